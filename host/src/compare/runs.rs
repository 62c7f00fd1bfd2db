//! Reading experiment folders: each run's config, manifest, metrics, summary and eval files, an
//! A/B parent folder expanded into its runs; broken or unfinished runs are noted, never fatal.

use serde_json::Value;
use std::{
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
        for v in [&mut self.loss, &mut self.tau_hat, &mut self.elapsed_s, &mut self.lr, &mut self.grad_norm]
            .into_iter()
            .chain(self.acc.iter_mut())
        {
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

/// The validation split's scores on one metrics line (`train.eval_every`).
#[derive(Debug, Clone, PartialEq)]
pub struct ValPoint {
    pub step: u64,
    pub tokens: f64,
    pub loss: f64,
    pub tau_hat: f64,
    pub acc: Vec<f64>,
}

impl ValPoint {
    /// The line's validation scores, if it has any (`null`, how NaN is written, reads as NaN;
    /// values beyond [`MAX_ABS`] too).
    pub fn parse(line: &str) -> Option<Self> {
        let v: Value = serde_json::from_str(line).ok()?;
        if v.get("val_loss").is_none() && v.get("val_tau_hat").is_none() {
            return None;
        }
        let clean = |x: Option<f64>| x.filter(|x| x.is_finite() && x.abs() <= MAX_ABS).unwrap_or(f64::NAN);
        let num = |k: &str| clean(v.get(k).and_then(Value::as_f64));
        let acc = v
            .get("val_acc")
            .and_then(Value::as_array)
            .map(|a| a.iter().map(|x| clean(x.as_f64())).collect())
            .unwrap_or_default();
        Some(Self {
            step: v.get("step")?.as_u64()?,
            tokens: v.get("tokens")?.as_f64()?,
            loss: num("val_loss"),
            tau_hat: num("val_tau_hat"),
            acc,
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
    /// The validation split's scores, in file order (`train.eval_every`).
    pub val: Vec<ValPoint>,
    /// `eval-validation.json`'s `tau`: measured on the validation prompts.
    pub val_eval_tau: Option<f64>,
    /// The A/B arm the manifest names.
    pub arm: Option<String>,
    /// What the run trained under, for grouping by name: its config's fields by dotted key
    /// (values as TOML writes them), without those a repeat varies or that say where it runs
    /// ([`NOT_GROUPING`]).
    pub settings: Option<std::collections::BTreeMap<String, String>>,
    /// Grouped by the config's `name` (no arm, no `--group-by`): runs of one name under different
    /// settings (a run and its fork) are split apart.
    pub grouped_by_name: bool,
}

/// Config fields that do not make two runs of one name different experiments: the seed (repeats
/// vary it), the name, and where and how long it runs.
const NOT_GROUPING: &[&str] = &["name", "seed", "device", "dtype", "pipeline", "train.steps", "train.keep_checkpoints"];

/// The config's fields by dotted key, without [`NOT_GROUPING`].
fn settings_of(config: &toml::Value) -> std::collections::BTreeMap<String, String> {
    fn walk(prefix: &str, v: &toml::Value, out: &mut std::collections::BTreeMap<String, String>) {
        if NOT_GROUPING.contains(&prefix) {
            return;
        }
        match v {
            toml::Value::Table(t) => {
                for (k, v) in t {
                    let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                    walk(&key, v, out);
                }
            }
            v => {
                out.insert(prefix.to_string(), v.to_string());
            }
        }
    }
    let mut out = Default::default();
    walk("", config, &mut out);
    out
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

    /// The validation split's last scores (the run's end, with `eval_every`).
    pub fn last_val(&self) -> Option<&ValPoint> {
        self.val.last()
    }

    /// Total wall time: `summary.json`'s, else the last record's `elapsed_s`.
    pub fn wall_s(&self) -> Option<f64> {
        self.summary_wall_s.or_else(|| self.records.last().map(|r| r.elapsed_s))
    }
}

/// Read one directory. Never fails: problems become `status` and `notes`.
pub fn load_run(dir: &Path, group_by: Option<&str>) -> Run {
    let mut run = unread(dir);
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

    let manifest = read_group(&mut run, &config_path, &manifest_path, group_by);
    if !read_metrics(&mut run, &metrics_path, manifest.as_ref()) {
        return run;
    }
    read_end(&mut run, dir);
    read_evals(&mut run, dir);
    run
}

/// A run before anything of its folder is read: named after the folder, not an experiment.
fn unread(dir: &Path) -> Run {
    let label = dir.file_name().map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned());
    Run {
        dir: dir.to_path_buf(),
        label: label.clone(),
        group: label,
        status: Status::NotExperiment,
        records: Vec::new(),
        notes: Vec::new(),
        summary_wall_s: None,
        eval_tau: None,
        evals: Vec::new(),
        val: Vec::new(),
        val_eval_tau: None,
        arm: None,
        settings: None,
        grouped_by_name: false,
    }
}

/// The config and the manifest, only for the group key. Returns the manifest (a fork's parent).
fn read_group(run: &mut Run, config_path: &Path, manifest_path: &Path, group_by: Option<&str>) -> Option<Value> {
    let config =
        read_optional(config_path, &mut run.notes, |s| toml::from_str::<toml::Value>(s).map_err(|e| e.to_string()));
    let manifest =
        read_optional(manifest_path, &mut run.notes, |s| serde_json::from_str::<Value>(s).map_err(|e| e.to_string()));
    run.arm = manifest.as_ref().and_then(|m| json_lookup(m, "arm"));
    if let Some(key) = group_by {
        let value = config
            .as_ref()
            .and_then(|c| toml_lookup(c, key))
            .or_else(|| manifest.as_ref().and_then(|m| json_lookup(m, key)));
        if value.is_none() {
            run.notes.push(format!("no `{key}` in config.toml or manifest.json"));
        }
        run.group = format!("{key}={}", value.unwrap_or_else(|| "?".into()));
    } else if let Some(arm) = manifest.as_ref().and_then(|m| json_lookup(m, "arm")) {
        run.group = arm;
    } else if let Some(name) = config.as_ref().and_then(|c| toml_lookup(c, "name")) {
        run.group = name;
        run.grouped_by_name = true;
    }
    run.settings = config.as_ref().map(settings_of);
    manifest
}

/// The metrics: whole lines only (a last line that does not parse is a write in progress), each
/// line capped, values beyond any real run's treated as missing (plots stay finite); a fork's
/// curve from its parent's up to the fork. False when there are none to read.
fn read_metrics(run: &mut Run, metrics_path: &Path, manifest: Option<&Value>) -> bool {
    if !metrics_path.exists() {
        run.status = Status::NoMetrics;
        run.notes.push("no metrics.jsonl".into());
        return false;
    }
    let lines = match crate::experiment::metrics::lines(metrics_path) {
        Ok(lines) => lines,
        Err(e) => {
            run.status = Status::NoMetrics;
            run.notes.push(format!("metrics.jsonl unreadable: {e}"));
            return false;
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
                run.val.extend(ValPoint::parse(&line));
            }
            Err(e) if lines.peek().is_none() => {
                run.notes.push(format!("truncated last line of metrics.jsonl ignored ({e})"))
            }
            Err(e) => run.notes.push(format!("metrics.jsonl line {} skipped: {e}", i + 1)),
        }
    }
    if let Some((parent, at)) = manifest.and_then(parent_of) {
        prepend_parent(run, &parent, at);
    }
    if absurd > 0 {
        run.notes
            .push(format!("{absurd} values in metrics.jsonl beyond ±{MAX_ABS:e} or not finite, treated as missing"));
    }
    if run.records.windows(2).any(|w| w[1].tokens < w[0].tokens) {
        run.notes.push("tokens decrease somewhere in metrics.jsonl (appended runs?); records sorted by tokens".into());
        run.records.sort_by(|a, b| a.tokens.total_cmp(&b.tokens));
    }
    true
}

/// Finished? Then the eval hook.
fn read_end(run: &mut Run, dir: &Path) {
    let summary = read_optional(&dir.join("summary.json"), &mut run.notes, |s| {
        serde_json::from_str::<Value>(s).map_err(|e| e.to_string())
    });
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
    let eval = read_optional(&dir.join("eval.json"), &mut run.notes, |s| {
        serde_json::from_str::<Value>(s).map_err(|e| e.to_string())
    });
    if let Some(eval) = eval {
        run.eval_tau = eval.get("tau").and_then(Value::as_f64);
        if run.eval_tau.is_none() {
            run.notes.push("eval.json has no numeric `tau`".into());
        }
    }
}

/// Every eval*.json, by name (eval.json first).
fn read_evals(run: &mut Run, dir: &Path) {
    let mut files: Vec<String> = fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    files.retain(|f| f.starts_with("eval") && f.ends_with(".json"));
    files.sort_by_key(|f| (f != "eval.json", f.clone()));
    for f in files {
        let mut notes = Vec::new();
        if let Some(v) =
            read_optional(&dir.join(&f), &mut notes, |s| serde_json::from_str::<Value>(s).map_err(|e| e.to_string()))
        {
            if f == crate::eval::VALIDATION_FILE {
                run.val_eval_tau = v.get("tau").and_then(Value::as_f64);
            }
            run.evals.push(EvalResult::parse(f, &v));
        }
        run.notes.extend(notes);
    }
}

/// The run folders among `dirs`: an experiment is itself; an A/B folder (no config.toml of its
/// own, runs in its subfolders) stands for its runs, in name order.
/// A fork's parent and the step it was forked at (the manifest's `parent`).
fn parent_of(manifest: &Value) -> Option<(PathBuf, u64)> {
    let p = manifest.get("parent")?;
    Some((PathBuf::from(p.get("path")?.as_str()?), p.get("step")?.as_u64()?))
}

/// A fork's curve begins with its parent's up to the fork: the parent's records at steps up to
/// `at` go before the fork's own (noted; a parent that cannot be read is noted too).
fn prepend_parent(run: &mut Run, parent: &Path, at: u64) {
    let path = parent.join("metrics.jsonl");
    let lines = match crate::experiment::metrics::lines(&path) {
        Ok(lines) => lines,
        Err(e) => {
            run.notes.push(format!("forked at step {at} from {}, whose metrics are unreadable: {e}", parent.display()));
            return;
        }
    };
    let before: Vec<Record> = lines
        .map_while(|l| l.ok())
        .filter_map(|l| Record::parse(&l).and_then(Record::sanitized).ok().map(|(r, _)| r))
        .filter(|r| r.step <= at)
        .collect();
    run.notes.push(format!("steps up to {at} are its parent's ({})", parent.display()));
    run.records.splice(0..0, before);
}

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
            let parts: Vec<String> =
                run.dir.components().rev().take(2).map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
            run.label = parts.into_iter().rev().collect::<Vec<_>>().join("/");
        }
    }
    split_by_settings(&mut runs);
    runs
}

/// Runs grouped by one name that trained under different settings (a run and its fork to
/// another optimizer; one name reused for another experiment) are different experiments: each
/// setting after the first (in the order given) is its own group, named by what differs from
/// the first (`fork (optimizer.plugin=muon, optimizer.momentum=0.9)`).
fn split_by_settings(runs: &mut [Run]) {
    let mut groups: Vec<String> = runs.iter().filter(|r| r.grouped_by_name).map(|r| r.group.clone()).collect();
    groups.sort();
    groups.dedup();
    for group in groups {
        let members: Vec<usize> =
            (0..runs.len()).filter(|&i| runs[i].grouped_by_name && runs[i].group == group).collect();
        let Some(first) = members.iter().find_map(|&i| runs[i].settings.clone()) else { continue };
        for &i in &members {
            let Some(settings) = &runs[i].settings else { continue };
            if *settings == first {
                continue;
            }
            let keys: std::collections::BTreeSet<&String> = settings.keys().chain(first.keys()).collect();
            let mut differs: Vec<&String> = keys.into_iter().filter(|k| settings.get(*k) != first.get(*k)).collect();
            differs.sort_by_key(|k| !k.ends_with(".plugin")); // a plugin switched says most
            let differs: Vec<String> =
                differs.iter().map(|k| format!("{k}={}", settings.get(*k).map_or("-", String::as_str))).collect();
            let shown =
                if differs.len() > 3 { format!("{}, ...", differs[..3].join(", ")) } else { differs.join(", ") };
            runs[i].group = format!("{group} ({shown})");
        }
    }
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
