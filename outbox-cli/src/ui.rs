//! Terminal output: progress lines, confirmations, tables.

use std::io::{BufRead, IsTerminal, Write};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A progress bar on stderr (indicatif), redrawn at most 10 times a second, only when stderr
/// is a terminal (logs and pipes get the final summary alone).
pub struct Progress {
    bar: ProgressBar,
}

/// `label [#####>----] done/total (rate)`, or without a total `label done (rate)`.
const WITH_TOTAL: &str = "{msg} [{bar:30}] {pos}/{len} ({per_sec})";
const WITHOUT_TOTAL: &str = "{msg} {pos} ({per_sec})";

impl Progress {
    pub fn new(label: impl Into<String>, total: Option<u64>) -> Self {
        let (bar, template) = match total {
            Some(total) if total > 0 => (ProgressBar::new(total), WITH_TOTAL),
            _ => (ProgressBar::no_length(), WITHOUT_TOTAL),
        };
        bar.set_draw_target(ProgressDrawTarget::stderr_with_hz(10));
        if let Ok(style) = ProgressStyle::with_template(template) {
            bar.set_style(style.progress_chars("#>-"));
        }
        bar.set_message(label.into());
        Progress { bar }
    }

    pub fn update(&mut self, done: u64) {
        self.bar.set_position(done);
    }

    /// Clears the bar; the caller prints the summary.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }

    pub fn elapsed(&self) -> Duration {
        self.bar.elapsed()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_templates_are_valid() {
        for template in [WITH_TOTAL, WITHOUT_TOTAL] {
            assert!(ProgressStyle::with_template(template).is_ok(), "{template}");
        }
    }
}
