//! `outbox`: the operator's tool for the transactional outbox and inbox. See `outbox --help`
//! and its README (`outbox-cli/README.md`); operating the outbox: `docs/operations.md`.

/// `println!` for a command's results. A closed stdout (`outbox status | head -1`) ends the
/// output, not the command: the rest is dropped, the command finishes its work and exits as it
/// would have, like any Unix filter.
macro_rules! out {
    () => {
        $crate::print_line(format_args!(""))
    };
    ($($arg:tt)*) => {
        $crate::print_line(format_args!($($arg)*))
    };
}

mod commands;
mod parse;
mod shutdown;
mod ui;

use std::io::{ErrorKind, IsTerminal, Write};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::EnvFilter;

/// Operate the transactional outbox and inbox: migrations, status, relays, replay, retention
/// and poison events.
#[derive(Debug, Parser)]
#[command(name = "outbox", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// How log lines (on stderr) look; which are shown is RUST_LOG's to say (by default
    /// `info` for `relay`, `console` and `dev-broker`, `warn` for the others)
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "OUTBOX_LOG_FORMAT")]
    log_format: LogFormat,
}

/// How log lines look.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    /// One line of text per event, coloured on a terminal
    Text,
    /// One JSON object per line, for a log collector
    Json,
}

/// Where the database is.
#[derive(Debug, Args)]
struct Db {
    /// PostgreSQL URL, e.g. postgres://user:password@host:5432/app
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, value_name = "URL")]
    database_url: String,
}

/// Where Kafka is.
#[derive(Debug, Args)]
struct Brokers {
    /// Kafka bootstrap servers, e.g. broker1:9092,broker2:9092
    #[arg(long, env = "KAFKA_BROKERS", value_name = "HOST:PORT,...")]
    brokers: String,
    /// A producer setting (librdkafka's names), e.g. -X security.protocol=SASL_SSL; repeatable
    #[arg(short = 'X', long = "producer-config", value_name = "KEY=VALUE", value_parser = parse::key_value)]
    producer_config: Vec<(String, String)>,
}

/// Where `relay` and `replay` publish: Kafka, or NATS JetStream.
#[derive(Debug, Args)]
struct PublishTo {
    /// Kafka bootstrap servers, e.g. broker1:9092,broker2:9092 (or --nats-url)
    #[arg(
        long,
        env = "KAFKA_BROKERS",
        value_name = "HOST:PORT,...",
        required_unless_present = "nats_url"
    )]
    brokers: Option<String>,
    /// A producer setting (librdkafka's names), e.g. -X security.protocol=SASL_SSL; repeatable
    #[arg(short = 'X', long = "producer-config", value_name = "KEY=VALUE", value_parser = parse::key_value)]
    producer_config: Vec<(String, String)>,
    /// Publish to NATS JetStream instead of Kafka, e.g. nats://127.0.0.1:4222 (a topic is a
    /// subject, which a stream must capture); KAFKA_BROKERS is then ignored
    #[arg(long, value_name = "URL", conflicts_with = "producer_config")]
    nats_url: Option<String>,
}

/// `outbox relay`'s options.
#[derive(Debug, Args)]
struct RelayArgs {
    #[command(flatten)]
    db: Db,
    #[command(flatten)]
    to: PublishTo,
    /// With --nats-url: create a stream for a topic that no stream captures (by default its
    /// events are held until one exists)
    #[arg(long, requires = "nats_url")]
    create_streams: bool,
    /// Relay instances in this process (they share the shards with every other relay);
    /// each holds two database connections
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    instances: u16,
    /// Rows claimed per batch
    #[arg(long, default_value_t = 500)]
    batch_size: usize,
    /// How often an idle relay looks for work without a notification
    #[arg(long, default_value = "500ms", value_parser = parse::duration)]
    poll_interval: Duration,
    /// Refusals of a record before it is parked
    #[arg(long, default_value_t = 5)]
    max_attempts: u32,
    /// Serve Prometheus metrics at http://HOST:PORT/metrics, e.g. 127.0.0.1:9464
    #[arg(long, env = "OUTBOX_METRICS_ADDR", value_name = "HOST:PORT")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Also run retention, beside publishing: delete published outbox rows (and the dedup
    /// records with them) older than this, e.g. 30d; one relay process at a time does it
    #[arg(long, value_parser = parse::duration, value_name = "DURATION")]
    retention: Option<Duration>,
    /// With --retention: keep the dedup records (processed_event, processed inbox rows) this
    /// long instead; not shorter than --retention
    #[arg(long, value_parser = parse::duration, value_name = "DURATION", requires = "retention")]
    dedup_retention: Option<Duration>,
    /// With --retention: how often it runs
    #[arg(long, default_value = "1h", value_parser = parse::duration, value_name = "DURATION")]
    retention_every: Duration,
    /// How often to check the outbox's health and log its warnings (0s: never)
    #[arg(long, default_value = "30s", value_parser = parse::duration, value_name = "DURATION")]
    health_interval: Duration,
    #[command(flatten)]
    thresholds: Thresholds,
}

/// When `status` and `relay` warn about the outbox's health.
#[derive(Debug, Args)]
struct Thresholds {
    /// Warn when an event has waited longer than this to be published [default: 1m]
    #[arg(long, value_parser = parse::duration, value_name = "DURATION")]
    warn_unpublished_age: Option<Duration>,
    /// Warn when an inbox row has waited longer than this to be processed [default: 5m]
    #[arg(long, value_parser = parse::duration, value_name = "DURATION")]
    warn_unprocessed_age: Option<Duration>,
    /// Warn when an outbox or inbox table holds more dead rows than this [default: 500000]
    #[arg(long, value_name = "ROWS")]
    warn_dead_rows: Option<i64>,
    /// Warn when a table with 10000 dead rows or more was last vacuumed longer ago than this
    /// [default: 1h]
    #[arg(long, value_parser = parse::duration, value_name = "DURATION")]
    warn_vacuum_age: Option<Duration>,
    /// Warn when a session or a prepared transaction has held back the cleanup horizon longer
    /// than this [default: 5m]
    #[arg(long, value_parser = parse::duration, value_name = "DURATION")]
    warn_transaction_age: Option<Duration>,
    /// Warn sooner of a session idle in its transaction this long in one stretch (it holds
    /// the cleanup horizon while it waits) [default: 30s]
    #[arg(long, value_parser = parse::duration, value_name = "DURATION")]
    warn_idle_transaction_age: Option<Duration>,
    /// Warn when a partitioned table's partitions reach less than this past now [default: 1d,
    /// or half the layout's ahead if less]
    #[arg(long, value_parser = parse::duration, value_name = "DURATION")]
    warn_partitions_ahead: Option<Duration>,
    /// Warn when the outbox or the inbox has more partitions than this (every claim reads
    /// each of them) [default: 60]
    #[arg(long, value_name = "PARTITIONS")]
    warn_partitions: Option<usize>,
    /// Leave out warnings of this kind; repeatable. Kinds: autovacuum_off, dead_rows,
    /// vacuum_overdue, long_transaction, replication_slot, standby_feedback, prepared_transaction,
    /// old_unpublished, old_unprocessed, held_keys, parked, dead_inbox, missing_topic,
    /// partitions_not_ahead, partition_not_dropped, many_partitions, conversion_interrupted
    #[arg(long, value_name = "KIND")]
    ignore: Vec<outbox_runtime::admin::WarningKind>,
}

impl Thresholds {
    fn health(&self) -> outbox_runtime::admin::HealthThresholds {
        let mut t = outbox_runtime::admin::HealthThresholds::default();
        if let Some(age) = self.warn_unpublished_age {
            t = t.unpublished_age(age);
        }
        if let Some(age) = self.warn_unprocessed_age {
            t = t.unprocessed_age(age);
        }
        if let Some(rows) = self.warn_dead_rows {
            t = t.dead_rows(rows);
        }
        if let Some(age) = self.warn_vacuum_age {
            t = t.vacuum_age(age);
        }
        if let Some(age) = self.warn_transaction_age {
            t = t.transaction_age(age);
        }
        if let Some(age) = self.warn_idle_transaction_age {
            t = t.idle_transaction_age(age);
        }
        if let Some(ahead) = self.warn_partitions_ahead {
            t = t.partitions_ahead(ahead);
        }
        if let Some(partitions) = self.warn_partitions {
            t = t.max_partitions(partitions);
        }
        self.ignore.iter().fold(t, |t, kind| t.ignore(*kind))
    }
}

/// `outbox replay`'s options.
#[derive(Debug, Args)]
struct ReplayArgs {
    #[command(flatten)]
    db: Db,
    #[command(flatten)]
    to: PublishTo,
    /// The topic whose published events to replay
    #[arg(long)]
    topic: String,
    /// Only events created at or after this time (RFC 3339, a date, or a duration ago: 2h)
    #[arg(long, value_parser = parse::time, value_name = "TIME")]
    since: Option<chrono::DateTime<chrono::Utc>>,
    /// Only events created before this time
    #[arg(long, value_parser = parse::time, value_name = "TIME")]
    until: Option<chrono::DateTime<chrono::Utc>>,
    /// Only events of this aggregate type
    #[arg(long)]
    aggregate_type: Option<String>,
    /// Only events of this event type
    #[arg(long)]
    event_type: Option<String>,
    /// Publish to this topic instead of the original one
    #[arg(long, value_name = "TOPIC")]
    to_topic: Option<String>,
    /// Count what would be replayed, publish nothing
    #[arg(long)]
    dry_run: bool,
    /// Records sent before waiting for their acknowledgements
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u32).range(1..=50_000))]
    batch_size: u32,
}

/// `outbox topics`' actions.
#[derive(Debug, Subcommand)]
enum TopicsAction {
    /// Create the topics an installation needs, for brokers that do not create topics on first
    /// use: each source topic (--topic, and those of rows waiting in the outbox), and beside it
    /// its retry and dead-letter topics with its partition count; existing topics are left as
    /// they are
    Ensure(TopicsEnsureArgs),
}

/// `outbox topics ensure`'s options.
#[derive(Debug, Args)]
struct TopicsEnsureArgs {
    #[command(flatten)]
    db: Db,
    #[command(flatten)]
    brokers: Brokers,
    /// A source topic to ensure (repeatable), besides those of the outbox's waiting rows
    #[arg(long = "topic", value_name = "TOPIC")]
    topics: Vec<String>,
    /// Partitions of a source topic that must be created (required when one must be)
    #[arg(long, value_parser = clap::value_parser!(i32).range(1..=100_000))]
    partitions: Option<i32>,
    /// Replication factor of the topics created [default: the broker's]
    #[arg(long, value_parser = clap::value_parser!(i32).range(1..=100))]
    replication_factor: Option<i32>,
    /// Retry topics per source topic, as the consumers' retry_tiers (0: none)
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(0..=100))]
    retry_tiers: u32,
    /// The retry topics' suffix, as the consumers' retry_suffix
    #[arg(long, default_value = ".retry")]
    retry_suffix: String,
    /// The dead-letter topics' suffix, as the consumers' dlq_suffix
    #[arg(long, default_value = ".dlq")]
    dlq_suffix: String,
    /// Say what would be created, create nothing
    #[arg(long)]
    dry_run: bool,
    /// Print JSON instead of a table
    #[arg(long)]
    json: bool,
}

/// `outbox partitions`' actions.
#[derive(Debug, Subcommand)]
enum PartitionsAction {
    /// A table's partitions: bounds, estimated rows, size (or that it is not partitioned yet)
    List {
        #[command(flatten)]
        db: Db,
        #[command(flatten)]
        table: PartitionedTable,
        /// Print JSON instead of a table
        #[arg(long)]
        json: bool,
    },
    /// Create the partitions missing up to the layout's `ahead` past now (relays with
    /// retention and dedup consumers do it on their own)
    Create {
        #[command(flatten)]
        db: Db,
        #[command(flatten)]
        table: PartitionedTable,
    },
    /// Change the width of the partitions created from the last one on, and how far ahead
    /// they are kept created; then create what is missing
    Set {
        #[command(flatten)]
        db: Db,
        #[command(flatten)]
        table: PartitionedTable,
        /// Each new partition's width, a whole number of minutes up to 31 days, e.g. 1h, 1d
        #[arg(long, value_parser = parse::duration, value_name = "DURATION")]
        width: Duration,
        /// How far past now partitions are kept created, at least 1h, e.g. 3d
        #[arg(long, value_parser = parse::duration, value_name = "DURATION")]
        ahead: Duration,
    },
    /// Convert an installation's plain table to partitions in place, while consumers and emitters run (consumers of this version or later: stop older ones
    /// first; for outbox, stop the relays first); nothing is copied, the old table becomes the first partition
    Convert {
        #[command(flatten)]
        db: Db,
        #[command(flatten)]
        table: PartitionedTable,
        /// Convert without asking
        #[arg(long)]
        yes: bool,
    },
}

/// Which partitioned table.
#[derive(Debug, Args)]
struct PartitionedTable {
    /// The table: processed (processed_event, dedup mode's records), inbox (inbox_event) or outbox (outbox_event)
    #[arg(long, default_value = "processed", value_parser = parse::partitioned_table)]
    table: outbox_runtime::admin::CleanupTable,
}

/// `outbox cleanup`'s options.
#[derive(Debug, Args)]
struct CleanupArgs {
    #[command(flatten)]
    db: Db,
    /// The retention, e.g. 30d, 12h, 1w
    #[arg(long, value_parser = parse::duration, value_name = "DURATION")]
    older_than: Duration,
    /// A longer retention for the dedup records (processed inbox rows, processed_event):
    /// a message delivered again after its record is gone is handled again. Default: the
    /// same as --older-than (a replay can resend anything still in the outbox)
    #[arg(long, value_parser = parse::duration, value_name = "DURATION")]
    dedup_older_than: Option<Duration>,
    /// Rows deleted per transaction
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    batch: u32,
    /// Only these tables (outbox, inbox, processed); repeatable; default all three
    #[arg(long = "table", value_name = "TABLE")]
    tables: Vec<outbox_runtime::admin::CleanupTable>,
    /// Count what would be deleted, delete nothing
    #[arg(long)]
    dry_run: bool,
    /// Do not ask for confirmation
    #[arg(long, short = 'y')]
    yes: bool,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Apply the outbox/inbox migrations (idempotent; safe from several processes at once)
    Migrate {
        #[command(flatten)]
        db: Db,
    },
    /// Backlog per topic: unpublished, parked, oldest unpublished age, published in the last
    /// minute; inbox backlog and dead rows; processed_event size; the tables' vacuum figures and
    /// the health warnings (autovacuum off, dead rows, the cleanup horizon held back, ...)
    Status {
        #[command(flatten)]
        db: Db,
        /// Print JSON instead of tables
        #[arg(long)]
        json: bool,
        /// Exit with an error (code 1) while any health warning stands: a check for cron or a
        /// probe
        #[arg(long)]
        check: bool,
        #[command(flatten)]
        thresholds: Thresholds,
        /// Exit with an error (code 1) when an unpublished outbox row or an unprocessed inbox
        /// row is older than this, e.g. 2m: a health check for cron or a probe
        #[arg(long, value_parser = parse::duration, value_name = "DURATION")]
        max_age: Option<Duration>,
    },
    /// Run relays as a standalone process until Ctrl-C or SIGTERM
    Relay(RelayArgs),
    /// Publish stored events again (with their original event_id), to rebuild a projection
    Replay(ReplayArgs),
    /// Retention: delete published outbox rows, processed inbox rows and processed_event rows
    /// older than a cut-off, in small batches (never an unpublished, parked or dead row)
    Cleanup(CleanupArgs),
    /// The broker's topics: create what the installation needs
    Topics {
        #[command(subcommand)]
        action: TopicsAction,
    },
    /// processed_event's time partitions: list them, create them ahead, change their width,
    /// convert an installation from before partitions
    Partitions {
        #[command(subcommand)]
        action: PartitionsAction,
    },
    /// Parked outbox events (refused by the broker too often): list, retry, drop
    Parked {
        #[command(subcommand)]
        action: ParkedAction,
    },
    /// The inbox's dead rows (handlers failed for good): list, retry
    Inbox {
        #[command(subcommand)]
        action: InboxAction,
    },
    /// Serve the operator console: web pages over the outbox and inbox (backlog and charts,
    /// relays and held keys, parked and dead rows with retry/skip/discard, find an event), until
    /// Ctrl-C or SIGTERM
    Console(ConsoleArgs),
    /// Run an in-memory Kafka (librdkafka's mock cluster) on a local port, for trying things out
    DevBroker {
        /// The local port to listen on
        #[arg(long, default_value_t = 9092)]
        port: u16,
        /// Partitions of the topics created with --topic
        #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(i32).range(1..=1000))]
        partitions: i32,
        /// A topic to create at start; repeatable (others are created on first use, with 4
        /// partitions)
        #[arg(long = "topic", value_name = "TOPIC")]
        topics: Vec<String>,
    },
}

/// `outbox console`'s arguments.
#[derive(Debug, Args)]
struct ConsoleArgs {
    #[command(flatten)]
    db: Db,
    /// The address to serve on; anything but a loopback address lets other machines read the
    /// pages (payloads included)
    #[arg(long, default_value = "127.0.0.1:8080", value_name = "HOST:PORT")]
    listen: std::net::SocketAddr,
    /// Allow actions (retry, skip, discard) to whoever signs in with --token
    #[arg(long)]
    allow_actions: bool,
    /// The token that actions need (at least 16 characters); only with --allow-actions
    #[arg(
        long,
        env = "OUTBOX_CONSOLE_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN"
    )]
    token: Option<String>,
    /// How often the charts' figures are sampled
    #[arg(long, default_value = "10s", value_parser = parse::duration, value_name = "DURATION")]
    sample_interval: Duration,
    #[command(flatten)]
    thresholds: Thresholds,
}

/// Which poison rows: filters, or `--all`.
#[derive(Debug, Args)]
struct Selection {
    /// Only rows of this topic
    #[arg(long)]
    topic: Option<String>,
    /// Only rows of this event type
    #[arg(long)]
    event_type: Option<String>,
    /// Only this row: an event id (UUID), or an outbox row id; repeatable
    #[arg(long = "id", value_name = "ID")]
    ids: Vec<String>,
    /// At most this many rows, the oldest first
    #[arg(long)]
    limit: Option<u32>,
}

/// `list`: which rows, and how to print them.
#[derive(Debug, Args)]
struct List {
    #[command(flatten)]
    db: Db,
    #[command(flatten)]
    select: Selection,
    /// Print JSON (with payloads)
    #[arg(long)]
    json: bool,
}

/// `retry` / `drop`: which rows, and the confirmation.
#[derive(Debug, Args)]
struct Act {
    #[command(flatten)]
    db: Db,
    #[command(flatten)]
    select: Selection,
    /// Every row (when no filter is given)
    #[arg(long)]
    all: bool,
    /// Do not ask for confirmation
    #[arg(long, short = 'y')]
    yes: bool,
}

#[derive(Debug, Subcommand)]
enum ParkedAction {
    /// List parked events (the oldest first; 100 unless --limit)
    List(List),
    /// Un-park events: the relay publishes them again, attempts reset
    Retry(Act),
    /// Delete parked events for good
    Drop(Act),
}

#[derive(Debug, Subcommand)]
enum InboxAction {
    /// Dead inbox rows: list, retry, discard
    Dead {
        #[command(subcommand)]
        action: DeadAction,
    },
}

#[derive(Debug, Subcommand)]
enum DeadAction {
    /// List dead inbox rows (the oldest first; 100 unless --limit)
    List(List),
    /// Revive dead rows: the inbox processors handle them again, attempts reset
    Retry(Act),
    /// Settle dead rows without handling them: they stay as processed dedup records (a
    /// redelivery is not handled either), and retention removes them in time
    Discard(Act),
}

/// Installs the log subscriber: RUST_LOG's filter (`default` when it is not set), lines on
/// stderr in `format`.
fn init_logging(default: LevelFilter, format: LogFormat) -> Result<(), String> {
    // Unset or empty (a blank variable in a container): the default.
    let filter = match std::env::var(EnvFilter::DEFAULT_ENV) {
        Ok(directives) if !directives.trim().is_empty() => EnvFilter::try_new(&directives)
            .map_err(|e| format!("invalid RUST_LOG: {}", outbox_runtime::error_chain(&e)))?,
        _ => EnvFilter::default().add_directive(default.into()),
    };
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false);
    match format {
        LogFormat::Text => logs.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => logs.json().with_ansi(false).init(),
    }
    Ok(())
}

/// Writes one line to stdout, unless stdout was found closed (see [`out!`]).
fn print_line(line: std::fmt::Arguments<'_>) {
    static CLOSED: AtomicBool = AtomicBool::new(false);
    if CLOSED.load(Ordering::Relaxed) {
        return;
    }
    if let Err(e) = writeln!(std::io::stdout().lock(), "{line}") {
        CLOSED.store(true, Ordering::Relaxed);
        if e.kind() != ErrorKind::BrokenPipe {
            tracing::warn!(error = %e, "cannot write to stdout; the rest of the output is dropped");
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The long-running commands log what they do; the others print their results and log
    // only problems. RUST_LOG says otherwise.
    let level = match cli.command {
        Command::Relay { .. } | Command::DevBroker { .. } | Command::Console { .. } => {
            LevelFilter::INFO
        }
        _ => LevelFilter::WARN,
    };
    if let Err(message) = init_logging(level, cli.log_format) {
        eprintln!("error: {message}");
        return ExitCode::from(2);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(commands::run(cli.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}
