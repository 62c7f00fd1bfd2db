//! An optimizer plugin ("faulty") that does nothing, or panics inside `step` when its config
//! says `panic_at_step = N`. Built with plugin-api's test features it is refused at load.

use plugin_api::{
    abi_stable::{
        sabi_trait::TD_Opaque,
        std_types::{RResult, RVec},
    },
    catch_plugin_panic,
    serde::Deserialize,
    HostContext, NamedTensor, Optimizer, Optimizer_TO, PluginError, PluginInfo, PluginInstance, PluginKind,
};

#[derive(Deserialize)]
#[serde(crate = "plugin_api::serde", deny_unknown_fields)]
struct Config {
    #[serde(default)]
    panic_at_step: u64,
}

struct Faulty {
    panic_at_step: u64,
    steps: u64,
}

impl Optimizer for Faulty {
    fn init(&mut self, _params: RVec<NamedTensor>) -> RResult<(), PluginError> {
        RResult::ROk(())
    }

    fn step(&mut self, _lr_scale: f64) -> RResult<(), PluginError> {
        catch_plugin_panic(|| {
            self.steps += 1;
            if self.steps == self.panic_at_step {
                panic!("deliberate failure at step {}", self.steps);
            }
            Ok(())
        })
        .into()
    }

    fn base_lr(&self) -> f64 {
        0.0
    }

    fn state(&self) -> RVec<NamedTensor> {
        RVec::new()
    }

    fn load_state(&mut self, _state: RVec<NamedTensor>) -> RResult<(), PluginError> {
        RResult::ROk(())
    }
}

fn info() -> PluginInfo {
    PluginInfo::new("faulty", PluginKind::Optimizer, "0.1.0", "test plugin")
}

fn create(config: &str, _ctx: &HostContext) -> Result<PluginInstance, PluginError> {
    let cfg: Config = plugin_api::parse_section(config)?;
    Ok(PluginInstance::Optimizer(Optimizer_TO::from_value(Faulty { panic_at_step: cfg.panic_at_step, steps: 0 }, TD_Opaque)))
}

plugin_api::declare_plugin!(faulty, info, create);
