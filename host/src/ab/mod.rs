//! A/B experiments: arms that differ only in what the A/B config names (an optimizer, a drafter
//! setting, ...), each over several seeds, run one after another into side-by-side experiment
//! directories, then compared. A seed fixes the drafter's initial weights, the data order and
//! the anchors, so arm `a` seed 1 and arm `b` seed 1 see exactly the same batches.
//!
//! ```toml
//! name = "adamw-vs-muon"
//! base = "smollm2-chitchat.toml"   # relative to this file
//! seeds = [0, 1, 2]
//! select = "val_tau"                # what picks a swept arm's value (validation only)
//! [common]                          # shared by every arm, e.g. a shorter schedule
//! train = { steps = 100, eval_every = 20 }
//! data = { validation = 32 }
//! [eval]                            # real tau on the validation (if it selects) and test prompts
//! limit = 32
//! [arms.adamw]
//! optimizer = { plugin = "adamw" }
//! sweep = { "optimizer.lr" = [1e-3, 3e-3, 1e-2] }
//! [arms.muon]
//! optimizer = { plugin = "muon", lr = 0.02 }
//! ```
//!
//! An arm that sweeps ([`sweep`]) runs every value with the first seed; its value is then chosen
//! on a validation measure only ([`select`]: never the test prompts, never training metrics),
//! and the other seeds run at that value. Folders: `experiments/<name>/<arm>-s<seed>`, or
//! `<arm>-<field>=<value>-s<seed>` for a swept arm; `selection.json` records the choice; `[eval]`
//! runs `eval` in-process after each run ([`evals`]).
//!
//! Arms may instead continue one run from its checkpoint: with `[fork]`, every arm forks
//! `exp`'s checkpoint at step `at` (the run may still be training; it is only read), its config
//! the parent's with `[common]` and the arm's changes, and each seed varies what comes after the
//! fork (data order and anchors). An arm's `fork = { optimizer_state = "fresh", schedule =
//! "restart", rewarm = 8 }` chooses as `dflash-host fork` does:
//!
//! ```toml
//! name = "adamw-fork-muon"
//! seeds = [0, 1, 2]
//! [fork]
//! exp = "experiments/adamw-parent"
//! at = 80
//! [arms.adamw]
//! [arms.muon-fresh]
//! optimizer = { plugin = "muon", lr = 3e-3 }
//! fork = { optimizer_state = "fresh" }
//! [arms.muon-carry]
//! optimizer = { plugin = "muon", lr = 3e-3 }
//! fork = { optimizer_state = "carry" }
//! ```
//!
//! `compare` draws each fork's curve from its parent's up to the fork.

mod evals;
mod jobs;
mod select;
mod sweep;

pub use select::{choose, Select};
pub use sweep::SweepPoint;

use crate::{
    config::{validate_name, RunConfig},
    plugins::Registry,
};
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AbConfig {
    pub name: String,
    /// The run config every arm starts from (relative to the A/B file); not with `[fork]`.
    #[serde(default)]
    pub base: Option<PathBuf>,
    /// Every arm forks this run's checkpoint instead of training from the start.
    #[serde(default)]
    pub fork: Option<ForkFrom>,
    #[serde(default = "default_seeds")]
    pub seeds: Vec<u64>,
    /// What chooses a swept arm's value: `val_tau` (real tau on the validation prompts, needs
    /// `[eval]`; the default with it), `val_tau_hat` (the last validation tau-hat, needs
    /// `train.eval_every`; the default without `[eval]`) or `val_loss` (the last validation loss).
    #[serde(default)]
    pub select: Option<Select>,
    /// Speculative-decoding eval after each run.
    #[serde(default)]
    pub eval: Option<EvalSpec>,
    /// Changes every arm shares (e.g. a shorter schedule than the base's), applied first.
    #[serde(default)]
    pub common: toml::Table,
    /// Arm name -> what it changes in the base config, and optionally `sweep`.
    pub arms: BTreeMap<String, toml::Table>,
}

/// `[fork]`: the run every arm forks, and the step of its checkpoint.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ForkFrom {
    /// The experiment directory (relative to the working folder).
    pub exp: PathBuf,
    pub at: u64,
}

/// An arm's `fork = { ... }`: what it does with the parent's optimizer state and schedule, as
/// `dflash-host fork`'s options.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ArmFork {
    #[serde(default)]
    pub optimizer_state: Option<crate::train::fork::OptimizerStateChoice>,
    #[serde(default)]
    pub schedule: crate::train::fork::ScheduleChoice,
    #[serde(default)]
    pub rewarm: Option<u64>,
}

/// A run that forks a checkpoint: the parent, the step, and the arm's choices.
#[derive(Debug, Clone)]
pub struct ForkRun {
    pub parent: PathBuf,
    pub at: u64,
    pub choices: ArmFork,
}

fn default_seeds() -> Vec<u64> {
    vec![0]
}

/// `[eval]`: after each run, real tau by speculative decoding of the newest checkpoint on the
/// validation prompts (`eval-validation.json`, when `select = "val_tau"` chooses by it) and, for
/// the runs compared, on the test prompts (`eval.json`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EvalSpec {
    /// Prompts per set.
    #[serde(default = "default_eval_limit")]
    pub limit: u32,
    #[serde(default = "default_eval_tokens")]
    pub max_new_tokens: u32,
}

fn default_eval_limit() -> u32 {
    32
}
fn default_eval_tokens() -> u32 {
    64
}

/// One run of the plan.
#[derive(Debug)]
pub struct ArmRun {
    pub arm: String,
    /// The swept point's label (None: the arm sweeps nothing).
    pub point: Option<String>,
    pub seed: u64,
    pub config: RunConfig,
    /// The base config file (relative paths in it resolve from its folder).
    pub base_path: PathBuf,
    pub dir: PathBuf,
    /// The checkpoint it forks (None: it trains from the start).
    pub fork: Option<ForkRun>,
}

/// One value of an arm (its only one when it sweeps nothing) and its runs, one per seed.
#[derive(Debug)]
pub struct PointRuns {
    pub point: Option<SweepPoint>,
    pub runs: Vec<ArmRun>,
}

#[derive(Debug)]
pub struct ArmPlan {
    pub arm: String,
    /// The swept fields (empty: none).
    pub fields: Vec<String>,
    pub points: Vec<PointRuns>,
}

/// Everything an A/B file asks for, every config checked.
#[derive(Debug)]
pub struct Plan {
    pub name: String,
    /// `<root>/<name>`: the runs' parent, where `selection.json` goes.
    pub dir: PathBuf,
    /// What chooses swept values (None: no arm sweeps).
    pub select: Option<Select>,
    pub eval: Option<EvalSpec>,
    pub arms: Vec<ArmPlan>,
}

impl Plan {
    /// Every run on `device` (`ab --device`, as `train --device` sets a run's `device`).
    pub fn on_device(mut self, device: &str) -> Self {
        for point in self.arms.iter_mut().flat_map(|a| a.points.iter_mut()) {
            for run in &mut point.runs {
                run.config.device = device.to_string();
            }
        }
        self
    }

    /// Phase 1: the first seed of every value of every arm.
    pub fn first_seed_runs(&self) -> impl Iterator<Item = &ArmRun> {
        self.arms.iter().flat_map(|a| a.points.iter().map(|p| &p.runs[0]))
    }

    /// Phase 2: every seed at each arm's chosen value (`chosen`: arm -> point label; an arm
    /// that sweeps nothing has its one value), seed by seed.
    pub fn compared_runs(&self, chosen: &BTreeMap<String, String>) -> Vec<&ArmRun> {
        let at: Vec<&PointRuns> = self
            .arms
            .iter()
            .filter_map(|a| match chosen.get(&a.arm) {
                Some(label) => a.points.iter().find(|p| p.point.as_ref().is_some_and(|q| &q.label == label)),
                None => a.points.first().filter(|p| p.point.is_none()),
            })
            .collect();
        let seeds = at.first().map_or(0, |p| p.runs.len());
        (0..seeds).flat_map(|i| at.iter().map(move |p| &p.runs[i])).collect()
    }

    /// Every run the plan may make.
    pub fn all_runs(&self) -> impl Iterator<Item = &ArmRun> {
        self.arms.iter().flat_map(|a| a.points.iter().flat_map(|p| &p.runs))
    }
}

/// Records the run's data loader holds out, by split, as its plugin's check says (ABI `check`):
/// `(validation, holdout)`. None when the plugin does not say, or refuses the section (the run
/// reports why when it starts).
fn data_splits(cfg: &RunConfig, config_dir: &Path, registry: &Registry) -> Option<(u64, u64)> {
    let section = cfg.section("data");
    let plugin = registry.find(plugin_api::PluginKind::DataLoader, &section.plugin).ok()?;
    let ctx = crate::experiment::manifest::plugin_context(cfg, config_dir, &crate::environment::cache_dir());
    let check = plugin.check(&section, &ctx).ok()?;
    let records = |name: &str| check.splits.iter().find(|s| s.name.as_str() == name).map(|s| s.records);
    Some((records("validation")?, records("holdout")?))
}

const PLUGIN_SECTIONS: [&str; 4] = ["target", "drafter", "optimizer", "data"];

/// Apply an arm's changes: tables merge key by key, except a plugin section that names another
/// plugin, which replaces the base section whole (the old plugin's keys mean nothing to the new).
pub fn merge(base: &mut toml::Table, arm: &toml::Table) {
    for (k, v) in arm {
        let replaces_plugin = PLUGIN_SECTIONS.contains(&k.as_str())
            && v.get("plugin").is_some()
            && v.get("plugin") != base.get(k).and_then(|b| b.get("plugin"));
        match (base.get_mut(k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(a)) if !replaces_plugin => merge(b, a),
            _ => {
                base.insert(k.clone(), v.clone());
            }
        }
    }
}

/// Read an A/B file and expand it into runs under `root/<name>/`: every arm, every value it
/// sweeps, every seed, each config typed and checked now (a bad value is refused before any run).
pub fn plan(path: &Path, seeds: Option<u64>, root: &Path, registry: &Registry) -> Result<Plan> {
    let text = input_files::read_to_string_capped(path, crate::config::MAX_CONFIG_BYTES)
        .with_context(|| format!("reading {}", path.display()))?;
    let ab: AbConfig =
        toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}", crate::config::toml_error(path, &text, &e)))?;
    validate_name(&ab.name).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    if ab.arms.len() < 2 {
        bail!("{}: an A/B needs at least two arms, found {}", path.display(), ab.arms.len());
    }
    let seeds: Vec<u64> = match seeds {
        Some(0) => bail!("--seeds must be >= 1"),
        Some(n) => (0..n).collect(),
        None => ab.seeds.clone(),
    };
    if seeds.is_empty() {
        bail!("{}: field `seeds`: give at least one", path.display());
    }
    if let Some(e) = &ab.eval {
        if e.limit == 0 || e.max_new_tokens == 0 {
            bail!("{}: [eval]: `limit` and `max_new_tokens` must be >= 1", path.display());
        }
    }
    let base_path = match (&ab.base, &ab.fork) {
        (Some(base), None) => crate::config::config_dir(path).join(base),
        (None, Some(f)) => f.exp.join(crate::experiment::CONFIG),
        (Some(_), Some(_)) => {
            bail!("{}: `base` and [fork] exclude each other (a fork's base is its parent's config)", path.display())
        }
        (None, None) => bail!("{}: give `base` (a run config) or [fork] (a run's checkpoint)", path.display()),
    };
    let base_dir = crate::config::config_dir(&base_path);
    let base_text = input_files::read_to_string_capped(&base_path, crate::config::MAX_CONFIG_BYTES)
        .with_context(|| format!("reading base config {}", base_path.display()))?;
    let base: toml::Table = toml::from_str(&base_text)
        .map_err(|e| anyhow::anyhow!("{}", crate::config::toml_error(&base_path, &base_text, &e)))?;
    let dir = root.join(&ab.name);
    let sweeps = ab.arms.values().any(|a| a.contains_key("sweep"));
    let select = match (sweeps, ab.select, &ab.eval) {
        (false, _, _) => None,
        (true, Some(s), _) => Some(s),
        (true, None, Some(_)) => Some(Select::ValTau),
        (true, None, None) => Some(Select::ValTauHat),
    };
    let mut arms = Vec::new();
    for (arm, changes) in &ab.arms {
        let bad = |e: &dyn std::fmt::Display| anyhow::anyhow!("{}: arm `{arm}`: {e}", path.display());
        validate_name(arm).map_err(|e| bad(&e))?;
        let mut changes = changes.clone();
        let fork = match (changes.remove("fork"), &ab.fork) {
            (None, None) => None,
            (Some(_), None) => return Err(bad(&"`fork` needs the A/B's [fork] (the run to fork)")),
            (choices, Some(f)) => {
                let choices: ArmFork = match choices {
                    Some(c) => c.try_into().map_err(|e: toml::de::Error| bad(&format!("fork: {}", e.message())))?,
                    None => ArmFork::default(),
                };
                Some(ForkRun { parent: f.exp.clone(), at: f.at, choices })
            }
        };
        let (fields, points) = match changes.remove("sweep") {
            Some(s) => {
                let (fields, points) = sweep::expand(&s).map_err(|e| bad(&e))?;
                (fields, points.into_iter().map(Some).collect())
            }
            None => (Vec::new(), vec![None]),
        };
        let mut table = base.clone();
        merge(&mut table, &ab.common);
        merge(&mut table, &changes);
        let mut point_runs = Vec::new();
        for point in points {
            let mut runs = Vec::new();
            for &seed in &seeds {
                let mut t = table.clone();
                if let Some(p) = &point {
                    sweep::apply(&mut t, p).map_err(|e| bad(&e))?;
                }
                let folder = match &point {
                    Some(p) => format!("{arm}-{}-s{seed}", p.label),
                    None => format!("{arm}-s{seed}"),
                };
                // The run's name holds what its folder does (`=` is no name character).
                t.insert("name".into(), toml::Value::String(format!("{}-{}", ab.name, folder.replace('=', "_"))));
                t.insert("seed".into(), toml::Value::Integer(seed as i64));
                let config: RunConfig = t.try_into().map_err(|e: toml::de::Error| bad(&e.message()))?;
                config.validate().map_err(|e| bad(&e))?;
                if let Some(f) = &fork {
                    if f.at >= config.train.steps {
                        return Err(bad(&format!("[fork] at = {}: train.steps is {}", f.at, config.train.steps)));
                    }
                }
                if ab.eval.is_some() {
                    evals::check(data_splits(&config, &base_dir, registry)).map_err(|e| bad(&e))?;
                }
                if let (Some(select), Some(p)) = (select, &point) {
                    select
                        .check(&config, data_splits(&config, &base_dir, registry), ab.eval.is_some())
                        .map_err(|e| bad(&format!("{}: {e}", p.label)))?;
                }
                runs.push(ArmRun {
                    arm: arm.clone(),
                    point: point.as_ref().map(|p| p.label.clone()),
                    seed,
                    config,
                    base_path: base_path.clone(),
                    dir: dir.join(folder),
                    fork: fork.clone(),
                });
            }
            point_runs.push(PointRuns { point, runs });
        }
        arms.push(ArmPlan { arm: arm.clone(), fields, points: point_runs });
    }
    Ok(Plan { name: ab.name, dir, select, eval: ab.eval, arms })
}

/// Where an arm's run stands on disk, so a rerun of the A/B continues instead of redoing work.
#[derive(Debug, PartialEq, Eq)]
pub enum ArmState {
    /// No folder (or an empty one): start it.
    New,
    /// Started with this arm's config and not finished (interrupted, killed): resume it.
    Unfinished,
    /// Finished (summary.json, or its last checkpoint is at the last step): leave it.
    Finished,
}

/// The state of `run`'s folder. An unfinished arm must have been started with the config the
/// plan gives it now (an edited A/B file is refused, naming the fields, rather than mixed in);
/// nothing is ever deleted.
pub fn arm_state(run: &ArmRun) -> Result<ArmState> {
    let dir = &run.dir;
    if !dir.exists() || std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))?.next().is_none() {
        return Ok(ArmState::New);
    }
    if crate::experiment::is_finished(dir) {
        return Ok(ArmState::Finished);
    }
    let cfg_path = dir.join(crate::experiment::CONFIG);
    if !cfg_path.is_file() {
        bail!(
            "{}: exists but is not an experiment (no config.toml); move it away to run arm `{}` seed {}",
            dir.display(),
            run.arm,
            run.seed
        );
    }
    let then = input_files::read_to_string_capped(&cfg_path, crate::config::MAX_CONFIG_BYTES)?;
    let drift = crate::experiment::manifest::config_drift(&then, &toml::to_string(&run.config)?);
    if !drift.is_empty() {
        let fields: Vec<String> = drift.iter().map(|d| d.to_string()).collect();
        bail!(
            "arm `{}` seed {}: {} was started with another config ({}); move it away to run the arm again with this one",
            run.arm,
            run.seed,
            dir.display(),
            fields.join("; ")
        );
    }
    // Killed between its last checkpoint and its summary: nothing is left to train.
    let at = crate::experiment::checkpoint::newest_good(dir).0.map_or(0, |c| c.step);
    if at >= run.config.train.steps {
        tracing::warn!(
            "{}: its last checkpoint is at the last step, but it has no summary.json; counted as finished",
            dir.display()
        );
        return Ok(ArmState::Finished);
    }
    Ok(ArmState::Unfinished)
}

/// `dflash-host ab`: phase 1 runs every arm's first seed at every value it sweeps, phase 2 every
/// seed at each arm's value (chosen on the validation split between them, `selection.json`),
/// each run followed by `[eval]`; finished runs are skipped, unfinished ones resumed. Then the
/// comparison into `out` (default: the A/B folder's `report/`). Returns the report and, when a
/// run was interrupted, its exit code (rerunning the A/B resumes it).
pub fn run(
    config: &Path,
    how: &How,
    out: Option<&Path>,
    registry: &Registry,
    print_summary: fn(&crate::train::TrainSummary),
) -> Result<(PathBuf, Option<u8>)> {
    if let Some(out) = out {
        // Before hours of training (and again when the report is written).
        let ab_file = crate::experiment::guard::Input::new("the A/B file", config);
        crate::experiment::guard::check_out_folder("--out", out, &[ab_file])?;
    }
    let plan = how.plan(config, registry)?;
    let mut jobs = jobs::Jobs { config, how, forward: None };
    let report = plan.dir.join("report");
    let first: Vec<&ArmRun> = plan.first_seed_runs().collect();
    let swept = plan.arms.iter().filter(|a| !a.fields.is_empty()).count();
    let n_seeds = plan.arms[0].points[0].runs.len();
    tracing::info!(
        "A/B {}: {} arms{}, {n_seeds} seed(s), {} runs",
        plan.dir.display(),
        plan.arms.len(),
        if swept > 0 {
            format!(" ({swept} sweeping, chosen by {})", plan.select.map_or("-", Select::as_str))
        } else {
            String::new()
        },
        first.len() + plan.arms.len() * (n_seeds - 1),
    );
    // 1. Every arm's first seed, at every value it sweeps.
    if how.jobs > 1 {
        if let Some(code) = jobs.run(&first, Stage::First)? {
            return Ok((report, Some(code)));
        }
    } else {
        for (i, r) in first.iter().enumerate() {
            tracing::info!(
                "A/B phase 1, run {}/{}: arm `{}`{}, seed {}",
                i + 1,
                first.len(),
                r.arm,
                point_text(r),
                r.seed
            );
            if let Some(code) = train_one(r, registry, print_summary)? {
                return Ok((report, Some(code)));
            }
            first_evals(&plan, r, registry)?;
        }
    }
    // 2. Each swept arm's value, on the validation split only.
    let selection = choose(&plan)?;
    let mut chosen = BTreeMap::new();
    if !selection.arms.is_empty() {
        select::write(&plan, &selection)?;
        for a in &selection.arms {
            tracing::info!(
                "A/B: arm `{}` runs at {} (best {} on the validation split)",
                a.arm,
                a.chosen,
                selection.select
            );
            chosen.insert(a.arm.clone(), a.chosen.clone());
        }
    }
    // 3. Every seed at those values; the compared runs are evaluated on the test prompts too.
    let compared = plan.compared_runs(&chosen);
    if how.jobs > 1 {
        // The first seed's runs are trained already: they come back for their evaluations only.
        let due: Vec<&ArmRun> =
            compared.iter().copied().filter(|r| r.seed != first[0].seed || plan.eval.is_some()).collect();
        if let Some(code) = jobs.run(&due, Stage::Compared)? {
            return Ok((report, Some(code)));
        }
    } else {
        let later = compared.iter().filter(|r| r.seed != first[0].seed).count();
        let mut k = 0;
        for r in &compared {
            if r.seed != first[0].seed {
                k += 1;
                tracing::info!("A/B phase 2, run {k}/{later}: arm `{}`{}, seed {}", r.arm, point_text(r), r.seed);
                if let Some(code) = train_one(r, registry, print_summary)? {
                    return Ok((report, Some(code)));
                }
            }
            compared_evals(&plan, r, registry)?;
        }
    }
    // 4. The comparison: every run made (the sweep's other values shown as such).
    let mut dirs: Vec<PathBuf> = first.iter().chain(&compared).map(|r| r.dir.clone()).collect();
    dirs.sort();
    dirs.dedup();
    let out = out.map_or(report, Path::to_path_buf);
    Ok((crate::compare::run(&dirs, Some(&out), None)?, None))
}

/// After a phase-1 run: real tau on the validation prompts, only where it chooses (decoding
/// costs more than the training of a small run).
fn first_evals(plan: &Plan, r: &ArmRun, registry: &Registry) -> Result<()> {
    if let (Some(spec), Some(Select::ValTau)) = (&plan.eval, plan.select) {
        evals::ensure(&r.dir, registry, spec, &[evals::PromptSet::Validation])?;
    }
    Ok(())
}

/// After a compared run: the test prompts too.
fn compared_evals(plan: &Plan, r: &ArmRun, registry: &Registry) -> Result<()> {
    if let Some(spec) = &plan.eval {
        let sets: &[evals::PromptSet] = match plan.select {
            Some(Select::ValTau) => &[evals::PromptSet::Validation, evals::PromptSet::Test],
            _ => &[evals::PromptSet::Test],
        };
        evals::ensure(&r.dir, registry, spec, sets)?;
    }
    Ok(())
}

/// How an A/B runs: the seeds and device given on the command line, and how many runs of a
/// phase train at once (`--jobs`: more than 1 runs each in its own process, `ab --only`).
pub struct How {
    pub seeds: Option<u64>,
    pub device: Option<String>,
    pub jobs: usize,
}

impl How {
    fn plan(&self, config: &Path, registry: &Registry) -> Result<Plan> {
        let plan = plan(config, self.seeds, Path::new("experiments"), registry)?;
        Ok(match &self.device {
            Some(d) => plan.on_device(d),
            None => plan,
        })
    }
}

/// Which phase a run belongs to, for what is evaluated after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Stage {
    /// Phase 1: every arm's first seed at every value it sweeps.
    First,
    /// Phase 2: the compared runs.
    Compared,
}

/// `ab --only RUN --stage S`: one run of the plan (its folder's name) and the evaluations its
/// phase asks for, as one of the processes of `ab --jobs`. Returns the code of an interrupted run.
pub fn run_only(
    config: &Path,
    how: &How,
    name: &str,
    stage: Stage,
    registry: &Registry,
    print_summary: fn(&crate::train::TrainSummary),
) -> Result<Option<u8>> {
    let plan = how.plan(config, registry)?;
    let Some(r) = plan.all_runs().find(|r| r.dir.file_name().is_some_and(|n| n == name)) else {
        bail!("{}: the A/B plans no run `{name}`", config.display());
    };
    if let Some(code) = train_one(r, registry, print_summary)? {
        return Ok(Some(code));
    }
    match stage {
        Stage::First => first_evals(&plan, r, registry)?,
        Stage::Compared => compared_evals(&plan, r, registry)?,
    }
    Ok(None)
}

fn point_text(r: &ArmRun) -> String {
    r.point.as_ref().map_or(String::new(), |p| format!(" at {p}"))
}

/// Train one run of the plan (new, resumed, or left as it is when finished). Returns the exit
/// code of an interrupted run.
fn train_one(r: &ArmRun, registry: &Registry, print_summary: fn(&crate::train::TrainSummary)) -> Result<Option<u8>> {
    let summary = match arm_state(r)? {
        ArmState::Finished => {
            tracing::info!("{} is complete already; skipping it", r.dir.display());
            None
        }
        ArmState::Unfinished => {
            tracing::info!("{} is unfinished: resuming it", r.dir.display());
            Some(crate::train::start::resume_with(
                &r.dir,
                None,
                registry,
                &crate::train::start::ResumeOptions::default(),
            )?)
        }
        ArmState::New if r.fork.is_some() => {
            let f = r.fork.as_ref().expect("a fork");
            let ab_name = r.dir.parent().and_then(Path::file_name).unwrap_or_default().to_string_lossy().to_string();
            Some(crate::train::fork::fork(crate::train::fork::ForkSpec {
                parent: &f.parent,
                at: f.at,
                overrides: Vec::new(),
                config: Some(r.config.clone()),
                exp_dir: Some(r.dir.clone()),
                optimizer_state: f.choices.optimizer_state,
                schedule: f.choices.schedule,
                rewarm: f.choices.rewarm,
                registry,
                stop_at: None,
                ab: Some((&ab_name, &r.arm)),
            })?)
        }
        ArmState::New => {
            let ab_name = r.dir.parent().and_then(Path::file_name).unwrap_or_default().to_string_lossy().to_string();
            Some(crate::train::start::run(crate::train::start::RunSpec {
                cfg: &r.config,
                config_path: &r.base_path,
                exp_dir: &r.dir,
                registry,
                ab: Some((&ab_name, &r.arm)),
                stop_at: None,
            })?)
        }
    };
    Ok(summary.and_then(|s| {
        print_summary(&s);
        s.interrupted
    }))
}

#[cfg(test)]
mod tests;
