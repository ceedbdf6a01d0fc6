//! `outbox_event` in time partitions (a new installation's; `convert_to_partitions` for one from before): relays publish every
//! event once and in per-key order while partitions are created and dropped under them,
//! retention never drops a partition that holds an unpublished or parked row (it keeps and
//! reports it), and an installation from before converts while emitters run (with its relays
//! stopped, which the conversion checks).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use outbox_runtime::admin::{self, CleanupTable, Conversion, HealthThresholds, Retention};
use outbox_runtime::{Error, Uow};
use outbox_tests::deposits::{
    check_delivery, check_delivery_where, consume_all, deposit, relay_on, Deposited, PARTITIONS,
    TOPIC,
};
use outbox_tests::kafka::Kafka;
use outbox_tests::payments::wait_for;
use outbox_tests::{count, fixtures, Running, TestDb};
use sqlx::PgPool;
use uuid::Uuid;

/// A new installation's outbox is partitioned already: converting it does nothing.
async fn already_partitioned(pool: &PgPool) {
    let conversion = admin::convert_to_partitions(pool, CleanupTable::Outbox)
        .await
        .unwrap();
    assert_eq!(conversion, Conversion::AlreadyPartitioned);
}

/// Converts the outbox of an installation from before partitions; asserts that it was
/// converted now.
async fn partitioned(pool: &PgPool) -> Conversion {
    let conversion = admin::convert_to_partitions(pool, CleanupTable::Outbox)
        .await
        .unwrap();
    assert!(
        matches!(conversion, Conversion::Converted { .. }),
        "{conversion:?}"
    );
    conversion
}

/// Emits `keys` accounts' deposits, `batch` per unit of work, round after round, until `stop`:
/// every unit of work must commit. Returns how many events it emitted.
fn emitter(pool: PgPool, keys: usize, batch: usize, stop: Arc<AtomicBool>) -> Emitter {
    let emitted = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&emitted);
    let task = tokio::spawn(async move {
        let mut seq = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let events: Vec<Deposited> = (0..keys).map(|k| deposit(k, seq)).collect();
            for chunk in events.chunks(batch) {
                let mut uow = Uow::begin(&pool).await.unwrap();
                uow.emit_all(chunk).await.unwrap();
                uow.commit().await.unwrap();
                counted.fetch_add(chunk.len(), Ordering::Relaxed);
            }
            seq += 1;
        }
    });
    Emitter { emitted, task }
}

struct Emitter {
    emitted: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Emitter {
    fn so_far(&self) -> usize {
        self.emitted.load(Ordering::Relaxed)
    }

    /// Waits until it emitted `n` more events than now.
    async fn more(&self, n: usize) {
        let target = self.so_far() + n;
        wait_for("the emitter emitting", Duration::from_secs(60), || async {
            self.so_far() >= target
        })
        .await;
    }

    async fn finish(self) -> usize {
        self.task.await.unwrap();
        self.emitted.load(Ordering::Relaxed)
    }
}

/// Writes an old row of topic `old.events`, created `days_ago`, in the state `state` describes
/// (columns of `outbox_event` set as an SQL list), with its own key.
async fn old_row(pool: &PgPool, days_ago: i32, state: &str) -> Uuid {
    let id = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, \
                                   topic, partition_key, created_at) \
         VALUES ($1, 'Account', 'old', 'Deposited', '{}', 'old.events', $1::text, \
                 now() - make_interval(days => $2))",
    )
    .bind(id)
    .bind(days_ago)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(&format!(
        "UPDATE outbox_event SET {state} WHERE event_id = $1"
    ))
    .bind(id)
    .execute(pool)
    .await
    .unwrap_or_else(|e| panic!("{state}: {e}"));
    id
}

/// The partitions (their tables' names) that hold the rows `filter` picks.
async fn holding(pool: &PgPool, filter: &str) -> Vec<String> {
    sqlx::query_scalar(&format!(
        "SELECT DISTINCT tableoid::regclass::text FROM outbox_event WHERE {filter} ORDER BY 1"
    ))
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_publish_everything_once_in_order_while_partitions_are_created_and_dropped() {
    let db = TestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    kafka.create_topic("old.events", 1).await;
    already_partitioned(&db.pool).await;
    // An installation 6 days old: partitions a day wide from then.
    fixtures::partitions_since(&db.pool, "outbox_event", 6).await;
    // Published rows in each past day, and three that must stay: an unpublished row 5 days
    // old (its retry is a day away, its key held), a parked one 4 days old, and a row 3 days
    // old published only an hour ago (within the window).
    for day in 2..=6 {
        for _ in 0..20 {
            old_row(
                &db.pool,
                day,
                "published_at = created_at + interval '1 minute'",
            )
            .await;
        }
    }
    let waiting = old_row(
        &db.pool,
        5,
        "attempts = 1, last_error = 'refused', next_attempt_at = now() + interval '1 day'",
    )
    .await;
    let parked = old_row(
        &db.pool,
        4,
        "attempts = 5, last_error = 'refused', parked_at = now() - interval '1 day'",
    )
    .await;
    let late = old_row(&db.pool, 3, "published_at = now() - interval '1 hour'").await;
    let kept: Vec<String> = holding(
        &db.pool,
        &format!("event_id IN ('{waiting}', '{parked}', '{late}')"),
    )
    .await;
    assert_eq!(kept.len(), 3, "{kept:?}");

    // Two relays and an emitter; meanwhile partitions are created ahead and retention runs
    // again and again.
    let relays: Vec<Running> = (0..2)
        .map(|_| Running::relay(&relay_on(&db.pool, &kafka).batch_size(200).build().unwrap()))
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let emitter = emitter(db.pool.clone(), 200, 100, Arc::clone(&stop));
    emitter.more(2_000).await;
    // The relays made the partitions ahead when they started: they go, and come back now.
    fixtures::drop_partitions_of(
        &db.pool,
        "outbox_event",
        "lower_bound > now() + interval '1 hour'",
    )
    .await;
    let created = admin::create_partitions(&db.pool, CleanupTable::Outbox)
        .await
        .unwrap();
    assert!(created >= 2, "{created} partitions created ahead");
    let retention = Retention::new(Duration::from_secs(86_400));
    let mut dropped = 0;
    let mut runs = 0;
    while runs < 3 || emitter.so_far() < 8_000 {
        let report = retention.run_once(&db.pool).await.unwrap().unwrap();
        dropped += report.outbox_partitions_dropped;
        // The partitions with an unpublished and a parked row; the one with a row published
        // within the window is kept too, unreported (it goes once the row is past it).
        assert_eq!(report.partitions_kept, 2, "{report:?}");
        runs += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let n = emitter.finish().await;
    let received = consume_all(&kafka, n, Duration::from_secs(120)).await;
    wait_for("every event published", Duration::from_secs(60), || async {
        count(
            &db.pool,
            "SELECT count(*) FROM outbox_event WHERE topic = 'account.events' \
             AND published_at IS NULL",
        )
        .await
            == 0
    })
    .await;
    Running::stop_all(relays).await;
    let duplicates = check_delivery_where(&db.pool, &received, n, "topic = 'account.events'").await;
    assert_eq!(duplicates, 0, "{n} events, none published twice");

    // The partitions of days 6 and 2 held only published rows past the window: dropped (the
    // history partition too, empty). Those of days 5, 4 and 3 stay, with their rows to keep;
    // their other rows, published before the cut-off, are gone.
    assert_eq!(dropped, 3, "partitions dropped");
    assert_eq!(
        holding(&db.pool, "topic = 'old.events'").await,
        kept,
        "the kept partitions hold only the rows to keep"
    );
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM outbox_event WHERE topic = 'old.events'"
        )
        .await,
        3
    );
    let health = admin::health(&db.pool, &HealthThresholds::default())
        .await
        .unwrap();
    let mut reasons: Vec<String> = health
        .warnings
        .iter()
        .filter(|w| w.kind() == admin::WarningKind::PartitionNotDropped)
        .map(ToString::to_string)
        .collect();
    reasons.sort();
    assert_eq!(reasons.len(), 2, "{reasons:#?}");
    for (partition, reason) in [
        (&kept[0], "it holds 1 unpublished row"),
        (&kept[1], "it holds 1 parked row"),
    ] {
        assert!(
            reasons
                .iter()
                .any(|r| r.contains(&format!("partition {partition} ")) && r.contains(reason)),
            "{partition}: {reason}: {reasons:#?}"
        );
    }
    let layout = admin::partitions(&db.pool, CleanupTable::Outbox)
        .await
        .unwrap()
        .unwrap();
    assert!(
        !health
            .warnings
            .iter()
            .any(|w| w.kind() == admin::WarningKind::PartitionsNotAhead),
        "{layout:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpartitioned_outbox_converts_while_emitters_run_and_its_relays_restart_after() {
    let db = TestDb::before_partitions().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    let relay = relay_on(&db.pool, &kafka).batch_size(200).build().unwrap();
    let running = Running::relay(&relay);
    let stop = Arc::new(AtomicBool::new(false));
    let emitter = emitter(db.pool.clone(), 100, 50, Arc::clone(&stop));
    emitter.more(2_000).await;

    // Refused while a relay runs: its shard locks are keyed by the table it resolved.
    let refused = admin::convert_to_partitions(&db.pool, CleanupTable::Outbox)
        .await
        .unwrap_err();
    assert!(matches!(refused, Error::Config(_)), "{refused}");
    assert!(
        refused.to_string().contains("stop them before converting"),
        "{refused}"
    );
    running.stop().await;
    // Its session ends once the server notices the closed connection.
    wait_for(
        "the relay's session gone",
        Duration::from_secs(30),
        || async {
            count(
                &db.pool,
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
             AND classid = 'outbox_event'::regclass",
            )
            .await
                == 0
        },
    )
    .await;
    let before: i64 = count(&db.pool, "SELECT max(id) FROM outbox_event").await;

    // A session holding a relay's shard lock and no member slot (as a relay that connected
    // after the first check would, between its two locks) is caught under the swap's lock:
    // refused, and the plain table left as it was.
    let mut shard = db.pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock('outbox_event'::regclass::oid::int4, 1392508928)")
        .execute(&mut *shard)
        .await
        .unwrap();
    let refused = admin::convert_to_partitions(&db.pool, CleanupTable::Outbox)
        .await
        .unwrap_err();
    assert!(
        outbox_runtime::error_chain(&refused)
            .to_string()
            .contains("a relay (or a retention run) holds its locks on outbox_event"),
        "{refused}"
    );
    assert!(admin::partitions(&db.pool, CleanupTable::Outbox)
        .await
        .unwrap()
        .is_none());
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM pg_constraint WHERE conname = 'outbox_event_before_partitions'"
        )
        .await,
        0,
        "the bound is dropped again"
    );
    sqlx::query("SELECT pg_advisory_unlock_all()")
        .execute(&mut *shard)
        .await
        .unwrap();
    drop(shard);

    // The emitter goes on through the conversion, which leaves the rows where they are.
    let conversion = partitioned(&db.pool).await;
    let Conversion::Converted { history, .. } = conversion else {
        unreachable!()
    };
    assert_eq!(history, "outbox_event_history");
    emitter.more(2_000).await;
    let relays: Vec<Running> = (0..2)
        .map(|_| Running::relay(&relay_on(&db.pool, &kafka).batch_size(200).build().unwrap()))
        .collect();
    emitter.more(2_000).await;
    stop.store(true, Ordering::Relaxed);
    let n = emitter.finish().await;
    let received = consume_all(&kafka, n, Duration::from_secs(120)).await;
    outbox_tests::deposits::wait_until_published(&db.pool, Duration::from_secs(60)).await;
    Running::stop_all(relays).await;
    let duplicates = check_delivery(&db.pool, &received, n).await;
    assert_eq!(duplicates, 0, "{n} events, none published twice");

    // The rows from before are in the history partition, with ids below every later one's.
    assert!(
        count(
            &db.pool,
            &format!("SELECT count(*) FROM outbox_event_history WHERE id <= {before}")
        )
        .await
            >= 2_000
    );
    let layout = admin::partitions(&db.pool, CleanupTable::Outbox)
        .await
        .unwrap()
        .expect("partitioned");
    // The history partition takes rows until the end of the day after tomorrow, then days.
    assert!(layout.partitions.len() >= 2, "{layout:#?}");
    assert_eq!(layout.partitions[0].name, "outbox_event_history");
    // Every index of the partitioned table has its partition in the history table.
    let unattached = count(
        &db.pool,
        "SELECT count(*) FROM pg_index i \
         WHERE i.indrelid = 'outbox_event'::regclass AND NOT EXISTS ( \
             SELECT 1 FROM pg_inherits h JOIN pg_index c ON c.indexrelid = h.inhrelid \
             WHERE h.inhparent = i.indexrelid \
               AND c.indrelid = 'outbox_event_history'::regclass)",
    )
    .await;
    assert_eq!(unattached, 0);
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM pg_index WHERE indrelid = 'outbox_event'::regclass"
        )
        .await,
        6,
        "the key, the event id's and the four partial indexes"
    );

    // An event id twice in one unit of work is still refused (by the constraint of the
    // partition the rows go to, which PostgreSQL names).
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    let first = fixtures::posted("L-1");
    let again = fixtures::Posted {
        ledger: "L-2".into(),
        id: first.id,
    };
    uow.emit_all(&[first, again]).await.unwrap();
    let err = outbox_runtime::error_chain(&uow.commit().await.unwrap_err()).to_string();
    assert!(
        err.contains(
            "duplicate key value violates unique constraint \"outbox_event_history_event_id_key\""
        ),
        "{err}"
    );
}

/// Ten-minute outbox partitions from three hours ago to an hour ahead (about 24).
async fn three_hours_of_ten_minute_partitions(pool: &PgPool) {
    fixtures::narrow_partitions(
        pool,
        CleanupTable::Outbox,
        Duration::from_secs(600),
        "now() - interval '3 hours'",
    )
    .await;
}

/// An unpublished row created `ago` (an SQL interval) on topic `TOPIC` with key `key`, written
/// directly (as a backlog from before, or a write that bypasses `outbox_emit`).
async fn backdated(pool: &PgPool, ago: &str, key: &str, seq: u64) -> Uuid {
    let event = deposit(0, seq);
    let id = Uuid::now_v7();
    sqlx::query(&format!(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, \
                                   topic, partition_key, created_at) \
         VALUES ($1, 'Account', $2, 'Deposited', $3, '{TOPIC}', $2, now() - interval '{ago}')"
    ))
    .bind(id)
    .bind(key)
    .bind(serde_json::to_value(&event).unwrap())
    .execute(pool)
    .await
    .unwrap();
    id
}

/// The claim's floor on a partitioned outbox: the oldest claimable row's `created_at`, or now
/// (less the margin) when none is older; a parked row does not hold it; none while a
/// transaction that was running goes on running; none on a plain outbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claim_floor_stays_below_every_row_that_can_still_be_claimed() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    three_hours_of_ten_minute_partitions(pool).await;
    let wait = Duration::from_secs(10);
    let floor = |margin: u64, wait: Duration| async move {
        outbox_runtime::relay::claim_floor(pool, Duration::from_secs(margin), wait)
            .await
            .unwrap()
    };
    let now = || async {
        sqlx::query_scalar::<_, chrono::DateTime<chrono::Utc>>("SELECT clock_timestamp()")
            .fetch_one(pool)
            .await
            .unwrap()
    };
    let created = |id: Uuid| async move {
        sqlx::query_scalar::<_, chrono::DateTime<chrono::Utc>>(
            "SELECT created_at FROM outbox_event WHERE event_id = $1",
        )
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
    };

    // Nothing to claim: about now, less the margin.
    let before = now().await;
    let f = floor(60, wait).await.expect("a floor");
    let after = now().await;
    assert!(
        f >= before - chrono::Duration::seconds(61) && f <= after - chrono::Duration::seconds(59),
        "{f} {before} {after}"
    );

    // A row two hours old waiting: the floor stays at it, also when it waits for a retry.
    let old = backdated(pool, "2 hours", "k-old", 1).await;
    assert_eq!(floor(0, wait).await, Some(created(old).await));
    sqlx::query(
        "UPDATE outbox_event SET next_attempt_at = now() + interval '1 hour' WHERE event_id = $1",
    )
    .bind(old)
    .execute(pool)
    .await
    .unwrap();
    assert_eq!(floor(0, wait).await, Some(created(old).await));
    // Parked or published, it does not hold the floor.
    sqlx::query("UPDATE outbox_event SET parked_at = now() WHERE event_id = $1")
        .bind(old)
        .execute(pool)
        .await
        .unwrap();
    assert!(floor(0, wait).await.unwrap() > created(old).await + chrono::Duration::minutes(100));

    // A transaction that was running when the floor was asked for: none while it runs, since
    // it could still write a row as old as its start.
    let mut running = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1")
        .execute(&mut *running)
        .await
        .unwrap();
    assert_eq!(floor(0, Duration::from_millis(300)).await, None);
    running.commit().await.unwrap();
    assert!(floor(0, wait).await.is_some());

    // A plain outbox has none: its claim reads one index.
    let plain = TestDb::before_partitions().await;
    let none =
        outbox_runtime::relay::claim_floor(&plain.pool, Duration::ZERO, Duration::from_millis(200))
            .await
            .unwrap();
    assert_eq!(none, None);
}

/// Relays whose claims skip the partitions below their floor (recomputed every 100 ms, a
/// second's clock margin) publish every event once and in per-key order, also the rows that become
/// claimable below the floor: a unit of work that began before the floor moved and commits
/// late, a parked row retried and a row written directly with an old `created_at` (both
/// while a transaction holds back the floor's rise).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_skipping_settled_partitions_lose_nothing_below_their_floor() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    three_hours_of_ten_minute_partitions(pool).await;
    // A row that will be parked, and a unit of work that begins now and commits at the end.
    let parked = backdated(pool, "150 minutes", "k-parked", 1).await;
    sqlx::query("UPDATE outbox_event SET parked_at = now() WHERE event_id = $1")
        .bind(parked)
        .execute(pool)
        .await
        .unwrap();
    let mut late = Uow::begin(pool).await.unwrap();
    late.emit(&deposit(999, 0)).await.unwrap();
    let late_started: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(late.tx())
        .await
        .unwrap();

    let relays: Vec<_> = (0..2)
        .map(|_| {
            relay_on(pool, &kafka)
                .claim_floor_interval(Duration::from_millis(100))
                .claim_floor_margin(Duration::from_secs(1))
                .build()
                .unwrap()
        })
        .collect();
    let running: Vec<_> = relays.iter().map(Running::relay).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let emitter = emitter(db.pool.clone(), 50, 25, Arc::clone(&stop));
    emitter.more(1_000).await;
    // The floor cannot pass the unit of work still open.
    let f = outbox_runtime::relay::claim_floor(pool, Duration::ZERO, Duration::from_millis(300))
        .await
        .unwrap();
    assert!(f.is_none_or(|f| f <= late_started), "{f:?} {late_started}");
    late.commit().await.unwrap();
    emitter.more(1_000).await;
    // Once it committed, the floor moves past the old partitions.
    wait_for(
        "the floor past the old partitions",
        Duration::from_secs(30),
        || async {
            outbox_runtime::relay::claim_floor(pool, Duration::ZERO, Duration::from_secs(1))
                .await
                .unwrap()
                .is_some_and(|f| f > late_started)
        },
    )
    .await;
    // Below it: a parked row retried, and a row written with an old `created_at`, while a
    // transaction holds every new sighting (the floor goes down without one).
    let mut blocker = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1")
        .execute(&mut *blocker)
        .await
        .unwrap();
    let retried = admin::retry_parked(pool, &admin::PoisonFilter::all())
        .await
        .unwrap();
    assert_eq!(retried, 1);
    let direct = backdated(pool, "100 minutes", "k-direct", 1).await;
    wait_for(
        "the retried and the direct row published, an older transaction still open",
        Duration::from_secs(30),
        || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM outbox_event \
                 WHERE event_id = ANY($1) AND published_at IS NOT NULL",
            )
            .bind([parked, direct])
            .fetch_one(pool)
            .await
            .unwrap()
                == 2
        },
    )
    .await;
    blocker.commit().await.unwrap();
    emitter.more(1_000).await;
    stop.store(true, Ordering::Relaxed);
    let emitted = emitter.finish().await;
    // Every emitted event, the late unit of work's, the retried and the direct one.
    let expected = emitted + 3;
    wait_for("every row published", Duration::from_secs(60), || async {
        count(
            pool,
            "SELECT count(*) FROM outbox_event WHERE published_at IS NULL",
        )
        .await
            == 0
    })
    .await;
    let received = consume_all(&kafka, expected, Duration::from_secs(60)).await;
    check_delivery(pool, &received, expected).await;
    for id in [parked, direct] {
        assert!(
            received
                .iter()
                .any(|r| r.header("event_id") == id.to_string()),
            "{id} published"
        );
    }
    for r in running {
        r.stop().await;
    }
}
