//! `dflash-host ab`: the arms of an A/B over seeds, then their report.

use crate::{plugins::Registry, say};
use anyhow::Result;
use clap::Args;
use std::{path::PathBuf, process::ExitCode};

#[derive(Args)]
pub struct AbArgs {
    /// The A/B config (TOML: name, base, seeds, select, [common], [eval], [arms.<name>] with
    /// an optional `sweep`).
    #[arg(long)]
    pub config: PathBuf,
    /// Seeds 0..N (overrides the file's `seeds`).
    #[arg(long)]
    pub seeds: Option<u64>,
    /// Every run's device (`cpu`, `cuda`, `cuda:N`), as `train --device` sets it.
    #[arg(long)]
    pub device: Option<String>,
    /// The report's folder (default: experiments/<name>/report).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Train N runs of a phase at once, each its own process on the runs' device (small
    /// drafters leave most of a GPU idle; several at once fill it).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub jobs: u64,
    /// One run of the plan (its folder's name) and its phase's evaluations: what each process
    /// of `--jobs` runs.
    #[arg(long, hide = true, requires = "stage")]
    pub only: Option<String>,
    #[arg(long, hide = true, value_enum)]
    pub stage: Option<crate::ab::Stage>,
}

pub fn run(args: AbArgs, plugin_paths: &[PathBuf]) -> Result<ExitCode> {
    let AbArgs { config, seeds, device, out, jobs, only, stage } = args;
    let registry = Registry::new(plugin_paths)?;
    let how = crate::ab::How { seeds, device, jobs: jobs as usize };
    let print = super::train::print_summary;
    if let (Some(name), Some(stage)) = (only, stage) {
        let interrupted = crate::ab::run_only(&config, &how, &name, stage, &registry, print)?;
        return Ok(ExitCode::from(interrupted.unwrap_or(0)));
    }
    let (report, interrupted) = crate::ab::run(&config, &how, out.as_deref(), &registry, print)?;
    if let Some(code) = interrupted {
        return Ok(ExitCode::from(code)); // rerunning the A/B resumes this arm
    }
    say!("report: {}", report.display());
    Ok(ExitCode::SUCCESS)
}
