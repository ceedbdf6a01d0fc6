//! The account events of the relay tests, the relay they run, and what checks their delivery:
//! every event once at least, each key's events in outbox `id` order.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use outbox_runtime::relay::{Relay, RelayBuilder};
use outbox_runtime::{OutboxEvent, Uow};
use serde::Serialize;
use sqlx::PgPool;

use crate::kafka::{consume, Kafka, Received};

pub const TOPIC: &str = "account.events";
pub const PARTITIONS: i32 = 6;

#[derive(Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(
    topic = "account.events",
    aggregate_type = "Account",
    event_type = "Deposited"
)]
pub struct Deposited {
    #[outbox(aggregate_id)]
    pub account: String,
    /// Position of this event among its account's events.
    pub seq: u64,
    pub amount: i64,
    pub note: String,
}

/// A relay on `pool` publishing to `kafka`, quick to notice work and to retry: polling every
/// 100 ms, a 5 s publish timeout, retries backing off from 50 ms to 500 ms. A test that needs
/// other settings chains them.
pub fn relay_on(pool: &PgPool, kafka: &Kafka) -> RelayBuilder {
    Relay::builder(pool.clone())
        .brokers(kafka.bootstrap())
        .poll_interval(Duration::from_millis(100))
        .publish_timeout(Duration::from_secs(5))
        .retry_backoff(Duration::from_millis(50), Duration::from_millis(500))
}

pub fn deposit(account: usize, seq: u64) -> Deposited {
    Deposited {
        account: format!("acct-{account}"),
        seq,
        amount: seq as i64 * 10,
        note: "x".repeat(40),
    }
}

/// What emitters did, per event `(key, seq)`: committed, failed (nothing written), or of
/// unknown outcome (the connection broke after `COMMIT` was sent).
#[derive(Default, Debug)]
pub struct Emitted {
    pub committed: HashSet<(String, u64)>,
    pub failed: HashSet<(String, u64)>,
    pub unknown: HashSet<(String, u64)>,
}

impl Emitted {
    /// Emits `events` in one unit of work and records how it ended; `false` if it failed (the
    /// caller should not spin: the server may be away).
    pub async fn unit_of_work<DB: outbox_runtime::EmitDatabase>(
        &mut self,
        pool: &sqlx::Pool<DB>,
        events: &[Deposited],
    ) -> bool {
        let ids = events.iter().map(|e| (e.account.clone(), e.seq));
        let result = async {
            let mut uow = Uow::begin(pool).await?;
            uow.emit_all(events).await?;
            uow.commit().await
        }
        .await;
        match result {
            Ok(()) => self.committed.extend(ids),
            Err(e) if e.is_outcome_unknown() => self.unknown.extend(ids),
            Err(_) => {
                self.failed.extend(ids);
                return false;
            }
        }
        true
    }

    /// Adds what another emitter did.
    pub fn absorb(&mut self, other: Emitted) {
        self.committed.extend(other.committed);
        self.failed.extend(other.failed);
        self.unknown.extend(other.unknown);
    }
}

/// Emits `per_key` events for each of `keys` keys, `batch` events per transaction, keys
/// interleaved; returns how many.
pub async fn emit_events(pool: &PgPool, keys: usize, per_key: u64, batch: usize) -> usize {
    let events: Vec<Deposited> = (0..per_key)
        .flat_map(|seq| (0..keys).map(move |k| deposit(k, seq)))
        .collect();
    for chunk in events.chunks(batch) {
        let mut uow = Uow::begin(pool).await.unwrap();
        uow.emit_all(chunk).await.unwrap();
        uow.commit().await.unwrap();
    }
    events.len()
}

pub async fn consume_all(kafka: &Kafka, expected: usize, timeout: Duration) -> Vec<Received> {
    let mut seen = HashSet::new();
    consume(&kafka.bootstrap(), TOPIC, PARTITIONS, timeout, |r| {
        if let Some(last) = r.last() {
            seen.insert(last.header("event_id").to_owned());
        }
        seen.len() >= expected
    })
    .await
}

/// Checks every record against its outbox row and that each key's events arrived in `id`
/// order (first deliveries; a duplicate may come later). Returns the number of duplicates.
pub async fn check_delivery(pool: &PgPool, received: &[Received], expected: usize) -> usize {
    check_delivery_where(pool, received, expected, "true").await
}

/// [`check_delivery`] against the outbox rows `filter` picks (the others are another test's
/// fixture).
pub async fn check_delivery_where(
    pool: &PgPool,
    received: &[Received],
    expected: usize,
    filter: &str,
) -> usize {
    let rows: Vec<(i64, uuid::Uuid, String, String, serde_json::Value, i64)> =
        sqlx::query_as(&format!(
            "SELECT id, event_id, partition_key, aggregate_id, payload, \
                (extract(epoch FROM created_at) * 1000)::int8 FROM outbox_event WHERE {filter}"
        ))
        .fetch_all(pool)
        .await
        .unwrap();
    assert_eq!(rows.len(), expected);
    let by_id: HashMap<i64, _> = rows.iter().map(|r| (r.0, r)).collect();
    let mut first_seen: HashSet<i64> = HashSet::new();
    let mut last_id_of_key: HashMap<&str, i64> = HashMap::new();
    let mut duplicates = 0;
    for r in received {
        let id = r.outbox_id();
        let row = by_id
            .get(&id)
            .unwrap_or_else(|| panic!("record of unknown outbox id {id}"));
        assert_eq!(r.header("event_id"), row.1.to_string());
        assert_eq!(r.key, row.2);
        assert_eq!(r.header("aggregate_id"), row.3);
        assert_eq!(r.header("aggregate_type"), "Account");
        assert_eq!(r.header("event_type"), "Deposited");
        assert_eq!(r.header("content-type"), "application/json");
        assert_eq!(r.payload, row.4);
        assert_eq!(r.timestamp_ms, Some(row.5));
        if !first_seen.insert(id) {
            duplicates += 1;
            continue;
        }
        let last = last_id_of_key.entry(row.2.as_str()).or_insert(0);
        assert!(
            id > *last,
            "key {} went out of order: outbox id {id} after {}",
            row.2,
            *last
        );
        *last = id;
    }
    assert_eq!(first_seen.len(), expected, "every event arrived");
    duplicates
}

pub async fn wait_until_published(pool: &PgPool, timeout: Duration) {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let status = outbox_runtime::admin::status(pool)
            .await
            .unwrap()
            .outbox_total();
        if status.unpublished == 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still unpublished after {timeout:?}: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The steps of the consumer order tests: which account's event was handled in which order.
pub async fn create_steps(pool: &PgPool) {
    sqlx::query(
        "CREATE TABLE steps (n bigserial PRIMARY KEY, account text NOT NULL, seq bigint NOT NULL)",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// Records the step; slowly for a few of account 0's (a slow call), so that a batch holding one
/// of them takes long enough for later events of the account to reach another consumer.
#[outbox_runtime::inbox_handler]
pub async fn record_step(
    event: Deposited,
    tx: &mut sqlx::PgConnection,
) -> Result<(), outbox_runtime::inbox::HandlerError> {
    if event.account == "acct-0" && event.seq.is_multiple_of(10) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    insert_step(tx, &event).await
}

/// The attempt (`MessageMeta::attempt`) at which [`record_step_and_attempt`] and its MariaDB
/// twin last handled each event, by event id.
pub static ATTEMPTS: std::sync::Mutex<std::collections::BTreeMap<uuid::Uuid, u32>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

/// [`record_step`] (without its slow steps), noting the attempt in [`ATTEMPTS`].
#[outbox_runtime::inbox_handler]
pub async fn record_step_and_attempt(
    event: Deposited,
    tx: &mut sqlx::PgConnection,
    meta: &outbox_runtime::inbox::MessageMeta<'_>,
) -> Result<(), outbox_runtime::inbox::HandlerError> {
    insert_step(tx, &event).await?;
    ATTEMPTS
        .lock()
        .unwrap()
        .insert(meta.event_id(), meta.attempt());
    Ok(())
}

/// Records the step of `event` in `steps`, in the handler's transaction.
pub async fn insert_step(
    tx: &mut sqlx::PgConnection,
    event: &Deposited,
) -> Result<(), outbox_runtime::inbox::HandlerError> {
    sqlx::query("INSERT INTO steps (account, seq) VALUES ($1, $2)")
        .bind(&event.account)
        .bind(event.seq as i64)
        .execute(tx)
        .await?;
    Ok(())
}

/// Events `0..seqs` of `accounts` accounts, interleaved (every account's first, then every
/// account's second, ...), as records the relay would send, each with an id of its own.
pub fn interleaved(accounts: usize, seqs: u64) -> Vec<crate::kafka::Outgoing> {
    (0..seqs)
        .flat_map(|seq| (0..accounts).map(move |account| deposit(account, seq)))
        .map(|event| crate::kafka::Outgoing::event(&event, uuid::Uuid::now_v7()))
        .collect()
}

/// Each account's steps, in the order they were handled.
pub async fn steps(pool: &PgPool) -> std::collections::BTreeMap<String, Vec<i64>> {
    let rows: Vec<(String, i64)> = sqlx::query_as("SELECT account, seq FROM steps ORDER BY n")
        .fetch_all(pool)
        .await
        .unwrap();
    let mut by_account = std::collections::BTreeMap::<String, Vec<i64>>::new();
    for (account, seq) in rows {
        by_account.entry(account).or_default().push(seq);
    }
    by_account
}
