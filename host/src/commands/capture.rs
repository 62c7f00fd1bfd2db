//! `dflash-host capture`: the config's targets over its data, features written to `--out` for
//! `pipeline.capture` to train from.

use crate::{
    config::{self, ConfigOverrides, Override, RunConfig},
    dist::launch::{self, nproc},
    environment::cache_dir,
    memory_estimate::Work,
    pipeline::{
        assemble::build_for,
        capture::{CaptureIndex, CaptureOptions, StoredDtype},
        replicas,
    },
    plugins::Registry,
    say,
};
use anyhow::{Context, Result};
use clap::Args;
use std::{
    path::{Path, PathBuf},
    process::ExitCode,
};

#[derive(Args)]
pub struct CaptureArgs {
    #[arg(long)]
    pub config: PathBuf,
    #[command(flatten)]
    pub overrides: ConfigOverrides,
    #[arg(long)]
    pub out: PathBuf,
    /// Stored precision of the features (default: the run's dtype).
    #[arg(long, value_enum)]
    pub dtype: Option<crate::pipeline::capture::StoredDtype>,
    /// Micro-batches to capture (default: steps x grad_accum).
    #[arg(long)]
    pub batches: Option<u64>,
    /// Shard size in MiB.
    #[arg(long, default_value_t = 1024)]
    pub shard_mb: usize,
    /// Start N local ranks (a target replica over N ranks, `[target] tensor_parallel = N`):
    /// rank 0 captures, the others serve its target.
    #[arg(long, value_name = "N", value_parser = nproc)]
    pub nproc: Option<usize>,
}

pub fn run(args: CaptureArgs, plugin_paths: &[PathBuf]) -> Result<ExitCode> {
    let CaptureArgs { config, out, dtype, batches, shard_mb, overrides, nproc } = args;
    if let Some(code) = launch::relaunch(nproc, Vec::new)? {
        return Ok(code);
    }
    let cfg = RunConfig::load_with(&config, &Override::from_args(&overrides.set, overrides.device.as_deref())?)?;
    let cfg = crate::pipeline::ranks::place_rank(&cfg)?;
    let registry = Registry::new(plugin_paths)?;
    let run_dtype = if cfg.dtype() == "bf16" { StoredDtype::Bf16 } else { StoredDtype::F32 };
    let opts = CaptureOptions {
        dtype: dtype.unwrap_or(run_dtype),
        micro_batches: batches.unwrap_or(cfg.train.steps * cfg.train.grad_accum),
        shard_bytes: shard_mb << 20,
    };
    let Some(index) = capture(&cfg, &config, &out, &registry, &opts)? else { return Ok(ExitCode::SUCCESS) };
    say!(
        "captured     {} micro-batches in {} shards ({:?}) -> {}",
        index.batches.len(),
        index.shards.len(),
        index.dtype,
        out.display()
    );
    say!("train on it  set `[pipeline] capture = \"{}\"` in the config", out.display());
    Ok(ExitCode::SUCCESS)
}

/// `dflash-host capture`: the config's targets over its data, features written to `out`. With a
/// target replica over several ranks, rank 0 captures and the others serve its target (None
/// there).
fn capture(
    cfg: &RunConfig,
    config_path: &Path,
    out: &Path,
    registry: &Registry,
    opts: &CaptureOptions,
) -> Result<Option<CaptureIndex>> {
    let config_dir = config::config_dir(config_path).canonicalize().context("config folder")?;
    if let Some(follower) = replicas::one_replica(&cfg.target, "capture")?.filter(|(_, l)| !l.is_lead()) {
        replicas::serve(cfg, config_path, &config_dir, registry, out, follower)?;
        return Ok(None);
    }
    let inputs = crate::outputs::run_inputs(cfg, config_path, &config_dir, registry)?;
    let out_dir = crate::outputs::OutDir::create("--out", out, inputs)?;
    let components = build_for(Work::Target, cfg, config_path, &config_dir, registry)?;
    // The components (the target's last call) go inside `capture`, before the heartbeat the
    // replica's other ranks watch.
    let (components, _held) = replicas::drive(cfg, components, out, "capture")?;
    crate::pipeline::capture::capture(cfg, components, &out_dir, &cache_dir(), opts).map(Some)
}
