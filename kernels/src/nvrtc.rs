//! CUDA C++ compiled at run time with NVRTC and launched through cudarc on libtorch's stream.
//!
//! libtorch runs its kernels on the device's legacy default (null) stream unless a caller sets
//! another, which tch never does; cudarc's `default_stream` is that stream, so a launch here is
//! ordered with the tensor ops around it, without synchronising. While a CUDA graph records, the
//! launches go to its stream instead (`Module::stream`). `CudaContext::new` retains the primary
//! context libtorch uses, so `data_ptr()`s are valid device pointers.

use cudarc::{
    driver::{CudaContext, CudaFunction, CudaStream},
    nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx},
};
use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, AtomicU8, Ordering},
        Arc, Mutex, OnceLock,
    },
};

/// Whether the kernels compiled here may run: `DFLASH_NVRTC=0` turns them off, and the
/// composites of libtorch ops they replace run instead (for A/B benches, or a GPU they fail on).
pub fn enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        UNSET => {
            let on = std::env::var("DFLASH_NVRTC").map_or(true, |v| v != "0");
            set(on);
            on
        }
        s => s == ON,
    }
}

/// `f` with the kernels turned on or off for the process, then the setting as it was, also if `f`
/// panics (benches and tests comparing the kernels with the composites they replace).
pub fn with_enabled<T>(on: bool, f: impl FnOnce() -> T) -> T {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            set(self.0);
        }
    }
    let _restore = Restore(enabled());
    set(on);
    f()
}

/// `kernel()`, unless it failed before in this process (`failed`, one flag a kernel): its first
/// failure is reported as `what` and it is not tried again. None then, and the caller runs the
/// libtorch ops it replaces.
pub fn try_kernel<T>(failed: &AtomicBool, what: &str, kernel: impl FnOnce() -> Result<T, String>) -> Option<T> {
    if failed.load(Ordering::Relaxed) {
        return None;
    }
    kernel()
        .map_err(|e| {
            if !failed.swap(true, Ordering::Relaxed) {
                eprintln!("warning: {what} failed ({e}); using libtorch ops instead");
            }
        })
        .ok()
}

/// A one-dimensional grid for a grid-stride kernel over `items` work items, `per_cta` of them a
/// CTA of `threads` threads: enough CTAs to fill an H100/H200 (132 SMs) a few times over, each
/// looping over the rest.
pub fn grid_stride(items: u64, per_cta: u64, threads: u32) -> cudarc::driver::LaunchConfig {
    let ctas = items.div_ceil(per_cta.max(1)).clamp(1, 132 * 16) as u32;
    cudarc::driver::LaunchConfig { grid_dim: (ctas, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

fn set(on: bool) {
    STATE.store(if on { ON } else { OFF }, Ordering::Relaxed);
}

const UNSET: u8 = 0;
const ON: u8 = 1;
const OFF: u8 = 2;
static STATE: AtomicU8 = AtomicU8::new(UNSET);

/// A compiled module's functions on one device, with the stream to launch them on.
#[derive(Clone)]
pub struct Module {
    default_stream: Arc<CudaStream>,
    functions: HashMap<String, CudaFunction>,
}

impl Module {
    pub fn function(&self, name: &str) -> &CudaFunction {
        &self.functions[name]
    }

    /// The stream to launch on: libtorch's, or the one a CUDA graph is recording libtorch's work
    /// on (`cuda_graph`), so that the graph holds these kernels too.
    pub fn stream(&self) -> Arc<CudaStream> {
        match crate::cuda_graph::recording_stream() {
            // SAFETY: libtorch's stream from the pool, alive for the process; the recording
            // orders work on it as libtorch's ops are ordered.
            Some(raw) => unsafe { self.default_stream.context().wrap_borrowed_stream(raw as _) },
            None => self.default_stream.clone(),
        }
    }
}

/// `src` with `defines`, compiled once per process and loaded once per device: the functions
/// named in `functions`. Errors (no driver, no NVRTC, a compile error) come back as text.
pub fn module(device: usize, src: &str, defines: &[(&str, i64)], functions: &[&str]) -> Result<Module, String> {
    module_for(BASE_ARCH, device, src, defines, functions)
}

/// [`module`] compiled for the virtual architecture `arch` (`compute_90` for instructions older
/// GPUs lack, such as the FP8 conversions): it loads only on GPUs of that capability or later.
pub fn module_for(
    arch: &'static str,
    device: usize,
    src: &str,
    defines: &[(&str, i64)],
    functions: &[&str],
) -> Result<Module, String> {
    static CACHE: OnceLock<Mutex<HashMap<String, Result<Module, String>>>> = OnceLock::new();
    let key = format!("{arch} {device} {defines:?} {functions:?} {src}");
    let mut cache = CACHE.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    cache.entry(key).or_insert_with(|| load(arch, device, src, defines, functions)).clone()
}

fn load(
    arch: &'static str,
    device: usize,
    src: &str,
    defines: &[(&str, i64)],
    functions: &[&str],
) -> Result<Module, String> {
    // SAFETY: only probes whether the driver library can be loaded.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("the CUDA driver library (libcuda) is not available".into());
    }
    let ptx = compile_for(arch, src, defines)?;
    let ctx = CudaContext::new(device).map_err(|e| format!("CUDA context on device {device}: {e}"))?;
    let module = ctx.load_module(ptx).map_err(|e| format!("loading the compiled module: {e}"))?;
    let functions = functions
        .iter()
        .map(|&name| {
            module.load_function(name).map(|f| (name.to_string(), f)).map_err(|e| format!("function `{name}`: {e}"))
        })
        .collect::<Result<_, _>>()?;
    Ok(Module { default_stream: ctx.default_stream(), functions })
}

/// The virtual architecture the kernels are compiled for unless they ask for another.
const BASE_ARCH: &str = "compute_80";

/// PTX for compute capability 8.0 (the driver JIT-compiles it for the GPU at hand, Hopper
/// included). Needs no GPU, so the CPU test suite checks that the sources compile.
pub fn compile(src: &str, defines: &[(&str, i64)]) -> Result<Ptx, String> {
    compile_for(BASE_ARCH, src, defines)
}

/// PTX for the virtual architecture `arch` (e.g. `compute_90`); needs no GPU either.
pub fn compile_for(arch: &'static str, src: &str, defines: &[(&str, i64)]) -> Result<Ptx, String> {
    load_nvrtc()?;
    let opts = CompileOptions {
        arch: Some(arch),
        options: defines.iter().map(|(k, v)| format!("-D{k}={v}")).collect(),
        ..Default::default()
    };
    compile_ptx_with_opts(src, opts).map_err(|e| format!("NVRTC: {e}"))
}

/// Load libnvrtc, and its builtins from the same folder: libnvrtc opens them by bare name, which
/// only LD_LIBRARY_PATH resolves, while libnvrtc itself is also found through the
/// binary's RUNPATH.
fn load_nvrtc() -> Result<(), String> {
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            // SAFETY: probes for the library; `culib` then keeps it loaded for the process.
            if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
                return Err(
                    "NVRTC (libnvrtc.so) is not available: install nvidia-cuda-nvrtc or add it to LD_LIBRARY_PATH"
                        .into(),
                );
            }
            let _ = unsafe { cudarc::nvrtc::sys::culib() };
            let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
            let dir = maps
                .lines()
                .filter_map(|l| l.split_whitespace().nth(5))
                .find(|p| p.contains("/libnvrtc.so"))
                .and_then(|p| std::path::Path::new(p).parent().map(|d| d.to_path_buf()));
            if let Some(dir) = dir {
                let builtins = std::fs::read_dir(&dir).into_iter().flatten().flatten().map(|e| e.path()).find(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("libnvrtc-builtins.so.") && !n.contains("alt"))
                });
                if let Some(path) = builtins {
                    // SAFETY: a plain shared library with no initialisers that matter; kept loaded
                    // (RTLD_GLOBAL) so libnvrtc's own dlopen by bare name finds it.
                    let flags = libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL;
                    if let Ok(lib) = unsafe { libloading::os::unix::Library::open(Some(&path), flags) } {
                        std::mem::forget(lib);
                    }
                }
            }
            Ok(())
        })
        .clone()
}
