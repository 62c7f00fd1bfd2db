//! The SwiGLU product silu(gate) * up as one CUDA kernel each way (csrc/swiglu.cu), bf16,
//! outside autograd: what a cut MLP (`drafter_layers::layers::Mlp::forward_cut`) runs on a GPU.
//! Where it does not apply the caller runs the libtorch ops.

use crate::nvrtc;
use cudarc::driver::{LaunchConfig, PushKernelArg};
use std::sync::atomic::AtomicBool;
use tch::{Device, Kind, Tensor};

const SRC: &str = concat!(include_str!("../csrc/bf16x8.cuh"), include_str!("../csrc/swiglu.cu"));
const FORWARD: &str = "swiglu_forward";
const BACKWARD: &str = "swiglu_backward";
const THREADS: u32 = 256;

/// Whether the kernels apply: bf16 on CUDA with the kernels enabled, dense, 8-element groups.
pub fn applies(gate: &Tensor, up: &Tensor) -> bool {
    let dense = |t: &Tensor| t.is_contiguous() && t.data_ptr() as usize % 16 == 0;
    nvrtc::enabled()
        && gate.device().is_cuda()
        && gate.kind() == Kind::BFloat16
        && up.kind() == Kind::BFloat16
        && gate.size() == up.size()
        && gate.numel() % 8 == 0
        && dense(gate)
        && dense(up)
}

static FAILED: AtomicBool = AtomicBool::new(false);

/// silu(gate) * up, by the kernel where it applies, else libtorch's ops.
pub fn forward(gate: &Tensor, up: &Tensor) -> Tensor {
    let fused = applies(gate, up)
        .then(|| nvrtc::try_kernel(&FAILED, "the SwiGLU kernel", || launch_forward(gate, up)))
        .flatten();
    fused.unwrap_or_else(|| gate.silu() * up)
}

/// From dh = dLoss/d(silu(gate) * up): (silu(gate) * up, d_gate, d_up).
pub fn backward(gate: &Tensor, up: &Tensor, dh: &Tensor) -> (Tensor, Tensor, Tensor) {
    let fits = applies(gate, up) && dh.size() == gate.size() && dh.kind() == Kind::BFloat16;
    let fused = fits
        .then(|| nvrtc::try_kernel(&FAILED, "the SwiGLU kernel", || launch_backward(gate, up, &dh.contiguous())))
        .flatten();
    fused.unwrap_or_else(|| {
        let act = gate.silu();
        let h = &act * up;
        let d_up = dh * &act;
        let d_gate = gate.silu_backward(&(dh * up));
        (h, d_gate, d_up)
    })
}

fn module(t: &Tensor) -> Result<nvrtc::Module, String> {
    let Device::Cuda(ordinal) = t.device() else { return Err("not a CUDA tensor".into()) };
    nvrtc::module(ordinal, SRC, &[], &[FORWARD, BACKWARD])
}

/// A thread an 8-element group at a time, looping over the rest.
fn config(n: i64) -> LaunchConfig {
    nvrtc::grid_stride((n / 8) as u64, THREADS as u64, THREADS)
}

fn launch_forward(gate: &Tensor, up: &Tensor) -> Result<Tensor, String> {
    let m = module(gate)?;
    let h = Tensor::empty(gate.size(), (Kind::BFloat16, gate.device()));
    let (p_gate, p_up, p_h, n) =
        (gate.data_ptr() as u64, up.data_ptr() as u64, h.data_ptr() as u64, gate.numel() as i64);
    let stream = m.stream();
    let mut launch = stream.launch_builder(m.function(FORWARD));
    launch.arg(&p_gate).arg(&p_up).arg(&p_h).arg(&n);
    // SAFETY: dense bf16 tensors of n elements on this device (checked by `applies`), 16-byte
    // aligned; the launch is ordered on libtorch's stream.
    unsafe { launch.launch(config(n)) }.map_err(|e| format!("{FORWARD}: {e}"))?;
    Ok(h)
}

fn launch_backward(gate: &Tensor, up: &Tensor, dh: &Tensor) -> Result<(Tensor, Tensor, Tensor), String> {
    if dh.data_ptr() as usize % 16 != 0 {
        return Err("dh is not 16-byte aligned".into());
    }
    let m = module(gate)?;
    let new = || Tensor::empty(gate.size(), (Kind::BFloat16, gate.device()));
    let (h, d_gate, d_up) = (new(), new(), new());
    let [p_gate, p_up, p_dh, p_h, p_dg, p_du] = [gate, up, dh, &h, &d_gate, &d_up].map(|t| t.data_ptr() as u64);
    let n = gate.numel() as i64;
    let stream = m.stream();
    let mut launch = stream.launch_builder(m.function(BACKWARD));
    launch.arg(&p_gate).arg(&p_up).arg(&p_dh).arg(&p_h).arg(&p_dg).arg(&p_du).arg(&n);
    // SAFETY: as in `launch_forward`; dh is dense with gate's shape (the caller made it so).
    unsafe { launch.launch(config(n)) }.map_err(|e| format!("{BACKWARD}: {e}"))?;
    Ok((h, d_gate, d_up))
}

#[cfg(test)]
mod tests {
    /// The kernels compile with NVRTC (no GPU needed).
    #[test]
    fn the_kernels_compile() {
        let ptx = super::nvrtc::compile(super::SRC, &[]).unwrap();
        let text = ptx.to_src();
        assert!(text.contains(".entry swiglu_forward") && text.contains(".entry swiglu_backward"));
    }
}
