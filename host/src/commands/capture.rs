//! `dflash-host capture`: the config's targets over its data, features written to `--out` for
//! `pipeline.capture` to train from.

use crate::{
    cli::CaptureArgs,
    config::{self, Override, RunConfig},
    environment::cache_dir,
    experiment,
    pipeline::{
        assemble::build,
        capture::{CaptureIndex, CaptureOptions, StoredDtype},
    },
    plugins::Registry,
    say,
};
use anyhow::{Context, Result};
use std::{
    path::{Path, PathBuf},
    process::ExitCode,
};

pub fn run(args: CaptureArgs, plugin_paths: &[PathBuf]) -> Result<ExitCode> {
    let CaptureArgs { config, out, dtype, batches, shard_mb, overrides } = args;
    let cfg = RunConfig::load_with(&config, &Override::from_args(&overrides.set, overrides.device.as_deref())?)?;
    let registry = Registry::new(plugin_paths)?;
    let run_dtype = if cfg.dtype() == "bf16" { StoredDtype::Bf16 } else { StoredDtype::F32 };
    let opts = CaptureOptions {
        dtype: dtype.unwrap_or(run_dtype),
        micro_batches: batches.unwrap_or(cfg.train.steps * cfg.train.grad_accum),
        shard_bytes: shard_mb << 20,
    };
    let index = capture(&cfg, &config, &out, &registry, &opts)?;
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

/// `dflash-host capture`: the config's targets over its data, features written to `out`.
fn capture(
    cfg: &RunConfig,
    config_path: &Path,
    out: &Path,
    registry: &Registry,
    opts: &CaptureOptions,
) -> Result<CaptureIndex> {
    crate::pipeline::replicas::refuse(&cfg.target, "capture")?;
    experiment::guard::check_out_folder("--out", out)?;
    let config_dir = config::config_dir(config_path).canonicalize().context("config folder")?;
    let components = build(cfg, config_path, &config_dir, registry)?;
    crate::pipeline::capture::capture(cfg, components, out, &cache_dir(), opts)
}
