//! Kernels and libtorch entry points that tch does not bind, through small C++ shims (csrc/),
//! and CUDA kernels of our own compiled at run time with NVRTC (csrc/*.cu, `nvrtc`).
//!
//! - `autograd`: backward from several outputs with their gradients; gradients dropped; pinned
//!   copies.
//! - `block_attention`: DFlash block attention split into the context part (libtorch's fused
//!   attention with a staircase bias) and each block's own keys, merged exactly, with its own
//!   backward (autograd does not see it: a drafter cuts its graph around it and runs
//!   `Drafter::backward`).
//! - `block_part`: the block part of it as one CUDA kernel each way (bf16).
//! - `cross_entropy`: the loss's row statistics and softmax gradient in two passes (CUDA).
//! - `nvrtc`: compile CUDA C++ at run time and launch it on libtorch's stream (cudarc).
//! - `optim`: libtorch's fused multi-tensor AdamW.
//! - `profiler`: libtorch's Kineto profiler (Chrome traces with named ranges), for the benches.

pub mod autograd;
pub mod block_attention;
pub mod block_part;
pub mod cross_entropy;
pub mod ffi;
#[cfg(test)]
mod cuda_tests;
pub mod nvrtc;
pub mod optim;
pub mod profiler;

/// Load libtorch's CUDA library, which the linker's `--as-needed` drops from binaries that name
/// none of its symbols; needed before the first CUDA op. It stays loaded.
pub fn load_libtorch_cuda() -> Result<(), String> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: loading libtorch's own CUDA library; it is never unloaded.
    let lib = unsafe { Library::open(Some("libtorch_cuda.so"), RTLD_NOW | RTLD_GLOBAL) }.map_err(|e| e.to_string())?;
    std::mem::forget(lib);
    Ok(())
}
