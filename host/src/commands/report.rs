//! `dflash-host report`: what bounds a run, from its metrics.jsonl; or, with `--plan`, how to
//! split GPUs between the target and the drafter from `bench train`'s figures.

use crate::{cli::ReportArgs, plan, report, say};
use anyhow::Result;
use std::process::ExitCode;

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
