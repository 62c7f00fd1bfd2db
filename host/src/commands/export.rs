//! `dflash-host export`: a checkpoint as a drafter folder that vLLM and SGLang serve.

use crate::{cli::ExportArgs, say};
use anyhow::Result;
use std::{path::PathBuf, process::ExitCode};

pub fn run(args: ExportArgs, plugin_paths: &[PathBuf]) -> Result<ExitCode> {
    let ExportArgs { exp_dir, checkpoint, out, force } = args;
    let registry = crate::plugins::Registry::new(plugin_paths)?;
    let done = crate::export::export_experiment(&exp_dir, checkpoint, &out, force, &registry)?;
    say!("exported {} -> {}", done.checkpoint.display(), done.out.display());
    say!("serve it with (see {}):\n\n{}", done.out.join("README.md").display(), done.serving);
    Ok(ExitCode::SUCCESS)
}
