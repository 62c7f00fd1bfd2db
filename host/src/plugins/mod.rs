//! The plugin registry: built-ins (linked in, found through inventory) and shared libraries
//! given with `--plugin PATH`. The host sees every plugin only through `plugin-api`.
//!
//! A library is checked before this process runs any of its code, each check with a one-line
//! error: the path is a regular file; it is a shared object; it exports exactly one
//! `dflash_plugin_*` entry symbol (both read from the file); its SHA-256 (which a resume compares
//! with the manifest's, through [`Registry::with_gate`]). Then a child process (`dflash-host
//! plugins probe`) loads it and checks what only loading can show: its plugin ABI major version is
//! ours, its types' layouts equal ours (abi_stable; an older minor version's trait vtables may lack
//! the methods appended since), it was built against the same tch / libtorch (build id); a library
//! that crashes or hangs there costs the child, not this process. Only a
//! plugin a run actually creates is loaded here (`dlopen`), after its file is hashed once more.
//! So `plugins list` and `plugins inspect` never load a library into the host.

pub mod builtins;
pub mod check;
pub mod new;
mod poison;

pub use poison::{Instance, Poison, PoisonFn};

use crate::config::PluginSection;
use anyhow::{anyhow, bail, Context, Result};
use plugin_api::{
    abi_major,
    abi_stable::{
        abi_stability::abi_checking::{check_layout_compatibility, AbiInstability},
        library::{LibHeader, LibraryError, RawLibrary},
        type_layout::{TLFieldOrFunction, TypeLayout},
        StableAbi,
    },
    builtin_plugins, HostContext, PluginInfo, PluginInstance, PluginKind, PluginModule_Ref, ABI_VERSION,
};
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::{
    path::{Path, PathBuf},
    sync::OnceLock,
    time::Duration,
};

/// What a plugin is and where it came from, for `plugins list` and manifests.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
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
    pub record: PluginRecord,
    source: Source,
}

enum Source {
    Builtin(PluginModule_Ref),
    /// A probed library, loaded into this process the first time a plugin of it is created.
    Library {
        path: PathBuf,
        module: OnceLock<(PluginModule_Ref, Poison)>,
    },
}

impl Plugin {
    /// The plugin's root module, loading its library now if it is not loaded yet.
    pub fn module(&self) -> Result<PluginModule_Ref> {
        match &self.source {
            Source::Builtin(m) => Ok(*m),
            Source::Library { path, module } => {
                if let Some((m, _)) = module.get() {
                    return Ok(*m);
                }
                let loaded = load_library(path, self.record.sha256.as_deref())?;
                if loaded.record != self.record {
                    bail!("plugin {}: changed since it was checked (its metadata differs); run again", path.display());
                }
                Ok(module.get_or_init(|| (loaded.module, Poison::Library(loaded.poison))).0)
            }
        }
    }

    /// How to ask this plugin about its instances' panics (a library not loaded yet has none).
    pub fn poison(&self) -> Poison {
        match &self.source {
            Source::Builtin(_) => Poison::Builtin,
            Source::Library { module, .. } => module.get().map_or(Poison::Library(None), |(_, p)| *p),
        }
    }
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
    /// Built-ins, then each `--plugin` library (checked and probed, not loaded); a library
    /// replaces a built-in of the same kind and name (logged), two libraries with one kind and
    /// name are an error.
    pub fn new(paths: &[PathBuf]) -> Result<Self> {
        Self::with_gate(paths, |_, _| Ok(()))
    }

    /// As [`Registry::new`], with `gate(path, sha256)` called for each library after the checks
    /// that read its file and before any of its code runs (resume refuses a library the run did
    /// not start with here).
    pub fn with_gate(paths: &[PathBuf], gate: impl Fn(&Path, &str) -> Result<()>) -> Result<Self> {
        // Keeps the built-in crates linked (and so their inventory entries alive).
        std::hint::black_box(&crate::plugins::builtins::BUILTIN_MODULES);
        let mut plugins: Vec<Plugin> = builtin_plugins()
            .map(|module| {
                let info = checked_info(module, "a built-in plugin")?;
                Ok(Plugin {
                    record: record(&info, ABI_VERSION, "builtin".into(), None),
                    source: Source::Builtin(module),
                })
            })
            .collect::<Result<_>>()?;
        plugins.sort_by(|a, b| (&a.record.kind, &a.record.name).cmp(&(&b.record.kind, &b.record.name)));
        for arg in paths {
            let path = &find_library(arg)?;
            let (_, sha) = check_file(path)?;
            gate(path, &sha)?;
            let plugin = Plugin {
                record: probe(path)?,
                source: Source::Library { path: path.clone(), module: OnceLock::new() },
            };
            let (kind, name) = (&plugin.record.kind, &plugin.record.name);
            if let Some(i) = plugins.iter().position(|p| &p.record.kind == kind && &p.record.name == name) {
                if plugins[i].record.origin != "builtin" {
                    bail!("two {kind} plugins named `{name}`: {} and {}", plugins[i].record.origin, path.display());
                }
                tracing::info!("{kind} plugin `{name}` from {} replaces the built-in", path.display());
                plugins[i] = plugin;
            } else {
                tracing::info!("{kind} plugin `{name}` from {}", path.display());
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
        let known: Vec<_> =
            self.plugins.iter().filter(|p| p.record.kind == kind_s).map(|p| p.record.name.clone()).collect();
        bail!("no {kind} plugin named `{name}` (available: {}; load others with --plugin PATH)", known.join(", "))
    }

    /// How to ask the plugin of `kind` named `name` about its instances' panics.
    pub fn poison(&self, kind: PluginKind, name: &str) -> Poison {
        self.find(kind, name).map_or(Poison::Library(None), Plugin::poison)
    }

    /// Create the plugin a config section names; the instance must be of the section's kind.
    pub fn create(
        &self,
        kind: PluginKind,
        section: &PluginSection,
        ctx: &HostContext,
    ) -> Result<(PluginInstance, PluginRecord)> {
        let plugin = self.find(kind, &section.plugin).map_err(|e| anyhow!("[{}] {e}", section.kind))?;
        let instance = (plugin.module()?.create())(section.config_toml.as_str().into(), ctx)
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
    let mut f = input_files::open_regular(path)?;
    std::io::copy(&mut f, &mut h).with_context(|| format!("reading {}", path.display()))?;
    Ok(format!("{:x}", h.finalize()))
}

/// Plugin libraries are small (tens of MB); a larger file is refused before it is read whole.
const MAX_LIBRARY_BYTES: u64 = 1 << 30;

/// The checks that only read the file: a regular file, a shared object with one entry symbol.
/// Returns the entry symbol and the file's SHA-256.
pub fn check_file(path: &Path) -> Result<(String, String)> {
    let shown = path.display();
    let bytes = input_files::read_capped(path, MAX_LIBRARY_BYTES).map_err(|e| match e {
        input_files::InputError::NotRegular { kind: "a directory", .. } => {
            anyhow!("plugin {shown}: is a directory, expected a shared library (.so)")
        }
        e => anyhow!("plugin {e}"),
    })?;
    let symbol = entry_symbol(path, &bytes)?;
    Ok((symbol, format!("{:x}", Sha256::digest(&bytes))))
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

/// How long a probe may take to load a library (a library whose constructor hangs is refused).
const PROBE_TIMEOUT: Duration = Duration::from_secs(120);

/// The library's record, from a child process that loads and checks it (`dflash-host plugins
/// probe PATH`, which runs [`load_library`] and prints the record as JSON).
pub fn probe(path: &Path) -> Result<PluginRecord> {
    use std::process::{Command, Stdio};
    let shown = path.display();
    let exe = std::env::current_exe().context("finding this program to probe a plugin with")?;
    let child = Command::new(&exe)
        .args(["plugins", "probe"])
        .arg(path)
        .env("RUST_LOG", "error")
        .env_remove("RUST_BACKTRACE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("plugin {shown}: starting a probe process ({})", exe.display()))?;
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let out = match rx.recv_timeout(PROBE_TIMEOUT) {
        Ok(out) => out.with_context(|| format!("plugin {shown}: waiting for its probe process"))?,
        Err(_) => {
            // SAFETY: kill(2) on the probe child started above (not yet reaped: the thread waits).
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            bail!("plugin {shown}: still loading after {} s in a probe process (a constructor that never returns?); refused", PROBE_TIMEOUT.as_secs());
        }
    };
    if out.status.success() {
        let text = String::from_utf8_lossy(&out.stdout);
        return serde_json::from_str(text.trim())
            .map_err(|e| anyhow!("plugin {shown}: its probe printed no plugin record ({e})"));
    }
    use std::os::unix::process::ExitStatusExt;
    if let Some(sig) = out.status.signal() {
        bail!("plugin {shown}: loading it crashed the probe process ({}); refused", signal_name(sig));
    }
    let err = String::from_utf8_lossy(&out.stderr);
    if let Some(line) = err.lines().rev().find_map(|l| l.strip_prefix("error: ")) {
        bail!("{line}");
    }
    let mut lines = err.lines().map(str::trim);
    if lines.by_ref().any(|l| l.contains("panicked at")) {
        let message = lines.next().unwrap_or("");
        bail!("plugin {shown}: loading it crashed the probe process (a panic: {message}); refused");
    }
    bail!("plugin {shown}: its probe process failed ({}): {}", out.status, first_line(&err))
}

fn signal_name(sig: i32) -> String {
    let name = match sig {
        libc::SIGSEGV => "SIGSEGV, a segmentation fault",
        libc::SIGABRT => "SIGABRT, an abort",
        libc::SIGBUS => "SIGBUS, a bus error",
        libc::SIGILL => "SIGILL, an illegal instruction",
        libc::SIGFPE => "SIGFPE, an arithmetic fault",
        libc::SIGKILL => "SIGKILL",
        _ => return format!("signal {sig}"),
    };
    name.to_string()
}

/// A library loaded into this process.
pub struct Loaded {
    pub module: PluginModule_Ref,
    pub record: PluginRecord,
    pub poison: Option<PoisonFn>,
}

/// Load and check a plugin shared library in this process (see the module doc for the checks):
/// the probe process does this, and the host for a probed library it uses. `expect_sha256`: the
/// file must still be the one probed.
pub fn load_library(path: &Path, expect_sha256: Option<&str>) -> Result<Loaded> {
    let shown = path.display();
    let (symbol, sha) = check_file(path)?;
    if let Some(want) = expect_sha256.filter(|w| *w != sha) {
        bail!(
            "plugin {shown}: changed since it was checked (SHA-256 {} then, {} now); run again",
            &want[..16.min(want.len())],
            &sha[..16]
        );
    }
    let raw = RawLibrary::load_at(path)
        .map_err(|e| anyhow!("plugin {shown}: cannot be loaded: {}", first_line(&e.to_string())))?;
    // Libraries are never unloaded: their tensors and vtables may outlive any handle.
    let raw: &'static RawLibrary = Box::leak(Box::new(raw));
    let header: &'static LibHeader = unsafe {
        *raw.get::<&'static LibHeader>(format!("{symbol}\0").as_bytes())
            .map_err(|e| anyhow!("plugin {shown}: entry symbol `{symbol}`: {}", first_line(&e.to_string())))?
    };
    let theirs = header.version_strings().version.to_string();
    if abi_major(&theirs) != abi_major(ABI_VERSION) {
        bail!("plugin {shown}: built for plugin ABI {theirs}, this host speaks ABI {ABI_VERSION} (major versions differ; rebuild the plugin against this plugin-api)");
    }
    let refused = |e: LibraryError| {
        match e {
        LibraryError::AbiInstability(_) => anyhow!(
            "plugin {shown}: its plugin-api types differ from this host's (built against another plugin-api {theirs}?); rebuild it"
        ),
        other => anyhow!("plugin {shown}: incompatible: {}", first_line(&other.to_string())),
    }
    };
    let module = match header.init_root_module::<PluginModule_Ref>() {
        Ok(m) => m,
        Err(LibraryError::AbiInstability(_))
            if abi_minor(&theirs) < abi_minor(ABI_VERSION) && header.layout().is_some_and(only_appended) =>
        {
            // SAFETY: the layouts were just compared: they differ only as an older minor version's do.
            unsafe { header.init_root_module_with_unchecked_layout::<PluginModule_Ref>() }.map_err(refused)?
        }
        Err(e) => return Err(refused(e)),
    };
    let build = (module.build_id())();
    if build.as_str() != plugin_api::build_id() {
        bail!("plugin {shown}: built for `{build}`, this host is `{}`: tensors cannot cross between different libtorch builds", plugin_api::build_id());
    }
    let info = checked_info(module, &format!("plugin {shown}"))?;
    let query = symbol.replacen("dflash_plugin_", "dflash_poison_", 1);
    // SAFETY: declare_plugin! defines this symbol as a PoisonFn; older plugins lack it.
    let poison = unsafe { raw.get::<PoisonFn>(format!("{query}\0").as_bytes()).ok().map(|f| *f) };
    Ok(Loaded { record: record(&info, &theirs, path.display().to_string(), Some(sha)), module, poison })
}

fn abi_minor(version: &str) -> u64 {
    version.split('.').nth(1).and_then(|m| m.parse().ok()).unwrap_or(0)
}

/// Whether a library's types differ from this host's only as a plugin built against an older
/// minor version's do: trait vtables (prefix types) without the methods appended since. abi_stable
/// refuses those (its interface may not have more fields than the library), but a generated
/// trait object checks that a method after `last_prefix_field` is in the plugin's vtable before
/// calling it and runs the trait's default otherwise. Every other difference, including in the
/// methods both have, still refuses the library.
fn only_appended(theirs: &'static TypeLayout) -> bool {
    let Err(e) = check_layout_compatibility(<PluginModule_Ref as StableAbi>::LAYOUT, theirs) else { return true };
    // Each nested type's own errors (none for the types on the way down to one that differs).
    e.errors.iter().all(|err| {
        let in_vtable = err
            .stack_trace
            .last()
            .is_some_and(|f| matches!(&f.expected, TLFieldOrFunction::Field(field) if field.layout().is_prefix_kind()));
        err.errs.iter().all(|i| in_vtable && matches!(i, AbiInstability::FieldCountMismatch(n) if n.expected > n.found))
    })
}

/// The plugin's info; one whose `info()` panicked (an empty name, the panic as description) is
/// refused.
fn checked_info(module: PluginModule_Ref, who: &str) -> Result<PluginInfo> {
    let info = (module.info())();
    if info.name.is_empty() {
        bail!("{who}: {}", if info.description.is_empty() { "has no name" } else { info.description.as_str() });
    }
    Ok(info)
}

fn first_line(s: &str) -> String {
    s.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("").to_string()
}
