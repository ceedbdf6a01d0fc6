//! Stopping: Ctrl-C, or a background worker that stopped by itself, fires the shutdown token;
//! each worker is then awaited.

use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Fires `shutdown` on Ctrl-C (SIGINT).
pub async fn shutdown_on_ctrl_c(shutdown: CancellationToken) {
    tokio::select! {
        signal = tokio::signal::ctrl_c() => match signal {
            Ok(()) => {
                println!("Ctrl-C received");
                shutdown.cancel();
            }
            Err(e) => eprintln!("cannot listen for Ctrl-C: {e}"),
        },
        () = shutdown.cancelled() => {}
    }
}

/// A background task (relay or consumer). They run until told to stop; one that stops by
/// itself has failed, and then the whole application shuts down.
pub struct Worker {
    name: &'static str,
    task: JoinHandle<Result<(), String>>,
}

impl Worker {
    /// Watches `task`: if it ends (before it was told to stop), fires `shutdown`.
    pub fn spawn(
        name: &'static str,
        task: JoinHandle<outbox_runtime::Result<()>>,
        shutdown: &CancellationToken,
    ) -> Worker {
        let shutdown = shutdown.clone();
        let task = tokio::spawn(async move {
            let result = match task.await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(format!(
                    "{name} failed: {}",
                    outbox_runtime::error_chain(&e)
                )),
                Err(e) => Err(format!("{name} panicked: {e}")),
            };
            if let Err(e) = &result {
                eprintln!("{e}; shutting down");
            }
            shutdown.cancel();
            result
        });
        Worker { name, task }
    }

    /// Waits for the worker to finish (after its token was cancelled).
    pub async fn stop(self) -> Result<(), String> {
        match tokio::time::timeout(Duration::from_secs(30), self.task).await {
            Ok(Ok(result)) => result,
            Ok(Err(e)) => Err(format!("{} panicked: {e}", self.name)),
            Err(_) => Err(format!("{} did not stop within 30 s", self.name)),
        }
    }
}
