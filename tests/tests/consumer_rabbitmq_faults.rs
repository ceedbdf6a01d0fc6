//! RabbitMQ consumers on PostgreSQL when things break (a consumer gone after its commit and
//! before its acknowledgement is `rabbitmq_contract.rs`'s, on both databases): a node
//! SIGKILLed and started again several times under load, in both modes (every committed event
//! takes effect once, each key's order is kept, the consumer and the relay come back by
//! themselves).

use std::time::Duration;

use outbox_runtime::inbox::{Consumer, HandlerError, Mode};
use outbox_runtime::relay::{RabbitMq, Relay};
use outbox_runtime::Uow;
use outbox_tests::deposits::{create_steps, deposit, steps, wait_until_published, TOPIC};
use outbox_tests::fixtures::{self, PaymentSucceeded, PAYMENTS};
use outbox_tests::payments::{orders_with_payments, paid_counts, records, wait_for};
use outbox_tests::rabbitmq::{self as mq, RabbitNode, Vhost};
use outbox_tests::{count, Running, TestDb};
use tokio_util::sync::CancellationToken;

const SHARDS: u16 = 4;

/// Emits one event for each of `accounts` accounts per unit of work, seq after seq, until
/// `stop` fires; returns how many seqs each account got.
async fn emit_until(pool: sqlx::PgPool, accounts: usize, stop: CancellationToken) -> u64 {
    let mut seq = 0;
    while !stop.is_cancelled() {
        let events: Vec<_> = (0..accounts).map(|a| deposit(a, seq)).collect();
        let mut uow = Uow::begin(&pool).await.unwrap();
        uow.emit_all(&events).await.unwrap();
        uow.commit().await.unwrap();
        seq += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    seq
}

/// What the node says of its queues (each shard queue's Raft state), and its log's end.
fn diagnosis(node: &RabbitNode) -> String {
    let mut out = mq::rabbitmqctl(
        Some(node),
        &["list_queues", "name", "type", "messages", "consumers"],
    );
    let quorum = out.contains("quorum");
    for s in (0..SHARDS).filter(|_| quorum) {
        let queue = format!("{TOPIC}.ledger.{s}");
        out += &mq::rabbitmq_cli("rabbitmq-queues", Some(node), &["quorum_status", &queue]);
    }
    out + &node.log_tail()
}

/// Records the step (both modes).
#[outbox_runtime::inbox_handler]
async fn step(
    event: outbox_tests::deposits::Deposited,
    tx: &mut sqlx::PgConnection,
) -> Result<(), HandlerError> {
    outbox_tests::deposits::insert_step(tx, &event).await
}

/// A node SIGKILLed and started again `kills` times while events are emitted, relayed and
/// consumed in `mode` (queues quorum or classic per `quorum`): every committed event takes
/// effect once, in each key's order (dedup mode; the inbox processes in order of receipt).
async fn killed_under_load(mode: Mode, quorum: bool, kills: usize) {
    let _ = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_test_writer()
        .try_init();
    let mut node = RabbitNode::start().await;
    let url = node.url();
    let rabbit = RabbitMq::new(&url)
        .shards(SHARDS)
        .quorum_queues(quorum)
        .heartbeat(Duration::from_secs(2));
    let db = TestDb::new().await;
    create_steps(&db.pool).await;
    let consumer = Consumer::builder(db.pool.clone())
        .rabbitmq(rabbit.clone())
        .group_id("ledger")
        .handler(step)
        .mode(mode)
        .retry_backoff(Duration::from_millis(50), Duration::from_millis(500))
        .build()
        .unwrap();
    let consuming = Running::consumer(&consumer);
    wait_for("the queues declared", Duration::from_secs(30), || async {
        let mut queues = vec![format!("{TOPIC}.dlq")];
        queues.extend((0..SHARDS).map(|s| format!("{TOPIC}.ledger.{s}")));
        queues.extend((0..SHARDS).map(|s| format!("{TOPIC}.ledger.{s}.retry")));
        for q in &queues {
            if mq::queue_depth(&url, q).await.is_none() {
                return false;
            }
        }
        true
    })
    .await;
    if quorum {
        // RabbitMQ 3.10 would lose a queue declared just before a SIGKILL: see there.
        node.sync_quorum_registry();
    }
    let relay = Relay::builder(db.pool.clone())
        .rabbitmq(rabbit.clone())
        .poll_interval(Duration::from_millis(100))
        .publish_timeout(Duration::from_secs(5))
        .retry_backoff(Duration::from_millis(50), Duration::from_millis(500))
        .max_attempts(100_000)
        .build()
        .unwrap();
    let relaying = Running::relay(&relay);
    let stop = CancellationToken::new();
    let emitting = tokio::spawn(emit_until(db.pool.clone(), 10, stop.clone()));
    let pool = db.pool.clone();
    for round in 1..=kills {
        let before = count(&pool, "SELECT count(*) FROM steps").await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        while count(&pool, "SELECT count(*) FROM steps").await < before + 100 {
            if tokio::time::Instant::now() >= deadline {
                panic!("round {round}: no progress in 120 s\n{}", diagnosis(&node));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        eprintln!(
            "round {round}: killing {} at {} steps",
            node.node_name(),
            before
        );
        node.kill();
        node.spawn().await;
    }
    stop.cancel();
    let seqs = emitting.await.unwrap();
    let total = 10 * seqs as i64;
    wait_until_published(&db.pool, Duration::from_secs(120)).await;
    let handled = || async { count(&pool, "SELECT count(*) FROM steps").await };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while handled().await < total {
        if tokio::time::Instant::now() >= deadline {
            panic!(
                "{} of {total} handled after 120 s\n{}",
                handled().await,
                diagnosis(&node)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!consuming.is_finished() && !relaying.is_finished());
    relaying.stop().await;
    consuming.stop().await;
    let steps = steps(&db.pool).await;
    assert_eq!(steps.len(), 10);
    for (account, mut seqs_seen) in steps {
        if mode == Mode::Inbox {
            seqs_seen.sort_unstable();
        }
        assert_eq!(
            seqs_seen,
            (0..seqs as i64).collect::<Vec<_>>(),
            "account {account}: each once{}",
            if mode == Mode::Dedup {
                ", in order"
            } else {
                ""
            }
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_a_node_killed_under_load_loses_nothing_and_repeats_nothing() {
    killed_under_load(Mode::Dedup, true, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_a_node_killed_under_load_loses_nothing_and_repeats_nothing() {
    killed_under_load(Mode::Inbox, true, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_queue_a_kill_left_leaderless_is_consumed_once_declared_again() {
    // Killed right after declaring its queues, a RabbitMQ 3.10 node brings the queues back
    // as Ra servers with no leader, ever (see `RabbitNode::sync_quorum_registry`); a fixed
    // one brings them back whole. Either way the consumer, started meanwhile, consumes once
    // the queue works: at once, or once an operator deleted it (and the consumer declared it
    // again), without a restart.
    let mut node = RabbitNode::start().await;
    let url = node.url();
    let rabbit = RabbitMq::new(&url)
        .shards(1)
        .heartbeat(Duration::from_secs(2));
    rabbit.ensure_topology(TOPIC, "ledger").await.unwrap();
    node.kill();
    node.spawn().await;
    let queue = format!("{TOPIC}.ledger.0");
    let status = mq::rabbitmq_cli("rabbitmq-queues", Some(&node), &["quorum_status", &queue]);
    let leaderless = !status.contains("leader");
    eprintln!(
        "after the kill, {queue} is {}",
        if leaderless { "leaderless" } else { "whole" }
    );
    let db = TestDb::new().await;
    create_steps(&db.pool).await;
    let consumer = Consumer::builder(db.pool.clone())
        .rabbitmq(rabbit)
        .group_id("ledger")
        .handler(step)
        .retry_backoff(Duration::from_millis(50), Duration::from_millis(500))
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    if leaderless {
        // What the consumer's warning tells the operator to do.
        mq::rabbitmqctl(Some(&node), &["delete_queue", &queue]);
    }
    // Read from: declared (again) and bound, so that what is published next is routed to it
    // (published between its declaration and its binding, it would be dropped).
    wait_for(
        "the queue declared and read",
        Duration::from_secs(60),
        || async {
            mq::list_consumers(Some(&node), "/")
                .iter()
                .any(|(q, _)| *q == queue)
        },
    )
    .await;
    let records = outbox_tests::deposits::interleaved(3, 5);
    mq::publish(&url, TOPIC, "0", &records).await;
    let pool = db.pool.clone();
    wait_for("all 15 handled", Duration::from_secs(60), || async {
        count(&pool, "SELECT count(*) FROM steps").await == 15
    })
    .await;
    assert!(!running.is_finished());
    running.stop().await;
    for (account, seqs) in steps(&db.pool).await {
        assert_eq!(seqs, (0..5).collect::<Vec<i64>>(), "account {account}");
    }
}

/// Times [`pay_but_hang_on_13`] took a payment of 13 in hand.
static HUNG: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Marks the order paid; a payment of 13 never returns (the consumer is taken down holding it).
#[outbox_runtime::inbox_handler]
async fn pay_but_hang_on_13(
    event: PaymentSucceeded,
    tx: &mut sqlx::PgConnection,
) -> Result<(), HandlerError> {
    if event.amount == 13 {
        HUNG.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        std::future::pending::<()>().await;
    }
    sqlx::query("UPDATE orders SET paid = paid + 1 WHERE id = $1")
        .bind(event.order_id)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_keeps_taking_its_consumer_down_is_dead_lettered_by_the_node() {
    let vhost = Vhost::new("rc-limit");
    let url = vhost.url();
    let db = TestDb::new().await;
    fixtures::create_orders(&db.pool).await;
    let rabbit = RabbitMq::new(&url).shards(1);
    rabbit.ensure_topology(PAYMENTS, "orders").await.unwrap();
    let mut payments = orders_with_payments(&db.pool, 5).await;
    payments[0].1.amount = 13;
    mq::publish(&url, PAYMENTS, "0", &records(&payments)).await;
    // A consumer taken down (aborted) each time it holds the payment of 13, as a handler that
    // crashes its process would.
    let mut downs = 0;
    while mq::queue_depth(&url, &format!("{PAYMENTS}.dlq")).await == Some(0) {
        assert!(downs <= 25, "still not dead-lettered after {downs} crashes");
        let before = HUNG.load(std::sync::atomic::Ordering::SeqCst);
        let consumer = Consumer::builder(db.pool.clone())
            .rabbitmq(rabbit.clone())
            .group_id("orders")
            .handler(pay_but_hang_on_13)
            .build()
            .unwrap();
        let running = Running::consumer(&consumer);
        let url = url.clone();
        wait_for(
            "the payment of 13 in hand, or dead",
            Duration::from_secs(30),
            || {
                let url = url.clone();
                async move {
                    HUNG.load(std::sync::atomic::Ordering::SeqCst) > before
                        || mq::queue_depth(&url, &format!("{PAYMENTS}.dlq")).await != Some(0)
                }
            },
        )
        .await;
        running.abort();
        downs += 1;
    }
    // The limit is 20 returns; the others went through meanwhile (the first consumer paid
    // them, behind the one it held: nothing held them up once it was gone).
    assert!(
        (20..=22).contains(&downs),
        "dead-lettered after {downs} crashes"
    );
    let letters = mq::read_queue(&url, &format!("{PAYMENTS}.dlq"), 2, Duration::from_secs(2)).await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].header("event_id"), payments[0].0.to_string());
    assert!(letters[0].headers.contains_key("x-death"), "{letters:?}");
    let consumer = Consumer::builder(db.pool.clone())
        .rabbitmq(rabbit)
        .group_id("orders")
        .handler(pay_but_hang_on_13)
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    wait_for("the others paid", Duration::from_secs(30), || async {
        mq::shard_totals(None, &vhost.name, PAYMENTS, "orders") == (0, 0, 1)
    })
    .await;
    running.stop().await;
    let mut expected: Vec<(uuid::Uuid, i32)> = payments
        .iter()
        .map(|(_, p)| (p.order_id, i32::from(p.amount != 13)))
        .collect();
    expected.sort();
    let paid: Vec<i32> = expected.into_iter().map(|(_, paid)| paid).collect();
    assert_eq!(paid_counts(&db.pool).await, paid);
}
