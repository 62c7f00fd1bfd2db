//! `dflash-host train`: a fresh run from a config, a resumed one, or N local ranks of either.

use crate::{
    cli::{ConfigOverrides, TrainArgs},
    config::{Override, RunConfig},
    dist::launch,
    experiment,
    plugins::Registry,
    say,
    train::{
        start::{self, ResumeOptions, RunSpec},
        TrainSummary,
    },
};
use anyhow::Result;
use std::{
    path::{Path, PathBuf},
    process::ExitCode,
};

pub fn run(args: TrainArgs, plugin_paths: &[PathBuf]) -> Result<ExitCode> {
    match args {
        TrainArgs { nproc: Some(n), ref config, ref exp_dir, ref overrides, steps, .. }
            if n >= 1 && std::env::var_os("RANK").is_none() =>
        {
            let mut argv = launch::without_nproc(&std::env::args_os().collect::<Vec<_>>());
            // One experiment folder for every rank (each would otherwise pick a fresh name).
            if let (Some(config), None) = (config, exp_dir) {
                if !argv.iter().any(|a| a == "--resume") {
                    let cfg = RunConfig::load_with(config, &train_overrides(overrides, steps)?)?;
                    argv.extend([
                        "--exp-dir".into(),
                        experiment::fresh_dir(Path::new("experiments"), &cfg.name).into(),
                    ]);
                }
            }
            Ok(ExitCode::from(launch::launch(n, &argv)?))
        }
        TrainArgs { resume: Some(dir), allow_plugin_change, allow_change, stop_at, steps, overrides, .. } => {
            let opts = ResumeOptions {
                plugin_paths: plugin_paths.to_vec(),
                allow_plugin_change,
                allow_change,
                stop_at,
                overrides: train_overrides(&overrides, steps)?,
            };
            let summary = start::resume(&dir, &opts)?;
            print_summary(&summary);
            Ok(summary.interrupted.map_or(ExitCode::SUCCESS, ExitCode::from))
        }
        TrainArgs { config, exp_dir, steps, overrides, stop_at, .. } => {
            let config = config.expect("clap requires --config without --resume");
            let cfg = RunConfig::load_with(&config, &train_overrides(&overrides, steps)?)?;
            let registry = Registry::new(plugin_paths)?;
            let dir = exp_dir.unwrap_or_else(|| experiment::fresh_dir(Path::new("experiments"), &cfg.name));
            let summary = start::run(RunSpec {
                cfg: &cfg,
                config_path: &config,
                exp_dir: &dir,
                registry: &registry,
                ab: None,
                stop_at,
            })?;
            print_summary(&summary);
            Ok(summary.interrupted.map_or(ExitCode::SUCCESS, ExitCode::from))
        }
    }
}

/// `--set`, `--device` and `--steps` (= `--set train.steps=N`) as config overrides.
fn train_overrides(o: &ConfigOverrides, steps: Option<u64>) -> Result<Vec<Override>> {
    let mut all = Override::from_args(&o.set, o.device.as_deref())?;
    all.extend(steps.map(|n| Override {
        arg: format!("--steps {n}"),
        key: "train.steps".into(),
        value: toml::Value::Integer(i64::try_from(n).expect("clap bounds --steps by MAX_STEPS")),
    }));
    Ok(all)
}

/// The lines a finished (or interrupted) run prints; `ab` prints them for each arm.
pub fn print_summary(s: &TrainSummary) {
    if !crate::out::is_lead() {
        return; // rank 0 speaks for a data-parallel run
    }
    say!("experiment   {}", s.experiment);
    say!("steps        {}  ({} target tokens, {:.0} s)", s.steps, s.tokens, s.wall_s);
    if let Some(d) = &s.distill {
        say!(
            "distill      {} replies in {:.0} s ({} from the cache); run {:.0} s in all",
            d.replies,
            d.seconds,
            d.cached,
            d.seconds + s.wall_s
        );
    }
    if let (Some(f), Some(l)) = (&s.first, &s.last) {
        say!("loss         {:.4} -> {:.4}", f.loss, l.loss);
        say!("tau_hat      {:.3} -> {:.3}", f.tau_hat, l.tau_hat);
        say!("acc@1        {:.3} -> {:.3}", f.acc.first().unwrap_or(&0.0), l.acc.first().unwrap_or(&0.0));
    }
    if let Some(c) = &s.last_checkpoint {
        say!("checkpoint   {c}");
    }
}
