//! `dflash-host report`: what bounds a run, from its metrics.jsonl; or, with `--plan`, how to
//! split GPUs between the target and the drafter from `bench train`'s figures.

use crate::{plan, report, say};
use anyhow::Result;
use clap::Args;
use std::{path::PathBuf, process::ExitCode};

#[derive(Args)]
pub struct ReportArgs {
    /// The experiment directory.
    #[arg(value_name = "EXP", required_unless_present = "plan")]
    pub exp: Option<PathBuf>,
    /// Instead of a run: split `--gpus` GPUs between the target and the drafter from `bench
    /// train --json`'s file for them, the best split first with the throughput it predicts.
    #[arg(long, value_name = "BENCH_JSON", conflicts_with = "exp", requires = "gpus")]
    pub plan: Option<PathBuf>,
    /// The GPUs the plan splits.
    #[arg(long, value_name = "G", requires = "plan")]
    pub gpus: Option<u64>,
}

pub fn run(args: ReportArgs) -> Result<ExitCode> {
    let lines = match (&args.plan, args.gpus, &args.exp) {
        (Some(bench), Some(gpus), _) => {
            let times = plan::read_bench(bench)?;
            plan::lines(&times, gpus, &plan::plan(&times, gpus)?)
        }
        (_, _, Some(exp)) => report::lines(&report::report(exp)?),
        _ => anyhow::bail!("report: an experiment directory, or --plan BENCH_JSON --gpus G"),
    };
    for line in lines {
        say!("{line}");
    }
    Ok(ExitCode::SUCCESS)
}
