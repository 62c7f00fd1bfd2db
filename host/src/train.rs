//! The trainer: data -> target (frozen) -> anchors -> drafter -> DFlash loss -> optimizer, with
//! gradient accumulation, clipping, warm-up + cosine schedule, metrics and checkpoints.

use crate::{
    anchors::{block_token_ids, AnchorSampler},
    config::RunConfig,
    distill,
    experiment::Experiment,
    hidden_cache::HiddenStateCache,
    tensorboard,
    loss::{default_gamma, dflash_loss, tau_hat, LossInput},
    plugins::{PluginRecord, Registry},
    schedule::lr_scale,
};
use anyhow::{anyhow, bail, Result};
use indicatif::{ProgressBar, ProgressStyle};
use plugin_api::{
    abi_stable::std_types::{RNone, RSome},
    tch::{self, Kind, Tensor},
    Batch, DataLoaderBox, DraftInput, DrafterBox, HostContext, OptimizerBox, PluginInstance, PluginKind, TargetBox,
    TensorHandle,
};
use serde::Serialize;
use std::{
    path::Path,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc,
    },
    time::Instant,
};

/// The four components of a run, created from the config's sections.
pub struct Components {
    pub target: TargetBox,
    pub drafter: DrafterBox,
    pub optimizer: OptimizerBox,
    pub data: DataLoaderBox,
    pub records: Vec<PluginRecord>,
}

pub fn build_components(cfg: &RunConfig, registry: &Registry, config_dir: &Path, cache_dir: &Path) -> Result<Components> {
    let mut ctx = HostContext {
        device: cfg.device.clone().into(),
        dtype: cfg.dtype().into(),
        seed: cfg.seed,
        config_dir: config_dir.display().to_string().into(),
        cache_dir: cache_dir.display().to_string().into(),
        target: RNone,
    };
    let mut records = Vec::new();
    let mut create = |kind: PluginKind, ctx: &HostContext| -> Result<PluginInstance> {
        let section = cfg.section(kind.as_str());
        tracing::info!("creating {kind} plugin `{}`", section.plugin);
        let (instance, record) = registry.create(kind, &section, ctx)?;
        records.push(record);
        Ok(instance)
    };
    let wrong = |kind: PluginKind| anyhow!("plugin for [{kind}] did not create a {kind}");
    let PluginInstance::Target(target) = create(PluginKind::Target, &ctx)? else { return Err(wrong(PluginKind::Target)) };
    ctx.target = RSome(target.spec());
    let PluginInstance::Drafter(drafter) = create(PluginKind::Drafter, &ctx)? else { return Err(wrong(PluginKind::Drafter)) };
    let PluginInstance::Optimizer(optimizer) = create(PluginKind::Optimizer, &ctx)? else {
        return Err(wrong(PluginKind::Optimizer));
    };
    let PluginInstance::DataLoader(data) = create(PluginKind::DataLoader, &ctx)? else {
        return Err(wrong(PluginKind::DataLoader));
    };
    Ok(Components { target, drafter, optimizer, data, records })
}

impl Components {
    fn name(&self, kind: PluginKind) -> &str {
        self.records.iter().find(|r| r.kind == kind.as_str()).map_or("?", |r| r.name.as_str())
    }

    /// An error from a plugin call, naming the plugin and the call.
    pub fn err(&self, kind: PluginKind, call: &str) -> impl Fn(plugin_api::PluginError) -> anyhow::Error + '_ {
        let call = call.to_string();
        move |e| anyhow!("{kind} plugin `{}`: {call}: {e}", self.name(kind))
    }
}

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
    /// Target tokens per second over the logging window.
    pub tok_per_s: f64,
    /// Seconds per step in each stage over the window: target forward, drafter forward + loss +
    /// backward, optimizer (clip + step).
    pub target_s: f64,
    pub drafter_s: f64,
    pub optim_s: f64,
    pub elapsed_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct TrainerState {
    pub step: u64,
    pub tokens: u64,
    pub draft_tokens: u64,
    pub data_epoch: u64,
    pub data_index: u64,
    pub micro_batches: u64,
    pub skipped_steps: u64,
    pub seed: u64,
}

/// Skips steps whose loss or gradient is not finite, and stops the run after `max` in a row
/// (a diverged run does not recover by itself; its last good checkpoint is kept).
pub struct NonFiniteGuard {
    pub max: u64,
    pub consecutive: u64,
}

impl NonFiniteGuard {
    /// Ok(true): apply the step; Ok(false): skip it; Err: stop the run.
    pub fn check(&mut self, step: u64, loss: f64, grad_norm: f64) -> Result<bool> {
        if loss.is_finite() && grad_norm.is_finite() {
            self.consecutive = 0;
            return Ok(true);
        }
        self.consecutive += 1;
        tracing::warn!("step {step}: loss {loss}, gradient norm {grad_norm}: step skipped ({} in a row)", self.consecutive);
        if self.consecutive >= self.max {
            bail!("{} consecutive steps with a non-finite loss or gradient (up to step {step})", self.consecutive);
        }
        Ok(false)
    }
}

fn all_finite(params: &[Tensor]) -> bool {
    params.iter().all(|p| p.isfinite().all().int64_value(&[]) != 0)
}

#[derive(Debug, Clone, Serialize)]
pub struct TrainSummary {
    pub experiment: String,
    pub steps: u64,
    pub tokens: u64,
    pub wall_s: f64,
    pub first: Option<StepMetrics>,
    pub last: Option<StepMetrics>,
    pub last_checkpoint: Option<String>,
    /// Exit code when a signal stopped the run (130 SIGINT, 143 SIGTERM).
    pub interrupted: Option<u8>,
}

/// SIGINT / SIGTERM: the first lets the current step finish, then a checkpoint is written and the
/// run stops (exit 130 / 143); a second one exits at once (checkpoints are written whole or not
/// at all, so nothing on disk is left half-written).
pub struct StopSignal {
    code: Arc<AtomicUsize>,
}

impl StopSignal {
    pub fn install() -> Result<Self> {
        use signal_hook::{consts::*, flag};
        let code = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(AtomicBool::new(false));
        for (sig, exit) in [(SIGINT, 130), (SIGTERM, 143)] {
            flag::register_conditional_shutdown(sig, exit, Arc::clone(&seen))?;
            flag::register(sig, Arc::clone(&seen))?;
            flag::register_usize(sig, Arc::clone(&code), exit as usize)?;
        }
        Ok(Self { code })
    }

    /// The exit code if a signal asked to stop.
    pub fn requested(&self) -> Option<u8> {
        match self.code.load(Ordering::Relaxed) {
            0 => None,
            c => Some(c as u8),
        }
    }
}

/// Window accumulators between two log lines.
#[derive(Default)]
struct Window {
    loss_sum: f64,
    micro: u64,
    /// Micro-batches of skipped steps (not in `loss_sum`).
    skipped_micro: u64,
    correct: Vec<i64>,
    count: Vec<i64>,
    tokens: u64,
    steps: u64,
    target_s: f64,
    drafter_s: f64,
    optim_s: f64,
    started: Option<Instant>,
}

impl Window {
    fn new(block_size: i64) -> Self {
        let positions = block_size as usize - 1;
        Self { correct: vec![0; positions], count: vec![0; positions], ..Default::default() }
    }

    fn acc(&self) -> Vec<f64> {
        self.correct.iter().zip(&self.count).map(|(&c, &n)| if n > 0 { c as f64 / n as f64 } else { 0.0 }).collect()
    }
}

fn next_batch(c: &mut Components) -> Result<Batch> {
    for _ in 0..2 {
        let next = c.data.next_batch().into_result();
        match next.map_err(c.err(PluginKind::DataLoader, "next_batch"))?.into_option() {
            Some(b) => return Ok(b),
            None => continue, // end of epoch: the next call starts the next one
        }
    }
    bail!("the data loader yields no batches (is the dataset empty after filtering?)")
}

/// Global gradient norm, clipped to `max_norm` like torch.nn.utils.clip_grad_norm_.
fn clip_grad_norm(params: &[Tensor], max_norm: f64) -> f64 {
    let _guard = tch::no_grad_guard();
    let grads: Vec<Tensor> = params.iter().map(|p| p.grad()).filter(|g| g.defined()).collect();
    if grads.is_empty() {
        return 0.0;
    }
    let sq: Vec<Tensor> = grads.iter().map(|g| g.to_kind(Kind::Float).pow_tensor_scalar(2).sum(Kind::Float)).collect();
    let total = Tensor::stack(&sq, 0).sum(Kind::Float).sqrt().double_value(&[]);
    if max_norm > 0.0 {
        let coef = (max_norm / (total + 1e-6)).min(1.0);
        if coef < 1.0 {
            for mut g in grads {
                let _ = g.g_mul_scalar_(coef);
            }
        }
    }
    total
}

pub fn train(cfg: &RunConfig, mut c: Components, exp: &mut Experiment, cache_dir: &Path) -> Result<TrainSummary> {
    let t = &cfg.train;
    // 1. Data: tokenize with the target's tokenizer, then self-distil if the loader asks.
    let summary = c.data.open(c.target.tokenizer_json().as_rstr()).into_result().map_err(c.err(PluginKind::DataLoader, "open"))?;
    tracing::info!("data: {}", summary.description);
    if let Some(s) = distill::run(&mut c, cache_dir)? {
        tracing::info!("data after self-distillation: {}", s.description);
    }

    // 2. Shared frozen parts and the drafter's needs.
    let embedding = c.target.embedding().into_tensor();
    let lm_head = c.target.lm_head().into_tensor();
    let layer_ids: Vec<u32> = c.drafter.target_layer_ids().into_vec();
    let block_size = c.drafter.block_size() as i64;
    let mask_token_id = c.drafter.mask_token_id() as i64;
    let gamma = t.loss_gamma.unwrap_or_else(|| default_gamma(block_size as usize));
    let named = c.drafter.parameters();
    let params: Vec<Tensor> = named.iter().map(|nt| nt.tensor.tensor()).collect();
    let n_params: i64 = params.iter().map(|p| p.numel() as i64).sum();
    tracing::info!(
        "drafter: {:.1}M trainable parameters, block {block_size}, target layers {layer_ids:?}, mask token {mask_token_id}, gamma {gamma}",
        n_params as f64 / 1e6
    );
    c.optimizer.init(named).into_result().map_err(c.err(PluginKind::Optimizer, "init"))?;
    let sampler = AnchorSampler { per_seq: t.anchors_per_seq, seed: cfg.seed };
    let mut cache = HiddenStateCache::new(t.hidden_cache_mb << 20);

    // 3. The loop.
    let bar = ProgressBar::new(t.steps).with_style(
        ProgressStyle::with_template("train {bar:30} {pos}/{len} steps  {msg}  ETA {eta}").expect("template"),
    );
    let started = Instant::now();
    // TensorBoard event files beside metrics.jsonl (`tensorboard --logdir experiments/`).
    let mut tb = tensorboard::EventWriter::create(&exp.dir)?;
    let mut state = TrainerState {
        step: 0,
        tokens: 0,
        draft_tokens: 0,
        data_epoch: 0,
        data_index: 0,
        micro_batches: 0,
        skipped_steps: 0,
        seed: cfg.seed,
    };
    let mut guard = NonFiniteGuard { max: t.max_nonfinite_steps, consecutive: 0 };
    let mut window = Window::new(block_size);
    let (mut first, mut last, mut last_ckpt) = (None, None, None);
    let stop = StopSignal::install()?;
    let mut interrupted = None;
    for step in 1..=t.steps {
        window.started.get_or_insert_with(Instant::now);
        let mut step_loss = 0.0;
        for _ in 0..t.grad_accum {
            let batch = next_batch(&mut c)?;
            let input_ids = batch.input_ids.tensor();
            let loss_mask = batch.loss_mask.tensor();
            let tokens: u64 = batch.lengths.iter().map(|&l| l as u64).sum();
            // Target features (no grad inside the plugin).
            let t0 = Instant::now();
            let seq_len = input_ids.size()[1];
            let target_hidden = match cache.get(&batch.sequence_ids, seq_len, embedding.device(), embedding.kind()) {
                Some(h) => h,
                None => {
                    let out = c
                        .target
                        .forward(&batch.input_ids, layer_ids.as_slice().into(), false)
                        .into_result()
                        .map_err(c.err(PluginKind::Target, "forward"))?;
                    let h = out.hidden.into_tensor();
                    cache.put(&batch.sequence_ids, &batch.lengths, &h);
                    h
                }
            };
            let t1 = Instant::now();
            window.target_s += (t1 - t0).as_secs_f64();
            let anchors = sampler.sample(&loss_mask, state.micro_batches);
            state.micro_batches += 1;
            let device = embedding.device();
            let anchor_pos = anchors.positions.to_device(device);
            let block_ids = block_token_ids(&input_ids.to_device(device), &anchor_pos, block_size, mask_token_id);
            let block_embeds = tch::no_grad(|| Tensor::embedding(&embedding, &block_ids, -1, false, false));
            let input = DraftInput {
                target_hidden: TensorHandle::new(target_hidden),
                block_embeds: TensorHandle::new(block_embeds),
                anchors: TensorHandle::new(anchor_pos.shallow_clone()),
                anchor_valid: TensorHandle::new(anchors.valid.to_device(device)),
            };
            let block_hidden = c.drafter.forward(&input).into_result().map_err(c.err(PluginKind::Drafter, "forward"))?.into_tensor();
            let l = dflash_loss(&LossInput {
                block_hidden: &block_hidden,
                lm_head: &lm_head,
                input_ids: &input_ids,
                loss_mask: &loss_mask,
                anchors: &anchor_pos,
                anchor_valid: &input.anchor_valid.tensor(),
                block_size,
                gamma,
            });
            (&l.loss / t.grad_accum as f64).backward();
            step_loss += l.loss.double_value(&[]);
            window.drafter_s += t1.elapsed().as_secs_f64();
            window.micro += 1;
            window.tokens += tokens;
            state.tokens += tokens;
            for k in 0..l.count.len() {
                window.correct[k] += l.correct[k];
                window.count[k] += l.count[k];
                state.draft_tokens += l.count[k] as u64;
            }
        }
        let t2 = Instant::now();
        let grad_norm = clip_grad_norm(&params, t.grad_clip);
        let scale = lr_scale(step, t.steps, t.warmup_frac, t.min_lr_frac);
        let apply = guard.check(step, step_loss, grad_norm).map_err(|e| {
            anyhow!("{e:#}; stopped, the last good checkpoint is {}", last_ckpt.as_deref().unwrap_or("(none yet)"))
        })?;
        if apply {
            window.loss_sum += step_loss;
            c.optimizer.step(scale).into_result().map_err(c.err(PluginKind::Optimizer, "step"))?;
        } else {
            state.skipped_steps += 1;
            window.skipped_micro += t.grad_accum;
        }
        for p in &params {
            let mut p = p.shallow_clone();
            p.zero_grad();
        }
        window.optim_s += t2.elapsed().as_secs_f64();
        window.steps += 1;
        state.step = step;
        let pos = c.data.position();
        (state.data_epoch, state.data_index) = (pos.epoch, pos.index);

        if step % t.log_every == 0 || step == t.steps || step == 1 {
            let acc = window.acc();
            let secs = window.started.map_or(0.0, |s| s.elapsed().as_secs_f64());
            let m = StepMetrics {
                step,
                epoch: pos.epoch,
                tokens: state.tokens,
                draft_tokens: state.draft_tokens,
                loss: window.loss_sum / (window.micro - window.skipped_micro).max(1) as f64,
                tau_hat: tau_hat(&acc),
                acc,
                lr: scale * c.optimizer.base_lr(),
                grad_norm,
                skipped_steps: state.skipped_steps,
                tok_per_s: window.tokens as f64 / secs.max(1e-9),
                target_s: window.target_s / window.steps as f64,
                drafter_s: window.drafter_s / window.steps as f64,
                optim_s: window.optim_s / window.steps as f64,
                elapsed_s: started.elapsed().as_secs_f64(),
            };
            exp.log(&m)?;
            tensorboard::log_metrics(&mut tb, &serde_json::to_value(&m)?)?;
            bar.set_message(format!("loss {:.3}  τ̂ {:.3}  {:.0} tok/s", m.loss, m.tau_hat, m.tok_per_s));
            bar.suspend(|| {
                tracing::info!(
                    "step {step}/{}  loss {:.4}  τ̂ {:.3}  acc@1 {:.3}  lr {:.2e}  |g| {:.3}  {:.0} tok/s",
                    t.steps,
                    m.loss,
                    m.tau_hat,
                    m.acc.first().copied().unwrap_or(0.0),
                    m.lr,
                    m.grad_norm,
                    m.tok_per_s
                )
            });
            first.get_or_insert_with(|| m.clone());
            last = Some(m);
            window = Window::new(block_size);
        }
        interrupted = stop.requested();
        let due = (t.checkpoint_every > 0 && step % t.checkpoint_every == 0) || step == t.steps || interrupted.is_some();
        if due && !all_finite(&params) {
            // Never let a diverged state replace a good checkpoint.
            bar.suspend(|| tracing::warn!("step {step}: drafter weights are not finite; checkpoint not written"));
        } else if due {
            let dir = exp.save_checkpoint(
                step,
                &c.drafter.parameters(),
                c.drafter.config_json().as_str(),
                &c.optimizer.state(),
                &state,
                t.keep_checkpoints,
            )?;
            last_ckpt = Some(dir.display().to_string());
        }
        bar.inc(1);
        if let Some(code) = interrupted {
            bar.suspend(|| {
                let sig = if code == 130 { "SIGINT" } else { "SIGTERM" };
                tracing::warn!("{sig}: stopped after step {step}; checkpoint {}", last_ckpt.as_deref().unwrap_or("-"));
            });
            break;
        }
    }
    bar.finish_and_clear();
    let summary = TrainSummary {
        experiment: exp.dir.display().to_string(),
        steps: state.step,
        tokens: state.tokens,
        wall_s: started.elapsed().as_secs_f64(),
        first,
        last,
        last_checkpoint: last_ckpt,
        interrupted,
    };
    exp.write_summary(&summary)?;
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guard_skips_then_stops_after_max_in_a_row() {
        let mut g = NonFiniteGuard { max: 3, consecutive: 0 };
        assert!(g.check(1, 2.0, 1.0).unwrap());
        assert!(!g.check(2, f64::NAN, 1.0).unwrap());
        assert!(!g.check(3, 2.0, f64::INFINITY).unwrap());
        assert!(g.check(4, 2.0, 1.0).unwrap(), "a good step resets the count");
        assert!(!g.check(5, f64::NAN, 1.0).unwrap());
        assert!(!g.check(6, f64::NAN, 1.0).unwrap());
        let err = g.check(7, f64::NAN, f64::NAN).unwrap_err().to_string();
        assert!(err.contains("3 consecutive steps") && err.contains("step 7"), "{err}");
    }
}
