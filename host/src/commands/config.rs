//! `dflash-host config explain`: the config reference, whole or one section.

use crate::{cli::ConfigCommand, say};
use anyhow::Result;
use std::{path::PathBuf, process::ExitCode};

pub fn run(command: ConfigCommand, _plugin_paths: &[PathBuf]) -> Result<ExitCode> {
    let ConfigCommand::Explain { section } = command;
    say!("{}", crate::config::explain::markdown(section.as_deref())?.trim_end());
    Ok(ExitCode::SUCCESS)
}
