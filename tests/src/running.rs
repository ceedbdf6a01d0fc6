//! A relay or consumer running on a task of its own for the length of a test: stopped (and
//! checked) by the test, aborted if the test ends without stopping it (a failed assertion), so
//! that no worker outlives its test.

use std::panic;

use outbox_runtime::inbox::Consumer;
use outbox_runtime::relay::Relay;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A spawned worker with a cancellation token of its own.
///
/// [`stop`](Self::stop) cancels it, waits for it and asserts that it returned `Ok`; a guard
/// dropped before that cancels the token and aborts the task.
#[must_use = "a worker whose guard is dropped is aborted at once"]
#[derive(Debug)]
pub struct Running {
    what: &'static str,
    cancel: CancellationToken,
    handle: Option<JoinHandle<outbox_runtime::Result<()>>>,
}

impl Running {
    /// Runs `start(token)`: a worker that stops when the token is cancelled (`what` names it in
    /// failure messages).
    pub fn spawn(
        what: &'static str,
        start: impl FnOnce(CancellationToken) -> JoinHandle<outbox_runtime::Result<()>>,
    ) -> Running {
        let cancel = CancellationToken::new();
        let handle = start(cancel.clone());
        Running {
            what,
            cancel,
            handle: Some(handle),
        }
    }

    /// Runs one instance of `relay` ([`Relay::spawn`]).
    pub fn relay(relay: &Relay) -> Running {
        Running::spawn("relay", |cancel| relay.spawn(cancel))
    }

    /// Runs `consumer` ([`Consumer::spawn`]).
    pub fn consumer(consumer: &Consumer) -> Running {
        Running::spawn("consumer", |cancel| consumer.spawn(cancel))
    }

    /// A clone of the worker's token, for tasks of the test that stop with it.
    pub fn token(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// Cancels the worker without waiting for it (see [`stop`](Self::stop)).
    pub fn cancel(&self) {
        self.cancel.cancel();
    }

    /// Whether the worker's task has ended.
    pub fn is_finished(&self) -> bool {
        self.handle.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Cancels the worker, waits for it to return, and asserts that it returned `Ok` (a panic
    /// of the worker is resumed here). If this future is dropped before the worker returned (a
    /// timeout around it), the worker is aborted.
    pub async fn stop(mut self) {
        self.cancel.cancel();
        let handle = self.handle.as_mut().expect("a worker is stopped once");
        let joined = handle.await;
        self.handle = None;
        match joined {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("the {} returned an error: {e:?}", self.what),
            Err(e) if e.is_panic() => panic::resume_unwind(e.into_panic()),
            Err(e) => panic!("the {}'s task did not finish: {e}", self.what),
        }
    }

    /// Aborts the worker's task without cancelling it first, as a crash (`kill -9`) ends it:
    /// none of its own cleanup runs (a consumer's lease is not released, its messages are not
    /// settled).
    pub fn abort(mut self) {
        if let Some(handle) = self.handle.take() {
            handle.abort();
        }
    }

    /// Cancels every worker first, then [`stop`](Self::stop)s each in turn: as workers that
    /// share one token.
    pub async fn stop_all(workers: impl IntoIterator<Item = Running>) {
        let workers: Vec<Running> = workers.into_iter().collect();
        for worker in &workers {
            worker.cancel();
        }
        for worker in workers {
            worker.stop().await;
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(handle) = self.handle.take() {
            self.cancel.cancel();
            handle.abort();
        }
    }
}
