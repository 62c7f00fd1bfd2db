//! `fork`: a new experiment that starts from another one's checkpoint under a changed config.
//! The parent is only read (it may still be training; its lock is not taken): its checkpoint is
//! opened once, checked against its checksums, and copied into the fork as the fork's own first
//! checkpoint, so the fork is a normal experiment from then on (resume, locks, refused changes).
//! Its manifest records the parent, the step and the weights' SHA-256; its steps continue the
//! parent's count.

use super::start::{check_stop_at, connect, follower_rank, fresh_manifest, served};
use crate::{
    config::{self, RunConfig},
    environment::cache_dir,
    experiment::{self, checkpoint, manifest::ParentRecord, Experiment, Manifest},
    pipeline::{assemble::build, ranks::place_rank, replicas},
    plugins::Registry,
    train::{self, carry, schedule::ForkSchedule, ResumeFrom, TrainSummary, TrainerState},
};
use anyhow::{bail, Context, Result};
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

/// Fork `spec.parent` at `spec.at` and train the fork to its configured steps.
pub fn fork(spec: ForkSpec) -> Result<TrainSummary> {
    let parent = spec.parent;
    let at = spec.at;
    let parent_cfg = parent.join(experiment::CONFIG);
    if !parent_cfg.is_file() {
        bail!("{}: not an experiment directory (no config.toml)", parent.display());
    }
    let then = Manifest::read(parent)?;
    let cfg = match spec.config.clone() {
        Some(cfg) => cfg,
        None => RunConfig::load_with(&parent_cfg, &spec.overrides)?,
    };
    let cfg = place_rank(&cfg)?;
    if at >= cfg.train.steps {
        bail!(
            "cannot fork {} at step {at}: train.steps is {}; give `--set train.steps=N` with N > {at}",
            parent.display(),
            cfg.train.steps
        );
    }
    check_stop_at(spec.stop_at, at)?;
    // Under a launcher every rank must name the same folder (`--nproc` gives them one).
    let launched = crate::dist::DistEnv::from_env()?.is_some_and(|e| e.world > 1);
    // Without --exp-dir the fork takes the first free one of `<parent>-fork-<STEP>`, `-2`, ...
    // when its folder appears (forks started at once each get their own).
    let numbered = match spec.exp_dir.clone() {
        Some(_) => None,
        None if launched => {
            bail!("fork over several ranks: give the fork's folder with --exp-dir (one for every rank)")
        }
        None => Some(default_name(parent, at)),
    };
    let exp_dir = match &numbered {
        Some((root, name)) => root.join(name),
        None => spec.exp_dir.clone().expect("given"),
    };
    let config_dir = PathBuf::from(&then.config_dir);
    // A rank of a target replica other than its lead builds the target alone and serves it.
    if let Some(follower) = replicas::follower(&cfg)? {
        replicas::serve(&cfg, &parent_cfg, &config_dir, spec.registry, &exp_dir, follower)?;
        return Ok(served(&exp_dir));
    }
    // Rank 0 writes the fork's folder; every other rank that trains (a data-parallel rank, the
    // lead of another replica) reads the parent's checkpoint as rank 0 does.
    let writes = !follower_rank()?;
    if writes && numbered.is_none() {
        config::preflight::check_exp_dir(&exp_dir)?;
    }

    // The checkpoint: every file opened once and checked against its checksum, read from those
    // handles (a parent still training may prune the folder meanwhile).
    let ckpt = checkpoint::open_step(parent, at, true)?;
    let state_path = ckpt.dir.join("trainer_state.json");
    let mut state: TrainerState = serde_json::from_value(ckpt.trainer_state.clone())
        .with_context(|| format!("{}: not valid", state_path.display()))?;
    if state.step != at {
        bail!("{}: records step {}, the folder is step-{at}", state_path.display(), state.step);
    }

    // The optimizer state and the schedule.
    let plugin_of = |kind: &str| then.plugins.iter().find(|p| p.kind == kind).map(|p| p.name.clone());
    let optimizer_then = plugin_of("optimizer").unwrap_or_default();
    let optimizer_now = cfg.section("optimizer").plugin;
    let switched = optimizer_then != optimizer_now;
    let choice =
        spec.optimizer_state.unwrap_or(if switched { OptimizerStateChoice::Fresh } else { OptimizerStateChoice::Keep });
    if switched && choice == OptimizerStateChoice::Keep {
        bail!(
            "field `fork.optimizer_state` (--optimizer-state) is keep, but the checkpoint holds `{optimizer_then}`'s \
             state and the fork's optimizer is `{optimizer_now}`; give --optimizer-state fresh (a new state) or carry \
             (what maps taken over)"
        );
    }
    let t = &cfg.train;
    let warmup = (t.warmup_frac * t.steps as f64).round() as u64;
    let rewarm = spec.rewarm.unwrap_or(match (choice, spec.schedule) {
        (OptimizerStateChoice::Fresh, ScheduleChoice::Continue) => warmup,
        _ => 0,
    });
    if spec.schedule == ScheduleChoice::Restart || rewarm > 0 {
        state.fork = Some(ForkSchedule { at, restart: spec.schedule == ScheduleChoice::Restart, rewarm });
    }

    // The plugins under the fork's config, and what only they know.
    let cache = cache_dir();
    let components = build(&cfg, &parent_cfg, &config_dir, spec.registry)?;
    let parent_state = || ckpt.optimizer_state.clone().expect("opened with the optimizer state");
    let (optimizer_state, carried) = match choice {
        OptimizerStateChoice::Keep => (parent_state(), None),
        OptimizerStateChoice::Fresh => (Vec::new(), None),
        OptimizerStateChoice::Carry => {
            let from = carry::CarryFrom {
                section: RunConfig::load(&parent_cfg)?.section("optimizer"),
                state: parent_state(),
                weights: &ckpt.weights,
            };
            let trainable: Vec<String> = components.drafter.parameters()?.iter().map(|p| p.name.to_string()).collect();
            let c = carry::carry(from, &cfg, &trainable, spec.registry, &config_dir, &cache)?;
            (c.state, Some(c.record))
        }
    };
    let positions = components.drafter.block_size()?.saturating_sub(1) as usize;
    if state.window.positions() != positions {
        bail!(
            "cannot fork {} at step {at}: its checkpoint has statistics for {} block positions, the fork's drafter has \
             {positions} (block_size changed)",
            parent.display(),
            state.window.positions()
        );
    }
    let declared = checkpoint::declared_by(&components.drafter.parameters()?);
    checkpoint::check_declared(&ckpt.weights_file(), &ckpt.weights, &declared)?;

    let manifest = Manifest {
        parent: Some(ParentRecord {
            path: parent.canonicalize().unwrap_or_else(|_| parent.to_path_buf()).display().to_string(),
            step: at,
            checkpoint_sha256: ckpt.weights_sha256.clone(),
            optimizer_then,
            optimizer_now,
            optimizer_state: choice.name().into(),
            schedule: spec.schedule.name().into(),
            rewarm,
            carried: carried.clone(),
        }),
        ab: spec.ab.map(|(name, _)| name.to_string()),
        arm: spec.ab.map(|(_, arm)| arm.to_string()),
        ..fresh_manifest(&cfg, spec.registry, &config_dir, &cache, &components)?
    };
    let resolved = manifest.config_toml.clone().expect("a fresh manifest holds its config");
    let ckpt_config_json = ckpt.config_json.clone();

    // The fork's folder, with the checkpoint it starts from as its own first one (written before
    // the folder appears): killed at any moment, the fork resumes from there at the latest. It is
    // made once everything was checked: the data read (and its position in it taken), the
    // optimizer state loaded; a refused fork leaves no folder.
    let first_weights = ckpt.weights.clone();
    let first_optimizer = optimizer_state.clone();
    let first_state = state.clone();
    let keep = t.keep_checkpoints;
    let said = format!(
        "(optimizer {} -> {}, state {}, schedule {}, re-warm {rewarm} steps)",
        manifest.parent.as_ref().map_or("", |p| p.optimizer_then.as_str()),
        manifest.parent.as_ref().map_or("", |p| p.optimizer_now.as_str()),
        choice.name(),
        spec.schedule.name()
    );
    let carried_said = carried.as_ref().map(|c| {
        format!(
            "carried the optimizer state {} -> {}: {}",
            manifest.parent.as_ref().map_or("", |p| p.optimizer_then.as_str()),
            manifest.parent.as_ref().map_or("", |p| p.optimizer_now.as_str()),
            c.summary()
        )
    });
    let folder = if writes {
        let exp_dir = exp_dir.clone();
        train::RunFolder::New(Box::new(move || {
            let first = checkpoint::CheckpointData {
                weights: &first_weights,
                drafter_config_json: &ckpt_config_json,
                optimizer_state: &first_optimizer,
                trainer_state: &first_state,
            };
            let fill = |tmp: &Path| checkpoint::write(tmp, at, &first, keep).map(|_| ());
            let exp = match numbered {
                Some((root, name)) => Experiment::create_numbered(&root, &name, &resolved, &manifest, fill)?,
                None => Experiment::create_with(&exp_dir, &resolved, &manifest, fill)?,
            };
            tracing::info!("forked {} at step {at} into {} {said}", parent.display(), exp.dir.display());
            if let Some(c) = carried_said {
                tracing::info!("{c}");
            }
            Ok(exp)
        }))
    } else {
        train::RunFolder::Open(Experiment::detached(&exp_dir))
    };
    let Some((comm, components)) = connect(&cfg, components, &exp_dir)? else { return Ok(served(&exp_dir)) };
    let from = ResumeFrom { state, weights: ckpt.weights, optimizer_state, checkpoint: ckpt.dir.display().to_string() };
    train::train(
        &cfg,
        components,
        folder,
        &cache,
        train::TrainOptions { resume: Some(from), stop_at: spec.stop_at, comm },
    )
}
