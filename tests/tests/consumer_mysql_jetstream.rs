//! JetStream consumers on MariaDB (the machine's 10.11), dedup mode, each test with its own
//! nats-server: what the group's lease on a topic does there that PostgreSQL's does not (its
//! time in `outbox_consumer_lease`, the name every batch checks in `outbox_consumer_fence`).
//! An instance whose lease was taken while its batch ran commits that batch and nothing more
//! (the takeover waits for it); a standby leaves an expired lease alone while a batch of its
//! holder runs; a lease whose fence row was deleted by hand is taken again; and `build` refuses
//! what the lease's columns cannot hold. The suite both
//! databases share (order, effects once, crashes, handovers) is `jetstream_lease.rs`.

use std::time::Duration;

use outbox_runtime::inbox::{Consumer, ConsumerBuilder, HandlerError};
use outbox_runtime::relay::JetStream;
use outbox_tests::deposits::{deposit, interleaved, Deposited, TOPIC};
use outbox_tests::kafka::Outgoing;
use outbox_tests::log::Log;
use outbox_tests::mysql::{count, create_steps, insert_step, record_step, steps, MySqlTestDb};
use outbox_tests::nats::NatsServer;
use outbox_tests::payments::wait_for;
use outbox_tests::Running;
use sqlx::{Executor, MySqlConnection};

/// The accounts stream.
const STREAM: &str = "ACCOUNTS";

/// A test's database with the steps table, and its own server with the accounts stream.
async fn setup() -> (MySqlTestDb, NatsServer) {
    let db = MySqlTestDb::new().await;
    create_steps(&db.pool).await;
    let server = NatsServer::start().await;
    server.create_stream(STREAM, TOPIC, |_| {}).await;
    (db, server)
}

/// A consumer of group `group` on `db`, reading `server`'s JetStream (a lease of 2 s).
async fn builder(
    db: &MySqlTestDb,
    server: &NatsServer,
    group: &str,
) -> ConsumerBuilder<(), sqlx::MySql> {
    Consumer::builder(db.pool.clone())
        .jetstream(JetStream::new(server.client().await).ack_wait(Duration::from_secs(2)))
        .group_id(group)
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(200))
}

/// Waits until group `group` has settled every message of the stream.
async fn wait_settled(server: &NatsServer, group: &str) {
    let durable = format!("{group}_{}", TOPIC.replace('.', "_"));
    wait_for("every message settled", Duration::from_secs(60), || async {
        server.unsettled(STREAM, &durable).await == Some((0, 0))
    })
    .await;
}

/// The group's lease as `outbox status` shows it: (owned, seconds until it expires).
async fn lease(db: &MySqlTestDb, group: &str) -> (bool, Option<f64>) {
    let leases = outbox_runtime::mysql::status(&db.pool)
        .await
        .unwrap()
        .consumer_leases;
    let lease = leases
        .iter()
        .find(|l| l.group == group)
        .unwrap_or_else(|| panic!("no lease of {group}: {leases:?}"));
    assert_eq!(lease.topic, TOPIC);
    (lease.owned, lease.expires_in_secs)
}

/// This test binary's log at `INFO` (each test finds its own group's lines).
fn log() -> &'static Log {
    static LOG: std::sync::OnceLock<Log> = std::sync::OnceLock::new();
    LOG.get_or_init(|| Log::install(tracing::Level::INFO))
}

/// [`record_step_held_at_first`] is in its first call.
static HELD: tokio::sync::Notify = tokio::sync::Notify::const_new();
/// Lets [`record_step_held_at_first`]'s first call go on.
static LET_GO: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// [`record_step`], its first call (account 0's first event) held until the test lets it go.
#[outbox_runtime::inbox_handler]
async fn record_step_held_at_first(
    event: Deposited,
    tx: &mut MySqlConnection,
) -> Result<(), HandlerError> {
    if event.seq == 0 {
        HELD.notify_one();
        LET_GO.notified().await;
    }
    insert_step(tx, &event).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_whose_lease_was_taken_commits_nothing_more_until_it_owns_it_again() {
    let log = log();
    let (db, server) = setup().await;
    let consumer = builder(&db, &server, "fenced")
        .await
        .handler(record_step_held_at_first)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    let records = interleaved(1, 2);
    server.publish(TOPIC, &records[..1]).await;
    tokio::time::timeout(Duration::from_secs(30), HELD.notified())
        .await
        .expect("the first event handled");
    // While its first batch runs (the fence passed), another instance takes the lease over, as
    // `try_acquire` does once it expired: its time is written at once, but the fence waits for
    // the batch to end.
    let mut other = db.connection().await;
    let takeover = tokio::spawn(async move {
        other
            .execute(sqlx::raw_sql(
                "START TRANSACTION; \
                 UPDATE outbox_consumer_lease \
                 SET holder = UNHEX(REPLACE(UUID(), '-', '')), \
                     expires_at = UTC_TIMESTAMP(6) + INTERVAL 1 HOUR \
                 WHERE group_id = 'fenced'; \
                 UPDATE outbox_consumer_fence \
                 SET holder = (SELECT holder FROM outbox_consumer_lease WHERE group_id = 'fenced') \
                 WHERE group_id = 'fenced'; \
                 COMMIT",
            ))
            .await
            .unwrap();
        other
    });
    let pool = db.pool.clone();
    wait_for(
        "the takeover waiting for the batch's fence",
        Duration::from_secs(30),
        || async {
            count(
                &pool,
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
                 WHERE INFO LIKE 'UPDATE outbox_consumer_fence%'",
            )
            .await
                == 1
        },
    )
    .await;
    assert!(
        !takeover.is_finished(),
        "the fence did not hold the takeover"
    );
    server.publish(TOPIC, &records[1..]).await;
    LET_GO.notify_one();
    // The batch that checked the lease before it was taken commits; the next one is refused.
    drop(takeover.await.unwrap());
    wait_for(
        "the next batch refused",
        Duration::from_secs(30),
        || async {
            log.text().lines().any(|line| {
                line.contains("another instance owns the lease") && line.contains("\"fenced\"")
            })
        },
    )
    .await;
    assert_eq!(steps(&db.pool).await["acct-0"], vec![0]);
    // The other instance gives it up: this one takes it again, and goes on in order.
    sqlx::query(
        "UPDATE outbox_consumer_lease SET holder = NULL, expires_at = UTC_TIMESTAMP(6) \
         WHERE group_id = 'fenced'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    wait_settled(&server, "fenced").await;
    running.stop().await;
    assert_eq!(steps(&db.pool).await["acct-0"], vec![0, 1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_leaves_an_expired_lease_alone_while_a_batch_of_its_holder_runs() {
    let log = log();
    let (db, server) = setup().await;
    server.publish(TOPIC, &interleaved(2, 5)).await;
    // Another instance holds the lease and let it expire (it stalled), while a batch of it
    // runs: its fence row locked as a batch locks it.
    let stalled = uuid::Uuid::now_v7();
    let mut holder = db.connection().await;
    for table in ["outbox_consumer_lease", "outbox_consumer_fence"] {
        let expires = if table == "outbox_consumer_lease" {
            ", expires_at) VALUES (?, ?, ?, UTC_TIMESTAMP(6) - INTERVAL 1 MINUTE)"
        } else {
            ") VALUES (?, ?, ?)"
        };
        sqlx::query(&format!(
            "INSERT INTO {table} (group_id, topic, holder{expires}"
        ))
        .bind("held")
        .bind(TOPIC)
        .bind(stalled)
        .execute(&mut holder)
        .await
        .unwrap();
    }
    holder
        .execute(sqlx::raw_sql(
            "START TRANSACTION; \
             SELECT COUNT(*) FROM outbox_consumer_fence WHERE group_id = 'held' \
             LOCK IN SHARE MODE",
        ))
        .await
        .unwrap();
    let consumer = builder(&db, &server, "held")
        .await
        .handler(record_step)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    wait_for(
        "the new instance standing by",
        Duration::from_secs(30),
        || async {
            log.text()
                .lines()
                .any(|line| line.contains("standing by") && line.contains("group=held"))
        },
    )
    .await;
    assert!(
        steps(&db.pool).await.is_empty(),
        "read beside a running batch"
    );
    // The batch ends: the expired lease is taken over, and everything handled in order.
    holder.execute("COMMIT").await.unwrap();
    wait_settled(&server, "held").await;
    running.stop().await;
    for (account, seqs) in steps(&db.pool).await {
        assert_eq!(seqs, (0..5).collect::<Vec<i64>>(), "account {account}");
    }
    assert_eq!(lease(&db, "held").await, (false, None));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_whose_fence_row_was_deleted_is_taken_again() {
    let (db, server) = setup().await;
    server.publish(TOPIC, &interleaved(2, 3)).await;
    let consumer = builder(&db, &server, "unfenced")
        .await
        .handler(record_step)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    wait_settled(&server, "unfenced").await;
    // An operator deletes the fence row (a cleanup by hand, a restore of some tables only):
    // the holder's next batch finds no row naming it, and the lease is taken again, the row
    // written anew, rather than the topic standing still.
    let deleted = sqlx::query(
        "DELETE FROM outbox_consumer_fence WHERE group_id = 'unfenced' AND holder IS NOT NULL",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    assert_eq!(deleted.rows_affected(), 1);
    let more: Vec<_> = (3..6)
        .map(|seq| Outgoing::event(&deposit(0, seq), uuid::Uuid::now_v7()))
        .collect();
    server.publish(TOPIC, &more).await;
    wait_settled(&server, "unfenced").await;
    running.stop().await;
    let steps: Vec<Vec<i64>> = steps(&db.pool).await.into_values().collect();
    assert_eq!(steps, [(0..6).collect::<Vec<i64>>(), (0..3).collect()]);
    assert_eq!(
        count(
            &db.pool,
            "SELECT COUNT(*) FROM outbox_consumer_fence WHERE group_id = 'unfenced'"
        )
        .await,
        1,
        "the fence row written anew"
    );
}

#[tokio::test]
async fn build_refuses_a_group_the_lease_cannot_hold() {
    let (db, server) = setup().await;
    for (group, expected) in [
        (
            "g".repeat(256),
            "longer than a JetStream consumer's lease holds",
        ),
        ("ledger ".to_owned(), "ends with a space"),
    ] {
        let refused = builder(&db, &server, &group)
            .await
            .handler(record_step)
            .build()
            .unwrap_err()
            .to_string();
        assert!(refused.contains(expected), "{refused}");
    }
}
