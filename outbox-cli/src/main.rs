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

mod args;
mod commands;
mod parse;
mod shutdown;
mod ui;

use std::io::{ErrorKind, IsTerminal, Write};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::Parser;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::EnvFilter;

use args::{Cli, Command, LogFormat};

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
