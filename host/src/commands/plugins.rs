//! `dflash-host plugins list | inspect | check | new | probe`.

use crate::{
    cli::PluginsCommand,
    plugins::{self, PluginRecord, Registry},
    say,
};
use anyhow::Result;
use std::{path::PathBuf, process::ExitCode};

pub fn run(command: PluginsCommand, plugin_paths: &[PathBuf]) -> Result<ExitCode> {
    match command {
        PluginsCommand::List => {
            let registry = Registry::new(plugin_paths)?;
            print_plugins(registry.plugins.iter().map(|p| &p.record));
            Ok(ExitCode::SUCCESS)
        }
        PluginsCommand::Inspect { path } => {
            let path = plugins::find_library(&path)?;
            let (_, sha256) = plugins::check_file(&path)?;
            let record = plugins::probe(&path, &sha256)?;
            print_plugins(std::iter::once(&record));
            Ok(ExitCode::SUCCESS)
        }
        PluginsCommand::Check(args) => plugins::check::run(plugin_paths, args),
        PluginsCommand::New(args) => plugins::new::run(args),
        // The child process `probe` runs: load the library here, print what it declares.
        PluginsCommand::Probe { path, sha256 } => {
            let loaded = plugins::load_library(&path, sha256.as_deref())?;
            say!("{}", serde_json::to_string(&loaded.record)?);
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn print_plugins<'a>(records: impl Iterator<Item = &'a PluginRecord>) {
    say!("{:<10} {:<10} {:<8} {:<6} {:<16} {:<64} origin", "kind", "name", "version", "abi", "sha256", "description");
    for r in records {
        let sha = r.sha256.as_deref().map_or("-".to_string(), |s| s[..16].to_string());
        say!(
            "{:<10} {:<10} {:<8} {:<6} {:<16} {:<64} {}",
            r.kind,
            r.name,
            r.version,
            r.abi,
            sha,
            r.description,
            r.origin
        );
    }
}
