//! One AdamW step of a bf16 parameter with an fp32 master copy as one CUDA kernel
//! (csrc/adamw_master.cu): what the AdamW optimizers run on a GPU for mixed-precision
//! parameters, in place of a cast of the gradient, libtorch's fused AdamW and a copy back.

use crate::nvrtc;
use cudarc::driver::PushKernelArg;
use tch::{Device, Kind, Tensor};

const SRC: &str = include_str!("../csrc/adamw_master.cu");
const STEP: &str = "adamw_master_step";
const THREADS: u32 = 256;

/// Whether the kernel applies: a bf16 CUDA parameter with its gradient, fp32 master and moments,
/// all dense and of one shape, with the kernels enabled.
pub fn applies(param: &Tensor, grad: &Tensor, master: &Tensor, exp_avg: &Tensor, exp_avg_sq: &Tensor) -> bool {
    let size = param.size();
    nvrtc::enabled()
        && param.device().is_cuda()
        && param.kind() == Kind::BFloat16
        && grad.kind() == Kind::BFloat16
        && [master, exp_avg, exp_avg_sq]
            .iter()
            .all(|t| t.kind() == Kind::Float && t.size() == size && t.is_contiguous())
        && grad.size() == size
        && grad.is_contiguous()
        && param.is_contiguous()
}

/// The AdamW hyper-parameters of one step.
#[derive(Debug, Clone, Copy)]
pub struct Step {
    pub lr: f64,
    pub betas: [f64; 2],
    pub weight_decay: f64,
    pub eps: f64,
    /// Counted from 1.
    pub step: i64,
}

/// One step: `master`, the moments and `param` (= master rounded to bf16) updated in place from
/// `grad`.
pub fn master_step(
    param: &Tensor,
    grad: &Tensor,
    master: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    h: Step,
) -> Result<(), String> {
    let Device::Cuda(ordinal) = param.device() else { return Err("not a CUDA tensor".into()) };
    if !applies(param, grad, master, exp_avg, exp_avg_sq) {
        return Err(format!(
            "parameter {:?} {:?}: expected bf16 with dense fp32 master and moments",
            param.size(),
            param.kind()
        ));
    }
    let m = nvrtc::module(ordinal, SRC, &[], &[STEP])?;
    let n = param.numel() as i64;
    let [beta1, beta2] = h.betas;
    let step_size = (h.lr / (1.0 - beta1.powi(h.step as i32))) as f32;
    let bc2_sqrt = (1.0 - beta2.powi(h.step as i32)).sqrt() as f32;
    let (lr, b1, b2, wd, eps) = (h.lr as f32, beta1 as f32, beta2 as f32, h.weight_decay as f32, h.eps as f32);
    let [pg, pm, pa, ps, pp] = [grad, master, exp_avg, exp_avg_sq, param].map(|t| t.data_ptr() as u64);
    // Groups of 4 elements where every tensor starts 16-byte aligned (libtorch's allocations do).
    let n4 = if [pg, pm, pa, ps, pp].iter().all(|p| p % 16 == 0) { n / 4 } else { 0 };
    let stream = m.stream();
    let mut launch = stream.launch_builder(m.function(STEP));
    launch.arg(&pg).arg(&pm).arg(&pa).arg(&ps).arg(&pp).arg(&n).arg(&n4);
    launch.arg(&lr).arg(&b1).arg(&b2).arg(&wd).arg(&eps).arg(&step_size).arg(&bc2_sqrt);
    let config = nvrtc::grid_stride(if n4 > 0 { n4 } else { n } as u64, THREADS as u64, THREADS);
    // SAFETY: five dense tensors of n elements on this device, of the kinds `applies` checked; the
    // launch is ordered on libtorch's stream.
    unsafe { launch.launch(config) }.map_err(|e| format!("{STEP}: {e}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The kernel compiles with NVRTC (no GPU needed).
    #[test]
    fn the_kernel_compiles() {
        let ptx = super::nvrtc::compile(super::SRC, &[]).unwrap();
        assert!(ptx.to_src().contains(".entry adamw_master_step"));
    }
}
