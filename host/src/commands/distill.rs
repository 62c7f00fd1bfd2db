//! `dflash-host distill`: the target's own replies to the config's prompts, written as chat JSONL
//! to train on.

use crate::{
    cli::DistillArgs,
    config::{self, Override, RunConfig},
    environment::cache_dir,
    pipeline::{assemble::build, distill::DistillStats},
    plugins::Registry,
    say,
};
use anyhow::{Context, Result};
use std::{
    path::{Path, PathBuf},
    process::ExitCode,
};

pub fn run(args: DistillArgs, plugin_paths: &[PathBuf]) -> Result<ExitCode> {
    let DistillArgs { config, out, overrides } = args;
    let cfg = RunConfig::load_with(&config, &Override::from_args(&overrides.set, overrides.device.as_deref())?)?;
    let registry = Registry::new(plugin_paths)?;
    let (n, stats) = distill(&cfg, &config, &out, &registry)?;
    if let Some(s) = stats {
        say!(
            "distilled    {} replies in {:.1} s ({} from the cache {})",
            s.replies,
            s.seconds,
            s.cached,
            s.cache_file.display()
        );
    }
    say!("wrote        {n} records -> {}", out.display());
    say!("train on it  [data] path = \"{}\", distill = false", out.display());
    Ok(ExitCode::SUCCESS)
}

/// Self-distil the config's data and write it as chat JSONL (`dflash-host distill --out`).
fn distill(
    cfg: &RunConfig,
    config_path: &Path,
    out: &Path,
    registry: &Registry,
) -> Result<(u64, Option<DistillStats>)> {
    let config_dir = config::config_dir(config_path).canonicalize().context("config folder")?;
    let mut c = build(cfg, config_path, &config_dir, registry)?;
    let stats = crate::pipeline::distill::prepare_data(&mut c, &cache_dir())?;
    if stats.is_none() {
        anyhow::bail!(
            "{}: the data loader regenerates no replies (in [data], distill = false?)",
            config_path.display()
        );
    }
    // Written beside `out`, then renamed into place; a `.gz` name stays last (the loader gzips it).
    let name = out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = out.with_file_name(match name.strip_suffix(".gz") {
        Some(stem) => format!("{stem}.partial.gz"),
        None => format!("{name}.partial"),
    });
    let n = c.data.export_distilled(tmp.display().to_string().as_str().into()).into_result();
    let n = n.map_err(c.err(plugin_api::PluginKind::DataLoader, "export_distilled"))?;
    std::fs::rename(&tmp, out).with_context(|| format!("writing {}", out.display()))?;
    Ok((n, stats))
}
