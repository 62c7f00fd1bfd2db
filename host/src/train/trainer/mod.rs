//! The training loop: data -> target workers (frozen, on their own threads) -> hidden-state
//! buffer -> anchors -> drafter -> DFlash loss -> optimizer, with gradient accumulation,
//! clipping, warm-up + cosine schedule, metrics, checkpoints and exact resume.

use super::{
    loss::tau_hat,
    schedule::lr_factor,
    state::{
        all_finite, DistillSummary, ResumeFrom, StepMetrics, StopSignal, TrainSummary, TrainerState, WindowSums,
        WindowTimes,
    },
    step_runner::{NonFiniteGuard, Reduced, StepAccum, StepRunner},
    validation::{ValidationScores, ValidationSet},
};
use crate::{
    config::RunConfig,
    dist::Communicator,
    experiment::Experiment,
    pipeline::{
        components::Components,
        hidden_cache::HiddenStateCache,
        stages::{feature_bytes_per_token, target_workers, HostBatch, Micro},
        Feed, PipelineOptions, Worker,
    },
    progress::{elapsed_eta, Pace},
    sysinfo::{peak_rss_mb, GpuMonitor},
    tensorboard,
};
use anyhow::{anyhow, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use observers::{GpuSampler, MetricsFile, Observer, Progress, StepValues, TensorBoard};
use setup::{DrafterSide, Draws, FeatureSource};
use std::{path::Path, sync::Arc, time::Instant};

// When a checkpoint is written.
mod checkpoints;
// Where the figures go: metrics.jsonl, TensorBoard, the progress bar, the GPU monitor.
mod observers;
// The phases that write to the experiment: log, maybe_checkpoint, finish.
mod outputs;
// What the loop is assembled from: features, the drafter's side, resume, the producer.
mod setup;

#[derive(Default)]
pub struct TrainOptions {
    pub resume: Option<ResumeFrom>,
    /// Stop (with a checkpoint) after this step, as if interrupted: a long schedule in slices.
    pub stop_at: Option<u64>,
    /// Data-parallel replicas (None: this process alone). Rank 0 writes the experiment.
    pub comm: Option<Box<dyn Communicator>>,
}

/// The run's folder: open already (a resume, a rank that writes nothing), or made once everything
/// that can be checked before the first step has been (the data read and rendered, the
/// validation split, the checkpoint's optimizer state and data position taken): a run refused
/// then leaves no folder behind.
pub enum RunFolder<'a> {
    Open(Experiment),
    New(Box<dyn FnOnce() -> Result<Experiment> + 'a>),
}

pub fn train(
    cfg: &RunConfig,
    mut c: Components,
    folder: RunFolder,
    cache_dir: &Path,
    opts: TrainOptions,
) -> Result<TrainSummary> {
    let t = &cfg.train;
    let mut comm = opts.comm;
    let (rank, world) = comm.as_ref().map_or((0, 1), |c| (c.rank() as u64, c.world() as u64));
    let source = FeatureSource::open(cfg, &mut c, cache_dir)?;
    let capture = source.capture.as_ref();
    let side = DrafterSide::assemble(cfg, &mut c, &mut comm, capture)?;
    let (state, last_ckpt) = setup::resume(cfg, &mut c, opts.resume, capture.is_some(), side.draft.block_size)?;
    let mut exp = match folder {
        RunFolder::Open(exp) => exp,
        RunFolder::New(create) => create()?,
    };
    let exp = &mut exp;

    // The stages: producer (data or capture index), target workers, the drafter here.
    let drafter_device = side.draft.embedding.device();
    let fbpt = feature_bytes_per_token(cfg, side.layer_ids.len(), c.target.spec()?.hidden_size);
    let cache = HiddenStateCache::new(t.hidden_cache_mb << 20, fbpt);
    let draws = Draws { first: state.micro_batches, total: (t.steps - state.step) * t.grad_accum, rank, world };
    let producer = setup::producer(&mut c.data, capture, Arc::clone(&cache), fbpt, draws);
    let devices = cfg.target_devices();
    let workers: Vec<Worker<HostBatch, Micro>> = match capture {
        Some(cap) => vec![cap.worker(drafter_device)],
        None => target_workers(&mut c.target, &mut c.extra_targets, &devices, &side.layer_ids, &cache, drafter_device),
    };
    let pipe =
        PipelineOptions { buffer_bytes: cfg.pipeline.buffer_bytes(), deterministic: cfg.pipeline.deterministic() };
    tracing::info!(
        "pipeline: {} target worker(s) on {:?}, drafter on {}, buffer {} MiB, {}",
        workers.len(),
        if capture.is_some() { vec!["capture".to_string()] } else { devices.clone() },
        cfg.drafter_device(),
        pipe.buffer_bytes >> 20,
        if pipe.deterministic { "deterministic order" } else { "arrival order" }
    );

    // The drafter's stage: one step after another, as the features arrive.
    let runner = StepRunner {
        drafter: &mut c.drafter,
        optimizer: &mut c.optimizer,
        params: side.params,
        draft: side.draft,
        grad_accum: t.grad_accum,
        grad_clip: t.grad_clip,
        comm,
        guard: NonFiniteGuard { max: t.max_nonfinite_steps, consecutive: state.nonfinite_in_a_row },
    };
    let lead = rank == 0;
    let bar = progress_bar(t.steps, state.step, lead);
    let gpus = GpuMonitor::new(devices.iter().map(String::as_str).chain([cfg.drafter_device()]));
    let mut trainer = Trainer {
        cfg,
        runner,
        validation: Validation { set: side.validation, total_s: 0.0, count: 0 },
        clock: Clock::new(state.elapsed_s, state.wall_s),
        outputs: Outputs { observers: observers(exp, &bar, gpus, t, lead)?, bar, first: None, last: None },
        control: Control { stop: StopSignal::install()?, stop_at: opts.stop_at, interrupted: None, stopped_at: None },
        run: RunFacts {
            lead,
            from_capture: capture.is_some(),
            feature_bytes_per_token: fbpt,
            distilled: source.distilled,
        },
        state,
        exp,
        last_ckpt,
    };
    crate::pipeline::run(&pipe, producer, workers, |feed| trainer.run(feed))?;
    trainer.finish()
}

/// Steps left out of the ETA's pace: the first steps load kernels, grow the allocator and plan
/// cuDNN's shapes.
const WARMUP_STEPS: u64 = 3;
/// Steps the pace is the mean of.
const PACE_WINDOW: usize = 20;

/// The GPU monitor, metrics.jsonl, TensorBoard (the lead rank only) and the progress bar, in the
/// order they are told.
fn observers(
    exp: &mut Experiment,
    bar: &ProgressBar,
    gpus: GpuMonitor,
    t: &crate::config::TrainConfig,
    lead: bool,
) -> Result<Vec<Box<dyn Observer>>> {
    let mut out: Vec<Box<dyn Observer>> =
        vec![Box::new(GpuSampler(gpus)), Box::new(MetricsFile(exp.take_metrics_log()))];
    if lead {
        let writer = tensorboard::EventWriter::create(&exp.dir)?;
        out.push(Box::new(TensorBoard { writer, every: t.tensorboard_every }));
    }
    out.push(Box::new(Progress { bar: bar.clone(), steps: t.steps, stats: String::new() }));
    Ok(out)
}

fn progress_bar(steps: u64, at: u64, lead: bool) -> ProgressBar {
    let bar = ProgressBar::new(steps)
        .with_style(ProgressStyle::with_template("train {bar:30} {pos}/{len} steps  {msg}").expect("template"));
    bar.set_position(at);
    if !lead {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    bar
}

/// The drafter's side of the pipeline: micro-steps into one optimizer step, then validation,
/// logging and checkpointing, until the schedule ends or a signal or `--stop-at` stops it.
struct Trainer<'a> {
    cfg: &'a RunConfig,
    /// The step: drafter, optimizer, loss, guard, replicas.
    runner: StepRunner<'a>,
    /// The checkpointed counters and the logging window's sums.
    state: TrainerState,
    validation: Validation,
    clock: Clock,
    outputs: Outputs,
    control: Control,
    run: RunFacts,
    exp: &'a mut Experiment,
    /// The last checkpoint written or resumed from.
    last_ckpt: Option<String>,
}

/// The validation split, scored every `eval_every` steps and at the last, and the seconds spent
/// on it in this process (not training time) over how many times it ran.
struct Validation {
    set: Option<ValidationSet>,
    total_s: f64,
    count: u64,
}

/// The run's time: this process's start, the training time of the processes before it, the pace
/// for the ETA, and the logging window's stage timings with the pipeline's counters they are
/// measured against.
struct Clock {
    started: Instant,
    elapsed_before: f64,
    /// The run's wall seconds before this process (from the checkpoint it resumed).
    wall_before: f64,
    /// Seconds per step (validation left out).
    pace: Pace,
    times: WindowTimes,
    busy_before: Vec<f64>,
    wait_before: f64,
    hs_total_bytes: u64,
}

impl Clock {
    fn new(elapsed_before: f64, wall_before: f64) -> Self {
        Clock {
            started: Instant::now(),
            elapsed_before,
            wall_before,
            pace: Pace::new(WARMUP_STEPS, PACE_WINDOW),
            times: WindowTimes::default(),
            busy_before: Vec::new(),
            wait_before: 0.0,
            hs_total_bytes: 0,
        }
    }
}

/// Where the figures go, the progress bar other log lines print around, and the first and last
/// metrics lines (for the summary).
struct Outputs {
    observers: Vec<Box<dyn Observer>>,
    bar: ProgressBar,
    first: Option<StepMetrics>,
    last: Option<StepMetrics>,
}

/// What ends the run before its last step: a signal (on any replica) or `--stop-at`.
struct Control {
    stop: StopSignal,
    stop_at: Option<u64>,
    /// The exit code of the signal that stopped the run.
    interrupted: Option<u8>,
    /// The step `--stop-at` stopped at.
    stopped_at: Option<u64>,
}

impl Control {
    /// After `step` of `last`: `any_rank_stopped` says a replica had a signal.
    fn after_step(&mut self, step: u64, last: u64, any_rank_stopped: bool) {
        self.interrupted = self.stop.requested().or(any_rank_stopped.then_some(143));
        if self.stop_at == Some(step) && step < last {
            self.stopped_at = Some(step);
        }
    }

    fn stopping(&self) -> bool {
        self.interrupted.is_some() || self.stopped_at.is_some()
    }
}

/// Facts of the run that do not change as it goes.
struct RunFacts {
    /// Rank 0: writes metrics and checkpoints.
    lead: bool,
    from_capture: bool,
    feature_bytes_per_token: usize,
    /// What self-distillation did before the loop (for the summary).
    distilled: Option<DistillSummary>,
}

impl Trainer<'_> {
    fn run(&mut self, feed: &mut Feed<Micro>) -> Result<()> {
        let t = &self.cfg.train;
        self.clock.busy_before = feed.worker_busy_s();
        self.clock.wait_before = feed.wait_s;
        for step in self.state.step + 1..=t.steps {
            let (step_started, val_before) = (Instant::now(), self.validation.total_s);
            let (grad_norm, any_rank_stopped) = self.step(step, feed)?;
            let val = self.maybe_validate(step)?;
            if step % t.log_every == 0 || step == t.steps || step == 1 || val.is_some() {
                self.log(step, grad_norm, feed, val)?;
            }
            self.control.after_step(step, t.steps, any_rank_stopped);
            self.maybe_checkpoint(step)?;
            self.clock.pace.record(step_started.elapsed().as_secs_f64() - (self.validation.total_s - val_before));
            let timing = self.timing(step);
            for o in &mut self.outputs.observers {
                o.step_done(&timing);
            }
            if self.control.stopping() {
                self.report_stop(step);
                break;
            }
        }
        Ok(())
    }

    /// One optimizer step from the feed's next `grad_accum` micro-batches: the step runner's
    /// micro-steps, reductions, guard and optimizer, the counters, the observers. Returns the
    /// gradient norm and whether any rank asked to stop.
    fn step(&mut self, step: u64, feed: &mut Feed<Micro>) -> Result<(f64, bool)> {
        let t = &self.cfg.train;
        self.clock.times.started.get_or_insert_with(Instant::now);
        let mut acc = self.runner.begin();
        let (r, started) = match self.gather(step, feed, &mut acc) {
            Ok(r) => r,
            Err(e) => return Err(self.after_failed_step(e)),
        };
        let lr_scale = lr_factor(step, t.steps, t.warmup_frac, t.min_lr_frac, self.state.fork.as_ref());
        let last_good = self.last_ckpt.as_deref().unwrap_or("(none yet)");
        let applied = self.runner.apply(step, &r, lr_scale, Some(last_good))?;
        self.state.count_step(&r, applied);
        self.state.nonfinite_in_a_row = self.runner.guard.consecutive;
        let values =
            StepValues { loss: r.loss, lr: lr_scale * self.runner.optimizer.base_lr()?, grad_norm: r.grad_norm };
        for o in &mut self.outputs.observers {
            o.step(step, &values)?;
        }
        self.clock.times.optim_s += started.elapsed().as_secs_f64();
        self.state.step = step;
        if let (Some(pos), false) = (acc.last_position, self.run.from_capture) {
            (self.state.data_epoch, self.state.data_index) = (pos.epoch, pos.index);
        }
        Ok((r.grad_norm, r.sums.stop))
    }

    /// The step's micro-batches through the drafter, and their reductions: everything before the
    /// optimizer changes a weight. A CUDA out-of-memory panic of the host's own work in a
    /// micro-step is an error here, as a plugin's is at its handle.
    fn gather(&mut self, step: u64, feed: &mut Feed<Micro>, acc: &mut StepAccum) -> Result<(Reduced, Instant)> {
        for _ in 0..self.cfg.train.grad_accum {
            let ready = feed.next()?.ok_or_else(|| anyhow!("pipeline ended before step {step}"))?;
            self.clock.times.depth_sum += feed.depth() as f64;
            let started = Instant::now();
            self.clock.hs_total_bytes += (ready.item.input_ids.numel() * self.run.feature_bytes_per_token) as u64;
            // Held until the micro-step ends: its room in the buffer is freed with it.
            let runner = &mut self.runner;
            crate::memory_estimate::catch_host_panic("the drafter's step", || runner.micro_step(&ready.item, acc))?;
            self.clock.times.drafter_s += started.elapsed().as_secs_f64();
        }
        let started = Instant::now();
        Ok((self.runner.reduce(acc, self.control.stop.requested().is_some())?, started))
    }

    /// A step that failed before the optimizer ran out of device memory: the weights are still
    /// the last step's, so they are checkpointed (where the last checkpoint is older) for a resume
    /// at a size that fits, and the error says where. Any other error is returned as it is.
    fn after_failed_step(&mut self, e: anyhow::Error) -> anyhow::Error {
        let done = self.state.step;
        let written = self.last_ckpt.as_deref().is_some_and(|c| c.ends_with(&format!("step-{done}")));
        if !crate::memory_estimate::is_oom_error(&e) || done == 0 || written || !self.run.lead {
            return e;
        }
        // As a stop does: the policy writes the checkpoint of the last step done.
        self.control.stopped_at = Some(done);
        let resume = format!("resume with `train --resume {}` at a size that fits", self.exp.dir.display());
        match self.maybe_checkpoint(done) {
            Ok(()) => match &self.last_ckpt {
                Some(ckpt) if ckpt.ends_with(&format!("step-{done}")) => {
                    anyhow!("{e:#} The weights of step {done} are checkpointed in {ckpt}: {resume}.")
                }
                _ => e,
            },
            Err(ckpt_err) => {
                let why = format!("{ckpt_err:#}");
                // A plugin that panicked answers no more calls (its state may be half-changed).
                let why = match why.contains("panicked before") {
                    true => "a plugin that panicked answers no more calls",
                    false => &why,
                };
                let last = self.last_ckpt.as_deref().unwrap_or("none yet");
                anyhow!("{e:#} The weights of step {done} could not be checkpointed ({why}); the last checkpoint is {last}.")
            }
        }
    }

    /// The log line of a stop before the schedule's end.
    fn report_stop(&self, step: u64) {
        if let Some(code) = self.control.interrupted {
            let sig = StopSignal::name(code);
            let ckpt = self.last_ckpt.as_deref().unwrap_or("-");
            self.outputs.bar.suspend(|| tracing::warn!("{sig}: stopped after step {step}; checkpoint {ckpt}"));
        } else {
            let dir = self.exp.dir.display();
            self.outputs
                .bar
                .suspend(|| tracing::info!("--stop-at {step}: stopped; resume with `train --resume {dir}`"));
        }
    }

    /// The validation split's scores when an evaluation is due (every `eval_every` steps and at
    /// the last step).
    fn maybe_validate(&mut self, step: u64) -> Result<Option<ValidationScores>> {
        let t = &self.cfg.train;
        let Some(set) = self.validation.set.as_ref().filter(|_| step % t.eval_every == 0 || step == t.steps) else {
            return Ok(None);
        };
        let scores = set.score(&self.runner.draft, self.runner.drafter).context("validation")?;
        self.clock.times.val_s += scores.seconds;
        self.validation.total_s += scores.seconds;
        self.validation.count += 1;
        let n = set.sequences();
        self.outputs.bar.suspend(|| {
            tracing::info!(
                "step {step}/{}  validation ({n} sequences): loss {:.4}  τ̂ {:.3}  acc@1 {:.3}  ({:.1} s)",
                t.steps,
                scores.loss,
                scores.tau_hat,
                scores.acc.first().copied().unwrap_or(0.0),
                scores.seconds
            )
        });
        Ok(Some(scores))
    }

    /// Seconds until the configured steps are done: the steps left at the smoothed pace, and the
    /// validations still due at their mean time so far; None while the pace is unknown.
    fn eta_s(&self, step: u64) -> Option<f64> {
        let t = &self.cfg.train;
        let steps = self.clock.pace.eta(t.steps - step)?;
        let validations = match t.eval_every {
            0 => 0,
            n => t.steps / n - step / n + u64::from(t.steps % n != 0 && step < t.steps),
        };
        let v = &self.validation;
        let per_validation = if v.count > 0 { v.total_s / v.count as f64 } else { 0.0 };
        Some(steps + validations as f64 * per_validation)
    }

    /// `3m05s elapsed, ETA 12m00s`: this process's wall time and [`eta_s`](Self::eta_s).
    fn timing(&self, step: u64) -> String {
        elapsed_eta(self.clock.started.elapsed().as_secs_f64(), self.eta_s(step))
    }

    /// Wall seconds so far, over every process of the run.
    fn wall_s(&self) -> f64 {
        self.clock.wall_before + self.clock.started.elapsed().as_secs_f64()
    }

    /// Training seconds so far, over every process of the run (validation left out).
    fn train_elapsed_s(&self) -> f64 {
        self.clock.elapsed_before + self.clock.started.elapsed().as_secs_f64() - self.validation.total_s
    }
}
