//! `dflash-host config explain`: the config reference, whole or one section, for every built-in,
//! one plugin (`--plugin`) or the plugins a config picks (`--config`); plugin libraries given with
//! the global `--plugin PATH` are described too.

use crate::{
    cli::ConfigCommand,
    config::explain::{markdown_for, Picks},
    plugins::Registry,
    say,
};
use anyhow::Result;
use std::{path::PathBuf, process::ExitCode};

pub fn run(command: ConfigCommand, plugin_paths: &[PathBuf]) -> Result<ExitCode> {
    let ConfigCommand::Explain { section, plugin, config } = command;
    let registry = Registry::new(plugin_paths)?;
    let picks = match (plugin, config) {
        (Some(name), _) => Picks::plugin(&name, &registry)?,
        (None, Some(file)) => Picks::config(&file)?,
        (None, None) => Picks::default(),
    };
    say!("{}", markdown_for(section.as_deref(), &picks, &registry)?.trim_end());
    Ok(ExitCode::SUCCESS)
}
