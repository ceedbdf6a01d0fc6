//! The PostgreSQL server restarts under load (`pg_ctlcluster ... restart`): nothing committed is
//! lost, no key goes out of order, each message takes effect once, and the relays and
//! consumers recover by themselves.
//!
//! Run alone (it breaks every connection to the server): `cargo test -p outbox-tests --test
//! pg_restart`, as `.ci/run` does after the other tests.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use outbox_runtime::inbox::Mode;
use outbox_runtime::relay::Relay;
use outbox_tests::deposits::{deposit, wait_until_published, Emitted, PARTITIONS, TOPIC};
use outbox_tests::fixtures::{self, PAYMENTS};
use outbox_tests::kafka::{committed_total, consume, Kafka};
use outbox_tests::payments::{self, orders_with_payments, paid_counts, wait_for};
use outbox_tests::{restart_postgres, Running, TestDb};

/// Emits units of work of 1 to 3 events over keys of its own until `stop`, numbering each key's
/// events; a failed unit of work is counted, not retried (its numbers are simply skipped).
async fn emitter(pool: sqlx::PgPool, task: usize, keys: usize, stop: Arc<AtomicBool>) -> Emitted {
    let mut emitted = Emitted::default();
    let mut seq = vec![0u64; keys];
    let mut i = 0usize;
    while !stop.load(Ordering::SeqCst) {
        let k = i % keys;
        let account = task * keys + k;
        let n = 1 + (i % 3) as u64;
        let events: Vec<_> = (0..n).map(|j| deposit(account, seq[k] + j)).collect();
        seq[k] += n;
        i += 1;
        if !emitted.unit_of_work(&pool, &events).await {
            // The server is away: do not spin.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    emitted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_recover_from_a_postgres_restart_and_lose_nothing() {
    let db = TestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    let pool = db.pool(12).await;
    let relays: Vec<_> = (0..3)
        .map(|_| {
            Running::relay(
                &Relay::builder(pool.clone())
                    .brokers(kafka.bootstrap())
                    .poll_interval(Duration::from_millis(100))
                    .retry_backoff(Duration::from_millis(100), Duration::from_millis(500))
                    .build()
                    .unwrap(),
            )
        })
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let emitters: Vec<_> = (0..4)
        .map(|t| tokio::spawn(emitter(pool.clone(), t, 25, stop.clone())))
        .collect();

    // Let it run, restart the server mid-stream, let it run again.
    let published = |pool: sqlx::PgPool| async move {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM outbox_event WHERE published_at IS NOT NULL",
        )
        .fetch_one(&pool)
        .await
        .unwrap_or(0)
    };
    while published(db.pool.clone()).await < 500 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    restart_postgres().await;
    let after_restart = published(db.pool.clone()).await;
    while published(db.pool.clone()).await < after_restart + 500 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::SeqCst);
    let mut emitted = Emitted::default();
    for e in emitters {
        emitted.absorb(e.await.unwrap());
    }
    // The relays were not restarted: they drain everything by themselves.
    wait_until_published(&db.pool, Duration::from_secs(60)).await;

    let (committed, failed) = (&emitted.committed, &emitted.failed);
    let received = consume(
        &kafka.bootstrap(),
        TOPIC,
        PARTITIONS,
        Duration::from_secs(60),
        |r| {
            let seen: HashSet<(String, u64)> = r
                .iter()
                .map(|m| (m.key.clone(), m.payload["seq"].as_u64().unwrap()))
                .collect();
            committed.is_subset(&seen)
        },
    )
    .await;
    let mut first: HashSet<(String, u64)> = HashSet::new();
    let mut last: HashMap<String, u64> = HashMap::new();
    let mut duplicates = 0;
    for r in &received {
        let id = (r.key.clone(), r.payload["seq"].as_u64().unwrap());
        assert!(
            !failed.contains(&id),
            "{id:?} failed to commit but reached the broker"
        );
        if !first.insert(id.clone()) {
            duplicates += 1;
            continue;
        }
        if let Some(prev) = last.insert(id.0.clone(), id.1) {
            assert!(
                prev < id.1,
                "key {} out of order: {} after {prev}",
                id.0,
                id.1
            );
        }
    }
    let lost: Vec<_> = committed.difference(&first).collect();
    println!(
        "postgres restart: {} committed, {} failed, {} unknown outcome, {} received, {} lost, \
         {duplicates} duplicates",
        committed.len(),
        failed.len(),
        emitted.unknown.len(),
        first.len(),
        lost.len()
    );
    // Whether a unit of work was in flight when the server went down is timing (the emitters
    // wait in the pool while it is down): `restart_postgres` checks the restart itself.
    assert!(lost.is_empty(), "lost: {lost:?}");
    Running::stop_all(relays).await;
}

/// A dedup consumer and an inbox consumer (two processors) handle a stream of payments while
/// the server restarts: each payment takes effect once in each, nothing is dead-lettered or
/// dead, and neither consumer needed restarting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_recover_from_a_postgres_restart_with_each_effect_once() {
    const N: usize = 2000;
    let (db, kafka) = payments::setup().await;
    fixtures::create_ledger(&db.pool).await;
    let all = orders_with_payments(&db.pool, N).await;
    let consumer = |group: &str, mode: Mode| {
        let builder = payments::builder(&db, &kafka, group).mode(mode);
        let builder = match mode {
            Mode::Dedup => builder.handler(fixtures::mark_order_paid),
            _ => builder.handler(fixtures::record_payment).processors(2),
        };
        builder.build().unwrap()
    };
    let dedup = Running::consumer(&consumer("dedup-svc", Mode::Dedup));
    let inbox = Running::consumer(&consumer("inbox-svc", Mode::Inbox));

    // The payments arrive over a few seconds; the server restarts once a quarter are applied.
    let producer = {
        let kafka_bootstrap = kafka.bootstrap();
        let all = all.clone();
        tokio::spawn(async move {
            for chunk in all.chunks(50) {
                outbox_tests::kafka::produce(&kafka_bootstrap, PAYMENTS, &payments::records(chunk))
                    .await;
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        })
    };
    let applied = |pool: sqlx::PgPool| async move {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM ledger")
            .fetch_one(&pool)
            .await
            .unwrap_or(0)
    };
    wait_for("a quarter applied", Duration::from_secs(60), || async {
        applied(db.pool.clone()).await >= (N / 4) as i64
    })
    .await;
    restart_postgres().await;
    producer.await.unwrap();
    wait_for(
        "every payment applied by both",
        Duration::from_secs(120),
        || async {
            applied(db.pool.clone()).await == N as i64
                && paid_counts(&db.pool).await.iter().sum::<i32>() == N as i32
        },
    )
    .await;
    for group in ["dedup-svc", "inbox-svc"] {
        wait_for(group, Duration::from_secs(60), || async {
            committed_total(&kafka.bootstrap(), group, PAYMENTS, payments::PARTITIONS) == N as i64
        })
        .await;
    }
    assert!(
        !dedup.is_finished() && !inbox.is_finished(),
        "both consumers still run"
    );
    Running::stop_all([dedup, inbox]).await;

    assert_eq!(
        paid_counts(&db.pool).await,
        vec![1; N],
        "dedup: each effect once"
    );
    let (rows, dead, unprocessed): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE dead_at IS NOT NULL), \
                count(*) FILTER (WHERE NOT processed) FROM inbox_event",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (rows, dead, unprocessed),
        (N as i64, 0, 0),
        "inbox: each row once, none dead"
    );
    let dead_letters = consume(
        &kafka.bootstrap(),
        &format!("{PAYMENTS}.dlq"),
        1,
        Duration::from_secs(1),
        |r| !r.is_empty(),
    )
    .await;
    assert!(
        dead_letters.is_empty(),
        "dead letters: {}",
        dead_letters.len()
    );
}
