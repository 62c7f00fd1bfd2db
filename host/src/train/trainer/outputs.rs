//! The trainer's phases that leave the process: a metrics line (metrics.jsonl, TensorBoard, the
//! log), a checkpoint when one is due, and the run's summary.

use super::{
    checkpoints::{Checkpoint, CheckpointPolicy},
    *,
};

impl Trainer<'_> {
    /// A metrics line over the window since the last one, to the observers, then a new window.
    pub(super) fn log(
        &mut self,
        step: u64,
        grad_norm: f64,
        feed: &Feed<Micro>,
        val: Option<ValidationScores>,
    ) -> Result<()> {
        let t = &self.cfg.train;
        let w = &self.state.window;
        let acc = w.acc();
        let secs =
            (self.clock.times.started.map_or(0.0, |s| s.elapsed().as_secs_f64()) - self.clock.times.val_s).max(1e-9);
        let busy_now = feed.worker_busy_s();
        let target_busy: Vec<f64> = busy_now.iter().zip(&self.clock.busy_before).map(|(a, b)| (a - b) / secs).collect();
        let target_s: f64 = busy_now.iter().zip(&self.clock.busy_before).map(|(a, b)| a - b).sum();
        self.clock.times.wait_s = feed.wait_s - self.clock.wait_before;
        let steps_w = w.steps.max(1) as f64;
        let (hs_bytes, hs_peak_bytes) = feed.bytes();
        let scale = lr_factor(step, t.steps, t.warmup_frac, t.min_lr_frac, self.state.fork.as_ref());
        let times = &self.clock.times;
        let mut m = StepMetrics {
            step,
            epoch: self.state.data_epoch,
            tokens: self.state.tokens,
            draft_tokens: self.state.draft_tokens,
            loss: w.loss_sum / (w.micro - w.skipped_micro).max(1) as f64,
            tau_hat: tau_hat(&acc),
            acc,
            lr: scale * self.runner.optimizer.base_lr()?,
            grad_norm,
            skipped_steps: self.state.skipped_steps,
            tok_per_s: w.tokens as f64 / secs,
            draft_tok_per_s: w.draft_tokens as f64 / secs,
            target_s: target_s / steps_w,
            drafter_s: times.drafter_s / steps_w,
            optim_s: times.optim_s / steps_w,
            wait_s: times.wait_s / steps_w,
            target_busy,
            drafter_busy: (times.drafter_s + times.optim_s) / secs,
            q_hs: times.depth_sum / w.micro.max(1) as f64,
            q_hs_now: feed.depth(),
            hs_bytes,
            hs_peak_bytes,
            hs_total_bytes: self.clock.hs_total_bytes,
            peak_rss_mb: peak_rss_mb(),
            gpu_util: None,
            gpu_power_w: None,
            gpu_mem_mb: None,
            eta_s: self.eta_s(step).unwrap_or((t.steps - step) as f64 * secs / steps_w),
            elapsed_s: self.train_elapsed_s(),
            val_loss: val.as_ref().map(|v| v.loss),
            val_tau_hat: val.as_ref().map(|v| v.tau_hat),
            val_s: val.as_ref().map(|v| v.seconds),
            val_acc: val.map(|v| v.acc),
        };
        for o in &mut self.outputs.observers {
            o.measure(&mut m);
        }
        let timing = self.timing(step);
        for o in &mut self.outputs.observers {
            o.metrics(&m, &timing)?;
        }
        self.outputs.first.get_or_insert_with(|| m.clone());
        self.outputs.last = Some(m);
        self.state.window = WindowSums::new(self.runner.draft.block_size);
        self.clock.times = WindowTimes::default();
        self.clock.busy_before = busy_now;
        self.clock.wait_before = feed.wait_s;
        Ok(())
    }

    /// A checkpoint when [`CheckpointPolicy`] says so, written by the lead rank.
    pub(super) fn maybe_checkpoint(&mut self, step: u64) -> Result<()> {
        let t = &self.cfg.train;
        let finite = || all_finite(&self.runner.params);
        let decision = CheckpointPolicy::new(t).after_step(step, self.control.stopping(), finite);
        if decision == Checkpoint::NonFinite {
            self.outputs
                .bar
                .suspend(|| tracing::warn!("step {step}: drafter weights are not finite; checkpoint not written"));
        } else if decision == Checkpoint::Write && self.run.lead {
            self.state.elapsed_s = self.train_elapsed_s();
            self.state.wall_s = self.wall_s();
            let r = &self.runner;
            let (weights, config_json, optimizer_state) =
                (r.drafter.parameters()?, r.drafter.config_json()?, r.optimizer.state()?);
            let last_good = self.last_ckpt.as_deref().unwrap_or("none yet");
            let dir = self
                .exp
                .save_checkpoint(
                    step,
                    &weights,
                    config_json.as_str(),
                    &optimizer_state,
                    &self.state,
                    t.keep_checkpoints,
                )
                .map_err(|e| e.context(format!("stopped at step {step}; the last good checkpoint is {last_good}")))?;
            self.last_ckpt = Some(dir.display().to_string());
        }
        Ok(())
    }

    /// The run's summary (also written to the experiment when the schedule ran to its end).
    pub(super) fn finish(self) -> Result<TrainSummary> {
        self.outputs.bar.finish_and_clear();
        let summary = TrainSummary {
            experiment: self.exp.dir.display().to_string(),
            steps: self.state.step,
            tokens: self.state.tokens,
            wall_s: self.wall_s(),
            first: self.outputs.first,
            last: self.outputs.last,
            last_checkpoint: self.last_ckpt,
            interrupted: self.control.interrupted,
            stopped_at: self.control.stopped_at,
            distill: self.run.distilled,
        };
        if summary.interrupted.is_none() && summary.stopped_at.is_none() && self.run.lead {
            self.exp.write_summary(&summary)?;
        }
        Ok(summary)
    }
}
