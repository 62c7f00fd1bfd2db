//! An optimizer plugin ("faulty") that does nothing, or panics inside `step` when its config
//! says `panic_at_step = N`, or writes NaN into every parameter at `nan_at_step = N` (a diverged
//! run). Built with plugin-api's test features it is refused at load.

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
    #[serde(default)]
    nan_at_step: u64,
}

struct Faulty {
    panic_at_step: u64,
    nan_at_step: u64,
    steps: u64,
    params: Vec<plugin_api::tch::Tensor>,
}

impl Optimizer for Faulty {
    fn init(&mut self, params: RVec<NamedTensor>) -> RResult<(), PluginError> {
        self.params = params.into_iter().map(|nt| nt.tensor.into_tensor()).collect();
        RResult::ROk(())
    }

    fn step(&mut self, _lr_scale: f64) -> RResult<(), PluginError> {
        catch_plugin_panic(|| {
            self.steps += 1;
            if self.steps == self.panic_at_step {
                panic!("deliberate failure at step {}", self.steps);
            }
            if self.steps == self.nan_at_step {
                let _guard = plugin_api::tch::no_grad_guard();
                for p in &mut self.params {
                    let _ = p.fill_(f64::NAN);
                }
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
    Ok(PluginInstance::Optimizer(Optimizer_TO::from_value(Faulty { panic_at_step: cfg.panic_at_step, nan_at_step: cfg.nan_at_step, steps: 0, params: Vec::new() }, TD_Opaque)))
}

plugin_api::declare_plugin!(faulty, info, create);
