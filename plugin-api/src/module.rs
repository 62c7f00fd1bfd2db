//! Root modules: how the host finds, checks and instantiates a plugin.

use crate::{DataLoaderBox, DrafterBox, OptimizerBox, PluginError, TargetBox, TargetSpec};
use abi_stable::{
    declare_root_module_statics,
    library::RootModule,
    package_version_strings,
    sabi_types::VersionStrings,
    std_types::{ROption, RResult, RStr, RString},
    StableAbi,
};

/// Major.minor of this ABI. A major change breaks loading; a minor one only appends.
pub const ABI_VERSION: &str = "1.0";

/// What a plugin must have been built against to share tensors with this host: the ABI, tch and
/// libtorch. abi_stable checks type layouts but sees tensors only as pointers, so this is checked
/// too (STACK.md).
pub fn build_id() -> String {
    format!("dflash-plugin-abi {ABI_VERSION}; tch 0.24.0; libtorch 2.11.0")
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
}

impl RootModule for PluginModule_Ref {
    declare_root_module_statics! {PluginModule_Ref}
    const BASE_NAME: &'static str = "dflash_plugin";
    const NAME: &'static str = "dflash_plugin";
    const VERSION_STRINGS: VersionStrings = package_version_strings!();
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
/// plugin_api::declare_plugin!(optim_adamw, info, create);
/// ```
#[macro_export]
macro_rules! declare_plugin {
    ($name:ident, $info:path, $create:path) => {
        pub fn plugin_module() -> $crate::PluginModule_Ref {
            use $crate::abi_stable::prefix_type::PrefixTypeTrait;
            // Prefixed names: the macro's arguments may be called `info` / `create` themselves.
            extern "C" fn __dflash_build_id() -> $crate::abi_stable::std_types::RString {
                $crate::build_id().into()
            }
            extern "C" fn __dflash_info() -> $crate::PluginInfo {
                $info()
            }
            extern "C" fn __dflash_create(
                config: $crate::abi_stable::std_types::RStr<'_>,
                ctx: &$crate::HostContext,
            ) -> $crate::abi_stable::std_types::RResult<$crate::PluginInstance, $crate::PluginError> {
                $crate::catch_plugin_panic(|| $create(config.as_str(), ctx)).into()
            }
            $crate::PluginModule { build_id: __dflash_build_id, info: __dflash_info, create: __dflash_create }
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

/// Run `f`, turning a panic into a [`PluginError`] so it never unwinds across the ABI.
pub fn catch_plugin_panic<T>(f: impl FnOnce() -> Result<T, PluginError>) -> Result<T, PluginError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic payload".into());
            Err(PluginError::new(format!("panicked: {msg}")))
        }
    }
}
