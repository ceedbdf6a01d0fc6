//! Operator tools and what they cost the relay, side by side in one run:
//!
//! 1. the relay's database work (claim + mark, no Kafka) with and without the retention index
//!    on `published_at` (migration 6), on two databases, alternating;
//! 2. `Cleanup` deleting published rows, batches of 10,000;
//! 3. `Replay` publishing stored events to the mock cluster, beside the relay publishing the
//!    same rows (`publish_pending`, one instance) as the yardstick.
//!
//! `cargo bench -p outbox-tests --bench admin` (N=50000 ROUNDS=3).

use std::time::Instant;

use outbox_runtime::admin::{Cleanup, CleanupTable, Replay, ReplayFilter};
use outbox_runtime::relay;
use outbox_tests::bench::{env, median, rate};
use outbox_tests::kafka::Kafka;
use outbox_tests::TestDb;
use sqlx::PgPool;

const TOPIC: &str = "bench.events";

async fn write_rows(pool: &PgPool, n: u64) {
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, \
             topic, partition_key) \
         SELECT gen_random_uuid(), 'Account', 'k-' || (i % 1000), 'Deposited', \
             jsonb_build_object('seq', i, 'amount', i * 10, 'note', repeat('x', 40)), $1, \
             'k-' || (i % 1000) \
         FROM generate_series(1, $2::int8) AS i",
    )
    .bind(TOPIC)
    .bind(n as i64)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE outbox_event")
        .execute(pool)
        .await
        .unwrap();
}

async fn drain_rate(pool: &PgPool, n: u64) -> f64 {
    write_rows(pool, n).await;
    let t = Instant::now();
    assert_eq!(
        relay::drain_without_broker(pool.clone(), 500)
            .await
            .unwrap(),
        n
    );
    rate(n, t.elapsed())
}

/// Deletes the `n` published rows (all of them) with the retention job.
async fn clean(pool: &PgPool, n: u64) {
    let cleanup = Cleanup::new(pool.clone(), std::time::Duration::ZERO);
    let cutoff = cleanup.cutoff().await.unwrap();
    let deleted = cleanup
        .run(CleanupTable::Outbox, cutoff, |_| {})
        .await
        .unwrap();
    assert_eq!(deleted, n);
}

#[tokio::main]
async fn main() {
    let n: u64 = env("N", 50_000);
    let rounds: usize = env("ROUNDS", 3);
    let with = TestDb::new().await;
    let without = TestDb::new().await;
    sqlx::query("DROP INDEX ix_outbox_event_published_at")
        .execute(&without.pool)
        .await
        .unwrap();
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, 12).await;
    let replay = Replay::new(with.pool.clone(), &kafka.bootstrap()).unwrap();
    let relay = relay::Relay::builder(with.pool.clone())
        .brokers(kafka.bootstrap())
        .build()
        .unwrap();

    let (mut on, mut off, mut cleaned, mut replayed, mut relayed) =
        (vec![], vec![], vec![], vec![], vec![]);
    for round in 0..rounds {
        // Alternate which goes first.
        let (a, b) = if round % 2 == 0 {
            let a = drain_rate(&with.pool, n).await;
            (a, drain_rate(&without.pool, n).await)
        } else {
            let b = drain_rate(&without.pool, n).await;
            (drain_rate(&with.pool, n).await, b)
        };
        on.push(a);
        off.push(b);
        clean(&without.pool, n).await;
        clean(&with.pool, n).await;

        write_rows(&with.pool, n).await;
        let t = Instant::now();
        assert_eq!(relay.publish_pending().await.unwrap(), n);
        relayed.push(rate(n, t.elapsed()));
        let t = Instant::now();
        let sent = replay
            .run(&ReplayFilter::topic(TOPIC), None, |_| {})
            .await
            .unwrap();
        assert_eq!((sent.published, sent.unpublished), (n, 0));
        replayed.push(rate(n, t.elapsed()));

        let t = Instant::now();
        clean(&with.pool, n).await;
        cleaned.push(rate(n, t.elapsed()));
        println!(
            "round {round}: claim+mark with the retention index {a:.0}/s, without {b:.0}/s; \
             relay {:.0}/s, replay {:.0}/s; cleanup {:.0}/s",
            relayed[round], replayed[round], cleaned[round]
        );
    }
    let (a, b) = (median(on), median(off));
    println!(
        "median of {rounds} rounds, {n} rows: claim+mark with index {a:.0}/s, without {b:.0}/s \
         (with/without = {:.3}); relay {:.0}/s, replay {:.0}/s; cleanup {:.0}/s",
        a / b,
        median(relayed),
        median(replayed),
        median(cleaned)
    );
}
