//! GPU memory in use, read with `cudaMemGetInfo` from the CUDA runtime libtorch already loaded
//! (tch exposes no allocator statistics). PyTorch's caching allocator keeps what it reserved
//! until the process ends, so the memory in use after a phase is the peak that phase reserved
//! (plus the CUDA context and library workspaces).

use plugin_api::tch::Device;

/// Bytes in use on CUDA device `index` (every process's), or None without a CUDA runtime.
pub fn device_used_bytes(index: usize) -> Option<u64> {
    kernels::ffi::cuda_mem_used(index)
}

pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// GiB in use on `device` (every process's), or None off CUDA.
pub(crate) fn mem(device: Device) -> Option<f64> {
    match device {
        Device::Cuda(i) => device_used_bytes(i).map(gib),
        _ => None,
    }
}

/// `bench train`'s device memory by part: the estimate made before anything loaded
/// (`memory_estimate.rs`) beside what the CUDA caching allocator measured for the same part, so
/// the estimate stays honest.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MemoryRow {
    pub part: String,
    pub estimate_gib: f64,
    /// None where the bench cannot measure it (on the CPU).
    pub measured_gib: Option<f64>,
}

impl MemoryRow {
    /// Measured over estimated.
    pub fn ratio(&self) -> Option<f64> {
        self.measured_gib.map(|m| m / self.estimate_gib)
    }
}

/// What the allocator held at each point of the bench (bytes), for [`rows`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Measured {
    /// Allocated after the target was built, and after the drafter and optimizer were.
    pub target_built: u64,
    pub all_built: u64,
    /// The peak over `all_built` during the drafter step phase (its features included).
    pub drafter_step_peak: u64,
    /// The peak over what was held during the full target forward phase (logits included).
    pub target_forward_peak: u64,
    /// In use on the device (cudaMemGetInfo) beyond what the allocator reserved.
    pub outside_allocator: u64,
}

use crate::memory_estimate::{Estimate, Part, Phase};
use plugin_api::describe::MemoryScale;

fn is_context(p: &Part) -> bool {
    p.name == "CUDA context and workspaces"
}

/// The forward's own parts (its working set) and what it returns (the drafter's input).
fn in_forward(p: &Part) -> bool {
    (!p.drafter && p.scale == MemoryScale::Batch) || p.name == "target features"
}

/// The estimate's parts grouped as the bench measures them, the measured beside each (None on
/// the CPU); the last row the peak of phases run one at a time (as the bench runs them; training
/// runs the target's forward beside the drafter's step, the estimate's total).
pub fn rows(e: &Estimate, m: Option<Measured>) -> Vec<MemoryRow> {
    let sum = |keep: &dyn Fn(&Part) -> bool| e.parts.iter().filter(|p| keep(p)).map(|p| p.bytes).sum::<u64>();
    let weights = sum(&|p| p.scale == MemoryScale::TargetWeights);
    let built = sum(&|p| p.phase() == Phase::Always && p.scale == MemoryScale::Fixed && !is_context(p));
    let step = e.step_peak();
    let forward = sum(&in_forward);
    let context = sum(&is_context);
    let one_at_a_time = weights + built + context + step.max(forward);
    let row = |part: &str, est: u64, measured: Option<u64>| MemoryRow {
        part: part.into(),
        estimate_gib: gib(est),
        measured_gib: measured.map(gib),
    };
    vec![
        row("target weights", weights, m.map(|m| m.target_built)),
        row("drafter and optimizer state", built, m.map(|m| m.all_built - m.target_built)),
        row("drafter step (peak over those)", step, m.map(|m| m.drafter_step_peak)),
        row("target forward (peak, logits)", forward, m.map(|m| m.target_forward_peak)),
        row("CUDA context and workspaces", context, m.map(|m| m.outside_allocator)),
        row(
            "total, phases one at a time",
            one_at_a_time,
            m.map(|m| m.all_built + m.drafter_step_peak.max(m.target_forward_peak) + m.outside_allocator),
        ),
    ]
}
