//! `dflash-host plugins list | inspect | doc | check | new | probe`.

use crate::{
    config::explain,
    plugins::{self, PluginRecord, Registry},
    say,
};
use anyhow::Result;
use clap::Subcommand;
use std::{path::PathBuf, process::ExitCode};

#[derive(Subcommand)]
pub enum PluginsCommand {
    /// Built-in and loaded (`--plugin PATH`) plugins: name, kind, version, ABI, origin, SHA-256.
    List,
    /// Check one plugin library and show its metadata (it is loaded in a child process only:
    /// none of its code runs in this one).
    Inspect {
        /// The shared library.
        path: PathBuf,
    },
    /// Load one library in this process and print its record as JSON (what `inspect`, `list` and
    /// `--plugin` run in a child process).
    #[command(hide = true)]
    Probe {
        path: PathBuf,
        /// The SHA-256 the library was checked with: other bytes are refused, not loaded.
        #[arg(long)]
        sha256: Option<String>,
    },
    /// A plugin's config reference: every field of its section with type, default, range and
    /// meaning, as the plugin describes it (a library is checked first, then loaded to ask it).
    Doc {
        /// A plugin library (`.so`), or the name of a built-in plugin.
        plugin: String,
    },
    /// Run the contract of a plugin's kind against it: pass / FAIL per clause.
    Check(crate::plugins::check::CheckArgs),
    /// Write a plugin crate from a template (build it with `cargo build --release`).
    New(crate::plugins::new::NewArgs),
}

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
            let record = plugins::probe::probe(&path, &sha256)?;
            print_plugins(std::iter::once(&record));
            Ok(ExitCode::SUCCESS)
        }
        PluginsCommand::Doc { plugin } => {
            say!("{}", doc(&plugin, plugin_paths)?.trim_end());
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

/// The reference of a plugin library (checked, probed, then loaded to ask it), or of a plugin
/// known by name (a built-in, or one given with `--plugin`).
fn doc(plugin: &str, plugin_paths: &[PathBuf]) -> Result<String> {
    let as_path = std::path::Path::new(plugin);
    if as_path.exists() || plugin.ends_with(".so") {
        let path = plugins::find_library(as_path)?;
        let mut paths = plugin_paths.to_vec();
        paths.push(path.clone());
        let registry = Registry::new(&paths)?;
        let origin = path.display().to_string();
        let p = registry.plugins.iter().find(|p| p.record.origin == origin).expect("the library just registered");
        return explain::plugin_markdown(p, &registry);
    }
    let registry = Registry::new(plugin_paths)?;
    let Some(p) = registry.plugins.iter().find(|p| p.record.name == plugin) else {
        let known: Vec<&str> = registry.plugins.iter().map(|p| p.record.name.as_str()).collect();
        anyhow::bail!("plugins doc {plugin}: no such file, and no plugin of that name (known: {})", known.join(", "));
    };
    explain::plugin_markdown(p, &registry)
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
