//! SGD with momentum as a dflash optimizer plugin: the template for third-party plugins.
//!
//! What a plugin does: parse its config section (`plugin_api::parse_section`), implement one
//! plugin trait (here `Optimizer`), never let a panic cross the ABI (`catch_plugin_panic`), and
//! declare itself once with `declare_plugin!`.

use plugin_api::{
    abi_stable::{
        sabi_trait::TD_Opaque,
        std_types::{RResult, RVec},
    },
    catch_plugin_panic,
    serde::Deserialize,
    tch::{self, Kind, Tensor},
    HostContext, NamedTensor, Optimizer, Optimizer_TO, PluginError, PluginInfo, PluginInstance, PluginKind,
};

/// The `[optimizer]` section (besides `plugin = "sgd"`).
#[derive(Debug, Clone, Deserialize)]
#[serde(crate = "plugin_api::serde", deny_unknown_fields)]
pub struct SgdConfig {
    pub lr: f64,
    #[serde(default = "default_momentum")]
    pub momentum: f64,
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

impl Optimizer for Sgd {
    fn init(&mut self, params: RVec<NamedTensor>) -> RResult<(), PluginError> {
        self.params = params
            .into_iter()
            .map(|nt| {
                let p = nt.tensor.into_tensor();
                let buf = Tensor::zeros(p.size(), (Kind::Float, p.device()));
                (nt.name.into_string(), p, buf)
            })
            .collect();
        RResult::ROk(())
    }

    fn step(&mut self, lr_scale: f64) -> RResult<(), PluginError> {
        catch_plugin_panic(|| {
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
        })
        .into()
    }

    fn base_lr(&self) -> f64 {
        self.cfg.lr
    }

    fn state(&self) -> RVec<NamedTensor> {
        let mut out = vec![NamedTensor::new("step", Tensor::from(self.steps))];
        out.extend(self.params.iter().map(|(n, _, b)| NamedTensor::new(format!("{n}.momentum_buffer"), b.shallow_clone())));
        out.into()
    }

    fn load_state(&mut self, state: RVec<NamedTensor>) -> RResult<(), PluginError> {
        catch_plugin_panic(|| {
            for nt in state {
                if nt.name.as_str() == "step" {
                    self.steps = nt.tensor.tensor().int64_value(&[]);
                } else if let Some((_, _, buf)) =
                    self.params.iter_mut().find(|(n, _, _)| format!("{n}.momentum_buffer") == nt.name.as_str())
                {
                    *buf = nt.tensor.into_tensor();
                } else {
                    return Err(PluginError::new(format!("unexpected optimizer state `{}`", nt.name)));
                }
            }
            Ok(())
        })
        .into()
    }
}

fn info() -> PluginInfo {
    PluginInfo::new("sgd", PluginKind::Optimizer, env!("CARGO_PKG_VERSION"), "SGD with momentum (template plugin)")
}

fn create(config: &str, _ctx: &HostContext) -> Result<PluginInstance, PluginError> {
    let cfg: SgdConfig = plugin_api::parse_section(config)?;
    if !(cfg.lr > 0.0) || !(0.0..1.0).contains(&cfg.momentum) {
        return Err(PluginError::new("field `lr` must be > 0 and `momentum` in [0, 1)"));
    }
    Ok(PluginInstance::Optimizer(Optimizer_TO::from_value(Sgd { cfg, params: Vec::new(), steps: 0 }, TD_Opaque)))
}

plugin_api::declare_plugin!(optim_sgd, info, create);

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
