//! One training run from a config: build the plugins, open the experiment directory, train.
//! Used by `dflash-host train` and by each arm of `dflash-host ab`; `resume` continues one,
//! after checking that nothing it was started with has changed.

use crate::{
    config::{self, RunConfig},
    dist,
    experiment::{
        self, checkpoint,
        manifest::{self, ChangeRecord, Drift, DriftKind},
        Experiment, ExperimentLock, Manifest,
    },
    pipeline::components::{build_components, Components},
    plugins::{PluginRecord, Registry},
    train::{self, TrainSummary, TrainerState},
};
use anyhow::{bail, Context, Result};
use plugin_api::PluginKind;
use std::path::{Path, PathBuf};

pub fn cache_dir() -> PathBuf {
    std::env::var_os("DFLASH_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/dflash"))
}

/// The git revision the binary was built from (host/build.rs), not the one of the folder it
/// runs in.
pub fn git_revision() -> &'static str {
    option_env!("DFLASH_GIT_REVISION").unwrap_or("unknown")
}

/// libtorch_cuda.so is dropped by `--as-needed`; load it before the first CUDA op.
pub fn enable_cuda() -> bool {
    kernels::load_libtorch_cuda().map_err(|e| tracing::warn!("CUDA unavailable: {e}")).is_ok()
}

/// Load CUDA when the config asks for it, or say why it cannot run.
fn ensure_device(cfg: &RunConfig) -> Result<()> {
    let devices = cfg.target_devices();
    let cuda = devices.iter().map(String::as_str).chain([cfg.drafter_device()]).find(|d| d.starts_with("cuda"));
    if let Some(d) = cuda {
        if !enable_cuda() {
            anyhow::bail!("device `{d}` asked for, but libtorch's CUDA libraries could not be loaded");
        }
    }
    Ok(())
}

/// `--stop-at N` must lie ahead of the step the run is at.
pub fn check_stop_at(stop_at: Option<u64>, at: u64) -> Result<()> {
    match stop_at {
        Some(n) if n <= at => bail!("--stop-at {n}: the run is at step {at} already; give a later step"),
        _ => Ok(()),
    }
}

/// This process is a data-parallel rank other than 0 (which owns the experiment folder).
fn follower_rank() -> Result<bool> {
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
        crate::preflight::check_exp_dir(exp_dir)?; // before the target loads
    }
    let components = build(cfg, config_path, &config_dir, registry)?;
    let spec = components.target.spec();
    let gamma = crate::train::loss::resolve_gamma(cfg.train.loss_gamma, components.drafter.block_size() as usize);
    components.check_poisoned()?;
    let resolved = toml::to_string(cfg)?;
    let target_source = PathBuf::from(spec.source.as_str());
    let known = |p: &Path| same_file(p, &target_source).then(|| spec.source_sha256.to_string());
    let inputs = manifest::hash_inputs(cfg, &config_dir, &cache, &known, &|_| false)?;
    let manifest = Manifest {
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
        target_hub: manifest::target_hub(cfg, &config_dir, &cache),
        config_dir: config_dir.display().to_string(),
        loss_gamma: gamma.map_or_else(|| "none".into(), Into::into),
        config_sha256: Some(manifest::sha256_hex(resolved.as_bytes())),
        config_toml: Some(resolved.clone()),
        inputs,
        changes: Vec::new(),
        ab: ab.map(|(name, _)| name.to_string()),
        arm: ab.map(|(_, arm)| arm.to_string()),
    };
    let mut exp = if follower_rank()? {
        Experiment::detached(exp_dir)
    } else {
        Experiment::create(exp_dir, &resolved, &manifest)?
    };
    let comm = connect(cfg, &components.records, exp_dir)?;
    tracing::info!("experiment: {}", exp_dir.display());
    train::train(cfg, components, &mut exp, &cache, train::TrainOptions { resume: None, stop_at, comm })
}

fn same_file(a: &Path, b: &Path) -> bool {
    a == b || a.canonicalize().ok().is_some_and(|a| b.canonicalize().is_ok_and(|b| a == b))
}

/// The data-parallel communicator when a launcher started several ranks (RANK, WORLD_SIZE, ...):
/// c10d on the drafter's device (Gloo on the CPU, NCCL on a GPU), after the ranks checked that
/// they run the same build with the same config.
fn connect(cfg: &RunConfig, records: &[PluginRecord], exp_dir: &Path) -> Result<Option<Box<dyn dist::Communicator>>> {
    let Some(env) = dist::DistEnv::from_env()? else { return Ok(None) };
    let device = config::parse_device(cfg.drafter_device())?;
    let identity = identity(cfg, records, exp_dir)?;
    Ok(Some(Box::new(dist::C10dCommunicator::connect(&env, device, &identity)?)))
}

/// What ranks compare at the rendezvous: the resolved config without its device placement (each
/// rank's own, see `place_rank`), and this binary plus the plugin libraries; the experiment folder
/// names the run when the launcher gives no run token.
fn identity(cfg: &RunConfig, records: &[PluginRecord], exp_dir: &Path) -> Result<dist::Identity> {
    use sha2::{Digest, Sha256};
    let mut table = toml::Table::try_from(cfg)?;
    table.remove("device");
    if let Some(toml::Value::Table(p)) = table.get_mut("pipeline") {
        p.remove("targets");
        p.remove("drafter");
    }
    let short = |h: Sha256| h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect::<String>();
    let exe = std::env::current_exe().context("this binary's path")?;
    let mut build = Sha256::new_with_prefix(std::fs::read(&exe).with_context(|| format!("reading {}", exe.display()))?);
    for r in records {
        build.update(format!("{} {} {} {:?}\n", r.kind, r.name, r.origin, r.sha256));
    }
    Ok(dist::Identity::new(toml::to_string(&table)?, short(build), exp_dir.display().to_string()))
}

/// This rank's devices when a launcher put several ranks on one machine: the config's CUDA
/// devices offset by `LOCAL_RANK` x the GPUs one replica uses (`dist::rank_devices`).
fn place_rank(cfg: &RunConfig) -> Result<RunConfig> {
    let mut cfg = cfg.clone();
    let Some(env) = dist::DistEnv::from_env()? else { return Ok(cfg) };
    let mut all = vec![cfg.device.clone()];
    all.extend(cfg.pipeline.targets.iter().cloned());
    all.extend(cfg.pipeline.drafter.iter().cloned());
    if env.local_rank == 0 || !all.iter().any(|d| d.starts_with("cuda")) {
        return Ok(cfg);
    }
    let visible = if enable_cuda() { tch::Cuda::device_count() as usize } else { 0 };
    let moved = dist::rank_devices(&all, env.local_rank, visible)?;
    let n = cfg.pipeline.targets.len();
    cfg.device = moved[0].clone();
    cfg.pipeline.targets = moved[1..1 + n].to_vec();
    cfg.pipeline.drafter = moved.get(1 + n).cloned();
    tracing::info!("local rank {}: devices {:?}", env.local_rank, &moved);
    Ok(cfg)
}

/// The run's components; plugin config errors point at the config line (or `--set` argument)
/// that set the field. Everything that can be checked without the target is, first.
fn build(cfg: &RunConfig, config_path: &Path, config_dir: &Path, registry: &Registry) -> Result<Components> {
    let ctx = manifest::plugin_context(cfg, config_dir, &cache_dir());
    crate::preflight::check(cfg, config_path, &ctx, registry)?;
    ensure_device(cfg)?;
    tch::manual_seed(cfg.seed as i64);
    build_components(cfg, registry, config_dir, &cache_dir())
        .map_err(|e| crate::preflight::locate(cfg, config_path, format!("{e:#}")))
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
    let cfg_path = exp_dir.join(experiment::CONFIG);
    let cfg = RunConfig::load_with(&cfg_path, &opts.overrides)?;
    let mut manifest = Manifest::read(exp_dir)?;
    let config_dir = PathBuf::from(&manifest.config_dir);
    let cache = cache_dir();
    let resolved = toml::to_string(&cfg)?;

    // 1. Config and input files, before anything is built.
    let mut drifts = match &manifest.config_toml {
        Some(then) => manifest::config_drift(then, &resolved),
        None => {
            tracing::warn!(
                "{}: the manifest predates config records; config changes cannot be checked",
                exp_dir.display()
            );
            Vec::new()
        }
    };
    let target_source = PathBuf::from(&manifest.target_source);
    let is_target = |p: &Path| same_file(p, &target_source);
    let inputs_now = manifest::hash_inputs(&cfg, &config_dir, &cache, &|_| None, &is_target)?;
    drifts.extend(manifest::input_drift(&manifest.inputs, &inputs_now));
    // `--steps N` (or `--set train.steps=N`) extends the run: that change needs no --allow-change.
    let extend = opts.overrides.iter().rev().find(|o| o.fields().iter().any(|f| f == "train.steps"));
    let (extended, drifts): (Vec<Drift>, Vec<Drift>) =
        drifts.into_iter().partition(|d| extend.is_some() && d.what == DriftKind::Config && d.field == "train.steps");
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

    // 2. Plugins: what each section picks now against what the run used (no library loaded yet).
    let picked: Vec<PluginRecord> =
        [PluginKind::Target, PluginKind::Drafter, PluginKind::Optimizer, PluginKind::DataLoader]
            .into_iter()
            .map(|k| {
                Ok(registry
                    .find(k, &cfg.section(k.as_str()).plugin)
                    .map_err(|e| anyhow::anyhow!("[{k}] {e}"))?
                    .record
                    .clone())
            })
            .collect::<Result<_>>()?;
    let plugin_changes = check_plugins(&manifest.plugins, &picked, opts.allow_plugin_change)?;

    // 3. Where it resumes, and whether there is anything left to do.
    let (good, _corrupt) = checkpoint::newest_usable(exp_dir, true);
    let state: Option<TrainerState> = match &good {
        Some(c) => Some(
            serde_json::from_value(c.trainer_state.clone())
                .with_context(|| format!("{}: not valid", c.dir.join("trainer_state.json").display()))?,
        ),
        None => {
            tracing::warn!("{}: no usable checkpoint; starting from step 0", exp_dir.display());
            None
        }
    };
    let at = state.as_ref().map_or(0, |s| s.step);
    if at >= cfg.train.steps {
        bail!(
            "nothing to do: the run is at step {at} of {}; extend it with `train --resume {} --steps N` (N > {at})",
            cfg.train.steps,
            exp_dir.display()
        );
    }
    check_stop_at(opts.stop_at, at)?;

    // 4. The plugins (on this rank's devices), then what only they know: the target's weights,
    // the drafter's shape.
    let cfg = place_rank(&cfg)?;
    let components = build(&cfg, &cfg_path, &config_dir, registry)?;
    let spec = components.target.spec();
    if spec.source_sha256.as_str() != manifest.target_sha256 {
        let field = manifest
            .inputs
            .iter()
            .find(|i| is_target(Path::new(&i.path)))
            .map_or("target".to_string(), |i| i.field.clone());
        let sha = |s: &str| format!("SHA-256 {}", &s[..16.min(s.len())]);
        let drift = Drift {
            field,
            then: format!("{} ({})", manifest.target_source, sha(&manifest.target_sha256)),
            now: format!("{} ({})", spec.source, sha(&spec.source_sha256)),
            what: DriftKind::Input,
        };
        allowed.extend(manifest::refuse_drift(exp_dir, vec![drift], &opts.allow_change)?);
    }
    if let Some(s) = &state {
        let positions = components.drafter.block_size().saturating_sub(1) as usize;
        if s.window.positions() != positions {
            bail!(
                "cannot resume {}: its checkpoint has statistics for {} block positions, the drafter now has {positions} \
                 (block_size changed); start a new run instead",
                exp_dir.display(),
                s.window.positions()
            );
        }
    }
    let from = match good {
        Some(c) => Some(resume_from(c, state.expect("read with the checkpoint"), &components)?),
        None => None,
    };

    // 5. Every check passed: now change the folder.
    let mut exp = match lock {
        None => Experiment::detached(exp_dir),
        Some(lock) => {
            checkpoint::set_aside_after(exp_dir, at)?;
            if !opts.overrides.is_empty() {
                // The command line changed the config: the experiment's config.toml says what runs.
                experiment::write_atomic(&cfg_path, resolved.as_bytes())?;
            }
            if !allowed.is_empty() || !plugin_changes.is_empty() || manifest.config_toml.is_none() {
                for d in &allowed {
                    manifest.changes.push(ChangeRecord {
                        at_step: at,
                        field: d.field.clone(),
                        then: d.then.clone(),
                        now: d.now.clone(),
                    });
                }
                for (kind, then, now) in &plugin_changes {
                    manifest.changes.push(ChangeRecord {
                        at_step: at,
                        field: format!("plugins.{kind}"),
                        then: then.clone(),
                        now: now.clone(),
                    });
                }
                manifest.plugins = picked.clone();
                manifest.config_sha256 = Some(manifest::sha256_hex(resolved.as_bytes()));
                manifest.config_toml = Some(resolved.clone());
                let known = |p: &Path| is_target(p).then(|| spec.source_sha256.to_string());
                manifest.inputs = manifest::hash_inputs(&cfg, &config_dir, &cache, &known, &|_| false)?;
                manifest.target_sha256 = spec.source_sha256.to_string();
                manifest.target_source = spec.source.to_string();
                manifest.target_hub = manifest::target_hub(&cfg, &config_dir, &cache);
                manifest.write(exp_dir)?;
            }
            Experiment::reopen(exp_dir, lock, at)?
        }
    };
    let comm = connect(&cfg, &components.records, exp_dir)?;
    train::train(&cfg, components, &mut exp, &cache, train::TrainOptions { resume: from, stop_at: opts.stop_at, comm })
}

/// What a resume starts from: the opened checkpoint, its weights checked against what the
/// drafter declares.
fn resume_from(c: checkpoint::Opened, state: TrainerState, components: &Components) -> Result<train::ResumeFrom> {
    let declared = checkpoint::declared_by(&components.drafter.parameters());
    checkpoint::check_declared(&c.weights_file(), &c.weights, &declared)?;
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

/// `dflash-host capture`: the config's targets over its data, features written to `out`.
pub fn capture(
    cfg: &RunConfig,
    config_path: &Path,
    out: &Path,
    registry: &Registry,
    opts: &crate::pipeline::capture::CaptureOptions,
) -> Result<crate::pipeline::capture::CaptureIndex> {
    experiment::guard::check_out_folder("--out", out)?;
    let config_dir = config::config_dir(config_path).canonicalize().context("config folder")?;
    let components = build(cfg, config_path, &config_dir, registry)?;
    crate::pipeline::capture::capture(cfg, components, out, &cache_dir(), opts)
}

/// Self-distil the config's data and write it as chat JSONL (`dflash-host distill --out`): what
/// was generated, and what was written and left out.
pub fn distill(
    cfg: &RunConfig,
    config_path: &Path,
    out: &Path,
    registry: &Registry,
) -> Result<(plugin_api::DistilledExport, crate::pipeline::distill::DistillStats)> {
    experiment::guard::check_out_file("--out", out)?;
    let config_dir = config::config_dir(config_path).canonicalize().context("config folder")?;
    let mut c = build(cfg, config_path, &config_dir, registry)?;
    let Some(stats) = crate::pipeline::distill::prepare_data(&mut c, &cache_dir())? else {
        anyhow::bail!(
            "{}: the data loader regenerates no replies (in [data], distill = false?)",
            config_path.display()
        );
    };
    // Written beside `out`, then renamed into place; a `.gz` name stays last (the loader gzips it).
    let name = out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = out.with_file_name(match name.strip_suffix(".gz") {
        Some(stem) => format!("{stem}.partial.gz"),
        None => format!("{name}.partial"),
    });
    let written = c.data.export_distilled_summary(tmp.display().to_string().as_str().into()).into_result();
    let written = written.map_err(c.err(plugin_api::PluginKind::DataLoader, "export_distilled"))?;
    std::fs::rename(&tmp, out).with_context(|| format!("writing {}", out.display()))?;
    Ok((written, stats))
}

/// Where an evaluated drafter's weights come from: a checkpoint already opened (found once, so
/// a training run pruning it meanwhile cannot take it away), or a z-lab folder.
pub enum DrafterFrom<'a> {
    Checkpoint(checkpoint::Opened),
    Folder(&'a Path),
}

/// Rebuild a finished experiment's plugins (eval): its resolved config, with the drafter from a
/// checkpoint (its weights checked against what the drafter declares) or from a z-lab folder.
pub fn load_experiment(exp_dir: &Path, registry: &Registry, drafter: DrafterFrom) -> Result<(RunConfig, Components)> {
    let cfg_path = exp_dir.join(experiment::CONFIG);
    let mut cfg = RunConfig::load(&cfg_path)?;
    let manifest = Manifest::read(exp_dir)?;
    let config_dir = PathBuf::from(&manifest.config_dir);
    if let DrafterFrom::Folder(d) = drafter {
        let abs = d.canonicalize().with_context(|| format!("{}", d.display()))?;
        let mut t = toml::Table::new();
        t.insert("plugin".into(), "dflash".into());
        t.insert("init_from".into(), abs.display().to_string().into());
        cfg.drafter = t;
    }
    ensure_device(&cfg)?;
    let mut c = build_components(&cfg, registry, &config_dir, &cache_dir())?;
    if let DrafterFrom::Checkpoint(ckpt) = drafter {
        let declared = checkpoint::declared_by(&c.drafter.parameters());
        checkpoint::check_declared(&ckpt.weights_file(), &ckpt.weights, &declared)?;
        c.drafter
            .load_weights(ckpt.weights.into())
            .into_result()
            .map_err(c.err(PluginKind::Drafter, "load_weights"))?;
        tracing::info!("drafter weights from {}", ckpt.dir.display());
    }
    Ok((cfg, c))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `run.toml` in `dir` with a random tiny target (`tiny.json`, no weights to download) unless
    /// `target` says otherwise, and `data` as the dataset.
    fn write_config(dir: &Path, target: &str, data: &str) -> PathBuf {
        let tiny = r#"{"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 2, "vocab_size": 32, "eos_token_id": 1}"#;
        std::fs::write(dir.join("tiny.json"), tiny).unwrap();
        let text = format!(
            "name = \"t\"\n[train]\nsteps = 1\n\n[target]\nplugin = \"hf\"\n{target}\n\n[drafter]\nplugin = \"dflash\"\n\
             num_hidden_layers = 1\nblock_size = 4\nnum_target_features = 1\nmask_token_id = 0\n\n\
             [optimizer]\nplugin = \"adamw\"\nlr = 1e-3\n\n[data]\nplugin = \"chat\"\nformat = \"jsonl\"\n{data}\n"
        );
        let path = dir.join("run.toml");
        std::fs::write(&path, text).unwrap();
        path
    }

    fn build_error(path: &Path) -> String {
        let cfg = RunConfig::load(path).unwrap();
        let registry = Registry::new(&[]).unwrap();
        let dir = config::config_dir(path);
        match build(&cfg, path, &dir, &registry) {
            Ok(_) => panic!("{} built", path.display()),
            Err(e) => format!("{e:#}"),
        }
    }

    #[test]
    fn a_missing_model_or_data_file_names_the_config_line_and_field() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = write_config(dir.path(), "path = \"nope.gguf\"", "path = \"chat.jsonl\"");
        let err = build_error(&cfg);
        let want = format!(
            "run.toml:7: [target] plugin `hf`: field `path`: {}: no such file",
            dir.path().join("nope.gguf").display()
        );
        assert!(err.contains(&want), "{err}\nshould contain\n{want}");

        let cfg = write_config(dir.path(), "path = \"tiny.json\"\nrandom_init = true", "path = \"nope.jsonl\"");
        let err = build_error(&cfg);
        // Found before the target loads (preflight), not by the data plugin after it.
        let want = format!(
            "run.toml:24: [data] plugin `chat`: field `path`: {}: no such file or folder",
            dir.path().join("nope.jsonl").display()
        );
        assert!(err.contains(&want), "{err}\nshould contain\n{want}");
    }

    #[test]
    fn a_device_or_fifo_where_a_file_belongs_is_refused_before_a_plugin_opens_it() {
        let dir = tempfile::tempdir().unwrap();
        // Was "no such file" from the target plugin.
        let cfg = write_config(dir.path(), "path = \"/dev/zero\"", "path = \"chat.jsonl\"");
        let err = build_error(&cfg);
        assert!(
            err.ends_with(
                "run.toml:7: [target] plugin `hf`: field `path`: /dev/zero: not a regular file (a character device)"
            ),
            "{err}"
        );
        // Blocked forever in the data plugin's read.
        let fifo = dir.path().join("chat.fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let cfg = write_config(dir.path(), "path = \"tiny.json\"\nrandom_init = true", "path = \"chat.fifo\"");
        let err = build_error(&cfg);
        let want =
            format!("run.toml:24: [data] plugin `chat`: field `path`: {}: not a regular file (a FIFO)", fifo.display());
        assert!(err.ends_with(&want), "{err}\nshould end with\n{want}");
    }
}
