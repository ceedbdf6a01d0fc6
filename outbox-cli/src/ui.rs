//! Terminal output: progress lines, confirmations, tables.

use std::io::{BufRead, IsTerminal, Write};
use std::time::{Duration, Instant};

/// A progress line on stderr, redrawn at most every 100 ms, only when stderr is a terminal
/// (logs and pipes get the final summary alone).
pub struct Progress {
    label: String,
    total: Option<u64>,
    started: Instant,
    drawn: Option<Instant>,
    tty: bool,
}

impl Progress {
    pub fn new(label: impl Into<String>, total: Option<u64>) -> Self {
        Progress {
            label: label.into(),
            total,
            started: Instant::now(),
            drawn: None,
            tty: std::io::stderr().is_terminal(),
        }
    }

    pub fn update(&mut self, done: u64) {
        if !self.tty
            || self
                .drawn
                .is_some_and(|t| t.elapsed() < Duration::from_millis(100))
        {
            return;
        }
        self.drawn = Some(Instant::now());
        let rate = done as f64 / self.started.elapsed().as_secs_f64().max(1e-3);
        let line = match self.total {
            Some(total) if total > 0 => {
                let width = 30;
                let filled = ((done.min(total) * width) / total) as usize;
                format!(
                    "{} [{}{}] {done}/{total} ({:.0}/s)",
                    self.label,
                    "#".repeat(filled),
                    "-".repeat(width as usize - filled),
                    rate
                )
            }
            _ => format!("{} {done} ({rate:.0}/s)", self.label),
        };
        eprint!("\r{line}\x1b[K");
        let _ = std::io::stderr().flush();
    }

    /// Clears the line; the caller prints the summary.
    pub fn finish(&self) {
        if self.tty && self.drawn.is_some() {
            eprint!("\r\x1b[K");
        }
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}

/// Asks before a destructive action. `yes` (the `--yes` flag) answers for the user; without
/// it, stdin must be a terminal to ask on.
pub fn confirm(question: &str, yes: bool) -> Result<(), String> {
    if yes {
        return Ok(());
    }
    if !std::io::stdin().is_terminal() {
        return Err(format!(
            "{question}: refusing without confirmation; pass --yes (stdin is not a terminal)"
        ));
    }
    eprint!("{question}? [y/N] ");
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut answer)
        .map_err(|e| format!("cannot read the answer: {e}"))?;
    if matches!(answer.trim(), "y" | "Y" | "yes" | "YES" | "Yes") {
        Ok(())
    } else {
        Err("cancelled; nothing was changed".to_owned())
    }
}

/// Prints rows as a table with a header, columns padded to their widest cell; `right` marks
/// columns aligned right (numbers).
pub fn table(header: &[&str], right: &[bool], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut out = String::new();
        for (i, cell) in cells.iter().enumerate() {
            let pad = widths[i].saturating_sub(cell.chars().count());
            if i > 0 {
                out.push_str("  ");
            }
            if right.get(i).copied().unwrap_or(false) {
                out.push_str(&" ".repeat(pad));
                out.push_str(cell);
            } else {
                out.push_str(cell);
                if i + 1 < cells.len() {
                    out.push_str(&" ".repeat(pad));
                }
            }
        }
        out!("{out}");
    };
    line(header.to_vec());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
}

/// `text` cut to `max` characters, on one line.
pub fn short(text: &str, max: usize) -> String {
    let one_line: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if one_line.chars().count() <= max {
        one_line
    } else {
        let cut: String = one_line.chars().take(max.saturating_sub(1)).collect();
        format!("{cut}…")
    }
}
