//! `outbox relay`: relay instances in this process until Ctrl-C or SIGTERM.

use outbox_runtime::admin::Retention;
use outbox_runtime::relay::{JetStream, Relay};
use tokio_util::sync::CancellationToken;

use super::{chain, connect_migrated, connect_mysql_migrated, is_mysql, Result, Target};
use crate::args::RelayArgs;
use crate::shutdown::Shutdown;

pub async fn run(args: RelayArgs) -> Result {
    let RelayArgs {
        db,
        to,
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
    // The broker, before anything connects to the database.
    let target = Target::connect(to).await?;
    // Each instance takes a connection of its own off the pool when it connects (and listens
    // for notifications on another, outside the pool); the pool serves the backlog gauges, the
    // health checks and the readiness probe (2), and retention (2 more: its lock and its
    // batches).
    let extra = if retention.is_some() { 4 } else { 2 };
    let connections = u32::from(instances) * 2 + extra;
    let mut builder = if is_mysql(&db.database_url) {
        Relay::builder(connect_mysql_migrated(&db, connections).await?)
    } else {
        Relay::builder(connect_migrated(&db, connections).await?)
    };
    if let Some(older_than) = retention {
        let mut retention = Retention::new(older_than).every(retention_every);
        if let Some(dedup) = dedup_retention {
            retention = retention.dedup_older_than(dedup);
        }
        builder = builder.retention(retention);
    }
    let builder = match target.clone() {
        Target::Kafka(config, _) => builder.producer_config(config),
        Target::JetStream(client, _) => {
            builder.jetstream(JetStream::new(client).create_streams(create_streams))
        }
        Target::RabbitMq(settings) => builder.rabbitmq(settings),
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
