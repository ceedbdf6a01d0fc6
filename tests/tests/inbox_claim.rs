//! The processors' claim costs what its batch costs, however many rows were processed since
//! the inbox was last vacuumed (their entries stay in the pending indexes until then); and
//! the floor that lets its scans start past them never leaves a row behind, even one whose
//! receipt commits long after later rows were processed.

use std::time::Duration;

use outbox_runtime::inbox;
use outbox_tests::TestDb;
use sqlx::PgPool;

/// Buffers (shared, hit or read) the plan's top node touched.
fn buffers(plan: &serde_json::Value) -> i64 {
    let node = &plan[0]["Plan"];
    node["Shared Hit Blocks"].as_i64().unwrap_or(0)
        + node["Shared Read Blocks"].as_i64().unwrap_or(0)
}

/// Stores `n` rows as receipts store them, over 1,000 keys, in one statement.
async fn received(pool: &PgPool, n: i64) {
    sqlx::query(
        "INSERT INTO inbox_event (event_id, topic, event_type, partition_key, payload, \
             source_partition, source_offset) \
         SELECT gen_random_uuid(), 'payment.events', 'PaymentSucceeded', 'acct-' || (g % 1000), \
                jsonb_build_object('n', g), 0, g \
         FROM generate_series(1, $1) AS g",
    )
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
}

/// Buffers of the claim of a batch of 100.
async fn claim_cost(pool: &PgPool) -> i64 {
    buffers(&inbox::explain_claim(pool, 100).await.unwrap())
}

/// A claim behind 100,000 rows processed since the last vacuum (as at 500 events/s for three
/// minutes with autovacuum behind) costs about what one on a fresh inbox does. Before the
/// floor, both statements started at the bottom of their indexes and stepped over every
/// processed row's entry: 10 to 20 times the buffers.
#[tokio::test]
async fn a_claim_costs_the_same_however_many_rows_were_processed_since_the_last_vacuum() {
    let fresh = TestDb::new().await;
    received(&fresh.pool, 10_000).await;
    let claim_base = claim_cost(&fresh.pool).await;

    let busy = TestDb::new().await;
    received(&busy.pool, 110_000).await;
    sqlx::query(
        "UPDATE inbox_event SET processed = true, processed_at = now() \
         WHERE seq <= (SELECT min(seq) + 99999 FROM inbox_event)",
    )
    .execute(&busy.pool)
    .await
    .unwrap();
    let claim_behind = claim_cost(&busy.pool).await;

    println!(
        "claim: {claim_base} buffers on a fresh inbox, {claim_behind} behind 100,000 processed rows"
    );
    assert!(
        claim_behind <= 2 * claim_base + 50,
        "the claim steps over the processed rows' entries: {claim_behind} buffers against {claim_base}"
    );
}

/// The oldest unprocessed, live row's `seq`.
async fn oldest(pool: &PgPool) -> Option<i64> {
    sqlx::query_scalar("SELECT min(seq) FROM inbox_event WHERE NOT processed AND dead_at IS NULL")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The floor once a sighting settled (within 60 s: the test's own transactions end at once).
async fn floor(pool: &PgPool) -> i64 {
    inbox::claim_floor(pool, Duration::from_secs(60))
        .await
        .unwrap()
        .expect("a sighting settles within 60 s")
}

/// A receipt that drew its row's `seq` and commits after later rows were received and
/// processed holds the floor below its row until it ends, so its row is claimed once it
/// commits; a dead row an operator retries lowers the floor to it again.
#[tokio::test]
async fn the_floor_waits_for_a_receipt_that_commits_late_and_comes_down_for_a_revived_row() {
    let db = TestDb::new().await;
    received(&db.pool, 100).await;
    // A receipt still open, its row's seq drawn.
    let mut late = db.pool.begin().await.unwrap();
    let late_seq: i64 = sqlx::query_scalar(
        "INSERT INTO inbox_event (event_id, topic, event_type, partition_key, payload) \
         VALUES (gen_random_uuid(), 'payment.events', 'PaymentSucceeded', 'acct-late', '{}') \
         RETURNING seq",
    )
    .fetch_one(&mut *late)
    .await
    .unwrap();
    // Later receipts, committed, and every row the processors can see handled.
    received(&db.pool, 100).await;
    sqlx::query("UPDATE inbox_event SET processed = true, processed_at = now()")
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(oldest(&db.pool).await, None);
    let settled = inbox::claim_floor(&db.pool, Duration::from_secs(2))
        .await
        .unwrap();
    assert!(
        settled.is_none_or(|f| f <= late_seq),
        "the floor {settled:?} passed row {late_seq}, whose receipt has not ended"
    );

    late.commit().await.unwrap();
    assert_eq!(oldest(&db.pool).await, Some(late_seq));
    assert_eq!(
        floor(&db.pool).await,
        late_seq,
        "the late row is the oldest to claim"
    );
    // It is handled; the first row of all turns out dead.
    sqlx::query("UPDATE inbox_event SET processed = true, processed_at = now() WHERE seq = $1")
        .bind(late_seq)
        .execute(&db.pool)
        .await
        .unwrap();
    let first: i64 = sqlx::query_scalar(
        "UPDATE inbox_event SET processed = false, processed_at = NULL, dead_at = now(), \
                last_error = 'boom' \
         WHERE seq = (SELECT min(seq) FROM inbox_event) RETURNING seq",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let past = floor(&db.pool).await;
    assert!(
        past > late_seq,
        "with nothing to process the floor moves past every row: {past}"
    );

    // The operator retries the dead row: its old seq is due again.
    sqlx::query("UPDATE inbox_event SET dead_at = NULL, attempts = 0 WHERE seq = $1")
        .bind(first)
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(floor(&db.pool).await, first);
}

/// A receipt costs what its rows cost, however large the inbox's partition has grown since
/// the connection planned its insert (a prepared statement keeps its generic plan; statistics
/// stale or missing, as between autovacuum's rounds or with it off). Before, the absence
/// check became a hash anti-join over the whole partition: a receipt of one row read every
/// row received that day (7 ms at 30,000 rows, growing with each).
#[tokio::test]
async fn a_receipt_costs_the_same_however_large_its_partition_has_grown() {
    let db = TestDb::new().await;
    let pool = db.pool.clone();
    let (before, after) = inbox::explain_receipt(&db.pool, async move {
        received(&pool, 100_000).await;
    })
    .await
    .unwrap();
    let (before, after) = (buffers(&before), buffers(&after));
    println!("a receipt of one row: {before} buffers on an empty inbox, {after} with 100,000 rows");
    assert!(
        after <= before + 50,
        "the receipt reads the partition it stores into: {after} buffers against {before}"
    );
}

/// A consumer that only processes the inbox (no broker is ever reached), with `handler`.
fn processing<H: inbox::Handler<()>>(pool: &PgPool, handler: H) -> inbox::Consumer {
    inbox::Consumer::builder(pool.clone())
        .brokers("127.0.0.1:9")
        .group_id("processing")
        .handler(handler)
        .mode(inbox::Mode::Inbox)
        .processors(0)
        .build()
        .unwrap()
}

/// A payment as [`received`] stores it.
#[derive(serde::Serialize, serde::Deserialize, outbox_runtime::OutboxEvent)]
#[outbox(
    topic = "payment.events",
    aggregate_type = "Account",
    event_type = "PaymentSucceeded"
)]
struct Payment {
    #[outbox(aggregate_id)]
    n: i64,
}

/// Takes note of nothing.
#[outbox_runtime::inbox_handler]
async fn noted(
    _event: Payment,
    _tx: &mut sqlx::PgConnection,
) -> Result<(), outbox_runtime::inbox::HandlerError> {
    Ok(())
}

/// A processor's marks (processed, failed) find their rows by id in a table that grows all day:
/// a plan a connection kept from while the partition was small scans it whole (a generic
/// plan, which PostgreSQL settles on after a statement's fifth execution: a sequential scan of
/// the partition, 5 ms at 30,000 rows and growing, found by the latency bench). They are
/// planned each time, with the partition's size.
#[tokio::test]
async fn a_processor_keeps_no_plan_of_its_marks_from_while_the_partition_was_small() {
    let db = TestDb::new().await;
    // One connection: every statement the processor prepares is on it.
    let pool = db.pool(1).await;
    let consumer = processing(&pool, noted);
    for _ in 0..10 {
        received(&pool, 10).await;
        assert_eq!(consumer.process_inbox_pending().await.unwrap(), 10);
    }
    let kept: Vec<String> = sqlx::query_scalar(
        "SELECT statement FROM pg_prepared_statements \
         WHERE statement LIKE 'UPDATE inbox_event%' AND generic_plans > 0",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(kept.is_empty(), "kept generic plans: {kept:?}");
}

/// A transaction left open in another database of the server holds back nothing of this one's
/// floor (it would if the floor waited on the server's oldest transaction).
#[tokio::test]
async fn a_transaction_open_in_another_database_does_not_hold_the_floor() {
    let db = TestDb::new().await;
    let other = TestDb::new().await;
    let mut open = other.pool.begin().await.unwrap();
    sqlx::query("SELECT pg_current_xact_id()")
        .execute(&mut *open)
        .await
        .unwrap();
    received(&db.pool, 10).await;
    let settled = inbox::claim_floor(&db.pool, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(
        settled,
        oldest(&db.pool).await,
        "the floor is at the oldest row"
    );
    open.rollback().await.unwrap();
}

/// A key whose first row waits for its retry holds back its own later rows and nothing else,
/// however many of them there are: the other keys' rows received after them are handled now,
/// not when the retry comes due (each claim looked only at the oldest four batches of
/// unprocessed rows, 2,000 with the default batch, the held-back ones included, and found
/// nothing it could take).
#[tokio::test]
async fn a_key_waiting_for_its_retry_holds_back_only_its_own_rows_however_many() {
    let db = TestDb::new().await;
    sqlx::query(
        "INSERT INTO inbox_event (event_id, topic, event_type, partition_key, payload, \
             source_partition, source_offset) \
         SELECT gen_random_uuid(), 'payment.events', 'PaymentSucceeded', 'acct-stuck', \
                jsonb_build_object('n', g), 0, g \
         FROM generate_series(1, 5000) AS g",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // Its first row failed; its retry is an hour away.
    sqlx::query(
        "UPDATE inbox_event SET attempts = 1, last_error = 'boom', \
                next_attempt_at = now() + interval '1 hour' \
         WHERE seq = (SELECT min(seq) FROM inbox_event)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    received(&db.pool, 50).await;
    let consumer = processing(&db.pool, noted);
    let handled = consumer.process_inbox_pending().await.unwrap();
    let left: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM inbox_event WHERE NOT processed AND partition_key <> 'acct-stuck'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (handled, left),
        (50, 0),
        "the rows of the other keys are handled while acct-stuck waits"
    );
    let stuck: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM inbox_event WHERE NOT processed AND partition_key = 'acct-stuck'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(stuck, 5000, "acct-stuck's rows wait for its first");
}

/// A processor's claim keeps no plan from while the inbox was empty: the plan a session keeps
/// of a prepared statement is made once, on the sizes and statistics of that moment, and one
/// made on an empty, never analyzed partition (a new day's) reads the partition whole and
/// sorts it, for every claim, as it fills.
#[tokio::test]
async fn a_processor_keeps_no_plan_of_its_claim_from_while_the_inbox_was_empty() {
    let db = TestDb::new().await;
    let kept = claim_kept(&db, Before::Empty).await;
    println!("the claim kept from an empty inbox reads {kept} buffers with 30,000 rows");
    assert!(
        kept < 1_500,
        "the claim's kept plan reads the partition whole: {kept} buffers"
    );
}

/// A processor that shares the shards, whose claim starts at its own shards' first row, keeps
/// no plan of it that walks another processor's burst: one kept from an inbox all processed
/// (the statistics of autovacuum's last analyze before the burst) looked for each shard's
/// first row by walking the pending rows in order, the burst's included (31,891 buffers), not
/// in the index that holds them by shard.
#[tokio::test]
async fn a_processor_sharing_the_shards_keeps_no_plan_of_its_claim_that_walks_a_burst() {
    let db = TestDb::new().await;
    let kept = claim_kept(&db, Before::AllProcessedShared).await;
    println!("the claim of all shards but the burst's, kept from an inbox all processed, reads {kept} buffers");
    assert!(
        kept < 1_500,
        "the claim's kept plan walks the burst: {kept} buffers"
    );
}

/// Another processor, as far as the shares go: a connection (out of the pool, so that its
/// lock goes with it) holding a member lock of the inbox's processors (the last slot), and no
/// shard.
async fn another_member(pool: &PgPool) -> sqlx::PgConnection {
    let mut other = pool.acquire().await.unwrap().detach();
    sqlx::query(
        "SELECT pg_advisory_lock((SELECT relnamespace FROM pg_class \
                                  WHERE oid = 'inbox_event'::regclass)::int4, $1)",
    )
    .bind(0x6d00_0000 + 4095)
    .execute(&mut other)
    .await
    .unwrap();
    other
}

/// What the inbox was like while a processor's session made the plan it keeps of its claim.
#[derive(PartialEq)]
enum Before {
    /// Empty, never analyzed; the processor holds every shard.
    Empty,
    /// 30,000 rows, all processed and analyzed so; the processor shares the shards with
    /// another, and its plan is the generic one (PostgreSQL may keep either).
    AllProcessedShared,
}

/// Buffers of a claim of 500 by the plan a processor's session kept of it from claims on the
/// inbox `before`, once a burst of 20,000 rows of one key and 10,000 of 1,000 keys arrived;
/// of every shard (`Empty`), or of every shard but the burst's.
async fn claim_kept(db: &TestDb, before: Before) -> i64 {
    // One connection: the processor's claim is prepared on it, and explained on it after.
    let pool = db.pool(1).await;
    let shared = before == Before::AllProcessedShared;
    if shared {
        received(&pool, 30_000).await;
        sqlx::raw_sql(
            "UPDATE inbox_event SET processed = true, processed_at = now(); \
             ANALYZE inbox_event; SET plan_cache_mode = force_generic_plan",
        )
        .execute(&pool)
        .await
        .unwrap();
    }
    let _other = if shared {
        Some(another_member(&db.pool).await)
    } else {
        None
    };
    let consumer = processing(&pool, noted);
    // Claims with nothing due, more than the five PostgreSQL plans afresh before it keeps one.
    for _ in 0..8 {
        assert_eq!(consumer.process_inbox_pending().await.unwrap(), 0);
    }
    sqlx::query(
        "INSERT INTO inbox_event (event_id, topic, event_type, partition_key, payload, \
             source_partition, source_offset) \
         SELECT gen_random_uuid(), 'payment.events', 'PaymentSucceeded', 'acct-hot', \
                jsonb_build_object('n', -g), 0, g \
         FROM generate_series(1, 20000) AS g",
    )
    .execute(&pool)
    .await
    .unwrap();
    received(&pool, 10_000).await;
    let mut conn = pool.acquire().await.unwrap();
    let mask: i64 = if shared {
        sqlx::query_scalar(
            "SELECT ~(1::int8 << (hashtext('payment.events' || E'\\x1f' || 'acct-hot') & 63))",
        )
        .fetch_one(&mut *conn)
        .await
        .unwrap()
    } else {
        -1
    };
    let name: String = sqlx::query_scalar(
        "SELECT name FROM pg_prepared_statements \
         WHERE statement LIKE '%FROM inbox_event e WHERE%' AND statement NOT LIKE '%ANY($2)%'",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    // From the first row to process, as the floor would be: the plan is what is weighed.
    let first: i64 = sqlx::query_scalar("SELECT min(seq) FROM inbox_event WHERE NOT processed")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    // With the planner settings of a claim's transaction: a plan made again (after an
    // invalidation) is made with them, as a processor's would be.
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    sqlx::raw_sql(
        "SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; \
         SET LOCAL enable_sort = off",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    let plan: serde_json::Value = sqlx::query_scalar(&format!(
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE {name}(500, 2000, {mask}, {first})"
    ))
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    buffers(&plan)
}

/// A claim costs its batch when the statistics describe an inbox whose rows were all
/// processed (the last analyze before a burst, as between autovacuum's rounds): believing few
/// rows due, a plan that reads the claim's whole window and sorts it costs several batches'
/// reads for every claim until the next analyze.
#[tokio::test]
async fn a_claim_costs_its_batch_on_the_statistics_of_an_inbox_all_processed() {
    let analyzed = TestDb::new().await;
    received(&analyzed.pool, 30_000).await;
    sqlx::query("ANALYZE inbox_event")
        .execute(&analyzed.pool)
        .await
        .unwrap();
    let base = buffers(&inbox::explain_claim(&analyzed.pool, 500).await.unwrap());

    let stale = TestDb::new().await;
    received(&stale.pool, 30_000).await;
    sqlx::query("UPDATE inbox_event SET processed = true, processed_at = now()")
        .execute(&stale.pool)
        .await
        .unwrap();
    sqlx::query("ANALYZE inbox_event")
        .execute(&stale.pool)
        .await
        .unwrap();
    received(&stale.pool, 30_000).await;
    let behind = buffers(&inbox::explain_claim(&stale.pool, 500).await.unwrap());
    println!("a claim of 500: {base} buffers analyzed, {behind} on the statistics of an inbox all processed");
    assert!(
        behind <= 2 * base + 50,
        "the claim reads its window whole on stale statistics: {behind} buffers against {base}"
    );
}

/// Records the planner settings its handler runs with.
#[outbox_runtime::inbox_handler]
async fn settings_seen(
    _event: Payment,
    tx: &mut sqlx::PgConnection,
) -> Result<(), outbox_runtime::inbox::HandlerError> {
    sqlx::query(
        "INSERT INTO seen SELECT current_setting('enable_seqscan') || ' ' \
             || current_setting('enable_bitmapscan') || ' ' || current_setting('enable_sort')",
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// The planner is held to index scans for the claim alone: handlers run with the session's
/// own settings.
#[tokio::test]
async fn handlers_run_with_the_sessions_own_planner_settings() {
    let db = TestDb::new().await;
    sqlx::query("CREATE TABLE seen (settings text NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    received(&db.pool, 20).await;
    let consumer = processing(&db.pool, settings_seen);
    assert_eq!(consumer.process_inbox_pending().await.unwrap(), 20);
    let seen: Vec<String> = sqlx::query_scalar("SELECT DISTINCT settings FROM seen")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(seen, ["on on on"]);
}

/// Handles a payment, slowly if it is the hot account's (a negative `n`, as
/// [`a_hot_key_holds_back_its_own_shards_alone`] stores them).
#[outbox_runtime::inbox_handler]
async fn slow_when_hot(
    event: Payment,
    _tx: &mut sqlx::PgConnection,
) -> Result<(), outbox_runtime::inbox::HandlerError> {
    if event.n < 0 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Ok(())
}

/// A burst of one key (3,000 rows of `acct-hot`, slow to handle) received before the other
/// keys' rows holds back the rows of its own processor's shards alone: with two processors,
/// the other one handles its keys' rows at once, not once the burst is nearly done. (Each
/// claim looked only from the first row anyone could claim, a few batches on: the hot key's.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_key_holds_back_its_own_shards_alone() {
    let db = TestDb::new().await;
    sqlx::query(
        "INSERT INTO inbox_event (event_id, topic, event_type, partition_key, payload, \
             source_partition, source_offset) \
         SELECT gen_random_uuid(), 'payment.events', 'PaymentSucceeded', 'acct-hot', \
                jsonb_build_object('n', -g), 0, g \
         FROM generate_series(1, 3000) AS g",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    received(&db.pool, 100).await;
    let consumer = inbox::Consumer::builder(db.pool.clone())
        .brokers("127.0.0.1:9")
        .group_id("processing")
        .handler(slow_when_hot)
        .mode(inbox::Mode::Inbox)
        .processors(0)
        .batch_size(100)
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let cancel = tokio_util::sync::CancellationToken::new();
    let processors: Vec<_> = (0..2)
        .map(|_| {
            let (consumer, cancel) = (consumer.clone(), cancel.clone());
            tokio::spawn(async move { consumer.run_processor(cancel).await })
        })
        .collect();
    let processed = |hot: bool| {
        let pool = db.pool.clone();
        async move {
            let sql = format!(
                "SELECT count(*) FROM inbox_event WHERE processed AND (partition_key = 'acct-hot') = {hot}"
            );
            sqlx::query_scalar::<_, i64>(&sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    // About half of the other keys are the other processor's (32 shards of 64 each).
    outbox_tests::payments::wait_for(
        "a quarter of the other keys' rows processed",
        Duration::from_secs(60),
        || async { processed(false).await >= 25 },
    )
    .await;
    // Before, they were reached only within a window of five batches (500 rows) of the
    // burst's end: 2,500 of its rows processed at least. Now, once the first processor gave
    // the second its shards (after its first batch, 0.2 s), and however slow the machine:
    // each hot row takes 2 ms.
    let hot_done = processed(true).await;
    eprintln!("{hot_done} of the burst's rows processed first");
    assert!(
        hot_done < 2_000,
        "the other keys' rows waited for the burst: {hot_done} of its 3,000 rows were processed first"
    );
    cancel.cancel();
    for p in processors {
        p.await.unwrap().unwrap();
    }
}

/// A one-off run (`process_inbox_pending`) handles the rows of every shard no processor holds,
/// not only of its fair share: beside another processor that holds nothing yet (just started;
/// or another one-off run, which has ended by the time the shares move), it took half of the
/// shards and left the other half's rows to nobody (a benchmark's two concurrent runs handled
/// 10,000 of 20,000 rows).
#[tokio::test]
async fn a_one_off_run_handles_the_rows_of_shards_no_one_holds() {
    let db = TestDb::new().await;
    received(&db.pool, 2_000).await;
    let _other = another_member(&db.pool).await;
    let consumer = processing(&db.pool, noted);
    let handled = consumer.process_inbox_pending().await.unwrap();
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM inbox_event WHERE NOT processed")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!((handled, left), (2_000, 0), "every row handled");
}
