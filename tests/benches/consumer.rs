//! Consumer throughput for a trivial handler, beside the raw consumer, on one broker and one
//! database in one run, each figure from the first message handled (joining the group is not
//! the framework's cost): dedup mode (on a new installation's partitioned `processed_event`, on
//! ones with 11 and 34 partitions, i.e. 7 and 30 days back, and on a plain table as installations from before
//! partitions have), inbox receipt, inbox processing (1 and 2 processors), both also on an
//! inbox converted to partitions, and dedup mode with
//! 1% of the messages failing once (retried through the retry topic, or in place).
//!
//! `cargo bench -p outbox-tests --bench consumer` (env: `N`, default 20000; `ROUNDS`, default 3).

use std::time::{Duration, Instant};

use std::collections::HashSet;
use std::sync::Mutex;

use outbox_runtime::inbox::{Consumer, HandlerError, Mode, RetryPolicy};
use outbox_runtime::inbox_handler;
use outbox_tests::bench::{env, median, rate, rate_until, trivial, PaymentSucceeded};
use outbox_tests::kafka::{produce, Kafka, Outgoing};
use outbox_tests::{Running, TestDb};
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::ClientConfig;
use uuid::Uuid;

const TOPIC: &str = "bench.payments";
const PARTITIONS: i32 = 12;

/// Payments that failed once already.
static FAILED: Mutex<Option<HashSet<Uuid>>> = Mutex::new(None);

/// Does nothing, but fails once for 1% of the payments (amount 1).
#[inbox_handler]
async fn failing_once_in_a_hundred(
    event: PaymentSucceeded,
    tx: &mut sqlx::PgConnection,
) -> Result<(), HandlerError> {
    let _ = tx;
    if event.amount == 1
        && FAILED
            .lock()
            .unwrap()
            .get_or_insert_default()
            .insert(event.payment_id)
    {
        return Err(HandlerError::retryable("fails once"));
    }
    Ok(())
}

async fn raw_consumer(bootstrap: &str, group: &str, n: usize) -> Duration {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap();
    consumer.subscribe(&[TOPIC]).unwrap();
    consumer.recv().await.unwrap();
    let start = Instant::now();
    for _ in 1..n {
        consumer.recv().await.unwrap();
    }
    start.elapsed()
}

fn consumer(db: &TestDb, bootstrap: &str, group: &str, mode: Mode, processors: usize) -> Consumer {
    Consumer::builder(db.pool.clone())
        .brokers(bootstrap)
        .group_id(group)
        .handler(trivial)
        .mode(mode)
        .processors(processors)
        .build()
        .unwrap()
}

/// Dedup mode over messages of which 1% fail once; a 10 ms backoff before their retry. The
/// rate until 99% of the messages are handled (how the partitions flow meanwhile), and how
/// long after that the last retry is handled.
async fn one_percent_retried(
    db: &TestDb,
    bootstrap: &str,
    group: &str,
    policy: RetryPolicy,
    n: usize,
) -> (f64, f64) {
    sqlx::query("TRUNCATE processed_event")
        .execute(&db.pool)
        .await
        .unwrap();
    *FAILED.lock().unwrap() = None;
    let consumer = Consumer::builder(db.pool.clone())
        .brokers(bootstrap)
        .group_id(group)
        .handler(failing_once_in_a_hundred)
        .retry_policy(policy)
        .retry_backoff(Duration::from_millis(10), Duration::from_millis(10))
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    let sql = "SELECT count(*) FROM processed_event";
    let flow = rate_until(&db.pool, sql, (n - n / 100) as i64).await;
    let at = Instant::now();
    rate_until(&db.pool, sql, n as i64).await;
    let tail_ms = at.elapsed().as_secs_f64() * 1000.0;
    running.stop().await;
    (flow, tail_ms)
}

#[tokio::main]
async fn main() {
    let n: usize = env("N", 20_000);
    let rounds: usize = env("ROUNDS", 3);
    let kafka = Kafka::mock();
    let bootstrap = kafka.bootstrap();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    kafka
        .create_topic(&format!("{TOPIC}.retry"), PARTITIONS)
        .await;
    kafka.create_topic(&format!("{TOPIC}.dlq"), 1).await;
    let records: Vec<Outgoing> = (0..n)
        .map(|i| {
            let e = PaymentSucceeded {
                payment_id: Uuid::now_v7(),
                order_id: Uuid::now_v7(),
                amount: if i % 100 == 7 { 1 } else { 100 },
            };
            Outgoing::event(&e, Uuid::now_v7())
        })
        .collect();
    produce(&bootstrap, TOPIC, &records).await;
    let db = TestDb::new().await;
    let week = TestDb::new().await;
    outbox_tests::fixtures::dedup_partitions_since(&week.pool, 7).await;
    let month = TestDb::new().await;
    outbox_tests::fixtures::dedup_partitions_since(&month.pool, 30).await;
    // Past partitions hold records (10,000 a day), so each probe walks a real index.
    for (db, days) in [(&week, 7), (&month, 30)] {
        sqlx::query(
            "INSERT INTO processed_event (event_id, handler, processed_at) \
             SELECT gen_random_uuid(), 'dedup/trivial', now() - make_interval(days => d) \
             FROM generate_series(1, $1) AS d, generate_series(1, 10000)",
        )
        .bind(days)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    let plain = TestDb::before_partitions().await;
    // An inbox converted to partitions (daily; receipt locks its sources and probes them).
    let parted = TestDb::new().await;
    outbox_runtime::admin::convert_to_partitions(
        &parted.pool,
        outbox_runtime::admin::CleanupTable::Inbox,
    )
    .await
    .unwrap();
    println!("consumer benchmark: {n} messages, {PARTITIONS} partitions, trivial handler, {rounds} rounds");
    let mut results: [Vec<f64>; 14] = Default::default();
    for round in 0..rounds {
        let raw = rate(
            n as u64 - 1,
            raw_consumer(&bootstrap, &format!("raw-{round}"), n).await,
        );

        sqlx::query("TRUNCATE processed_event, inbox_event")
            .execute(&db.pool)
            .await
            .unwrap();
        let running = Running::consumer(&consumer(
            &db,
            &bootstrap,
            &format!("dedup-{round}"),
            Mode::Dedup,
            0,
        ));
        let dedup = rate_until(&db.pool, "SELECT count(*) FROM processed_event", n as i64).await;
        running.stop().await;
        let mut other_layouts = Vec::new();
        for (layout, other) in [("week", &week), ("month", &month), ("plain", &plain)] {
            // Only the previous round's records: the past partitions keep theirs.
            sqlx::query(
                "DELETE FROM processed_event WHERE processed_at > now() - interval '1 hour'",
            )
            .execute(&other.pool)
            .await
            .unwrap();
            let running = Running::consumer(&consumer(
                other,
                &bootstrap,
                &format!("dedup-{layout}-{round}"),
                Mode::Dedup,
                0,
            ));
            // This round's records (the past partitions' are days old).
            let sql = "SELECT count(*) FROM processed_event \
                       WHERE processed_at > now() - interval '1 hour'";
            other_layouts.push(rate_until(&other.pool, sql, n as i64).await);
            running.stop().await;
        }
        let [week_rate, month_rate, plain_rate] =
            [other_layouts[0], other_layouts[1], other_layouts[2]];

        // Receipt alone: no processors.
        let inbox = consumer(&db, &bootstrap, &format!("inbox-{round}"), Mode::Inbox, 0);
        let running = Running::consumer(&inbox);
        let receipt = rate_until(&db.pool, "SELECT count(*) FROM inbox_event", n as i64).await;
        running.stop().await;

        let start = Instant::now();
        inbox.process_inbox_pending().await.unwrap();
        let one = rate(n as u64, start.elapsed());

        sqlx::query("UPDATE inbox_event SET processed = false, processed_at = NULL")
            .execute(&db.pool)
            .await
            .unwrap();
        sqlx::query("VACUUM inbox_event")
            .execute(&db.pool)
            .await
            .unwrap();
        let start = Instant::now();
        let (a, b) = tokio::join!(inbox.process_inbox_pending(), inbox.process_inbox_pending());
        assert_eq!(a.unwrap() + b.unwrap(), n as u64);
        let two = rate(n as u64, start.elapsed());
        // The same on the partitioned inbox.
        sqlx::query("TRUNCATE inbox_event")
            .execute(&parted.pool)
            .await
            .unwrap();
        let inbox = consumer(
            &parted,
            &bootstrap,
            &format!("inbox-parted-{round}"),
            Mode::Inbox,
            0,
        );
        let running = Running::consumer(&inbox);
        let parted_receipt =
            rate_until(&parted.pool, "SELECT count(*) FROM inbox_event", n as i64).await;
        running.stop().await;
        let start = Instant::now();
        inbox.process_inbox_pending().await.unwrap();
        let parted_one = rate(n as u64, start.elapsed());

        let (topic, topic_tail) = one_percent_retried(
            &db,
            &bootstrap,
            &format!("retry-topic-{round}"),
            RetryPolicy::Topic,
            n,
        )
        .await;
        let (in_place, in_place_tail) = one_percent_retried(
            &db,
            &bootstrap,
            &format!("retry-in-place-{round}"),
            RetryPolicy::InPlace,
            n,
        )
        .await;
        println!(
            "round {round}: raw {raw:.0}/s, dedup {dedup:.0}/s (11 partitions {week_rate:.0}/s, 34 {month_rate:.0}/s, \
             plain table {plain_rate:.0}/s), inbox receipt {receipt:.0}/s, \
             processing 1: {one:.0}/s, 2: {two:.0}/s; partitioned inbox: receipt \
             {parted_receipt:.0}/s, processing 1: {parted_one:.0}/s; 1% retried: retry topic {topic:.0}/s \
             (+{topic_tail:.0} ms), in place {in_place:.0}/s (+{in_place_tail:.0} ms)"
        );
        for (i, r) in [
            raw,
            dedup,
            receipt,
            one,
            two,
            topic,
            topic_tail,
            in_place,
            in_place_tail,
            month_rate,
            plain_rate,
            week_rate,
            parted_receipt,
            parted_one,
        ]
        .into_iter()
        .enumerate()
        {
            results[i].push(r);
        }
    }
    let [raw, dedup, receipt, one, two, topic, topic_tail, in_place, in_place_tail, month, plain, week, parted_receipt, parted_one] =
        results.map(median);
    println!();
    println!("medians over {rounds} rounds (messages/s, from the first message handled):");
    println!("  raw consumer (no processing)     {raw:>9.0}");
    println!("  dedup mode                       {dedup:>9.0}");
    println!(
        "    with 11 partitions (7 days)    {week:>9.0}  ({:.2}x)",
        week / dedup
    );
    println!(
        "    with 34 partitions (30 days)   {month:>9.0}  ({:.2}x)",
        month / dedup
    );
    println!(
        "    on a plain table (before)      {plain:>9.0}  ({:.2}x)",
        plain / dedup
    );
    println!("  inbox mode, receipt              {receipt:>9.0}");
    println!("  inbox mode, processing, 1 task   {one:>9.0}");
    println!("  inbox mode, processing, 2 tasks  {two:>9.0}");
    println!(
        "    partitioned inbox: receipt     {parted_receipt:>9.0}  ({:.2}x)",
        parted_receipt / receipt
    );
    println!(
        "    partitioned inbox: 1 task      {parted_one:>9.0}  ({:.2}x)",
        parted_one / one
    );
    println!(
        "  dedup, 1% retried, retry topic   {topic:>9.0}   {:.1}% of dedup until 99% handled; \
         the last retry {topic_tail:.0} ms later",
        topic / dedup * 100.0
    );
    println!(
        "  dedup, 1% retried, in place      {in_place:>9.0}   {:.1}% of dedup until 99% handled; \
         the last retry {in_place_tail:.0} ms later",
        in_place / dedup * 100.0
    );
}
