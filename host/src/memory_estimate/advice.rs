//! An estimate's total (its parts by [`Phase`]) and what would fit instead: a smaller batch, fewer
//! anchors, `checkpoint_layers`, tensor parallelism, an FP8 target; and the refusal naming them.

use super::{gib, Estimate, Part, Phase};
use plugin_api::describe::MemoryScale;

impl Estimate {
    /// The most held at once: what is always held, and the larger of a training step's phases
    /// (its activations, with the gradients of the micro-batches before where a step has several;
    /// or the gradients with the optimizer's copies of them).
    pub fn total(&self) -> u64 {
        self.total_with(|p| p.bytes)
    }

    /// [`total`](Self::total) with each part's bytes as `bytes` gives them.
    fn total_with(&self, bytes: impl Fn(&Part) -> u64) -> u64 {
        let of = |phase: Phase| self.parts.iter().filter(|p| p.phase() == phase).map(&bytes).sum::<u64>();
        let grads = of(Phase::Gradients);
        let held = if self.grad_accum > 1 { grads } else { 0 };
        of(Phase::Always) + (of(Phase::Activations) + held).max(grads + of(Phase::OptimizerStep))
    }

    /// The drafter's step at its peak (the larger of its phases): what `bench train` measures as
    /// the step's peak over the weights and state.
    pub fn step_peak(&self) -> u64 {
        self.total() - self.sum(|p| p.phase() == Phase::Always)
    }

    pub(super) fn sum(&self, keep: impl Fn(&Part) -> bool) -> u64 {
        self.parts.iter().filter(|p| keep(p)).map(|p| p.bytes).sum()
    }

    fn scaled(&self, scale: MemoryScale) -> u64 {
        self.sum(|p| p.scale == scale)
    }

    /// The parts as one line, largest first: `target weights 15.3 GiB, ...`.
    pub fn largest(&self, n: usize) -> String {
        let mut parts: Vec<&Part> = self.parts.iter().collect();
        parts.sort_by_key(|p| std::cmp::Reverse(p.bytes));
        let mut out: Vec<String> =
            parts.iter().take(n).map(|p| format!("{} {:.1} GiB", p.name, gib(p.bytes))).collect();
        let rest: u64 = parts.iter().skip(n).map(|p| p.bytes).sum();
        if rest > 0 {
            out.push(format!("{:.1} GiB in {} smaller parts", gib(rest), parts.len() - n));
        }
        out.join(", ")
    }

    /// The total at `batch` sequences and `anchors` a sequence, the parts scaled as they say.
    fn total_at(&self, batch: u32, anchors: u32) -> u64 {
        let b = batch as f64 / self.shape.batch.max(1) as f64;
        let a = anchors as f64 / self.shape.anchors_per_seq.max(1) as f64;
        self.total_with(|p| match p.scale {
            MemoryScale::Batch => (p.bytes as f64 * b) as u64,
            MemoryScale::BatchAnchors => (p.bytes as f64 * b * a) as u64,
            _ => p.bytes,
        })
    }

    /// The largest batch whose estimate fits in `device` bytes (None: not even one sequence).
    pub fn largest_batch(&self, device: u64) -> Option<u32> {
        let anchors = self.shape.anchors_per_seq;
        (self.total_at(1, anchors) <= device)
            .then(|| (1..1 << 16).take_while(|&b| self.total_at(b, anchors) <= device).last().unwrap_or(1))
    }

    /// The most anchors a sequence whose estimate fits at this batch (None: not even one, or
    /// nothing scales with them).
    pub fn largest_anchors(&self, device: u64) -> Option<u32> {
        let batch = self.shape.batch;
        let fits = |a: u32| self.total_at(batch, a) <= device;
        (self.scaled(MemoryScale::BatchAnchors) > 0 && fits(1))
            .then(|| (1..1 << 16).take_while(|&a| fits(a)).last().unwrap_or(1))
    }

    /// The total with the drafter's `checkpoint_layers` on (None: no such switch, or it is on).
    pub fn with_checkpointing(&self) -> Option<u64> {
        let checkpointed = self.checkpointed?;
        let mut e = self.clone();
        e.parts.retain(|p| !(p.drafter && matches!(p.scale, MemoryScale::Batch | MemoryScale::BatchAnchors)));
        let scale = MemoryScale::BatchAnchors;
        e.parts.push(Part {
            name: "drafter activations (checkpointed)".into(),
            bytes: checkpointed,
            scale,
            drafter: true,
        });
        Some(e.total())
    }

    /// The total with the target's weights split over `n` ranks instead of `tensor_parallel`
    /// (the drafter stays on the first).
    pub fn with_tensor_parallel(&self, n: usize) -> u64 {
        let share = self.tensor_parallel as f64 / n as f64;
        self.total_with(|p| match p.scale {
            MemoryScale::TargetWeights => (p.bytes as f64 * share) as u64,
            _ => p.bytes,
        })
    }

    /// The total with `[target] compute = "fp8"` (None: it is on, or the target cannot tell).
    pub fn with_fp8_target(&self) -> Option<u64> {
        let fp8 = self.fp8_target_weights?;
        let weights = self.scaled(MemoryScale::TargetWeights);
        Some(self.total() - weights + fp8)
    }

    /// What would fit in `device` bytes, each as a clause (`a micro-batch of 2 sequences`).
    pub fn what_fits(&self, device: u64) -> Vec<String> {
        let mut fits = Vec::new();
        if let Some(b) = self.largest_batch(device).filter(|&b| b < self.shape.batch) {
            fits.push(format!(
                "a micro-batch of {b} sequence{} (now {})",
                if b == 1 { "" } else { "s" },
                self.shape.batch
            ));
        }
        if let Some(a) = self.largest_anchors(device).filter(|&a| a < self.shape.anchors_per_seq) {
            fits.push(format!("{a} anchors a sequence (`anchors_per_seq`, now {})", self.shape.anchors_per_seq));
        }
        if let Some(c) = self.with_checkpointing().filter(|&c| c <= device) {
            fits.push(format!("`checkpoint_layers = true` in [drafter] ({:.1} GiB)", gib(c)));
        }
        if self.scaled(MemoryScale::TargetWeights) > 0 {
            if let Some(n) = [2, 4, 8]
                .into_iter()
                .filter(|&n| n > self.tensor_parallel)
                .find(|&n| self.with_tensor_parallel(n) <= device)
            {
                fits.push(format!(
                    "`tensor_parallel = {n}` in [target] over {n} GPUs ({:.1} GiB on the first)",
                    gib(self.with_tensor_parallel(n))
                ));
            }
            if let Some(t) = self.with_fp8_target().filter(|&t| t <= device) {
                fits.push(format!("an FP8 target, `compute = \"fp8\"` in [target] on Hopper ({:.1} GiB)", gib(t)));
            }
        }
        fits
    }

    /// The refusal: one paragraph naming the largest parts and what would fit.
    pub fn refusal(&self, device_name: &str, device: u64) -> String {
        let fits = self.what_fits(device);
        let advice = match fits.is_empty() {
            true => "Nothing of the batch, anchors, `checkpoint_layers`, `tensor_parallel` or an FP8 target alone fits it; a larger device or several of those together would.".to_string(),
            false => format!("What would fit: {}.", fits.join("; or ")),
        };
        format!(
            "not enough device memory: this config needs about {:.1} GiB on {device_name}, which has {:.1} GiB \
             (batch {} x {} tokens, {} anchors a sequence): {}. {advice}{} To run it anyway: --no-memory-check.",
            gib(self.total()),
            gib(device),
            self.shape.batch,
            self.shape.seq_len,
            self.shape.anchors_per_seq,
            self.largest(4),
            self.unknown_note(),
        )
    }

    pub(super) fn unknown_note(&self) -> String {
        match self.unknown.is_empty() {
            true => String::new(),
            false => format!(" (Not counted, as their plugins cannot tell: {}.)", self.unknown.join(", ")),
        }
    }
}
