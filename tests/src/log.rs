//! The log in memory, for a test that reads what the framework says (its subscriber is
//! process-wide: one per test binary, each test finding its own lines).

use std::sync::{Arc, Mutex};

/// The log, as the subscriber writes it.
#[derive(Clone, Default)]
pub struct Log(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Log {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Log {
    /// Makes this process's log, from `level` up, a new [`Log`]; panics if the process has a
    /// subscriber already.
    pub fn install(level: tracing::Level) -> Log {
        let log = Log::default();
        let writer = log.clone();
        tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_max_level(level)
            .init();
        log
    }

    /// What was written so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}
