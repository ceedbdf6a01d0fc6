//! The dev broker's forwarding of a client's requests to the mock broker: each Kafka request
//! passed on whole, with two of the client's settings capped where the mock would otherwise
//! behave unlike Apache Kafka:
//!
//! - A Fetch's wait (`MaxWaitMs`), at [`MockKafka::FETCH_WAIT`]. The mock answers a fetch that
//!   found nothing only when its wait has passed, even if records arrive meanwhile; Apache
//!   Kafka answers as soon as they do. A consumer with librdkafka's default wait (500 ms) would
//!   get each record up to 500 ms late from the dev broker.
//! - A JoinGroup's session timeout, at [`MockKafka::SESSION_TIMEOUT`]. When a group's last member
//!   leaves, the mock keeps the group rebalancing for that member's session timeout (less a
//!   second) before it lets the next member in; Apache Kafka lets it in after its initial
//!   rebalance delay (3 s by default), as the mock does a group's first member. With
//!   librdkafka's default (45 s), a consumer restarted in development would read nothing for
//!   44 s. The mock also drops a member that has not heartbeated within the timeout: librdkafka
//!   heartbeats every 3 s by default, from a thread of its own.
//!
//! Both are the client's settings, so they are capped here, on the way: a client's shorter
//! settings are left alone. The one limit it sets: a client must heartbeat more often than
//! every 10 s (librdkafka's default is 3 s; a client that heartbeats from its processing loop
//! must not spend longer in a handler).

use outbox_runtime::testing::MockKafka;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};

/// Fetch's API key.
const FETCH: i16 = 1;
/// The first version of Fetch with a flexible request header (tagged fields).
const FETCH_FLEXIBLE_FROM: i16 = 12;
/// The versions of Fetch read: a later one, whose layout is not known here, passes untouched.
const FETCH_VERSIONS: std::ops::RangeInclusive<i16> = 0..=17;
/// The last version of Fetch whose body starts with `ReplicaId`.
const REPLICA_ID_UNTIL: i16 = 14;
/// JoinGroup's API key.
const JOIN_GROUP: i16 = 11;
/// The first version of JoinGroup with a flexible request header (and compact strings).
const JOIN_GROUP_FLEXIBLE_FROM: i16 = 6;
/// The versions of JoinGroup read, as for Fetch.
const JOIN_GROUP_VERSIONS: std::ops::RangeInclusive<i16> = 0..=9;
/// A request larger than this is not a client's: the connection is closed.
const MAX_REQUEST: usize = 256 * 1024 * 1024;

/// The caps [`cap`] applies, in milliseconds.
#[derive(Clone, Copy)]
pub(super) struct Caps {
    pub(super) fetch_wait: i32,
    pub(super) session_timeout: i32,
}

impl Caps {
    fn dev_broker() -> Caps {
        Caps {
            fetch_wait: millis(MockKafka::FETCH_WAIT),
            session_timeout: millis(MockKafka::SESSION_TIMEOUT),
        }
    }
}

fn millis(d: std::time::Duration) -> i32 {
    i32::try_from(d.as_millis()).unwrap_or(i32::MAX)
}

/// Passes `client`'s requests to `broker` until the client closes its side (then closes the
/// broker's), capping each Fetch's wait and each JoinGroup's session timeout.
pub(super) async fn forward_requests(
    mut client: impl AsyncRead + Unpin,
    mut broker: impl AsyncWrite + Unpin,
) -> std::io::Result<()> {
    let caps = Caps::dev_broker();
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
        cap(&mut request, caps);
        broker.write_all(&size).await?;
        broker.write_all(&request).await?;
    }
}

/// Caps the wait of a Fetch `request` (its bytes after the size) or the session timeout of a
/// JoinGroup one. Any other request, or one it cannot read, is left as it is.
pub(super) fn cap(request: &mut [u8], caps: Caps) {
    let Some((at, cap)) = capped_field(request, caps) else {
        return;
    };
    let field = &mut request[at..at + 4];
    let value = i32::from_be_bytes([field[0], field[1], field[2], field[3]]);
    if value > cap {
        field.copy_from_slice(&cap.to_be_bytes());
    }
}

/// Where the field to cap is, and its cap: a Fetch's `MaxWaitMs` (after, until version 14,
/// `ReplicaId`) or a JoinGroup's `SessionTimeoutMs` (after `GroupId`), each after the request
/// header (API key, version, correlation id, client id; in a flexible version its tagged
/// fields).
fn capped_field(request: &[u8], caps: Caps) -> Option<(usize, i32)> {
    let i16_at = |at: usize| {
        Some(i16::from_be_bytes(
            request.get(at..at + 2)?.try_into().ok()?,
        ))
    };
    let key = i16_at(0)?;
    let version = i16_at(2)?;
    let flexible = match key {
        FETCH if FETCH_VERSIONS.contains(&version) => version >= FETCH_FLEXIBLE_FROM,
        JOIN_GROUP if JOIN_GROUP_VERSIONS.contains(&version) => version >= JOIN_GROUP_FLEXIBLE_FROM,
        _ => return None,
    };
    // API key, version, correlation id; the client id (length -1: none).
    let mut at = 8;
    let client_id = match i16_at(at)? {
        -1 => 0,
        len => usize::try_from(len).ok()?,
    };
    at += 2 + client_id;
    if flexible {
        let (fields, n) = uvarint(request.get(at..)?)?;
        at += n;
        for _ in 0..fields {
            let (_tag, n) = uvarint(request.get(at..)?)?;
            at += n;
            let (size, n) = uvarint(request.get(at..)?)?;
            at = at.checked_add(n)?.checked_add(size)?;
        }
    }
    let cap = if key == FETCH {
        if version <= REPLICA_ID_UNTIL {
            at += 4;
        }
        caps.fetch_wait
    } else {
        // The group id: a compact string (its length plus one, a varint) when flexible.
        if flexible {
            let (len_plus_one, n) = uvarint(request.get(at..)?)?;
            at = at
                .checked_add(n)?
                .checked_add(len_plus_one.checked_sub(1)?)?;
        } else {
            at += 2 + usize::try_from(i16_at(at)?).ok()?;
        }
        caps.session_timeout
    };
    request.get(at..at + 4)?;
    Some((at, cap))
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

    const CAPS: Caps = Caps {
        fetch_wait: 5,
        session_timeout: 10_000,
    };

    /// A Fetch request of `version` with client id `client`, a tagged field in the header when
    /// flexible, waiting `wait` ms; the rest of its body a marker.
    fn fetch(version: i16, client: &str, wait: i32) -> Vec<u8> {
        let mut r = Vec::new();
        r.extend(FETCH.to_be_bytes());
        r.extend(version.to_be_bytes());
        r.extend(7i32.to_be_bytes());
        r.extend((client.len() as i16).to_be_bytes());
        r.extend(client.as_bytes());
        if version >= FETCH_FLEXIBLE_FROM {
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
            cap(&mut request, CAPS);
            assert_eq!(request, fetch(version, "rdkafka", 5), "version {version}");
        }
    }

    #[test]
    fn a_shorter_wait_and_other_requests_are_left_alone() {
        let mut request = fetch(11, "", 2);
        cap(&mut request, CAPS);
        assert_eq!(request, fetch(11, "", 2));
        // A Produce request (API key 0) of the same shape.
        let mut produce = fetch(11, "rdkafka", 500);
        produce[1] = 0;
        let before = produce.clone();
        cap(&mut produce, CAPS);
        assert_eq!(produce, before);
        // Cut short: left as it is.
        let mut short = fetch(11, "rdkafka", 500);
        short.truncate(16);
        let before = short.clone();
        cap(&mut short, CAPS);
        assert_eq!(short, before);
    }

    /// A JoinGroup request of `version` for group `group`, a tagged field in the header when
    /// flexible, with session timeout `timeout` ms; the rest of its body a marker.
    fn join_group(version: i16, group: &str, timeout: i32) -> Vec<u8> {
        let mut r = Vec::new();
        r.extend(JOIN_GROUP.to_be_bytes());
        r.extend(version.to_be_bytes());
        r.extend(9i32.to_be_bytes());
        r.extend(7i16.to_be_bytes());
        r.extend(b"rdkafka");
        if version >= JOIN_GROUP_FLEXIBLE_FROM {
            r.extend([1, 0, 2, 0xaa, 0xbb]);
            r.push(u8::try_from(group.len() + 1).unwrap());
        } else {
            r.extend((group.len() as i16).to_be_bytes());
        }
        r.extend(group.as_bytes());
        r.extend(timeout.to_be_bytes());
        r.extend([0xde, 0xad]);
        r
    }

    #[test]
    fn a_join_groups_session_timeout_is_capped_in_every_version() {
        for version in [0, 1, 5, 6, 9] {
            let mut request = join_group(version, "orders", 45_000);
            cap(&mut request, CAPS);
            assert_eq!(
                request,
                join_group(version, "orders", 10_000),
                "version {version}"
            );
            // A shorter one is left alone, and so is a request cut short.
            let mut short = join_group(version, "orders", 6_000);
            cap(&mut short, CAPS);
            assert_eq!(short, join_group(version, "orders", 6_000));
            // A version not known here, and a client id of a negative length, neither read.
            for (at, bytes) in [(2, 10i16.to_be_bytes()), (8, (-2i16).to_be_bytes())] {
                let mut odd = join_group(version, "orders", 45_000);
                odd[at..at + 2].copy_from_slice(&bytes);
                let before = odd.clone();
                cap(&mut odd, CAPS);
                assert_eq!(odd, before, "version {version}");
            }
            let mut cut = join_group(version, "orders", 45_000);
            cut.truncate(cut.len() - 5);
            let before = cut.clone();
            cap(&mut cut, CAPS);
            assert_eq!(cut, before, "version {version}");
        }
    }
}
