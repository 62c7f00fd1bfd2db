//! `dflash-host ab`: the arms of an A/B over seeds, then their report.

use crate::{cli::AbArgs, plugins::Registry, say};
use anyhow::Result;
use std::{path::PathBuf, process::ExitCode};

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
