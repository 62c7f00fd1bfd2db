//! `dflash-host train`: a fresh run from a config, a resumed one, or N local ranks of either.

use crate::{
    config::{ConfigOverrides, Override, RunConfig},
    dist::launch::{self, nproc},
    experiment,
    plugins::Registry,
    say,
    train::{
        start::{self, ResumeOptions, RunSpec},
        TrainSummary,
    },
};
use anyhow::Result;
use clap::Args;
use std::{
    path::{Path, PathBuf},
    process::ExitCode,
};

#[derive(Args)]
pub struct TrainArgs {
    /// The run config (TOML).
    #[arg(long, required_unless_present = "resume")]
    pub config: Option<PathBuf>,
    /// Experiment directory (default: experiments/<name>, or <name>-N if that exists).
    #[arg(long, conflicts_with = "resume")]
    pub exp_dir: Option<PathBuf>,
    /// Set `train.steps` (= `--set train.steps=N`). With --resume: extend a finished or
    /// interrupted run to N steps (its learning-rate schedule then spans N), recorded in the
    /// manifest's `changes`.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=crate::config::MAX_STEPS))]
    pub steps: Option<u64>,
    /// `--set train.steps=400 --set optimizer.lr=1e-3 --set 'data.template_kwargs={
    /// enable_thinking = false }'`: the experiment's config.toml records the result. With
    /// --resume, a field other than `train.steps` that changes is refused unless
    /// `--allow-change FIELD` is given too.
    #[command(flatten)]
    pub overrides: ConfigOverrides,
    /// Continue this experiment from its newest good checkpoint, with its own config (and
    /// the --steps / --set / --device changes, checked as `--allow-change` says).
    #[arg(long, value_name = "EXP_DIR", conflicts_with = "config")]
    pub resume: Option<PathBuf>,
    /// Resume even if a plugin library differs from the one the run started with.
    #[arg(long, requires = "resume")]
    pub allow_plugin_change: bool,
    /// Resume although this config field (dotted, e.g. `train.steps`; a section name allows
    /// all its fields) or the file it names changed since the run started (repeatable).
    #[arg(long, value_name = "FIELD", requires = "resume")]
    pub allow_change: Vec<String>,
    /// Stop after this step with a checkpoint, as if interrupted (resume later); must lie
    /// ahead of the step the run is at.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub stop_at: Option<u64>,
    /// Data-parallel: start N local ranks of this command (as `torchrun --nproc-per-node N
    /// --no-python dflash-host train ...` would); each rank's GPUs are the config's offset by
    /// its local rank. N = 1 runs one rank through the same collectives.
    #[arg(long, value_name = "N", value_parser = nproc)]
    pub nproc: Option<usize>,
}

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
