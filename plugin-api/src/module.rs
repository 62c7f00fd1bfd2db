//! Root modules: how the host finds, checks and instantiates a plugin.

use crate::{
    describe::{FlopsPart, FlopsQuery, MemoryQuery, ParamShape, SectionCheck, SectionDoc, SectionMemory},
    DataLoaderBox, DrafterBox, OptimizerBox, PluginError, TargetBox, TargetSpec,
};
use abi_stable::{
    declare_root_module_statics,
    library::RootModule,
    package_version_strings,
    sabi_types::VersionStrings,
    std_types::{ROption, RResult, RStr, RString, RVec},
    StableAbi,
};

/// The ABI version, plugin-api's package version: a plugin built against another major version
/// is refused (with one line naming both); minor versions only append fields and methods (below
/// each trait's `last_prefix_field`), so a plugin built against an older minor of this major
/// loads.
pub const ABI_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The ABI's major version.
pub fn abi_major(version: &str) -> &str {
    version.split('.').next().unwrap_or(version)
}

/// What a plugin must have been built against to share tensors with this host: the ABI, tch and
/// libtorch. abi_stable checks type layouts but sees tensors only as pointers, so this is checked
/// too.
pub fn build_id() -> String {
    let libtorch = if cfg!(feature = "test-other-libtorch") { "2.10.0" } else { "2.11.0" };
    format!("dflash-plugin-abi {}; tch 0.24.0; libtorch {libtorch}", abi_major(ABI_VERSION))
}

#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PluginKind {
    Target,
    Drafter,
    Optimizer,
    DataLoader,
}

impl PluginKind {
    pub fn as_str(self) -> &'static str {
        match self {
            PluginKind::Target => "target",
            PluginKind::Drafter => "drafter",
            PluginKind::Optimizer => "optimizer",
            PluginKind::DataLoader => "data",
        }
    }
}

impl std::fmt::Display for PluginKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Who a plugin is.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct PluginInfo {
    /// The name configs use (`optimizer = "adamw"`).
    pub name: RString,
    pub kind: PluginKind,
    pub version: RString,
    pub description: RString,
    /// Test-only: the layout an older plugin-api would have had.
    #[cfg(feature = "test-old-layout")]
    pub legacy_flags: u64,
}

impl PluginInfo {
    pub fn new(name: &str, kind: PluginKind, version: &str, description: &str) -> Self {
        Self {
            name: name.into(),
            kind,
            version: version.into(),
            description: description.into(),
            #[cfg(feature = "test-old-layout")]
            legacy_flags: 0,
        }
    }
}

/// What the host tells a plugin at creation.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct HostContext {
    /// `cpu` or `cuda:N`.
    pub device: RString,
    /// `f32` or `bf16`: compute dtype for activations and trainable weights.
    pub dtype: RString,
    pub seed: u64,
    /// Directory of the config file, for resolving relative paths.
    pub config_dir: RString,
    /// Cache directory for downloaded assets and derived data.
    pub cache_dir: RString,
    /// The loaded target's facts, for the drafter and the data loader (the host creates the
    /// target first).
    pub target: ROption<TargetSpec>,
    /// For a target spread over several ranks (tensor parallelism): where this rank's replica
    /// meets. None: the target runs whole on this rank.
    pub replica: ROption<ReplicaGroup>,
}

/// Where the ranks of one target replica meet to make their c10d process group: the run's store
/// (a c10d `TCPStore`), this replica's key prefix in it, and this rank's place in the replica.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct ReplicaGroup {
    /// `host:port` of the store.
    pub store: RString,
    /// The replica's keys in the store start with it (each replica its own).
    pub prefix: RString,
    /// This rank's place in the replica, 0 (the lead, which hands on the features) to size - 1.
    pub rank: u32,
    pub size: u32,
    /// How long a collective may wait for a peer, in seconds.
    pub timeout_s: u64,
}

impl HostContext {
    /// A path from a config section: `$DFLASH_CACHE/...` is in the cache folder, a relative path
    /// is against the config file's folder.
    pub fn resolve_path(&self, p: &str) -> std::path::PathBuf {
        use std::path::Path;
        if let Some(rest) = p.strip_prefix("$DFLASH_CACHE/") {
            return Path::new(self.cache_dir.as_str()).join(rest);
        }
        let path = Path::new(p);
        if path.is_absolute() {
            path.to_path_buf()
        } else {
            Path::new(self.config_dir.as_str()).join(path)
        }
    }

    /// `device` as a tch device (`cpu`, `cuda:N`).
    pub fn tch_device(&self) -> Result<tch::Device, PluginError> {
        match self.device.as_str() {
            "cpu" => Ok(tch::Device::Cpu),
            d => d
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(tch::Device::Cuda)
                .ok_or_else(|| PluginError::new(format!("device `{d}`: expected `cpu` or `cuda:N`"))),
        }
    }

    /// `dtype` as a tch kind (`f32`, `bf16`).
    pub fn tch_kind(&self) -> Result<tch::Kind, PluginError> {
        match self.dtype.as_str() {
            "f32" => Ok(tch::Kind::Float),
            "bf16" => Ok(tch::Kind::BFloat16),
            d => Err(PluginError::new(format!("dtype `{d}`: expected `f32` or `bf16`"))),
        }
    }

    /// CPU, f32, seed 0, no target: for tests and tools that create one plugin on its own.
    pub fn cpu() -> Self {
        Self {
            device: "cpu".into(),
            dtype: "f32".into(),
            seed: 0,
            config_dir: ".".into(),
            cache_dir: ".".into(),
            target: ROption::RNone,
            replica: ROption::RNone,
        }
    }
}

/// A created plugin instance of one kind.
#[repr(u8)]
#[derive(StableAbi)]
pub enum PluginInstance {
    Target(TargetBox),
    Drafter(DrafterBox),
    Optimizer(OptimizerBox),
    DataLoader(DataLoaderBox),
}

/// The root module every plugin exports.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = PluginModule_Ref)))]
#[sabi(missing_field(panic))]
pub struct PluginModule {
    /// [`build_id`] as the plugin saw it when built.
    pub build_id: extern "C" fn() -> RString,
    pub info: extern "C" fn() -> PluginInfo,
    /// Create an instance from the plugin's config section (TOML text, may be empty).
    #[sabi(last_prefix_field)]
    pub create: extern "C" fn(config_toml: RStr<'_>, ctx: &HostContext) -> RResult<PluginInstance, PluginError>,
    /// The config section's reference (ABI 2.0), generated from the type it is parsed into.
    /// Absent from a plugin built before it: the host then has no reference to show.
    #[sabi(missing_field(option))]
    pub describe: extern "C" fn() -> SectionDoc,
    /// Check the section before anything heavy loads (ABI 2.0): parse it, check what can be
    /// checked without weights or data, and say which files the run reads. Errors name the
    /// field (`field `lr`: ...`).
    #[sabi(missing_field(option))]
    pub check: extern "C" fn(config_toml: RStr<'_>, ctx: &HostContext) -> RResult<SectionCheck, PluginError>,
    /// A target's forward FLOPs by part, from its config without its weights (ABI 2.0); None
    /// when the plugin cannot tell.
    #[sabi(missing_field(option))]
    pub target_flops: extern "C" fn(
        config_toml: RStr<'_>,
        ctx: &HostContext,
        query: FlopsQuery,
    ) -> RResult<ROption<RVec<FlopsPart>>, PluginError>,
    /// A drafter's parameter shapes as a saved config.json of this plugin implies them (ABI
    /// 2.0), for `export`'s check of the weights; None when the config is not this plugin's.
    #[sabi(missing_field(option))]
    pub saved_shapes: extern "C" fn(config_json: RStr<'_>) -> RResult<ROption<RVec<ParamShape>>, PluginError>,
    /// The device memory a section takes at a run's shapes, by part, from its config without its
    /// weights (ABI 2.2): the host's estimate before anything loads. Absent from a plugin built
    /// before it, or None: the host leaves the section out of its estimate and says so.
    #[sabi(missing_field(option))]
    pub memory: extern "C" fn(
        config_toml: RStr<'_>,
        ctx: &HostContext,
        query: MemoryQuery,
    ) -> RResult<ROption<SectionMemory>, PluginError>,
}

impl RootModule for PluginModule_Ref {
    declare_root_module_statics! {PluginModule_Ref}
    const BASE_NAME: &'static str = "dflash_plugin";
    const NAME: &'static str = "dflash_plugin";
    #[cfg(not(any(feature = "test-other-major", feature = "test-older-minor")))]
    const VERSION_STRINGS: VersionStrings = package_version_strings!();
    /// A major version this host does not speak.
    #[cfg(feature = "test-other-major")]
    const VERSION_STRINGS: VersionStrings = VersionStrings::new("99.0.0");
    /// This major version's first minor (at `N.0.0` that is this version itself).
    #[cfg(all(feature = "test-older-minor", not(feature = "test-other-major")))]
    const VERSION_STRINGS: VersionStrings = VersionStrings::new(concat!(env!("CARGO_PKG_VERSION_MAJOR"), ".0.0"));
}

/// A plugin linked into the host, registered with `inventory` by [`declare_plugin!`].
pub struct BuiltinPlugin {
    pub module: fn() -> PluginModule_Ref,
}

inventory::collect!(BuiltinPlugin);

/// Every built-in plugin linked into this binary.
pub fn builtin_plugins() -> impl Iterator<Item = PluginModule_Ref> {
    inventory::iter::<BuiltinPlugin>.into_iter().map(|b| (b.module)())
}

/// Declare a plugin crate's root module, as a built-in (inventory) and as a shared-library entry
/// symbol `dflash_plugin_<name>` (unique per plugin, so several can link into one binary).
///
/// ```ignore
/// plugin_api::declare_plugin!(optim_adamw, info, create, section = ParamsAdamW);
/// ```
///
/// `section = TYPE` names the type the config section is parsed into, a [`Section`]
/// (`#[derive(Describe)]`): the host then shows its reference and runs its checks before anything
/// heavy loads. Without it the plugin has neither.
///
/// [`Section`]: crate::describe::Section
#[macro_export]
macro_rules! declare_plugin {
    ($name:ident, $info:path, $create:path) => {
        $crate::declare_plugin!(@module $name, $info, $create, $crate::describe::Undescribed);
    };
    ($name:ident, $info:path, $create:path, section = $section:ty) => {
        $crate::declare_plugin!(@module $name, $info, $create, $section);
    };
    (@module $name:ident, $info:path, $create:path, $section:ty) => {
        pub fn plugin_module() -> $crate::PluginModule_Ref {
            use $crate::abi_stable::prefix_type::PrefixTypeTrait;
            use $crate::abi_stable::std_types::{ROption, RResult, RStr, RString, RVec};
            // Prefixed names: the macro's arguments may be called `info` / `create` themselves.
            extern "C" fn __dflash_build_id() -> RString {
                $crate::build_id().into()
            }
            extern "C" fn __dflash_info() -> $crate::PluginInfo {
                $crate::info_or_panic(|| $info())
            }
            extern "C" fn __dflash_create(
                config: RStr<'_>,
                ctx: &$crate::HostContext,
            ) -> RResult<$crate::PluginInstance, $crate::PluginError> {
                $crate::catch_plugin_panic(|| $create(config.as_str(), ctx)).into()
            }
            extern "C" fn __dflash_describe() -> $crate::describe::SectionDoc {
                $crate::catch_plugin_panic(|| Ok($crate::describe::section_doc::<$section>()))
                    .unwrap_or_default()
            }
            extern "C" fn __dflash_check(
                config: RStr<'_>,
                ctx: &$crate::HostContext,
            ) -> RResult<$crate::describe::SectionCheck, $crate::PluginError> {
                $crate::catch_plugin_panic(|| $crate::describe::check_section::<$section>(config.as_str(), ctx))
                    .into()
            }
            extern "C" fn __dflash_target_flops(
                config: RStr<'_>,
                ctx: &$crate::HostContext,
                query: $crate::describe::FlopsQuery,
            ) -> RResult<ROption<RVec<$crate::describe::FlopsPart>>, $crate::PluginError> {
                $crate::catch_plugin_panic(|| {
                    $crate::describe::section_flops::<$section>(config.as_str(), ctx, query)
                })
                .into()
            }
            extern "C" fn __dflash_saved_shapes(
                config_json: RStr<'_>,
            ) -> RResult<ROption<RVec<$crate::describe::ParamShape>>, $crate::PluginError> {
                $crate::catch_plugin_panic(|| $crate::describe::section_saved_shapes::<$section>(config_json.as_str())).into()
            }
            extern "C" fn __dflash_memory(
                config: RStr<'_>,
                ctx: &$crate::HostContext,
                query: $crate::describe::MemoryQuery,
            ) -> RResult<ROption<$crate::describe::SectionMemory>, $crate::PluginError> {
                $crate::catch_plugin_panic(|| {
                    $crate::describe::section_memory::<$section>(config.as_str(), ctx, query)
                })
                .into()
            }
            $crate::PluginModule {
                build_id: __dflash_build_id,
                info: __dflash_info,
                create: __dflash_create,
                describe: __dflash_describe,
                check: __dflash_check,
                target_flops: __dflash_target_flops,
                saved_shapes: __dflash_saved_shapes,
                memory: __dflash_memory,
            }
            .leak_into_prefix()
        }

        $crate::inventory::submit! { $crate::BuiltinPlugin { module: plugin_module } }

        /// The shared-library entry point (what `#[export_root_module]` makes, under a name of
        /// this plugin's own).
        #[export_name = concat!("dflash_plugin_", stringify!($name))]
        pub static DFLASH_PLUGIN_HEADER: $crate::abi_stable::library::LibHeader = {
            extern "C" fn erased() -> $crate::abi_stable::library::RootModuleResult {
                $crate::abi_stable::library::__call_root_module_loader(plugin_module)
            }
            // SAFETY: `erased` returns this crate's PluginModule_Ref, the type named here.
            unsafe {
                $crate::abi_stable::library::LibHeader::from_constructor::<$crate::PluginModule_Ref>(
                    erased,
                    $crate::abi_stable::library::CheckTypeLayout::Yes,
                )
            }
        };
    };
}

thread_local! {
    /// Set while a plugin call runs under [`catch_plugin_panic`].
    static IN_PLUGIN_CALL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Wrap the panic hook once (per copy of std: the host's, and each shared library's) so a panic
/// that [`catch_plugin_panic`] turns into an error prints nothing; the error says it all. With
/// RUST_BACKTRACE set the usual report is printed too.
fn quiet_caught_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let caught = IN_PLUGIN_CALL.with(|c| c.get());
            if !caught || std::env::var_os("RUST_BACKTRACE").is_some_and(|v| v != "0") {
                previous(info);
            }
        }));
    });
}

/// `info()`, or on a panic a record with an empty name and the panic as its description (the
/// host refuses such a plugin with that message).
pub fn info_or_panic(info: impl FnOnce() -> PluginInfo) -> PluginInfo {
    catch_plugin_panic(|| Ok(info()))
        .unwrap_or_else(|e| PluginInfo::new("", PluginKind::Optimizer, "", &format!("`info` {}", e.message)))
}

/// Run `f`, turning a panic into a [`PluginError`] (`panicked: <message>`) so it never unwinds
/// across the ABI.
pub fn catch_plugin_panic<T>(f: impl FnOnce() -> Result<T, PluginError>) -> Result<T, PluginError> {
    catch_panic(f).unwrap_or_else(|message| Err(PluginError::new(format!("panicked: {message}"))))
}

/// Run `f`; a panic is its message, quiet (see [`quiet_caught_panics`]).
pub(crate) fn catch_panic<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    quiet_caught_panics();
    let outer = IN_PLUGIN_CALL.with(|c| c.replace(true));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    IN_PLUGIN_CALL.with(|c| c.set(outer));
    result.map_err(|payload| {
        let msg = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic payload".into());
        without_libtorch_frames(&msg)
    })
}

/// A libtorch error unwrapped in a panic (`... Torch("[enforce fail ...] what\nframe #0: ...")`)
/// as its first line, `libtorch: what`: the C++ frames that follow are dozens of lines that say
/// nothing to the user.
fn without_libtorch_frames(msg: &str) -> String {
    let Some(at) = msg.find("Torch(\"") else { return msg.to_string() };
    let what = &msg[at + "Torch(\"".len()..];
    let end = ["\\nframe #", "\nframe #", "\")"].iter().filter_map(|m| what.find(m)).min().unwrap_or(what.len());
    format!("libtorch: {}", what[..end].trim_end_matches("\\n").trim_end())
}

#[cfg(test)]
mod libtorch_message_tests {
    use super::without_libtorch_frames;

    #[test]
    fn a_libtorch_error_loses_its_frames() {
        let debug = r#"called `Result::unwrap()` on an `Err` value: Torch("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 128000000000 bytes. Error code 12 (Cannot allocate memory)\nframe #0: c10::ThrowEnforceNotMet(char const*, int) + 0x6a (0x7f in libc10.so)\nframe #1: c10::alloc_cpu(unsigned long)\n")"#;
        assert_eq!(
            without_libtorch_frames(debug),
            "libtorch: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 128000000000 bytes. Error code 12 (Cannot allocate memory)"
        );
        assert_eq!(without_libtorch_frames("Torch(\"shape mismatch\")"), "libtorch: shape mismatch");
        assert_eq!(without_libtorch_frames("index out of bounds"), "index out of bounds");
    }
}
