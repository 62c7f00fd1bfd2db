//! An optimizer plugin ("faulty") that does nothing, or panics inside `step` when its config
//! says `panic_at_step = N`, or writes NaN into every parameter at `nan_at_step = N` (a diverged
//! run), or panics in the value-returning method `panic_in` names (`base_lr`, `state`). Built
//! with plugin-api's test features it is refused at load.

use plugin_api::{
    serde::Deserialize, tch::Tensor, HostContext, OptimizerPlugin, PluginError, PluginInfo, PluginInstance, PluginKind,
};

#[derive(Deserialize)]
#[serde(crate = "plugin_api::serde", deny_unknown_fields)]
struct Config {
    #[serde(default)]
    panic_at_step: u64,
    #[serde(default)]
    nan_at_step: u64,
    #[serde(default)]
    panic_in: String,
    /// A broken optimizer for `plugins check`: every step moves every parameter, gradient or not.
    #[serde(default)]
    touch_all: bool,
}

struct Faulty {
    panic_at_step: u64,
    nan_at_step: u64,
    panic_in: String,
    touch_all: bool,
    steps: u64,
    params: Vec<Tensor>,
}

impl OptimizerPlugin for Faulty {
    fn init(&mut self, params: Vec<(String, Tensor)>) -> Result<(), PluginError> {
        self.params = params.into_iter().map(|(_, t)| t).collect();
        Ok(())
    }

    fn step(&mut self, _lr_scale: f64) -> Result<(), PluginError> {
        self.steps += 1;
        if self.steps == self.panic_at_step {
            panic!("deliberate failure at step {}", self.steps);
        }
        if self.touch_all {
            let _guard = plugin_api::tch::no_grad_guard();
            for p in &mut self.params {
                let _ = p.g_add_scalar_(1e-3);
            }
        }
        if self.steps == self.nan_at_step {
            let _guard = plugin_api::tch::no_grad_guard();
            for p in &mut self.params {
                let _ = p.fill_(f64::NAN);
            }
        }
        Ok(())
    }

    fn base_lr(&self) -> f64 {
        if self.panic_in == "base_lr" {
            panic!("deliberate panic in base_lr");
        }
        0.0
    }

    fn state(&self) -> Vec<(String, Tensor)> {
        if self.panic_in == "state" {
            panic!("deliberate panic in state");
        }
        Vec::new()
    }

    fn load_state(&mut self, _state: Vec<(String, Tensor)>) -> Result<(), PluginError> {
        Ok(())
    }
}

fn info() -> PluginInfo {
    PluginInfo::new("faulty", PluginKind::Optimizer, "0.1.0", "test plugin")
}

fn create(config: &str, _ctx: &HostContext) -> Result<PluginInstance, PluginError> {
    let cfg: Config = plugin_api::parse_section(config)?;
    Ok(PluginInstance::optimizer(Faulty {
        panic_at_step: cfg.panic_at_step,
        nan_at_step: cfg.nan_at_step,
        panic_in: cfg.panic_in,
        touch_all: cfg.touch_all,
        steps: 0,
        params: Vec::new(),
    }))
}

plugin_api::declare_plugin!(faulty, info, create);
