//! `dflash-host eval`: speculative decoding with a trained drafter against greedy decoding.

pub use crate::eval::args::EvalArgs;
use anyhow::Result;
use std::{path::PathBuf, process::ExitCode};

pub fn run(args: EvalArgs, plugin_paths: &[PathBuf]) -> Result<ExitCode> {
    if let Some(code) = crate::dist::launch::relaunch(args.nproc, Vec::new)? {
        return Ok(code);
    }
    crate::eval::command(&args, plugin_paths)?;
    Ok(ExitCode::SUCCESS)
}
