//! (I + A)^{-1} of strictly lower-triangular fp32 matrices as one CUDA kernel
//! (csrc/unit_lower_inverse.cu): what `gated_deltanet::unit_lower_inverse` runs on a GPU for the
//! chunked delta rule's WY systems (no autograd), in place of its blocked substitution.

use crate::nvrtc;
use cudarc::driver::{LaunchConfig, PushKernelArg};
use tch::{Device, Kind, Tensor};

const SRC: &str = include_str!("../csrc/unit_lower_inverse.cu");
const FORWARD: &str = "unit_lower_inverse";
/// The largest matrix side a CTA (one thread a column) takes.
pub const MAX_SIDE: i64 = 64;

/// Whether the kernel applies to `a` [.., C, C]: fp32 on CUDA, kernels enabled, C <= 64.
pub fn applies(a: &Tensor) -> bool {
    let s = a.size();
    nvrtc::enabled()
        && a.device().is_cuda()
        && a.kind() == Kind::Float
        && s.len() >= 2
        && s[s.len() - 1] == s[s.len() - 2]
        && (1..=MAX_SIDE).contains(&s[s.len() - 1])
}

/// (I + A)^{-1} of each [C, C] matrix of `a`, from its strictly lower part (the rest is not
/// read): same shape, fp32, dense.
pub fn forward(a: &Tensor) -> Result<Tensor, String> {
    let Device::Cuda(ordinal) = a.device() else { return Err("not a CUDA tensor".into()) };
    let c = *a.size().last().ok_or("a scalar is not a matrix")?;
    let a = a.contiguous();
    let n = a.numel() as i64 / (c * c).max(1);
    let x = Tensor::empty(a.size().as_slice(), (Kind::Float, a.device()));
    if n == 0 {
        return Ok(x);
    }
    let m = nvrtc::module(ordinal, SRC, &[("C", c)], &[FORWARD])?;
    let (pa, px) = (a.data_ptr() as u64, x.data_ptr() as u64);
    let stream = m.stream();
    let mut launch = stream.launch_builder(m.function(FORWARD));
    launch.arg(&pa).arg(&px);
    let blocks = u32::try_from(n).map_err(|_| format!("{n} matrices: too many for one launch"))?;
    let config = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (c as u32, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments match the kernel's signature; a and x are dense fp32 tensors of n
    // C x C matrices on this device, and the launch is ordered on libtorch's stream.
    unsafe { launch.launch(config) }.map_err(|e| format!("{FORWARD}: {e}"))?;
    Ok(x)
}

#[cfg(test)]
mod tests {
    /// The kernel compiles with NVRTC (no GPU needed).
    #[test]
    fn the_kernel_compiles() {
        for c in [16, 37, 64] {
            let ptx = super::nvrtc::compile(super::SRC, &[("C", c)]).unwrap_or_else(|e| panic!("C {c}: {e}"));
            assert!(ptx.to_src().contains(".entry unit_lower_inverse"));
        }
    }
}
