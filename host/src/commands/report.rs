//! `dflash-host report`: what bounds a run, from its metrics.jsonl.

use crate::{cli::ReportArgs, report, say};
use anyhow::Result;
use std::process::ExitCode;

pub fn run(args: ReportArgs) -> Result<ExitCode> {
    let r = report::report(&args.exp)?;
    for line in report::lines(&r) {
        say!("{line}");
    }
    Ok(ExitCode::SUCCESS)
}
