//! `dflash-host distill`: the target's own replies to the config's prompts, written as chat JSONL
//! to train on.

use crate::{
    config::{self, ConfigOverrides, Override, RunConfig},
    dist::launch::{self, nproc},
    environment::cache_dir,
    outputs::{self, OutFile},
    pipeline::{assemble::build, distill::DistillStats, replicas},
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
pub struct DistillArgs {
    #[arg(long)]
    pub config: PathBuf,
    #[command(flatten)]
    pub overrides: ConfigOverrides,
    /// The JSONL file to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Start N local ranks (a target replica over N ranks, `[target] tensor_parallel = N`):
    /// rank 0 distils, the others serve its target.
    #[arg(long, value_name = "N", value_parser = nproc)]
    pub nproc: Option<usize>,
}

pub fn run(args: DistillArgs, plugin_paths: &[PathBuf]) -> Result<ExitCode> {
    let DistillArgs { config, out, overrides, nproc } = args;
    if let Some(code) = launch::relaunch(nproc, Vec::new)? {
        return Ok(code);
    }
    let cfg = RunConfig::load_with(&config, &Override::from_args(&overrides.set, overrides.device.as_deref())?)?;
    let cfg = crate::pipeline::ranks::place_rank(&cfg)?;
    let registry = Registry::new(plugin_paths)?;
    let Some((written, stats)) = distill(&cfg, &config, &out, &registry)? else { return Ok(ExitCode::SUCCESS) };
    for line in crate::pipeline::distill::export_summary(&stats, &written, &out) {
        say!("{line}");
    }
    Ok(ExitCode::SUCCESS)
}

/// Self-distil the config's data and write it as chat JSONL (`dflash-host distill --out`): what
/// was generated, and what was written and left out. With a target replica over several ranks,
/// rank 0 runs it and the others serve its target (None there).
fn distill(
    cfg: &RunConfig,
    config_path: &Path,
    out: &Path,
    registry: &Registry,
) -> Result<Option<(plugin_api::DistilledExport, DistillStats)>> {
    let config_dir = config::config_dir(config_path).canonicalize().context("config folder")?;
    if let Some((env, layout)) = replicas::one_replica(&cfg.target, "distill")?.filter(|(_, l)| !l.is_lead()) {
        replicas::serve(cfg, config_path, &config_dir, registry, out, (env, layout))?;
        return Ok(None);
    }
    // Never one of the run's inputs (its data, its config) nor inside an experiment; checked
    // before the target loads, and again when the file replaces what `out` names.
    let out_file = OutFile::create("--out", out, outputs::run_inputs(cfg, config_path, &config_dir, registry)?)?;
    let c = build(cfg, config_path, &config_dir, registry)?;
    // Dropped in this order: the target's last call, then the heartbeat its other ranks watch.
    let (mut c, _held) = replicas::drive(cfg, c, out, "distill")?;
    let Some(stats) = crate::pipeline::distill::prepare_data(&mut c, &cache_dir())? else {
        anyhow::bail!(
            "{}: the data loader regenerates no replies (in [data], distill = false?)",
            config_path.display()
        );
    };
    // Written in a private folder beside `out` under its name (the loader gzips a `.gz` name),
    // then moved into place.
    let staged = out_file.stage()?;
    let written = c.data.export_distilled_summary(&staged.path.display().to_string())?;
    out_file.commit(staged)?;
    drop(c);
    Ok(Some((written, stats)))
}
