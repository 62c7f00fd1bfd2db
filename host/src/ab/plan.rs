//! An A/B file read and expanded into its plan: every arm, every value it sweeps, every seed,
//! each run's config typed and checked before any run starts; how the command runs it ([`How`]) and
//! its phases ([`Stage`]).

use super::{
    evals::{self, EvalSpec},
    measure::Select,
    sweep,
    sweep::SweepPoint,
};
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
/// How an A/B runs: the seeds and device given on the command line, and how many runs of a
/// phase train at once (`--jobs`: more than 1 runs each in its own process, `ab --only`).
pub struct How {
    pub seeds: Option<u64>,
    pub device: Option<String>,
    pub jobs: usize,
}

impl How {
    pub(super) fn plan(&self, config: &Path, registry: &Registry) -> Result<Plan> {
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
    let (ab, seeds) = read_ab(path, seeds)?;
    let (base_path, base) = read_base(path, &ab)?;
    let dir = root.join(&ab.name);
    let sweeps = ab.arms.values().any(|a| a.contains_key("sweep"));
    let select = match (sweeps, ab.select, &ab.eval) {
        (false, _, _) => None,
        (true, Some(s), _) => Some(s),
        (true, None, Some(_)) => Some(Select::ValTau),
        (true, None, None) => Some(Select::ValTauHat),
    };
    let expand = Expand {
        path,
        ab: &ab,
        seeds: &seeds,
        base_dir: crate::config::config_dir(&base_path),
        base_path: &base_path,
        base: &base,
        dir: &dir,
        select,
        registry,
    };
    let arms = ab.arms.iter().map(|(arm, changes)| expand.arm(arm, changes)).collect::<Result<Vec<_>>>()?;
    Ok(Plan { name: ab.name, dir, select, eval: ab.eval, arms })
}

/// The A/B file, parsed and checked, and its seeds (`--seeds N`: 0..N instead of the file's).
fn read_ab(path: &Path, seeds: Option<u64>) -> Result<(AbConfig, Vec<u64>)> {
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
    Ok((ab, seeds))
}

/// The run config every arm starts from: `base`, or with `[fork]` the parent's config.
fn read_base(path: &Path, ab: &AbConfig) -> Result<(PathBuf, toml::Table)> {
    let base_path = match (&ab.base, &ab.fork) {
        (Some(base), None) => crate::config::config_dir(path).join(base),
        (None, Some(f)) => f.exp.join(crate::experiment::CONFIG),
        (Some(_), Some(_)) => {
            bail!("{}: `base` and [fork] exclude each other (a fork's base is its parent's config)", path.display())
        }
        (None, None) => bail!("{}: give `base` (a run config) or [fork] (a run's checkpoint)", path.display()),
    };
    let base_text = input_files::read_to_string_capped(&base_path, crate::config::MAX_CONFIG_BYTES)
        .with_context(|| format!("reading base config {}", base_path.display()))?;
    let base: toml::Table = toml::from_str(&base_text)
        .map_err(|e| anyhow::anyhow!("{}", crate::config::toml_error(&base_path, &base_text, &e)))?;
    Ok((base_path, base))
}

/// What every arm's expansion reads: the A/B file, its seeds, the base config and where runs go.
struct Expand<'a> {
    path: &'a Path,
    ab: &'a AbConfig,
    seeds: &'a [u64],
    base_dir: PathBuf,
    base_path: &'a Path,
    base: &'a toml::Table,
    dir: &'a Path,
    select: Option<Select>,
    registry: &'a Registry,
}

impl Expand<'_> {
    fn bad(&self, arm: &str, e: &dyn std::fmt::Display) -> anyhow::Error {
        anyhow::anyhow!("{}: arm `{arm}`: {e}", self.path.display())
    }

    /// One arm: the checkpoint it forks, the values it sweeps, a run per value and seed.
    fn arm(&self, arm: &String, changes: &toml::Table) -> Result<ArmPlan> {
        let bad = |e: &dyn std::fmt::Display| self.bad(arm, e);
        validate_name(arm).map_err(|e| bad(&e))?;
        let mut changes = changes.clone();
        let fork = match (changes.remove("fork"), &self.ab.fork) {
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
        let mut table = self.base.clone();
        merge(&mut table, &self.ab.common);
        merge(&mut table, &changes);
        let mut point_runs = Vec::new();
        for point in points {
            let mut runs = Vec::new();
            for &seed in self.seeds {
                runs.push(self.run(arm, &table, point.as_ref(), seed, &fork)?);
            }
            point_runs.push(PointRuns { point, runs });
        }
        Ok(ArmPlan { arm: arm.clone(), fields, points: point_runs })
    }

    /// One run: the arm's config at the swept value with the seed, typed and checked, its folder.
    fn run(
        &self,
        arm: &String,
        table: &toml::Table,
        point: Option<&SweepPoint>,
        seed: u64,
        fork: &Option<ForkRun>,
    ) -> Result<ArmRun> {
        let (ab, registry, base_dir) = (self.ab, self.registry, &self.base_dir);
        let bad = |e: &dyn std::fmt::Display| self.bad(arm, e);
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
            evals::check(data_splits(&config, base_dir, registry)).map_err(|e| bad(&e))?;
        }
        if let (Some(select), Some(p)) = (self.select, &point) {
            select
                .check(&config, data_splits(&config, base_dir, registry), ab.eval.is_some())
                .map_err(|e| bad(&format!("{}: {e}", p.label)))?;
        }
        Ok(ArmRun {
            arm: arm.clone(),
            point: point.map(|p| p.label.clone()),
            seed,
            config,
            base_path: self.base_path.to_path_buf(),
            dir: self.dir.join(folder),
            fork: fork.clone(),
        })
    }
}
