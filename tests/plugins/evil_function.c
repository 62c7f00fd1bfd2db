/* A shared object whose `dflash_plugin_*` entry symbol is a function, not the plugin header
 * `plugin_api::declare_plugin!` exports. Built by tests/plugins_so.rs with `cc`. */
__attribute__((visibility("default"))) int dflash_plugin_function(void) { return 42; }
