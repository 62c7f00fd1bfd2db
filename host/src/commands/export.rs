//! `dflash-host export`: a checkpoint as a drafter folder that vLLM and SGLang serve.

use crate::say;
use anyhow::Result;
use clap::Args;
use std::{path::PathBuf, process::ExitCode};

#[derive(Args)]
pub struct ExportArgs {
    #[arg(long)]
    pub exp_dir: PathBuf,
    /// Checkpoint step (default: the newest that verifies).
    #[arg(long)]
    pub checkpoint: Option<u64>,
    /// A new or empty folder outside the experiment.
    #[arg(long)]
    pub out: PathBuf,
    /// Replace `--out` if it is a non-empty folder.
    #[arg(long)]
    pub force: bool,
}

pub fn run(args: ExportArgs, plugin_paths: &[PathBuf]) -> Result<ExitCode> {
    let ExportArgs { exp_dir, checkpoint, out, force } = args;
    let registry = crate::plugins::Registry::new(plugin_paths)?;
    let done = crate::export::export_experiment(&exp_dir, checkpoint, &out, force, &registry)?;
    say!("exported {} -> {}", done.checkpoint.display(), done.out.display());
    say!("serve it with (see {}):\n\n{}", done.out.join("README.md").display(), done.serving);
    if done.serving.contains(crate::export::card::NO_HF_CHECKPOINT) {
        say!(
            "\nthe target was a GGUF file, which the servers do not load, and no HF checkpoint of it is known: put the \
             hub id or the folder of the same model's HF checkpoint (the full-precision weights the GGUF was made \
             from) in place of {}",
            crate::export::card::NO_HF_CHECKPOINT
        );
    }
    Ok(ExitCode::SUCCESS)
}
