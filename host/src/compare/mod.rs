//! `dflash-host compare DIR...`: compare experiment directories at equal target tokens.
//!
//! Reads each run's `config.toml`, `manifest.json`, `metrics.jsonl`, `summary.json` (present =
//! finished) and optional `eval.json` (`tau`: measured acceptance length), groups runs (manifest
//! `arm`, else config `name`, or `--group-by KEY`), and writes `report.md` plus PNG and SVG plots
//! into the output folder, and prints the tables. Every run is read at one token count T, the
//! smallest final token count among finished runs, interpolating linearly between logged records.
//! Broken or unfinished runs are reported, never fatal.

use anyhow::{anyhow, Context, Result};
use serde_json::Value;
use std::{
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
};

/// The fields of one `metrics.jsonl` line (`train::StepMetrics`) the report uses.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub step: u64,
    pub tokens: f64,
    pub loss: f64,
    /// Top-1 accuracy per block position 1..B-1 over the logging window.
    pub acc: Vec<f64>,
    pub tau_hat: f64,
    pub elapsed_s: f64,
    /// The learning rate of the step and the gradient norm (NaN in records that lack them).
    pub lr: f64,
    pub grad_norm: f64,
}

/// Largest magnitude a metric may have (loss, tau_hat, accuracy, seconds); beyond it a value is
/// corrupt, and plotting it would need axes no plot can draw.
pub const MAX_ABS: f64 = 1e15;
/// Largest token count a record may have (x axis).
pub const MAX_TOKENS: f64 = 1e18;

impl Record {
    /// Values beyond [`MAX_ABS`] (or not finite) become NaN, shown as missing; returns how many.
    /// A record whose token count is not a count is refused.
    pub fn sanitized(mut self) -> Result<(Self, usize), String> {
        if !(self.tokens.is_finite() && (0.0..=MAX_TOKENS).contains(&self.tokens)) {
            return Err(format!("`tokens` {} is not a token count", self.tokens));
        }
        let mut n = 0;
        for v in [&mut self.loss, &mut self.tau_hat, &mut self.elapsed_s, &mut self.lr, &mut self.grad_norm].into_iter().chain(self.acc.iter_mut()) {
            if (v.is_finite() && v.abs() > MAX_ABS) || v.is_infinite() {
                *v = f64::NAN;
                n += 1;
            }
        }
        Ok((self, n))
    }

    /// Parse one line; JSON `null` (how serde_json writes NaN) reads as NaN.
    pub fn parse(line: &str) -> Result<Self, String> {
        let v: Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
        let num = |key: &str| match v.get(key) {
            Some(Value::Null) => Ok(f64::NAN),
            Some(x) => x.as_f64().ok_or_else(|| format!("`{key}` is not a number")),
            None => Err(format!("no `{key}`")),
        };
        let acc = match v.get("acc") {
            Some(Value::Array(a)) => a.iter().map(|x| x.as_f64().unwrap_or(f64::NAN)).collect(),
            _ => Vec::new(),
        };
        Ok(Self {
            step: num("step")? as u64,
            tokens: num("tokens")?,
            loss: num("loss")?,
            acc,
            tau_hat: num("tau_hat")?,
            elapsed_s: num("elapsed_s").unwrap_or(f64::NAN),
            lr: num("lr").unwrap_or(f64::NAN),
            grad_norm: num("grad_norm").unwrap_or(f64::NAN),
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// `summary.json` written: the run ended.
    Complete,
    /// Metrics but no `summary.json`: still running, or stopped.
    Unfinished,
    NoMetrics,
    EmptyMetrics,
    NotExperiment,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Complete => "complete",
            Status::Unfinished => "unfinished",
            Status::NoMetrics => "no metrics",
            Status::EmptyMetrics => "empty metrics",
            Status::NotExperiment => "not an experiment",
        }
    }
}

/// One directory as read from disk.
#[derive(Debug, Clone)]
pub struct Run {
    pub dir: PathBuf,
    /// Short name for tables and plots (the folder name, made unique in `load_runs`).
    pub label: String,
    pub group: String,
    pub status: Status,
    /// Sorted by tokens.
    pub records: Vec<Record>,
    /// What was wrong or odd, for the report (empty for a clean complete run).
    pub notes: Vec<String>,
    /// `summary.json`'s `wall_s`.
    pub summary_wall_s: Option<f64>,
    /// `eval.json`'s `tau` (measured acceptance length), when an eval has run.
    pub eval_tau: Option<f64>,
    /// Every `eval*.json` of the run (other prompt sets, checkpoints, drafters), by file name.
    pub evals: Vec<EvalResult>,
}

/// One `eval*.json`: what it measured and on what.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalResult {
    pub file: String,
    /// z-lab's per-response tau and the pooled one (all accepted + 1 over all verify cycles).
    pub tau: Option<f64>,
    pub tau_pooled: Option<f64>,
    pub cycles: Option<u64>,
    pub prompts: Option<u64>,
    pub source: String,
    /// The checkpoint step evaluated, or the drafter folder.
    pub checkpoint_step: Option<u64>,
    pub drafter: Option<String>,
}

impl EvalResult {
    fn parse(file: String, v: &Value) -> Self {
        let num = |k: &str| v.get(k).and_then(Value::as_f64);
        Self {
            file,
            tau: num("tau"),
            tau_pooled: num("tau_pooled"),
            cycles: v.get("cycles").and_then(Value::as_u64),
            prompts: v.get("prompts").and_then(Value::as_u64),
            source: v.get("source").and_then(Value::as_str).unwrap_or("?").to_string(),
            checkpoint_step: v.pointer("/evaluated/checkpoint_step").and_then(Value::as_u64),
            drafter: v.pointer("/evaluated/drafter").and_then(Value::as_str).map(str::to_string),
        }
    }
}

impl Run {
    pub fn has_data(&self) -> bool {
        !self.records.is_empty()
    }

    pub fn final_tokens(&self) -> Option<f64> {
        self.records.last().map(|r| r.tokens)
    }

    /// Total wall time: `summary.json`'s, else the last record's `elapsed_s`.
    pub fn wall_s(&self) -> Option<f64> {
        self.summary_wall_s.or_else(|| self.records.last().map(|r| r.elapsed_s))
    }
}

/// Read one directory. Never fails: problems become `status` and `notes`.
pub fn load_run(dir: &Path, group_by: Option<&str>) -> Run {
    let label = dir.file_name().map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned());
    let mut run = Run {
        dir: dir.to_path_buf(),
        label: label.clone(),
        group: label,
        status: Status::NotExperiment,
        records: Vec::new(),
        notes: Vec::new(),
        summary_wall_s: None,
        eval_tau: None,
        evals: Vec::new(),
    };
    if !dir.is_dir() {
        run.notes.push(if dir.exists() { "not a directory".into() } else { "does not exist".into() });
        return run;
    }
    let (config_path, manifest_path, metrics_path) =
        (dir.join("config.toml"), dir.join("manifest.json"), dir.join("metrics.jsonl"));
    if !config_path.exists() && !manifest_path.exists() && !metrics_path.exists() {
        run.notes.push(if dir.join("report.md").exists() {
            "a `compare` report folder, not an experiment".into()
        } else {
            "no config.toml, manifest.json or metrics.jsonl".into()
        });
        return run;
    }

    // 1. Config and manifest: only for the group key.
    let config = read_optional(&config_path, &mut run.notes, |s| toml::from_str::<toml::Value>(s).map_err(|e| e.to_string()));
    let manifest = read_optional(&manifest_path, &mut run.notes, |s| serde_json::from_str::<Value>(s).map_err(|e| e.to_string()));
    if let Some(key) = group_by {
        let value = config.as_ref().and_then(|c| toml_lookup(c, key)).or_else(|| manifest.as_ref().and_then(|m| json_lookup(m, key)));
        if value.is_none() {
            run.notes.push(format!("no `{key}` in config.toml or manifest.json"));
        }
        run.group = format!("{key}={}", value.unwrap_or_else(|| "?".into()));
    } else if let Some(arm) = manifest.as_ref().and_then(|m| json_lookup(m, "arm")) {
        run.group = arm;
    } else if let Some(name) = config.as_ref().and_then(|c| toml_lookup(c, "name")) {
        run.group = name;
    }

    // 2. Metrics: whole lines only (a last line that does not parse is a write in progress), each
    //    line capped, values beyond any real run's treated as missing (plots stay finite).
    if !metrics_path.exists() {
        run.status = Status::NoMetrics;
        run.notes.push("no metrics.jsonl".into());
        return run;
    }
    let lines = match crate::experiment::metrics::lines(&metrics_path) {
        Ok(lines) => lines,
        Err(e) => {
            run.status = Status::NoMetrics;
            run.notes.push(format!("metrics.jsonl unreadable: {e}"));
            return run;
        }
    };
    let mut lines = lines.enumerate().peekable();
    let mut absurd = 0;
    while let Some((i, line)) = lines.next() {
        let line = match line {
            Ok(l) => l,
            Err(e) => {
                run.notes.push(format!("metrics.jsonl read up to line {}: {e}", i + 1));
                break;
            }
        };
        if line.trim().is_empty() {
            continue;
        }
        match Record::parse(&line).and_then(Record::sanitized) {
            Ok((r, n)) => {
                absurd += n;
                run.records.push(r);
            }
            Err(e) if lines.peek().is_none() => run.notes.push(format!("truncated last line of metrics.jsonl ignored ({e})")),
            Err(e) => run.notes.push(format!("metrics.jsonl line {} skipped: {e}", i + 1)),
        }
    }
    if absurd > 0 {
        run.notes.push(format!("{absurd} values in metrics.jsonl beyond ±{MAX_ABS:e} or not finite, treated as missing"));
    }
    if run.records.windows(2).any(|w| w[1].tokens < w[0].tokens) {
        run.notes.push("tokens decrease somewhere in metrics.jsonl (appended runs?); records sorted by tokens".into());
        run.records.sort_by(|a, b| a.tokens.total_cmp(&b.tokens));
    }

    // 3. Finished? Then the eval hook.
    let summary = read_optional(&dir.join("summary.json"), &mut run.notes, |s| serde_json::from_str::<Value>(s).map_err(|e| e.to_string()));
    run.summary_wall_s = summary.as_ref().and_then(|s| s.get("wall_s")).and_then(Value::as_f64);
    run.status = match (run.records.is_empty(), &summary) {
        (true, _) => {
            run.notes.push("metrics.jsonl has no complete record".into());
            Status::EmptyMetrics
        }
        (false, Some(_)) => Status::Complete,
        (false, None) => {
            if !dir.join("summary.json").exists() {
                run.notes.push("no summary.json (still running, or stopped)".into());
            }
            Status::Unfinished
        }
    };
    let eval = read_optional(&dir.join("eval.json"), &mut run.notes, |s| serde_json::from_str::<Value>(s).map_err(|e| e.to_string()));
    if let Some(eval) = eval {
        run.eval_tau = eval.get("tau").and_then(Value::as_f64);
        if run.eval_tau.is_none() {
            run.notes.push("eval.json has no numeric `tau`".into());
        }
    }
    // 4. Every eval*.json, by name (eval.json first).
    let mut files: Vec<String> = fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    files.retain(|f| f.starts_with("eval") && f.ends_with(".json"));
    files.sort_by_key(|f| (f != "eval.json", f.clone()));
    for f in files {
        let mut notes = Vec::new();
        if let Some(v) = read_optional(&dir.join(&f), &mut notes, |s| serde_json::from_str::<Value>(s).map_err(|e| e.to_string())) {
            run.evals.push(EvalResult::parse(f, &v));
        }
        run.notes.extend(notes);
    }
    run
}

/// The run folders among `dirs`: an experiment is itself; an A/B folder (no config.toml of its
/// own, runs in its subfolders) stands for its runs, in name order.
pub fn expand_dirs(dirs: &[PathBuf]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for d in dirs {
        if d.join("config.toml").exists() || !d.is_dir() {
            out.push(d.clone());
            continue;
        }
        let mut runs: Vec<PathBuf> = fs::read_dir(d)
            .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.join("config.toml").is_file()).collect())
            .unwrap_or_default();
        runs.sort();
        if runs.is_empty() {
            out.push(d.clone()); // reported as what it is
        } else {
            out.extend(runs);
        }
    }
    out
}

/// Load every directory; labels made unique by prefixing parent folders where names repeat.
pub fn load_runs(dirs: &[PathBuf], group_by: Option<&str>) -> Vec<Run> {
    let mut runs: Vec<Run> = dirs.iter().map(|d| load_run(d, group_by)).collect();
    let labels: Vec<String> = runs.iter().map(|r| r.label.clone()).collect();
    for (i, run) in runs.iter_mut().enumerate() {
        if labels.iter().filter(|l| **l == labels[i]).count() > 1 {
            let parts: Vec<String> = run.dir.components().rev().take(2).map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
            run.label = parts.into_iter().rev().collect::<Vec<_>>().join("/");
        }
    }
    runs
}

/// Read and parse a file that may be absent (None, no note) or broken (None, a note).
fn read_optional<T>(path: &Path, notes: &mut Vec<String>, parse: impl FnOnce(&str) -> Result<T, String>) -> Option<T> {
    if !path.exists() {
        return None;
    }
    let name = path.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    // Reports are small; a FIFO, device or huge file here is a note, never a hang.
    match input_files::read_to_string_capped(path, 64 << 20).map_err(|e| e.to_string()).and_then(|s| parse(&s)) {
        Ok(v) => Some(v),
        Err(e) => {
            notes.push(format!("{name} unreadable: {}", e.lines().next().unwrap_or("")));
            None
        }
    }
}

/// `a.b.c` in a TOML document, as text (strings unquoted).
fn toml_lookup(doc: &toml::Value, key: &str) -> Option<String> {
    let v = key.split('.').try_fold(doc, |v, k| v.get(k))?;
    Some(match v {
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
    })
}

fn json_lookup(doc: &Value, key: &str) -> Option<String> {
    let v = key.split('.').try_fold(doc, |v, k| v.get(k))?;
    match v {
        Value::Null => None,
        Value::String(s) => Some(s.clone()),
        other => Some(other.to_string()),
    }
}

// ---------------------------------------------------------------------------------------------
// Equal-token comparison

/// One run's metrics at T.
#[derive(Debug, Clone, PartialEq)]
pub struct AtTokens {
    pub loss: f64,
    /// Lowest loss over the records up to T (and the value at T).
    pub best_loss: f64,
    pub tau_hat: f64,
    pub best_tau_hat: f64,
    pub acc: Vec<f64>,
    pub elapsed_s: f64,
    /// T / elapsed seconds at T: mean training throughput up to T.
    pub tok_per_s: f64,
}

fn lerp(a: f64, b: f64, w: f64) -> f64 {
    a + (b - a) * w
}

/// The run's metrics at `t` tokens, linearly interpolated between the two records around it;
/// None when the run's records do not span `t`.
pub fn at_tokens(records: &[Record], t: f64) -> Option<AtTokens> {
    let first = records.first()?;
    let last = records.last()?;
    if t < first.tokens || t > last.tokens {
        return None;
    }
    let i = records.partition_point(|r| r.tokens < t);
    let (a, b) = if records[i].tokens == t || i == 0 { (&records[i], &records[i]) } else { (&records[i - 1], &records[i]) };
    let w = if b.tokens > a.tokens { (t - a.tokens) / (b.tokens - a.tokens) } else { 0.0 };
    let n = a.acc.len().max(b.acc.len());
    let acc = (0..n)
        .map(|k| match (a.acc.get(k), b.acc.get(k)) {
            (Some(&x), Some(&y)) => lerp(x, y, w),
            (Some(&x), None) | (None, Some(&x)) => x,
            (None, None) => f64::NAN,
        })
        .collect();
    let loss = lerp(a.loss, b.loss, w);
    let tau_hat = lerp(a.tau_hat, b.tau_hat, w);
    let elapsed_s = lerp(a.elapsed_s, b.elapsed_s, w);
    let upto = records.iter().filter(|r| r.tokens <= t);
    let best_loss = upto.clone().map(|r| r.loss).fold(loss, f64::min);
    let best_tau_hat = upto.map(|r| r.tau_hat).fold(tau_hat, f64::max);
    Some(AtTokens { loss, best_loss, tau_hat, best_tau_hat, acc, elapsed_s, tok_per_s: t / elapsed_s })
}

/// Mean and sample standard deviation (n-1; None for one value).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stat {
    pub mean: f64,
    pub std: Option<f64>,
    pub n: usize,
}

pub fn stat(xs: impl IntoIterator<Item = f64>) -> Option<Stat> {
    let xs: Vec<f64> = xs.into_iter().collect();
    let n = xs.len();
    if n == 0 {
        return None;
    }
    let mean = xs.iter().sum::<f64>() / n as f64;
    let std = (n > 1).then(|| (xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt());
    Some(Stat { mean, std, n })
}

#[derive(Debug, Clone)]
pub struct GroupStats {
    pub name: String,
    /// Indices (into the runs) of the runs the statistics cover.
    pub members: Vec<usize>,
    /// Runs of the group with metrics, counted or not.
    pub listed: usize,
    pub loss: Option<Stat>,
    pub best_loss: Option<Stat>,
    pub tau_hat: Option<Stat>,
    pub best_tau_hat: Option<Stat>,
    pub acc: Vec<Option<Stat>>,
    pub elapsed_s: Option<Stat>,
    pub tok_per_s: Option<Stat>,
    pub final_tokens: Option<Stat>,
    pub wall_s: Option<Stat>,
    pub eval_tau: Option<Stat>,
}

#[derive(Debug, Clone)]
pub struct Comparison {
    /// T: the common token count; None when no run has metrics.
    pub tokens: Option<f64>,
    /// True when T comes from finished runs; false when none has finished (provisional).
    pub from_complete: bool,
    /// Per run (same order as the runs): metrics at T, when the run reaches T.
    pub at: Vec<Option<AtTokens>>,
    /// Whether a run counts in its group's statistics.
    pub counted: Vec<bool>,
    pub groups: Vec<GroupStats>,
}

/// T = smallest final token count among complete runs (or among all runs with metrics when none
/// is complete); each run read at T; group statistics over the counted runs.
pub fn compare(runs: &[Run]) -> Comparison {
    let complete: Vec<f64> = runs.iter().filter(|r| r.status == Status::Complete).filter_map(Run::final_tokens).collect();
    let from_complete = !complete.is_empty();
    let pool: Vec<f64> = if from_complete { complete } else { runs.iter().filter_map(Run::final_tokens).collect() };
    let tokens = pool.into_iter().reduce(f64::min);
    let at: Vec<Option<AtTokens>> = runs.iter().map(|r| tokens.and_then(|t| at_tokens(&r.records, t))).collect();
    let counted: Vec<bool> = runs
        .iter()
        .zip(&at)
        .map(|(r, a)| a.is_some() && (r.status == Status::Complete || (!from_complete && r.has_data())))
        .collect();

    let mut names: Vec<&str> = Vec::new();
    for r in runs.iter().filter(|r| r.has_data()) {
        if !names.contains(&r.group.as_str()) {
            names.push(&r.group);
        }
    }
    let groups = names
        .into_iter()
        .map(|name| {
            let members: Vec<usize> = (0..runs.len()).filter(|&i| counted[i] && runs[i].group == name).collect();
            let listed = runs.iter().filter(|r| r.has_data() && r.group == name).count();
            let of = |f: &dyn Fn(&AtTokens) -> f64| stat(members.iter().map(|&i| f(at[i].as_ref().expect("counted runs reach T"))));
            let positions = members.iter().map(|&i| at[i].as_ref().map_or(0, |a| a.acc.len())).max().unwrap_or(0);
            let acc = (0..positions)
                .map(|k| stat(members.iter().filter_map(|&i| at[i].as_ref().and_then(|a| a.acc.get(k).copied()))))
                .collect();
            GroupStats {
                name: name.to_string(),
                listed,
                loss: of(&|a| a.loss),
                best_loss: of(&|a| a.best_loss),
                tau_hat: of(&|a| a.tau_hat),
                best_tau_hat: of(&|a| a.best_tau_hat),
                acc,
                elapsed_s: of(&|a| a.elapsed_s),
                tok_per_s: of(&|a| a.tok_per_s),
                final_tokens: stat(members.iter().filter_map(|&i| runs[i].final_tokens())),
                wall_s: stat(members.iter().filter_map(|&i| runs[i].wall_s())),
                eval_tau: stat(members.iter().filter_map(|&i| runs[i].eval_tau)),
                members,
            }
        })
        .collect();
    Comparison { tokens, from_complete, at, counted, groups }
}

mod plot;
mod report;

use plot::*;
use report::*;

// ---------------------------------------------------------------------------------------------
// Entry point

fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// UTC `YYYYMMDD-HHMMSS` (folder names) or `YYYY-MM-DD HH:MM:SS` (text), from Unix seconds.
fn utc_timestamp(secs: f64, readable: bool) -> String {
    let secs = secs as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (proleptic Gregorian; eras of 400 years).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let (hh, mm, ss) = (rem / 3600, rem % 3600 / 60, rem % 60);
    if readable {
        format!("{y:04}-{m:02}-{d:02} {hh:02}:{mm:02}:{ss:02}")
    } else {
        format!("{y:04}{m:02}{d:02}-{hh:02}{mm:02}{ss:02}")
    }
}

/// Default output, one folder reused by every comparison of the same runs: an A/B folder's
/// `report/` when one A/B folder is given, else `compare/` beside the first run.
pub fn default_out(dirs: &[PathBuf]) -> PathBuf {
    if let [one] = dirs {
        if !one.join("config.toml").exists() && one.is_dir() {
            return one.join("report");
        }
    }
    let parent = dirs
        .first()
        .and_then(|d| d.parent())
        .filter(|p| !p.as_os_str().is_empty())
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf);
    parent.join("compare")
}

/// `dflash-host compare`: load, compare, write `report.md` + plots into `out`, print the tables.
/// Returns the report's path.
pub fn run(dirs: &[PathBuf], out: Option<&Path>, group_by: Option<&str>) -> Result<PathBuf> {
    let out = out.map_or_else(|| default_out(dirs), Path::to_path_buf);
    let dirs = &expand_dirs(dirs);
    fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let runs = load_runs(dirs, group_by);
    let cmp = compare(&runs);
    let (plots, plot_errors) = write_plots(&runs, &cmp, &out);
    let report = out.join("report.md");
    fs::write(&report, render_markdown(&runs, &cmp, &plots, &plot_errors))
        .with_context(|| format!("writing {}", report.display()))?;
    crate::say!("{}", render_terminal(&runs, &cmp).trim_end_matches('\n'));
    for e in &plot_errors {
        crate::say!("plot failed: {e}");
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An A/B folder stands for its runs; every eval*.json is read; lr and gradient norm are read
    /// and plotted, eval tau too when evals name their checkpoints; final values come per run.
    #[test]
    fn ab_folders_expand_evals_are_all_read_and_final_values_are_per_run() {
        let root = tempfile::tempdir().unwrap();
        let ab = root.path().join("ab");
        let short = fake_run(&ab, "a-s0", "x", Some("a"), &rows(1.0, 2000), true);
        let long = fake_run(&ab, "b-s0", "x", Some("b"), &rows(0.5, 20000), true);
        fs::create_dir_all(ab.join("report")).unwrap();
        fs::write(long.join("eval.json"), r#"{"tau": 1.8, "tau_pooled": 1.9, "cycles": 40, "prompts": 4, "source": "holdout", "evaluated": {"checkpoint_step": 200}}"#).unwrap();
        fs::write(long.join("eval-step-100.json"), r#"{"tau": 1.5, "tau_pooled": 1.6, "cycles": 50, "prompts": 4, "source": "holdout", "evaluated": {"checkpoint_step": 100}}"#).unwrap();
        fs::write(long.join("eval-humaneval-drafter-0123456789ab.json"), r#"{"tau": 2.5, "source": "humaneval", "evaluated": {"drafter": "/z"}}"#).unwrap();
        assert_eq!(expand_dirs(&[ab.clone()]), vec![short.clone(), long.clone()]);
        let report = run(&[ab.clone()], None, None).unwrap();
        assert_eq!(report, ab.join("report/report.md"));
        let md = fs::read_to_string(&report).unwrap();
        let runs = load_runs(&expand_dirs(&[ab.clone()]), None);
        assert_eq!(runs[1].evals.iter().map(|e| e.file.as_str()).collect::<Vec<_>>(), ["eval.json", "eval-humaneval-drafter-0123456789ab.json", "eval-step-100.json"]);
        assert!(runs[1].records.iter().all(|r| r.lr == 1e-4 && r.grad_norm == 1.0));
        // The long run's own end (loss 10*0.5/20 = 0.25) next to the comparison at the short run's end.
        assert!(md.contains("## Final values") && md.contains("| b-s0 |") && md.contains("0.2500"), "{md}");
        assert!(md.contains("## Evaluations") && md.contains("eval-step-100.json") && md.contains("/z"), "{md}");
        for stem in ["lr_vs_tokens", "grad_norm_vs_tokens", "eval_tau_vs_tokens"] {
            assert!(ab.join(format!("report/{stem}.png")).exists(), "{stem}");
        }
        // Run again: the same folder, no second one.
        run(&[ab.clone()], None, None).unwrap();
        let folders = fs::read_dir(&ab).unwrap().count();
        assert_eq!(folders, 3, "a-s0, b-s0, report");
    }

    /// A fake experiment: config (name), optional manifest arm, metrics from (tokens, loss, tau,
    /// acc) rows, summary when `finished`.
    fn fake_run(root: &Path, dir: &str, name: &str, arm: Option<&str>, rows: &[(u64, f64, f64, [f64; 3])], finished: bool) -> PathBuf {
        let d = root.join(dir);
        fs::create_dir_all(&d).unwrap();
        fs::write(d.join("config.toml"), format!("name = \"{name}\"\nseed = 0\n\n[optimizer]\nlr = 0.0006\n")).unwrap();
        let manifest = match arm {
            Some(a) => serde_json::json!({"seed": 0, "arm": a}),
            None => serde_json::json!({"seed": 0}),
        };
        fs::write(d.join("manifest.json"), manifest.to_string()).unwrap();
        let mut text = String::new();
        for (i, &(tokens, loss, tau, acc)) in rows.iter().enumerate() {
            let rec = serde_json::json!({
                "step": (i + 1) * 10, "epoch": 0, "tokens": tokens, "draft_tokens": tokens * 2, "loss": loss,
                "acc": acc, "tau_hat": tau, "lr": 1e-4, "grad_norm": 1.0, "tok_per_s": 100.0,
                "target_s": 0.1, "drafter_s": 0.2, "optim_s": 0.01, "elapsed_s": tokens as f64 / 100.0,
            });
            text += &rec.to_string();
            text.push('\n');
        }
        fs::write(d.join("metrics.jsonl"), text).unwrap();
        if finished {
            let wall = rows.last().map_or(0.0, |r| r.0 as f64 / 100.0);
            fs::write(d.join("summary.json"), serde_json::json!({"wall_s": wall, "tokens": rows.last().map(|r| r.0)}).to_string())
                .unwrap();
        }
        d
    }

    fn rows(scale: f64, last_tokens: u64) -> Vec<(u64, f64, f64, [f64; 3])> {
        (1..=last_tokens / 1000)
            .map(|k| {
                let t = k * 1000;
                (t, scale * 10.0 / k as f64, 1.0 + 0.1 * k as f64, [0.5 * scale, 0.25 * scale, 0.125 * scale])
            })
            .collect()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9 * (1.0 + a.abs().max(b.abs()))
    }

    #[test]
    fn interpolates_linearly_at_equal_tokens() {
        let recs: Vec<Record> = [(1000.0, 10.0, 1.0, 10.0), (3000.0, 6.0, 2.0, 20.0), (5000.0, 8.0, 1.5, 40.0)]
            .iter()
            .enumerate()
            .map(|(i, &(tokens, loss, tau_hat, elapsed_s))| Record {
                step: i as u64,
                tokens,
                loss,
                acc: vec![0.2 * (i + 1) as f64, 0.1],
                tau_hat,
                elapsed_s,
                lr: 1e-3,
                grad_norm: 1.0,
            })
            .collect();
        let a = at_tokens(&recs, 2000.0).unwrap();
        assert!(close(a.loss, 8.0), "loss {}", a.loss);
        assert!(close(a.tau_hat, 1.5), "tau {}", a.tau_hat);
        assert!(close(a.acc[0], 0.3) && close(a.acc[1], 0.1), "acc {:?}", a.acc);
        assert!(close(a.elapsed_s, 15.0) && close(a.tok_per_s, 2000.0 / 15.0));
        assert!(close(a.best_loss, 8.0), "best loss over records ≤ T and T itself: {}", a.best_loss);
        // At 4000: loss 7 interpolated, best loss 6 (record at 3000); best tau 2.
        let b = at_tokens(&recs, 4000.0).unwrap();
        assert!(close(b.loss, 7.0) && close(b.best_loss, 6.0) && close(b.best_tau_hat, 2.0), "{b:?}");
        // Exact on a record; outside the logged span: None.
        assert!(close(at_tokens(&recs, 5000.0).unwrap().loss, 8.0));
        assert!(at_tokens(&recs, 5001.0).is_none() && at_tokens(&recs, 999.0).is_none());
    }

    #[test]
    fn mean_and_sample_std() {
        let s = stat([1.0, 2.0, 3.0, 4.0]).unwrap();
        assert!(close(s.mean, 2.5));
        assert!(close(s.std.unwrap(), (5.0f64 / 3.0).sqrt()), "{s:?}");
        assert_eq!(stat([7.0]).unwrap().std, None);
        assert!(stat(std::iter::empty()).is_none());
        assert_eq!(fmt_stat(stat([1.0, 3.0]), 2, 2), "2.00 ± 1.41");
        assert_eq!(fmt_stat(stat([1.0]), 2, 3), "1.00 (n=1)");
        assert_eq!(fmt_count(1234567.0), "1,234,567");
        assert_eq!(fmt_tokens_short(12_500.0), "12.5k");
    }

    #[test]
    fn groups_by_arm_then_name_then_config_key() {
        let root = tempfile::tempdir().unwrap();
        let a1 = fake_run(root.path(), "a1", "base", Some("A"), &rows(1.0, 5000), true);
        let a2 = fake_run(root.path(), "a2", "base", Some("A"), &rows(1.2, 6000), true);
        let b1 = fake_run(root.path(), "b1", "muon", None, &rows(0.8, 4000), true);
        let dirs = vec![a1.clone(), a2.clone(), b1.clone()];
        let runs = load_runs(&dirs, None);
        assert_eq!(runs.iter().map(|r| r.group.as_str()).collect::<Vec<_>>(), ["A", "A", "muon"]);
        let cmp = compare(&runs);
        assert_eq!(cmp.tokens, Some(4000.0), "smallest final count among complete runs");
        assert!(cmp.from_complete);
        assert_eq!(cmp.groups.len(), 2);
        let a = &cmp.groups[0];
        assert_eq!((a.name.as_str(), a.members.as_slice()), ("A", &[0usize, 1][..]));
        // Loss at 4000 tokens: 10/4 = 2.5 and 12/4 = 3.0 -> mean 2.75, std sqrt(0.125).
        let loss = a.loss.unwrap();
        assert!(close(loss.mean, 2.75) && close(loss.std.unwrap(), 0.125f64.sqrt()), "{loss:?}");
        let acc1 = a.acc[0].unwrap();
        assert!(close(acc1.mean, 0.55), "{acc1:?}");
        assert!(close(a.final_tokens.unwrap().mean, 5500.0));
        assert_eq!(cmp.groups[1].members, vec![2]);

        let by_lr = load_runs(&dirs, Some("optimizer.lr"));
        assert!(by_lr.iter().all(|r| r.group == "optimizer.lr=0.0006"), "{:?}", by_lr[0].group);
        let by_missing = load_runs(&[a1], Some("train.nope"));
        assert_eq!(by_missing[0].group, "train.nope=?");
        assert!(by_missing[0].notes.iter().any(|n| n.contains("train.nope")));
    }

    #[test]
    fn half_written_and_foreign_dirs_are_reported_not_fatal() {
        let root = tempfile::tempdir().unwrap();
        let good = fake_run(root.path(), "good", "x", None, &rows(1.0, 3000), true);
        // Truncated last line, no summary: unfinished, records before the cut kept.
        let cut = fake_run(root.path(), "cut", "x", None, &rows(1.0, 5000), false);
        let mut text = fs::read_to_string(cut.join("metrics.jsonl")).unwrap();
        text += "{\"step\": 60, \"tokens\": 60";
        fs::write(cut.join("metrics.jsonl"), text).unwrap();
        let empty = fake_run(root.path(), "empty", "x", None, &[], false);
        let nometrics = fake_run(root.path(), "nometrics", "x", None, &[], false);
        fs::remove_file(nometrics.join("metrics.jsonl")).unwrap();
        let foreign = root.path().join("photos");
        fs::create_dir_all(&foreign).unwrap();
        fs::write(foreign.join("cat.jpg"), b"meow").unwrap();
        let missing = root.path().join("nope");
        let dirs = vec![good, cut, empty, nometrics, foreign, missing];
        let runs = load_runs(&dirs, None);
        let status: Vec<Status> = runs.iter().map(|r| r.status).collect();
        use Status::*;
        assert_eq!(status, [Complete, Unfinished, EmptyMetrics, NoMetrics, NotExperiment, NotExperiment]);
        assert_eq!(runs[1].records.len(), 5);
        assert!(runs[1].notes.iter().any(|n| n.contains("truncated last line")), "{:?}", runs[1].notes);
        assert!(runs[1].notes.iter().any(|n| n.contains("no summary.json")));

        // The unfinished run reaches T = 3000 and shows values there, outside group statistics.
        let cmp = compare(&runs);
        assert_eq!(cmp.tokens, Some(3000.0));
        assert!(cmp.at[1].is_some() && !cmp.counted[1]);
        assert_eq!(cmp.groups[0].members, vec![0]);

        let out = root.path().join("report");
        fs::create_dir_all(&out).unwrap();
        let md = render_markdown(&runs, &cmp, &[], &[]);
        let term = render_terminal(&runs, &cmp);
        for text in [&md, &term] {
            for want in ["truncated last line", "unfinished", "empty metrics", "no metrics", "not an experiment", "does not exist"] {
                assert!(text.contains(want), "missing `{want}` in:\n{text}");
            }
        }
    }

    #[test]
    fn no_finished_run_gives_a_provisional_comparison() {
        let root = tempfile::tempdir().unwrap();
        let a = fake_run(root.path(), "a", "x", None, &rows(1.0, 3000), false);
        let b = fake_run(root.path(), "b", "x", None, &rows(1.0, 5000), false);
        let runs = load_runs(&[a, b], None);
        let cmp = compare(&runs);
        assert_eq!((cmp.tokens, cmp.from_complete), (Some(3000.0), false));
        assert_eq!(cmp.groups[0].members, vec![0, 1]);
        assert!(render_markdown(&runs, &cmp, &[], &[]).contains("provisional"));
    }

    #[test]
    fn report_with_tables_and_png_svg_plots() {
        let root = tempfile::tempdir().unwrap();
        let mut dirs = Vec::new();
        for (i, scale) in [1.0, 1.1, 0.9].into_iter().enumerate() {
            dirs.push(fake_run(root.path(), &format!("base-s{i}"), "base", Some("adamw"), &rows(scale, 8000), true));
            dirs.push(fake_run(root.path(), &format!("muon-s{i}"), "muon", Some("muon"), &rows(scale * 0.7, 9000), true));
        }
        fs::write(dirs[0].join("eval.json"), r#"{"tau": 3.21}"#).unwrap();
        dirs.push(fake_run(root.path(), "live", "muon", Some("muon"), &rows(0.7, 4000), false));
        let out = root.path().join("cmp");
        let report = run(&dirs, Some(&out), None).unwrap();
        assert_eq!(report, out.join("report.md"));
        let md = fs::read_to_string(&report).unwrap();
        assert!(md.contains("| group | runs | loss @T |"), "{md}");
        assert!(md.contains("| adamw | 3 |"), "{md}");
        assert!(md.contains("| muon | 3 of 4 |"), "{md}");
        assert!(md.contains("T = 8,000 target tokens"), "{md}");
        assert!(md.contains(" ± "));
        assert!(md.contains("3.210") && md.contains(DASH), "eval tau column");
        assert!(md.contains("![Loss vs tokens](loss_vs_tokens.png)"));
        for stem in ["loss_vs_tokens", "tau_hat_vs_tokens", "acc_at_tokens"] {
            let png = out.join(format!("{stem}.png"));
            let img = image::open(&png).unwrap_or_else(|e| panic!("{}: {e}", png.display())).to_rgb8();
            assert_eq!(img.dimensions(), SIZE);
            // Non-trivial: many distinct colours (lines, text), not a blank canvas.
            let mut colors: Vec<[u8; 3]> = img.pixels().map(|p| p.0).collect();
            colors.sort_unstable();
            colors.dedup();
            assert!(colors.len() > 20, "{stem}.png has {} colours", colors.len());
            let svg = fs::read_to_string(out.join(format!("{stem}.svg"))).unwrap();
            assert!(svg.starts_with("<svg") && svg.contains("<polyline") && svg.contains("<text"), "{stem}.svg");
            assert!(svg.len() > 5_000, "{stem}.svg is {} bytes", svg.len());
        }
    }

    /// `compare::run` in a thread: a hang fails the test after `secs` instead of hanging the suite.
    fn run_within(dirs: Vec<PathBuf>, out: PathBuf, secs: u64) -> Result<PathBuf> {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(run(&dirs, Some(&out), None));
        });
        rx.recv_timeout(std::time::Duration::from_secs(secs)).expect("compare hung")
    }

    #[test]
    fn absurd_values_are_treated_as_missing_and_plots_finish() {
        let root = tempfile::tempdir().unwrap();
        let a = fake_run(root.path(), "a", "x", None, &rows(1.0, 3000), true);
        let b = fake_run(root.path(), "b", "y", None, &rows(2.0, 3000), true);
        // One value of 1.7e308 (plotters' key-point search looped on the axis it made), one
        // infinite, one token count that is no count.
        let metrics = b.join("metrics.jsonl");
        let text = fs::read_to_string(&metrics).unwrap();
        let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
        lines[1] = lines[1].replacen("\"loss\":", "\"loss\":1.7e308,\"x\":", 1);
        lines[2] = lines[2].replacen("\"tau_hat\":", "\"tau_hat\":1e999,\"y\":", 1);
        lines.push(lines[0].replacen("\"tokens\":", "\"tokens\":1.7e308,\"z\":", 1));
        fs::write(&metrics, lines.join("\n") + "\n").unwrap();
        let run_b = load_run(&b, None);
        assert!(run_b.records[1].loss.is_nan() && run_b.records[0].loss.is_finite(), "{:?}", run_b.records[1]);
        assert!(run_b.notes.iter().any(|n| n.contains("beyond ±1e15")), "{:?}", run_b.notes);
        assert!(run_b.notes.iter().any(|n| n.contains("is not a token count")), "{:?}", run_b.notes);
        let report = run_within(vec![a, b], root.path().join("cmp"), 120).unwrap();
        assert!(report.exists());
        assert!(root.path().join("cmp/loss_vs_tokens.svg").exists());
    }

    #[test]
    fn a_fifo_or_device_as_a_run_file_is_a_note_not_a_hang() {
        let root = tempfile::tempdir().unwrap();
        let fifo_run = fake_run(root.path(), "fifo", "x", None, &rows(1.0, 3000), true);
        let zero_run = fake_run(root.path(), "zero", "x", None, &rows(1.0, 3000), true);
        for name in ["metrics.jsonl", "summary.json", "manifest.json"] {
            fs::remove_file(fifo_run.join(name)).unwrap();
            let c = std::ffi::CString::new(fifo_run.join(name).as_os_str().as_encoded_bytes()).unwrap();
            assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
            fs::remove_file(zero_run.join(name)).unwrap();
            std::os::unix::fs::symlink("/dev/zero", zero_run.join(name)).unwrap();
        }
        run_within(vec![fifo_run.clone(), zero_run.clone()], root.path().join("cmp"), 60).unwrap();
        for dir in [fifo_run, zero_run] {
            let r = load_run(&dir, None);
            assert_eq!(r.status, Status::NoMetrics, "{}", dir.display());
            assert!(r.notes.iter().any(|n| n.contains("not a regular file")), "{:?}", r.notes);
        }
    }

    #[test]
    fn default_out_is_one_folder_beside_the_runs_or_in_the_ab() {
        let root = tempfile::tempdir().unwrap();
        let a = fake_run(root.path(), "exp1", "x", None, &rows(1.0, 3000), true);
        assert_eq!(default_out(&[a.clone()]), root.path().join("compare"), "reused, not a fresh name");
        assert_eq!(default_out(&[root.path().to_path_buf()]), root.path().join("report"), "an A/B folder's report");
        assert_eq!(utc_timestamp(0.0, true), "1970-01-01 00:00:00");
        assert_eq!(utc_timestamp(951_782_400.0, false), "20000229-000000");
    }
}
