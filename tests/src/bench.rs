//! Small helpers shared by the benchmarks.

use std::str::FromStr;
use std::time::Duration;

/// The consumer benchmarks' event (topic `bench.payments`).
#[derive(serde::Serialize, serde::Deserialize, outbox_runtime::OutboxEvent)]
#[outbox(
    topic = "bench.payments",
    aggregate_type = "Payment",
    event_type = "PaymentSucceeded"
)]
pub struct PaymentSucceeded {
    #[outbox(aggregate_id)]
    pub payment_id: uuid::Uuid,
    pub order_id: uuid::Uuid,
    pub amount: i64,
}

/// Does nothing: the consumer benchmarks' figures are the framework's cost.
#[outbox_runtime::inbox_handler]
pub async fn trivial(
    event: PaymentSucceeded,
    tx: &mut sqlx::PgConnection,
) -> Result<(), outbox_runtime::inbox::HandlerError> {
    let _ = (event, tx);
    Ok(())
}

/// Calls of [`counted`] so far (process-wide).
pub static COUNTED: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);

/// Does nothing but count its calls in [`COUNTED`]: a consumer's progress read without
/// asking the database (see [`rate_counted`]).
#[outbox_runtime::inbox_handler]
pub async fn counted(
    event: PaymentSucceeded,
    tx: &mut sqlx::PgConnection,
) -> Result<(), outbox_runtime::inbox::HandlerError> {
    let _ = (event, tx);
    COUNTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// The median of the samples (upper median for an even count).
pub fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(|a, b| a.total_cmp(b));
    samples[samples.len() / 2]
}

/// The `p` quantile (0 to 1) of the durations; sorts them.
pub fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    samples[((samples.len() as f64 * p) as usize).min(samples.len() - 1)]
}

/// Runs `txs` calls of `command` in each of `concurrency` tasks at once: (calls per second,
/// each call's latency). The emit benchmarks' round.
pub async fn concurrent_calls<F, Fut>(
    concurrency: usize,
    txs: usize,
    command: F,
) -> (f64, Vec<Duration>)
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let start = std::time::Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let command = command.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::with_capacity(txs);
                for _ in 0..txs {
                    let t = std::time::Instant::now();
                    command().await;
                    latencies.push(t.elapsed());
                }
                latencies
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for task in tasks {
        latencies.extend(task.await.expect("a benchmark task"));
    }
    let rate = (concurrency * txs) as f64 / start.elapsed().as_secs_f64();
    (rate, latencies)
}

/// A setting from the environment, or `default`.
pub fn env<T: FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Events (or rows) per second.
pub fn rate(n: u64, elapsed: Duration) -> f64 {
    n as f64 / elapsed.as_secs_f64()
}

/// Waits until `sql` counts `n` on `pool` and returns the rate from the first count above zero
/// it saw: joining a consumer group (a broker's timing, noisy) is not the framework's cost.
pub async fn rate_until(pool: &sqlx::PgPool, sql: &str, n: i64) -> f64 {
    let (at, from) = first_seen_until(|| crate::count(pool, sql), n, 2).await;
    rate((n - from).max(1) as u64, at.elapsed())
}

/// As [`rate_until`], for a consumer whose handler is [`counted`] (each message run once):
/// follows [`COUNTED`] (store 0 in it before the consumer starts) in the process, so that no
/// query competes with the consumer for the machine while it runs (a `count(*)` every 2 ms
/// over a growing table keeps a backend busy), then waits until `sql` counts `n` (the last
/// batch committed) and returns the rate from the first count above zero it saw.
pub async fn rate_counted(pool: &sqlx::PgPool, sql: &str, n: i64) -> f64 {
    let calls = || async { COUNTED.load(std::sync::atomic::Ordering::Relaxed) };
    let (at, from) = first_seen_until(calls, n, 1).await;
    first_seen_until(|| crate::count(pool, sql), n, 1).await;
    rate((n - from).max(1) as u64, at.elapsed())
}

/// Reads `seen` every `every_ms` until it reaches `n`; when it was first above zero, and what
/// it was then.
pub async fn first_seen_until<F, Fut>(
    mut seen: F,
    n: i64,
    every_ms: u64,
) -> (std::time::Instant, i64)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = i64>,
{
    let mut first: Option<(std::time::Instant, i64)> = None;
    loop {
        let now = seen().await;
        if first.is_none() && now > 0 {
            first = Some((std::time::Instant::now(), now));
        }
        if now >= n {
            return first.expect("seen above zero");
        }
        tokio::time::sleep(Duration::from_millis(every_ms)).await;
    }
}

/// The server's `autovacuum` setting (a benchmark of sustained load says which it ran with).
pub async fn autovacuum(pool: &sqlx::PgPool) -> String {
    sqlx::query_scalar("SHOW autovacuum")
        .fetch_one(pool)
        .await
        .expect("SHOW autovacuum")
}

/// The machine's CPU time so far, busy and total (jiffies, all cores), from `/proc/stat`.
pub fn cpu_times() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let fields: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    let total: u64 = fields.iter().sum();
    let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

/// The share of the machine's CPU that was busy since `start` (from [`cpu_times`]), 0 to 1.
pub fn cpu_busy_since(start: (u64, u64)) -> f64 {
    let (busy, total) = cpu_times();
    let (dbusy, dtotal) = (busy - start.0, total - start.1);
    if dtotal == 0 {
        0.0
    } else {
        dbusy as f64 / dtotal as f64
    }
}

/// The relay benchmarks' event (topic `bench.events`).
#[derive(serde::Serialize, outbox_runtime::OutboxEvent)]
#[outbox(
    topic = "bench.events",
    aggregate_type = "Order",
    event_type = "OrderCreated"
)]
pub struct OrderCreated {
    #[outbox(aggregate_id)]
    pub order_id: String,
    pub customer_id: uuid::Uuid,
    pub amount: i64,
    pub n: u64,
}

/// Writes `n` events over `keys` keys, 1,000 per unit of work, into an emptied outbox.
pub async fn write_events(pool: &sqlx::PgPool, n: u64, keys: u64) {
    sqlx::query("TRUNCATE outbox_event")
        .execute(pool)
        .await
        .unwrap();
    let mut i = 0;
    while i < n {
        let events: Vec<OrderCreated> = (i..(i + 1000).min(n))
            .map(|n| OrderCreated {
                order_id: format!("order-{}", n % keys),
                customer_id: uuid::Uuid::from_u128(n as u128),
                amount: n as i64,
                n,
            })
            .collect();
        let mut uow = outbox_runtime::Uow::begin(pool).await.unwrap();
        uow.emit_all(&events).await.unwrap();
        uow.commit().await.unwrap();
        i += 1000;
    }
    sqlx::query("VACUUM ANALYZE outbox_event")
        .execute(pool)
        .await
        .unwrap();
}

/// Returns once the outbox has nothing unpublished.
pub async fn wait_drained(pool: &sqlx::PgPool) {
    while outbox_runtime::admin::status(pool)
        .await
        .unwrap()
        .outbox_total()
        .unpublished
        > 0
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
