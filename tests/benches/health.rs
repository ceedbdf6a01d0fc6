//! What a health check costs, on tables of a service that has run for a while: `status` (the
//! backlog figures alone, the yardstick), `health` as `outbox status` runs it (`processed_event`
//! counted), and as a running relay runs it every 30 s (`processed_event` estimated from the
//! statistics). Alternating, medians of ROUNDS rounds of REPEAT calls each.
//!
//! `cargo bench -p outbox-tests --bench health` (PUBLISHED=1000000 PROCESSED=2000000
//! UNPUBLISHED=1000 ROUNDS=5 REPEAT=5).

use std::time::Instant;

use outbox_runtime::admin::{health, health_estimated, status, HealthThresholds};
use outbox_tests::bench::{env, median};
use outbox_tests::TestDb;

#[tokio::main]
async fn main() {
    let published: i64 = env("PUBLISHED", 1_000_000);
    let processed: i64 = env("PROCESSED", 2_000_000);
    let unpublished: i64 = env("UNPUBLISHED", 1_000);
    let rounds: usize = env("ROUNDS", 5);
    let repeat: usize = env("REPEAT", 5);
    let db = TestDb::new().await;
    let pool = &db.pool;
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, \
             topic, partition_key, created_at, published_at) \
         SELECT gen_random_uuid(), 'Account', 'k-' || (i % 1000), 'Deposited', \
             jsonb_build_object('seq', i, 'note', repeat('x', 40)), 'bench.events', \
             'k-' || (i % 1000), now() - interval '1 hour', \
             CASE WHEN i > $2 THEN now() - interval '30 minutes' END \
         FROM generate_series(1, $1 + $2) AS i",
    )
    .bind(published)
    .bind(unpublished)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO processed_event (event_id, handler) \
         SELECT gen_random_uuid(), 'g/h' FROM generate_series(1, $1)",
    )
    .bind(processed)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("VACUUM ANALYZE outbox_event, processed_event")
        .execute(pool)
        .await
        .unwrap();
    let thresholds = HealthThresholds::default();

    let (mut s, mut counted, mut estimated) = (vec![], vec![], vec![]);
    let ms = |t: Instant| t.elapsed().as_secs_f64() * 1_000.0 / repeat as f64;
    for round in 0..rounds {
        let mut order = [0, 1, 2];
        order.rotate_left(round % 3);
        for which in order {
            let t = Instant::now();
            for _ in 0..repeat {
                match which {
                    0 => {
                        status(pool).await.unwrap();
                    }
                    1 => {
                        health(pool, &thresholds).await.unwrap();
                    }
                    _ => {
                        health_estimated(pool, &thresholds).await.unwrap();
                    }
                }
            }
            [&mut s, &mut counted, &mut estimated][which].push(ms(t));
        }
        println!(
            "round {round}: status {:.1} ms, health (counted) {:.1} ms, health (estimated) {:.1} ms",
            s[round], counted[round], estimated[round]
        );
    }
    let (s, c, e) = (median(s), median(counted), median(estimated));
    println!(
        "median of {rounds} rounds ({published} published, {unpublished} unpublished, {processed} \
         processed_event rows): status {s:.1} ms, health as `outbox status` runs it {c:.1} ms \
         ({:.2}x status), as the relay runs it {e:.1} ms ({:.3}x status)",
        c / s,
        e / s
    );
}
