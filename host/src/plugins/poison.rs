//! Panics in a plugin's value-returning methods, as the host asks about them.

use plugin_api::{abi_stable::std_types::RString, DataLoaderBox, DrafterBox, OptimizerBox, PluginInstance, TargetBox};

/// A library's `dflash_poison_<name>` (see `plugin_api::declare_plugin!`).
pub type PoisonFn = extern "C" fn(usize) -> RString;

/// How to ask a plugin whether a value-returning method of an instance panicked. Such a method
/// cannot return an error across the ABI: plugin-api gives the host a placeholder (no weights,
/// zero, empty) and records the panic, which the host asks for after its calls so that it stops
/// before using the placeholder.
#[derive(Clone, Copy)]
pub enum Poison {
    /// Linked in: this binary's plugin-api holds the record.
    Builtin,
    /// The library's query; None for one built before plugin-api had it (its next fallible
    /// call still fails with the panic).
    Library(Option<PoisonFn>),
}

impl Poison {
    /// The panic left on `instance` (`` `<method>` panicked: <message> ``), taken.
    pub fn take(self, instance: &impl Instance) -> Option<String> {
        self.take_at(instance.address())
    }

    /// [`Poison::take`] by the instance's [`Instance::address`].
    pub fn take_at(self, address: usize) -> Option<String> {
        let why = match self {
            Poison::Builtin => plugin_api::author::take_poison(address)?,
            Poison::Library(f) => f?(address).into_string(),
        };
        (!why.is_empty()).then_some(why)
    }
}

/// A created plugin instance, known to its plugin-api by the address of its value.
pub trait Instance {
    fn address(&self) -> usize;
}

macro_rules! instance {
    ($($t:ty),*) => {$(
        impl Instance for $t {
            fn address(&self) -> usize {
                self.obj.sabi_erased_ref().as_ptr() as usize
            }
        }
    )*};
}
instance!(TargetBox, DrafterBox, OptimizerBox, DataLoaderBox);

impl Instance for PluginInstance {
    fn address(&self) -> usize {
        match self {
            PluginInstance::Target(t) => t.address(),
            PluginInstance::Drafter(d) => d.address(),
            PluginInstance::Optimizer(o) => o.address(),
            PluginInstance::DataLoader(d) => d.address(),
        }
    }
}
