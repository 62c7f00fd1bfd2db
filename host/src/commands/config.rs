//! `dflash-host config explain`: the config reference, whole or one section, for every built-in,
//! one plugin (`--plugin`) or the plugins a config picks (`--config`); plugin libraries given with
//! the global `--plugin PATH` are described too.

use crate::{
    config::explain::{markdown_for, Picks},
    plugins::Registry,
    say,
};
use anyhow::Result;
use clap::Subcommand;
use std::{path::PathBuf, process::ExitCode};

#[derive(Subcommand)]
pub enum ConfigCommand {
    /// Print the fields of every section, or of one (`top`, `train`, `pipeline`, `target`,
    /// `drafter`, `optimizer`, `data`). A plugin section's fields are its plugin's, picked by
    /// its `plugin = "..."`: every built-in plugin's are shown unless --plugin or --config says
    /// which.
    Explain {
        section: Option<String>,
        /// Only this plugin's fields where a section has several plugins (`gdn`, `muon`).
        #[arg(long, conflicts_with = "config")]
        plugin: Option<String>,
        /// Only the plugins this run config picks, saying which and where.
        #[arg(long)]
        config: Option<PathBuf>,
    },
}

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
