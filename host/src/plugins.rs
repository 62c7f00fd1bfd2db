//! The plugin registry: built-ins (linked in, found through inventory) and shared libraries
//! given with `--plugin PATH`. The host sees every plugin only through `plugin-api`.
//!
//! Loading a library checks, in order, each with a one-line error: the path is a file; it is a
//! shared object; it exports exactly one `dflash_plugin_*` entry symbol (read from the dynamic
//! symbol table before any of its code runs); its plugin ABI major version is ours; its types'
//! layouts equal ours (abi_stable); it was built against the same tch / libtorch (build id).

use crate::config::PluginSection;
use anyhow::{anyhow, bail, Context, Result};
use plugin_api::{
    abi_major,
    abi_stable::library::{LibHeader, LibraryError, RawLibrary},
    builtin_plugins, HostContext, PluginInfo, PluginInstance, PluginKind, PluginModule_Ref, ABI_VERSION,
};
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// What a plugin is and where it came from, for `plugins list` and manifests.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct PluginRecord {
    pub name: String,
    pub kind: String,
    pub version: String,
    pub description: String,
    /// Plugin ABI version it was built against.
    pub abi: String,
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

fn record(info: &PluginInfo, abi: &str, origin: String, sha256: Option<String>) -> PluginRecord {
    PluginRecord {
        name: info.name.to_string(),
        kind: info.kind.to_string(),
        version: info.version.to_string(),
        description: info.description.to_string(),
        abi: abi.to_string(),
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
                Plugin { record: record(&info, ABI_VERSION, "builtin".into(), None), module }
            })
            .collect();
        plugins.sort_by(|a, b| (&a.record.kind, &a.record.name).cmp(&(&b.record.kind, &b.record.name)));
        for arg in paths {
            let path = &find_library(arg)?;
            let plugin = load_library(path)?;
            let (kind, name) = (&plugin.record.kind, &plugin.record.name);
            if let Some(i) = plugins.iter().position(|p| &p.record.kind == kind && &p.record.name == name) {
                if plugins[i].record.origin != "builtin" {
                    bail!("two {kind} plugins named `{name}`: {} and {}", plugins[i].record.origin, path.display());
                }
                tracing::info!("{kind} plugin `{name}` from {} replaces the built-in", path.display());
                plugins[i] = plugin;
            } else {
                tracing::info!("loaded {kind} plugin `{name}` from {}", path.display());
                plugins.push(plugin);
            }
        }
        Ok(Self { plugins })
    }

    pub fn find(&self, kind: PluginKind, name: &str) -> Result<&Plugin> {
        let kind_s = kind.to_string();
        if let Some(p) = self.plugins.iter().find(|p| p.record.kind == kind_s && p.record.name == name) {
            return Ok(p);
        }
        if let Some(other) = self.plugins.iter().find(|p| p.record.name == name) {
            bail!("plugin `{name}` is a {} plugin, but the [{kind}] section needs a {kind} plugin", other.record.kind);
        }
        let known: Vec<_> = self.plugins.iter().filter(|p| p.record.kind == kind_s).map(|p| p.record.name.clone()).collect();
        bail!("no {kind} plugin named `{name}` (available: {}; load others with --plugin PATH)", known.join(", "))
    }

    /// Create the plugin a config section names; the instance must be of the section's kind.
    pub fn create(&self, kind: PluginKind, section: &PluginSection, ctx: &HostContext) -> Result<(PluginInstance, PluginRecord)> {
        let plugin = self.find(kind, &section.plugin).map_err(|e| anyhow!("[{}] {e}", section.kind))?;
        let instance = (plugin.module.create())(section.config_toml.as_str().into(), ctx)
            .into_result()
            .map_err(|e| anyhow!("[{}] plugin `{}`: {e}", section.kind, section.plugin))?;
        let made = match &instance {
            PluginInstance::Target(_) => PluginKind::Target,
            PluginInstance::Drafter(_) => PluginKind::Drafter,
            PluginInstance::Optimizer(_) => PluginKind::Optimizer,
            PluginInstance::DataLoader(_) => PluginKind::DataLoader,
        };
        if made != kind {
            bail!("[{}] plugin `{}` says it is a {kind} plugin but created a {made}", section.kind, section.plugin);
        }
        Ok((instance, plugin.record.clone()))
    }
}

pub fn sha256_file(path: &Path) -> Result<String> {
    let mut h = Sha256::new();
    let mut f = std::fs::File::open(path).with_context(|| format!("{}", path.display()))?;
    std::io::copy(&mut f, &mut h)?;
    Ok(format!("{:x}", h.finalize()))
}

/// The library's `dflash_plugin_*` entry symbol, read from its dynamic symbol table without
/// loading it.
fn entry_symbol(path: &Path, bytes: &[u8]) -> Result<String> {
    use object::{Object, ObjectKind, ObjectSymbol};
    let shown = path.display();
    let file = object::File::parse(bytes).map_err(|_| anyhow!("plugin {shown}: not a shared library"))?;
    if file.kind() != ObjectKind::Dynamic {
        bail!("plugin {shown}: not a shared library (an object of kind {:?})", file.kind());
    }
    let mut found: Vec<String> = file
        .dynamic_symbols()
        .filter(|s| s.is_definition())
        .filter_map(|s| s.name().ok().filter(|n| n.starts_with("dflash_plugin_")).map(str::to_string))
        .collect();
    found.sort();
    found.dedup();
    match found.len() {
        0 => bail!("plugin {shown}: no `dflash_plugin_*` entry symbol (not a dflash plugin; declare one with plugin_api::declare_plugin!)"),
        1 => Ok(found.remove(0)),
        _ => bail!("plugin {shown}: several entry symbols ({}); a plugin library declares exactly one", found.join(", ")),
    }
}

/// The library a `--plugin` argument names: a path as given (anything with a `/`, or a file
/// that exists), else a bare name looked up, in order, in `$DFLASH_PLUGIN_PATH` (colon-separated),
/// the running binary's folder and the `plugins/` folder beside it. `optim_adamw`,
/// `optim_adamw.so` and `liboptim_adamw.so` all name `liboptim_adamw.so`.
pub fn find_library(arg: &Path) -> Result<PathBuf> {
    let text = arg.to_string_lossy();
    if text.contains('/') || arg.exists() {
        return Ok(arg.to_path_buf());
    }
    let stem = text.strip_suffix(".so").unwrap_or(&text);
    let stem = stem.strip_prefix("lib").unwrap_or(stem);
    let files = [format!("lib{stem}.so"), format!("{stem}.so")];
    let mut dirs: Vec<PathBuf> = std::env::var_os("DFLASH_PLUGIN_PATH")
        .map(|v| std::env::split_paths(&v).filter(|d| !d.as_os_str().is_empty()).collect())
        .unwrap_or_default();
    if let Some(bin_dir) = std::env::current_exe().ok().and_then(|e| e.parent().map(Path::to_path_buf)) {
        dirs.push(bin_dir.join("plugins"));
        dirs.insert(dirs.len() - 1, bin_dir);
    }
    for dir in &dirs {
        for file in &files {
            let candidate = dir.join(file);
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    let looked: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
    bail!(
        "plugin {text}: no such file, and no {} in {} ($DFLASH_PLUGIN_PATH, the binary's folder, its plugins/ folder)",
        files.join(" or "),
        if looked.is_empty() { "(no folder to look in)".to_string() } else { looked.join(", ") }
    )
}

/// Load and check a plugin shared library (see the module doc for the checks).
pub fn load_library(path: &Path) -> Result<Plugin> {
    let shown = path.display();
    if !path.exists() {
        bail!("plugin {shown}: no such file");
    }
    if path.is_dir() {
        bail!("plugin {shown}: is a directory, expected a shared library (.so)");
    }
    let bytes = std::fs::read(path).with_context(|| format!("plugin {shown}"))?;
    let symbol = entry_symbol(path, &bytes)?;
    let sha = format!("{:x}", Sha256::digest(&bytes));
    let raw = RawLibrary::load_at(path).map_err(|e| anyhow!("plugin {shown}: cannot be loaded: {}", first_line(&e.to_string())))?;
    // Libraries are never unloaded: their tensors and vtables may outlive any handle (STACK.md).
    let raw: &'static RawLibrary = Box::leak(Box::new(raw));
    let header: &'static LibHeader = unsafe {
        *raw.get::<&'static LibHeader>(format!("{symbol}\0").as_bytes())
            .map_err(|e| anyhow!("plugin {shown}: entry symbol `{symbol}`: {}", first_line(&e.to_string())))?
    };
    let theirs = header.version_strings().version.to_string();
    if abi_major(&theirs) != abi_major(ABI_VERSION) {
        bail!("plugin {shown}: built for plugin ABI {theirs}, this host speaks ABI {ABI_VERSION} (major versions differ; rebuild the plugin against this plugin-api)");
    }
    let module = header.init_root_module::<PluginModule_Ref>().map_err(|e| match e {
        LibraryError::AbiInstability(_) => anyhow!(
            "plugin {shown}: its plugin-api types differ from this host's (built against another plugin-api {theirs}?); rebuild it"
        ),
        other => anyhow!("plugin {shown}: incompatible: {}", first_line(&other.to_string())),
    })?;
    let build = (module.build_id())();
    if build.as_str() != plugin_api::build_id() {
        bail!("plugin {shown}: built for `{build}`, this host is `{}`: tensors cannot cross between different libtorch builds", plugin_api::build_id());
    }
    let info = (module.info())();
    Ok(Plugin { record: record(&info, &theirs, path.display().to_string(), Some(sha)), module })
}

fn first_line(s: &str) -> String {
    s.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("").to_string()
}
