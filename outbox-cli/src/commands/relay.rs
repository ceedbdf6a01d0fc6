//! `outbox relay`: relay instances in this process until Ctrl-C or SIGTERM.

use outbox_runtime::admin::Retention;
use outbox_runtime::relay::{JetStream, Relay};
use tokio_util::sync::CancellationToken;

use super::{chain, connect_migrated, producer_config, Result};
use crate::shutdown::Shutdown;
use crate::RelayArgs;

pub async fn run(args: RelayArgs) -> Result {
    let RelayArgs {
        db,
        brokers,
        producer_config: settings,
        nats_url,
        create_streams,
        instances,
        batch_size,
        poll_interval,
        max_attempts,
        metrics_addr,
        health_interval,
        thresholds,
        retention,
        dedup_retention,
        retention_every,
    } = args;
    // The broker, checked before anything connects to the database.
    let target = match (&nats_url, brokers) {
        (Some(url), brokers) => {
            if let Some(brokers) = brokers {
                tracing::info!(%brokers, "publishing to JetStream: the Kafka brokers are ignored");
            }
            let client = async_nats::connect(url.as_str())
                .await
                .map_err(|e| format!("cannot connect to NATS at {url}: {}", chain(e)))?;
            Target::JetStream(
                JetStream::new(client).create_streams(create_streams),
                url.clone(),
            )
        }
        (None, brokers) => {
            let brokers = crate::Brokers {
                brokers: brokers.unwrap_or_default(),
                producer_config: settings,
            };
            Target::Kafka(producer_config(&brokers)?, brokers.brokers)
        }
    };
    // Each instance takes a connection of its own off the pool when it connects (and listens
    // for notifications on another, outside the pool); the pool serves the backlog gauges, the
    // health checks and the readiness probe (2), and retention (2 more: its lock and its
    // batches).
    let extra = if retention.is_some() { 4 } else { 2 };
    let pool = connect_migrated(&db, u32::from(instances) * 2 + extra).await?;
    let mut builder = Relay::builder(pool);
    if let Some(older_than) = retention {
        let mut retention = Retention::new(older_than).every(retention_every);
        if let Some(dedup) = dedup_retention {
            retention = retention.dedup_older_than(dedup);
        }
        builder = builder.retention(retention);
    }
    let builder = match target.clone() {
        Target::Kafka(config, _) => builder.producer_config(config),
        Target::JetStream(jetstream, _) => builder.jetstream(jetstream),
    };
    let relay = builder
        .batch_size(batch_size)
        .poll_interval(poll_interval)
        .max_attempts(max_attempts)
        .health_interval(health_interval)
        .health(thresholds.health())
        .build()
        .map_err(chain)?;
    if let Some(addr) = metrics_addr {
        outbox_runtime::serve_prometheus_for_relay(addr, &relay).map_err(chain)?;
    }
    let shutdown = Shutdown::listen();
    let cancel = CancellationToken::new();
    let handles: Vec<_> = (0..instances)
        .map(|_| relay.spawn(cancel.clone()))
        .collect();
    let to = target.describe();
    tracing::info!(
        instances,
        to,
        metrics = ?metrics_addr,
        "outbox relay started"
    );
    out!("outbox relay: {instances} instance(s) publishing to {to}; stop with Ctrl-C or SIGTERM");
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

/// Where the relay publishes, and how to say so.
#[derive(Clone)]
enum Target {
    Kafka(rdkafka::config::ClientConfig, String),
    JetStream(JetStream, String),
}

impl Target {
    fn describe(&self) -> String {
        match self {
            Target::Kafka(_, brokers) => brokers.trim().to_owned(),
            Target::JetStream(_, url) => format!("JetStream at {url}"),
        }
    }
}
