//! `dflash-host compare`: experiments side by side in one report.

use crate::{cli::CompareArgs, say};
use anyhow::Result;
use std::{path::PathBuf, process::ExitCode};

pub fn run(args: CompareArgs, _plugin_paths: &[PathBuf]) -> Result<ExitCode> {
    let CompareArgs { dirs, out, group_by } = args;
    let report = crate::compare::run(&dirs, out.as_deref(), group_by.as_deref())?;
    say!("report: {}", report.display());
    Ok(ExitCode::SUCCESS)
}
