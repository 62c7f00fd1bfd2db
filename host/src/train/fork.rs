//! `fork`: a new experiment that starts from another one's checkpoint under a changed config.
//! The parent is only read (it may still be training; its lock is not taken): its checkpoint is
//! opened once, checked against its checksums, and copied into the fork as the fork's own first
//! checkpoint, so the fork is a normal experiment from then on (resume, locks, refused changes).
//! Its manifest records the parent, the step and the weights' SHA-256; its steps continue the
//! parent's count.

use super::start::{check_stop_at, connect, follower_rank, fresh_manifest, served, trainer_state};
use crate::{
    config::{self, PluginSection, RunConfig},
    environment::cache_dir,
    experiment::{
        self, checkpoint,
        manifest::{CarryRecord, ParentRecord},
        Experiment, Manifest,
    },
    pipeline::{assemble::build, components::Components, ranks::place_rank, replicas},
    plugins::Registry,
    train::{self, carry, schedule::ForkSchedule, ResumeFrom, TrainSummary, TrainerState},
};
use anyhow::{bail, Result};
use plugin_api::NamedTensor;
use std::path::{Path, PathBuf};

/// What the fork does with the parent's optimizer state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerStateChoice {
    /// Load the parent's state (the default when the optimizer plugin stays the same).
    Keep,
    /// A new state (the default when the optimizer plugin changes).
    Fresh,
    /// What maps taken over from the parent's optimizer by role (plugin ABI 2.1): first moment
    /// (AdamW's `exp_avg`, Muon's momentum buffer), second moment where the fork's optimizer has
    /// one, master weights, the step count.
    Carry,
}

/// Where the fork's learning-rate schedule goes on from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleChoice {
    /// At the parent's position: the schedule of `train.steps` steps, as the parent has it.
    #[default]
    Continue,
    /// A new warm-up and cosine decay over the steps after the fork.
    Restart,
}

impl OptimizerStateChoice {
    fn name(self) -> &'static str {
        match self {
            Self::Keep => "keep",
            Self::Fresh => "fresh",
            Self::Carry => "carry",
        }
    }
}

impl ScheduleChoice {
    fn name(self) -> &'static str {
        match self {
            Self::Continue => "continue",
            Self::Restart => "restart",
        }
    }
}

pub struct ForkSpec<'a> {
    pub parent: &'a Path,
    pub at: u64,
    /// `--set` / `--device`, applied to the parent's config.
    pub overrides: Vec<config::Override>,
    /// The fork's whole config instead (an A/B arm's: the parent's merged with the arm's changes,
    /// a plugin section naming another plugin replaced whole); `overrides` are then not read.
    pub config: Option<RunConfig>,
    /// Default: `<parent>-fork-<STEP>` beside the parent (`-2`, ... if taken).
    pub exp_dir: Option<PathBuf>,
    pub optimizer_state: Option<OptimizerStateChoice>,
    pub schedule: ScheduleChoice,
    /// Steps of linear re-warm-up from the fork (default: the run's warm-up length after a fresh
    /// optimizer state with the schedule continued, else none).
    pub rewarm: Option<u64>,
    pub registry: &'a Registry,
    pub stop_at: Option<u64>,
    /// The A/B and arm the fork is a run of (recorded in its manifest).
    pub ab: Option<(&'a str, &'a str)>,
}

/// The fork's folder when none is given: `<parent>-fork-<STEP>` beside the parent (`-2`, ... if
/// taken, as it is now; the fork itself claims its name when its folder appears).
pub fn default_dir(parent: &Path, at: u64) -> PathBuf {
    let (root, name) = default_name(parent, at);
    experiment::fresh_dir(&root, &name)
}

/// The folder and name a fork without `--exp-dir` goes under.
fn default_name(parent: &Path, at: u64) -> (PathBuf, String) {
    let name = parent.file_name().map_or("experiment".into(), |n| n.to_string_lossy().to_string());
    let root = parent.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    (root.to_path_buf(), format!("{name}-fork-{at}"))
}

/// Fork `spec.parent` at `spec.at` and train the fork to its configured steps: the parent
/// resolved once, the fork's config and folder, the changes applied (the optimizer state, the
/// schedule), the child's first checkpoint and manifest, then the trainer as for a resume.
pub fn fork(spec: ForkSpec) -> Result<TrainSummary> {
    // 1. Resolve the parent, the fork's config and its folder.
    let parent = Parent::resolve(spec.parent)?;
    let cfg = fork_config(&spec, &parent)?;
    let dir = ChildDir::choose(&spec)?;
    // A rank of a target replica other than its lead builds the target alone and serves it.
    if let Some(follower) = replicas::follower(&cfg)? {
        replicas::serve(&cfg, &parent.config_path, &parent.config_dir, spec.registry, &dir.path, follower)?;
        return Ok(served(&dir.path));
    }
    // Rank 0 writes the fork's folder; every other rank that trains (a data-parallel rank, the
    // lead of another replica) reads the parent's checkpoint as rank 0 does.
    let writes = !follower_rank()?;
    if writes && dir.numbered.is_none() {
        config::preflight::check_exp_dir(&dir.path)?;
    }
    let (ckpt, mut state) = parent.checkpoint(spec.at)?;

    // 2. Apply the changes: the optimizer state and the schedule, then the plugins under the
    // fork's config and what only they know.
    let changes = Changes::choose(&spec, &parent, &cfg)?;
    if let Some(schedule) = changes.schedule(&spec) {
        state.fork = Some(schedule);
    }
    let cache = cache_dir();
    let components = build(&cfg, &parent.config_path, &parent.config_dir, spec.registry)?;
    let (optimizer_state, carried) = changes.optimizer_state(&spec, &parent, &ckpt, &cfg, &components, &cache)?;
    check_drafter(&spec, &state, &ckpt, &components)?;

    // 3. Write the child: its manifest, then its folder with the parent's checkpoint as its first.
    let manifest = child_manifest(&spec, &parent, &ckpt, &changes, carried, &cfg, &components, &cache)?;
    let keep = cfg.train.keep_checkpoints;
    let folder = match writes {
        true => child_folder(&spec, dir.clone(), &ckpt, &optimizer_state, &state, manifest, keep),
        false => train::RunFolder::Open(Experiment::detached(&dir.path)),
    };
    let Some((comm, components)) = connect(&cfg, components, &dir.path)? else { return Ok(served(&dir.path)) };
    let from = ResumeFrom { state, weights: ckpt.weights, optimizer_state, checkpoint: ckpt.dir.display().to_string() };
    train::train(
        &cfg,
        components,
        folder,
        &cache,
        train::TrainOptions { resume: Some(from), stop_at: spec.stop_at, comm },
    )
}

/// The parent as the fork reads it, resolved once and handed to every phase: it is only read
/// (it may still be training; its lock is not taken).
struct Parent<'a> {
    dir: &'a Path,
    /// Its `config.toml`: the fork's config unless one is given, and where errors point.
    config_path: PathBuf,
    /// The folder its config's relative paths resolve from (its manifest's).
    config_dir: PathBuf,
    /// The optimizer plugin it trained with (its manifest's record; empty if none).
    optimizer: String,
}

impl<'a> Parent<'a> {
    fn resolve(dir: &'a Path) -> Result<Self> {
        let config_path = dir.join(experiment::CONFIG);
        if !config_path.is_file() {
            bail!("{}: not an experiment directory (no config.toml)", dir.display());
        }
        let manifest = Manifest::read(dir)?;
        let optimizer = manifest.plugins.iter().find(|p| p.kind == "optimizer").map(|p| p.name.clone());
        Ok(Parent {
            dir,
            config_path,
            config_dir: PathBuf::from(&manifest.config_dir),
            optimizer: optimizer.unwrap_or_default(),
        })
    }

    /// Its checkpoint at `at`: every file opened once and checked against its checksum, read
    /// from those handles (a parent still training may prune the folder meanwhile); and the
    /// trainer state it holds.
    fn checkpoint(&self, at: u64) -> Result<(checkpoint::Opened, TrainerState)> {
        let ckpt = checkpoint::open_step(self.dir, at, true)?;
        let state = trainer_state(&ckpt)?;
        if state.step != at {
            let path = ckpt.dir.join("trainer_state.json");
            bail!("{}: records step {}, the folder is step-{at}", path.display(), state.step);
        }
        Ok((ckpt, state))
    }

    /// Its folder as the manifest records it.
    fn path(&self) -> String {
        self.dir.canonicalize().unwrap_or_else(|_| self.dir.to_path_buf()).display().to_string()
    }
}

/// The fork's config: the one given, or the parent's with the overrides; this rank's devices;
/// steps left after the fork.
fn fork_config(spec: &ForkSpec, parent: &Parent) -> Result<RunConfig> {
    let cfg = match spec.config.clone() {
        Some(cfg) => cfg,
        None => RunConfig::load_with(&parent.config_path, &spec.overrides)?,
    };
    let cfg = place_rank(&cfg)?;
    let at = spec.at;
    if at >= cfg.train.steps {
        bail!(
            "cannot fork {} at step {at}: train.steps is {}; give `--set train.steps=N` with N > {at}",
            parent.dir.display(),
            cfg.train.steps
        );
    }
    check_stop_at(spec.stop_at, at)?;
    Ok(cfg)
}

/// The fork's folder.
#[derive(Clone)]
struct ChildDir {
    path: PathBuf,
    /// Without `--exp-dir`: the root and name the fork claims the first free one of
    /// (`<parent>-fork-<STEP>`, `-2`, ...) when its folder appears.
    numbered: Option<(PathBuf, String)>,
}

impl ChildDir {
    fn choose(spec: &ForkSpec) -> Result<Self> {
        // Under a launcher every rank must name the same folder (`--nproc` gives them one).
        let launched = crate::dist::DistEnv::from_env()?.is_some_and(|e| e.world > 1);
        // Forks started at once each get their own numbered folder.
        let numbered = match spec.exp_dir.clone() {
            Some(_) => None,
            None if launched => {
                bail!("fork over several ranks: give the fork's folder with --exp-dir (one for every rank)")
            }
            None => Some(default_name(spec.parent, spec.at)),
        };
        let path = match &numbered {
            Some((root, name)) => root.join(name),
            None => spec.exp_dir.clone().expect("given"),
        };
        Ok(ChildDir { path, numbered })
    }
}

/// What the fork changes against its parent: the optimizer (then and now), what becomes of its
/// state, the re-warm-up.
struct Changes {
    optimizer_then: String,
    optimizer_now: PluginSection,
    choice: OptimizerStateChoice,
    rewarm: u64,
}

impl Changes {
    fn choose(spec: &ForkSpec, parent: &Parent, cfg: &RunConfig) -> Result<Self> {
        let optimizer_then = parent.optimizer.clone();
        let optimizer_now = cfg.section("optimizer");
        let switched = optimizer_then != optimizer_now.plugin;
        let choice = spec.optimizer_state.unwrap_or(if switched {
            OptimizerStateChoice::Fresh
        } else {
            OptimizerStateChoice::Keep
        });
        if switched && choice == OptimizerStateChoice::Keep {
            bail!(
                "field `fork.optimizer_state` (--optimizer-state) is keep, but the checkpoint holds `{optimizer_then}`'s \
                 state and the fork's optimizer is `{}`; give --optimizer-state fresh (a new state) or carry (what maps \
                 taken over)",
                optimizer_now.plugin
            );
        }
        let t = &cfg.train;
        let warmup = (t.warmup_frac * t.steps as f64).round() as u64;
        let rewarm = spec.rewarm.unwrap_or(match (choice, spec.schedule) {
            (OptimizerStateChoice::Fresh, ScheduleChoice::Continue) => warmup,
            _ => 0,
        });
        Ok(Changes { optimizer_then, optimizer_now, choice, rewarm })
    }

    /// The schedule the trainer state keeps, where it is not the parent's.
    fn schedule(&self, spec: &ForkSpec) -> Option<ForkSchedule> {
        let restart = spec.schedule == ScheduleChoice::Restart;
        (restart || self.rewarm > 0).then_some(ForkSchedule { at: spec.at, restart, rewarm: self.rewarm })
    }

    /// The fork's optimizer state: the parent's, a new one, or what carries over into the fork's
    /// optimizer (with the record of it).
    fn optimizer_state(
        &self,
        spec: &ForkSpec,
        parent: &Parent,
        ckpt: &checkpoint::Opened,
        cfg: &RunConfig,
        components: &Components,
        cache: &Path,
    ) -> Result<(Vec<NamedTensor>, Option<CarryRecord>)> {
        let parent_state = || ckpt.optimizer_state.clone().expect("opened with the optimizer state");
        Ok(match self.choice {
            OptimizerStateChoice::Keep => (parent_state(), None),
            OptimizerStateChoice::Fresh => (Vec::new(), None),
            OptimizerStateChoice::Carry => {
                let from = carry::CarryFrom {
                    section: RunConfig::load(&parent.config_path)?.section("optimizer"),
                    state: parent_state(),
                    weights: &ckpt.weights,
                };
                let trainable: Vec<String> =
                    components.drafter.parameters()?.iter().map(|p| p.name.to_string()).collect();
                let to = &self.optimizer_now;
                let c = carry::carry(from, to, cfg, &trainable, spec.registry, &parent.config_dir, cache)?;
                (c.state, Some(c.record))
            }
        })
    }
}

/// The fork's drafter must take the checkpoint: its block positions and its weights.
fn check_drafter(
    spec: &ForkSpec,
    state: &TrainerState,
    ckpt: &checkpoint::Opened,
    components: &Components,
) -> Result<()> {
    let positions = components.drafter.block_size()?.saturating_sub(1) as usize;
    if state.window.positions() != positions {
        bail!(
            "cannot fork {} at step {}: its checkpoint has statistics for {} block positions, the fork's drafter has \
             {positions} (block_size changed)",
            spec.parent.display(),
            spec.at,
            state.window.positions()
        );
    }
    ckpt.check_weights_for(&components.drafter.parameters()?)
}

/// The fork's manifest: a fresh one under its config, with its parent, the A/B it is a run of.
#[allow(clippy::too_many_arguments)]
fn child_manifest(
    spec: &ForkSpec,
    parent: &Parent,
    ckpt: &checkpoint::Opened,
    changes: &Changes,
    carried: Option<CarryRecord>,
    cfg: &RunConfig,
    components: &Components,
    cache: &Path,
) -> Result<Manifest> {
    Ok(Manifest {
        parent: Some(ParentRecord {
            path: parent.path(),
            step: spec.at,
            checkpoint_sha256: ckpt.weights_sha256.clone(),
            optimizer_then: changes.optimizer_then.clone(),
            optimizer_now: changes.optimizer_now.plugin.clone(),
            optimizer_state: changes.choice.name().into(),
            schedule: spec.schedule.name().into(),
            rewarm: changes.rewarm,
            carried,
        }),
        ab: spec.ab.map(|(name, _)| name.to_string()),
        arm: spec.ab.map(|(_, arm)| arm.to_string()),
        ..fresh_manifest(cfg, spec.registry, &parent.config_dir, cache, components)?
    })
}

/// The fork's folder, with the checkpoint it starts from as its own first one (written before
/// the folder appears): killed at any moment, the fork resumes from there at the latest. It is
/// made once everything was checked: the data read (and its position in it taken), the
/// optimizer state loaded; a refused fork leaves no folder.
fn child_folder(
    spec: &ForkSpec,
    dir: ChildDir,
    ckpt: &checkpoint::Opened,
    optimizer_state: &[NamedTensor],
    state: &TrainerState,
    manifest: Manifest,
    keep: usize,
) -> train::RunFolder<'static> {
    let at = spec.at;
    let parent = spec.parent.to_path_buf();
    let resolved = manifest.config_toml.clone().expect("a fresh manifest holds its config");
    let (first_weights, ckpt_config_json) = (ckpt.weights.clone(), ckpt.config_json.clone());
    let (first_optimizer, first_state) = (optimizer_state.to_vec(), state.clone());
    let record = manifest.parent.as_ref().expect("a fork's manifest names its parent");
    let (then, now) = (&record.optimizer_then, &record.optimizer_now);
    let said = format!(
        "(optimizer {then} -> {now}, state {}, schedule {}, re-warm {} steps)",
        record.optimizer_state, record.schedule, record.rewarm
    );
    let carried_said =
        record.carried.as_ref().map(|c| format!("carried the optimizer state {then} -> {now}: {}", c.summary()));
    train::RunFolder::New(Box::new(move || {
        let first = checkpoint::CheckpointData {
            weights: &first_weights,
            drafter_config_json: &ckpt_config_json,
            optimizer_state: &first_optimizer,
            trainer_state: &first_state,
        };
        let fill = |tmp: &Path| checkpoint::write(tmp, at, &first, keep).map(|_| ());
        let exp = match dir.numbered {
            Some((root, name)) => Experiment::create_numbered(&root, &name, &resolved, &manifest, fill)?,
            None => Experiment::create_with(&dir.path, &resolved, &manifest, fill)?,
        };
        tracing::info!("forked {} at step {at} into {} {said}", parent.display(), exp.dir.display());
        if let Some(c) = carried_said {
            tracing::info!("{c}");
        }
        Ok(exp)
    }))
}
