//! The training loop: data -> target workers (frozen, on their own threads) -> hidden-state
//! buffer -> anchors -> drafter -> DFlash loss -> optimizer, with gradient accumulation,
//! clipping, warm-up + cosine schedule, metrics, checkpoints and exact resume.

use super::{
    anchors::AnchorSampler,
    loss::{resolve_gamma, tau_hat},
    schedule::lr_factor,
    state::{
        all_finite, DistillSummary, NonFiniteGuard, ResumeFrom, StepMetrics, StopSignal, TrainSummary, TrainerState,
        WindowSums, WindowTimes,
    },
    step::{clip_grad_norm, normalize_gradients, trainable_parameters, DraftLoss, StepSums},
    validation::{ValidationScores, ValidationSet},
};
use crate::{
    config::RunConfig,
    dist::Communicator,
    experiment::Experiment,
    pipeline::{
        capture::CaptureReader,
        components::Components,
        distill,
        hidden_cache::HiddenStateCache,
        stages::{feature_bytes_per_token, next_batch, target_workers, HostBatch, Micro},
        Feed, Job, PipelineOptions, Worker,
    },
    plugins::{DrafterHandle, OptimizerHandle},
    progress::{elapsed_eta, Pace},
    sysinfo::{peak_rss_mb, GpuMonitor},
    tensorboard,
};
use anyhow::{anyhow, bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use observers::{MetricsFile, Observer, Progress, StepValues, TensorBoard};
use plugin_api::{
    tch::{Device, Kind, Tensor},
    DataPosition,
};
use std::{path::Path, sync::Arc, time::Instant};

// When a checkpoint is written.
mod checkpoints;
// Where the figures go: metrics.jsonl, TensorBoard, the progress bar.
mod observers;
// The phases that write to the experiment: log, maybe_checkpoint, finish.
mod outputs;

#[derive(Default)]
pub struct TrainOptions {
    pub resume: Option<ResumeFrom>,
    /// Stop (with a checkpoint) after this step, as if interrupted: a long schedule in slices.
    pub stop_at: Option<u64>,
    /// Data-parallel replicas (None: this process alone). Rank 0 writes the experiment.
    pub comm: Option<Box<dyn Communicator>>,
}

pub fn train(
    cfg: &RunConfig,
    mut c: Components,
    exp: &mut Experiment,
    cache_dir: &Path,
    opts: TrainOptions,
) -> Result<TrainSummary> {
    let t = &cfg.train;
    let mut comm = opts.comm;
    let (rank, world) = comm.as_ref().map_or((0, 1), |c| (c.rank() as u64, c.world() as u64));
    // 1. Data, unless features come from a capture.
    let mut distilled = None;
    let capture = match &cfg.pipeline.capture {
        Some(dir) => Some(CaptureReader::open(Path::new(dir), &c.target.spec()?)?),
        None => {
            distilled = distill::prepare_data(&mut c, cache_dir)?;
            None
        }
    };

    // 2. Shared frozen parts and the drafter's needs.
    let drafter_device = crate::config::parse_device(cfg.drafter_device())?;
    let layer_ids: Vec<u32> = c.drafter.target_layer_ids()?;
    if let Some(cap) = &capture {
        cap.check_layers(&layer_ids)?;
    }
    let draft = DraftLoss::for_drafter(
        &c.drafter,
        &c.target,
        drafter_device,
        AnchorSampler { per_seq: t.anchors_per_seq, seed: cfg.seed, rule: t.anchors },
        resolve_gamma(t.loss_gamma, c.drafter.block_size()? as usize),
        t.loss_normalization,
    )?;
    let (block_size, mask_token_id, gamma) = (draft.block_size, draft.mask_token_id, draft.gamma);
    let (named, params) = trainable_parameters(&c.drafter)?;
    let n_params: i64 = params.iter().map(|p| p.numel() as i64).sum();
    tracing::info!(
        "drafter: {:.1}M trainable parameters, block {block_size}, target layers {layer_ids:?}, mask token {mask_token_id}, gamma {}, \
         loss_normalization {}, anchors {}",
        n_params as f64 / 1e6,
        gamma.map_or("none".to_string(), |g| g.to_string()),
        t.loss_normalization,
        t.anchors,
    );
    // Replicas: every rank starts from rank 0's weights; the optimizer may split its work.
    if let Some(comm) = comm.as_deref_mut() {
        comm.broadcast(&params, 0)?;
        c.optimizer.set_collectives(comm.collectives())?;
    }
    c.optimizer.init(named)?;
    // The validation split's target features, once, before the target moves to its worker.
    // Every rank scores it alike (same weights, same batches); rank 0 writes the scores.
    let validation = match t.eval_every {
        0 => None,
        n => Some(ValidationSet::prepare(&mut c, &layer_ids, &draft.sampler, n)?),
    };

    // 3. Resume: weights, optimizer state, counters, data position.
    let mut state = TrainerState {
        step: 0,
        tokens: 0,
        draft_tokens: 0,
        data_epoch: 0,
        data_index: 0,
        micro_batches: 0,
        skipped_steps: 0,
        nonfinite_in_a_row: 0,
        seed: cfg.seed,
        window: WindowSums::new(block_size),
        elapsed_s: 0.0,
        fork: None,
    };
    let mut last_ckpt = None;
    if let Some(r) = opts.resume {
        c.drafter.load_weights(r.weights.into())?;
        // No saved state: a fork that starts its optimizer afresh.
        if !r.optimizer_state.is_empty() {
            c.optimizer.load_state(r.optimizer_state.into())?;
        }
        if capture.is_none() {
            let pos = DataPosition { epoch: r.state.data_epoch, index: r.state.data_index };
            c.data.seek(pos)?;
        }
        tracing::info!("resuming from {} (step {}, {} target tokens)", r.checkpoint, r.state.step, r.state.tokens);
        state = r.state;
        last_ckpt = Some(r.checkpoint);
    }
    if state.step >= t.steps {
        bail!("nothing to do: the run is at step {} of {}", state.step, t.steps);
    }

    // 4. The stages: producer (data or capture index), target workers, the drafter here.
    let total_micro = (t.steps - state.step) * t.grad_accum;
    let spec = c.target.spec()?;
    let feature_bytes_per_token = feature_bytes_per_token(cfg, layer_ids.len(), spec.hidden_size);
    let cache = HiddenStateCache::new(t.hidden_cache_mb << 20, feature_bytes_per_token);
    let cache_p = Arc::clone(&cache);
    let pipe =
        PipelineOptions { buffer_bytes: cfg.pipeline.buffer_bytes(), deterministic: cfg.pipeline.deterministic() };
    let devices = cfg.target_devices();
    let n_workers = if capture.is_some() { 1 } else { devices.len() };
    let (data, target, extra) = (&mut c.data, &mut c.target, &mut c.extra_targets);
    let first_draw = state.micro_batches;
    let mut produced = 0u64;
    let capture_ref = capture.as_ref();
    // With R replicas, each reads every batch and keeps its share: batch `rank` of each group of R,
    // tagged with the position after the whole group (where every rank resumes).
    let producer = move || -> Result<Option<Job<HostBatch>>> {
        if produced == total_micro {
            return Ok(None);
        }
        let index = first_draw + produced * world + rank;
        let mut b = match capture_ref {
            Some(cap) => cap.batch(index)?,
            None => {
                let mut mine = None;
                for r in 0..world {
                    let b = next_batch(data)?;
                    if r == rank {
                        mine = Some(b);
                    } else if let Some(m) = mine.as_mut() {
                        m.position = b.position;
                    }
                }
                mine.expect("rank < world")
            }
        };
        b.index = index;
        if capture_ref.is_none() {
            b.cache_ticket = Some(cache_p.plan(&b.sequence_ids, &b.lengths));
        }
        produced += 1;
        let bytes = b.input_ids.numel() * feature_bytes_per_token;
        Ok(Some(Job { payload: b, bytes }))
    };
    let workers: Vec<Worker<HostBatch, Micro>> = match capture_ref {
        Some(cap) => vec![cap.worker(drafter_device)],
        None => target_workers(target, extra, &devices, &layer_ids, &cache, drafter_device),
    };
    tracing::info!(
        "pipeline: {n_workers} target worker(s) on {:?}, drafter on {}, buffer {} MiB, {}",
        if capture.is_some() { vec!["capture".to_string()] } else { devices.clone() },
        cfg.drafter_device(),
        pipe.buffer_bytes >> 20,
        if pipe.deterministic { "deterministic order" } else { "arrival order" }
    );

    // 5. The drafter's stage: one step after another, as the features arrive.
    let lead = rank == 0;
    let bar = progress_bar(t.steps, state.step, lead);
    let mut trainer = Trainer {
        cfg,
        drafter: &mut c.drafter,
        optimizer: &mut c.optimizer,
        params,
        device: drafter_device,
        draft,
        validation,
        val_total_s: 0.0,
        val_count: 0,
        pace: Pace::new(WARMUP_STEPS, PACE_WINDOW),
        guard: NonFiniteGuard { max: t.max_nonfinite_steps, consecutive: state.nonfinite_in_a_row },
        elapsed_before: state.elapsed_s,
        observers: observers(exp, &bar, t.steps, t.tensorboard_every, lead)?,
        bar,
        state,
        exp,
        comm,
        world,
        lead,
        feature_bytes_per_token,
        from_capture: capture.is_some(),
        stop: StopSignal::install()?,
        gpus: GpuMonitor::new(devices.iter().map(String::as_str).chain([cfg.drafter_device()])),
        times: WindowTimes::default(),
        busy_before: Vec::new(),
        wait_before: 0.0,
        hs_total_bytes: 0,
        started: Instant::now(),
        first: None,
        last: None,
        last_ckpt,
        interrupted: None,
        stopped_at: None,
        distilled: distilled.map(|d| DistillSummary { replies: d.replies, cached: d.cached, seconds: d.seconds }),
    };
    crate::pipeline::run(&pipe, producer, workers, |feed| trainer.run(feed, opts.stop_at))?;
    trainer.finish()
}

/// Steps left out of the ETA's pace: the first steps load kernels, grow the allocator and plan
/// cuDNN's shapes.
const WARMUP_STEPS: u64 = 3;
/// Steps the pace is the mean of.
const PACE_WINDOW: usize = 20;

/// metrics.jsonl, TensorBoard (the lead rank only) and the progress bar, in the order they are
/// told.
fn observers(
    exp: &mut Experiment,
    bar: &ProgressBar,
    steps: u64,
    tensorboard_every: u64,
    lead: bool,
) -> Result<Vec<Box<dyn Observer>>> {
    let mut out: Vec<Box<dyn Observer>> = vec![Box::new(MetricsFile(exp.take_metrics_log()))];
    if lead {
        let writer = tensorboard::EventWriter::create(&exp.dir)?;
        out.push(Box::new(TensorBoard { writer, every: tensorboard_every }));
    }
    out.push(Box::new(Progress { bar: bar.clone(), steps, stats: String::new() }));
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

/// The drafter's side of the pipeline: micro-steps into one optimizer step, then logging and
/// checkpointing, until the schedule ends or a signal or `--stop-at` stops it.
struct Trainer<'a> {
    cfg: &'a RunConfig,
    drafter: &'a mut DrafterHandle,
    optimizer: &'a mut OptimizerHandle,
    /// The drafter's trainable parameters (handles sharing its storage).
    params: Vec<Tensor>,
    draft: DraftLoss,
    /// Scored every `eval_every` steps and at the last.
    validation: Option<ValidationSet>,
    /// Seconds spent on it in this process (not training time), and how many times it ran.
    val_total_s: f64,
    val_count: u64,
    /// Seconds per step (validation left out), for the ETA.
    pace: Pace,
    state: TrainerState,
    exp: &'a mut Experiment,
    comm: Option<Box<dyn Communicator>>,
    /// Replicas in the run; rank 0 (the lead) writes metrics and checkpoints.
    world: u64,
    lead: bool,
    device: Device,
    feature_bytes_per_token: usize,
    from_capture: bool,
    guard: NonFiniteGuard,
    stop: StopSignal,
    /// Shared with the progress observer; other log lines print around it.
    bar: ProgressBar,
    observers: Vec<Box<dyn Observer>>,
    gpus: GpuMonitor,
    /// The logging window's timings and the stage counters they are measured against.
    times: WindowTimes,
    busy_before: Vec<f64>,
    wait_before: f64,
    hs_total_bytes: u64,
    started: Instant,
    elapsed_before: f64,
    first: Option<StepMetrics>,
    last: Option<StepMetrics>,
    last_ckpt: Option<String>,
    interrupted: Option<u8>,
    stopped_at: Option<u64>,
    /// What self-distillation did before the loop (for the summary).
    distilled: Option<DistillSummary>,
}

/// One step's micro-batches as they accumulate: loss, weight sum and accuracy counts stay on the
/// device.
struct StepAccum {
    loss_sum: Tensor,
    weight_sum: Tensor,
    counts: Tensor,
    tokens: u64,
    last_position: Option<DataPosition>,
}

impl<'a> Trainer<'a> {
    fn run(&mut self, feed: &mut Feed<Micro>, stop_at: Option<u64>) -> Result<()> {
        let t = &self.cfg.train;
        self.busy_before = feed.worker_busy_s();
        self.wait_before = feed.wait_s;
        for step in self.state.step + 1..=t.steps {
            self.times.started.get_or_insert_with(Instant::now);
            let (step_started, val_before) = (Instant::now(), self.val_total_s);
            let mut acc = StepAccum {
                loss_sum: Tensor::zeros([], (Kind::Float, self.device)),
                weight_sum: Tensor::zeros([], (Kind::Float, self.device)),
                counts: Tensor::zeros([2, self.draft.block_size - 1], (Kind::Int64, self.device)),
                tokens: 0,
                last_position: None,
            };
            for _ in 0..t.grad_accum {
                let ready = feed.next()?.ok_or_else(|| anyhow!("pipeline ended before step {step}"))?;
                self.times.depth_sum += feed.depth() as f64;
                // Held until the micro-step ends: its room in the buffer is freed with it.
                self.micro_step(&ready.item, &mut acc)?;
            }
            let (grad_norm, any_rank_stopped) = self.finish_step(step, acc)?;
            let val = self.maybe_validate(step)?;
            if step % t.log_every == 0 || step == t.steps || step == 1 || val.is_some() {
                self.log(step, grad_norm, feed, val)?;
            }
            self.interrupted = self.stop.requested().or(any_rank_stopped.then_some(143));
            if stop_at == Some(step) && step < t.steps {
                self.stopped_at = Some(step);
            }
            self.maybe_checkpoint(step)?;
            self.pace.record(step_started.elapsed().as_secs_f64() - (self.val_total_s - val_before));
            let timing = self.timing(step);
            for o in &mut self.observers {
                o.step_done(&timing);
            }
            if let Some(code) = self.interrupted {
                let sig = StopSignal::name(code);
                let ckpt = self.last_ckpt.as_deref().unwrap_or("-");
                self.bar.suspend(|| tracing::warn!("{sig}: stopped after step {step}; checkpoint {ckpt}"));
                break;
            }
            if self.stopped_at.is_some() {
                let dir = self.exp.dir.display();
                self.bar.suspend(|| tracing::info!("--stop-at {step}: stopped; resume with `train --resume {dir}`"));
                break;
            }
        }
        Ok(())
    }

    /// The validation split's scores when an evaluation is due (every `eval_every` steps and at
    /// the last step).
    fn maybe_validate(&mut self, step: u64) -> Result<Option<ValidationScores>> {
        let t = &self.cfg.train;
        let Some(set) = self.validation.as_ref().filter(|_| step % t.eval_every == 0 || step == t.steps) else {
            return Ok(None);
        };
        let scores = set.score(&self.draft, self.drafter).context("validation")?;
        self.times.val_s += scores.seconds;
        self.val_total_s += scores.seconds;
        self.val_count += 1;
        let n = set.sequences();
        self.bar.suspend(|| {
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
        let steps = self.pace.eta(t.steps - step)?;
        let validations = match t.eval_every {
            0 => 0,
            n => t.steps / n - step / n + u64::from(t.steps % n != 0 && step < t.steps),
        };
        let per_validation = if self.val_count > 0 { self.val_total_s / self.val_count as f64 } else { 0.0 };
        Some(steps + validations as f64 * per_validation)
    }

    /// `3m05s elapsed, ETA 12m00s`: this process's wall time and [`eta_s`](Self::eta_s).
    fn timing(&self, step: u64) -> String {
        elapsed_eta(self.started.elapsed().as_secs_f64(), self.eta_s(step))
    }

    /// Training seconds so far, over every session of the run (validation left out).
    fn train_elapsed_s(&self) -> f64 {
        self.elapsed_before + self.started.elapsed().as_secs_f64() - self.val_total_s
    }

    /// One micro-batch: anchors, drafter forward, loss, backward (its sum, or with per-micro-batch
    /// normalisation its mean / K); the loss, weight sum and counts are added on the device,
    /// nothing waits for the GPU.
    fn micro_step(&mut self, m: &Micro, acc: &mut StepAccum) -> Result<()> {
        let t1 = Instant::now();
        self.hs_total_bytes += (m.input_ids.numel() * self.feature_bytes_per_token) as u64;
        let d = self.draft.compute(self.drafter, &m.input_ids, &m.loss_mask, &m.hidden, m.index)?;
        let scale = self.draft.backward_scale(self.cfg.train.grad_accum);
        d.backward(self.drafter, scale)?;
        acc.loss_sum += d.loss.loss.detach();
        acc.weight_sum += &d.loss.weight_sum;
        acc.counts += &d.loss.counts;
        acc.tokens += m.lengths.iter().map(|&l| l as u64).sum::<u64>();
        acc.last_position = Some(m.position);
        self.times.drafter_s += t1.elapsed().as_secs_f64();
        Ok(())
    }

    /// The step's end: gradients normalised (over the weight sum of every micro-batch on every
    /// rank, or averaged over replicas), clipped, the step's one synchronisation (loss, weight
    /// sum, gradient norm and counts in one copy), the non-finite guard, the optimizer, and the
    /// counters. Returns the gradient norm and whether any rank asked to stop.
    fn finish_step(&mut self, step: u64, acc: StepAccum) -> Result<(f64, bool)> {
        let t = &self.cfg.train;
        let t2 = Instant::now();
        let n = self.draft.block_size as usize - 1;
        let mut sums = StepSums {
            loss: 0.0,
            weight: 0.0,
            tokens: acc.tokens,
            correct: vec![0; n],
            count: vec![0; n],
            stop: self.stop.requested().is_some(),
        };
        // Replicas: normalise the gradients over all of them, sum what the step counted, agree
        // on stopping.
        normalize_gradients(self.comm.as_mut(), &self.params, t.loss_normalization, &acc.weight_sum)?;
        let grad_norm = clip_grad_norm(&self.params, t.grad_clip);
        let host = Vec::<f64>::try_from(
            Tensor::cat(
                &[
                    acc.loss_sum.view([1]).to_kind(Kind::Double),
                    acc.weight_sum.view([1]).to_kind(Kind::Double),
                    grad_norm.to_device(self.device).view([1]).to_kind(Kind::Double),
                    acc.counts.flatten(0, -1).to_kind(Kind::Double),
                ],
                0,
            )
            .to_device(Device::Cpu),
        )?;
        let grad_norm = host[2];
        (sums.loss, sums.weight) = (host[0], host[1]);
        sums.correct = host[3..3 + n].iter().map(|&c| c as i64).collect();
        sums.count = host[3 + n..].iter().map(|&c| c as i64).collect();
        if let Some(comm) = self.comm.as_deref_mut() {
            sums.all_reduce(comm)?;
        }
        let micro = t.grad_accum * self.world;
        let step_loss = sums.step_loss(t.loss_normalization, micro);
        let state = &mut self.state;
        state.micro_batches += micro;
        state.window.micro += micro;
        state.window.tokens += sums.tokens;
        state.tokens += sums.tokens;
        for k in 0..sums.count.len() {
            state.window.correct[k] += sums.correct[k];
            state.window.count[k] += sums.count[k];
            state.window.draft_tokens += sums.count[k] as u64;
            state.draft_tokens += sums.count[k] as u64;
        }
        let last_ckpt = self.last_ckpt.as_deref().unwrap_or("(none yet)");
        let apply = self
            .guard
            .check(step, step_loss, grad_norm)
            .map_err(|e| anyhow!("{e:#}; stopped, the last good checkpoint is {last_ckpt}"))?;
        if apply {
            // The window's loss is the mean of its steps' losses (each step weighs its micro-batches).
            state.window.loss_sum += step_loss * micro as f64;
            let scale = lr_factor(step, t.steps, t.warmup_frac, t.min_lr_frac, state.fork.as_ref());
            self.optimizer.step(scale)?;
        } else {
            state.skipped_steps += 1;
            state.window.skipped_micro += micro;
        }
        state.nonfinite_in_a_row = self.guard.consecutive;
        let lr =
            lr_factor(step, t.steps, t.warmup_frac, t.min_lr_frac, state.fork.as_ref()) * self.optimizer.base_lr()?;
        let values = StepValues { loss: step_loss, lr, grad_norm };
        for o in &mut self.observers {
            o.step(step, &values)?;
        }
        // Gradients dropped, not zeroed (PyTorch's default): until the next backward they take
        // no memory, so the forward's activations never sit beside last step's gradients.
        for p in &self.params {
            kernels::autograd::clear_grad(p);
        }
        self.times.optim_s += t2.elapsed().as_secs_f64();
        state.window.steps += 1;
        state.step = step;
        if let (Some(pos), false) = (acc.last_position, self.from_capture) {
            (state.data_epoch, state.data_index) = (pos.epoch, pos.index);
        }
        Ok((grad_norm, sums.stop))
    }
}
