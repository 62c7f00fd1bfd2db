//! A Gated DeltaNet layer's short causal conv and its SiLU as one CUDA kernel
//! (csrc/causal_conv.cu), forward only, bf16: what `gated_deltanet::conv_silu` runs on a GPU
//! without autograd, in place of a concatenation, K multiply passes and the SiLU.

use crate::nvrtc;
use cudarc::driver::{LaunchConfig, PushKernelArg};
use tch::{Device, Kind, Tensor};

const SRC: &str = include_str!("../csrc/causal_conv.cu");
const FORWARD: &str = "causal_conv_silu";
const THREADS: u32 = 128;
/// Steps a thread takes (the kernel's T).
const STEPS: i64 = 32;

/// Whether the kernel applies: bf16 on CUDA with the kernels enabled, channels dense in x.
pub fn applies(x: &Tensor) -> bool {
    nvrtc::enabled() && x.device().is_cuda() && x.kind() == Kind::BFloat16 && x.dim() == 3 && x.stride()[2] == 1
}

/// silu(depthwise causal conv) of `x` [B, L, C] (rows may be strided) after `history` [B, K-1, C],
/// weights `w` [C, K] -> [B, L, C] bf16, dense.
pub fn forward(history: &Tensor, x: &Tensor, w: &Tensor) -> Result<Tensor, String> {
    let Device::Cuda(ordinal) = x.device() else { return Err("not a CUDA tensor".into()) };
    let (b, l, c) = (x.size()[0], x.size()[1], x.size()[2]);
    let k = w.size()[1];
    if w.size() != [c, k] || x.stride()[2] != 1 {
        return Err(format!(
            "x {:?} (strides {:?}), w {:?}: expected w [C, K] and dense channels",
            x.size(),
            x.stride(),
            w.size()
        ));
    }
    let w = w.to_kind(Kind::BFloat16).contiguous();
    if history.size() != [b, k - 1, c] {
        return Err(format!("history {:?}, expected {:?}", history.size(), [b, k - 1, c]));
    }
    let hist = history.to_kind(Kind::BFloat16).contiguous();
    let out = Tensor::empty([b, l, c], (Kind::BFloat16, x.device()));
    if l == 0 {
        return Ok(out);
    }
    let m = nvrtc::module(ordinal, SRC, &[("K", k)], &[FORWARD])?;
    let (p_hist, p_x, p_w, p_out) =
        (hist.data_ptr() as u64, x.data_ptr() as u64, w.data_ptr() as u64, out.data_ptr() as u64);
    let (xb, xt) = (x.stride()[0], x.stride()[1]);
    let (l32, c32) = (l as i32, c as i32);
    let stream = m.stream();
    let mut launch = stream.launch_builder(m.function(FORWARD));
    launch.arg(&p_hist).arg(&p_x).arg(&xb).arg(&xt).arg(&p_w).arg(&p_out).arg(&l32).arg(&c32);
    let grid = ((c as u32).div_ceil(THREADS), ((l + STEPS - 1) / STEPS) as u32, b as u32);
    let config = LaunchConfig { grid_dim: grid, block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments match the kernel's signature; x is read through its own strides, the
    // other tensors are dense with the checked shapes, all on this device, and the launch is
    // ordered on libtorch's stream.
    unsafe { launch.launch(config) }.map_err(|e| format!("{FORWARD}: {e}"))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    /// The kernel compiles with NVRTC (no GPU needed).
    #[test]
    fn the_kernel_compiles() {
        for k in [2, 4] {
            let ptx = super::nvrtc::compile(super::SRC, &[("K", k)]).unwrap_or_else(|e| panic!("K {k}: {e}"));
            assert!(ptx.to_src().contains(".entry causal_conv_silu"));
        }
    }
}
