//! `dflash-host eval`: speculative decoding with a trained drafter against greedy decoding.

use crate::cli::EvalArgs;
use anyhow::Result;
use std::{path::PathBuf, process::ExitCode};

pub fn run(args: EvalArgs, plugin_paths: &[PathBuf]) -> Result<ExitCode> {
    crate::eval::command(&args, plugin_paths)?;
    Ok(ExitCode::SUCCESS)
}
