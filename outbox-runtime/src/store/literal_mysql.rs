//! Values written into MariaDB/MySQL statements as literals, for the multi-statement text
//! queries that run a round trip of several statements (no placeholders there): hexadecimal,
//! so exact whatever `sql_mode` and the connection's character set say.

/// Text as a hexadecimal literal in utf8mb4.
pub(crate) fn push_text(sql: &mut String, value: &str) {
    sql.push_str("_utf8mb4 X'");
    push_hex(sql, value.as_bytes());
    sql.push('\'');
}

/// Bytes as hexadecimal digits (inside `X'...'`, which the caller writes).
pub(crate) fn push_hex(sql: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789ABCDEF";
    sql.reserve(2 * bytes.len());
    for &b in bytes {
        sql.push(char::from(DIGITS[usize::from(b >> 4)]));
        sql.push(char::from(DIGITS[usize::from(b & 0xF)]));
    }
}
