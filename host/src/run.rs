//! One training run from a config: build the plugins, open the experiment directory, train.
//! Used by `dflash-host train` and by each arm of `dflash-host ab`.

use crate::{
    config::{self, RunConfig},
    experiment::Experiment,
    plugins::{PluginRecord, Registry},
    train::{self, TrainSummary},
};
use anyhow::{Context, Result};
use serde::Serialize;
use std::path::{Path, PathBuf};

/// `manifest.json`: what produced an experiment.
#[derive(Serialize)]
pub struct Manifest {
    pub host_version: &'static str,
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
    // SAFETY: loading libtorch's own CUDA library; it is never unloaded.
    let lib = unsafe {
        libloading::os::unix::Library::open(
            Some("libtorch_cuda.so"),
            libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
        )
    };
    match lib {
        Ok(lib) => {
            std::mem::forget(lib);
            true
        }
        Err(e) => {
            tracing::warn!("CUDA unavailable: {e}");
            false
        }
    }
}

/// Load CUDA when the config asks for it, or say why it cannot run.
fn ensure_device(cfg: &RunConfig) -> Result<()> {
    if cfg.device.starts_with("cuda") && !enable_cuda() {
        anyhow::bail!("device `{}` asked for, but libtorch's CUDA libraries could not be loaded", cfg.device);
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
}

pub fn run(spec: RunSpec) -> Result<TrainSummary> {
    let RunSpec { cfg, config_path, exp_dir, registry, ab } = spec;
    ensure_device(cfg)?;
    tch::manual_seed(cfg.seed as i64);
    let cache = cache_dir();
    let config_dir = config::config_dir(config_path).canonicalize().context("config folder")?;
    let components = train::build_components(cfg, registry, &config_dir, &cache).map_err(|e| {
        // Point plugin config errors at the line that set the field.
        let msg = format!("{e:#}");
        let text = std::fs::read_to_string(config_path).unwrap_or_default();
        match config::locate_plugin_error(&text, &msg) {
            Some(line) => anyhow::anyhow!("{}:{line}: {msg}", config_path.display()),
            None => anyhow::anyhow!("{}: {msg}", config_path.display()),
        }
    })?;
    let spec = components.target.spec();
    let manifest = Manifest {
        host_version: env!("CARGO_PKG_VERSION"),
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
        ab: ab.map(|(name, _)| name.to_string()),
        arm: ab.map(|(_, arm)| arm.to_string()),
    };
    let resolved = toml::to_string(cfg)?;
    let mut exp = Experiment::create(exp_dir, &resolved, &manifest)?;
    tracing::info!("experiment: {}", exp_dir.display());
    train::train(cfg, components, &mut exp, &cache)
}

/// Rebuild a finished experiment's plugins (eval, export): its resolved config, with the drafter
/// from `drafter` (a z-lab folder) or else from checkpoint `step` (default: the newest).
pub fn load_experiment(
    exp_dir: &Path,
    registry: &Registry,
    step: Option<u64>,
    drafter: Option<&Path>,
) -> Result<(RunConfig, train::Components)> {
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
    let mut c = train::build_components(&cfg, registry, &config_dir, &cache_dir())?;
    if drafter.is_none() {
        let ckpt = crate::export::find_checkpoint(exp_dir, step)?;
        let weights = crate::experiment::read_safetensors(&ckpt.join("model.safetensors"))?;
        c.drafter.load_weights(weights.into()).into_result().map_err(c.err(plugin_api::PluginKind::Drafter, "load_weights"))?;
        tracing::info!("drafter weights from {}", ckpt.display());
    }
    Ok((cfg, c))
}
