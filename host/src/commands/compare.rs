//! `dflash-host compare`: experiments side by side in one report.

use crate::say;
use anyhow::Result;
use clap::Args;
use std::{path::PathBuf, process::ExitCode};

#[derive(Args)]
pub struct CompareArgs {
    /// Experiment directories, or A/B folders (their runs).
    #[arg(required = true)]
    pub dirs: Vec<PathBuf>,
    /// Output folder, reused (default: an A/B folder's report/, else compare/ beside the
    /// first run).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Group runs by this config key (dotted, e.g. `optimizer.lr`; falls back to manifest.json)
    /// instead of the manifest's `arm`, else the config's `name`.
    #[arg(long)]
    pub group_by: Option<String>,
}

pub fn run(args: CompareArgs, _plugin_paths: &[PathBuf]) -> Result<ExitCode> {
    let CompareArgs { dirs, out, group_by } = args;
    let report = crate::compare::run(&dirs, out.as_deref(), group_by.as_deref())?;
    say!("report: {}", report.display());
    Ok(ExitCode::SUCCESS)
}
