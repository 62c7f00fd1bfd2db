//! Every C function this crate calls, in one place: the shims in `csrc/` (libtorch functions
//! tch does not bind), and the CUDA libraries asked for versions and memory at run time (opened
//! with dlopen, so a binary without a GPU still starts). Each shim that can fail returns non-zero
//! and writes a NUL-terminated message into the error buffer it is given: [`with_error_buffer`].

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::Path;
use std::sync::OnceLock;

extern "C" {
    // csrc/autograd.cpp
    pub fn dflash_backward(
        tensors: *const *const c_void,
        grads: *const *const c_void,
        n: usize,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    pub fn dflash_clear_grad(t: *const c_void);
    pub fn dflash_empty_pinned_like(t: *const c_void, out: *mut *mut c_void, err: *mut c_char, err_len: usize)
        -> c_int;

    // csrc/fused_adamw.cpp
    pub fn dflash_fused_adamw(
        params: *const *const c_void,
        grads: *const *const c_void,
        exp_avgs: *const *const c_void,
        exp_avg_sqs: *const *const c_void,
        n: usize,
        step: *const c_void,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    pub fn dflash_foreach_mul_(
        ts: *const *const c_void,
        n: usize,
        scale: *const c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;

    // csrc/cudnn_attention.cpp
    pub fn dflash_cudnn_attention_forward(
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        bias: *const c_void,
        scale: f64,
        out: *mut *mut c_void,
        lse: *mut *mut c_void,
        cum_q: *mut *mut c_void,
        cum_k: *mut *mut c_void,
        max_q: *mut i64,
        max_k: *mut i64,
        seed: *mut *mut c_void,
        offset: *mut *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    pub fn dflash_allow_cudnn_sdp(enabled: c_int) -> c_int;

    // csrc/memory_stats.cpp
    pub fn dflash_cuda_memory_stats(
        device: c_int,
        reset_peak: c_int,
        allocated: *mut i64,
        peak: *mut i64,
        reserved: *mut i64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;

    // csrc/profiler.cpp
    pub fn dflash_profiler_start(cuda: c_int, err: *mut c_char, err_len: usize) -> c_int;
    pub fn dflash_profiler_stop(path: *const c_char, err: *mut c_char, err_len: usize) -> c_int;
    pub fn dflash_range_begin(name: *const c_char) -> *mut c_void;
    pub fn dflash_range_end(record: *mut c_void);
}

/// Call a shim with an error buffer; its message's first line on failure.
pub fn with_error_buffer(f: impl FnOnce(*mut c_char, usize) -> c_int) -> Result<(), String> {
    let mut err = [0 as c_char; 1024];
    if f(err.as_mut_ptr(), err.len()) == 0 {
        return Ok(());
    }
    // SAFETY: on failure the shim wrote a NUL-terminated message into `err`.
    Err(unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy().lines().next().unwrap_or("").to_string())
}

/// The CUDA caching allocator's bytes on a device: allocated now, the most allocated at once since
/// the last reset, and reserved from the device (allocated and cached).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocatorStats {
    pub allocated: u64,
    pub peak: u64,
    pub reserved: u64,
}

/// [`AllocatorStats`] of CUDA device `index`, the peak then reset when `reset_peak` (so the next
/// read's peak is the work's in between); an error without CUDA.
pub fn cuda_allocator_stats(index: usize, reset_peak: bool) -> Result<AllocatorStats, String> {
    let (mut allocated, mut peak, mut reserved) = (0i64, 0i64, 0i64);
    // SAFETY: the shim writes the three values and, on failure, the error buffer.
    with_error_buffer(|err, len| unsafe {
        dflash_cuda_memory_stats(
            index as c_int,
            reset_peak as c_int,
            &mut allocated,
            &mut peak,
            &mut reserved,
            err,
            len,
        )
    })?;
    Ok(AllocatorStats { allocated: allocated as u64, peak: peak as u64, reserved: reserved as u64 })
}

/// Bytes in use on CUDA device `index` (every process's), from `cudaMemGetInfo` in the CUDA
/// runtime libtorch loaded, or None without one. The thread's current device is set for the
/// query and put back, so a rank on `cuda:r` reads its own device.
pub fn cuda_mem_used(index: usize) -> Option<u64> {
    cuda_mem_info(index).map(|(free, total)| total - free)
}

/// Bytes free and in all on CUDA device `index`, as [`cuda_mem_used`] reads them.
pub fn cuda_mem_info(index: usize) -> Option<(u64, u64)> {
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
        ok.then_some((free as u64, total as u64))
    }
}

/// `int symbol(int*)` in `lib` (the CUDA runtime's and NCCL's version queries).
pub fn int_version(lib: &Path, symbol: &[u8]) -> Option<i64> {
    // SAFETY: NVIDIA's version queries write one int and touch no other state.
    unsafe {
        let l = libloading::Library::new(lib).ok()?;
        let f: libloading::Symbol<unsafe extern "C" fn(*mut i32) -> i32> = l.get(symbol).ok()?;
        let mut v = 0i32;
        (f(&mut v) == 0).then_some(v as i64)
    }
}

/// `cudnnGetVersion()` in `lib`.
pub fn cudnn_version(lib: &Path) -> Option<i64> {
    // SAFETY: cudnnGetVersion takes nothing and returns size_t.
    unsafe {
        let l = libloading::Library::new(lib).ok()?;
        let f: libloading::Symbol<unsafe extern "C" fn() -> usize> = l.get(b"cudnnGetVersion\0").ok()?;
        Some(f() as i64)
    }
}

/// `nvrtcVersion(&major, &minor)` in `lib`.
pub fn nvrtc_version(lib: &Path) -> Option<(i32, i32)> {
    // SAFETY: nvrtcVersion writes two ints.
    unsafe {
        let l = libloading::Library::new(lib).ok()?;
        let f: libloading::Symbol<unsafe extern "C" fn(*mut i32, *mut i32) -> i32> = l.get(b"nvrtcVersion\0").ok()?;
        let (mut major, mut minor) = (0, 0);
        (f(&mut major, &mut minor) == 0).then_some((major, minor))
    }
}

/// The name of CUDA device `ordinal` ("NVIDIA H100 80GB HBM3"), from the driver, or None
/// without one.
pub fn cuda_device_name(ordinal: usize) -> Option<String> {
    // SAFETY: only probes whether the driver library can be loaded.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return None;
    }
    cudarc::driver::CudaContext::new(ordinal).and_then(|c| c.name()).ok()
}

// csrc/cuda_graph.cpp, a library of its own (it links libtorch_cuda): built with this crate,
// embedded, and loaded at the first graph; empty when the build found no CUDA headers.
static GRAPH_LIBRARY: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libdflash_cuda_graph.so"));

type New = unsafe extern "C" fn(*mut *mut c_void, *mut c_char, usize) -> c_int;
type Free = unsafe extern "C" fn(*mut c_void);
type Enter = unsafe extern "C" fn(*mut c_void, c_int, *mut *mut c_void, *mut c_char, usize) -> c_int;
type Step = unsafe extern "C" fn(*mut c_void, *mut c_char, usize) -> c_int;

pub(crate) struct GraphShim {
    pub new: New,
    pub free: Free,
    pub enter: Enter,
    pub exit: Step,
    pub capture_begin: Step,
    pub capture_end: Step,
    pub replay: Step,
}

pub(crate) fn graph_shim() -> Result<&'static GraphShim, String> {
    static SHIM: OnceLock<Result<GraphShim, String>> = OnceLock::new();
    SHIM.get_or_init(|| {
        if GRAPH_LIBRARY.is_empty() {
            return Err("this build has no CUDA graphs: it was compiled without the CUDA runtime's headers \
                        (`make setup` installs them into $DFLASH_CACHE/cuda-headers; rebuild)"
                .into());
        }
        crate::load_libtorch_cuda()?;
        let lib = crate::embedded_library::open(GRAPH_LIBRARY, "dflash-cuda-graph")?;
        // SAFETY: the symbols are the shim's, with these signatures; the library stays loaded.
        let shim = unsafe {
            GraphShim {
                new: *lib.get::<New>(b"dflash_graph_new\0").map_err(|e| e.to_string())?,
                free: *lib.get::<Free>(b"dflash_graph_free\0").map_err(|e| e.to_string())?,
                enter: *lib.get::<Enter>(b"dflash_graph_enter\0").map_err(|e| e.to_string())?,
                exit: *lib.get::<Step>(b"dflash_graph_exit\0").map_err(|e| e.to_string())?,
                capture_begin: *lib.get::<Step>(b"dflash_graph_capture_begin\0").map_err(|e| e.to_string())?,
                capture_end: *lib.get::<Step>(b"dflash_graph_capture_end\0").map_err(|e| e.to_string())?,
                replay: *lib.get::<Step>(b"dflash_graph_replay\0").map_err(|e| e.to_string())?,
            }
        };
        std::mem::forget(lib);
        Ok(shim)
    })
    .as_ref()
    .map_err(Clone::clone)
}
