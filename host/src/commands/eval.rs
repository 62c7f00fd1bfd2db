//! `dflash-host eval`: speculative decoding with a trained drafter against greedy decoding.

use crate::{cli::EvalArgs, eval::EvalCommand};
use anyhow::Result;
use std::{path::PathBuf, process::ExitCode};

pub fn run(args: EvalArgs, plugin_paths: &[PathBuf]) -> Result<ExitCode> {
    let EvalArgs { exp_dir, checkpoint, drafter, prompts, prompt_format, limit, max_new_tokens, time_split } = args;
    let args = EvalCommand { exp_dir, checkpoint, drafter, prompts, prompt_format, limit, max_new_tokens, time_split };
    crate::eval::command(&args, plugin_paths)?;
    Ok(ExitCode::SUCCESS)
}
