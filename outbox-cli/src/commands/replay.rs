//! `outbox replay`: publish stored events again, with their original event ids.

use std::time::Duration;

use outbox_runtime::admin::{Replay, ReplayFilter};
use outbox_runtime::relay::Database;
use rdkafka::config::ClientConfig;
use rdkafka::producer::{BaseProducer, Producer};

use super::{chain, OutboxDb, Result, Target};
use crate::args::ReplayArgs;
use crate::ui::Progress;

pub async fn run(args: ReplayArgs) -> Result {
    let ReplayArgs {
        db,
        to,
        topic,
        since,
        until,
        aggregate_type,
        event_type,
        to_topic,
        dry_run,
        batch_size,
    } = args;
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
    let to_topic = to_topic.as_deref();
    let broker = Target::connect(to).await?;
    let outbox = OutboxDb::connect(&db).await?;
    let topic = filter.source_topic();
    if !outbox.has_topic(topic).await? {
        let topics = outbox.topics(20).await?;
        let known = if topics.is_empty() {
            "the outbox is empty".to_owned()
        } else {
            format!("topics with events: {}", topics.join(", "))
        };
        return Err(format!(
            "unknown topic `{topic}`: no stored events ({known})"
        ));
    }
    let pool: Database = match outbox {
        OutboxDb::Postgres(pool) => pool.into(),
        OutboxDb::MySql(pool) => pool.into(),
    };
    let target = to_topic.unwrap_or(topic);
    let replay = match broker {
        Target::Kafka(config, _) => {
            if !dry_run {
                check_kafka(&config).await?;
            }
            Replay::with_producer_config(pool, config)
        }
        Target::JetStream(client, _) => {
            Replay::jetstream(pool, outbox_runtime::relay::JetStream::new(client))
        }
        Target::RabbitMq(settings) => Replay::rabbitmq(pool, settings),
    }
    .map_err(chain)?
    .batch_size(batch_size);
    let counts = replay.count(&filter).await.map_err(chain)?;
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
            .run(&filter, to_topic, |sent| progress.update(sent))
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

/// The outbox's topics, on either database.
impl OutboxDb {
    /// Whether the outbox holds an event of `topic`.
    async fn has_topic(&self, topic: &str) -> Result<bool> {
        let sql = "SELECT EXISTS (SELECT 1 FROM outbox_event WHERE topic = ";
        match self {
            OutboxDb::Postgres(pool) => sqlx::query_scalar(&format!("{sql}$1)"))
                .bind(topic)
                .fetch_one(pool)
                .await
                .map_err(chain),
            OutboxDb::MySql(pool) => sqlx::query_scalar(&format!("{sql}?)"))
                .bind(topic)
                .fetch_one(pool)
                .await
                .map(|found: i64| found != 0)
                .map_err(chain),
        }
    }

    /// The first `n` of the outbox's topics, in order.
    async fn topics(&self, n: u32) -> Result<Vec<String>> {
        // On MariaDB/MySQL the column's binary collation reads as bytes unless cast.
        let sql =
            |topic: &str| format!("SELECT DISTINCT {topic} FROM outbox_event ORDER BY 1 LIMIT {n}");
        match self {
            OutboxDb::Postgres(pool) => sqlx::query_scalar(&sql("topic")).fetch_all(pool).await,
            OutboxDb::MySql(pool) => {
                sqlx::query_scalar(&sql("CAST(topic AS CHAR)"))
                    .fetch_all(pool)
                    .await
            }
        }
        .map_err(chain)
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
