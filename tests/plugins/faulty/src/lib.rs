//! An optimizer plugin ("faulty") that does nothing, or panics inside `step` when its config
//! says `panic_at_step = N`, or writes NaN into every parameter at `nan_at_step = N` (a diverged
//! run), or panics in the value-returning method `panic_in` names (`base_lr`, `state`), or with
//! `lossy_carry = true` exports a first moment per parameter that its import halves. Built with
//! plugin-api's test features it is refused at load.

use plugin_api::{
    roles, serde::Deserialize, tch::Tensor, HostContext, Imported, OptimizerPlugin, PluginError, PluginInfo,
    PluginInstance, PluginKind, StateByRole,
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
    /// A broken carry for `plugins check`: the state it exports does not survive its own import.
    #[serde(default)]
    lossy_carry: bool,
    /// Accepted and unused: a run's AdamW section switched to this plugin with `--set` keeps it.
    #[serde(default)]
    #[allow(dead_code)]
    lr: f64,
}

struct Faulty {
    panic_at_step: u64,
    nan_at_step: u64,
    panic_in: String,
    touch_all: bool,
    lossy_carry: bool,
    steps: u64,
    params: Vec<(String, Tensor)>,
    /// Each parameter's first moment, for `lossy_carry`: ones at init.
    moments: Vec<Tensor>,
}

impl OptimizerPlugin for Faulty {
    fn init(&mut self, params: Vec<(String, Tensor)>) -> Result<(), PluginError> {
        self.moments = params.iter().map(|(_, t)| t.ones_like()).collect();
        self.params = params;
        Ok(())
    }

    fn step(&mut self, _lr_scale: f64) -> Result<(), PluginError> {
        self.steps += 1;
        if self.steps == self.panic_at_step {
            panic!("deliberate failure at step {}", self.steps);
        }
        if self.touch_all {
            let _guard = plugin_api::tch::no_grad_guard();
            for (_, p) in &mut self.params {
                let _ = p.g_add_scalar_(1e-3);
            }
        }
        if self.steps == self.nan_at_step {
            let _guard = plugin_api::tch::no_grad_guard();
            for (_, p) in &mut self.params {
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

    fn export_state(&self) -> Option<StateByRole> {
        let params = self.params.iter().zip(&self.moments);
        let params = params.map(|((n, _), m)| (n.clone(), [(roles::FIRST_MOMENT.to_string(), m.copy())].into()));
        self.lossy_carry.then(|| StateByRole { step: Some(self.steps), params: params.collect() })
    }

    fn import_state(&mut self, state: StateByRole) -> Result<Option<Imported>, PluginError> {
        if !self.lossy_carry {
            return Ok(None);
        }
        let mut report = Imported { step: state.step.is_some(), ..Imported::default() };
        self.steps = state.step.unwrap_or(0);
        for (name, mut roles) in state.params {
            let (i, m) = (self.params.iter().position(|(n, _)| *n == name), roles.remove(roles::FIRST_MOMENT));
            if let (Some(i), Some(m)) = (i, m) {
                self.moments[i] = m * 0.5; // the fault
                report.took(roles::FIRST_MOMENT);
            }
        }
        Ok(Some(report))
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
        lossy_carry: cfg.lossy_carry,
        steps: 0,
        params: Vec::new(),
        moments: Vec::new(),
    }))
}

plugin_api::declare_plugin!(faulty, info, create);
