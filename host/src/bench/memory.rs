//! GPU memory in use, read with `cudaMemGetInfo` from the CUDA runtime libtorch already loaded
//! (tch exposes no allocator statistics). PyTorch's caching allocator keeps what it reserved
//! until the process ends, so the memory in use after a phase is the peak that phase reserved
//! (plus the CUDA context and library workspaces).

/// Bytes in use on CUDA device `index` (every process's), or None without a CUDA runtime. The
/// thread's current device is set for the query and put back: a rank on `cuda:r` reads its own.
pub fn device_used_bytes(index: usize) -> Option<u64> {
    type GetDevice = unsafe extern "C" fn(*mut i32) -> i32;
    type SetDevice = unsafe extern "C" fn(i32) -> i32;
    type MemGetInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> i32;
    // SAFETY: the CUDA runtime's own signatures; each call writes only the values it is given.
    unsafe {
        let lib = libloading::Library::new("libcudart.so.13").ok()?;
        let get_device: libloading::Symbol<GetDevice> = lib.get(b"cudaGetDevice\0").ok()?;
        let set_device: libloading::Symbol<SetDevice> = lib.get(b"cudaSetDevice\0").ok()?;
        let mem_get_info: libloading::Symbol<MemGetInfo> = lib.get(b"cudaMemGetInfo\0").ok()?;
        let mut current = 0i32;
        if get_device(&mut current) != 0 || set_device(index as i32) != 0 {
            return None;
        }
        let (mut free, mut total) = (0usize, 0usize);
        let ok = mem_get_info(&mut free, &mut total) == 0;
        set_device(current);
        ok.then(|| (total - free) as u64)
    }
}

pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}
