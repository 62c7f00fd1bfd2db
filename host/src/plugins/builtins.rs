//! The plugins linked into the host. Naming each crate's module function here is what makes the
//! linker keep the crate, and with it its `inventory` registration.

/// Every built-in plugin crate's root module; `plugin_api::builtin_plugins()` finds the same set.
pub const BUILTIN_MODULES: [fn() -> plugin_api::PluginModule_Ref; 6] = [
    target_hf::plugin_module,
    drafter_dflash::plugin_module,
    drafter_gdn::plugin_module,
    optim_adamw::plugin_module,
    optim_muon::plugin_module,
    data_chat::plugin_module,
];
