//! Where the run's figures go, each an [`Observer`]: the GPU monitor (which adds its readings to
//! each metrics line), metrics.jsonl, TensorBoard, and the progress bar with its log line, called
//! in that order.

use crate::{
    experiment::MetricsLog,
    sysinfo::GpuMonitor,
    tensorboard::{self, EventWriter},
    train::state::StepMetrics,
};
use anyhow::Result;
use indicatif::ProgressBar;

/// One step's own values, already on the host (a metrics line averages its window).
pub(super) struct StepValues {
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
}

pub(super) trait Observer {
    /// Adds what it measures to a metrics line before any observer is told of the line.
    fn measure(&mut self, _m: &mut StepMetrics) {}

    /// After each optimizer step (applied or skipped by the non-finite guard).
    fn step(&mut self, _step: u64, _values: &StepValues) -> Result<()> {
        Ok(())
    }

    /// A metrics line over the window since the last one; `timing` is the elapsed time and ETA.
    fn metrics(&mut self, _m: &StepMetrics, _timing: &str) -> Result<()> {
        Ok(())
    }

    /// The step's end, after its checkpoint.
    fn step_done(&mut self, _timing: &str) {}
}

/// GPU utilisation, power and memory per GPU in use, from NVML, sampled for each metrics line
/// (nothing without NVML).
pub(super) struct GpuSampler(pub GpuMonitor);

impl Observer for GpuSampler {
    fn measure(&mut self, m: &mut StepMetrics) {
        if let Some(g) = self.0.sample() {
            (m.gpu_util, m.gpu_power_w, m.gpu_mem_mb) = (Some(g.util), Some(g.power_w), Some(g.mem_mb));
        }
    }
}

/// `metrics.jsonl` (nothing on ranks other than 0).
pub(super) struct MetricsFile(pub MetricsLog);

impl Observer for MetricsFile {
    fn metrics(&mut self, m: &StepMetrics, _timing: &str) -> Result<()> {
        self.0.log(m)
    }
}

/// TensorBoard event files beside metrics.jsonl (`tensorboard --logdir experiments/`): every
/// metrics line, and the step's own values every `every` steps (0: never).
pub(super) struct TensorBoard {
    pub writer: EventWriter,
    pub every: u64,
}

impl Observer for TensorBoard {
    fn step(&mut self, step: u64, v: &StepValues) -> Result<()> {
        if self.every > 0 && step % self.every == 0 {
            let values = [("train_step/loss", v.loss), ("train_step/lr", v.lr), ("train_step/grad_norm", v.grad_norm)];
            self.writer.add_scalars(step as i64, &values.map(|(k, v)| (k.to_string(), v)))?;
            self.writer.flush()?;
        }
        Ok(())
    }

    fn metrics(&mut self, m: &StepMetrics, _timing: &str) -> Result<()> {
        tensorboard::log_metrics(&mut self.writer, &serde_json::to_value(m)?)?;
        Ok(())
    }
}

/// The progress bar (its message: the last metrics line's values and the time) and the log line
/// of each metrics line.
pub(super) struct Progress {
    pub bar: ProgressBar,
    pub steps: u64,
    /// The last metrics line's values, shown on the bar beside the time.
    pub stats: String,
}

impl Observer for Progress {
    fn metrics(&mut self, m: &StepMetrics, timing: &str) -> Result<()> {
        self.stats = format!("loss {:.3}  τ̂ {:.3}  {:.0} tok/s  q_hs {:.1}", m.loss, m.tau_hat, m.tok_per_s, m.q_hs);
        self.bar.suspend(|| {
            tracing::info!(
                "step {}/{}  loss {:.4}  τ̂ {:.3}  acc@1 {:.3}  lr {:.2e}  |g| {:.3}  {:.0} tok/s  q_hs {:.1}  {timing}",
                m.step,
                self.steps,
                m.loss,
                m.tau_hat,
                m.acc.first().copied().unwrap_or(0.0),
                m.lr,
                m.grad_norm,
                m.tok_per_s,
                m.q_hs
            )
        });
        Ok(())
    }

    fn step_done(&mut self, timing: &str) {
        self.bar.inc(1);
        self.bar.set_message(format!("{}  {}", self.stats, timing));
    }
}
