//! `admin::health` against the real server: each warning provoked for real (autovacuum off on a
//! table, dead rows, an idle-in-transaction session, an unpublished event past its threshold,
//! held, parked and dead rows, a consumer's missing dead-letter topic), named with its cause,
//! and gone once the cause is; `EnsureTopics` creating what is missing.

use std::str::FromStr;
use std::time::Duration;

use outbox_runtime::admin::{
    self, health, EnsureTopics, EnsuredTopic, Health, HealthThresholds, TopicAction, TopicRole,
    Warning, WarningKind,
};
use outbox_runtime::relay::Relay;
use outbox_runtime::Uow;
use outbox_tests::fixtures::{self, PaymentSucceeded, PAYMENTS};
use outbox_tests::kafka::Kafka;
use outbox_tests::payments::{
    builder, no_auto_created_topics, setup_without_dead_letter_topic, wait_for, PARTITIONS,
};
use outbox_tests::{count, HeldTransaction, Running, TestDb};
use sqlx::{ConnectOptions, PgPool};
use uuid::Uuid;

/// Checks health until `found` holds for its report (the statistics views lag the tables by
/// a second or so); panics with the last report after 30 s.
async fn until(
    pool: &PgPool,
    thresholds: &HealthThresholds,
    what: &str,
    found: impl Fn(&Health) -> bool,
) -> Health {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let report = health(pool, thresholds).await.expect("health check");
        if found(&report) {
            return report;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not after 30 s; last report: {report:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn of_kind(h: &Health, kind: WarningKind) -> Vec<&Warning> {
    h.warnings.iter().filter(|w| w.kind() == kind).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn autovacuum_off_dead_rows_and_an_overdue_vacuum_are_named_until_vacuumed() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    let thresholds = HealthThresholds::default().dead_rows(10_000);

    // The server's own setting, whichever it is: warned about exactly when it is off.
    let server_on: bool = sqlx::query_scalar(
        "SELECT current_setting('autovacuum')::bool AND current_setting('track_counts')::bool",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    let fresh = health(pool, &thresholds).await.unwrap();
    assert_eq!(fresh.autovacuum, server_on);
    let server_warnings: Vec<_> = of_kind(&fresh, WarningKind::AutovacuumOff);
    assert_eq!(server_warnings.is_empty(), server_on, "{fresh:#?}");
    assert!(server_warnings
        .iter()
        .all(|w| matches!(w, Warning::AutovacuumOff { table: None, .. })));
    assert!(
        of_kind(&fresh, WarningKind::DeadRows).is_empty(),
        "{fresh:#?}"
    );
    let names: Vec<&str> = fresh.tables.iter().map(|t| t.table.as_str()).collect();
    assert_eq!(
        names,
        [
            "inbox_event",
            "outbox_event",
            "outbox_relay_waiting",
            "processed_event"
        ]
    );

    // Autovacuum off for one table: a partition of the inbox (a partitioned table has no
    // setting of its own), named where it is set.
    let partition: String = sqlx::query_scalar(
        "SELECT partition::text FROM outbox_partitions('inbox_event') \
         WHERE lower_bound <= now() AND now() < upper_bound",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    sqlx::query(&format!(
        "ALTER TABLE {partition} SET (autovacuum_enabled = off)"
    ))
    .execute(pool)
    .await
    .unwrap();
    let off = health(pool, &thresholds).await.unwrap();
    let table_off: Vec<_> = off
        .warnings
        .iter()
        .filter(|w| matches!(w, Warning::AutovacuumOff { table: Some(_), .. }))
        .collect();
    assert_eq!(
        table_off,
        [&Warning::AutovacuumOff {
            table: Some(partition.clone()),
            setting: "autovacuum_enabled = false".into()
        }]
    );
    assert!(table_off[0].to_string().contains(&format!(
        "autovacuum is off for table {partition} (autovacuum_enabled = false): its dead rows \
         are never removed unless something runs VACUUM (ALTER TABLE {partition} RESET \
         (autovacuum_enabled))"
    )));
    let inbox = off
        .tables
        .iter()
        .find(|t| t.table == "inbox_event")
        .unwrap();
    assert!(!inbox.autovacuum_enabled);
    assert_eq!(inbox.autovacuum_off_in, std::slice::from_ref(&partition));

    // 12,000 dead rows in processed_event: past the threshold, and never vacuumed (in its
    // first partition, which holds everything from before), in an installation two days old
    // (a table created minutes ago is not overdue, see below).
    installed_ago(pool, "2 days").await;
    sqlx::query(
        "INSERT INTO processed_event (event_id, handler, processed_at) \
         SELECT gen_random_uuid(), 'h', now() - interval '2 days' FROM generate_series(1, 12000)",
    )
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("DELETE FROM processed_event")
        .execute(pool)
        .await
        .unwrap();
    let dead = until(pool, &thresholds, "dead rows reported", |h| {
        !of_kind(h, WarningKind::DeadRows).is_empty()
    })
    .await;
    match of_kind(&dead, WarningKind::DeadRows)[..] {
        [Warning::DeadRows { table, dead, .. }] => {
            assert_eq!(table, "processed_event");
            assert_eq!(*dead, 12_000);
        }
        ref other => panic!("{other:?}"),
    }
    assert!(
        of_kind(&dead, WarningKind::VacuumOverdue)
            .iter()
            .any(|w| matches!(
                w,
                Warning::VacuumBehind { table, partition: Some(p), last_vacuum_age_secs: None, .. }
                    if table == "processed_event" && p == "processed_event_history"
            )),
        "{dead:#?}"
    );
    // Ignored kinds are left out.
    let quiet = health(
        pool,
        &thresholds
            .clone()
            .ignore(WarningKind::DeadRows)
            .ignore(WarningKind::VacuumOverdue)
            .ignore(WarningKind::AutovacuumOff),
    )
    .await
    .unwrap();
    assert_eq!(quiet.warnings, [], "{quiet:#?}");

    // A vacuum removes them: both warnings go.
    sqlx::query("VACUUM processed_event")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query(&format!(
        "ALTER TABLE {partition} RESET (autovacuum_enabled)"
    ))
    .execute(pool)
    .await
    .unwrap();
    let clean = until(pool, &thresholds, "the vacuum seen", |h| {
        of_kind(h, WarningKind::DeadRows).is_empty()
            && of_kind(h, WarningKind::VacuumOverdue).is_empty()
    })
    .await;
    let processed = clean
        .tables
        .iter()
        .find(|t| t.table == "processed_event")
        .unwrap();
    assert_eq!(processed.dead_rows, 0);
    assert!(processed.last_vacuum_age_secs.is_some());
    assert_eq!(
        of_kind(&clean, WarningKind::AutovacuumOff).len(),
        usize::from(!server_on)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_in_transaction_session_is_named_with_its_pid_until_it_ends() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    let thresholds = HealthThresholds::default().transaction_age(Duration::from_secs(1));
    let session = HeldTransaction::open(&db.url, "forgotten-migration").await;
    let pid = session.pid;

    let held = until(pool, &thresholds, "the session named", |h| {
        h.warnings
            .iter()
            .any(|w| matches!(w, Warning::LongTransaction { pid: p, .. } if *p == pid))
    })
    .await;
    let warning = held
        .warnings
        .iter()
        .find(|w| w.kind() == WarningKind::LongTransaction)
        .unwrap();
    match warning {
        Warning::LongTransaction {
            application_name,
            state,
            age_secs,
            ..
        } => {
            assert_eq!(application_name, "forgotten-migration");
            assert_eq!(state, "idle in transaction");
            assert!(*age_secs > 1.0, "{age_secs}");
        }
        other => panic!("{other:?}"),
    }
    assert!(warning.to_string().starts_with(&format!(
        "session {pid} (application `forgotten-migration`, user postgres, idle in transaction) \
         has held a transaction open for"
    )));
    assert!(held.oldest_transaction_age_secs.unwrap() > 1.0);

    // Under the default thresholds (30 s for a session idle in its transaction) it is not a
    // warning yet.
    let default = health(pool, &HealthThresholds::default()).await.unwrap();
    assert!(of_kind(&default, WarningKind::LongTransaction).is_empty());

    session.commit().await;
    let ended = until(pool, &thresholds, "the warning gone", |h| {
        of_kind(h, WarningKind::LongTransaction).is_empty()
    })
    .await;
    assert_eq!(ended.oldest_transaction_age_secs, None, "{ended:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_idle_in_its_transaction_is_named_sooner_than_a_busy_one() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    // A busy transaction (a report running a long statement), older than the idle one.
    let mut busy = sqlx::postgres::PgConnectOptions::from_str(&db.url)
        .unwrap()
        .application_name("busy-report")
        .connect()
        .await
        .unwrap();
    let busy_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut busy)
        .await
        .unwrap();
    let report =
        sqlx::raw_sql("BEGIN; SELECT txid_current(); SELECT pg_sleep(120)").execute(&mut busy);
    let checks = async {
        wait_for("the report to run", Duration::from_secs(10), || async {
            count(
                pool,
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE application_name = 'busy-report' AND state = 'active' \
                   AND backend_xid IS NOT NULL",
            )
            .await
                == 1
        })
        .await;
        let idle = HeldTransaction::open(&db.url, "forgotten-session").await;
        let thresholds = HealthThresholds::default().idle_transaction_age(Duration::from_secs(1));
        let named = until(pool, &thresholds, "the idle session named", |h| {
            h.warnings
                .iter()
                .any(|w| matches!(w, Warning::LongTransaction { pid, .. } if *pid == idle.pid))
        })
        .await;
        let busy_age = named.oldest_transaction_age_secs.unwrap();
        assert!(busy_age > 1.0, "{named:#?}");
        assert!(
            !named
                .warnings
                .iter()
                .any(|w| matches!(w, Warning::LongTransaction { pid, .. } if *pid == busy_pid)),
            "a busy transaction of {busy_age} s is no warning under 5 minutes: {named:#?}"
        );
        // The busy one is named too once past the (general) threshold.
        let both = thresholds.transaction_age(Duration::from_secs(1));
        until(pool, &both, "the busy session named", |h| {
            h.warnings
                .iter()
                .any(|w| matches!(w, Warning::LongTransaction { pid, .. } if *pid == busy_pid))
        })
        .await;
        sqlx::query("SELECT pg_cancel_backend($1)")
            .bind(busy_pid)
            .execute(pool)
            .await
            .unwrap();
        idle
    };
    let (report, idle) = tokio::join!(report, checks);
    assert!(report.is_err(), "the report was cancelled");
    idle.commit().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpublished_event_past_the_threshold_warns_until_it_is_published() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    let thresholds = HealthThresholds::default().unpublished_age(Duration::from_secs(1));
    let mut uow = Uow::begin(pool).await.unwrap();
    uow.emit(&PaymentSucceeded {
        payment_id: Uuid::now_v7(),
        order_id: Uuid::now_v7(),
        amount: 5,
    })
    .await
    .unwrap();
    uow.commit().await.unwrap();

    let stale = until(pool, &thresholds, "the event past 1 s", |h| {
        !of_kind(h, WarningKind::OldUnpublished).is_empty()
    })
    .await;
    match of_kind(&stale, WarningKind::OldUnpublished)[..] {
        [Warning::OldUnpublished { topic, age_secs }] => {
            assert_eq!(topic, PAYMENTS);
            assert!(*age_secs > 1.0);
        }
        ref other => panic!("{other:?}"),
    }

    let kafka = Kafka::mock();
    kafka.create_topic(PAYMENTS, 1).await;
    let relay = Relay::builder(pool.clone())
        .brokers(kafka.bootstrap())
        .build()
        .unwrap();
    assert_eq!(relay.publish_pending().await.unwrap(), 1);
    let published = health(pool, &thresholds).await.unwrap();
    assert!(
        of_kind(&published, WarningKind::OldUnpublished).is_empty(),
        "{published:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_keys_parked_and_dead_rows_are_warnings_with_their_topic() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, \
             topic, partition_key, held_at, parked_at, attempts, last_error) \
         SELECT gen_random_uuid(), 'A', 'a', 'E', '{}', t, k, h, p, 1, e \
         FROM (VALUES ('held.events', 'k1', now(), NULL::timestamptz, 'UnknownTopicOrPartition'), \
                      ('held.events', 'k1', now(), NULL, 'UnknownTopicOrPartition'), \
                      ('held.events', 'k2', now(), NULL, 'UnknownTopicOrPartition'), \
                      ('parked.events', 'k', NULL, now(), 'MessageSizeTooLarge')) \
             AS v(t, k, h, p, e)",
    )
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO inbox_event (event_id, topic, event_type, payload, dead_at, last_error) \
         VALUES (gen_random_uuid(), 'in.events', 'E', '{}', now(), 'boom')",
    )
    .execute(pool)
    .await
    .unwrap();
    let report = health(
        pool,
        &HealthThresholds::default().ignore(WarningKind::AutovacuumOff),
    )
    .await
    .unwrap();
    assert_eq!(
        report.warnings,
        [
            Warning::HeldKeys {
                topic: "held.events".into(),
                rows: 3,
                keys: 2,
                error: Some("UnknownTopicOrPartition".into())
            },
            Warning::Parked {
                topic: "parked.events".into(),
                rows: 1
            },
            Warning::DeadInbox {
                topic: "in.events".into(),
                rows: 1
            },
        ],
        "{report:#?}"
    );
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["warnings"][0]["kind"], "held_keys");
    assert_eq!(json["outbox"][0]["topic"], "held.events", "the backlog too");
    assert_eq!(
        report.warnings[0].to_string(),
        "2 keys of `held.events` are held for an operator (3 rows wait): UnknownTopicOrPartition"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_records_its_missing_dead_letter_topic_at_start_and_topics_ensure_creates_it() {
    // tansu: librdkafka's mock cluster does not answer CreateTopics.
    let (db, kafka) = setup_without_dead_letter_topic(Kafka::tansu().await).await;
    let pool = &db.pool;
    let dlq = format!("{PAYMENTS}.dlq");
    // A record the group left behind when it had two retry tiers: it wants that topic no more.
    sqlx::query(
        "INSERT INTO outbox_consumer_missing_topic (group_id, topic, source_topic, role) \
         VALUES ('orders', 'payment.events.retry-2', 'payment.events', 'retry')",
    )
    .execute(pool)
    .await
    .unwrap();
    let consumer = builder(&db, &kafka, "orders")
        .producer_config(no_auto_created_topics())
        .handler(fixtures::mark_order_paid)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    let thresholds = HealthThresholds::default().ignore(WarningKind::AutovacuumOff);

    // No message has failed, none has even arrived: the consumer says so when it starts.
    let missing = until(pool, &thresholds, "the missing topic recorded", |h| {
        h.warnings.iter().any(|w| w.subject().ends_with(".dlq"))
    })
    .await;
    match &missing.warnings[..] {
        [w @ Warning::MissingTopic {
            group,
            topic,
            source,
            role,
            ..
        }] => {
            assert_eq!(
                (
                    group.as_str(),
                    topic.as_str(),
                    source.as_str(),
                    role.as_str()
                ),
                ("orders", dlq.as_str(), PAYMENTS, "dead_letter")
            );
            assert!(w.to_string().starts_with(&format!(
                "consumer group `orders` has no dead-letter topic `{dlq}` for `{PAYMENTS}`"
            )));
        }
        other => panic!("{other:#?}"),
    }

    // `topics ensure` says what it would create, then creates it with the source's partitions.
    let mut config = rdkafka::ClientConfig::new();
    config.set("bootstrap.servers", kafka.bootstrap());
    let plan = EnsureTopics::new().topic(PAYMENTS);
    let summary = |ensured: &[EnsuredTopic]| -> Vec<(String, TopicRole, i32, TopicAction)> {
        ensured
            .iter()
            .map(|t| (t.topic.clone(), t.role, t.partitions, t.action))
            .collect()
    };
    let expected = |dlq_action| {
        vec![
            (
                PAYMENTS.to_owned(),
                TopicRole::Source,
                PARTITIONS,
                TopicAction::Exists,
            ),
            (
                format!("{PAYMENTS}.retry"),
                TopicRole::Retry,
                PARTITIONS,
                TopicAction::Exists,
            ),
            (dlq.clone(), TopicRole::DeadLetter, PARTITIONS, dlq_action),
        ]
    };
    let dry = plan.clone().dry_run(true).run(pool, &config).await.unwrap();
    assert_eq!(summary(&dry), expected(TopicAction::WouldCreate));
    assert_eq!(
        of_kind(
            &health(pool, &thresholds).await.unwrap(),
            WarningKind::MissingTopic
        )
        .len(),
        1,
        "a dry run clears nothing"
    );
    let done = plan.run(pool, &config).await.unwrap();
    assert_eq!(summary(&done), expected(TopicAction::Created));
    let again = plan.run(pool, &config).await.unwrap();
    assert_eq!(
        summary(&again),
        expected(TopicAction::Exists),
        "the broker has it now"
    );
    let cleared = health(pool, &thresholds).await.unwrap();
    assert_eq!(cleared.warnings, [], "{cleared:#?}");

    // A source topic that must be created needs a partition count: refused, naming it.
    let err = EnsureTopics::new()
        .topic("ledger.events")
        .run(pool, &config)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("topic `ledger.events` does not exist: say how many partitions it gets"),
        "{err}"
    );
    running.stop().await;
}

/// Makes the installation `age` old (an SQL interval), as its migrations' ledger says: no table
/// of the framework is older than its first migration.
async fn installed_ago(pool: &PgPool, age: &str) {
    sqlx::query(&format!(
        "UPDATE outbox_schema_migrations SET applied_at = applied_at - interval '{age}'"
    ))
    .execute(pool)
    .await
    .unwrap();
}

/// A partition opened minutes ago with dead rows and no vacuum yet (autovacuum comes at its
/// next round) is not overdue: it can have held rows only since its lower bound. One that
/// opened longer ago than the threshold, in an installation older than that, is, and says it
/// was never vacuumed. The same partition in an installation a minute old is not (the test
/// of the console's banner, `tests/console/vacuum.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_young_partition_not_vacuumed_yet_is_not_overdue() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    fixtures::narrow_partitions(
        pool,
        admin::CleanupTable::Outbox,
        Duration::from_secs(300),
        "now() - interval '2 hours'",
    )
    .await;
    installed_ago(pool, "3 hours").await;
    // Whatever the server's setting, no vacuum comes in between.
    sqlx::raw_sql(
        "DO $$ DECLARE p regclass; BEGIN \
           FOR p IN SELECT partition FROM outbox_partitions('outbox_event') LOOP \
             EXECUTE format('ALTER TABLE %s SET (autovacuum_enabled = off)', p); \
           END LOOP; \
         END $$",
    )
    .execute(pool)
    .await
    .unwrap();
    // 12,000 rows published in this 5-minute partition: 12,000 dead row versions.
    let emit_and_publish = |age: &'static str| async move {
        sqlx::query(&format!(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, \
                                       payload, topic, partition_key, created_at) \
             SELECT gen_random_uuid(), 'A', 'a', 'E', '{{}}', 't', 'k', now() - interval '{age}' \
             FROM generate_series(1, 12000)"
        ))
        .execute(pool)
        .await
        .unwrap();
        sqlx::query("UPDATE outbox_event SET published_at = now() WHERE published_at IS NULL")
            .execute(pool)
            .await
            .unwrap();
    };
    emit_and_publish("0 minutes").await;
    let thresholds = HealthThresholds::default().dead_rows(1_000_000);
    let young = until(pool, &thresholds, "the dead rows counted", |h| {
        h.tables
            .iter()
            .any(|t| t.table == "outbox_event" && t.dead_rows >= 12_000)
    })
    .await;
    assert!(
        of_kind(&young, WarningKind::VacuumOverdue).is_empty(),
        "{young:#?}"
    );
    // The same in a partition that opened 90 minutes ago (past the 1 h threshold).
    emit_and_publish("90 minutes").await;
    let old = until(pool, &thresholds, "the older partition overdue", |h| {
        !of_kind(h, WarningKind::VacuumOverdue).is_empty()
    })
    .await;
    match of_kind(&old, WarningKind::VacuumOverdue)[..] {
        [w @ Warning::VacuumBehind {
            table,
            partition: Some(partition),
            last_vacuum_age_secs: None,
            rows_age_secs: Some(age),
            autovacuum_at: None,
            ..
        }] => {
            assert_eq!(table, "outbox_event");
            assert!(*age >= 90.0 * 60.0 && *age < 100.0 * 60.0, "{age}");
            let text = w.to_string();
            assert!(
                text.starts_with(&format!(
                    "partition {partition} of outbox_event has never been vacuumed in the 1h"
                )) && text.contains("holds 12,000 dead rows"),
                "{text}"
            );
        }
        ref other => panic!("{other:?}"),
    }
}

/// An outbox whose partitions pile up (no retention, or narrow partitions) is named: every
/// claim reads each partition. Retention drops them, and the warning goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_with_many_partitions_is_named_until_retention_drops_them() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    // Ten-minute partitions from four hours ago to an hour ahead: about thirty.
    fixtures::narrow_partitions(
        pool,
        admin::CleanupTable::Outbox,
        Duration::from_secs(600),
        "now() - interval '4 hours'",
    )
    .await;
    let thresholds = HealthThresholds::default().max_partitions(20);
    let before = health(pool, &thresholds).await.unwrap();
    match of_kind(&before, WarningKind::ManyPartitions)[..] {
        [w @ Warning::ManyPartitions { table, partitions }] => {
            assert_eq!(table, "outbox_event");
            assert!((25..=40).contains(partitions), "{partitions}");
            assert!(
                w.to_string().starts_with(&format!(
                    "outbox_event has {partitions} partitions, and every claim reads each of them"
                )),
                "{w}"
            );
        }
        ref other => panic!("{other:?}"),
    }
    // The default threshold (60) is not reached.
    let default = health(pool, &HealthThresholds::default()).await.unwrap();
    assert!(of_kind(&default, WarningKind::ManyPartitions).is_empty());

    // Retention with an hour's window drops those that ended before it.
    admin::Retention::new(Duration::from_secs(3600))
        .run_once(pool)
        .await
        .unwrap()
        .expect("no other retention run");
    let after = health(pool, &thresholds).await.unwrap();
    assert_eq!(
        of_kind(&after, WarningKind::ManyPartitions),
        Vec::<&Warning>::new()
    );
}

/// A conversion stopped midway leaves its bound on the plain table, which refuses every insert
/// once it is past: named, with when, until the conversion is run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversion_stopped_midway_is_named_with_when_inserts_start_failing() {
    let db = TestDb::before_partitions().await;
    let pool = &db.pool;
    // What a conversion killed after its second step leaves: the bound, a day ahead.
    let bound: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT date_trunc('second', now() + interval '1 day')")
            .fetch_one(pool)
            .await
            .unwrap();
    sqlx::raw_sql(&format!(
        "ALTER TABLE outbox_event ADD CONSTRAINT outbox_event_before_partitions \
         CHECK (created_at < '{}') NOT VALID",
        bound.to_rfc3339()
    ))
    .execute(pool)
    .await
    .unwrap();
    let thresholds = HealthThresholds::default();
    let stopped = health(pool, &thresholds).await.unwrap();
    match of_kind(&stopped, WarningKind::ConversionInterrupted)[..] {
        [w @ Warning::ConversionInterrupted {
            table,
            constraint,
            refuses_from,
            in_secs,
        }] => {
            assert_eq!(
                (table.as_str(), constraint.as_str()),
                ("outbox_event", "outbox_event_before_partitions")
            );
            assert_eq!(*refuses_from, bound);
            assert!((86_300.0..=86_400.0).contains(in_secs), "{in_secs}");
            assert!(
                w.to_string().starts_with(
                    "converting outbox_event to partitions stopped midway: its constraint \
                     outbox_event_before_partitions refuses every insert from "
                ),
                "{w}"
            );
        }
        ref other => panic!("{other:?}"),
    }
    // Run again, the conversion finishes: the bound is the first partition's now.
    let converted = admin::convert_to_partitions(pool, admin::CleanupTable::Outbox)
        .await
        .unwrap();
    assert!(
        matches!(converted, admin::Conversion::Converted { .. }),
        "{converted:?}"
    );
    let done = health(pool, &thresholds).await.unwrap();
    assert!(
        of_kind(&done, WarningKind::ConversionInterrupted).is_empty(),
        "{done:#?}"
    );
}
