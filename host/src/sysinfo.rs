//! Process and GPU figures for the metrics: peak resident memory (Linux /proc), and GPU
//! utilisation, power and memory through NVML, loaded at run time (absent where there is none).

use nvml_wrapper::Nvml;

/// The process's peak resident set size (VmHWM) in MiB; 0 where /proc is missing.
pub fn peak_rss_mb() -> f64 {
    status_mb("VmHWM:")
}

/// A memory line of /proc/self/status (given in kB) in MiB; 0 where /proc is missing.
fn status_mb(key: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with(key)).and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

pub struct GpuSample {
    pub util: Vec<f64>,
    pub power_w: Vec<f64>,
    pub mem_mb: Vec<f64>,
}

/// The GPUs a run uses, watched through NVML.
pub struct GpuMonitor {
    nvml: Option<Nvml>,
    indices: Vec<u32>,
}

impl GpuMonitor {
    /// Watch the `cuda:N` devices among `devices`; without NVML (no driver) it samples nothing.
    pub fn new<'a>(devices: impl Iterator<Item = &'a str>) -> Self {
        let mut indices: Vec<u32> = devices.filter_map(|d| d.strip_prefix("cuda:")?.parse().ok()).collect();
        indices.sort_unstable();
        indices.dedup();
        let nvml = if indices.is_empty() {
            None
        } else {
            Nvml::init().map_err(|e| tracing::info!("NVML unavailable ({e}): no GPU metrics")).ok()
        };
        Self { nvml, indices }
    }

    pub fn sample(&self) -> Option<GpuSample> {
        let nvml = self.nvml.as_ref()?;
        let mut s = GpuSample { util: Vec::new(), power_w: Vec::new(), mem_mb: Vec::new() };
        for &i in &self.indices {
            // CUDA and NVML number devices alike unless CUDA_VISIBLE_DEVICES reorders them.
            let dev = nvml.device_by_index(i).ok()?;
            s.util.push(dev.utilization_rates().map_or(f64::NAN, |u| u.gpu as f64));
            s.power_w.push(dev.power_usage().map_or(f64::NAN, |mw| mw as f64 / 1000.0));
            s.mem_mb.push(dev.memory_info().map_or(f64::NAN, |m| m.used as f64 / 1048576.0));
        }
        Some(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_rss_is_read_and_cpu_runs_have_no_gpu_sample() {
        // The peak is the process's, and the tests beside this one raise it too: allocate past it.
        let before = peak_rss_mb();
        let now = status_mb("VmRSS:");
        let big = vec![1u8; ((before - now).max(0.0) as usize + 64) << 20];
        std::hint::black_box(&big);
        assert!(peak_rss_mb() >= before + 60.0, "{before} -> {}", peak_rss_mb());
        assert!(GpuMonitor::new(["cpu"].into_iter()).sample().is_none());
    }
}
