//! `dflash-host doctor`: what this machine gives libtorch, in one screen. The libtorch build and
//! the CUDA version it was built for, the driver, the CUDA runtime, cuDNN, NCCL and NVRTC
//! versions (read from the libraries themselves), the GPUs (NVML), whether `libtorch_cuda.so`
//! loads and, if not, which of the libraries it links against are missing and how to get them.

use crate::environment::cache_dir;
use anyhow::Result;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// One library as the dynamic loader resolves it for `libtorch_cuda.so`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Needed {
    pub name: String,
    /// Where the loader finds it; None: missing.
    pub path: Option<PathBuf>,
}

/// `ldd`'s report on a shared library: each needed library and where it resolves.
pub fn parse_ldd(out: &str) -> Vec<Needed> {
    out.lines()
        .filter_map(|l| {
            let (name, rest) = l.trim().split_once(" => ")?;
            let path = rest.split(" (").next().unwrap_or("").trim();
            Some(Needed {
                name: name.trim().to_string(),
                path: (path != "not found" && !path.is_empty()).then(|| PathBuf::from(path)),
            })
        })
        .collect()
}

fn ldd(lib: &Path) -> Option<Vec<Needed>> {
    let out = std::process::Command::new("ldd").arg(lib).output().ok()?;
    Some(parse_ldd(&String::from_utf8_lossy(&out.stdout)))
}

/// `__version__` and `cuda` from libtorch's `version.py` (the torch wheel's).
pub fn parse_torch_version(text: &str) -> (Option<String>, Option<String>) {
    let value = |key: &str| {
        text.lines()
            .find(|l| l.starts_with(key) && l[key.len()..].trim_start().starts_with(['=', ':']))
            .and_then(|l| l.split('=').nth(1))
            .map(|v| v.trim().trim_matches(['\'', '"']).to_string())
            .filter(|v| v != "None")
    };
    (value("__version__"), value("cuda"))
}

/// A version integer from a library call: `major * a + minor * b + patch`.
fn split_version(v: i64, a: i64, b: i64) -> String {
    if b == 1 {
        format!("{}.{}", v / a, v % a / 10)
    } else {
        format!("{}.{}.{}", v / a, v % a / b, v % b)
    }
}

fn find<'a>(needed: &'a [Needed], prefix: &str) -> Option<&'a Needed> {
    needed.iter().find(|n| n.name.starts_with(prefix))
}

pub fn run(_plugin_paths: &[PathBuf]) -> Result<ExitCode> {
    let named = std::env::var_os("LIBTORCH").map(PathBuf::from).unwrap_or_else(|| cache_dir().join("libtorch"));
    // The libtorch this process runs on is the one to diagnose: LD_LIBRARY_PATH may name another
    // (a pip torch's `torch/lib`, with the same layout) than LIBTORCH or the cache.
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let libtorch = match loaded_libtorch(&maps) {
        Some(loaded) if std::fs::canonicalize(&loaded).ok() != std::fs::canonicalize(&named).ok() => {
            crate::say!("dflash-host runs on the libtorch at {} (not {})", loaded.display(), named.display());
            loaded
        }
        _ => named,
    };
    diagnose(&libtorch)
}

/// The folder of the libtorch mapped into this process (`/proc/self/maps`): the parent of the
/// `lib/` that holds `libtorch_cpu.so`.
pub fn loaded_libtorch(maps: &str) -> Option<PathBuf> {
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|path| path.ends_with("/libtorch_cpu.so"))
        .and_then(|path| Path::new(path).parent()?.parent().map(Path::to_path_buf))
}

fn diagnose(libtorch: &Path) -> Result<ExitCode> {
    let mut missing: Vec<String> = Vec::new();
    crate::say!("dflash-host doctor");
    let version = libtorch_line(libtorch, &mut missing);
    crate::say!("  tch          0.24.0, plugin ABI {}", plugin_api::ABI_VERSION);

    // The driver: libcuda.so.1 comes with it, never with a wheel.
    let driver = kernels::ffi::int_version(Path::new("libcuda.so.1"), b"cuDriverGetVersion\0");
    let cuda_lib = libtorch.join("lib/libtorch_cuda.so");
    let needed = ldd(&cuda_lib).unwrap_or_default();
    let cpu_needed = ldd(&libtorch.join("lib/libtorch_cpu.so")).unwrap_or_default();
    cuda_line(libtorch, driver, &needed, &cpu_needed);
    let cudnn = find(&needed, "libcudnn.so");
    let cudnn_v = cudnn.and_then(|n| n.path.as_deref()).and_then(kernels::ffi::cudnn_version);
    crate::say!("  cuDNN        {}", linked(cudnn, cudnn_v));
    let nccl = find(&needed, "libnccl.so");
    let nccl_v = nccl.and_then(|n| n.path.as_deref()).and_then(|p| kernels::ffi::int_version(p, b"ncclGetVersion\0"));
    crate::say!("  NCCL         {}", linked(nccl, nccl_v));
    let gpus = gpus();
    match &gpus {
        Ok(list) if list.is_empty() => crate::say!("  GPUs         none"),
        Ok(list) => {
            for (i, g) in list.iter().enumerate() {
                crate::say!("  GPU {i}        {g}");
            }
        }
        Err(why) => crate::say!("  GPUs         none ({why})"),
    }
    let absent: Vec<&str> = needed.iter().filter(|n| n.path.is_none()).map(|n| n.name.as_str()).collect();
    let loads = kernels::load_libtorch_cuda();
    let devices = if loads.is_ok() { tch::Cuda::device_count() } else { 0 };
    match &loads {
        Ok(()) => crate::say!("  libtorch_cuda.so loads; libtorch sees {devices} GPU(s)"),
        Err(_) if needed.is_empty() => {
            crate::say!("  libtorch_cuda.so  not found in {}", cuda_lib.parent().unwrap().display())
        }
        Err(_) if !absent.is_empty() => {
            crate::say!(
                "  libtorch_cuda.so  does not load: {} of the {} libraries it needs are missing",
                absent.len(),
                needed.len()
            )
        }
        Err(e) => crate::say!("  libtorch_cuda.so  does not load: {e}"),
    }
    if !absent.is_empty() {
        crate::say!("  missing      {}", absent.join(", "));
        missing.extend(absent.iter().map(|s| s.to_string()));
    }
    let gpu_here = driver.is_some() || gpus.as_ref().is_ok_and(|g| !g.is_empty());
    let complete = missing.is_empty() && loads.is_ok();
    Ok(verdict(gpu_here, complete, devices, version.as_deref()))
}

/// The libtorch line: its version and the CUDA it was built for, from its `version.py`; returns
/// the version (None, and `libtorch` missing, without one).
fn libtorch_line(libtorch: &Path, missing: &mut Vec<String>) -> Option<String> {
    let (version, cuda) =
        std::fs::read_to_string(libtorch.join("version.py")).map(|t| parse_torch_version(&t)).unwrap_or((None, None));
    match &version {
        Some(v) => crate::say!(
            "  libtorch     {v}{} at {}",
            cuda.as_ref().map(|c| format!(" (built for CUDA {c})")).unwrap_or_default(),
            libtorch.display()
        ),
        None => {
            crate::say!("  libtorch     no version.py at {} (LIBTORCH points elsewhere?)", libtorch.display());
            missing.push("libtorch".into());
        }
    }
    version
}

/// The CUDA line: the driver, the runtime libtorch links, NVRTC for kernels/.
fn cuda_line(libtorch: &Path, driver: Option<i64>, needed: &[Needed], cpu_needed: &[Needed]) {
    let runtime = find(needed, "libcudart.so").or_else(|| find(cpu_needed, "libcudart.so"));
    let runtime_v =
        runtime.and_then(|n| n.path.as_deref()).and_then(|p| kernels::ffi::int_version(p, b"cudaRuntimeGetVersion\0"));
    let nvrtc = nvrtc_version(libtorch);
    crate::say!(
        "  CUDA         {}; runtime {}; NVRTC {}",
        driver.map_or("no driver (libcuda.so.1 not found)".to_string(), |v| format!(
            "driver {}",
            split_version(v, 1000, 1)
        )),
        runtime_v.map_or_else(
            || "missing".to_string(),
            |v| format!("{} ({})", split_version(v, 1000, 1), runtime.map(|n| n.name.as_str()).unwrap_or(""))
        ),
        nvrtc.map_or_else(
            || "missing (kernels/ cannot compile its CUDA sources)".to_string(),
            |(name, v)| format!("{v} ({name})")
        ),
    );
}

/// A library libtorch_cuda links (cuDNN, NCCL): its version and file, missing, or not linked.
fn linked(lib: Option<&Needed>, version: Option<i64>) -> String {
    match (lib, version) {
        (Some(n), Some(v)) => format!("{} ({})", split_version(v, 10000, 100), n.name),
        (Some(n), None) => format!("missing ({})", n.name),
        (None, _) => "not linked".into(),
    }
}

/// What the machine is ready for, and what to do when a GPU is here but libtorch cannot use it
/// (exit 1).
fn verdict(gpu_here: bool, complete: bool, devices: i64, version: Option<&str>) -> ExitCode {
    if gpu_here && complete && devices > 0 {
        crate::say!("  => ready for device = \"cpu\" and \"cuda\" ({devices} GPU(s))");
        ExitCode::SUCCESS
    } else if gpu_here {
        crate::say!(
            "  => an NVIDIA driver is here but libtorch cannot use it: run `make setup` (or `GPU=1 make setup`),"
        );
        crate::say!("     which installs the NVIDIA wheels the torch {} wheel requires", version.unwrap_or("2.11.0"));
        ExitCode::from(1)
    } else if complete {
        crate::say!("  => ready for device = \"cpu\"; libtorch's GPU libraries are all here, device = \"cuda\" needs an NVIDIA driver");
        ExitCode::SUCCESS
    } else {
        crate::say!("  => ready for device = \"cpu\"; no NVIDIA driver here, so the GPU libraries are not needed");
        crate::say!("     (on a GPU machine `make setup` installs them; `GPU=1 make setup` forces it)");
        ExitCode::SUCCESS
    }
}

/// NVRTC as kernels/ loads it (the loader's search path, or beside libtorch), and its version.
fn nvrtc_version(libtorch: &Path) -> Option<(String, String)> {
    let beside = libtorch.join("../nvidia/cu13/lib/libnvrtc.so.13");
    let candidates =
        [PathBuf::from("libnvrtc.so.13"), PathBuf::from("libnvrtc.so.12"), PathBuf::from("libnvrtc.so"), beside];
    candidates.iter().find_map(|p| {
        let (major, minor) = kernels::ffi::nvrtc_version(p)?;
        Some((p.file_name().unwrap().to_string_lossy().to_string(), format!("{major}.{minor}")))
    })
}

/// Each GPU as NVML sees it: name, memory, driver.
fn gpus() -> std::result::Result<Vec<String>, String> {
    let nvml = nvml_wrapper::Nvml::init().map_err(|e| match e {
        nvml_wrapper::error::NvmlError::LibloadingError(_) => {
            "no NVIDIA driver: libnvidia-ml.so.1 not found".to_string()
        }
        e => format!("NVML: {e}"),
    })?;
    let driver = nvml.sys_driver_version().unwrap_or_default();
    let n = nvml.device_count().map_err(|e| format!("NVML: {e}"))?;
    (0..n)
        .map(|i| {
            let d = nvml.device_by_index(i).map_err(|e| format!("NVML device {i}: {e}"))?;
            let mem = d.memory_info().map(|m| m.total as f64 / (1u64 << 30) as f64).unwrap_or(f64::NAN);
            Ok(format!("{}, {mem:.0} GiB, driver {driver}", d.name().unwrap_or_default()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_libtorch_mapped_into_the_process_is_found() {
        let maps = "7f00-7f10 r--p 00000000 fd:01 11 /usr/lib/x86_64-linux-gnu/libc.so.6
7f20-7f30 r-xp 00010000 fd:01 12 /opt/venv/lib/python3.12/site-packages/torch/lib/libtorch_cpu.so
7f40-7f50 rw-p 00000000 00:00 0 ";
        assert_eq!(loaded_libtorch(maps), Some(PathBuf::from("/opt/venv/lib/python3.12/site-packages/torch")));
        assert_eq!(loaded_libtorch("7f00-7f10 r--p 00000000 fd:01 11 /usr/lib/libc.so.6"), None);
    }

    #[test]
    fn ldd_output_and_version_py_are_read() {
        let out = "\tlinux-vdso.so.1 (0x00007ffd)\n\tlibcudnn.so.9 => not found\n\tlibcudart.so.13 => /c/nvidia/cu13/lib/libcudart.so.13 (0x00007f)\n";
        assert_eq!(
            parse_ldd(out),
            vec![
                Needed { name: "libcudnn.so.9".into(), path: None },
                Needed { name: "libcudart.so.13".into(), path: Some("/c/nvidia/cu13/lib/libcudart.so.13".into()) },
            ]
        );
        let py =
            "__version__ = '2.11.0+cu130'\ndebug = False\ncuda: Optional[str] = '13.0'\nhip: Optional[str] = None\n";
        assert_eq!(parse_torch_version(py), (Some("2.11.0+cu130".into()), Some("13.0".into())));
        assert_eq!(split_version(13000, 1000, 1), "13.0");
        assert_eq!(split_version(91900, 10000, 100), "9.19.0");
        assert_eq!(split_version(22809, 10000, 100), "2.28.9");
    }
}
