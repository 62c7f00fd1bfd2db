//! The plugin registry: built-ins (linked in, found through inventory) and shared libraries
//! given with `--plugin PATH`. The host sees every plugin only through `plugin-api`.
//!
//! A library is checked before this process runs any of its code, each check with a one-line
//! error: the path is a regular file; it is a shared object; it exports exactly one
//! `dflash_plugin_*` entry symbol, which holds a plugin header (all read from the file); its
//! SHA-256 (which a resume compares with the manifest's, through [`Registry::with_gate`]). Then a
//! confined child process (probe.rs: `dflash-host plugins probe`) loads the bytes of that hash and
//! checks what only loading can show: its plugin ABI major version is ours, its types' layouts
//! equal ours (abi_stable; an older minor version's trait vtables may lack the methods appended
//! since), it was built against the same tch / libtorch (build id); a library that crashes, hangs,
//! floods its output or signals others there costs the child, not this process. Only a plugin a
//! run actually creates is loaded here, after its file is read and hashed once more; what is
//! loaded is a sealed in-memory copy of the bytes hashed, never the file again, so a file swapped
//! after its check never runs. So `plugins list` and `plugins inspect` never load a library into
//! the host.

pub mod builtins;
pub mod check;
pub mod handles;
pub mod new;
pub mod probe;
mod record;

pub use record::PluginRecord;

use crate::{
    config::PluginSection,
    out::{first_line, one_line},
};
use anyhow::{anyhow, bail, Context, Result};
use plugin_api::{
    abi_major,
    abi_stable::{
        abi_stability::abi_checking::{check_layout_compatibility, AbiInstability},
        library::{LibHeader, LibraryError, RawLibrary},
        type_layout::{TLFieldOrFunction, TypeLayout},
        StableAbi,
    },
    builtin_plugins,
    describe::{FlopsPart, FlopsQuery, SectionCheck, SectionDoc},
    HostContext, PluginInfo, PluginInstance, PluginKind, PluginModule_Ref, ABI_VERSION,
};
use sha2::{Digest, Sha256};
use std::{
    path::{Path, PathBuf},
    sync::OnceLock,
};

/// The plugin kind of a config section (`target`, `drafter`, `optimizer`, `data`).
pub fn kind_of_section(section: &str) -> PluginKind {
    match section {
        "target" => PluginKind::Target,
        "drafter" => PluginKind::Drafter,
        "optimizer" => PluginKind::Optimizer,
        _ => PluginKind::DataLoader,
    }
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
        module: OnceLock<PluginModule_Ref>,
    },
}

impl Plugin {
    /// An instance for a config section that names this plugin; it must be of the section's kind.
    pub fn create(&self, kind: PluginKind, section: &PluginSection, ctx: &HostContext) -> Result<PluginInstance> {
        let instance = (self.module()?.create())(section.config_toml.as_str().into(), ctx)
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
        Ok(instance)
    }

    /// The plugin's root module, loading its library now if it is not loaded yet.
    pub fn module(&self) -> Result<PluginModule_Ref> {
        match &self.source {
            Source::Builtin(m) => Ok(*m),
            Source::Library { path, module } => {
                if let Some(m) = module.get() {
                    return Ok(*m);
                }
                let loaded = load_library(path, self.record.sha256.as_deref())?;
                if loaded.record != self.record {
                    bail!("plugin {}: changed since it was checked (its metadata differs); run again", path.display());
                }
                Ok(*module.get_or_init(|| loaded.module))
            }
        }
    }

    /// The plugin's config section reference (ABI 2.0); None for a plugin built before it, or
    /// one that does not describe its section. A library is loaded into this process for it.
    pub fn describe(&self) -> Result<Option<SectionDoc>> {
        let Some(describe) = self.module()?.describe() else { return Ok(None) };
        let doc = describe();
        Ok(doc.described.then_some(doc))
    }

    /// The plugin's check of its config section, before anything heavy loads (ABI 2.0): the
    /// files the run reads and what the host needs to know; nothing for a plugin built before it.
    pub fn check(&self, section: &PluginSection, ctx: &HostContext) -> Result<SectionCheck> {
        let Some(check) = self.module()?.check() else { return Ok(SectionCheck::default()) };
        check(section.config_toml.as_str().into(), ctx)
            .into_result()
            .map_err(|e| anyhow!("[{}] plugin `{}`: {e}", section.kind, section.plugin))
    }

    /// A target's forward FLOPs by part for `query`, from its config without its weights
    /// (ABI 2.0); None when the plugin cannot tell.
    pub fn target_flops(
        &self,
        section: &PluginSection,
        ctx: &HostContext,
        query: FlopsQuery,
    ) -> Result<Option<Vec<FlopsPart>>> {
        let Some(flops) = self.module()?.target_flops() else { return Ok(None) };
        let parts = flops(section.config_toml.as_str().into(), ctx, query)
            .into_result()
            .map_err(|e| anyhow!("[{}] plugin `{}`: {e}", section.kind, section.plugin))?;
        Ok(parts.into_option().map(|p| p.into_vec()))
    }

    /// The device memory the section takes at `query`, by part (ABI 2.2); None when the plugin
    /// cannot tell (or was built before 2.2).
    pub fn memory(
        &self,
        section: &PluginSection,
        ctx: &HostContext,
        query: plugin_api::describe::MemoryQuery,
    ) -> Result<Option<plugin_api::describe::SectionMemory>> {
        let Some(memory) = self.module()?.memory() else { return Ok(None) };
        let answer = memory(section.config_toml.as_str().into(), ctx, query)
            .into_result()
            .map_err(|e| anyhow!("[{}] plugin `{}`: {e}", section.kind, section.plugin))?;
        Ok(answer.into_option())
    }

    /// A drafter's parameter shapes as a saved config.json of this plugin implies them (ABI
    /// 2.0); None when the config is not this plugin's, or the plugin cannot tell.
    pub fn saved_shapes(&self, config_json: &str) -> Result<Option<plugin_api::describe::Shapes>> {
        let Some(shapes) = self.module()?.saved_shapes() else { return Ok(None) };
        let shapes = shapes(config_json.into()).into_result().map_err(|e| anyhow!("{e}"))?;
        Ok(shapes.into_option().map(|v| v.into_iter().map(|p| (p.name.into_string(), p.shape.into_vec())).collect()))
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
                record: probe::probe(path, &sha)?,
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

    /// Create the plugin a config section names; the instance must be of the section's kind.
    pub fn create(
        &self,
        kind: PluginKind,
        section: &PluginSection,
        ctx: &HostContext,
    ) -> Result<(PluginInstance, PluginRecord)> {
        let plugin = self.find(kind, &section.plugin).map_err(|e| anyhow!("[{}] {e}", section.kind))?;
        Ok((plugin.create(kind, section, ctx)?, plugin.record.clone()))
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

/// A library file read once: what is hashed, checked and loaded are these bytes.
pub struct LibraryFile {
    pub bytes: Vec<u8>,
    /// Its `dflash_plugin_*` entry symbol.
    pub symbol: String,
    pub sha256: String,
}

/// Read a library and make the checks that need only its bytes: a regular file, a shared object
/// with one entry symbol that holds a plugin header.
pub fn read_library(path: &Path) -> Result<LibraryFile> {
    let shown = path.display();
    let bytes = input_files::read_capped(path, MAX_LIBRARY_BYTES).map_err(|e| match e {
        input_files::InputError::NotRegular { kind: "a directory", .. } => {
            anyhow!("plugin {shown}: is a directory, expected a shared library (.so)")
        }
        e => anyhow!("plugin {e}"),
    })?;
    let symbol = entry_symbol(path, &bytes)?;
    let sha256 = format!("{:x}", Sha256::digest(&bytes));
    Ok(LibraryFile { bytes, symbol, sha256 })
}

/// [`read_library`]'s entry symbol and SHA-256.
pub fn check_file(path: &Path) -> Result<(String, String)> {
    read_library(path).map(|f| (f.symbol, f.sha256))
}

/// The library's `dflash_plugin_*` entry symbol, read from its dynamic symbol table without
/// loading it; it must be data that starts as `declare_plugin!`'s header does (abi_stable's magic
/// string and ABI version), not a function or other bytes.
fn entry_symbol(path: &Path, bytes: &[u8]) -> Result<String> {
    use object::{Object, ObjectKind, ObjectSection, ObjectSymbol, SymbolKind};
    let shown = path.display();
    let file = object::File::parse(bytes).map_err(|_| anyhow!("plugin {shown}: not a shared library"))?;
    if file.kind() != ObjectKind::Dynamic {
        bail!("plugin {shown}: not a shared library (an object of kind {:?})", file.kind());
    }
    let mut found: Vec<_> = file
        .dynamic_symbols()
        .filter(|s| s.is_definition())
        .filter(|s| s.name().is_ok_and(|n| n.starts_with("dflash_plugin_")))
        .collect();
    found.sort_by_key(|s| s.name().unwrap_or_default().to_string());
    found.dedup_by_key(|s| s.name().unwrap_or_default().to_string());
    let sym = match found.len() {
        0 => bail!("plugin {shown}: no `dflash_plugin_*` entry symbol (not a dflash plugin; declare one with plugin_api::declare_plugin!)"),
        1 => found.remove(0),
        _ => {
            let names: Vec<&str> = found.iter().filter_map(|s| s.name().ok()).collect();
            bail!("plugin {shown}: several entry symbols ({}); a plugin library declares exactly one", names.join(", "))
        }
    };
    let name = sym.name().unwrap_or_default().to_string();
    let not_header = |what: &str| {
        anyhow!("plugin {shown}: its entry symbol `{name}` is {what}, not the plugin header `plugin_api::declare_plugin!` exports; refused")
    };
    if sym.kind() != SymbolKind::Data {
        let what = match sym.kind() {
            SymbolKind::Text => "a function".to_string(),
            k => format!("of kind {k:?}"),
        };
        return Err(not_header(&what));
    }
    // abi_stable's AbiHeader opens the LibHeader: a magic string and its ABI version.
    let want = plugin_api::abi_stable::library::AbiHeader::VALUE;
    let header: Option<&[u8]> = sym
        .section_index()
        .and_then(|i| file.section_by_index(i).ok())
        .and_then(|section| section.data_range(sym.address(), 40).ok().flatten());
    let Some(header) = header else { return Err(not_header("data without contents in the file")) };
    if header[..32] != want.magic_string {
        return Err(not_header("other data"));
    }
    let version = |at: usize| u32::from_ne_bytes(header[at..at + 4].try_into().expect("4 bytes"));
    let (major, minor) = (version(32), version(36));
    if major != want.abi_major || (major == 0 && minor != want.abi_minor) {
        bail!(
            "plugin {shown}: built with abi_stable's ABI {major}.{minor}, this host's is {}.{}; rebuild it against this plugin-api",
            want.abi_major,
            want.abi_minor
        );
    }
    Ok(name)
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

/// A library loaded into this process.
pub struct Loaded {
    pub module: PluginModule_Ref,
    pub record: PluginRecord,
}

/// Load and check a plugin shared library in this process (see the module doc for the checks):
/// the probe process does this, and the host for a probed library it uses. `expect_sha256`: the
/// file must still be the one probed.
pub fn load_library(path: &Path, expect_sha256: Option<&str>) -> Result<Loaded> {
    let shown = path.display();
    let LibraryFile { bytes, symbol, sha256: sha } = read_library(path)?;
    if let Some(want) = expect_sha256.filter(|w| *w != sha) {
        bail!(
            "plugin {shown}: changed since it was checked (SHA-256 {} then, {} now); run again",
            &want[..16.min(want.len())],
            &sha[..16]
        );
    }
    let raw = load_bytes(path, &bytes)?;
    // Libraries are never unloaded: their tensors and vtables may outlive any handle.
    let raw: &'static RawLibrary = Box::leak(Box::new(raw));
    let header: &'static LibHeader = unsafe {
        *raw.get::<&'static LibHeader>(format!("{symbol}\0").as_bytes())
            .map_err(|e| anyhow!("plugin {shown}: entry symbol `{symbol}`: {}", one_line(&e.to_string())))?
    };
    let theirs = header.version_strings().version.to_string();
    if theirs.split('.').count() != 3
        || !theirs.split('.').all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
    {
        bail!("plugin {shown}: its plugin header gives no plugin ABI version (`{theirs}`); not a dflash plugin built with plugin_api::declare_plugin!");
    }
    if abi_major(&theirs) != abi_major(ABI_VERSION) {
        bail!("plugin {shown}: built for plugin ABI {theirs}, this host speaks plugin ABI {ABI_VERSION}: rebuild the plugin against plugin-api {ABI_VERSION}");
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
    Ok(Loaded { record: record(&info, &theirs, path.display().to_string(), Some(sha)), module })
}

/// `dlopen` exactly `bytes` (the ones hashed and checked), not the file again: a sealed in-memory
/// copy (memfd), so a file swapped or rewritten after the checks never runs. The library's
/// folder is not its `$ORIGIN` then; a dependency it names through `$ORIGIN` must be found
/// another way (an absolute RUNPATH, LD_LIBRARY_PATH).
fn load_bytes(path: &Path, bytes: &[u8]) -> Result<RawLibrary> {
    use std::{io::Write, os::fd::FromRawFd};
    let shown = path.display();
    let name = path.file_name().map_or_else(|| "plugin".into(), |n| n.to_string_lossy().replace('\0', ""));
    let name = std::ffi::CString::new(format!("dflash-plugin:{name}")).expect("no NUL left");
    const MFD_EXEC: libc::c_uint = 0x10; // executable on kernels that default to noexec memfds
    let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    // SAFETY: memfd_create with a valid name; the descriptor is owned by `file` from here.
    let fd = match unsafe { libc::memfd_create(name.as_ptr(), flags | MFD_EXEC) } {
        -1 => unsafe { libc::memfd_create(name.as_ptr(), flags) },
        fd => fd,
    };
    if fd < 0 {
        bail!("plugin {shown}: an in-memory copy to load: {}", std::io::Error::last_os_error());
    }
    let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.write_all(bytes).with_context(|| format!("plugin {shown}: writing its in-memory copy"))?;
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on the descriptor `file` owns.
    if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, seals) } < 0 {
        bail!("plugin {shown}: sealing its in-memory copy: {}", std::io::Error::last_os_error());
    }
    let library = RawLibrary::load_at(Path::new(&format!("/proc/self/fd/{fd}"))).map_err(|e| {
        let why = first_line(&e.to_string()).replace(&format!("/proc/self/fd/{fd}"), &shown.to_string());
        let origin = if bytes.windows(7).any(|w| w == b"$ORIGIN") {
            " (it is loaded from an in-memory copy of the bytes checked, where `$ORIGIN` does not name its folder: give its dependencies by an absolute RUNPATH or LD_LIBRARY_PATH)"
        } else {
            ""
        };
        anyhow!("plugin {shown}: cannot be loaded: {why}{origin}")
    })?;
    // The descriptor stays open as long as the library stays loaded (for good): the dynamic loader
    // knows a library by its path, and would take a later library loaded from the same reused
    // `/proc/self/fd/N` for this one.
    std::mem::forget(file);
    Ok(library)
}

/// The minor part of a plugin ABI version (`2.1.0` -> 1; 0 where it cannot be read).
pub(crate) fn abi_minor(version: &str) -> u64 {
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

/// Every non-empty line of `s`, trimmed, on one line.
/// The context a plugin is created with: where it runs, in which dtype, the run's seed, and the
/// folders its config's paths resolve against. The target's facts are added once the target is
/// built, for the plugins created after it.
pub fn host_context(device: &str, dtype: &str, seed: u64, config_dir: &Path, cache_dir: &Path) -> HostContext {
    HostContext {
        device: device.into(),
        dtype: dtype.into(),
        seed,
        config_dir: config_dir.display().to_string().into(),
        cache_dir: cache_dir.display().to_string().into(),
        target: plugin_api::abi_stable::std_types::RNone,
        replica: plugin_api::abi_stable::std_types::RNone,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shared library (C, built with `cc`) whose `which` returns `n`.
    fn library(dir: &Path, n: u32) -> Vec<u8> {
        let (src, so) = (dir.join(format!("lib{n}.c")), dir.join(format!("lib{n}.so")));
        std::fs::write(&src, format!("int which(void) {{ return {n}; }}\n")).unwrap();
        let out = std::process::Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
            .args(["-shared", "-fPIC", "-o"])
            .arg(&so)
            .arg(&src)
            .output()
            .expect("a C compiler (cc)");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        std::fs::read(&so).unwrap()
    }

    /// What is loaded is the bytes that were checked, not the file again: a library swapped in at
    /// the path after its bytes were read never runs.
    #[test]
    fn the_bytes_checked_are_the_bytes_loaded_whatever_the_file_holds_then() {
        let dir = tempfile::tempdir().unwrap();
        let (checked, swapped) = (library(dir.path(), 1), library(dir.path(), 2));
        let path = dir.path().join("plugin.so");
        std::fs::write(&path, &swapped).unwrap();
        let lib = load_bytes(&path, &checked).unwrap();
        // SAFETY: `which` is `int which(void)` in both libraries.
        let which = unsafe { *lib.get::<extern "C" fn() -> i32>(b"which\0").unwrap() };
        assert_eq!(which(), 1);
    }

    /// Libraries loaded one after the other are each their own (a run loads up to four): the
    /// dynamic loader knows a library by the path of its in-memory copy, which no later copy
    /// shares.
    #[test]
    fn libraries_loaded_in_turn_are_each_their_own() {
        let dir = tempfile::tempdir().unwrap();
        let (three, four) = (library(dir.path(), 3), library(dir.path(), 4));
        let a = load_bytes(&dir.path().join("three.so"), &three).unwrap();
        let b = load_bytes(&dir.path().join("four.so"), &four).unwrap();
        // SAFETY: `which` is `int which(void)` in both libraries.
        let which = |l: &RawLibrary| unsafe { *l.get::<extern "C" fn() -> i32>(b"which\0").unwrap() }();
        assert_eq!((which(&a), which(&b)), (3, 4));
    }
}
