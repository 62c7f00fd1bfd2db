//! Kernels and libtorch entry points that tch does not bind, through small C++ shims (csrc/),
//! and CUDA kernels of our own compiled at run time with NVRTC (csrc/*.cu, `nvrtc`).
//!
//! - `adamw`: one AdamW step of a bf16 parameter with its fp32 master, in one pass (CUDA).
//! - `autograd`: backward from several outputs with their gradients; gradients dropped; pinned
//!   copies and non-blocking uploads.
//! - `block_attention`: DFlash block attention split into the context part (libtorch's fused
//!   attention with a staircase bias) and each block's own keys, merged exactly, with its own
//!   backward (autograd does not see it: a drafter cuts its graph around it and runs
//!   `Drafter::backward`).
//! - `block_part`: the block part of it as one CUDA kernel each way (bf16).
//! - `causal_conv`: a Gated DeltaNet layer's short causal conv and SiLU in one pass (CUDA).
//! - `context_tail`: the context part's staircase tails, the keys a block sees past its range's
//!   unbiased prefix, on tensor cores, one launch each way for every range (CUDA).
//! - `cross_entropy`: the loss's row statistics and softmax gradient in two passes (CUDA).
//! - `cross_entropy_cpu`: the same in three passes a row over the CPU's threads.
//! - `cuda_graph`: libtorch's work recorded once as a CUDA graph and replayed (decoding).
//! - `embedded_library`: open a shared library a crate embeds (the shims that link libtorch_cuda).
//! - `fp8`: FP8 block-scaled linear layers as served on Hopper: weight and activation quantisers
//!   (the activations' in one pass, CUDA) and the layer through libtorch's block-scaled GEMM.
//! - `gdn_prep`: a Gated DeltaNet layer's chunk quantities built on chip from its conv output, and
//!   its gated RMSNorm, forward (CUDA).
//! - `gdn_scan`: the chunked gated delta rule's scan over chunks in one kernel, forward (CUDA).
//! - `norm_rope`: an attention's q/k RMSNorm and rotary embedding in one pass each way (CUDA).
//! - `nvrtc`: compile CUDA C++ at run time and launch it on libtorch's stream (cudarc).
//! - `optim`: libtorch's fused multi-tensor AdamW.
//! - `profiler`: libtorch's Kineto profiler (Chrome traces with named ranges), for the benches.
//! - `range_sum`: the context part's gradients summed over its runs in one pass (CUDA).
//! - `sdpa`: libtorch's attention over grouped heads kept on a fused kernel when masked.
//! - `swiglu`: an MLP's silu(gate) * up in one pass each way (CUDA).
//! - `unit_lower_inverse`: the delta rule's WY systems inverted on chip, a matrix a CTA (CUDA).

pub mod adamw;
pub mod autograd;
pub mod block_attention;
pub mod block_part;
pub mod causal_conv;
pub mod context_tail;
pub mod cross_entropy;
pub mod cross_entropy_cpu;
pub mod cuda_graph;
#[cfg(test)]
mod cuda_tests;
pub mod embedded_library;
pub mod ffi;
pub mod fp8;
pub mod gdn_prep;
pub mod gdn_scan;
pub mod norm_rope;
pub mod nvrtc;
pub mod optim;
pub mod profiler;
pub mod range_sum;
pub mod rms_norm;
pub mod sdpa;
pub mod swiglu;
pub mod unit_lower_inverse;

/// Let libtorch's `scaled_dot_product_attention` pick cuDNN's kernel or not (process-wide, the
/// plugins' calls included); returns the previous setting. cuDNN builds a plan per shape, about
/// 60 ms each in bf16 on an H200: fine for training's fixed shapes, ruinous in decoding, where
/// every call has a new key length.
pub fn allow_cudnn_attention(enabled: bool) -> bool {
    // SAFETY: sets one flag in libtorch's global context.
    unsafe { ffi::dflash_allow_cudnn_sdp(enabled as std::ffi::c_int) != 0 }
}

/// cuDNN's attention kept out of `scaled_dot_product_attention` while this lives (decoding); the
/// previous setting comes back when it is dropped.
pub struct CudnnAttentionOff {
    was: bool,
}

impl CudnnAttentionOff {
    pub fn new() -> Self {
        Self { was: allow_cudnn_attention(false) }
    }
}

impl Default for CudnnAttentionOff {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for CudnnAttentionOff {
    fn drop(&mut self) {
        allow_cudnn_attention(self.was);
    }
}

/// Load libtorch's CUDA library, which the linker's `--as-needed` drops from binaries that name
/// none of its symbols; needed before the first CUDA op. It stays loaded.
pub fn load_libtorch_cuda() -> Result<(), String> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: loading libtorch's own CUDA library; it is never unloaded.
    let lib = unsafe { Library::open(Some("libtorch_cuda.so"), RTLD_NOW | RTLD_GLOBAL) }.map_err(|e| e.to_string())?;
    std::mem::forget(lib);
    Ok(())
}

/// CUDA device 0 with libtorch's CUDA library loaded, for the CUDA tests here and in the crates
/// that use these kernels. Each such test is `#[ignore = "needs a CUDA device: make gpu-test"]`
/// and has `cuda` in its path: `make gpu-test` runs them (`cargo test -- --ignored cuda`), and
/// `make test` reports them as ignored, not passed.
///
/// # Panics
/// Without a usable CUDA device: a CUDA test that runs where it cannot fails, it does not pass.
pub fn cuda_test_device() -> tch::Device {
    if let Err(e) = load_libtorch_cuda() {
        panic!("this test needs a CUDA device, and libtorch_cuda.so does not load: {e}");
    }
    assert!(tch::Cuda::is_available(), "this test needs a CUDA device, and libtorch sees none");
    tch::Device::Cuda(0)
}
