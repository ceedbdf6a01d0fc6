//! Retention on MariaDB under sustained load: does `processed_event` stay flat? Each round is a
//! day: `ROWS` dedup records written (as consumers would, a multi-row insert at a time), then
//! `mysql::Cleanup` deletes what is older than `RETAIN` days, as the relay's retention would.
//! Reports, per round, the rows kept, the space InnoDB has allocated to the table (data, index
//! and free pages, after `ANALYZE TABLE`), the history list length (purge's backlog), and the
//! rates of writing and deleting.
//!
//! `cargo bench -p outbox-tests --bench retention_mysql` (env: `DAYS`, default 20; `ROWS`,
//! default 50000; `RETAIN`, default 7).

use std::time::{Duration, Instant};

use outbox_runtime::admin::CleanupTable;
use outbox_tests::bench::{env, rate};
use outbox_tests::mysql::MySqlTestDb;
use sqlx::{MySqlPool, Row};

/// Writes `rows` dedup records dated `days_ago` days back, 1,000 to a statement.
async fn write_day(pool: &MySqlPool, rows: usize, days_ago: u64) {
    let mut written = 0;
    while written < rows {
        let n = (rows - written).min(1_000);
        let mut sql =
            String::from("INSERT INTO processed_event (event_id, handler, processed_at) VALUES ");
        for i in 0..n {
            if i > 0 {
                sql.push_str(", ");
            }
            sql.push_str(&format!(
                "(UNHEX('{}'), 'bench/handler', UTC_TIMESTAMP(6) - INTERVAL {days_ago} DAY)",
                uuid::Uuid::now_v7().simple()
            ));
        }
        sqlx::raw_sql(&sql).execute(pool).await.unwrap();
        written += n;
    }
}

/// The table's rows (estimated after ANALYZE) and allocated bytes (data, index, free).
async fn size(pool: &MySqlPool) -> (i64, i64) {
    sqlx::raw_sql("ANALYZE TABLE processed_event")
        .execute(pool)
        .await
        .unwrap();
    let row = sqlx::query(
        "SELECT CAST(TABLE_ROWS AS SIGNED), CAST(DATA_LENGTH + INDEX_LENGTH + DATA_FREE AS SIGNED) \
         FROM information_schema.TABLES \
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'processed_event'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    (row.get(0), row.get(1))
}

/// InnoDB's history list length (MariaDB's status variable; 0 where there is none).
async fn history(pool: &MySqlPool) -> i64 {
    sqlx::query("SHOW GLOBAL STATUS LIKE 'Innodb_history_list_length'")
        .fetch_optional(pool)
        .await
        .unwrap()
        .and_then(|row| row.try_get::<String, _>(1).ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[tokio::main]
async fn main() {
    let days: u64 = env("DAYS", 20);
    let rows: usize = env("ROWS", 50_000);
    let retain: u64 = env("RETAIN", 7);
    let db = MySqlTestDb::new().await;
    let exact: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM processed_event")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(exact, 0);
    println!(
        "retention on MariaDB: {days} days of {rows} dedup records each, {retain} days kept, \
         mysql::Cleanup (batches of 10,000) after each day"
    );
    println!("day  rows kept  allocated MB  history  write/s  delete/s");
    let day = Duration::from_secs(86_400);
    let mut allocated = Vec::new();
    for d in 0..days {
        // Day `d` of the run is `days - d` days ago; its retention cuts `retain` days before it.
        let ago = days - d;
        let start = Instant::now();
        write_day(&db.pool, rows, ago).await;
        let write = rate(rows as u64, start.elapsed());
        let cleanup =
            outbox_runtime::mysql::Cleanup::new(db.pool.clone(), day * (ago + retain) as u32);
        let cutoff = cleanup.cutoff().await.unwrap();
        let start = Instant::now();
        let deleted = cleanup
            .run(CleanupTable::ProcessedEvent, cutoff, |_| {})
            .await
            .unwrap();
        let delete = if deleted > 0 {
            format!("{:.0}", rate(deleted, start.elapsed()))
        } else {
            "-".to_owned()
        };
        let kept: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM processed_event")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        let (_, bytes) = size(&db.pool).await;
        allocated.push(bytes);
        println!(
            "{d:>3}  {kept:>9}  {:>12.1}  {:>7}  {write:>7.0}  {delete:>8}",
            bytes as f64 / 1e6,
            history(&db.pool).await
        );
    }
    let full = (retain + 1) as usize;
    if allocated.len() > full + 1 {
        let at_full = allocated[full] as f64;
        let last = *allocated.last().unwrap() as f64;
        println!(
            "allocated at the end / once the window filled (day {full}): {:.2}",
            last / at_full
        );
    }
}
