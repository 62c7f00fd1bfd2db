//! Progress on long work: a bar on a terminal, otherwise a log line every 15 s (so a log piped
//! to a file or a job scheduler's output shows progress too), each with the elapsed time and an
//! ETA from a smoothed time per unit that leaves the first units' warm-up out.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::{
    collections::VecDeque,
    io::IsTerminal,
    time::{Duration, Instant},
};

/// Time between progress lines when stderr is not a terminal.
pub const LINE_EVERY: Duration = Duration::from_secs(15);

/// `1h02m`, `3m05s`, `12s`.
pub fn clock(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, 0, s) => format!("{s}s"),
        (0, m, s) => format!("{m}m{s:02}s"),
        (h, m, _) => format!("{h}h{m:02}m"),
    }
}

/// `3m05s elapsed, ETA 12m00s` (`ETA -` until there is a pace to go by).
pub fn elapsed_eta(elapsed_s: f64, eta_s: Option<f64>) -> String {
    format!("{} elapsed, ETA {}", clock(elapsed_s), eta_s.map_or("-".into(), clock))
}

/// Seconds per unit of work: the mean over the last `window` units, the first `warmup` units left
/// out (kernel loading, allocator growth, cuDNN's plans make them slower than the rest).
#[derive(Debug, Clone)]
pub struct Pace {
    warmup: u64,
    window: usize,
    seen: u64,
    recent: VecDeque<f64>,
}

impl Pace {
    pub fn new(warmup: u64, window: usize) -> Self {
        Self { warmup, window: window.max(1), seen: 0, recent: VecDeque::new() }
    }

    /// One more unit, which took `seconds`.
    pub fn record(&mut self, seconds: f64) {
        self.seen += 1;
        if self.seen <= self.warmup {
            return;
        }
        if self.recent.len() == self.window {
            self.recent.pop_front();
        }
        self.recent.push_back(seconds);
    }

    /// The smoothed seconds per unit; None while only warm-up units have been seen.
    pub fn per_unit(&self) -> Option<f64> {
        (!self.recent.is_empty()).then(|| self.recent.iter().sum::<f64>() / self.recent.len() as f64)
    }

    /// Seconds for `left` more units.
    pub fn eta(&self, left: u64) -> Option<f64> {
        self.per_unit().map(|p| p * left as f64)
    }
}

/// A bar on a terminal, else a log line every [`LINE_EVERY`]: `what: done/total unit  status
/// elapsed, ETA`.
pub struct Progress {
    what: &'static str,
    unit: &'static str,
    total: u64,
    bar: Option<ProgressBar>,
    started: Instant,
    last_line: Instant,
}

impl Progress {
    /// A bar when stderr is a terminal.
    pub fn new(what: &'static str, unit: &'static str, total: u64) -> Self {
        Self::with_bar(what, unit, total, std::io::stderr().is_terminal())
    }

    fn with_bar(what: &'static str, unit: &'static str, total: u64, bar: bool) -> Self {
        let bar = bar.then(|| {
            let style = ProgressStyle::with_template(&format!("{what} {{bar:30}} {{pos}}/{{len}} {unit}  {{msg}}"))
                .expect("template");
            ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr()).with_style(style)
        });
        let now = Instant::now();
        Self { what, unit, total, bar, started: now, last_line: now }
    }

    /// `done` units so far, what they measured (`status`), and the seconds left if known.
    pub fn update(&mut self, done: u64, status: &str, eta_s: Option<f64>) {
        if let Some(line) = self.line(done, status, eta_s) {
            tracing::info!("{line}");
        }
    }

    /// The line to log now, if any (none with a bar: the bar shows it).
    fn line(&mut self, done: u64, status: &str, eta_s: Option<f64>) -> Option<String> {
        let timing = elapsed_eta(self.started.elapsed().as_secs_f64(), eta_s);
        if let Some(bar) = &self.bar {
            bar.set_position(done);
            bar.set_message(format!("{status}  {timing}"));
            return None;
        }
        if self.last_line.elapsed() < LINE_EVERY {
            return None;
        }
        self.last_line = Instant::now();
        Some(format!("{}: {done}/{} {}  {status}  {timing}", self.what, self.total, self.unit))
    }

    /// Run `f` (which logs) with the bar out of the way.
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        match &self.bar {
            Some(bar) => bar.suspend(f),
            None => f(),
        }
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_reads_like_a_stopwatch() {
        assert_eq!(clock(0.4), "0s");
        assert_eq!(clock(59.6), "1m00s");
        assert_eq!(clock(185.0), "3m05s");
        assert_eq!(clock(3725.0), "1h02m");
        assert_eq!(elapsed_eta(65.0, None), "1m05s elapsed, ETA -");
        assert_eq!(elapsed_eta(5.0, Some(3725.0)), "5s elapsed, ETA 1h02m");
    }

    /// The warm-up units are left out and the mean follows the last `window` units: a run that
    /// speeds up after its first slow steps is not promised its first steps' pace.
    #[test]
    fn the_pace_leaves_out_the_warm_up_and_follows_the_recent_units() {
        let mut pace = Pace::new(2, 3);
        pace.record(30.0);
        pace.record(10.0);
        assert_eq!(pace.per_unit(), None, "only warm-up so far");
        assert_eq!(pace.eta(5), None);
        pace.record(1.0);
        assert_eq!(pace.eta(10), Some(10.0));
        for s in [2.0, 2.0, 2.0] {
            pace.record(s);
        }
        assert_eq!(pace.per_unit(), Some(2.0), "the 1 s step has left the window");
        assert_eq!(pace.eta(4), Some(8.0));
    }

    /// Without a terminal a line goes out at most every 15 s and names the units, the status and
    /// the timing; with a bar, none (the bar shows it).
    #[test]
    fn lines_come_every_fifteen_seconds_without_a_terminal() {
        let mut p = Progress::with_bar("eval", "prompts", 24, false);
        assert_eq!(p.line(1, "τ 1.8", Some(60.0)), None, "too soon");
        p.last_line -= LINE_EVERY;
        let line = p.line(3, "9.5 tok/s  τ 1.84", Some(125.0)).unwrap();
        assert!(line.starts_with("eval: 3/24 prompts  9.5 tok/s  τ 1.84  0s elapsed, ETA 2m05s"), "{line}");
        assert_eq!(p.line(4, "τ 1.8", None), None, "the clock restarted");
        let mut p = Progress::with_bar("eval", "prompts", 24, true);
        p.last_line -= LINE_EVERY;
        assert_eq!(p.line(3, "τ 1.8", None), None);
        p.finish();
    }
}
