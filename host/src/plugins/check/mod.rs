//! `dflash-host plugins check LIB.so|NAME`: the contract of a plugin's kind, run against it,
//! one line per clause (`pass` / `FAIL: why`); exit 1 when a clause fails.
//!
//! The plugin is created from a run config (`--config`, default `configs/tiny.toml`): its
//! kind's section names it (`--section` gives the rest of the section when the config names
//! another plugin), the config's target supplies the spec and tokenizer a drafter and a data
//! loader need. Inputs are small (a few tokens, 8x4 matrices): the kit takes seconds.

mod data_loader;
mod drafter;
mod kit;
mod optimizer;
mod section;
mod target;

use super::{PluginRecord, Registry};
use crate::config::{PluginSection, RunConfig};
use anyhow::{anyhow, bail, Result};
use kit::Kit;
use plugin_api::PluginKind;
use std::{path::PathBuf, process::ExitCode};

/// The default run config: a seconds-long run on the real target and data.
const TINY: &str = include_str!("../../../../configs/tiny.toml");

#[derive(clap::Args)]
pub struct CheckArgs {
    /// The plugin: a shared library (path or bare name, as `--plugin` takes it) or the name of
    /// a built-in plugin (`adamw`, `chat`, `dflash`, `hf`, ...).
    plugin: PathBuf,
    /// The run config whose sections create the plugin and its target (default:
    /// configs/tiny.toml, embedded).
    #[arg(long)]
    config: Option<PathBuf>,
    /// The plugin's own config section (TOML, without `plugin = ...`) when the config's section
    /// of its kind names another plugin, e.g. `--section 'lr = 0.05'`.
    #[arg(long)]
    section: Option<String>,
}

pub fn run(plugin_args: &[PathBuf], args: CheckArgs) -> Result<ExitCode> {
    let (record, registry) = resolve(plugin_args, &args.plugin)?;
    let kind = kind_of(&record.kind)?;
    let cfg = match &args.config {
        Some(p) => RunConfig::load(p)?,
        None => RunConfig::from_toml(std::path::Path::new("configs/tiny.toml"), TINY)?,
    };
    let config_dir = args.config.as_deref().map(crate::config::config_dir).unwrap_or_else(|| PathBuf::from("."));
    let mut section = cfg.section(kind.as_str());
    if section.plugin != record.name {
        section = PluginSection {
            kind: section.kind,
            plugin: record.name.clone(),
            config_toml: args.section.clone().unwrap_or_default(),
        };
    } else if let Some(s) = &args.section {
        section.config_toml = s.clone();
    }
    let ctx = super::host_context("cpu", "f32", cfg.seed, &config_dir, &crate::environment::cache_dir());
    crate::say!("checking {} plugin `{}` ({})", record.kind, record.name, record.origin);
    let kit = Kit { registry: &registry, section, ctx, cfg };
    let mut clauses = kit.section_clauses(kind)?;
    clauses.extend(match kind {
        PluginKind::Optimizer => kit.optimizer()?,
        PluginKind::DataLoader => kit.data_loader()?,
        PluginKind::Drafter => kit.drafter()?,
        PluginKind::Target => kit.target()?,
    });
    let mut failed = 0;
    for c in &clauses {
        match &c.result {
            Ok(()) => crate::say!("  pass  {}", c.name),
            Err(e) => {
                failed += 1;
                crate::say!("  FAIL  {}: {}", c.name, format!("{e:#}").replace('\n', " "));
            }
        }
    }
    if failed > 0 {
        crate::say!("{failed} of {} clauses failed", clauses.len());
        return Ok(ExitCode::from(1));
    }
    crate::say!("all {} clauses pass", clauses.len());
    Ok(ExitCode::SUCCESS)
}

/// The registry with the library loaded (probed first), and the plugin's record; a built-in's
/// name when no library of that name exists.
fn resolve(plugin_args: &[PathBuf], arg: &std::path::Path) -> Result<(PluginRecord, Registry)> {
    let text = arg.to_string_lossy().to_string();
    let builtin = Registry::new(plugin_args)?;
    let is_library = text.contains('/') || text.ends_with(".so") || super::find_library(arg).is_ok();
    if !is_library {
        let mut found: Vec<PluginRecord> =
            builtin.plugins.iter().map(|p| p.record.clone()).filter(|r| r.name == text).collect();
        return match found.len() {
            1 => Ok((found.remove(0), builtin)),
            0 => bail!("plugin {text}: no library of that name (see `plugins inspect`) and no plugin named `{text}`"),
            _ => bail!("plugin {text}: several plugins are named `{text}`; give the library's path"),
        };
    }
    let path = super::find_library(arg)?;
    let mut paths = plugin_args.to_vec();
    paths.push(path.clone());
    let registry = Registry::new(&paths)?;
    let shown = path.display().to_string();
    let record = registry
        .plugins
        .iter()
        .map(|p| &p.record)
        .find(|r| r.origin == shown)
        .cloned()
        .ok_or_else(|| anyhow!("plugin {shown}: not registered"))?;
    Ok((record, registry))
}

fn kind_of(kind: &str) -> Result<PluginKind> {
    [PluginKind::Target, PluginKind::Drafter, PluginKind::Optimizer, PluginKind::DataLoader]
        .into_iter()
        .find(|k| k.as_str() == kind)
        .ok_or_else(|| anyhow!("unknown plugin kind `{kind}`"))
}
