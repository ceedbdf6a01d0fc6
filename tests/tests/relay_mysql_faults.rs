//! The relay on a MariaDB server of the test's own, killed with SIGKILL under load and started
//! again: no committed event lost, none that failed published, each key's order kept; and a
//! read-only server (a replica) refused with what to do.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_runtime::relay::{Relay, RelayBuilder};
use outbox_runtime::Uow;
use outbox_tests::deposits::{consume_all, deposit, Deposited, PARTITIONS, TOPIC};
use outbox_tests::kafka::Kafka;
use outbox_tests::mysql::{check_delivery, count_when_up, MariaDbServer};
use outbox_tests::Running;
use sqlx::MySqlPool;

fn relay(pool: &MySqlPool, kafka: &Kafka) -> RelayBuilder {
    Relay::builder(pool.clone())
        .brokers(kafka.bootstrap())
        .poll_interval(Duration::from_millis(100))
        .publish_timeout(Duration::from_secs(2))
        .failover_timeout(Duration::from_secs(5))
        .retry_backoff(Duration::from_millis(50), Duration::from_millis(500))
}

/// What the writers did, per event `(key, seq)`.
#[derive(Default)]
struct Outcomes {
    committed: HashSet<(String, u64)>,
    failed: HashSet<(String, u64)>,
    unknown: HashSet<(String, u64)>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_killed_under_load_loses_nothing_and_keeps_each_keys_order() {
    let mut server = MariaDbServer::start().await;
    let pool = server.database("outbox_fault", 16).await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;

    // A replica's (a read-only server's) relay would take shards of its own: refused.
    sqlx::query("SET GLOBAL read_only = 1")
        .execute(&pool)
        .await
        .unwrap();
    let e = relay(&pool, &kafka)
        .build()
        .unwrap()
        .publish_pending()
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("read-only") && e.contains("primary"), "{e}");
    sqlx::query("SET GLOBAL read_only = 0")
        .execute(&pool)
        .await
        .unwrap();

    let relays: Vec<_> = (0..2)
        .map(|_| Running::relay(&relay(&pool, &kafka).batch_size(50).build().unwrap()))
        .collect();
    let outcomes = Arc::new(Mutex::new(Outcomes::default()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Four writers, each its own ten keys, one unit of work per round with an event of each,
    // until told to stop.
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let (pool, outcomes, stop) = (pool.clone(), Arc::clone(&outcomes), Arc::clone(&stop));
            tokio::spawn(async move {
                for seq in 0.. {
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        break;
                    }
                    let events: Vec<Deposited> =
                        (0..10).map(|k| deposit(w * 10 + k, seq)).collect();
                    let result = async {
                        let mut uow = Uow::begin(&pool).await?;
                        uow.emit_all(&events).await?;
                        uow.commit().await
                    }
                    .await;
                    {
                        let mut o = outcomes.lock().unwrap();
                        let set = match &result {
                            Ok(()) => &mut o.committed,
                            Err(e) if e.is_outcome_unknown() => &mut o.unknown,
                            Err(_) => &mut o.failed,
                        };
                        set.extend(events.iter().map(|e| (e.account.clone(), e.seq)));
                    }
                    let pause = if result.is_ok() { 10 } else { 100 };
                    tokio::time::sleep(Duration::from_millis(pause)).await;
                }
            })
        })
        .collect();
    // Once the relays publish, the server dies mid-stream and comes back a second later.
    let published = "SELECT COUNT(*) FROM outbox_event WHERE published_at IS NOT NULL";
    while count_when_up(&pool, published).await < 300 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.kill();
    tokio::time::sleep(Duration::from_secs(1)).await;
    server.restart().await;
    // The writers go on until 400 more events committed after the restart.
    let committed = || outcomes.lock().unwrap().committed.len();
    let before = committed();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while committed() < before + 400 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "writes never resumed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for w in writers {
        w.await.unwrap();
    }
    let unpublished = "SELECT COUNT(*) FROM outbox_event WHERE published_at IS NULL";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    while count_when_up(&pool, unpublished).await > 0 {
        assert!(tokio::time::Instant::now() < deadline, "never drained");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let stored: Vec<(String, String)> = sqlx::query_as(
        "SELECT CAST(partition_key AS CHAR), CAST(payload AS CHAR) FROM outbox_event",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let stored: HashSet<(String, u64)> = stored
        .into_iter()
        .map(|(key, payload)| {
            let payload: serde_json::Value = serde_json::from_str(&payload).unwrap();
            (key, payload["seq"].as_u64().unwrap())
        })
        .collect();
    let o = std::mem::take(&mut *outcomes.lock().unwrap());
    // (A writer between units of work when the server dies waits for a connection and goes on:
    // not every kill fails one.)
    let lost: Vec<_> = o.committed.difference(&stored).collect();
    assert!(lost.is_empty(), "committed but not in the outbox: {lost:?}");
    let phantoms: Vec<_> = o.failed.intersection(&stored).collect();
    assert!(
        phantoms.is_empty(),
        "failed but in the outbox: {phantoms:?}"
    );
    let n = stored.len();
    let received = consume_all(&kafka, n, Duration::from_secs(60)).await;
    let duplicates = check_delivery(&pool, &received, n).await;
    println!(
        "MariaDB killed under load: {} committed, {} failed, {} of unknown outcome; {n} in the \
         outbox, all delivered in each key's order, {duplicates} duplicates",
        o.committed.len(),
        o.failed.len(),
        o.unknown.len()
    );
    Running::stop_all(relays).await;
}
