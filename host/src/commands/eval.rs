//! `dflash-host eval`: speculative decoding with a trained drafter against greedy decoding.

use crate::cli::EvalArgs;
use anyhow::Result;
use std::{path::PathBuf, process::ExitCode};

pub fn run(args: EvalArgs, plugin_paths: &[PathBuf]) -> Result<ExitCode> {
    if let Some(n) = args.nproc.filter(|_| std::env::var_os("RANK").is_none()) {
        let argv = crate::dist::launch::without_nproc(&std::env::args_os().collect::<Vec<_>>());
        return Ok(ExitCode::from(crate::dist::launch::launch(n, &argv)?));
    }
    crate::eval::command(&args, plugin_paths)?;
    Ok(ExitCode::SUCCESS)
}
