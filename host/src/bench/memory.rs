//! GPU memory in use, read with `cudaMemGetInfo` from the CUDA runtime libtorch already loaded
//! (tch exposes no allocator statistics). PyTorch's caching allocator keeps what it reserved
//! until the process ends, so the memory in use after a phase is the peak that phase reserved
//! (plus the CUDA context and library workspaces).

use libloading::{Library, Symbol};

/// Bytes in use on the current CUDA device, or None without a CUDA runtime.
pub fn device_used_bytes() -> Option<u64> {
    // SAFETY: the CUDA runtime libtorch links against; cudaMemGetInfo(size_t*, size_t*) -> int.
    unsafe {
        let lib = Library::new("libcudart.so.13").ok()?;
        let get: Symbol<unsafe extern "C" fn(*mut usize, *mut usize) -> i32> = lib.get(b"cudaMemGetInfo\0").ok()?;
        let (mut free, mut total) = (0usize, 0usize);
        if get(&mut free, &mut total) != 0 {
            return None;
        }
        Some((total - free) as u64)
    }
}

pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}
