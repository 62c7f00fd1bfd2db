//! SGD with momentum as a dflash optimizer plugin: the template for third-party plugins.
//!
//! What a plugin does: describe its config section (`#[derive(Describe)]`: every field's doc
//! comment, type, default and range is its reference in `dflash-host plugins doc`), check it
//! before anything heavy loads (`Section::check`), implement one plain-Rust plugin trait (here
//! `OptimizerPlugin`), and declare itself once with `declare_plugin!(.., section = TYPE)`. A
//! panic anywhere becomes an error the host reports; `plugin_api` does the ABI side.

use plugin_api::{
    describe::SectionCheck,
    roles,
    serde::Deserialize,
    tch::{self, Kind, Tensor},
    Describe, HostContext, Imported, OptimizerPlugin, PluginError, PluginInfo, PluginInstance, PluginKind, Section,
    StateByRole,
};

/// The `[optimizer]` section (besides `plugin = "sgd"`).
#[derive(Debug, Clone, Deserialize, Describe)]
#[serde(crate = "plugin_api::serde", deny_unknown_fields)]
pub struct SgdConfig {
    /// Peak learning rate (the host's schedule multiplies it).
    #[describe(range = "> 0")]
    pub lr: f64,
    /// Momentum coefficient.
    #[serde(default = "default_momentum")]
    #[describe(range = "in [0, 1)")]
    pub momentum: f64,
}

/// Checked before anything heavy loads (and again at `create`): errors name the field.
impl Section for SgdConfig {
    fn check(&self, _ctx: &HostContext) -> Result<SectionCheck, PluginError> {
        if !(self.lr > 0.0) {
            return Err(PluginError::new(format!("field `lr`: must be > 0, got {}", self.lr)));
        }
        if !(0.0..1.0).contains(&self.momentum) {
            return Err(PluginError::new(format!("field `momentum`: must be in [0, 1), got {}", self.momentum)));
        }
        Ok(SectionCheck::default())
    }
}

fn default_momentum() -> f64 {
    0.9
}

/// torch.optim.SGD with momentum (dampening 0, no Nesterov): buf = mu*buf + g; p -= lr*buf.
pub fn sgd_momentum_update(p: &mut Tensor, grad: &Tensor, buf: &mut Tensor, lr: f64, momentum: f64) {
    let _ = buf.g_mul_scalar_(momentum);
    let _ = buf.g_add_(grad);
    let _ = p.g_add_(&(&*buf * -lr));
}

pub struct Sgd {
    cfg: SgdConfig,
    params: Vec<(String, Tensor, Tensor)>,
    steps: i64,
}

impl OptimizerPlugin for Sgd {
    fn init(&mut self, params: Vec<(String, Tensor)>) -> Result<(), PluginError> {
        self.params = params
            .into_iter()
            .map(|(name, p)| {
                let buf = Tensor::zeros(p.size(), (Kind::Float, p.device()));
                (name, p, buf)
            })
            .collect();
        Ok(())
    }

    fn step(&mut self, lr_scale: f64) -> Result<(), PluginError> {
        let _guard = tch::no_grad_guard();
        let lr = self.cfg.lr * lr_scale;
        for (_, p, buf) in &mut self.params {
            let g = p.grad();
            if g.defined() {
                sgd_momentum_update(p, &g.to_kind(Kind::Float), buf, lr, self.cfg.momentum);
            }
        }
        self.steps += 1;
        Ok(())
    }

    fn base_lr(&self) -> f64 {
        self.cfg.lr
    }

    fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![("step".to_string(), Tensor::from(self.steps))];
        out.extend(self.params.iter().map(|(n, _, b)| (format!("{n}.momentum_buffer"), b.shallow_clone())));
        out
    }

    fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<(), PluginError> {
        for (name, t) in state {
            if name == "step" {
                self.steps = t.int64_value(&[]);
            } else if let Some((_, p, buf)) =
                self.params.iter_mut().find(|(n, _, _)| format!("{n}.momentum_buffer") == name)
            {
                if t.size() != p.size() {
                    return Err(PluginError::new(format!(
                        "optimizer state `{name}`: shape {:?}, expected {:?}",
                        t.size(),
                        p.size()
                    )));
                }
                *buf = t.to_kind(Kind::Float).to_device(p.device());
            } else {
                return Err(PluginError::new(format!("unexpected optimizer state `{name}`")));
            }
        }
        Ok(())
    }

    /// For a fork that carries the state to another optimizer (`optimizer_state = "carry"`): the
    /// momentum as a first moment. torch's buffer sums the gradients (buf = mu*buf + g), a first
    /// moment averages them (lerp(m, g, 1-mu)): m = (1 - mu) * buf.
    fn export_state(&self) -> Option<StateByRole> {
        let scale = 1.0 - self.cfg.momentum;
        let params = self
            .params
            .iter()
            .map(|(name, _, buf)| (name.clone(), [(roles::FIRST_MOMENT.to_string(), buf * scale)].into()))
            .collect();
        Some(StateByRole { step: Some(self.steps as u64), params })
    }

    /// Another optimizer's first moments become the momentum buffers (buf = m / (1 - mu)); roles
    /// SGD has no use for (AdamW's second moment) are reported as left.
    fn import_state(&mut self, state: StateByRole) -> Result<Option<Imported>, PluginError> {
        let mut report = Imported { step: state.step.is_some(), ..Imported::default() };
        let mut bufs = Vec::new();
        for (name, roles) in state.params {
            let Some(i) = self.params.iter().position(|(n, _, _)| *n == name) else {
                return Err(PluginError::new(format!(
                    "carried state names `{name}`, not a parameter of this optimizer"
                )));
            };
            for (role, t) in roles {
                let p = &self.params[i].1;
                if role != roles::FIRST_MOMENT {
                    report.passed(&role);
                } else if t.size() != p.size() {
                    return Err(PluginError::new(format!(
                        "carried `{name}` {role}: shape {:?}, expected {:?}",
                        t.size(),
                        p.size()
                    )));
                } else {
                    // A copy: the tensors given may be another optimizer's live state.
                    bufs.push((i, t.to_device(p.device()).to_kind(Kind::Float) / (1.0 - self.cfg.momentum)));
                    report.took(&role);
                }
            }
        }
        for (i, buf) in bufs {
            self.params[i].2 = buf;
        }
        self.steps = state.step.map_or(self.steps, |s| s as i64);
        Ok(Some(report))
    }
}

/// The name a config gives in `plugin = "..."` (`plugins new` replaces it).
const PLUGIN_NAME: &str = "sgd";

fn info() -> PluginInfo {
    PluginInfo::new(
        PLUGIN_NAME,
        PluginKind::Optimizer,
        env!("CARGO_PKG_VERSION"),
        "SGD with momentum (template plugin)",
    )
}

fn create(config: &str, ctx: &HostContext) -> Result<PluginInstance, PluginError> {
    let cfg: SgdConfig = plugin_api::parse_section(config)?;
    cfg.check(ctx)?;
    Ok(PluginInstance::optimizer(Sgd { cfg, params: Vec::new(), steps: 0 }))
}

plugin_api::declare_plugin!(optim_sgd, info, create, section = SgdConfig);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_steps_follow_the_momentum_formula() {
        let mut p = Tensor::from_slice(&[1.0f32, -2.0]);
        let mut buf = Tensor::zeros([2], (Kind::Float, tch::Device::Cpu));
        let g = Tensor::from_slice(&[0.5f32, 1.0]);
        sgd_momentum_update(&mut p, &g, &mut buf, 0.1, 0.9);
        sgd_momentum_update(&mut p, &g, &mut buf, 0.1, 0.9);
        // buf1 = g, p1 = p0 - 0.1 g; buf2 = 1.9 g, p2 = p1 - 0.19 g = p0 - 0.29 g
        let want = Tensor::from_slice(&[1.0f32 - 0.145, -2.0 - 0.29]);
        assert!(p.allclose(&want, 1e-6, 1e-6, false));
    }
}
