//! What the quickstart needs and does not teach: the command line ([`args`]), the databases
//! and their tables ([`db`]), the broker ([`broker`]: Kafka from [`kafka`], or NATS JetStream), the span printer and the log
//! ([`trace`]), the `--demo` load ([`demo`]) and its latency report ([`latency`]), the orders API's HTTP plumbing ([`http`]), the
//! payment provider's stand-in ([`provider`]), the operator console of `--console`
//! ([`console`]), and stopping ([`shutdown`]).

pub mod args;
pub mod broker;
pub mod console;
pub mod db;
pub mod demo;
pub mod http;
pub mod kafka;
pub mod latency;
pub mod provider;
pub mod shutdown;
pub mod trace;

use std::error::Error;
use std::fmt;

pub type BoxError = Box<dyn Error + Send + Sync>;
pub type Result<T, E = BoxError> = std::result::Result<T, E>;

/// What a failed `main` returns. Rust prints it with `{:?}` after `Error: `, so its `Debug` is
/// the message and its causes, not a data structure.
pub struct Report(pub BoxError);

impl Report {
    /// A command-line problem, followed by the usage text.
    pub fn usage(problem: String) -> Report {
        Report(format!("{problem}\n\n{}", args::USAGE).into())
    }
}

impl fmt::Debug for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", outbox_runtime::error_chain(&*self.0))
    }
}
