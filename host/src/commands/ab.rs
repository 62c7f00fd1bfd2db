//! `dflash-host ab`: the arms of an A/B over seeds, then their report.

use crate::{cli::AbArgs, plugins::Registry, say};
use anyhow::Result;
use std::{path::PathBuf, process::ExitCode};

pub fn run(args: AbArgs, plugin_paths: &[PathBuf]) -> Result<ExitCode> {
    let AbArgs { config, seeds, device, out } = args;
    let registry = Registry::new(plugin_paths)?;
    let (report, interrupted) =
        crate::ab::run(&config, seeds, device.as_deref(), out.as_deref(), &registry, super::train::print_summary)?;
    if let Some(code) = interrupted {
        return Ok(ExitCode::from(code)); // rerunning the A/B resumes this arm
    }
    say!("report: {}", report.display());
    Ok(ExitCode::SUCCESS)
}
