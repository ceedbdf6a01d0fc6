//! The dev broker's forwarding of a client's requests to the mock broker: each Kafka request
//! passed on whole, a Fetch's wait (`MaxWaitMs`) capped at [`MockKafka::FETCH_WAIT`].
//!
//! The mock answers a fetch that found nothing only when its wait has passed, even if records
//! arrive meanwhile; Apache Kafka answers as soon as they do. A consumer with librdkafka's
//! default wait (500 ms) would get each record up to 500 ms late from the dev broker, and the
//! wait is the client's setting: capped here, every client gets records within milliseconds,
//! as from Kafka, with its own settings.

use outbox_runtime::testing::MockKafka;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};

/// Fetch's API key.
const FETCH: i16 = 1;
/// The first version of Fetch with a flexible request header (tagged fields).
const FLEXIBLE_FROM: i16 = 12;
/// The last version of Fetch whose body starts with `ReplicaId`.
const REPLICA_ID_UNTIL: i16 = 14;
/// A request larger than this is not a client's: the connection is closed.
const MAX_REQUEST: usize = 256 * 1024 * 1024;

/// Passes `client`'s requests to `broker` until the client closes its side (then closes the
/// broker's), capping each Fetch's wait.
pub(super) async fn forward_requests(
    mut client: impl AsyncRead + Unpin,
    mut broker: impl AsyncWrite + Unpin,
) -> std::io::Result<()> {
    let cap = i32::try_from(MockKafka::FETCH_WAIT.as_millis()).unwrap_or(i32::MAX);
    let mut request = Vec::new();
    loop {
        let mut size = [0u8; 4];
        match client.read_exact(&mut size).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return broker.shutdown().await;
            }
            Err(e) => return Err(e),
        }
        let len = usize::try_from(i32::from_be_bytes(size))
            .ok()
            .filter(|&len| len <= MAX_REQUEST)
            .ok_or_else(|| std::io::Error::other("not a Kafka request"))?;
        request.resize(len, 0);
        client.read_exact(&mut request).await?;
        cap_fetch_wait(&mut request, cap);
        broker.write_all(&size).await?;
        broker.write_all(&request).await?;
    }
}

/// Caps the wait of a Fetch `request` (its bytes after the size) at `cap` ms. Any other
/// request, or one it cannot read, is left as it is.
pub(super) fn cap_fetch_wait(request: &mut [u8], cap: i32) {
    let Some(at) = max_wait_at(request) else {
        return;
    };
    let field = &mut request[at..at + 4];
    let wait = i32::from_be_bytes([field[0], field[1], field[2], field[3]]);
    if wait > cap {
        field.copy_from_slice(&cap.to_be_bytes());
    }
}

/// Where a Fetch request's `MaxWaitMs` is: after the request header (API key, version,
/// correlation id, client id; from version 12 its tagged fields) and, until version 14,
/// `ReplicaId`.
fn max_wait_at(request: &[u8]) -> Option<usize> {
    let i16_at = |at: usize| {
        Some(i16::from_be_bytes(
            request.get(at..at + 2)?.try_into().ok()?,
        ))
    };
    if i16_at(0)? != FETCH {
        return None;
    }
    let version = i16_at(2)?;
    // API key, version, correlation id; the client id (length -1: none).
    let mut at = 8;
    at += 2 + usize::try_from(i16_at(at)?).unwrap_or(0);
    if version >= FLEXIBLE_FROM {
        let (fields, n) = uvarint(request.get(at..)?)?;
        at += n;
        for _ in 0..fields {
            let (_tag, n) = uvarint(request.get(at..)?)?;
            at += n;
            let (size, n) = uvarint(request.get(at..)?)?;
            at += n + size;
        }
    }
    if version <= REPLICA_ID_UNTIL {
        at += 4;
    }
    request.get(at..at + 4)?;
    Some(at)
}

/// An unsigned varint (Kafka's tagged fields): its value and its length in bytes.
fn uvarint(bytes: &[u8]) -> Option<(usize, usize)> {
    let mut value = 0u64;
    for (i, b) in bytes.iter().enumerate().take(5) {
        value |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some((usize::try_from(value).ok()?, i + 1));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Fetch request of `version` with client id `client`, a tagged field in the header when
    /// flexible, waiting `wait` ms; the rest of its body a marker.
    fn fetch(version: i16, client: &str, wait: i32) -> Vec<u8> {
        let mut r = Vec::new();
        r.extend(FETCH.to_be_bytes());
        r.extend(version.to_be_bytes());
        r.extend(7i32.to_be_bytes());
        r.extend((client.len() as i16).to_be_bytes());
        r.extend(client.as_bytes());
        if version >= FLEXIBLE_FROM {
            // One tagged field: tag 0, 2 bytes.
            r.extend([1, 0, 2, 0xaa, 0xbb]);
        }
        if version <= REPLICA_ID_UNTIL {
            r.extend((-1i32).to_be_bytes());
        }
        r.extend(wait.to_be_bytes());
        r.extend([0xde, 0xad]);
        r
    }

    #[test]
    fn a_fetch_wait_is_capped_in_every_version() {
        for version in [4, 11, 12, 14, 15, 16] {
            let mut request = fetch(version, "rdkafka", 500);
            cap_fetch_wait(&mut request, 5);
            assert_eq!(request, fetch(version, "rdkafka", 5), "version {version}");
        }
    }

    #[test]
    fn a_shorter_wait_and_other_requests_are_left_alone() {
        let mut request = fetch(11, "", 2);
        cap_fetch_wait(&mut request, 5);
        assert_eq!(request, fetch(11, "", 2));
        // A Produce request (API key 0) of the same shape.
        let mut produce = fetch(11, "rdkafka", 500);
        produce[1] = 0;
        let before = produce.clone();
        cap_fetch_wait(&mut produce, 5);
        assert_eq!(produce, before);
        // Cut short: left as it is.
        let mut short = fetch(11, "rdkafka", 500);
        short.truncate(16);
        let before = short.clone();
        cap_fetch_wait(&mut short, 5);
        assert_eq!(short, before);
    }
}
