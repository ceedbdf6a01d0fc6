//! What each command does; `main.rs` only parses.

use std::str::FromStr;
use std::time::Duration;

use outbox_runtime::admin::{
    self, Cleanup, CleanupTable, PoisonFilter, Replay, ReplayFilter, Status,
};
use outbox_runtime::relay::Relay;
use rdkafka::config::ClientConfig;
use rdkafka::producer::{BaseProducer, Producer};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgPool};
use tokio_util::sync::CancellationToken;

use crate::parse::human;
use crate::ui::{self, Progress};
use crate::{
    Act, Brokers, Command, Db, DeadAction, InboxAction, List, ParkedAction, RelayArgs, Selection,
};

type Result<T = ()> = std::result::Result<T, String>;

/// Rows `list` shows unless `--limit` says otherwise.
const DEFAULT_LIST_LIMIT: u32 = 100;

/// An error and its causes, on one line.
fn chain<E: std::error::Error + 'static>(error: E) -> String {
    outbox_runtime::error_chain(&error).to_string()
}

pub async fn run(command: Command) -> Result {
    match command {
        Command::Migrate { db } => migrate(&db).await,
        Command::Status { db, json, max_age } => status(&db, json, max_age).await,
        Command::Relay(args) => relay(args).await,
        Command::Replay {
            db,
            brokers,
            topic,
            since,
            until,
            aggregate_type,
            event_type,
            to_topic,
            dry_run,
            batch_size,
        } => {
            let mut filter = ReplayFilter::topic(topic);
            if let Some(t) = since {
                filter = filter.since(t);
            }
            if let Some(t) = until {
                filter = filter.until(t);
            }
            if let Some(a) = aggregate_type {
                filter = filter.aggregate_type(a);
            }
            if let Some(e) = event_type {
                filter = filter.event_type(e);
            }
            replay(
                &db,
                &brokers,
                &filter,
                to_topic.as_deref(),
                dry_run,
                batch_size,
            )
            .await
        }
        Command::Cleanup {
            db,
            older_than,
            dedup_older_than,
            batch,
            tables,
            dry_run,
            yes,
        } => {
            cleanup(
                &db,
                older_than,
                dedup_older_than,
                batch,
                tables,
                dry_run,
                yes,
            )
            .await
        }
        Command::Parked { action } => parked(action).await,
        Command::Inbox {
            action: InboxAction::Dead { action },
        } => dead(action).await,
        Command::DevBroker {
            port,
            partitions,
            topics,
        } => crate::dev_broker::run(port, partitions, &topics).await,
    }
}

/// `host:port/database` of a URL, without its credentials.
fn describe(options: &PgConnectOptions) -> String {
    format!(
        "{}:{}/{}",
        options.get_host(),
        options.get_port(),
        options.get_database().unwrap_or("")
    )
}

async fn connect(db: &Db, max_connections: u32) -> Result<PgPool> {
    // No slow-statement warnings: a count on a large table is not a problem worth a log line.
    let options = PgConnectOptions::from_str(&db.database_url)
        .map_err(|e| format!("invalid database URL: {e}"))?
        .disable_statement_logging();
    let target = describe(&options);
    // One connection first: the pool would report a refused connection as a timeout.
    let first = tokio::time::timeout(Duration::from_secs(10), options.connect()).await;
    let first = match first {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => return Err(format!("cannot connect to PostgreSQL at {target}: {e}")),
        Err(_) => {
            return Err(format!(
                "cannot connect to PostgreSQL at {target}: no answer within 10 s"
            ))
        }
    };
    first.close().await.ok();
    Ok(PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(30))
        .connect_lazy_with(options))
}

/// Connects and checks that the schema is up to date.
async fn connect_migrated(db: &Db, max_connections: u32) -> Result<PgPool> {
    let pool = connect(db, max_connections).await?;
    let pending = outbox_runtime::migrate::pending(&pool)
        .await
        .map_err(chain)?;
    if !pending.is_empty() {
        return Err(format!(
            "the database is not migrated ({} of {} outbox migrations pending); run `outbox migrate`",
            pending.len(),
            outbox_runtime::migrate::MIGRATIONS.len()
        ));
    }
    Ok(pool)
}

fn producer_config(brokers: &Brokers) -> Result<ClientConfig> {
    if brokers.brokers.trim().is_empty() {
        return Err("no Kafka brokers: pass --brokers or set KAFKA_BROKERS".into());
    }
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", brokers.brokers.trim());
    for (key, value) in &brokers.producer_config {
        config.set(key, value);
    }
    Ok(config)
}

/// Fails with one clear line when no broker answers within 10 s.
async fn check_kafka(config: &ClientConfig) -> Result {
    let producer: BaseProducer = config
        .create()
        .map_err(|e| format!("invalid Kafka settings: {e}"))?;
    let brokers = config.get("bootstrap.servers").unwrap_or("").to_owned();
    tokio::task::spawn_blocking(move || {
        producer
            .client()
            .fetch_metadata(None, Duration::from_secs(10))
            .map(drop)
    })
    .await
    .map_err(chain)?
    .map_err(|e| format!("cannot reach Kafka at {brokers}: {e}"))
}

async fn migrate(db: &Db) -> Result {
    let pool = connect(db, 2).await?;
    let pending = outbox_runtime::migrate::pending(&pool)
        .await
        .map_err(chain)?;
    outbox_runtime::migrate(&pool).await.map_err(chain)?;
    if pending.is_empty() {
        out!(
            "schema up to date ({} migrations applied)",
            outbox_runtime::migrate::MIGRATIONS.len()
        );
    } else {
        for m in &pending {
            out!("applied {} {}", m.version, m.description);
        }
        out!("applied {} migrations", pending.len());
    }
    Ok(())
}

async fn status(db: &Db, json: bool, max_age: Option<Duration>) -> Result {
    let pool = connect_migrated(db, 2).await?;
    let status = admin::status(&pool).await.map_err(chain)?;
    if json {
        print_json(&status)?;
    } else {
        print_status(&status);
    }
    let Some(max_age) = max_age else {
        return Ok(());
    };
    let outbox = status.outbox.iter().filter_map(|t| {
        Some((
            t.oldest_unpublished_age_secs?,
            "unpublished outbox",
            &t.topic,
        ))
    });
    let inbox = status.inbox.iter().filter_map(|t| {
        Some((
            t.oldest_unprocessed_age_secs?,
            "unprocessed inbox",
            &t.topic,
        ))
    });
    let oldest = outbox.chain(inbox).max_by(|a, b| a.0.total_cmp(&b.0));
    match oldest {
        Some((age, what, topic)) if age > max_age.as_secs_f64() => Err(format!(
            "the oldest {what} row of `{topic}` is {} old, more than {}",
            human(Duration::from_secs_f64(age)),
            human(max_age)
        )),
        _ => Ok(()),
    }
}

fn age(secs: Option<f64>) -> String {
    secs.map_or_else(
        || "-".to_owned(),
        |s| human(Duration::from_secs_f64(s.max(0.0))),
    )
}

fn print_status(status: &Status) {
    out!(
        "outbox ({} relay instances running)",
        status.relay_instances
    );
    if status.outbox.is_empty() {
        out!("  nothing unpublished or parked, nothing published in the last minute");
    } else {
        let rows: Vec<Vec<String>> = status
            .outbox
            .iter()
            .map(|t| {
                vec![
                    t.topic.clone(),
                    t.unpublished.to_string(),
                    t.retrying.to_string(),
                    t.held.to_string(),
                    t.parked.to_string(),
                    age(t.oldest_unpublished_age_secs),
                    t.published_last_minute.to_string(),
                ]
            })
            .collect();
        ui::table(
            &[
                "TOPIC",
                "UNPUBLISHED",
                "RETRYING",
                "HELD",
                "PARKED",
                "OLDEST",
                "PUBLISHED/1M",
            ],
            &[false, true, true, true, true, true, true],
            &rows,
        );
    }
    out!();
    out!("inbox");
    if status.inbox.is_empty() {
        out!("  nothing unprocessed or dead");
    } else {
        let rows: Vec<Vec<String>> = status
            .inbox
            .iter()
            .map(|t| {
                vec![
                    t.topic.clone(),
                    t.unprocessed.to_string(),
                    t.retrying.to_string(),
                    t.dead.to_string(),
                    age(t.oldest_unprocessed_age_secs),
                ]
            })
            .collect();
        ui::table(
            &["TOPIC", "UNPROCESSED", "RETRYING", "DEAD", "OLDEST"],
            &[false, true, true, true, true],
            &rows,
        );
    }
    out!();
    out!("processed_event rows: {}", status.processed_event_rows);
}

async fn relay(args: RelayArgs) -> Result {
    let RelayArgs {
        db,
        brokers,
        instances,
        batch_size,
        poll_interval,
        max_attempts,
        metrics_addr,
    } = args;
    if let Some(addr) = metrics_addr {
        outbox_runtime::serve_prometheus(addr).map_err(chain)?;
    }
    let config = producer_config(&brokers)?;
    // Each instance takes a connection of its own off the pool when it connects (and listens
    // for notifications on another, outside the pool); the pool serves the backlog gauges.
    let pool = connect_migrated(&db, u32::from(instances) * 2 + 2).await?;
    let relay = Relay::builder(pool)
        .producer_config(config)
        .batch_size(batch_size)
        .poll_interval(poll_interval)
        .max_attempts(max_attempts)
        .build()
        .map_err(chain)?;
    let shutdown = Shutdown::listen();
    let cancel = CancellationToken::new();
    let handles: Vec<_> = (0..instances)
        .map(|_| relay.spawn(cancel.clone()))
        .collect();
    tracing::info!(
        instances,
        brokers = %brokers.brokers,
        metrics = ?metrics_addr,
        "outbox relay started"
    );
    out!(
        "outbox relay: {instances} instance(s) publishing to {}; stop with Ctrl-C or SIGTERM",
        brokers.brokers
    );
    shutdown.received().await;
    tracing::info!("outbox relay stopping: finishing the batches in flight");
    cancel.cancel();
    let mut failed = None;
    for handle in handles {
        match handle.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => failed = Some(chain(e)),
            Err(e) => failed = Some(chain(e)),
        }
    }
    if let Some(e) = failed {
        return Err(format!("a relay instance failed to stop cleanly: {e}"));
    }
    let status = relay.status().await.map_err(chain)?;
    out!(
        "stopped; {} unpublished, {} parked",
        status.unpublished,
        status.parked
    );
    Ok(())
}

/// Ctrl-C, or SIGTERM (what process managers send).
/// Ctrl-C or SIGTERM, listened for from [`listen`](Self::listen) on: create it before the
/// process says it runs, so that a signal sent right after is a graceful stop, not the default
/// action (the end of the process).
pub struct Shutdown {
    #[cfg(unix)]
    signals: Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>,
}

impl Shutdown {
    pub fn listen() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Shutdown {
                signals: signal(SignalKind::interrupt())
                    .ok()
                    .zip(signal(SignalKind::terminate()).ok()),
            }
        }
        #[cfg(not(unix))]
        Shutdown {}
    }

    /// Waits for the signal.
    pub async fn received(self) {
        #[cfg(unix)]
        if let Some((mut interrupt, mut terminate)) = self.signals {
            tokio::select! {
                _ = interrupt.recv() => {}
                _ = terminate.recv() => {}
            }
            return;
        }
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

async fn replay(
    db: &Db,
    brokers: &Brokers,
    filter: &ReplayFilter,
    to_topic: Option<&str>,
    dry_run: bool,
    batch_size: u32,
) -> Result {
    let config = producer_config(brokers)?;
    let pool = connect_migrated(db, 2).await?;
    let topic = filter.source_topic();
    let known: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM outbox_event WHERE topic = $1)")
            .bind(topic)
            .fetch_one(&pool)
            .await
            .map_err(chain)?;
    if !known {
        let topics: Vec<String> =
            sqlx::query_scalar("SELECT DISTINCT topic FROM outbox_event ORDER BY 1 LIMIT 20")
                .fetch_all(&pool)
                .await
                .map_err(chain)?;
        let known = if topics.is_empty() {
            "the outbox is empty".to_owned()
        } else {
            format!("topics with events: {}", topics.join(", "))
        };
        return Err(format!(
            "unknown topic `{topic}`: no stored events ({known})"
        ));
    }
    let target = to_topic.unwrap_or(topic);
    if !dry_run {
        check_kafka(&config).await?;
    }
    let replay = Replay::with_producer_config(pool, config)
        .map_err(chain)?
        .batch_size(batch_size);
    let counts = replay.count(filter).await.map_err(chain)?;
    let total = counts.published;
    if dry_run {
        out!(
            "dry run: would replay {total} events from `{topic}` to `{target}`{}",
            unpublished_note(counts.unpublished)
        );
        return Ok(());
    }
    let done = if total == 0 {
        out!("no published events of `{topic}` match; nothing replayed");
        counts
    } else {
        let mut progress = Progress::new(format!("replaying to {target}"), Some(total));
        let result = replay
            .run(filter, to_topic, |sent| progress.update(sent))
            .await;
        progress.finish();
        let done = result.map_err(chain)?;
        let secs = progress.elapsed().as_secs_f64();
        out!(
            "replayed {} events from `{topic}` to `{target}` in {secs:.2} s ({:.0}/s), with their original event ids",
            done.published,
            done.published as f64 / secs.max(1e-3)
        );
        done
    };
    match (done.unpublished, to_topic) {
        (0, _) => Ok(()),
        (n, None) => {
            out!(
                "{n} events of the range are not published yet: the relay sends them to `{topic}`"
            );
            Ok(())
        }
        (n, Some(_)) => Err(format!(
            "{n} events of the range were not published yet (waiting for the relay, or parked) \
             and were not sent to `{target}`: check `outbox status`, then replay them with --since"
        )),
    }
}

/// `; N more are not published yet (skipped)`, or nothing.
fn unpublished_note(n: u64) -> String {
    if n == 0 {
        String::new()
    } else {
        format!(
            "; {n} more are not published yet (waiting for the relay, or parked) and are skipped"
        )
    }
}

async fn cleanup(
    db: &Db,
    older_than: Duration,
    dedup_older_than: Option<Duration>,
    batch: u32,
    mut tables: Vec<CleanupTable>,
    dry_run: bool,
    yes: bool,
) -> Result {
    if tables.is_empty() {
        tables = CleanupTable::ALL.to_vec();
    }
    let mut seen = Vec::new();
    tables.retain(|t| {
        let new = !seen.contains(t);
        seen.push(*t);
        new
    });
    let pool = connect_migrated(db, 2).await?;
    let outbox = Cleanup::new(pool.clone(), older_than).batch_size(batch);
    let dedup = Cleanup::new(pool, dedup_older_than.unwrap_or(older_than)).batch_size(batch);
    let outbox_cut = outbox.cutoff().await.map_err(chain)?;
    let dedup_cut = dedup.cutoff().await.map_err(chain)?;
    let mut plan = Vec::new();
    for &table in &tables {
        let (cleanup, cutoff) = match table {
            CleanupTable::Outbox => (&outbox, outbox_cut),
            _ => (&dedup, dedup_cut),
        };
        let n = cleanup.count(table, cutoff).await.map_err(chain)?;
        plan.push((table, cleanup, cutoff, n));
    }
    let total: u64 = plan.iter().map(|p| p.3).sum();
    let summary = plan
        .iter()
        .map(|(t, _, cutoff, n)| format!("{n} from {} (before {})", t.table_name(), when(*cutoff)))
        .collect::<Vec<_>>()
        .join(", ");
    if dry_run {
        out!("dry run: would delete {total} rows: {summary}");
        return Ok(());
    }
    if total == 0 {
        out!("nothing past the retention; nothing deleted");
        return Ok(());
    }
    ui::confirm(&format!("delete {total} rows: {summary}"), yes)?;
    for (table, cleanup, cutoff, expected) in plan {
        if expected == 0 {
            out!("{}: nothing to delete", table.table_name());
            continue;
        }
        let mut progress =
            Progress::new(format!("cleaning {}", table.table_name()), Some(expected));
        let result = cleanup
            .run(table, cutoff, |done| progress.update(done))
            .await;
        progress.finish();
        let deleted = result.map_err(chain)?;
        out!(
            "{}: deleted {deleted} rows older than {} in {:.2} s",
            table.table_name(),
            when(cutoff),
            progress.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// The filter for a selection; `outbox_ids` says whether integer ids (outbox rows) are allowed.
fn filter_of(
    select: &Selection,
    outbox_ids: bool,
    default_limit: Option<u32>,
) -> Result<PoisonFilter> {
    let mut filter = PoisonFilter::all();
    if let Some(t) = &select.topic {
        filter = filter.topic(t);
    }
    if let Some(e) = &select.event_type {
        filter = filter.event_type(e);
    }
    for id in &select.ids {
        if let Ok(event_id) = uuid::Uuid::parse_str(id) {
            filter = filter.event_id(event_id);
        } else if let (true, Ok(row)) = (outbox_ids, id.parse::<i64>()) {
            filter = filter.id(row);
        } else if outbox_ids {
            return Err(format!(
                "invalid --id `{id}`: expected an event id (UUID) or an outbox row id (integer)"
            ));
        } else {
            return Err(format!("invalid --id `{id}`: expected an event id (UUID)"));
        }
    }
    if let Some(limit) = select.limit.or(default_limit) {
        filter = filter.limit(limit);
    }
    Ok(filter)
}

/// Retry and drop act on every row only when asked to.
fn require_selection(select: &Selection, all: bool) -> Result {
    let filtered = select.topic.is_some()
        || select.event_type.is_some()
        || !select.ids.is_empty()
        || select.limit.is_some();
    if filtered || all {
        Ok(())
    } else {
        Err("say which rows: --id, --topic, --event-type, --limit, or --all".into())
    }
}

fn print_json<T: serde::Serialize>(value: &T) -> Result {
    let text = serde_json::to_string_pretty(value).map_err(chain)?;
    out!("{text}");
    Ok(())
}

fn when(t: chrono::DateTime<chrono::Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

async fn parked(action: ParkedAction) -> Result {
    let (act, retry) = match action {
        ParkedAction::List(List { db, select, json }) => {
            let pool = connect_migrated(&db, 2).await?;
            let filter = filter_of(&select, true, Some(DEFAULT_LIST_LIMIT))?;
            let rows = admin::list_parked(&pool, &filter).await.map_err(chain)?;
            return print_list(
                &rows,
                json,
                select.limit,
                "no parked events",
                &[
                    ("ID", true),
                    ("EVENT_ID", false),
                    ("TOPIC", false),
                    ("KEY", false),
                    ("EVENT_TYPE", false),
                    ("ATTEMPTS", true),
                    ("PARKED_AT", false),
                    ("LAST_ERROR", false),
                ],
                |r| {
                    vec![
                        r.id.to_string(),
                        r.event_id.to_string(),
                        r.topic.clone(),
                        ui::short(&r.partition_key, 24),
                        r.event_type.clone(),
                        r.attempts.to_string(),
                        when(r.parked_at),
                        ui::short(r.last_error.as_deref().unwrap_or(""), 60),
                    ]
                },
            );
        }
        ParkedAction::Retry(act) => (act, true),
        ParkedAction::Drop(act) => (act, false),
    };
    require_selection(&act.select, act.all)?;
    let pool = connect_migrated(&act.db, 2).await?;
    let rows = admin::list_parked(&pool, &filter_of(&act.select, true, None)?)
        .await
        .map_err(chain)?;
    if rows.is_empty() {
        out!("no parked events match; nothing changed");
        return Ok(());
    }
    print_breakdown(
        rows.iter()
            .map(|r| (r.topic.as_str(), r.event_type.as_str())),
    );
    let n = rows.len();
    let question = if retry {
        format!("retry {n} parked events (the relay publishes them again, after their keys' later events)")
    } else {
        format!("delete {n} parked events for good (they will never be published)")
    };
    ui::confirm(&question, act.yes)?;
    // Exactly the rows listed to the user, even if more were parked meanwhile.
    let exact = rows.iter().fold(PoisonFilter::all(), |f, r| f.id(r.id));
    if retry {
        let n = admin::retry_parked(&pool, &exact).await.map_err(chain)?;
        out!("un-parked {n} events; running relays publish them now");
    } else {
        let n = admin::drop_parked(&pool, &exact).await.map_err(chain)?;
        out!("dropped {n} parked events");
    }
    Ok(())
}

/// The rows an action is about to change, counted by topic and event type.
fn print_breakdown<'a>(rows: impl Iterator<Item = (&'a str, &'a str)>) {
    let mut counts: std::collections::BTreeMap<(&str, &str), usize> = Default::default();
    for row in rows {
        *counts.entry(row).or_default() += 1;
    }
    let table: Vec<Vec<String>> = counts
        .into_iter()
        .map(|((topic, event_type), n)| {
            vec![topic.to_owned(), event_type.to_owned(), n.to_string()]
        })
        .collect();
    ui::table(
        &["TOPIC", "EVENT_TYPE", "ROWS"],
        &[false, false, true],
        &table,
    );
}

/// What `list` prints: the rows as JSON, or as a table of `columns` (name, aligned right)
/// with `cells` per row, then whether `--limit` (or its default) may have cut them. With JSON,
/// stdout stays one document and that note goes to stderr.
fn print_list<T: serde::Serialize>(
    rows: &[T],
    json: bool,
    limit: Option<u32>,
    empty: &str,
    columns: &[(&str, bool)],
    cells: impl Fn(&T) -> Vec<String>,
) -> Result {
    let cut = rows.len() >= limit.unwrap_or(DEFAULT_LIST_LIMIT) as usize;
    let shown = rows.len();
    if json {
        if cut {
            eprintln!(
                "note: {shown} rows shown, the oldest first; there may be more: raise --limit"
            );
        }
        return print_json(&rows);
    }
    if rows.is_empty() {
        out!("{empty}");
        return Ok(());
    }
    let header: Vec<&str> = columns.iter().map(|c| c.0).collect();
    let right: Vec<bool> = columns.iter().map(|c| c.1).collect();
    let table: Vec<Vec<String>> = rows.iter().map(cells).collect();
    ui::table(&header, &right, &table);
    if cut {
        out!("({shown} shown, the oldest first; there may be more: raise --limit)");
    } else {
        out!("({shown} rows)");
    }
    Ok(())
}

async fn dead(action: DeadAction) -> Result {
    match action {
        DeadAction::List(List { db, select, json }) => {
            let pool = connect_migrated(&db, 2).await?;
            let filter = filter_of(&select, false, Some(DEFAULT_LIST_LIMIT))?;
            let rows = admin::list_dead(&pool, &filter).await.map_err(chain)?;
            print_list(
                &rows,
                json,
                select.limit,
                "no dead inbox rows",
                &[
                    ("EVENT_ID", false),
                    ("TOPIC", false),
                    ("EVENT_TYPE", false),
                    ("ATTEMPTS", true),
                    ("DEAD_AT", false),
                    ("LAST_ERROR", false),
                ],
                |r| {
                    vec![
                        r.event_id.to_string(),
                        r.topic.clone(),
                        r.event_type.clone(),
                        r.attempts.to_string(),
                        when(r.dead_at),
                        ui::short(r.last_error.as_deref().unwrap_or(""), 60),
                    ]
                },
            )
        }
        DeadAction::Retry(Act {
            db,
            select,
            all,
            yes,
        }) => {
            require_selection(&select, all)?;
            let pool = connect_migrated(&db, 2).await?;
            let rows = admin::list_dead(&pool, &filter_of(&select, false, None)?)
                .await
                .map_err(chain)?;
            if rows.is_empty() {
                out!("no dead inbox rows match; nothing changed");
                return Ok(());
            }
            print_breakdown(
                rows.iter()
                    .map(|r| (r.topic.as_str(), r.event_type.as_str())),
            );
            ui::confirm(
                &format!(
                    "retry {} dead inbox rows (their handlers run again)",
                    rows.len()
                ),
                yes,
            )?;
            let exact = rows
                .iter()
                .fold(PoisonFilter::all(), |f, r| f.event_id(r.event_id));
            let n = admin::retry_dead(&pool, &exact).await.map_err(chain)?;
            out!("revived {n} dead inbox rows; running inbox processors handle them now");
            Ok(())
        }
    }
}
