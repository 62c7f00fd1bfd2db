//! libtorch's Kineto profiler through csrc/profiler.cpp (tch does not bind it): the same trace
//! `torch.profiler` writes, with every aten op, the GPU kernels each launched, and named ranges.
//! `scripts/bench/trace_summary.py` reads the trace back as tables.

use crate::ffi::{
    dflash_profiler_start, dflash_profiler_stop, dflash_range_begin, dflash_range_end, with_error_buffer as call,
};
use std::ffi::{c_int, c_void, CString};
use std::path::Path;

/// A running profiler; `save` stops it and writes the Chrome trace. Dropped unsaved, it stops
/// and discards what it collected.
pub struct Profiler {
    running: bool,
}

impl Profiler {
    /// Start recording this thread's ops (and CUDA kernels when `cuda`).
    pub fn start(cuda: bool) -> Result<Self, String> {
        // SAFETY: plain C call; `err` is a buffer of the length passed.
        call(|e, n| unsafe { dflash_profiler_start(cuda as c_int, e, n) })?;
        Ok(Self { running: true })
    }

    /// Stop and write the trace (Chrome trace JSON) to `path`.
    pub fn save(mut self, path: &Path) -> Result<(), String> {
        self.running = false;
        let path = CString::new(path.to_string_lossy().as_bytes()).map_err(|e| e.to_string())?;
        // SAFETY: `path` is NUL-terminated and outlives the call.
        call(|e, n| unsafe { dflash_profiler_stop(path.as_ptr(), e, n) })
    }
}

impl Drop for Profiler {
    fn drop(&mut self) {
        if self.running {
            // SAFETY: a null path only stops the profiler.
            let _ = call(|e, n| unsafe { dflash_profiler_stop(std::ptr::null(), e, n) });
        }
    }
}

/// A named range in the trace while the guard lives (no cost beyond a check when no profiler
/// runs).
pub struct Range(*mut c_void);

pub fn range(name: &str) -> Range {
    let name = CString::new(name).unwrap_or_default();
    // SAFETY: the shim copies the name into the record it returns.
    Range(unsafe { dflash_range_begin(name.as_ptr()) })
}

impl Drop for Range {
    fn drop(&mut self) {
        // SAFETY: the pointer came from dflash_range_begin and is ended once.
        unsafe { dflash_range_end(self.0) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind, Tensor};

    #[test]
    fn a_trace_holds_the_ops_and_the_named_ranges() {
        let dir = std::env::temp_dir().join(format!("dflash-profiler-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("trace.json");
        let p = Profiler::start(false).unwrap();
        {
            let _r = range("matmul_phase");
            let a = Tensor::randn([64, 64], (Kind::Float, Device::Cpu));
            let _ = a.matmul(&a).sum(Kind::Float);
        }
        p.save(&path).unwrap();
        let trace: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let names: Vec<&str> =
            trace["traceEvents"].as_array().unwrap().iter().filter_map(|e| e["name"].as_str()).collect();
        assert!(names.contains(&"matmul_phase"), "{names:?}");
        assert!(names.contains(&"aten::matmul"), "{names:?}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
