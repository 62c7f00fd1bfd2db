//! One training run from a config: build the plugins, open the experiment directory, train.
//! Used by `dflash-host train` and by each arm of `dflash-host ab`.

use crate::{
    config::{self, RunConfig},
    dist,
    experiment::Experiment,
    plugins::{PluginRecord, Registry},
    pipeline::components::{build_components, Components},
    train::{self, TrainSummary},
};
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// `manifest.json`: what produced an experiment.
#[derive(Serialize, Deserialize)]
pub struct Manifest {
    pub host_version: String,
    pub git_revision: String,
    pub command_line: Vec<String>,
    pub started_at_unix: u64,
    pub seed: u64,
    pub device: String,
    pub dtype: String,
    pub build_id: String,
    pub plugins: Vec<PluginRecord>,
    pub target_source: String,
    pub target_sha256: String,
    /// The config file's folder: relative paths in config.toml resolve from it.
    pub config_dir: String,
    /// The loss's decay gamma the run trains with (the paper's default for the block size when
    /// the config leaves it out), or "none"; null in manifests written before it was recorded.
    #[serde(default)]
    pub loss_gamma: serde_json::Value,
    /// The A/B this run is an arm of, and which arm (absent for plain runs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ab: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arm: Option<String>,
}

pub fn cache_dir() -> PathBuf {
    std::env::var_os("DFLASH_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/dflash"))
}

fn git_revision() -> String {
    std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

/// libtorch_cuda.so is dropped by `--as-needed`; load it before the first CUDA op (STACK.md).
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
    let cache = cache_dir();
    let config_dir = config::config_dir(config_path).canonicalize().context("config folder")?;
    let components = build(cfg, config_path, &config_dir, registry)?;
    let spec = components.target.spec();
    let gamma = crate::train::loss::resolve_gamma(cfg.train.loss_gamma, components.drafter.block_size() as usize);
    let manifest = Manifest {
        host_version: env!("CARGO_PKG_VERSION").into(),
        git_revision: git_revision(),
        command_line: std::env::args().collect(),
        started_at_unix: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs(),
        seed: cfg.seed,
        device: cfg.device.clone(),
        dtype: cfg.dtype().into(),
        build_id: plugin_api::build_id(),
        plugins: components.records.clone(),
        target_source: spec.source.to_string(),
        target_sha256: spec.source_sha256.to_string(),
        config_dir: config_dir.display().to_string(),
        loss_gamma: gamma.map_or_else(|| "none".into(), Into::into),
        ab: ab.map(|(name, _)| name.to_string()),
        arm: ab.map(|(_, arm)| arm.to_string()),
    };
    let resolved = toml::to_string(cfg)?;
    let comm = connect(cfg, &components.records)?;
    let mut exp = match &comm {
        Some(c) if c.rank() > 0 => Experiment::detached(exp_dir),
        _ => Experiment::create(exp_dir, &resolved, &manifest)?,
    };
    tracing::info!("experiment: {}", exp_dir.display());
    train::train(cfg, components, &mut exp, &cache, train::TrainOptions { resume: None, stop_at, comm })
}

/// The data-parallel communicator when a launcher started several ranks (RANK, WORLD_SIZE, ...):
/// c10d on the drafter's device (Gloo on the CPU, NCCL on a GPU), after the ranks checked that
/// they run the same build with the same config.
fn connect(cfg: &RunConfig, records: &[PluginRecord]) -> Result<Option<Box<dyn dist::Communicator>>> {
    let Some(env) = dist::DistEnv::from_env()? else { return Ok(None) };
    let device = config::parse_device(cfg.drafter_device())?;
    let identity = identity(cfg, records)?;
    Ok(Some(Box::new(dist::C10dCommunicator::connect(&env, device, &identity)?)))
}

/// The hashes ranks compare at the rendezvous: the resolved config without its device placement
/// (each rank's own, see `place_rank`), and this binary plus the plugin libraries.
fn identity(cfg: &RunConfig, records: &[PluginRecord]) -> Result<dist::Identity> {
    use sha2::{Digest, Sha256};
    let mut table = toml::Table::try_from(cfg)?;
    table.remove("device");
    if let Some(toml::Value::Table(p)) = table.get_mut("pipeline") {
        p.remove("targets");
        p.remove("drafter");
    }
    let short = |h: Sha256| h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect::<String>();
    let config = short(Sha256::new_with_prefix(toml::to_string(&table)?));
    let exe = std::env::current_exe().context("this binary's path")?;
    let mut build = Sha256::new_with_prefix(std::fs::read(&exe).with_context(|| format!("reading {}", exe.display()))?);
    for r in records {
        build.update(format!("{} {} {} {:?}\n", r.kind, r.name, r.origin, r.sha256));
    }
    Ok(dist::Identity { config, build: short(build) })
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

/// The run's components; plugin config errors point at the config line that set the field.
fn build(cfg: &RunConfig, config_path: &Path, config_dir: &Path, registry: &Registry) -> Result<Components> {
    ensure_device(cfg)?;
    tch::manual_seed(cfg.seed as i64);
    build_components(cfg, registry, config_dir, &cache_dir()).map_err(|e| {
        let msg = format!("{e:#}");
        let text = std::fs::read_to_string(config_path).unwrap_or_default();
        match config::locate_plugin_error(&text, &msg) {
            Some(line) => anyhow::anyhow!("{}:{line}: {msg}", config_path.display()),
            None => anyhow::anyhow!("{}: {msg}", config_path.display()),
        }
    })
}

/// Continue an experiment from its newest good checkpoint (or from the start if it has none):
/// same config, same plugins (a changed plugin file is refused unless `allow_plugin_change`).
pub fn resume(exp_dir: &Path, registry: &Registry, allow_plugin_change: bool, stop_at: Option<u64>) -> Result<TrainSummary> {
    let cfg_path = exp_dir.join("config.toml");
    if !cfg_path.exists() {
        anyhow::bail!("{}: not an experiment directory (no config.toml)", exp_dir.display());
    }
    let cfg = place_rank(&RunConfig::load(&cfg_path)?)?;
    let manifest_path = exp_dir.join("manifest.json");
    let manifest: Manifest = serde_json::from_str(&std::fs::read_to_string(&manifest_path).with_context(|| format!("reading {}", manifest_path.display()))?)
        .with_context(|| format!("{}: not a manifest", manifest_path.display()))?;
    let config_dir = PathBuf::from(&manifest.config_dir);
    let components = build(&cfg, &cfg_path, &config_dir, registry)?;
    check_plugins(&manifest.plugins, &components.records, allow_plugin_change)?;
    let from = match crate::experiment::newest_good_checkpoint(exp_dir) {
        Some((_, dir)) => Some(read_checkpoint(&dir)?),
        None => {
            tracing::warn!("{}: no usable checkpoint; starting from step 0", exp_dir.display());
            None
        }
    };
    let keep_through = from.as_ref().map_or(0, |r| r.state.step);
    let comm = connect(&cfg, &components.records)?;
    let mut exp = match &comm {
        Some(c) if c.rank() > 0 => Experiment::detached(exp_dir),
        _ => {
            let _ = std::fs::remove_file(exp_dir.join("summary.json"));
            Experiment::reopen(exp_dir, keep_through)?
        }
    };
    train::train(&cfg, components, &mut exp, &cache_dir(), train::TrainOptions { resume: from, stop_at, comm })
}

fn read_checkpoint(dir: &Path) -> Result<train::ResumeFrom> {
    let state_path = dir.join("trainer_state.json");
    let state = serde_json::from_str(&std::fs::read_to_string(&state_path)?).with_context(|| format!("{}: not a trainer state", state_path.display()))?;
    Ok(train::ResumeFrom {
        state,
        weights: crate::experiment::read_safetensors(&dir.join("model.safetensors"))?,
        optimizer_state: crate::experiment::read_safetensors(&dir.join("optimizer.safetensors"))?,
        checkpoint: dir.display().to_string(),
    })
}

/// A resumed run must use the plugins the run started with: same kind, name, origin and file.
pub fn check_plugins(recorded: &[PluginRecord], now: &[PluginRecord], allow_change: bool) -> Result<()> {
    for r in recorded {
        let Some(n) = now.iter().find(|n| n.kind == r.kind) else { continue };
        let changed = if n.name != r.name {
            Some(format!("the {} plugin was `{}`, now `{}`", r.kind, r.name, n.name))
        } else if n.sha256 != r.sha256 || n.origin != r.origin {
            let sha = |s: &Option<String>| s.as_deref().map_or("built-in".to_string(), |s| format!("SHA-256 {}", &s[..16]));
            Some(format!("the {} plugin `{}` changed: {} ({}) then, {} ({}) now", r.kind, r.name, r.origin, sha(&r.sha256), n.origin, sha(&n.sha256)))
        } else {
            None
        };
        if let Some(what) = changed {
            if !allow_change {
                anyhow::bail!("cannot resume: {what}; pass --allow-plugin-change to resume anyway");
            }
            tracing::warn!("resuming although {what} (--allow-plugin-change)");
        }
    }
    Ok(())
}

/// `dflash-host capture`: the config's targets over its data, features written to `out`.
pub fn capture(cfg: &RunConfig, config_path: &Path, out: &Path, registry: &Registry, opts: &crate::pipeline::capture::CaptureOptions) -> Result<crate::pipeline::capture::CaptureIndex> {
    let config_dir = config::config_dir(config_path).canonicalize().context("config folder")?;
    let components = build(cfg, config_path, &config_dir, registry)?;
    crate::pipeline::capture::capture(cfg, components, out, &cache_dir(), opts)
}

/// Self-distil the config's data and write it as chat JSONL (`dflash-host distill --out`).
pub fn distill(cfg: &RunConfig, config_path: &Path, out: &Path, registry: &Registry) -> Result<(u64, Option<crate::pipeline::distill::DistillStats>)> {
    let config_dir = config::config_dir(config_path).canonicalize().context("config folder")?;
    let mut c = build(cfg, config_path, &config_dir, registry)?;
    let stats = crate::pipeline::distill::prepare_data(&mut c, &cache_dir())?;
    if stats.is_none() {
        anyhow::bail!("{}: the data loader regenerates no replies (in [data], distill = false?)", config_path.display());
    }
    let tmp = out.with_extension("jsonl.tmp");
    let n = c.data.export_distilled(tmp.display().to_string().as_str().into()).into_result();
    let n = n.map_err(c.err(plugin_api::PluginKind::DataLoader, "export_distilled"))?;
    std::fs::rename(&tmp, out).with_context(|| format!("writing {}", out.display()))?;
    Ok((n, stats))
}

/// Rebuild a finished experiment's plugins (eval, export): its resolved config, with the drafter
/// from `drafter` (a z-lab folder) or else from checkpoint `step` (default: the newest).
pub fn load_experiment(
    exp_dir: &Path,
    registry: &Registry,
    step: Option<u64>,
    drafter: Option<&Path>,
) -> Result<(RunConfig, Components)> {
    let cfg_path = exp_dir.join("config.toml");
    let mut cfg = RunConfig::load(&cfg_path)?;
    let manifest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(exp_dir.join("manifest.json")).with_context(|| format!("{}: no manifest.json", exp_dir.display()))?,
    )?;
    let config_dir = PathBuf::from(manifest["config_dir"].as_str().unwrap_or("."));
    if let Some(d) = drafter {
        let abs = d.canonicalize().with_context(|| format!("{}", d.display()))?;
        let mut t = toml::Table::new();
        t.insert("plugin".into(), "dflash".into());
        t.insert("init_from".into(), abs.display().to_string().into());
        cfg.drafter = t;
    }
    ensure_device(&cfg)?;
    let mut c = build_components(&cfg, registry, &config_dir, &cache_dir())?;
    if drafter.is_none() {
        let ckpt = crate::export::find_checkpoint(exp_dir, step)?;
        let weights = crate::experiment::read_safetensors(&ckpt.join("model.safetensors"))?;
        c.drafter.load_weights(weights.into()).into_result().map_err(c.err(plugin_api::PluginKind::Drafter, "load_weights"))?;
        tracing::info!("drafter weights from {}", ckpt.display());
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
        let want = format!("run.toml:7: [target] plugin `hf`: field `path`: {}: no such file", dir.path().join("nope.gguf").display());
        assert!(err.contains(&want), "{err}\nshould contain\n{want}");

        let cfg = write_config(dir.path(), "path = \"tiny.json\"\nrandom_init = true", "path = \"nope.jsonl\"");
        let err = build_error(&cfg);
        let want = format!("run.toml:24: [data] plugin `chat`: field `path`: {}: No such file", dir.path().join("nope.jsonl").display());
        assert!(err.contains(&want), "{err}\nshould contain\n{want}");
    }
}
