//! `dflash-host fork`: a new experiment from another one's checkpoint, under a changed config.

use crate::{
    cli::ForkArgs,
    commands::train::print_summary,
    config::Override,
    dist::launch,
    plugins::Registry,
    train::fork::{self, ForkSpec},
};
use anyhow::Result;
use std::{path::PathBuf, process::ExitCode};

pub fn run(args: ForkArgs, plugin_paths: &[PathBuf]) -> Result<ExitCode> {
    // One fork folder for every rank (each would otherwise pick a fresh name).
    let one_folder = || match &args.exp_dir {
        None => vec!["--exp-dir".into(), fork::default_dir(&args.parent, args.at).into()],
        Some(_) => Vec::new(),
    };
    if let Some(code) = launch::relaunch(args.nproc, one_folder)? {
        return Ok(code);
    }
    let registry = Registry::new(plugin_paths)?;
    let summary = fork::fork(ForkSpec {
        parent: &args.parent,
        at: args.at,
        overrides: Override::from_args(&args.overrides.set, args.overrides.device.as_deref())?,
        exp_dir: args.exp_dir,
        optimizer_state: args.optimizer_state,
        schedule: args.schedule,
        rewarm: args.rewarm,
        registry: &registry,
        stop_at: args.stop_at,
        config: None,
        ab: None,
    })?;
    print_summary(&summary);
    Ok(summary.interrupted.map_or(ExitCode::SUCCESS, ExitCode::from))
}
