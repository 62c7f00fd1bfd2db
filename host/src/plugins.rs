//! The plugin registry: built-ins (linked in, found through inventory) and shared libraries
//! given with `--plugin PATH`. The host sees every plugin only through `plugin-api`.

use crate::config::PluginSection;
use anyhow::{anyhow, bail, Context, Result};
use plugin_api::{
    abi_stable::library::{LibHeader, RawLibrary},
    builtin_plugins, HostContext, PluginInfo, PluginInstance, PluginKind, PluginModule_Ref,
};
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// Where a plugin came from, for logs and manifests.
#[derive(Debug, Clone, Serialize)]
pub struct PluginRecord {
    pub name: String,
    pub kind: String,
    pub version: String,
    pub description: String,
    /// `builtin` or the shared library's path.
    pub origin: String,
    pub sha256: Option<String>,
}

pub struct Plugin {
    pub module: PluginModule_Ref,
    pub record: PluginRecord,
}

pub struct Registry {
    pub plugins: Vec<Plugin>,
}

fn record(info: &PluginInfo, origin: String, sha256: Option<String>) -> PluginRecord {
    PluginRecord {
        name: info.name.to_string(),
        kind: info.kind.to_string(),
        version: info.version.to_string(),
        description: info.description.to_string(),
        origin,
        sha256,
    }
}

impl Registry {
    /// Built-ins, then each `--plugin` library; a library replaces a built-in of the same kind and
    /// name (logged), two libraries with one kind and name are an error.
    pub fn new(paths: &[PathBuf]) -> Result<Self> {
        // Keeps the built-in crates linked (and so their inventory entries alive).
        std::hint::black_box(&crate::builtins::BUILTIN_MODULES);
        let mut plugins: Vec<Plugin> = builtin_plugins()
            .map(|module| {
                let info = (module.info())();
                Plugin { record: record(&info, "builtin".into(), None), module }
            })
            .collect();
        for path in paths {
            let plugin = load_library(path)?;
            let (kind, name) = (&plugin.record.kind, &plugin.record.name);
            if let Some(i) = plugins.iter().position(|p| &p.record.kind == kind && &p.record.name == name) {
                if plugins[i].record.origin != "builtin" {
                    bail!("two plugins named `{name}` ({kind}): {} and {}", plugins[i].record.origin, path.display());
                }
                tracing::info!("plugin {kind} `{name}` from {} replaces the built-in", path.display());
                plugins[i] = plugin;
            } else {
                tracing::info!("loaded plugin {kind} `{name}` from {}", path.display());
                plugins.push(plugin);
            }
        }
        Ok(Self { plugins })
    }

    pub fn find(&self, kind: PluginKind, name: &str) -> Result<&Plugin> {
        let kind_s = kind.to_string();
        self.plugins.iter().find(|p| p.record.kind == kind_s && p.record.name == name).ok_or_else(|| {
            let known: Vec<_> =
                self.plugins.iter().filter(|p| p.record.kind == kind_s).map(|p| p.record.name.clone()).collect();
            anyhow!("no {kind} plugin named `{name}` (available: {}; load others with --plugin PATH)", known.join(", "))
        })
    }

    /// Create the plugin a config section names.
    pub fn create(&self, kind: PluginKind, section: &PluginSection, ctx: &HostContext) -> Result<(PluginInstance, PluginRecord)> {
        let plugin = self.find(kind, &section.plugin)?;
        let instance = (plugin.module.create())(section.config_toml.as_str().into(), ctx)
            .into_result()
            .map_err(|e| anyhow!("[{}] plugin `{}`: {e}", section.kind, section.plugin))?;
        Ok((instance, plugin.record.clone()))
    }
}

pub fn sha256_file(path: &Path) -> Result<String> {
    let mut h = Sha256::new();
    let mut f = std::fs::File::open(path).with_context(|| format!("{}", path.display()))?;
    std::io::copy(&mut f, &mut h)?;
    Ok(format!("{:x}", h.finalize()))
}

/// Load a plugin shared library: its entry symbol is `dflash_plugin_<crate name>`, the crate
/// name read from the file name (`liboptim_adamw.so` -> `optim_adamw`).
fn load_library(path: &Path) -> Result<Plugin> {
    let shown = path.display();
    if !path.exists() {
        bail!("plugin {shown}: no such file");
    }
    if path.is_dir() {
        bail!("plugin {shown}: is a directory, expected a shared library (.so)");
    }
    let sha = sha256_file(path)?;
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
    let crate_name = stem.strip_prefix("lib").unwrap_or(stem);
    let symbol = format!("dflash_plugin_{crate_name}\0");
    let raw = RawLibrary::load_at(path).map_err(|e| anyhow!("plugin {shown}: not a loadable shared library: {e}"))?;
    // Libraries are never unloaded: their tensors and vtables may outlive any handle (STACK.md).
    let raw: &'static RawLibrary = Box::leak(Box::new(raw));
    let header: &'static LibHeader = unsafe {
        *raw.get::<&'static LibHeader>(symbol.as_bytes())
            .map_err(|_| anyhow!("plugin {shown}: no entry symbol `{}` (not a dflash plugin?)", symbol.trim_end_matches('\0')))?
    };
    let module = header
        .init_root_module::<PluginModule_Ref>()
        .map_err(|e| anyhow!("plugin {shown}: incompatible with this host: {e}"))?;
    let theirs = (module.build_id())();
    if theirs.as_str() != plugin_api::build_id() {
        bail!("plugin {shown}: built for `{theirs}`, this host is `{}`", plugin_api::build_id());
    }
    let info = (module.info())();
    Ok(Plugin { record: record(&info, path.display().to_string(), Some(sha)), module })
}
