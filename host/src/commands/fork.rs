//! `dflash-host fork`: a new experiment from another one's checkpoint, under a changed config.

use crate::{
    commands::train::print_summary,
    config::{ConfigOverrides, Override},
    dist::launch::{self, nproc},
    plugins::Registry,
    train::fork::{self, ForkSpec},
};
use anyhow::Result;
use clap::Args;
use std::{path::PathBuf, process::ExitCode};

#[derive(Args)]
pub struct ForkArgs {
    /// The experiment to fork (it may still be training: it is only read).
    #[arg(value_name = "EXP")]
    pub parent: PathBuf,
    /// The step of the parent's checkpoint to start from (`checkpoints/step-STEP`).
    #[arg(long, value_name = "STEP")]
    pub at: u64,
    /// `--set optimizer.plugin=muon --set train.steps=2000`: changes to the parent's config,
    /// recorded in the fork's config.toml.
    #[command(flatten)]
    pub overrides: ConfigOverrides,
    /// The fork's folder (default: `<EXP>-fork-<STEP>` beside the parent).
    #[arg(long)]
    pub exp_dir: Option<PathBuf>,
    /// `keep` the parent's optimizer state (the default for the same optimizer plugin), start a
    /// `fresh` one (the default when `optimizer.plugin` changes), or `carry` over what maps
    /// between the two optimizers (first moment, second moment where the new one has one, master
    /// weights, step count).
    #[arg(long, value_enum)]
    pub optimizer_state: Option<crate::train::fork::OptimizerStateChoice>,
    /// `continue` the learning-rate schedule at the parent's position, or `restart` a warm-up and
    /// cosine decay over the steps after the fork.
    #[arg(long, value_enum, default_value = "continue")]
    pub schedule: crate::train::fork::ScheduleChoice,
    /// Steps of linear re-warm-up from the fork (default: the run's own warm-up length,
    /// train.warmup_frac x train.steps, after a fresh optimizer state with the schedule
    /// continued; 0 otherwise).
    #[arg(long, value_name = "N")]
    pub rewarm: Option<u64>,
    /// Stop after this step with a checkpoint, as if interrupted (resume with `train --resume`).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub stop_at: Option<u64>,
    /// Start N local ranks of the fork's training, as `train --nproc N` does (a parent trained
    /// over N ranks, data-parallel or a target replica, `[target] tensor_parallel`).
    #[arg(long, value_name = "N", value_parser = nproc)]
    pub nproc: Option<usize>,
}

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
