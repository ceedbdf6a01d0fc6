//! `outbox console`: the operator console (the runtime's `console::router`) on its own server,
//! until Ctrl-C or SIGTERM.

use outbox_runtime::console::{self, ConsoleSettings};

use super::{chain, connect_migrated, Result};
use crate::args::ConsoleArgs;
use crate::shutdown::Shutdown;

pub async fn run(args: ConsoleArgs) -> Result {
    let ConsoleArgs {
        db,
        listen,
        allow_actions,
        token,
        sample_interval,
        thresholds,
        queues,
    } = args;
    let mut settings = ConsoleSettings::default()
        .health_thresholds(thresholds.health())
        .sample_interval(sample_interval);
    if let Some(rabbitmq) = queues.settings() {
        settings = settings
            .rabbitmq_queues(rabbitmq, queues.groups)
            .rabbitmq_topics(queues.topics);
    }
    match (allow_actions, token) {
        (true, Some(token)) => settings = settings.allow_actions(token),
        (true, None) => {
            return Err(
                "--allow-actions needs a token: pass --token or set OUTBOX_CONSOLE_TOKEN".into(),
            )
        }
        (false, Some(_)) => {
            return Err(
                "a token without --allow-actions guards nothing: add --allow-actions, or drop the token"
                    .into(),
            )
        }
        (false, None) => {}
    }
    let actions = settings.actions_allowed();
    // Pages, the sampler and actions: a few connections at a time.
    let pool = connect_migrated(&db, 4).await?;
    let app = console::router(pool, settings).map_err(chain)?;
    let shutdown = Shutdown::listen();
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    let reach = if addr.ip().is_loopback() {
        "only this machine can reach it"
    } else {
        "OTHER MACHINES CAN REACH IT: it shows payloads; put it behind your own access control"
    };
    let mode = if actions {
        "actions allowed to whoever signs in with the token"
    } else {
        "read-only"
    };
    eprintln!("outbox console on http://{addr}/ ({mode}; {reach}); Ctrl-C stops it");
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.received())
        .await
        .map_err(|e| format!("the console's server failed: {e}"))?;
    eprintln!("console stopped");
    Ok(())
}
