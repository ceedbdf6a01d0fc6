//! Ctrl-C, or SIGTERM (what process managers send): how `relay` and `dev-broker` stop.

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
