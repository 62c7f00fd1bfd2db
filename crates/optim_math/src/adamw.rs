//! AdamW, exactly as torch.optim.AdamW (single-tensor path) orders its operations
//!.

use plugin_api::{tch::Tensor, PluginError};
use serde::Deserialize;
use std::sync::atomic::AtomicBool;

/// Hyper-parameters; `Default` is PyTorch's, with `fused` on.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, plugin_api::Describe)]
#[serde(deny_unknown_fields, default)]
pub struct ParamsAdamW {
    /// Peak learning rate (the host's schedule multiplies it).
    #[describe(range = "> 0")]
    pub lr: f64,
    /// Decay rates of the first and second moment averages.
    #[describe(range = "in [0, 1)")]
    pub betas: [f64; 2],
    /// Added to the denominator's square root.
    #[describe(range = "> 0")]
    pub eps: f64,
    /// Decoupled weight decay: p *= 1 - lr * weight_decay each step.
    #[describe(range = ">= 0")]
    pub weight_decay: f64,
    /// On CUDA, update every tensor in one fused kernel (torch's `AdamW(fused=True)`), equal to
    /// the single-tensor path to rounding; the CPU always takes the single-tensor path.
    pub fused: bool,
}

impl Default for ParamsAdamW {
    fn default() -> Self {
        Self { lr: 1e-3, betas: [0.9, 0.999], eps: 1e-8, weight_decay: 1e-2, fused: true }
    }
}

/// The `[optimizer]` section of the AdamW plugin: its checks are its ranges (creating the
/// optimizer allocates nothing either way).
impl plugin_api::Section for ParamsAdamW {
    fn check(&self, _ctx: &plugin_api::HostContext) -> Result<plugin_api::describe::SectionCheck, PluginError> {
        self.validate()?;
        Ok(Default::default())
    }

    /// Two fp32 moments a parameter, an fp32 master copy of a parameter of another dtype, and
    /// the step's fp32 copies of the gradients.
    fn memory(
        &self,
        ctx: &plugin_api::HostContext,
        q: plugin_api::describe::MemoryQuery,
    ) -> Result<Option<plugin_api::describe::SectionMemory>, PluginError> {
        Ok(Some(crate::memory::optimizer_state(ctx, q, &[("AdamW moments (fp32)", 8.0)])?))
    }
}

impl ParamsAdamW {
    pub fn from_toml(text: &str) -> Result<Self, PluginError> {
        let p: Self = plugin_api::parse_section(text)?;
        p.validate()?;
        Ok(p)
    }

    /// Range checks; errors name the field (`field `lr`: ...`).
    pub fn validate(&self) -> Result<(), PluginError> {
        self.validate_in("")
    }

    /// As [`validate`](Self::validate), for a table nested under `prefix` (e.g. `adamw.`): errors
    /// name `prefix` + field.
    #[allow(clippy::neg_cmp_op_on_partial_ord)] // `!(x > 0.0)` also rejects NaN
    pub fn validate_in(&self, prefix: &str) -> Result<(), PluginError> {
        let bad = |field: &str, why: &str| Err(PluginError::new(format!("field `{prefix}{field}`: {why}")));
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return bad("lr", &format!("must be > 0, got {}", self.lr));
        }
        for (i, b) in self.betas.iter().enumerate() {
            if !(0.0..1.0).contains(b) {
                return bad("betas", &format!("betas[{i}] must be in [0, 1), got {b}"));
            }
        }
        if !(self.eps > 0.0) {
            return bad("eps", &format!("must be > 0, got {}", self.eps));
        }
        if !(self.weight_decay >= 0.0) {
            return bad("weight_decay", &format!("must be >= 0, got {}", self.weight_decay));
        }
        Ok(())
    }
}

/// One AdamW update of `p` (fp32) in place, `step` counted from 1. The order of operations is
/// torch's, so results match it to rounding.
#[allow(clippy::too_many_arguments)]
pub fn adamw_update(
    p: &mut Tensor,
    grad: &Tensor,
    exp_avg: &mut Tensor,
    exp_avg_sq: &mut Tensor,
    step: i64,
    lr: f64,
    h: &ParamsAdamW,
) {
    let [beta1, beta2] = h.betas;
    let _ = p.g_mul_scalar_(1.0 - lr * h.weight_decay);
    let _ = exp_avg.lerp_(grad, 1.0 - beta1);
    // torch: exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1-beta2), i.e. v + (value*g)*g.
    let _ = exp_avg_sq.g_mul_scalar_(beta2);
    let _ = exp_avg_sq.g_add_(&((grad * (1.0 - beta2)) * grad));
    let bias_correction1 = 1.0 - beta1.powi(step as i32);
    let bias_correction2 = 1.0 - beta2.powi(step as i32);
    let step_size = lr / bias_correction1;
    let denom = (exp_avg_sq.sqrt() / bias_correction2.sqrt()) + h.eps;
    // torch: p.addcdiv_(exp_avg, denom, value=-step_size), i.e. p + value*(m/denom).
    let _ = p.g_add_(&((&*exp_avg / denom) * -step_size));
}

/// [`adamw_update`] for many fp32 tensors at once, through libtorch's fused multi-tensor kernel
/// (torch's `AdamW(fused=True)`): the same formula, equal to rounding, not bit for bit. `step` is
/// a float scalar on the tensors' device holding the step number.
pub fn adamw_update_fused(
    params: &[Tensor],
    grads: &[Tensor],
    exp_avgs: &[Tensor],
    exp_avg_sqs: &[Tensor],
    step: &Tensor,
    lr: f64,
    h: &ParamsAdamW,
) -> Result<(), PluginError> {
    kernels::optim::fused_adamw(params, grads, exp_avgs, exp_avg_sqs, step, lr, h.betas, h.weight_decay, h.eps)
        .map_err(PluginError::new)
}

/// [`adamw_update`] of a bf16 CUDA parameter through its fp32 `master` in one kernel
/// (`kernels::adamw`): master and moments updated, the parameter set to the master rounded, the
/// bf16 gradient read as it is. False where the kernel does not apply (another dtype, the CPU) or
/// failed (reported once), with nothing updated: the caller takes [`adamw_update_fused`] over
/// fp32 copies instead.
#[allow(clippy::too_many_arguments)]
pub fn adamw_update_master(
    param: &Tensor,
    grad: &Tensor,
    master: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    step: i64,
    lr: f64,
    h: &ParamsAdamW,
) -> bool {
    static FAILED: AtomicBool = AtomicBool::new(false);
    if !kernels::adamw::applies(param, grad, master, exp_avg, exp_avg_sq) {
        return false;
    }
    let step = kernels::adamw::Step { lr, betas: h.betas, weight_decay: h.weight_decay, eps: h.eps, step };
    let run = || kernels::adamw::master_step(param, grad, master, exp_avg, exp_avg_sq, step);
    kernels::nvrtc::try_kernel(&FAILED, "the AdamW master-weight kernel", run).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;
    use plugin_api::tch::{Device, Kind};

    /// The fused kernel (its CPU build) against the single-tensor path: 5 steps, 3 tensors.
    #[test]
    fn the_fused_update_equals_the_single_tensor_one_to_rounding() {
        plugin_api::tch::manual_seed(3);
        let h = ParamsAdamW { lr: 1e-2, weight_decay: 0.1, ..Default::default() };
        let shapes: [&[i64]; 3] = [&[7, 5], &[5], &[3, 4, 2]];
        let init: Vec<Tensor> = shapes.iter().map(|s| Tensor::randn(*s, (Kind::Float, Device::Cpu))).collect();
        let zeros = |ts: &[Tensor]| ts.iter().map(|t| t.zeros_like()).collect::<Vec<_>>();
        let (mut single, fused) =
            (init.iter().map(|t| t.copy()).collect::<Vec<_>>(), init.iter().map(|t| t.copy()).collect::<Vec<_>>());
        let (mut m1, mut v1, m2, v2) = (zeros(&init), zeros(&init), zeros(&init), zeros(&init));
        let step_t = Tensor::zeros([], (Kind::Float, Device::Cpu));
        for step in 1..=5 {
            let grads: Vec<Tensor> = init.iter().map(|t| t.randn_like()).collect();
            let lr = h.lr * (1.0 - 0.1 * step as f64);
            for i in 0..3 {
                adamw_update(&mut single[i], &grads[i], &mut m1[i], &mut v1[i], step, lr, &h);
            }
            let _ = step_t.shallow_clone().fill_(step as f64);
            adamw_update_fused(&fused, &grads, &m2, &v2, &step_t, lr, &h).unwrap();
        }
        let max_abs = |t: Tensor| f64::try_from(t.abs().max()).unwrap();
        for ((a, b), start) in single.iter().zip(&fused).zip(&init) {
            assert!(max_abs(a - b) < 1e-6, "max |single - fused| = {}", max_abs(a - b));
            assert!(max_abs(a - start) > 1e-2, "the tensors moved");
        }
        let mismatch = adamw_update_fused(&fused, &fused[..2], &m2, &v2, &step_t, 1e-3, &h).unwrap_err();
        assert!(mismatch.to_string().contains("3 parameters but 2"), "{mismatch}");
    }
}
