//! Inbox mode keeps each key's order: several processors in several consumer instances of one
//! group, failures retried, on the mock cluster, JetStream and RabbitMQ. A row waiting for its retry
//! holds back the later rows of its key, and no other key.

use std::time::Duration;

use outbox_runtime::inbox::{Consumer, ConsumerBuilder, HandlerError, MessageMeta, Mode};
use outbox_runtime::relay::{JetStream, RabbitMq};
use outbox_tests::fixtures::PAYMENTS;
use outbox_tests::kafka::Outgoing;
use outbox_tests::nats::NatsServer;
use outbox_tests::payments::{builder, setup, wait_for};
use outbox_tests::rabbitmq::{self as mq, Vhost};
use outbox_tests::{count, Running, TestDb};
use sqlx::PgPool;
use uuid::Uuid;

/// The `n`-th event of account `account`; its handler checks it comes right after the
/// `n - 1`-th.
#[derive(serde::Serialize, serde::Deserialize, outbox_runtime::OutboxEvent)]
#[outbox(
    topic = "payment.events",
    aggregate_type = "Account",
    event_type = "Step"
)]
struct Step {
    #[outbox(aggregate_id)]
    account: String,
    n: i64,
}

/// The account whose first event fails until the test releases it (`gate`).
const STUCK: &str = "stuck";

/// Records the step, with the step its account was at before it, in the processor's
/// transaction (so two transactions on one account queue on its row). A step with
/// `n % 7 == 3` fails on its first attempt; the stuck account's first one until released.
#[outbox_runtime::inbox_handler]
async fn record_step(
    event: Step,
    tx: &mut sqlx::PgConnection,
    meta: &MessageMeta,
) -> Result<(), HandlerError> {
    if event.n % 7 == 3 && meta.attempt() == 1 {
        return Err(HandlerError::retryable(
            "first attempts at every seventh step fail",
        ));
    }
    if event.account == STUCK && event.n == 0 {
        let released: bool = sqlx::query_scalar("SELECT released FROM gate")
            .fetch_one(&mut *tx)
            .await?;
        if !released {
            return Err(HandlerError::retryable(
                "the stuck account is not released yet",
            ));
        }
    }
    sqlx::query(
        "INSERT INTO steps (account, n, previous) \
         SELECT $1, $2, last FROM progress WHERE account = $1 FOR UPDATE",
    )
    .bind(&event.account)
    .bind(event.n)
    .execute(&mut *tx)
    .await?;
    sqlx::query("UPDATE progress SET last = $2 WHERE account = $1")
        .bind(&event.account)
        .bind(event.n)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Each account's progress (`last`: -1 before its first step), every step recorded, and
/// the stuck account's gate.
async fn create_tables(pool: &PgPool, accounts: &[String]) {
    sqlx::query("CREATE TABLE gate AS SELECT false AS released")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("CREATE TABLE progress (account text PRIMARY KEY, last bigint NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("CREATE TABLE steps (account text NOT NULL, n bigint NOT NULL, previous bigint)")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO progress SELECT unnest($1::text[]), -1")
        .bind(accounts)
        .execute(pool)
        .await
        .unwrap();
}

/// `per_account` steps of each account, interleaved (step 0 of each, then step 1, ...).
fn steps(accounts: &[String], per_account: i64) -> Vec<Outgoing> {
    (0..per_account)
        .flat_map(|n| {
            accounts.iter().map(move |account| {
                let step = Step {
                    account: account.clone(),
                    n,
                };
                Outgoing::event(&step, Uuid::now_v7())
            })
        })
        .collect()
}

/// Steps recorded out of their account's order (after a later one, or twice), as
/// "account n after previous".
async fn out_of_order(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT account || ' ' || n || ' after ' || coalesce(previous::text, 'none') \
         FROM steps WHERE previous IS DISTINCT FROM n - 1 ORDER BY account, n LIMIT 20",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// No step recorded out of its account's order, and every row processed.
async fn all_in_order(pool: &PgPool) {
    assert_eq!(out_of_order(pool).await, Vec::<String>::new());
    assert_eq!(
        count(pool, "SELECT count(*) FROM inbox_event WHERE NOT processed").await,
        0
    );
}

/// An inbox consumer quick to retry, with two processors in small batches.
fn inbox(builder: ConsumerBuilder) -> Consumer {
    processing(builder, 2)
}

/// An inbox consumer quick to retry, with `processors` processors in small batches.
fn processing(builder: ConsumerBuilder, processors: usize) -> Consumer {
    builder
        .handler(record_step)
        .mode(Mode::Inbox)
        .processors(processors)
        .batch_size(40)
        .max_attempts(1_000)
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap()
}

/// Two consumers of one group, two processors each, handle every step once in its
/// account's order, though every seventh step fails once; while the stuck account's first
/// step waits for its retry, every other account finishes and none of the stuck one's later
/// steps is handled.
async fn in_order(db: &TestDb, consumers: [Consumer; 2], accounts: &[String], per_account: i64) {
    let running: Vec<Running> = consumers.iter().map(Running::consumer).collect();
    let others = (accounts.len() as i64 - 1) * per_account;
    wait_for(
        "every account but the stuck one done",
        Duration::from_secs(120),
        || async {
            count(
                &db.pool,
                "SELECT count(*) FROM steps WHERE account <> 'stuck'",
            )
            .await
                == others
        },
    )
    .await;
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM steps WHERE account = 'stuck'"
        )
        .await,
        0,
        "the stuck account's later steps wait for its first"
    );
    sqlx::query("UPDATE gate SET released = true")
        .execute(&db.pool)
        .await
        .unwrap();
    let all = accounts.len() as i64 * per_account;
    wait_for("every step handled", Duration::from_secs(120), || async {
        count(&db.pool, "SELECT count(*) FROM steps").await == all
    })
    .await;
    for r in running {
        r.stop().await;
    }
    all_in_order(&db.pool).await;
}

fn accounts() -> Vec<String> {
    std::iter::once(STUCK.to_owned())
        .chain((0..24).map(|i| format!("account-{i}")))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_processors_keep_each_keys_order_across_instances_on_the_mock_cluster() {
    let (db, kafka) = setup().await;
    let accounts = accounts();
    create_tables(&db.pool, &accounts).await;
    outbox_tests::kafka::produce(&kafka.bootstrap(), PAYMENTS, &steps(&accounts, 60)).await;
    let consumers = [
        inbox(builder(&db, &kafka, "ledger")),
        inbox(builder(&db, &kafka, "ledger")),
    ];
    in_order(&db, consumers, &accounts, 60).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_processors_keep_each_keys_order_across_instances_on_jetstream() {
    let db = TestDb::new().await;
    let server = NatsServer::start().await;
    server.create_stream("PAYMENTS", PAYMENTS, |_| {}).await;
    let accounts = accounts();
    create_tables(&db.pool, &accounts).await;
    server.publish(PAYMENTS, &steps(&accounts, 60)).await;
    let jetstream = |client| {
        Consumer::builder(db.pool.clone())
            .jetstream(JetStream::new(client).ack_wait(Duration::from_secs(2)))
            .group_id("ledger")
            .retry_backoff(Duration::from_millis(20), Duration::from_millis(200))
    };
    let consumers = [
        inbox(jetstream(server.client().await)),
        inbox(jetstream(server.client().await)),
    ];
    in_order(&db, consumers, &accounts, 60).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_processors_keep_each_keys_order_across_instances_on_rabbitmq() {
    const SHARDS: u16 = 4;
    let vhost = Vhost::new("io-order");
    let url = vhost.url();
    let db = TestDb::new().await;
    let accounts = accounts();
    create_tables(&db.pool, &accounts).await;
    let rabbit = || {
        RabbitMq::new(&url)
            .shards(SHARDS)
            .heartbeat(Duration::from_secs(2))
    };
    rabbit().ensure_topology(PAYMENTS, "ledger").await.unwrap();
    mq::publish_sharded(&url, PAYMENTS, SHARDS, &steps(&accounts, 60)).await;
    let rabbitmq = || {
        Consumer::builder(db.pool.clone())
            .rabbitmq(rabbit())
            .group_id("ledger")
            .retry_backoff(Duration::from_millis(20), Duration::from_millis(200))
    };
    let consumers = [inbox(rabbitmq()), inbox(rabbitmq())];
    in_order(&db, consumers, &accounts, 60).await;
}

/// Stores `per_account` steps of each account in the inbox as receipts store them,
/// interleaved (step 0 of each, then step 1, ...).
async fn received_steps(pool: &PgPool, accounts: &[String], per_account: i64) {
    sqlx::query(
        "INSERT INTO inbox_event (event_id, topic, event_type, partition_key, payload, \
             source_partition, source_offset) \
         SELECT gen_random_uuid(), 'payment.events', 'Step', a.account, \
                jsonb_build_object('account', a.account, 'n', n), 0, \
                n * 1000 + a.i \
         FROM generate_series(0, $2 - 1) AS n, unnest($1::text[]) WITH ORDINALITY AS a(account, i) \
         ORDER BY n, a.i",
    )
    .bind(accounts)
    .bind(per_account)
    .execute(pool)
    .await
    .unwrap();
}

/// Processors hold shards of the keys through their sessions: when a processor's session
/// ends (here ended by the server, again and again, mid-batch), its shards go to the others
/// or to it once it reconnects, and no key's rows are handled out of order or twice, though
/// every seventh step fails once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_processor_whose_session_ends_hands_its_keys_on_in_order() {
    let db = TestDb::new().await;
    let accounts: Vec<String> = (0..16).map(|i| format!("account-{i}")).collect();
    create_tables(&db.pool, &accounts).await;
    sqlx::query("UPDATE gate SET released = true")
        .execute(&db.pool)
        .await
        .unwrap();
    let per_account = 150;
    received_steps(&db.pool, &accounts, per_account).await;
    let consumers: Vec<Consumer> = (0..2)
        .map(|_| {
            let builder = Consumer::builder(db.pool.clone())
                .brokers("127.0.0.1:9")
                .group_id("handover");
            processing(builder, 0)
        })
        .collect();
    let cancel = tokio_util::sync::CancellationToken::new();
    let mut processors = tokio::task::JoinSet::new();
    for consumer in &consumers {
        for _ in 0..2 {
            let (consumer, cancel) = (consumer.clone(), cancel.clone());
            processors.spawn(async move { consumer.run_processor(cancel).await });
        }
    }
    wait_for("four processors seen", Duration::from_secs(30), || async {
        outbox_runtime::admin::status(&db.pool)
            .await
            .unwrap()
            .inbox_processors
            == 4
    })
    .await;
    let all = accounts.len() as i64 * per_account;
    let steps = || count(&db.pool, "SELECT count(*) FROM steps");
    let mut ended = 0;
    let mut last = 0;
    while ended < 12 {
        // Once more rows were handled since the last time, a processor's session is ended.
        wait_for("progress", Duration::from_secs(60), || async {
            let now = steps().await;
            now > last || now == all
        })
        .await;
        last = steps().await;
        if last == all {
            break;
        }
        let n: i64 = sqlx::query_scalar(
            "SELECT count(pg_terminate_backend(pid)) FROM (SELECT pid FROM pg_stat_activity \
             WHERE datname = current_database() AND application_name = 'outbox-inbox-processor' \
             ORDER BY random() LIMIT 1) s",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        ended += n;
    }
    wait_for("every step handled", Duration::from_secs(120), || async {
        steps().await == all
    })
    .await;
    cancel.cancel();
    while let Some(ended) = processors.join_next().await {
        ended.unwrap().unwrap();
    }
    assert!(ended >= 3, "only {ended} processor sessions were ended");
    all_in_order(&db.pool).await;
}
