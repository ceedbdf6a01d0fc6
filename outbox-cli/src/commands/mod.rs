//! What each command does, one file per subcommand (`args/` only defines the command line).
//! Here: the dispatch, and what several commands share (connecting and checking the schema, the
//! Kafka settings, the selection and listing of poison rows, printing).

mod cleanup;
mod console;
mod dev_broker;
mod inbox;
mod migrate;
mod parked;
mod partitions;
mod relay;
mod replay;
mod status;
mod topics;

use std::str::FromStr;
use std::time::Duration;

use outbox_runtime::admin::PoisonFilter;
use rdkafka::config::ClientConfig;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgPool};

use crate::args::{Brokers, Command, Db, PublishTo, Selection};
use crate::ui;

type Result<T = ()> = std::result::Result<T, String>;

pub async fn run(command: Command) -> Result {
    match command {
        Command::Migrate { db } => migrate::run(&db).await,
        Command::Status {
            db,
            json,
            check,
            thresholds,
            max_age,
            queues,
        } => status::run(&db, json, check, &thresholds.health(), max_age, &queues).await,
        Command::Relay(args) => relay::run(args).await,
        Command::Replay(args) => replay::run(args).await,
        Command::Cleanup(args) => cleanup::run(args).await,
        Command::Topics { action } => topics::run(action).await,
        Command::Partitions { action } => partitions::run(action).await,
        Command::Parked { action } => parked::run(action).await,
        Command::Inbox { action } => inbox::run(action).await,
        Command::Console(args) => console::run(args).await,
        Command::DevBroker {
            port,
            partitions,
            topics,
        } => dev_broker::run(port, partitions, &topics).await,
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

/// Whether `url` names a MariaDB or MySQL server.
fn is_mysql(url: &str) -> bool {
    url.starts_with("mysql://") || url.starts_with("mariadb://")
}

async fn connect(db: &Db, max_connections: u32) -> Result<PgPool> {
    if is_mysql(&db.database_url) {
        return Err(
            "MariaDB/MySQL: only `outbox migrate`, `relay`, `status`, `cleanup`, `parked` and \
             `replay` take a mysql:// URL so far; the other commands on it are not built yet"
                .into(),
        );
    }
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
    migrated(pending.len(), outbox_runtime::migrate::MIGRATIONS.len())?;
    Ok(pool)
}

/// A MariaDB/MySQL pool (a `mysql://` URL), its schema checked as [`connect_migrated`] does.
async fn connect_mysql_migrated(db: &Db, max_connections: u32) -> Result<sqlx::MySqlPool> {
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(30))
        .connect(&db.database_url)
        .await
        .map_err(|e| format!("cannot connect to MariaDB/MySQL: {e}"))?;
    let pending = outbox_runtime::mysql::pending(&pool).await.map_err(chain)?;
    migrated(pending.len(), outbox_runtime::mysql::MIGRATIONS.len())?;
    Ok(pool)
}

/// The outbox's database, PostgreSQL or MariaDB/MySQL by its URL, migrated: for the commands
/// that work on either.
enum OutboxDb {
    Postgres(PgPool),
    MySql(sqlx::MySqlPool),
}

impl OutboxDb {
    async fn connect(db: &Db) -> Result<OutboxDb> {
        Ok(if is_mysql(&db.database_url) {
            OutboxDb::MySql(connect_mysql_migrated(db, 2).await?)
        } else {
            OutboxDb::Postgres(connect_migrated(db, 2).await?)
        })
    }
}

/// Refuses a database with migrations pending.
fn migrated(pending: usize, all: usize) -> Result {
    if pending > 0 {
        return Err(format!(
            "the database is not migrated ({pending} of {all} outbox migrations pending); run \
             `outbox migrate`"
        ));
    }
    Ok(())
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

/// Where `relay` and `replay` publish, connected (NATS) or checked (Kafka's settings).
#[derive(Clone)]
enum Target {
    /// The producer's settings, and the brokers.
    Kafka(ClientConfig, String),
    /// A connected client, and its URL.
    JetStream(outbox_runtime::async_nats::Client, String),
    /// RabbitMQ's settings (checked: the relay connects, and says so while it cannot).
    RabbitMq(outbox_runtime::rabbitmq::RabbitMq),
}

impl Target {
    async fn connect(to: PublishTo) -> Result<Target> {
        let PublishTo {
            brokers,
            producer_config: settings,
            nats_url,
            rabbitmq,
        } = to;
        if let Some(settings) = rabbitmq.settings() {
            if let Some(brokers) = brokers {
                tracing::info!(%brokers, "publishing to RabbitMQ: the Kafka brokers are ignored");
            }
            return Ok(Target::RabbitMq(settings));
        }
        match nats_url {
            Some(url) => {
                if let Some(brokers) = brokers {
                    tracing::info!(%brokers, "publishing to JetStream: the Kafka brokers are ignored");
                }
                let client = outbox_runtime::async_nats::connect(url.as_str())
                    .await
                    .map_err(|e| format!("cannot connect to NATS at {url}: {}", chain(e)))?;
                Ok(Target::JetStream(client, url))
            }
            None => {
                let brokers = Brokers {
                    brokers: brokers.unwrap_or_default(),
                    producer_config: settings,
                };
                Ok(Target::Kafka(producer_config(&brokers)?, brokers.brokers))
            }
        }
    }

    /// Where, for a person: the brokers, or "JetStream at URL".
    fn describe(&self) -> String {
        match self {
            Target::Kafka(_, brokers) => brokers.trim().to_owned(),
            Target::JetStream(_, url) => format!("JetStream at {url}"),
            Target::RabbitMq(settings) => format!("RabbitMQ at {}", settings.url_for_display()),
        }
    }
}

/// An error and its causes, on one line.
fn chain<E: std::error::Error + 'static>(error: E) -> String {
    outbox_runtime::error_chain(&error).to_string()
}

fn print_json<T: serde::Serialize>(value: &T) -> Result {
    let text = serde_json::to_string_pretty(value).map_err(chain)?;
    out!("{text}");
    Ok(())
}

fn when(t: chrono::DateTime<chrono::Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

/// Rows `list` shows unless `--limit` says otherwise.
const DEFAULT_LIST_LIMIT: u32 = 100;

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
