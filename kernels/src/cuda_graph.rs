//! CUDA graphs of libtorch work (`at::cuda::CUDAGraph`, what `torch.cuda.graph` wraps): a forward
//! recorded once and replayed as one launch, for decoding, where a small model's forward is
//! hundreds of kernels of a few microseconds each and the host, not the GPU, sets the pace.
//!
//! A graph replays exactly the kernels it recorded, on the memory it recorded: its inputs are
//! tensors the caller keeps and writes before each replay, its outputs are the tensors the
//! recorded call returned, rewritten by each replay. Nothing in a recorded call may read a value
//! on the host (a `.item()`, a copy to the CPU) or copy from pageable host memory; such a call
//! fails to record, and [`CudaGraph::capture`] says so instead of returning a graph.
//!
//! The shim (csrc/cuda_graph.cpp) links libtorch_cuda, so it is a library of its own, embedded and
//! loaded at the first graph. While a call is recorded, the kernels of this crate launch on the
//! recording stream too (`nvrtc::Module::stream`).

use crate::ffi::{graph_shim, with_error_buffer, GraphShim};
use std::{
    collections::HashMap,
    ffi::{c_int, c_void},
    hash::Hash,
    panic::{catch_unwind, AssertUnwindSafe},
    sync::atomic::{AtomicUsize, Ordering},
};
use tch::{Device, Tensor};

/// The stream a call is being recorded on (its raw `cudaStream_t`) while one is, else 0: read at
/// every launch of this crate's kernels.
static RECORDING: AtomicUsize = AtomicUsize::new(0);

/// The raw stream this crate's kernels must launch on while a call is recorded.
pub(crate) fn recording_stream() -> Option<usize> {
    Some(RECORDING.load(Ordering::Relaxed)).filter(|&s| s != 0)
}

/// A recorded call, replayed on the stream current at [`replay`](Self::replay).
pub struct CudaGraph {
    raw: *mut c_void,
    shim: &'static GraphShim,
}

// SAFETY: the graph is only used through `&self`/`&mut self` by its owner; libtorch's CUDAGraph
// may be replayed from any thread.
unsafe impl Send for CudaGraph {}

impl CudaGraph {
    /// Record `call` on CUDA device `device`: it runs once as usual (the warm-up: libraries pick
    /// and cache their kernels and workspaces), then once recorded. Returns the graph, the
    /// warm-up's result (what this call computed) and the recorded call's (the graph's outputs).
    /// A call that cannot be recorded (it reads a value on the host, say) is an error, and the
    /// stream is left as it was.
    pub fn capture<T>(device: usize, mut call: impl FnMut() -> T) -> Result<(Self, T, T), String> {
        let shim = graph_shim()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: the shim writes a new graph's pointer into `raw`.
        with_error_buffer(|e, l| unsafe { (shim.new)(&mut raw, e, l) })?;
        let graph = Self { raw, shim };
        let mut stream = std::ptr::null_mut();
        // SAFETY: a live graph; the shim writes the side stream's handle into `stream`.
        with_error_buffer(|e, l| unsafe { (shim.enter)(graph.raw, device as c_int, &mut stream, e, l) })?;
        RECORDING.store(stream as usize, Ordering::Relaxed);
        let recorded = catch_unwind(AssertUnwindSafe(|| {
            let warm = call();
            // SAFETY: a live graph, its side stream current.
            with_error_buffer(|e, l| unsafe { (shim.capture_begin)(graph.raw, e, l) })?;
            let out = catch_unwind(AssertUnwindSafe(&mut call));
            // Ended also after a failed call: the stream leaves capture mode either way.
            // SAFETY: a live graph whose capture began.
            let ended = with_error_buffer(|e, l| unsafe { (shim.capture_end)(graph.raw, e, l) });
            let out = out.map_err(|p| panic_text(&p))?;
            ended.map(|_| (warm, out))
        }));
        RECORDING.store(0, Ordering::Relaxed);
        // SAFETY: a live graph; makes the outer stream current again.
        let exited = with_error_buffer(|e, l| unsafe { (shim.exit)(graph.raw, e, l) });
        let (warm, out) = recorded.map_err(|p| panic_text(&p))??;
        exited?;
        Ok((graph, warm, out))
    }

    /// Run the recorded kernels again on the current stream.
    pub fn replay(&self) -> Result<(), String> {
        // SAFETY: a live graph whose capture ended.
        with_error_buffer(|e, l| unsafe { (self.shim.replay)(self.raw, e, l) })
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // SAFETY: `raw` came from the shim and is freed once.
        unsafe { (self.shim.free)(self.raw) }
    }
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "the recorded call panicked".into())
}

/// Whether decoding may record its forwards as CUDA graphs: `DFLASH_CUDA_GRAPHS=0` (which `eval
/// --eager` sets) runs them op by op. An environment variable, so that it reaches plugins built
/// apart, whose copies of this crate are their own.
pub fn enabled() -> bool {
    std::env::var("DFLASH_CUDA_GRAPHS").map_or(true, |v| v != "0")
}

/// Calls recorded once per key (a shape) and replayed with new inputs copied into the recorded
/// ones: what decoding keeps for each forward shape. A call must read only its inputs and
/// tensors that stay where they are (weights, static caches), and return fresh outputs.
pub struct Replays<K> {
    recorded: HashMap<K, Recorded>,
    /// Record calls on CUDA devices (no recording failed yet).
    record: bool,
    /// What is recorded, for the one warning where it cannot be ("the target's forward").
    what: &'static str,
}

struct Recorded {
    graph: CudaGraph,
    inputs: Vec<Tensor>,
    outputs: Vec<Tensor>,
}

impl<K: Eq + Hash> Replays<K> {
    /// Calls on CUDA devices are recorded; elsewhere each runs as usual.
    pub fn new(what: &'static str) -> Self {
        Self { recorded: HashMap::new(), record: true, what }
    }

    /// Forget the recordings (the tensors they read have moved).
    pub fn clear(&mut self) {
        self.recorded.clear();
    }

    pub fn len(&self) -> usize {
        self.recorded.len()
    }

    pub fn is_empty(&self) -> bool {
        self.recorded.is_empty()
    }

    /// `call(inputs)`: replayed where `key` was recorded; else run, and recorded on a CUDA device.
    /// The outputs are the caller's own (copies of a recording's). A call that cannot be recorded
    /// runs as usual, then and from then on, after one warning.
    pub fn run(
        &mut self,
        key: K,
        inputs: &[&Tensor],
        mut call: impl FnMut(&[Tensor]) -> Vec<Tensor>,
    ) -> Result<Vec<Tensor>, String> {
        if let Some(r) = self.recorded.get(&key) {
            for (recorded, new) in r.inputs.iter().zip(inputs) {
                recorded.shallow_clone().copy_(new);
            }
            r.graph.replay()?;
            return Ok(r.outputs.iter().map(Tensor::copy).collect());
        }
        let as_given = || inputs.iter().map(|t| t.shallow_clone()).collect::<Vec<_>>();
        let device = inputs.first().map_or(Device::Cpu, |t| t.device());
        let (Device::Cuda(ordinal), true) = (device, self.record) else {
            return Ok(call(&as_given()));
        };
        let kept: Vec<Tensor> = inputs.iter().map(|t| t.copy()).collect();
        match CudaGraph::capture(ordinal, || call(&kept)) {
            Ok((graph, now, outputs)) => {
                self.recorded.insert(key, Recorded { graph, inputs: kept, outputs });
                Ok(now)
            }
            Err(e) => {
                eprintln!("warning: {} runs op by op: it could not be recorded as a CUDA graph ({e})", self.what);
                self.record = false;
                Ok(call(&as_given()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    fn affine(w: &Tensor) -> impl FnMut(&[Tensor]) -> Vec<Tensor> + '_ {
        move |x: &[Tensor]| vec![x[0].matmul(w) + 1.0, x[1].sum(Kind::Float)]
    }

    /// On the CPU nothing is recorded: each call runs.
    #[test]
    fn replays_run_every_call_on_the_cpu() {
        let w = Tensor::randn([4, 3], (Kind::Float, Device::Cpu));
        let mut replays = Replays::new("a test call");
        for _ in 0..2 {
            let (x, y) =
                (Tensor::randn([2, 4], (Kind::Float, Device::Cpu)), Tensor::ones([5], (Kind::Float, Device::Cpu)));
            let out = replays.run(1, &[&x, &y], affine(&w)).unwrap();
            assert!(out[0].allclose(&(x.matmul(&w) + 1.0), 1e-6, 1e-6, false));
        }
        assert!(replays.is_empty());
    }

    /// A recorded call replays with each new input (its outputs the caller's own, not rewritten
    /// by the next replay), one recording per key; a call that reads a value on the host cannot
    /// be recorded, runs as usual, and nothing is recorded after it.
    #[test]
    #[ignore = "needs a CUDA device: make gpu-test"]
    fn cuda_replays_rerun_the_recorded_kernels_on_new_inputs() {
        let device = crate::cuda_test_device();
        let w = Tensor::randn([4, 3], (Kind::Float, device));
        let mut replays = Replays::new("a test call");
        let mut kept = Vec::new();
        for i in 0..4 {
            let x = Tensor::randn([2, 4], (Kind::Float, device));
            let y = Tensor::full([5], i as f64, (Kind::Float, device));
            let out = replays.run("affine", &[&x, &y], affine(&w)).unwrap();
            assert!(out[0].allclose(&(x.matmul(&w) + 1.0), 1e-5, 1e-5, false), "call {i}");
            assert_eq!(out[1].double_value(&[]), 5.0 * i as f64, "call {i}");
            kept.push((x, out.into_iter().next().unwrap()));
        }
        for (x, out) in &kept {
            assert!(out.allclose(&(x.matmul(&w) + 1.0), 1e-5, 1e-5, false), "an earlier output was rewritten");
        }
        assert_eq!(replays.len(), 1);
        let x = Tensor::randn([3], (Kind::Float, device));
        let on_host = |x: &[Tensor]| vec![&x[0] * x[0].sum(Kind::Float).double_value(&[])];
        let out = replays.run("host", &[&x], on_host).unwrap();
        assert!(out[0].allclose(&(&x * x.sum(Kind::Float).double_value(&[])), 1e-5, 1e-5, false));
        assert_eq!(replays.len(), 1, "the host read was not recorded");
        let z = Tensor::randn([2, 4], (Kind::Float, device));
        let _ = replays.run("other", &[&z, &z], affine(&w)).unwrap();
        assert_eq!(replays.len(), 1, "nothing is recorded after a failure");
        // libtorch's stream is usable again.
        assert_eq!((Tensor::ones([3], (Kind::Float, device)) * 2.0).sum(Kind::Float).double_value(&[]), 6.0);
    }
}
