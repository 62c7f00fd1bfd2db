//! What the trainer keeps between steps: the metrics record and its window, the checkpointed
//! trainer state (a step's reductions counted in), the stop signal, and what a resume starts from.

use plugin_api::{tch::Tensor, NamedTensor};
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// One metrics.jsonl record.
#[derive(Debug, Clone, Serialize)]
pub struct StepMetrics {
    pub step: u64,
    pub epoch: u64,
    /// Target tokens consumed so far.
    pub tokens: u64,
    /// Draft labels the loss counted so far.
    pub draft_tokens: u64,
    pub loss: f64,
    /// Top-1 accuracy per block position 1..Bk-1 over the logging window.
    pub acc: Vec<f64>,
    pub tau_hat: f64,
    pub lr: f64,
    pub grad_norm: f64,
    /// Steps skipped so far for a non-finite loss or gradient.
    pub skipped_steps: u64,
    /// Target tokens per second over the logging window (the pipeline's throughput).
    pub tok_per_s: f64,
    /// Draft labels per second over the window (the drafter's throughput).
    pub draft_tok_per_s: f64,
    /// Seconds per step over the window: target work summed over workers, drafter forward +
    /// loss + backward, optimizer (clip + step), and the drafter waiting for features. The
    /// drafter's work is queued without waiting for the GPU; the step's one synchronisation
    /// (loss, counts and gradient norm, before the optimizer) falls in `optim_s`.
    pub target_s: f64,
    pub drafter_s: f64,
    pub optim_s: f64,
    pub wait_s: f64,
    /// Share of the window each stage was busy: per target worker, and the drafter.
    pub target_busy: Vec<f64>,
    pub drafter_busy: f64,
    /// Hidden-state buffer: batches waiting for the drafter (mean over the window's micro-batches
    /// and now), bytes held now and at most so far.
    pub q_hs: f64,
    pub q_hs_now: usize,
    pub hs_bytes: usize,
    pub hs_peak_bytes: usize,
    /// Feature bytes that have passed through the buffer so far (this process).
    pub hs_total_bytes: u64,
    /// Peak resident memory of the process (MiB).
    pub peak_rss_mb: f64,
    /// GPU utilisation (%), power (W) and memory used (MiB) per GPU in use, from NVML; absent
    /// without NVML.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_util: Option<Vec<f64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_power_w: Option<Vec<f64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_mem_mb: Option<Vec<f64>>,
    pub eta_s: f64,
    /// Training seconds so far (the validation's own time left out).
    pub elapsed_s: f64,
    /// The validation split at this step (`train.eval_every`): the DFlash loss over all its
    /// labels, top-1 accuracy per block position, tau-hat, and the seconds it took.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_acc: Option<Vec<f64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_tau_hat: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_s: Option<f64>,
}

/// Everything a resumed run needs to continue exactly where a checkpoint was written (besides
/// the weights and optimizer state, which have their own files).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainerState {
    pub step: u64,
    pub tokens: u64,
    pub draft_tokens: u64,
    pub data_epoch: u64,
    pub data_index: u64,
    /// Micro-batches consumed: numbers the anchor draws and the capture's batches.
    pub micro_batches: u64,
    pub skipped_steps: u64,
    #[serde(default)]
    pub nonfinite_in_a_row: u64,
    pub seed: u64,
    /// The logging window so far, so the next metrics line equals the uninterrupted run's.
    #[serde(default)]
    pub window: WindowSums,
    #[serde(default)]
    pub elapsed_s: f64,
    /// Wall seconds of every process of the run up to this state (validation included; what a
    /// process spent loading before its first step left out).
    #[serde(default)]
    pub wall_s: f64,
    /// A fork's schedule from the step it was forked at (absent for a run that is no fork, or a
    /// fork that continues its parent's schedule unchanged).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork: Option<crate::train::schedule::ForkSchedule>,
}

impl TrainerState {
    /// A run's start: step 0, nothing counted, an empty window for `block_size`.
    pub fn new(seed: u64, block_size: i64) -> Self {
        TrainerState {
            step: 0,
            tokens: 0,
            draft_tokens: 0,
            data_epoch: 0,
            data_index: 0,
            micro_batches: 0,
            skipped_steps: 0,
            nonfinite_in_a_row: 0,
            seed,
            window: WindowSums::new(block_size),
            elapsed_s: 0.0,
            wall_s: 0.0,
            fork: None,
        }
    }

    /// What a step added: its micro-batches, tokens and accuracy counts, to the run and to the
    /// logging window; its loss to the window where it was applied (the window's loss is the mean
    /// of its steps' losses, each step weighing its micro-batches), else a skipped step.
    pub(super) fn count_step(&mut self, r: &super::step_runner::Reduced, applied: bool) {
        let (sums, micro) = (&r.sums, r.micro);
        self.micro_batches += micro;
        self.window.micro += micro;
        self.window.tokens += sums.tokens;
        self.tokens += sums.tokens;
        for k in 0..sums.count.len() {
            self.window.correct[k] += sums.correct[k];
            self.window.count[k] += sums.count[k];
            self.window.draft_tokens += sums.count[k] as u64;
            self.draft_tokens += sums.count[k] as u64;
        }
        if applied {
            self.window.loss_sum += r.loss * micro as f64;
        } else {
            self.skipped_steps += 1;
            self.window.skipped_micro += micro;
        }
        self.window.steps += 1;
    }
}

pub(super) fn all_finite(params: &[Tensor]) -> bool {
    params.iter().all(|p| p.isfinite().all().int64_value(&[]) != 0)
}

#[derive(Debug, Clone, Serialize)]
pub struct TrainSummary {
    pub experiment: String,
    pub steps: u64,
    pub tokens: u64,
    /// Wall seconds of the whole run, every process of a resumed one included.
    pub wall_s: f64,
    pub first: Option<StepMetrics>,
    pub last: Option<StepMetrics>,
    pub last_checkpoint: Option<String>,
    /// Exit code when a signal stopped the run (130 SIGINT, 143 SIGTERM, 129 SIGHUP).
    pub interrupted: Option<u8>,
    /// The step `--stop-at` stopped at (the run is resumable from there).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped_at: Option<u64>,
    /// Self-distillation before training: replies, how many came from the cache, seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub distill: Option<DistillSummary>,
}

#[derive(Debug, Clone, Serialize)]
pub struct DistillSummary {
    pub replies: u64,
    pub cached: u64,
    pub seconds: f64,
}

pub use crate::signals::StopSignal;

/// Sums over the logging window that the loss and accuracy lines come from (checkpointed).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct WindowSums {
    pub(super) loss_sum: f64,
    pub(super) micro: u64,
    /// Micro-batches of skipped steps (not in `loss_sum`).
    pub(super) skipped_micro: u64,
    pub(super) correct: Vec<i64>,
    pub(super) count: Vec<i64>,
    pub(super) tokens: u64,
    pub(super) draft_tokens: u64,
    pub(super) steps: u64,
}

/// The window's timings (not checkpointed: a resumed run measures its own).
#[derive(Default)]
pub(super) struct WindowTimes {
    pub drafter_s: f64,
    pub optim_s: f64,
    pub wait_s: f64,
    pub depth_sum: f64,
    /// Spent scoring the validation split (left out of the window's rates).
    pub val_s: f64,
    pub started: Option<Instant>,
}

impl WindowSums {
    pub(super) fn new(block_size: i64) -> Self {
        let positions = block_size as usize - 1;
        Self { correct: vec![0; positions], count: vec![0; positions], ..Default::default() }
    }

    /// Block positions the window counts (block_size - 1 of the drafter that wrote it).
    pub fn positions(&self) -> usize {
        self.correct.len()
    }

    pub(super) fn acc(&self) -> Vec<f64> {
        super::loss::accuracy(&self.correct, &self.count)
    }
}

/// Where a resumed run starts: a checkpoint's trainer state, weights and optimizer state.
pub struct ResumeFrom {
    pub state: TrainerState,
    pub weights: Vec<NamedTensor>,
    pub optimizer_state: Vec<NamedTensor>,
    pub checkpoint: String,
}
