//! Writing outbox rows: through `outbox_emit`, with bound arrays (a flush, an
//! application-managed transaction) or as literals riding the commit's simple query; and the
//! emit functions for application-managed transactions.

use std::borrow::Cow;
use std::future::Future;
use std::pin::Pin;

use sqlx::PgConnection;
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::event::{IntoRecord, OutboxEvent, OutboxRecord};

/// One call for any number of rows. `outbox_emit` (`migrations/README.md` says which file
/// holds its current definition) takes a transaction-scoped advisory lock on the hash of each
/// partition key, so that one key's rows commit in `id` order (the relay's per-key ordering
/// relies on it), inserts the rows in the order given, and wakes waiting relays.
const EMIT_SQL: &str = "SELECT outbox_emit($1::uuid[], $2::text[], $3::text[], $4::text[], \
                        $5::text[], $6::text[], $7::text[])";
/// The same with the rows' headers, when one of them has any (emits without headers keep the
/// statement above, and its cost).
const EMIT_WITH_HEADERS_SQL: &str = "SELECT outbox_emit($1::uuid[], $2::text[], $3::text[], \
                                     $4::text[], $5::text[], $6::text[], $7::text[], $8::text[])";

/// Inserts one event into the outbox on a connection the application manages, e.g.
/// `emit(&mut tx, &event)` with `tx: sqlx::Transaction<'_, Postgres>`.
///
/// The row commits with that connection's transaction. On a connection outside a transaction it
/// commits at once, alone: use a [`Uow`](crate::Uow) or a transaction to keep it atomic with domain writes.
pub fn emit<'c, E: OutboxEvent + ?Sized>(
    conn: &'c mut PgConnection,
    event: &E,
) -> EmitFuture<'c, Uuid> {
    let record = OutboxRecord::from_event(event);
    Box::pin(async move { Ok(insert(conn, &[record?]).await?[0]) })
}

/// [`emit`] with the application's headers; see [`Uow::emit_with`](crate::Uow::emit_with).
pub fn emit_with<'c, E, I, K, V>(
    conn: &'c mut PgConnection,
    event: &E,
    headers: I,
) -> EmitFuture<'c, Uuid>
where
    E: OutboxEvent + ?Sized,
    I: IntoIterator<Item = (K, V)>,
    K: Into<String>,
    V: Into<String>,
{
    let record = OutboxRecord::from_event(event).and_then(|r| r.with_headers(headers));
    Box::pin(async move { Ok(insert(conn, &[record?]).await?[0]) })
}

/// Inserts many events with one statement on a connection the application manages; see [`emit`].
pub fn emit_all<I>(conn: &mut PgConnection, events: I) -> EmitFuture<'_, Vec<Uuid>>
where
    I: IntoIterator,
    I::Item: IntoRecord,
{
    let records = into_records(events);
    Box::pin(async move { insert(conn, &records?).await })
}

/// What the emit functions return: the insert, still to be awaited.
pub type EmitFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T>> + Send + 'a>>;

pub(crate) fn into_records<I>(events: I) -> Result<Vec<OutboxRecord>>
where
    I: IntoIterator,
    I::Item: IntoRecord,
{
    events.into_iter().map(IntoRecord::into_record).collect()
}

/// The event type(s) of a batch, for error messages.
pub(crate) fn event_types(records: &[OutboxRecord]) -> Cow<'static, str> {
    if records.is_empty() {
        return Cow::Borrowed("");
    }
    let mut types: Vec<&str> = records.iter().map(|r| r.event_type()).collect();
    types.sort_unstable();
    types.dedup();
    match records.first() {
        Some(first) if types.len() == 1 => first.event_type.clone(),
        _ => types.join("`, `").into(),
    }
}

pub(super) async fn insert(conn: &mut PgConnection, records: &[OutboxRecord]) -> Result<Vec<Uuid>> {
    if records.is_empty() {
        return Ok(Vec::new());
    }
    let n = records.len();
    let mut ids = Vec::with_capacity(n);
    let mut aggregate_types = Vec::with_capacity(n);
    let mut aggregate_ids = Vec::with_capacity(n);
    let mut event_types_col = Vec::with_capacity(n);
    let mut payloads = Vec::with_capacity(n);
    let mut topics = Vec::with_capacity(n);
    let mut keys = Vec::with_capacity(n);
    for r in records {
        ids.push(r.event_id);
        aggregate_types.push(r.aggregate_type());
        aggregate_ids.push(r.aggregate_id());
        event_types_col.push(r.event_type());
        payloads.push(r.payload());
        topics.push(r.topic());
        keys.push(r.partition_key());
    }
    let with_headers = records.iter().any(OutboxRecord::has_stored_headers);
    let headers: Vec<String> = if with_headers {
        records.iter().map(OutboxRecord::headers_json).collect()
    } else {
        Vec::new()
    };
    let query = sqlx::query(if with_headers {
        EMIT_WITH_HEADERS_SQL
    } else {
        EMIT_SQL
    })
    .bind(&ids)
    .bind(&aggregate_types)
    .bind(&aggregate_ids)
    .bind(&event_types_col)
    .bind(&payloads)
    .bind(&topics)
    .bind(&keys);
    let query = if with_headers {
        query.bind(&headers)
    } else {
        query
    };
    query.execute(conn).await.map_err(|source| Error::Emit {
        event_type: event_types(records),
        source,
    })?;
    Ok(ids)
}

/// `SELECT outbox_emit(ARRAY[...], ...)` with every value as a literal, for the
/// one-round-trip commit (a simple query carries no parameters).
///
/// Strings are written as `E'...'` literals with every backslash and quote escaped, which is
/// exact whatever `standard_conforming_strings` says; sqlx always talks UTF-8; a NUL character,
/// which no PostgreSQL text can hold, is refused before anything is sent.
pub(super) fn literal_emit(records: &[OutboxRecord]) -> Result<String> {
    let size: usize = records.iter().map(|r| r.payload.len() + 250).sum();
    let mut sql = String::with_capacity(size + 128);
    sql.push_str("SELECT outbox_emit(ARRAY[");
    let mut buf = Uuid::encode_buffer();
    for (i, r) in records.iter().enumerate() {
        if i > 0 {
            sql.push_str(", ");
        }
        sql.push('\'');
        sql.push_str(r.event_id.hyphenated().encode_lower(&mut buf));
        sql.push('\'');
    }
    sql.push_str("]::uuid[]");
    let columns: [fn(&OutboxRecord) -> &str; 6] = [
        OutboxRecord::aggregate_type,
        OutboxRecord::aggregate_id,
        OutboxRecord::event_type,
        OutboxRecord::payload,
        OutboxRecord::topic,
        OutboxRecord::partition_key,
    ];
    for column in columns {
        sql.push_str(", ARRAY[");
        for (i, r) in records.iter().enumerate() {
            if i > 0 {
                sql.push_str(", ");
            }
            push_literal(&mut sql, column(r)).map_err(|()| nul_error(r))?;
        }
        sql.push_str("]::text[]");
    }
    // The headers, only when a row has some (else the 7-argument `outbox_emit`).
    if records.iter().any(OutboxRecord::has_stored_headers) {
        sql.push_str(", ARRAY[");
        for (i, r) in records.iter().enumerate() {
            if i > 0 {
                sql.push_str(", ");
            }
            push_literal(&mut sql, &r.headers_json()).map_err(|()| nul_error(r))?;
        }
        sql.push_str("]::text[]");
    }
    sql.push(')');
    Ok(sql)
}

fn nul_error(r: &OutboxRecord) -> Error {
    Error::InvalidEvent {
        event_type: r.event_type.clone(),
        reason: "contains a NUL character, which PostgreSQL text cannot store".into(),
    }
}

fn push_literal(sql: &mut String, value: &str) -> Result<(), ()> {
    sql.push_str("E'");
    for c in value.chars() {
        match c {
            '\'' => sql.push_str("''"),
            '\\' => sql.push_str("\\\\"),
            '\0' => return Err(()),
            c => sql.push(c),
        }
    }
    sql.push('\'');
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::push_literal;

    fn literal(value: &str) -> String {
        let mut sql = String::new();
        push_literal(&mut sql, value).unwrap();
        sql
    }

    #[test]
    fn literals_escape_quotes_and_backslashes() {
        assert_eq!(literal("plain"), "E'plain'");
        assert_eq!(literal("it's"), "E'it''s'");
        assert_eq!(literal(r"a\b"), r"E'a\\b'");
        assert_eq!(
            literal(r"\'); DROP TABLE x; --"),
            r"E'\\''); DROP TABLE x; --'"
        );
        assert_eq!(literal("ключ ✓"), "E'ключ ✓'");
        assert!(push_literal(&mut String::new(), "a\0b").is_err());
    }
}
