//! `processed_event` in time partitions: deduplication holds across a partition boundary (a
//! redelivery after its first receipt's partition rolled over; the same message in two
//! consumers at once, their rows in different partitions; a retried copy beside its
//! redelivered original), partitions are created and dropped
//! while consumers insert, a consumer creates the partition it finds missing, an installation
//! from before converts while a consumer runs, and the health check reports partitions not
//! created ahead or not dropped.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_runtime::admin::{
    self, CleanupTable, Conversion, HealthThresholds, Retention, WarningKind,
};
use outbox_runtime::inbox::{HandlerError, MessageMeta};
use outbox_runtime::inbox_handler;
use outbox_runtime::testing::{self, Delivery};
use outbox_tests::fixtures::{self, PaymentSucceeded, PAYMENTS};
use outbox_tests::kafka::{committed_total, produce, produce_at, Kafka, Outgoing};
use outbox_tests::payments::PARTITIONS;
use outbox_tests::payments::{builder, orders_with_payments, paid_counts, records, wait_for};
use outbox_tests::{count, Running, TestDb};
use sqlx::postgres::PgConnectOptions;
use sqlx::{PgConnection, PgPool};
use tokio::sync::Semaphore;
use uuid::Uuid;

/// The payments' topics on a fresh mock cluster, and the orders table in `db`.
async fn payments_on(db: &TestDb) -> Kafka {
    fixtures::create_orders(&db.pool).await;
    let kafka = Kafka::mock();
    kafka.create_topic(PAYMENTS, PARTITIONS).await;
    kafka
        .create_topic(&format!("{PAYMENTS}.retry"), PARTITIONS)
        .await;
    kafka.create_topic(&format!("{PAYMENTS}.dlq"), 1).await;
    kafka
}

/// Waits until group `group` committed `total` offsets of the payments' topic.
async fn committed(kafka: &Kafka, group: &str, total: i64) {
    wait_for(
        "every message consumed and committed",
        Duration::from_secs(60),
        || async { committed_total(&kafka.bootstrap(), group, PAYMENTS, PARTITIONS) == total },
    )
    .await;
}

/// The partition (its table's name) each of the rows `where_` picks is in.
async fn partitions_of(pool: &PgPool, where_: &str) -> Vec<String> {
    sqlx::query_scalar(&format!(
        "SELECT DISTINCT tableoid::regclass::text FROM processed_event WHERE {where_} ORDER BY 1"
    ))
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_after_its_first_receipts_partition_rolled_over_takes_effect_once() {
    let db = TestDb::new().await;
    fixtures::dedup_partitions_since(&db.pool, 3).await;
    let kafka = payments_on(&db).await;
    let payments = orders_with_payments(&db.pool, 100).await;
    produce(&kafka.bootstrap(), PAYMENTS, &records(&payments)).await;
    let consumer = builder(&db, &kafka, "orders")
        .handler(fixtures::mark_order_paid)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    committed(&kafka, "orders", 100).await;
    let today = partitions_of(&db.pool, "true").await;
    assert_eq!(today.len(), 1, "{today:?}");

    // The first receipts' partition rolls over: their records are in yesterday's partition
    // now, and today's (where a redelivery's record goes) holds none of them.
    sqlx::query("UPDATE processed_event SET processed_at = processed_at - interval '1 day'")
        .execute(&db.pool)
        .await
        .unwrap();
    let yesterday = partitions_of(&db.pool, "true").await;
    assert_eq!(yesterday.len(), 1);
    assert_ne!(yesterday, today);

    // Everything delivered again.
    produce(&kafka.bootstrap(), PAYMENTS, &records(&payments)).await;
    committed(&kafka, "orders", 200).await;
    running.stop().await;
    assert_eq!(
        paid_counts(&db.pool).await,
        vec![1; 100],
        "each payment applied once"
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM processed_event").await,
        100
    );
    assert_eq!(partitions_of(&db.pool, "true").await, yesterday);
}

/// Lets a test hold a handler inside its transaction.
struct Gate {
    entered: Semaphore,
    release: Semaphore,
}

impl Gate {
    fn new() -> Arc<Gate> {
        Arc::new(Gate {
            entered: Semaphore::new(0),
            release: Semaphore::new(0),
        })
    }
}

#[inbox_handler]
async fn pay_when_released(
    event: PaymentSucceeded,
    tx: &mut PgConnection,
    gate: &Arc<Gate>,
) -> Result<(), HandlerError> {
    sqlx::query("UPDATE orders SET paid = paid + 1 WHERE id = $1")
        .bind(event.order_id)
        .execute(tx)
        .await?;
    gate.entered.add_permits(1);
    gate.release.acquire().await.unwrap().forget();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_message_in_two_consumers_at_once_takes_effect_once_across_partitions() {
    let db = TestDb::new().await;
    fixtures::create_orders(&db.pool).await;
    let payments = orders_with_payments(&db.pool, 1).await;
    let (event_id, payment) = payments[0].clone();
    // Two transactions on either side of a partition boundary: the second consumer's clock is
    // a day ahead, so its dedup record would go to tomorrow's partition, where the first one's
    // (today's) is no conflict for the table's key.
    sqlx::query(
        "ALTER TABLE processed_event ALTER COLUMN processed_at SET DEFAULT \
         coalesce(nullif(current_setting('outbox_test.clock', true), '')::timestamptz, now())",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let tomorrow: String = sqlx::query_scalar(
        "SELECT to_char((now() + interval '1 day') AT TIME ZONE 'UTC', \
                        'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let ahead = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect_with(
            db.url
                .parse::<PgConnectOptions>()
                .unwrap()
                .application_name("consumer-ahead")
                .options([("outbox_test.clock", tomorrow.as_str())]),
        )
        .await
        .unwrap();

    // The first consumer handles the message and is held inside its transaction (one that a
    // rebalance replaced, finishing its batch).
    let first_gate = Gate::new();
    let first = {
        let (pool, gate) = (db.pool.clone(), Arc::clone(&first_gate));
        let payment = payment.clone();
        tokio::spawn(async move {
            let meta = MessageMeta::new(event_id, "PaymentSucceeded", PAYMENTS);
            testing::deliver_with(&pool, "orders", pay_when_released, gate, &meta, &payment).await
        })
    };
    tokio::time::timeout(Duration::from_secs(10), first_gate.entered.acquire())
        .await
        .expect("the first consumer runs its handler")
        .unwrap()
        .forget();
    // The second gets the same message meanwhile.
    let second_gate = Gate::new();
    second_gate.release.add_permits(1);
    let second = {
        let gate = Arc::clone(&second_gate);
        let pool = ahead.clone();
        tokio::spawn(async move {
            let meta = MessageMeta::new(event_id, "PaymentSucceeded", PAYMENTS);
            testing::deliver_with(&pool, "orders", pay_when_released, gate, &meta, &payment).await
        })
    };
    // It must wait for the first (on a lock), or have finished without waiting.
    wait_for(
        "the second consumer to wait or finish",
        Duration::from_secs(10),
        || async {
            second.is_finished()
                || count(
                    &db.pool,
                    "SELECT count(*) FROM pg_stat_activity \
                 WHERE application_name = 'consumer-ahead' AND wait_event_type = 'Lock'",
                )
                .await
                    > 0
        },
    )
    .await;
    first_gate.release.add_permits(1);
    assert_eq!(first.await.unwrap().unwrap(), Delivery::Handled);
    assert_eq!(second.await.unwrap().unwrap(), Delivery::Duplicate);
    assert_eq!(paid_counts(&db.pool).await, vec![1], "applied once");
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM processed_event").await,
        1
    );
}

/// A member of a consumer group, as its handler knows it.
struct Member {
    name: &'static str,
    /// The orders whose payments the group's members handled (rolled back or not), and which
    /// member did.
    handled: Arc<Mutex<Vec<(Uuid, &'static str)>>>,
    /// The order whose payment's handling is held inside its transaction.
    held: Uuid,
    gate: Arc<Gate>,
}

impl Member {
    fn handler_of(&self, order: Uuid) -> Option<&'static str> {
        let handled = self.handled.lock().unwrap();
        handled.iter().find(|(o, _)| *o == order).map(|(_, m)| *m)
    }
}

#[inbox_handler]
async fn pay_as_member(
    event: PaymentSucceeded,
    tx: &mut PgConnection,
    member: &Member,
) -> Result<(), HandlerError> {
    sqlx::query("UPDATE orders SET paid = paid + 1 WHERE id = $1")
        .bind(event.order_id)
        .execute(tx)
        .await?;
    member
        .handled
        .lock()
        .unwrap()
        .push((event.order_id, member.name));
    if event.order_id == member.held {
        member.gate.entered.add_permits(1);
        member.gate.release.acquire().await.unwrap().forget();
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_copy_handled_beside_its_redelivered_original_takes_effect_once() {
    // A consumer sent a message to the retry topic and died before storing its offset: the
    // original is redelivered to one member of the group while another handles the copy from
    // the retry topic, whose partition number differs. Their dedup records would not conflict
    // in the partitioned table (its key holds `processed_at`): only the lock on the source
    // partition, the original's for both, makes the second see the first's record.
    let db = TestDb::new().await;
    let kafka = payments_on(&db).await;
    let retry_topic = format!("{PAYMENTS}.retry");
    let held = orders_with_payments(&db.pool, 1).await.remove(0);
    let handled = Arc::new(Mutex::new(Vec::new()));
    let gate = Gate::new();
    // Range assignment: one member gets partitions 0 and 1 of both topics, the other 2 and 3.
    let mut members = Vec::new();
    for name in ["member-a", "member-b"] {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect_with(
                db.url
                    .parse::<PgConnectOptions>()
                    .unwrap()
                    .application_name(name),
            )
            .await
            .unwrap();
        let mut config = rdkafka::ClientConfig::new();
        config
            .set("auto.commit.interval.ms", "100")
            .set("heartbeat.interval.ms", "500")
            // A rebalance waits for every member to rejoin, up to about the session timeout
            // (45 s by default): a member slow to rejoin on a loaded machine must not hold
            // the probes that long.
            .set("session.timeout.ms", "6000")
            .set("partition.assignment.strategy", "range");
        let consumer = outbox_runtime::inbox::Consumer::builder(pool)
            .brokers(kafka.bootstrap())
            .group_id("orders")
            .consumer_config(config)
            .state(Member {
                name,
                handled: Arc::clone(&handled),
                held: held.1.order_id,
                gate: Arc::clone(&gate),
            })
            .handler(pay_as_member)
            .build()
            .unwrap();
        members.push(Running::consumer(&consumer));
    }
    let observer = Member {
        name: "test",
        handled: Arc::clone(&handled),
        held: held.1.order_id,
        gate: Arc::clone(&gate),
    };
    // Once both have joined, partition 0 and partition 3 are two members' (a pair of probes
    // shows it). Rebalances may come one after another while the members join: each round of
    // probes may wait for them, within one deadline for all.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
    loop {
        let probes = orders_with_payments(&db.pool, 2).await;
        for ((_, probe), partition) in probes.iter().zip([0, PARTITIONS - 1]) {
            let record = Outgoing::event(probe, Uuid::now_v7());
            produce_at(&kafka.bootstrap(), PAYMENTS, Some(partition), &[record]).await;
        }
        // A rebalance may hold them up for a few heartbeats.
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        wait_for("the probes handled", left, || async {
            probes
                .iter()
                .all(|(_, p)| observer.handler_of(p.order_id).is_some())
        })
        .await;
        let by: Vec<_> = probes
            .iter()
            .map(|(_, p)| observer.handler_of(p.order_id))
            .collect();
        if by[0] != by[1] {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the two members never shared the partitions"
        );
    }

    // The original in partition 0, its retried copy (as the consumer that died sent it) in
    // partition 3 of the retry topic, due at once.
    let (event_id, payment) = held;
    let original = Outgoing::event(&payment, event_id);
    let at = produce_at(
        &kafka.bootstrap(),
        PAYMENTS,
        Some(0),
        std::slice::from_ref(&original),
    )
    .await;
    let mut copy = original;
    copy.headers.extend([
        ("outbox_retry_source_topic".into(), PAYMENTS.into()),
        ("outbox_retry_source_partition".into(), at[0].0.to_string()),
        ("outbox_retry_source_offset".into(), at[0].1.to_string()),
        ("outbox_retry_attempts".into(), "1".into()),
        ("outbox_retry_due_ms".into(), "0".into()),
        ("outbox_retry_error".into(), "busy".into()),
    ]);
    produce_at(
        &kafka.bootstrap(),
        &retry_topic,
        Some(PARTITIONS - 1),
        &[copy],
    )
    .await;
    // One member holds it inside its transaction; the other must then wait for it (on a
    // lock), or it handles the copy too.
    tokio::time::timeout(Duration::from_secs(30), gate.entered.acquire())
        .await
        .expect("a member handles the payment")
        .unwrap()
        .forget();
    wait_for(
        "the other member to wait, or to handle it too",
        Duration::from_secs(30),
        || async {
            gate.entered.available_permits() > 0
                || count(
                    &db.pool,
                    "SELECT count(*) FROM pg_stat_activity \
                     WHERE application_name LIKE 'member-%' AND wait_event_type = 'Lock'",
                )
                .await
                    > 0
        },
    )
    .await;
    gate.release.add_permits(2);
    wait_for(
        "both messages consumed",
        Duration::from_secs(60),
        || async {
            committed_total(&kafka.bootstrap(), "orders", &retry_topic, PARTITIONS) == 1
                && committed_total(&kafka.bootstrap(), "orders", PAYMENTS, PARTITIONS)
                    == count(&db.pool, "SELECT count(*) FROM orders").await
        },
    )
    .await;
    for member in members {
        member.stop().await;
    }
    let paid: i32 = sqlx::query_scalar("SELECT paid FROM orders WHERE id = $1")
        .bind(payment.order_id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(paid, 1, "the payment applied once");
    assert_eq!(
        count(
            &db.pool,
            &format!("SELECT count(*) FROM processed_event WHERE event_id = '{event_id}'")
        )
        .await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creating_partitions_beside_another_creator_works_under_a_repeatable_read_default() {
    // Some installations make REPEATABLE READ the default: a call that waited for another
    // creator's lock must still see the partitions that one made, not try to make them again.
    let db = TestDb::new().await;
    sqlx::query(&format!(
        "ALTER DATABASE {} SET default_transaction_isolation = 'repeatable read'",
        db.name
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    let pool = db.pool(2).await;
    let isolation: String = sqlx::query_scalar("SHOW transaction_isolation")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(isolation, "repeatable read");
    fixtures::drop_dedup_partitions(&pool, "lower_bound > now()").await;
    // Another creator holds the creators' lock.
    let mut other = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock('processed_event'::regclass::oid::int4, 1346458196)")
        .execute(&mut *other)
        .await
        .unwrap();
    let waiting = {
        let pool = pool.clone();
        tokio::spawn(
            async move { admin::create_partitions(&pool, CleanupTable::ProcessedEvent).await },
        )
    };
    wait_for(
        "the second creator to wait",
        Duration::from_secs(10),
        || async {
            count(
                &db.pool,
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            )
            .await
                == 1
        },
    )
    .await;
    let made: i32 = sqlx::query_scalar("SELECT outbox_create_partitions('processed_event')")
        .fetch_one(&mut *other)
        .await
        .unwrap();
    assert!(made > 0);
    other.commit().await.unwrap();
    assert_eq!(waiting.await.unwrap().unwrap(), 0, "nothing left to create");
    let layout = admin::partitions(&pool, CleanupTable::ProcessedEvent)
        .await
        .unwrap()
        .unwrap();
    assert!(layout.partitions.windows(2).all(|w| w[0].to == w[1].from));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_partitions_are_created_and_dropped_while_a_consumer_handles_events() {
    let db = TestDb::new().await;
    // An installation 6 days old, with a day's dedup records in each past partition.
    fixtures::dedup_partitions_since(&db.pool, 6).await;
    sqlx::query(
        "INSERT INTO processed_event (event_id, handler, processed_at) \
         SELECT gen_random_uuid(), 'old', now() - make_interval(days => d) \
         FROM generate_series(1, 5) AS d, generate_series(1, 100)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let kafka = payments_on(&db).await;
    let payments = orders_with_payments(&db.pool, 2_000).await;
    let consumer = builder(&db, &kafka, "orders")
        .handler(fixtures::mark_order_paid)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    // Events arrive in waves while retention (a 2-day dedup window) and a change of width
    // (hourly partitions from the last one on) create and drop partitions.
    let retention = Retention::new(Duration::from_secs(86_400))
        .dedup_older_than(Duration::from_secs(2 * 86_400));
    let mut reports = Vec::new();
    for (i, wave) in payments.chunks(400).enumerate() {
        produce(&kafka.bootstrap(), PAYMENTS, &records(wave)).await;
        if i == 1 {
            let created = admin::set_partitioning(
                &db.pool,
                CleanupTable::ProcessedEvent,
                Duration::from_secs(3600),
                Duration::from_secs(4 * 86_400),
            )
            .await
            .unwrap();
            assert!(created > 0, "hourly partitions after the daily ones");
        }
        reports.push(retention.run_once(&db.pool).await.unwrap().unwrap());
    }
    committed(&kafka, "orders", 2_000).await;
    running.stop().await;

    assert_eq!(
        paid_counts(&db.pool).await,
        vec![1; 2_000],
        "each payment applied once"
    );
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM processed_event WHERE handler = 'orders/mark_order_paid'"
        )
        .await,
        2_000
    );
    // The partitions that ended before the window went (the first one and those of 6 to 3
    // days ago), with the records of 5 to 3 days ago; those of the last 2 days stayed.
    let dropped: u64 = reports
        .iter()
        .map(|r| r.processed_event_partitions_dropped)
        .sum();
    let rows: u64 = reports.iter().map(|r| r.processed_event).sum();
    assert_eq!((dropped, rows), (5, 300), "{reports:?}");
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM processed_event WHERE handler = 'old'"
        )
        .await,
        200
    );
    let layout = admin::partitions(&db.pool, CleanupTable::ProcessedEvent)
        .await
        .unwrap()
        .unwrap();
    for pair in layout.partitions.windows(2) {
        assert_eq!(pair[0].to, pair[1].from, "no gap: {layout:#?}");
    }
    assert_eq!(layout.width, Duration::from_secs(3600));
    let last = layout.partitions.last().unwrap();
    assert_eq!(
        last.to.unwrap() - last.from.unwrap(),
        chrono::Duration::hours(1)
    );
    let now: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(
        last.to.unwrap() >= now + chrono::Duration::days(4),
        "{layout:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_creates_the_partition_it_finds_missing() {
    let db = TestDb::new().await;
    let kafka = payments_on(&db).await;
    let payments = orders_with_payments(&db.pool, 200).await;
    let consumer = builder(&db, &kafka, "orders")
        .handler(fixtures::mark_order_paid)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    produce(&kafka.bootstrap(), PAYMENTS, &records(&payments[..100])).await;
    committed(&kafka, "orders", 100).await;
    // Every partition goes (nothing created them for days, say): inserts find none.
    fixtures::drop_dedup_partitions(&db.pool, "true").await;
    produce(&kafka.bootstrap(), PAYMENTS, &records(&payments[100..])).await;
    committed(&kafka, "orders", 200).await;
    running.stop().await;
    assert_eq!(paid_counts(&db.pool).await, vec![1; 200]);
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM processed_event").await,
        100
    );
    let layout = admin::partitions(&db.pool, CleanupTable::ProcessedEvent)
        .await
        .unwrap()
        .unwrap();
    assert!(layout.partitions.len() >= 4, "{layout:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_dedup_table_converts_while_a_consumer_runs_losing_nothing() {
    let db = TestDb::before_partitions().await;
    let kafka = payments_on(&db).await;
    let payments = orders_with_payments(&db.pool, 1_500).await;
    let consumer = builder(&db, &kafka, "orders")
        .handler(fixtures::mark_order_paid)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    produce(&kafka.bootstrap(), PAYMENTS, &records(&payments[..500])).await;
    committed(&kafka, "orders", 500).await;
    // The next 500 arrive while the table converts.
    let producing = {
        let (bootstrap, wave) = (kafka.bootstrap(), records(&payments[500..1_000]));
        tokio::spawn(async move { produce(&bootstrap, PAYMENTS, &wave).await })
    };
    let conversion = admin::convert_to_partitions(&db.pool, CleanupTable::ProcessedEvent)
        .await
        .unwrap();
    producing.await.unwrap();
    let Conversion::Converted { history, .. } = &conversion else {
        panic!("{conversion:?}");
    };
    assert_eq!(history, "processed_event_history");
    // Then the last 500, and the first 500 again: redeliveries of events handled before the
    // conversion, whose records stayed in the old table, now the first partition.
    produce(&kafka.bootstrap(), PAYMENTS, &records(&payments[1_000..])).await;
    produce(&kafka.bootstrap(), PAYMENTS, &records(&payments[..500])).await;
    committed(&kafka, "orders", 2_000).await;
    running.stop().await;

    assert_eq!(
        paid_counts(&db.pool).await,
        vec![1; 1_500],
        "each payment applied once"
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM processed_event").await,
        1_500
    );
    let kind: String = sqlx::query_scalar(
        "SELECT relkind::text FROM pg_class WHERE oid = 'processed_event'::regclass",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(kind, "p");
    // Nothing left behind: the old table's bound is its partition bound now.
    assert_eq!(
        admin::convert_to_partitions(&db.pool, CleanupTable::ProcessedEvent)
            .await
            .unwrap(),
        Conversion::AlreadyPartitioned
    );
    let layout = admin::partitions(&db.pool, CleanupTable::ProcessedEvent)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(layout.partitions[0].name, "processed_event_history");
    // The old table takes the rows until the end of the width a day ahead; partitions follow
    // it to the layout's ahead.
    let now: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let history_until = layout.partitions[0].to.unwrap();
    assert!(
        history_until >= now + chrono::Duration::days(1),
        "{layout:#?}"
    );
    let last = layout.partitions.last().unwrap().to.unwrap();
    assert!(last >= now + chrono::Duration::days(3), "{layout:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_warns_of_partitions_not_ahead_and_of_one_not_dropped() {
    let db = TestDb::new().await;
    fixtures::dedup_partitions_since(&db.pool, 3).await;
    let thresholds = HealthThresholds::default();
    let kinds = |h: &admin::Health| h.warnings.iter().map(|w| w.kind()).collect::<Vec<_>>();
    let health = admin::health(&db.pool, &thresholds).await.unwrap();
    assert!(
        !kinds(&health).contains(&WarningKind::PartitionsNotAhead),
        "{health:#?}"
    );

    // The partitions after today's go: they reach less than a day past now.
    fixtures::drop_dedup_partitions(&db.pool, "lower_bound > now()").await;
    let health = admin::health(&db.pool, &thresholds).await.unwrap();
    let warning = health
        .warnings
        .iter()
        .find(|w| w.kind() == WarningKind::PartitionsNotAhead)
        .unwrap_or_else(|| panic!("{health:#?}"));
    assert!(
        warning
            .to_string()
            .contains("partitions of processed_event reach only"),
        "{warning}"
    );
    admin::create_partitions(&db.pool, CleanupTable::ProcessedEvent)
        .await
        .unwrap();
    let health = admin::health(&db.pool, &thresholds).await.unwrap();
    assert!(
        !kinds(&health).contains(&WarningKind::PartitionsNotAhead),
        "{health:#?}"
    );

    // A detach interrupted while a transaction could still see the partition.
    let oldest: String = sqlx::query_scalar(
        "SELECT partition::text FROM outbox_partitions('processed_event') \
         ORDER BY upper_bound LIMIT 1",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let mut reader = db.pool.begin().await.unwrap();
    sqlx::query("SELECT count(*) FROM processed_event")
        .execute(&mut *reader)
        .await
        .unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    sqlx::query("SET statement_timeout = '1s'")
        .execute(&mut *conn)
        .await
        .unwrap();
    let interrupted = sqlx::query(&format!(
        "ALTER TABLE processed_event DETACH PARTITION {oldest} CONCURRENTLY"
    ))
    .execute(&mut *conn)
    .await;
    assert!(interrupted.is_err(), "the detach waits for the reader");
    sqlx::query("RESET statement_timeout")
        .execute(&mut *conn)
        .await
        .unwrap();
    reader.rollback().await.unwrap();
    let health = admin::health(&db.pool, &thresholds).await.unwrap();
    let warning = health
        .warnings
        .iter()
        .find(|w| w.kind() == WarningKind::PartitionNotDropped)
        .unwrap_or_else(|| panic!("{health:#?}"));
    assert!(warning.to_string().contains(&oldest), "{warning}");
    // Retention finishes it (it ended before the window).
    let report = Retention::new(Duration::from_secs(86_400))
        .run_once(&db.pool)
        .await
        .unwrap()
        .unwrap();
    assert!(report.processed_event_partitions_dropped >= 1, "{report:?}");
    let health = admin::health(&db.pool, &thresholds).await.unwrap();
    assert!(
        !kinds(&health).contains(&WarningKind::PartitionNotDropped),
        "{health:#?}"
    );
}

/// Many narrow partitions (a minute wide, an hour ahead: 60 and more) are read in order: the
/// health check sees them reach an hour past now, and warns of none missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn minute_wide_partitions_an_hour_ahead_are_not_reported_missing() {
    let db = TestDb::new().await;
    fixtures::narrow_partitions(
        &db.pool,
        CleanupTable::ProcessedEvent,
        Duration::from_secs(60),
        "now()",
    )
    .await;
    // The catalogs' statistics as autovacuum keeps them on a server with it on: the planner
    // then joins them by hash, in no particular order.
    sqlx::raw_sql("ANALYZE pg_class; ANALYZE pg_inherits")
        .execute(&db.pool)
        .await
        .unwrap();
    let layout = admin::partitions(&db.pool, CleanupTable::ProcessedEvent)
        .await
        .unwrap()
        .unwrap();
    assert!(layout.partitions.len() > 60, "{}", layout.partitions.len());
    let bounds: Vec<_> = layout.partitions.iter().map(|p| p.to).collect();
    let mut sorted = bounds.clone();
    sorted.sort_by_key(|to| to.unwrap_or(chrono::DateTime::<chrono::Utc>::MAX_UTC));
    assert_eq!(bounds, sorted, "the partitions in order");
    let now = chrono::Utc::now();
    assert!(
        layout.covered_past(now) >= Duration::from_secs(59 * 60),
        "{:?}",
        layout.covered_past(now)
    );
    let health = admin::health(&db.pool, &HealthThresholds::default())
        .await
        .unwrap();
    assert!(
        !health
            .warnings
            .iter()
            .any(|w| w.kind() == WarningKind::PartitionsNotAhead),
        "{health:#?}"
    );
}
