//! One training run from a config: build the plugins, open the experiment directory, train.
//! Used by `dflash-host train` and by each arm of `dflash-host ab`; `resume` continues one,
//! after checking that nothing it was started with has changed.

use crate::{
    config::{self, RunConfig},
    dist,
    environment::{cache_dir, git_revision},
    experiment::{
        self, checkpoint,
        manifest::{self, ChangeRecord, Drift, DriftKind},
        Experiment, ExperimentLock, Manifest,
    },
    pipeline::{
        assemble::build,
        components::Components,
        ranks::{identity, place_rank},
        replicas,
    },
    plugins::{PluginRecord, Registry},
    train::{self, RunFolder, TrainSummary, TrainerState},
};
use anyhow::{bail, Context, Result};
use plugin_api::{PluginKind, TargetSpec};
use std::path::{Path, PathBuf};

/// `--stop-at N` must lie ahead of the step the run is at.
pub fn check_stop_at(stop_at: Option<u64>, at: u64) -> Result<()> {
    match stop_at {
        Some(n) if n <= at => bail!("--stop-at {n}: the run is at step {at} already; give a later step"),
        _ => Ok(()),
    }
}

/// This process is a data-parallel rank other than 0 (which owns the experiment folder).
pub(super) fn follower_rank() -> Result<bool> {
    Ok(crate::dist::DistEnv::from_env()?.is_some_and(|e| e.rank > 0))
}

/// What a run needs besides its config.
pub struct RunSpec<'a> {
    pub cfg: &'a RunConfig,
    /// The config file (errors point into it; relative paths resolve from its folder).
    pub config_path: &'a Path,
    pub exp_dir: &'a Path,
    pub registry: &'a Registry,
    pub ab: Option<(&'a str, &'a str)>,
    /// Stop with a checkpoint after this step (`train --stop-at`).
    pub stop_at: Option<u64>,
}

pub fn run(spec: RunSpec) -> Result<TrainSummary> {
    let RunSpec { cfg, config_path, exp_dir, registry, ab, stop_at } = spec;
    let cfg = &place_rank(cfg)?;
    check_stop_at(stop_at, 0)?;
    let cache = cache_dir();
    let config_dir = config::config_dir(config_path).canonicalize().context("config folder")?;
    if !follower_rank()? {
        crate::config::preflight::check_exp_dir(exp_dir)?; // before the target loads
    }
    if let Some(follower) = replicas::follower(cfg)? {
        replicas::serve(cfg, config_path, &config_dir, registry, exp_dir, follower)?;
        return Ok(served(exp_dir));
    }
    let components = build(cfg, config_path, &config_dir, registry)?;
    let manifest = fresh_manifest(cfg, registry, &config_dir, &cache, &components)?;
    let manifest =
        Manifest { ab: ab.map(|(name, _)| name.to_string()), arm: ab.map(|(_, arm)| arm.to_string()), ..manifest };
    let resolved = manifest.config_toml.clone().expect("a fresh manifest holds its config");
    // The folder appears once the data is read and every split rendered (a refused run leaves
    // none behind, so its rerun starts anew).
    let folder = if follower_rank()? {
        RunFolder::Open(Experiment::detached(exp_dir))
    } else {
        RunFolder::New(Box::new(move || {
            let exp = Experiment::create(exp_dir, &resolved, &manifest)?;
            tracing::info!("experiment: {}", exp_dir.display());
            Ok(exp)
        }))
    };
    let Some((comm, components)) = connect(cfg, components, exp_dir)? else { return Ok(served(exp_dir)) };
    train::train(cfg, components, folder, &cache, train::TrainOptions { resume: None, stop_at, comm })
}

/// The manifest of a run starting now under `cfg` with `components`: versions, plugins, the
/// target's source and hash, the resolved config and every input file's hash.
pub(super) fn fresh_manifest(
    cfg: &RunConfig,
    registry: &Registry,
    config_dir: &Path,
    cache: &Path,
    components: &Components,
) -> Result<Manifest> {
    let spec = components.target.spec()?;
    let gamma = crate::train::loss::resolve_gamma(cfg.train.loss_gamma, components.drafter.block_size()? as usize);
    let resolved = toml::to_string(cfg)?;
    let target_source = PathBuf::from(spec.source.as_str());
    let known = |p: &Path| same_file(p, &target_source).then(|| spec.source_sha256.to_string());
    Ok(Manifest {
        host_version: env!("CARGO_PKG_VERSION").into(),
        git_revision: git_revision().into(),
        command_line: std::env::args().collect(),
        started_at_unix: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs(),
        seed: cfg.seed,
        device: cfg.device.clone(),
        dtype: cfg.dtype().into(),
        build_id: plugin_api::build_id(),
        plugins: components.records.clone(),
        target_source: spec.source.to_string(),
        target_sha256: spec.source_sha256.to_string(),
        target_hub: manifest::target_hub(cfg, registry, config_dir, cache),
        config_dir: config_dir.display().to_string(),
        loss_gamma: gamma.map_or_else(|| "none".into(), Into::into),
        config_sha256: Some(manifest::sha256_hex(resolved.as_bytes())),
        config_toml: Some(resolved),
        inputs: manifest::hash_inputs(cfg, registry, config_dir, cache, &known, &|_| false)?,
        changes: Vec::new(),
        ab: None,
        arm: None,
        parent: None,
        mask_token: components.mask_token.clone(),
    })
}

pub(super) fn same_file(a: &Path, b: &Path) -> bool {
    a == b || a.canonicalize().ok().is_some_and(|a| b.canonicalize().is_ok_and(|b| a == b))
}

/// The data-parallel communicator when a launcher started several ranks (RANK, WORLD_SIZE, ...):
/// c10d on the drafter's device (Gloo on the CPU, NCCL on a GPU), after the ranks checked that
/// they run the same build with the same config; and the components as this rank trains with
/// them. With target replicas of several ranks (`[target] tensor_parallel`), the replicas' leads
/// train (the communicator is theirs, the target posts its calls for the replica's other
/// ranks), and every other rank serves its replica's target until the lead stops: None then.
#[allow(clippy::type_complexity)]
pub(super) fn connect(
    cfg: &RunConfig,
    components: Components,
    exp_dir: &Path,
) -> Result<Option<(Option<Box<dyn dist::Communicator>>, Components)>> {
    let Some(env) = dist::DistEnv::from_env()? else { return Ok(Some((None, components))) };
    let device = config::parse_device(cfg.drafter_device())?;
    let identity = identity(cfg, &components.records, exp_dir)?;
    let Some(layout) = dist::replica::Layout::of(&cfg.target, Some(&env))? else {
        return Ok(Some((
            Some(Box::new(dist::group::C10dCommunicator::connect(&env, device, &identity)?)),
            components,
        )));
    };
    let (comm, store) = dist::group::C10dCommunicator::connect_replicas(&env, device, &identity, &layout)?;
    let Some(comm) = comm else {
        let mut target = components.target;
        let calls = dist::replica::serve(&mut target, &layout, store, &dist::group::lead_beat_key(layout.index))?;
        tracing::info!("rank {}: served {calls} target calls of replica {}", env.rank, layout.index);
        return Ok(None);
    };
    let Components { target, extra_targets, drafter, optimizer, data, records, numerics, mask_token } = components;
    let target = dist::replica::lead(target, &layout, store);
    let components = Components { target, extra_targets, drafter, optimizer, data, records, numerics, mask_token };
    Ok(Some((Some(Box::new(comm)), components)))
}

/// What a rank that only served its replica's target reports.
pub(super) fn served(exp_dir: &Path) -> TrainSummary {
    TrainSummary {
        experiment: exp_dir.display().to_string(),
        steps: 0,
        tokens: 0,
        wall_s: 0.0,
        first: None,
        last: None,
        last_checkpoint: None,
        interrupted: None,
        stopped_at: None,
        distill: None,
    }
}

/// How to resume: the libraries given with `--plugin`, and what may have changed.
#[derive(Default)]
pub struct ResumeOptions {
    pub plugin_paths: Vec<PathBuf>,
    pub allow_plugin_change: bool,
    /// `--allow-change FIELD`: config fields (or sections) and input files that may differ.
    pub allow_change: Vec<String>,
    pub stop_at: Option<u64>,
    /// `--steps N` / `--set` / `--device`, applied to the experiment's config: `train.steps`
    /// may change (extending the run), any other field only as `allow_change` allows.
    pub overrides: Vec<config::Override>,
}

/// `train --resume DIR`: lock the experiment, then refuse any library the run did not start with
/// before its code runs (unless `--allow-plugin-change`), then [`resume_with`].
pub fn resume(exp_dir: &Path, opts: &ResumeOptions) -> Result<TrainSummary> {
    let (lock, manifest) = open_for_resume(exp_dir)?;
    let registry = Registry::with_gate(&opts.plugin_paths, |path, sha| {
        let known = manifest.plugins.iter().any(|p| p.sha256.as_deref() == Some(sha));
        if known {
            return Ok(());
        }
        let what =
            format!("the plugin library {} (SHA-256 {}) is not one the run started with", path.display(), &sha[..16]);
        if !opts.allow_plugin_change {
            bail!("cannot resume {}: {what}; pass --allow-plugin-change to resume anyway", exp_dir.display());
        }
        tracing::warn!("resuming although {what} (--allow-plugin-change)");
        Ok(())
    })?;
    resume_with(exp_dir, lock, &registry, opts)
}

/// Lock an experiment for resuming (rank 0; other ranks take no lock) and read its manifest.
fn open_for_resume(exp_dir: &Path) -> Result<(Option<ExperimentLock>, Manifest)> {
    if !exp_dir.join(experiment::CONFIG).is_file() {
        bail!("{}: not an experiment directory (no config.toml)", exp_dir.display());
    }
    let lock = if follower_rank()? { None } else { Some(ExperimentLock::acquire(exp_dir)?) };
    Ok((lock, Manifest::read(exp_dir)?))
}

/// Continue an experiment from its newest good checkpoint (or from the start if it has none).
/// Every check comes first and a refused resume changes nothing: the config (field by field),
/// the input files, the plugins and the target's weights must be those the run started with
/// (unless `--allow-change` / `--allow-plugin-change`), and there must be steps left. Then the
/// checkpoints after the one resumed from are set aside, metrics and events after it dropped.
pub fn resume_with(
    exp_dir: &Path,
    lock: Option<ExperimentLock>,
    registry: &Registry,
    opts: &ResumeOptions,
) -> Result<TrainSummary> {
    let lock = match lock {
        Some(l) => Some(l),
        None if follower_rank()? => None,
        None => Some(ExperimentLock::acquire(exp_dir)?),
    };
    // 1. Read the checkpoint's run: its config now, what its manifest recorded.
    let mut run = Resuming::read(exp_dir, opts)?;

    // 2. Check compatibility before anything is built: the config and input files, the plugins
    // each section picks now (no library loaded yet), where it resumes and what is left to do.
    let mut allowed = run.config_changes(registry, opts)?;
    let picked = picked_plugins(&run.cfg, registry)?;
    let plugin_changes = check_plugins(&run.manifest.plugins, &picked, opts.allow_plugin_change)?;
    let (good, state) = run.resume_point()?;
    let at = state.as_ref().map_or(0, |s| s.step);
    if at >= run.cfg.train.steps {
        bail!(
            "nothing to do: the run is at step {at} of {}; extend it with `train --resume {} --steps N` (N > {at})",
            run.cfg.train.steps,
            exp_dir.display()
        );
    }
    check_stop_at(opts.stop_at, at)?;

    // 3. The plugins (on this rank's devices), then what only they know: the target's weights,
    // the drafter's shape.
    let cfg = place_rank(&run.cfg)?;
    if let Some(follower) = replicas::follower(&cfg)? {
        replicas::serve(&cfg, &run.cfg_path, &run.config_dir, registry, exp_dir, follower)?;
        return Ok(served(exp_dir));
    }
    let components = build(&cfg, &run.cfg_path, &run.config_dir, registry)?;
    let target = components.target.spec()?;
    allowed.extend(run.target_change(&target, opts)?);
    let from = match (good, state) {
        (Some(c), Some(state)) => Some(run.resume_from(c, state, &components)?),
        _ => None,
    };

    // 4. Every check passed: now rebuild the folder's state.
    let exp = match lock {
        None => Experiment::detached(exp_dir),
        Some(lock) => {
            let changes = Changes { allowed, plugins: plugin_changes, picked };
            run.rewrite(lock, at, &cfg, registry, &target, changes, opts)?
        }
    };
    let Some((comm, components)) = connect(&cfg, components, exp_dir)? else { return Ok(served(exp_dir)) };
    let folder = RunFolder::Open(exp);
    train::train(
        &cfg,
        components,
        folder,
        &run.cache,
        train::TrainOptions { resume: from, stop_at: opts.stop_at, comm },
    )
}

/// What each plugin section picks now, by the record the registry has of it.
fn picked_plugins(cfg: &RunConfig, registry: &Registry) -> Result<Vec<PluginRecord>> {
    [PluginKind::Target, PluginKind::Drafter, PluginKind::Optimizer, PluginKind::DataLoader]
        .into_iter()
        .map(|k| {
            Ok(registry
                .find(k, &cfg.section(k.as_str()).plugin)
                .map_err(|e| anyhow::anyhow!("[{k}] {e}"))?
                .record
                .clone())
        })
        .collect()
}

/// An experiment being resumed, read once and handed to each phase.
struct Resuming<'a> {
    exp_dir: &'a Path,
    cfg_path: PathBuf,
    /// The experiment's config with the command line's overrides (before this rank's devices).
    cfg: RunConfig,
    /// `cfg` as TOML, what the manifest's config is compared with.
    resolved: String,
    manifest: Manifest,
    config_dir: PathBuf,
    cache: PathBuf,
    /// The target the run started with (the manifest's, as it was read).
    target_source: PathBuf,
}

/// What a resume let change: config fields and input files, plugins (kind, then, now), and the
/// plugins it runs with now.
struct Changes {
    allowed: Vec<Drift>,
    plugins: Vec<(String, String, String)>,
    picked: Vec<PluginRecord>,
}

impl<'a> Resuming<'a> {
    fn read(exp_dir: &'a Path, opts: &ResumeOptions) -> Result<Self> {
        let cfg_path = exp_dir.join(experiment::CONFIG);
        let cfg = RunConfig::load_with(&cfg_path, &opts.overrides)?;
        let manifest = Manifest::read(exp_dir)?;
        let config_dir = PathBuf::from(&manifest.config_dir);
        let resolved = toml::to_string(&cfg)?;
        let target_source = PathBuf::from(&manifest.target_source);
        Ok(Resuming { exp_dir, cfg_path, cfg, resolved, manifest, config_dir, cache: cache_dir(), target_source })
    }

    fn is_target(&self, p: &Path) -> bool {
        same_file(p, &self.target_source)
    }

    /// The config's fields and the input files against the run's record: the changes let through
    /// (`--allow-change`, and `train.steps` when the command line extends the run).
    fn config_changes(&self, registry: &Registry, opts: &ResumeOptions) -> Result<Vec<Drift>> {
        let exp_dir = self.exp_dir;
        let mut drifts = match &self.manifest.config_toml {
            Some(then) => manifest::config_drift(then, &self.resolved),
            None => {
                tracing::warn!(
                    "{}: the manifest predates config records; config changes cannot be checked",
                    exp_dir.display()
                );
                Vec::new()
            }
        };
        let is_target = |p: &Path| self.is_target(p);
        let inputs_now =
            manifest::hash_inputs(&self.cfg, registry, &self.config_dir, &self.cache, &|_| None, &is_target)?;
        drifts.extend(manifest::input_drift(&self.manifest.inputs, &inputs_now));
        // `--steps N` (or `--set train.steps=N`) extends the run: that change needs no --allow-change.
        let extend = opts.overrides.iter().rev().find(|o| o.fields().iter().any(|f| f == "train.steps"));
        let (extended, drifts): (Vec<Drift>, Vec<Drift>) = drifts
            .into_iter()
            .partition(|d| extend.is_some() && d.what == DriftKind::Config && d.field == "train.steps");
        let mut allowed = manifest::refuse_drift(exp_dir, drifts, &opts.allow_change)?;
        if let (Some(o), Some(d)) = (extend, extended.first()) {
            tracing::info!(
                "{}: train.steps {} -> {}; the learning-rate schedule now spans {} steps",
                o.arg,
                d.then,
                d.now,
                d.now
            );
        }
        allowed.extend(extended);
        Ok(allowed)
    }

    /// The newest usable checkpoint and its trainer state; none: from the start (never for a
    /// fork, which starts from its first checkpoint).
    fn resume_point(&self) -> Result<(Option<checkpoint::Opened>, Option<TrainerState>)> {
        let exp_dir = self.exp_dir;
        let (good, _corrupt) = checkpoint::newest_usable(exp_dir, true);
        let state = match &good {
            Some(c) => Some(trainer_state(c)?),
            None if self.manifest.parent.is_some() => bail!(
                "cannot resume {}: a fork starts from its first checkpoint, and none of its checkpoints is usable; \
                 fork its parent again",
                exp_dir.display()
            ),
            None => {
                tracing::warn!("{}: no usable checkpoint; starting from step 0", exp_dir.display());
                None
            }
        };
        Ok((good, state))
    }

    /// The target's weights against the run's record: the change let through, if any.
    fn target_change(&self, spec: &TargetSpec, opts: &ResumeOptions) -> Result<Vec<Drift>> {
        if spec.source_sha256.as_str() == self.manifest.target_sha256 {
            return Ok(Vec::new());
        }
        let field = self
            .manifest
            .inputs
            .iter()
            .find(|i| self.is_target(Path::new(&i.path)))
            .map_or("target".to_string(), |i| i.field.clone());
        let sha = |s: &str| format!("SHA-256 {}", &s[..16.min(s.len())]);
        let drift = Drift {
            field,
            then: format!("{} ({})", self.manifest.target_source, sha(&self.manifest.target_sha256)),
            now: format!("{} ({})", spec.source, sha(&spec.source_sha256)),
            what: DriftKind::Input,
        };
        manifest::refuse_drift(self.exp_dir, vec![drift], &opts.allow_change)
    }

    /// What the resume starts from: the drafter must take the checkpoint's block positions and
    /// its weights.
    fn resume_from(
        &self,
        c: checkpoint::Opened,
        state: TrainerState,
        components: &Components,
    ) -> Result<train::ResumeFrom> {
        let positions = components.drafter.block_size()?.saturating_sub(1) as usize;
        if state.window.positions() != positions {
            bail!(
                "cannot resume {}: its checkpoint has statistics for {} block positions, the drafter now has \
                 {positions} (block_size changed); start a new run instead",
                self.exp_dir.display(),
                state.window.positions()
            );
        }
        resume_from(c, state, components)
    }

    /// The folder brought to the step resumed from: later checkpoints set aside, the config the
    /// command line changed written, the manifest's record of the changes; then reopened.
    #[allow(clippy::too_many_arguments)]
    fn rewrite(
        &mut self,
        lock: ExperimentLock,
        at: u64,
        cfg: &RunConfig,
        registry: &Registry,
        spec: &TargetSpec,
        changes: Changes,
        opts: &ResumeOptions,
    ) -> Result<Experiment> {
        let exp_dir = self.exp_dir;
        checkpoint::set_aside_after(exp_dir, at)?;
        if !opts.overrides.is_empty() {
            // The command line changed the config: the experiment's config.toml says what runs.
            crate::atomic_write::write_atomic(&self.cfg_path, self.resolved.as_bytes())?;
        }
        let Changes { allowed, plugins, picked } = changes;
        if !allowed.is_empty() || !plugins.is_empty() || self.manifest.config_toml.is_none() {
            let target_source = self.target_source.clone();
            let manifest = &mut self.manifest;
            for d in &allowed {
                let (field, then, now) = (d.field.clone(), d.then.clone(), d.now.clone());
                manifest.changes.push(ChangeRecord { at_step: at, field, then, now });
            }
            for (kind, then, now) in &plugins {
                let (field, then, now) = (format!("plugins.{kind}"), then.clone(), now.clone());
                manifest.changes.push(ChangeRecord { at_step: at, field, then, now });
            }
            manifest.plugins = picked;
            manifest.config_sha256 = Some(manifest::sha256_hex(self.resolved.as_bytes()));
            manifest.config_toml = Some(self.resolved.clone());
            let known = |p: &Path| same_file(p, &target_source).then(|| spec.source_sha256.to_string());
            let (config_dir, cache) = (&self.config_dir, &self.cache);
            manifest.inputs = manifest::hash_inputs(cfg, registry, config_dir, cache, &known, &|_| false)?;
            manifest.target_sha256 = spec.source_sha256.to_string();
            manifest.target_source = spec.source.to_string();
            manifest.target_hub = manifest::target_hub(cfg, registry, config_dir, cache);
            manifest.write(exp_dir)?;
        }
        Experiment::reopen(exp_dir, lock, at)
    }
}

/// The trainer state a checkpoint holds.
pub(super) fn trainer_state(c: &checkpoint::Opened) -> Result<TrainerState> {
    serde_json::from_value(c.trainer_state.clone())
        .with_context(|| format!("{}: not valid", c.dir.join("trainer_state.json").display()))
}

/// What a resume starts from: the opened checkpoint, its weights checked against what the
/// drafter declares.
fn resume_from(c: checkpoint::Opened, state: TrainerState, components: &Components) -> Result<train::ResumeFrom> {
    c.check_weights_for(&components.drafter.parameters()?)?;
    Ok(train::ResumeFrom {
        state,
        weights: c.weights,
        optimizer_state: c.optimizer_state.expect("opened for a resume"),
        checkpoint: c.dir.display().to_string(),
    })
}

/// A resumed run must use the plugins the run started with: same kind, name, origin and file.
/// Returns the changes `allow_change` let through, as (kind, then, now).
pub fn check_plugins(
    recorded: &[PluginRecord],
    now: &[PluginRecord],
    allow_change: bool,
) -> Result<Vec<(String, String, String)>> {
    let mut changes = Vec::new();
    let sha = |s: &Option<String>| {
        s.as_deref().map_or("built-in".to_string(), |s| format!("SHA-256 {}", &s[..16.min(s.len())]))
    };
    for r in recorded {
        let Some(n) = now.iter().find(|n| n.kind == r.kind) else { continue };
        let changed = if n.name != r.name {
            Some(format!("the {} plugin was `{}`, now `{}`", r.kind, r.name, n.name))
        } else if n.sha256 != r.sha256 || n.origin != r.origin {
            Some(format!(
                "the {} plugin `{}` changed: {} ({}) then, {} ({}) now",
                r.kind,
                r.name,
                r.origin,
                sha(&r.sha256),
                n.origin,
                sha(&n.sha256)
            ))
        } else {
            None
        };
        if let Some(what) = changed {
            if !allow_change {
                anyhow::bail!("cannot resume: {what}; pass --allow-plugin-change to resume anyway");
            }
            tracing::warn!("resuming although {what} (--allow-plugin-change)");
            changes.push((
                r.kind.clone(),
                format!("{} {} ({})", r.name, r.origin, sha(&r.sha256)),
                format!("{} {} ({})", n.name, n.origin, sha(&n.sha256)),
            ));
        }
    }
    Ok(changes)
}
