//! GPU memory in use, read with `cudaMemGetInfo` from the CUDA runtime libtorch already loaded
//! (tch exposes no allocator statistics). PyTorch's caching allocator keeps what it reserved
//! until the process ends, so the memory in use after a phase is the peak that phase reserved
//! (plus the CUDA context and library workspaces).

/// Bytes in use on CUDA device `index` (every process's), or None without a CUDA runtime.
pub fn device_used_bytes(index: usize) -> Option<u64> {
    kernels::ffi::cuda_mem_used(index)
}

pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}
