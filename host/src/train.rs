//! The trainer: data -> target workers (frozen, on their own threads) -> hidden-state buffer ->
//! anchors -> drafter -> DFlash loss -> optimizer, with gradient accumulation, clipping, warm-up +
//! cosine schedule, metrics, checkpoints and exact resume.

use crate::{
    anchors::{block_token_ids, AnchorSampler, Anchors},
    capture::CaptureReader,
    config::RunConfig,
    distill,
    experiment::Experiment,
    hidden_cache::{CacheTicket, HiddenStateCache},
    loss::{default_gamma, dflash_loss, tau_hat, LossInput, LossOut},
    dist::Communicator,
    pipeline::{self, Feed, Job, PipelineOptions, Worker},
    plugins::{PluginRecord, Registry},
    schedule::lr_scale,
    sysinfo::{peak_rss_mb, GpuMonitor},
    tensorboard,
};
use anyhow::{anyhow, bail, Result};
use indicatif::{ProgressBar, ProgressStyle};
use plugin_api::{
    abi_stable::std_types::{RNone, RSome},
    tch::{self, Device, Kind, Tensor},
    DataLoaderBox, DataPosition, DraftInput, DrafterBox, HostContext, NamedTensor, OptimizerBox, PluginInstance,
    PluginKind, TargetBox, TensorHandle,
};
use serde::{Deserialize, Serialize};
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
    /// More target workers (`pipeline.targets` beyond the first), each on its own device.
    pub extra_targets: Vec<TargetBox>,
    pub drafter: DrafterBox,
    pub optimizer: OptimizerBox,
    pub data: DataLoaderBox,
    pub records: Vec<PluginRecord>,
    /// Plugin names for error messages (from `records`).
    pub names: PluginNames,
}

pub fn build_components(cfg: &RunConfig, registry: &Registry, config_dir: &Path, cache_dir: &Path) -> Result<Components> {
    let ctx_on = |device: &str| HostContext {
        device: device.into(),
        dtype: cfg.dtype().into(),
        seed: cfg.seed,
        config_dir: config_dir.display().to_string().into(),
        cache_dir: cache_dir.display().to_string().into(),
        target: RNone,
    };
    let mut records = Vec::new();
    let mut create = |kind: PluginKind, ctx: &HostContext| -> Result<PluginInstance> {
        let section = cfg.section(kind.as_str());
        tracing::info!("creating {kind} plugin `{}` on {}", section.plugin, ctx.device);
        let (instance, record) = registry.create(kind, &section, ctx)?;
        if !records.iter().any(|r: &PluginRecord| r.kind == record.kind) {
            records.push(record);
        }
        Ok(instance)
    };
    let wrong = |kind: PluginKind| anyhow!("plugin for [{kind}] did not create a {kind}");
    let devices = cfg.target_devices();
    let mut targets = Vec::new();
    for d in &devices {
        let PluginInstance::Target(t) = create(PluginKind::Target, &ctx_on(d))? else { return Err(wrong(PluginKind::Target)) };
        targets.push(t);
    }
    let target = targets.remove(0);
    let mut ctx = ctx_on(cfg.drafter_device());
    ctx.target = RSome(target.spec());
    let PluginInstance::Drafter(drafter) = create(PluginKind::Drafter, &ctx)? else { return Err(wrong(PluginKind::Drafter)) };
    let PluginInstance::Optimizer(optimizer) = create(PluginKind::Optimizer, &ctx)? else {
        return Err(wrong(PluginKind::Optimizer));
    };
    let PluginInstance::DataLoader(data) = create(PluginKind::DataLoader, &ctx)? else {
        return Err(wrong(PluginKind::DataLoader));
    };
    let names = PluginNames::new(&records);
    Ok(Components { target, extra_targets: targets, drafter, optimizer, data, records, names })
}

/// Plugin names for error messages, usable while the components are borrowed by the stages.
#[derive(Clone)]
pub struct PluginNames(Vec<(String, String)>);

impl PluginNames {
    pub fn new(records: &[PluginRecord]) -> Self {
        Self(records.iter().map(|r| (r.kind.clone(), r.name.clone())).collect())
    }

    /// An error from a plugin call, naming the plugin and the call.
    pub fn err(&self, kind: PluginKind, call: &str) -> impl Fn(plugin_api::PluginError) -> anyhow::Error + '_ {
        let call = call.to_string();
        move |e| {
            let name = self.0.iter().find(|(k, _)| k == kind.as_str()).map_or("?", |(_, n)| n.as_str());
            anyhow!("{kind} plugin `{name}`: {call}: {e}")
        }
    }
}

impl Components {
    /// An error from a plugin call, naming the plugin and the call.
    pub fn err(&self, kind: PluginKind, call: &str) -> impl Fn(plugin_api::PluginError) -> anyhow::Error + '_ {
        self.names.err(kind, call)
    }

    /// Tokenize the data with the target's tokenizer, then self-distil if the loader asks.
    pub fn prepare_data(&mut self, cache_dir: &Path) -> Result<()> {
        let summary = self.data.open(self.target.tokenizer_json().as_rstr()).into_result().map_err(self.err(PluginKind::DataLoader, "open"))?;
        tracing::info!("data: {}", summary.description);
        if let Some(s) = distill::run(self, cache_dir)? {
            tracing::info!("data after self-distillation: {}", s.description);
        }
        Ok(())
    }
}

/// A micro-batch with its target features, as the drafter receives it.
pub struct Micro {
    pub input_ids: Tensor,
    pub loss_mask: Tensor,
    pub lengths: Vec<u32>,
    pub sequence_ids: Vec<u64>,
    /// [B, S, n*H] features of the drafter's target layers.
    pub hidden: Tensor,
    /// The data loader's position after this batch: where a resume continues.
    pub position: DataPosition,
    /// The micro-batch's number in data order, across all ranks (numbers its anchor draw).
    pub index: u64,
}

/// A batch from the data loader, before the target has seen it.
pub struct HostBatch {
    pub input_ids: Tensor,
    pub loss_mask: Tensor,
    pub lengths: Vec<u32>,
    pub sequence_ids: Vec<u64>,
    pub position: DataPosition,
    /// The micro-batch's number in data order (set by the producer).
    pub index: u64,
    /// Its plan with the hidden-state cache (set by the producer).
    pub cache_ticket: Option<CacheTicket>,
}

impl HostBatch {
    /// The batch with its target features, for the drafter.
    pub fn with_features(self, hidden: Tensor) -> Micro {
        let Self { input_ids, loss_mask, lengths, sequence_ids, position, index, .. } = self;
        Micro { input_ids, loss_mask, lengths, sequence_ids, hidden, position, index }
    }
}

/// The next batch, across an epoch boundary if need be.
pub fn next_batch(data: &mut DataLoaderBox, names: &PluginNames) -> Result<HostBatch> {
    for _ in 0..2 {
        let next = data.next_batch().into_result().map_err(names.err(PluginKind::DataLoader, "next_batch"))?;
        if let Some(b) = next.into_option() {
            return Ok(HostBatch {
                input_ids: b.input_ids.into_tensor(),
                loss_mask: b.loss_mask.into_tensor(),
                lengths: b.lengths.into_vec(),
                sequence_ids: b.sequence_ids.into_vec(),
                position: data.position(),
                index: 0,
                cache_ticket: None,
            });
        }
        // End of epoch: the next call starts the next one.
    }
    bail!("the data loader yields no batches (is the dataset empty after filtering?)")
}

/// Features into the buffer: kept where they are when the drafter shares the device, else copied
/// to CPU memory (pinned when they come from a GPU, so the copy to the drafter's GPU is async).
fn to_buffer(hidden: Tensor, drafter: Device) -> Tensor {
    let from = hidden.device();
    if from == drafter || from == Device::Cpu {
        return hidden;
    }
    let empty = Tensor::empty(hidden.size(), (hidden.kind(), Device::Cpu));
    let mut host = kernels::autograd::pinned(&empty).unwrap_or(empty);
    host.copy_(&hidden);
    host
}

/// One worker per target device: the first target and the extra ones, in `devices` order.
pub fn target_workers<'a>(
    target: &'a mut TargetBox,
    extra: &'a mut [TargetBox],
    devices: &[String],
    layer_ids: &[u32],
    cache: &Arc<HiddenStateCache>,
    drafter_device: Device,
    names: &PluginNames,
) -> Vec<Worker<'a, HostBatch, Micro>> {
    std::iter::once(target)
        .chain(extra.iter_mut())
        .zip(devices)
        .enumerate()
        .map(|(i, (t, d))| target_worker(i, d.clone(), t, layer_ids.to_vec(), Arc::clone(cache), drafter_device, names.clone()))
        .collect()
}

/// Bytes of target features per token: `layers` features of `hidden_size` in the run's dtype.
pub fn feature_bytes_per_token(cfg: &RunConfig, layers: usize, hidden_size: u32) -> usize {
    let elt = if cfg.dtype() == "bf16" { 2 } else { 4 };
    layers * hidden_size as usize * elt
}

/// A target worker: runs its target (or takes cached features) for each batch.
fn target_worker<'a>(
    index: usize,
    device: String,
    target: &'a mut TargetBox,
    layer_ids: Vec<u32>,
    cache: Arc<HiddenStateCache>,
    drafter_device: Device,
    names: PluginNames,
) -> Worker<'a, HostBatch, Micro> {
    Worker {
        name: format!("{device}"),
        work: Box::new(move |mut b: HostBatch| {
            let seq_len = b.input_ids.size()[1];
            // Dropped at the end of this job, done or failed: releases what it did not store.
            let ticket = b.cache_ticket.take();
            let cached = ticket.as_ref().and_then(|t| cache.fetch(t, &b.sequence_ids, seq_len, Device::Cpu));
            let hidden = match cached {
                Some(h) => h,
                None => {
                    let ids = TensorHandle::new(b.input_ids.shallow_clone());
                    let out = target.forward(&ids, layer_ids.as_slice().into(), false).into_result();
                    let h = out.map_err(names.err(PluginKind::Target, &format!("forward (worker {index})")))?.hidden.into_tensor();
                    if let Some(t) = &ticket {
                        cache.store(t, &b.sequence_ids, &b.lengths, &h);
                    }
                    h
                }
            };
            Ok(b.with_features(to_buffer(hidden, drafter_device)))
        }),
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
    pub elapsed_s: f64,
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
    /// The step `--stop-at` stopped at (the run is resumable from there).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped_at: Option<u64>,
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

/// Sums over the logging window that the loss and accuracy lines come from (checkpointed).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct WindowSums {
    loss_sum: f64,
    micro: u64,
    /// Micro-batches of skipped steps (not in `loss_sum`).
    skipped_micro: u64,
    correct: Vec<i64>,
    count: Vec<i64>,
    tokens: u64,
    draft_tokens: u64,
    steps: u64,
}

/// The window's timings (not checkpointed: a resumed run measures its own).
#[derive(Default)]
struct WindowTimes {
    drafter_s: f64,
    optim_s: f64,
    wait_s: f64,
    depth_sum: f64,
    started: Option<Instant>,
}

impl WindowSums {
    fn new(block_size: i64) -> Self {
        let positions = block_size as usize - 1;
        Self { correct: vec![0; positions], count: vec![0; positions], ..Default::default() }
    }

    fn acc(&self) -> Vec<f64> {
        self.correct.iter().zip(&self.count).map(|(&c, &n)| if n > 0 { c as f64 / n as f64 } else { 0.0 }).collect()
    }
}

/// The drafter's side of one micro-batch (shared by training and `bench train`): anchors drawn,
/// blocks `[anchor, MASK x (Bk-1)]` embedded with the target's embedding, the drafter forward and
/// the DFlash loss through the target's LM head. The caller runs [`Drafted::backward`].
pub struct DraftLoss {
    /// The target's frozen embedding and LM head, on the drafter's device.
    pub embedding: Tensor,
    pub lm_head: Tensor,
    pub sampler: AnchorSampler,
    pub block_size: i64,
    pub mask_token_id: i64,
    pub gamma: f64,
}

impl DraftLoss {
    /// `hidden` [B, S, n*H] target features of `input_ids`; `draw` numbers the anchor draw.
    pub fn compute(
        &self,
        drafter: &mut DrafterBox,
        input_ids: &Tensor,
        loss_mask: &Tensor,
        hidden: &Tensor,
        draw: u64,
    ) -> Result<Drafted, plugin_api::PluginError> {
        let device = self.embedding.device();
        let anchors = self.sampler.sample(loss_mask, draw);
        let input_ids = to_device_async(input_ids, device);
        let loss_mask = &to_device_async(loss_mask, device);
        let anchor_pos = to_device_async(&anchors.positions, device);
        let block_ids = block_token_ids(&input_ids, &anchor_pos, self.block_size, self.mask_token_id);
        let block_embeds = tch::no_grad(|| Tensor::embedding(&self.embedding, &block_ids, -1, false, false));
        let input = DraftInput {
            target_hidden: TensorHandle::new(to_device_async(hidden, device).to_kind(self.embedding.kind())),
            block_embeds: TensorHandle::new(block_embeds),
            anchors: TensorHandle::new(anchor_pos.shallow_clone()),
            anchor_valid: TensorHandle::new(to_device_async(&anchors.valid, device)),
        };
        drafter.anchors_on_host(&TensorHandle::new(anchors.positions.shallow_clone())).into_result()?;
        let block_hidden = drafter.forward(&input).into_result()?.into_tensor();
        let loss = dflash_loss(&LossInput {
            block_hidden: &block_hidden,
            lm_head: &self.lm_head,
            input_ids: &input_ids,
            loss_mask,
            anchors: &anchor_pos,
            anchor_valid: &input.anchor_valid.tensor(),
            block_size: self.block_size,
            gamma: self.gamma,
        });
        Ok(Drafted { loss, anchors, output: block_hidden })
    }
}

/// One micro-batch drafted: its loss and anchors, and the drafter output backward starts from.
pub struct Drafted {
    pub loss: LossOut,
    pub anchors: Anchors,
    output: Tensor,
}

impl Drafted {
    /// Gradients of `scale * loss` into the drafter's parameters: through the output's graph, or,
    /// when the drafter returned a leaf, by handing it the output's gradient (`Drafter::backward`).
    pub fn backward(&self, drafter: &mut DrafterBox, scale: f64) -> Result<(), plugin_api::PluginError> {
        (&self.loss.loss * scale).backward();
        if self.output.is_leaf() && self.output.requires_grad() {
            drafter.backward(&TensorHandle::new(self.output.grad())).into_result()?;
        }
        Ok(())
    }
}

/// `t` on `device` without the host waiting: a CPU tensor goes through pinned memory with a
/// non-blocking copy (a copy from pageable memory first waits for all the GPU work queued).
fn to_device_async(t: &Tensor, device: tch::Device) -> Tensor {
    match (t.device(), device.is_cuda()) {
        (tch::Device::Cpu, true) => match kernels::autograd::pinned(t) {
            Ok(p) => p.to_device_(device, t.kind(), true, false),
            Err(_) => t.to_device(device),
        },
        _ => t.to_device(device),
    }
}

/// Global gradient norm (a scalar on the gradients' device), clipped to `max_norm` as
/// torch.nn.utils.clip_grad_norm_ does it: the norm of the per-tensor norms, each gradient read
/// once with fp32 accumulation, then every gradient times min(1, max_norm / (norm + 1e-6)).
/// Nothing waits for the GPU.
fn clip_grad_norm(params: &[Tensor], max_norm: f64) -> Tensor {
    let _guard = tch::no_grad_guard();
    let grads: Vec<Tensor> = params.iter().map(|p| p.grad()).filter(|g| g.defined()).collect();
    if grads.is_empty() {
        return Tensor::zeros([], (Kind::Float, tch::Device::Cpu));
    }
    let norms: Vec<Tensor> = grads.iter().map(|g| g.norm_scalaropt_dtype(2.0, Kind::Float)).collect();
    let total = Tensor::stack(&norms, 0).norm();
    if max_norm > 0.0 {
        let coef = (max_norm / (&total + 1e-6)).clamp_max(1.0);
        for mut g in grads {
            let _ = g.g_mul_(&coef.to_kind(g.kind()));
        }
    }
    total
}

/// Where a resumed run starts: a checkpoint's trainer state, weights and optimizer state.
pub struct ResumeFrom {
    pub state: TrainerState,
    pub weights: Vec<NamedTensor>,
    pub optimizer_state: Vec<NamedTensor>,
    pub checkpoint: String,
}

#[derive(Default)]
pub struct TrainOptions {
    pub resume: Option<ResumeFrom>,
    /// Stop (with a checkpoint) after this step, as if interrupted: a long schedule in slices.
    pub stop_at: Option<u64>,
    /// Data-parallel replicas (None: this process alone). Rank 0 writes the experiment.
    pub comm: Option<Box<dyn Communicator>>,
}

/// What one step adds up, summed across ranks before it is logged or acted on.
struct StepSums {
    loss: f64,
    tokens: u64,
    correct: Vec<i64>,
    count: Vec<i64>,
    /// Any rank asked to stop (a signal): all stop after this step, together.
    stop: bool,
}

impl StepSums {
    fn all_reduce(&mut self, comm: &mut dyn Communicator) -> Result<()> {
        let mut v: Vec<f64> = [self.loss, self.tokens as f64, self.stop as u8 as f64].into_iter().collect();
        v.extend(self.correct.iter().chain(&self.count).map(|&c| c as f64));
        comm.all_reduce_sum(&mut v)?;
        let n = self.correct.len();
        self.loss = v[0];
        self.tokens = v[1] as u64;
        self.stop = v[2] > 0.0;
        self.correct = v[3..3 + n].iter().map(|&c| c as i64).collect();
        self.count = v[3 + n..].iter().map(|&c| c as i64).collect();
        Ok(())
    }
}

pub fn train(cfg: &RunConfig, mut c: Components, exp: &mut Experiment, cache_dir: &Path, opts: TrainOptions) -> Result<TrainSummary> {
    let t = &cfg.train;
    let mut comm = opts.comm;
    let (rank, world) = comm.as_ref().map_or((0, 1), |c| (c.rank() as u64, c.world() as u64));
    let lead = rank == 0; // writes metrics and checkpoints
    let names = c.names.clone();
    // 1. Data, unless features come from a capture.
    let capture = match &cfg.pipeline.capture {
        Some(dir) => Some(CaptureReader::open(Path::new(dir), &c.target.spec())?),
        None => {
            c.prepare_data(cache_dir)?;
            None
        }
    };

    // 2. Shared frozen parts and the drafter's needs.
    let drafter_device = crate::config::parse_device(cfg.drafter_device())?;
    let layer_ids: Vec<u32> = c.drafter.target_layer_ids().into_vec();
    if let Some(cap) = &capture {
        cap.check_layers(&layer_ids)?;
    }
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
    c.optimizer.init(named).into_result().map_err(names.err(PluginKind::Optimizer, "init"))?;
    let draft = DraftLoss {
        lm_head: c.target.lm_head().into_tensor().to_device(drafter_device),
        embedding: c.target.embedding().into_tensor().to_device(drafter_device),
        sampler: AnchorSampler { per_seq: t.anchors_per_seq, seed: cfg.seed },
        block_size,
        mask_token_id,
        gamma,
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
    };
    let mut last_ckpt = None;
    if let Some(r) = opts.resume {
        c.drafter.load_weights(r.weights.into()).into_result().map_err(names.err(PluginKind::Drafter, "load_weights"))?;
        c.optimizer.load_state(r.optimizer_state.into()).into_result().map_err(names.err(PluginKind::Optimizer, "load_state"))?;
        if capture.is_none() {
            let pos = DataPosition { epoch: r.state.data_epoch, index: r.state.data_index };
            c.data.seek(pos).into_result().map_err(names.err(PluginKind::DataLoader, "seek"))?;
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
    let spec = c.target.spec();
    let feature_bytes_per_token = feature_bytes_per_token(cfg, layer_ids.len(), spec.hidden_size);
    let cache = HiddenStateCache::new(t.hidden_cache_mb << 20, feature_bytes_per_token);
    let cache_p = Arc::clone(&cache);
    let pipe = PipelineOptions { buffer_bytes: cfg.pipeline.buffer_bytes(), deterministic: cfg.pipeline.deterministic() };
    let devices = cfg.target_devices();
    let n_workers = if capture.is_some() { 1 } else { devices.len() };
    let (data, target, extra) = (&mut c.data, &mut c.target, &mut c.extra_targets);
    let (drafter, optimizer) = (&mut c.drafter, &mut c.optimizer);
    let first_draw = state.micro_batches;
    let mut produced = 0u64;
    let names_p = names.clone();
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
                    let b = next_batch(data, &names_p)?;
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
        None => target_workers(target, extra, &devices, &layer_ids, &cache, drafter_device, &names),
    };
    tracing::info!(
        "pipeline: {n_workers} target worker(s) on {:?}, drafter on {}, buffer {} MiB, {}",
        if capture.is_some() { vec!["capture".to_string()] } else { devices.clone() },
        cfg.drafter_device(),
        pipe.buffer_bytes >> 20,
        if pipe.deterministic { "deterministic order" } else { "arrival order" }
    );

    let bar = ProgressBar::new(t.steps).with_style(
        ProgressStyle::with_template("train {bar:30} {pos}/{len} steps  {msg}  ETA {eta}").expect("template"),
    );
    bar.set_position(state.step);
    let started = Instant::now();
    let elapsed_before = state.elapsed_s;
    // TensorBoard event files beside metrics.jsonl (`tensorboard --logdir experiments/`).
    let mut tb = if lead { Some(tensorboard::EventWriter::create(&exp.dir)?) } else { None };
    if !lead {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let mut guard = NonFiniteGuard { max: t.max_nonfinite_steps, consecutive: state.nonfinite_in_a_row };
    let gpus = GpuMonitor::new(devices.iter().map(String::as_str).chain([cfg.drafter_device()]));
    let (mut first, mut last) = (None, None);
    let stop = StopSignal::install()?;
    let mut interrupted = None;
    let mut stopped_at = None;

    let consume = |feed: &mut Feed<Micro>| -> Result<()> {
        let mut times = WindowTimes::default();
        let mut busy_before = feed.worker_busy_s();
        let mut hs_total_bytes = 0u64;
        let mut wait_before = feed.wait_s;
        for step in state.step + 1..=t.steps {
            times.started.get_or_insert_with(Instant::now);
            let mut sums = StepSums { loss: 0.0, tokens: 0, correct: vec![0; block_size as usize - 1], count: vec![0; block_size as usize - 1], stop: false };
            // Summed on the drafter's device, fetched once with the gradient norm.
            let mut loss_sum = Tensor::zeros([], (Kind::Float, drafter_device));
            let mut counts = Tensor::zeros([2, block_size - 1], (Kind::Int64, drafter_device));
            let mut last_position = None;
            for _ in 0..t.grad_accum {
                let ready = feed.next()?.ok_or_else(|| anyhow!("pipeline ended before step {step}"))?;
                times.depth_sum += feed.depth() as f64;
                // Held until the micro-step ends: its room in the buffer is freed with it.
                let m = &ready.item;
                let t1 = Instant::now();
                let tokens: u64 = m.lengths.iter().map(|&l| l as u64).sum();
                hs_total_bytes += (m.input_ids.numel() * feature_bytes_per_token) as u64;
                let d = draft
                    .compute(drafter, &m.input_ids, &m.loss_mask, &m.hidden, m.index)
                    .map_err(names.err(PluginKind::Drafter, "forward"))?;
                d.backward(drafter, 1.0 / t.grad_accum as f64).map_err(names.err(PluginKind::Drafter, "backward"))?;
                loss_sum += d.loss.loss.detach();
                counts += &d.loss.counts;
                sums.tokens += tokens;
                times.drafter_s += t1.elapsed().as_secs_f64();
                last_position = Some(m.position);
            }
            let t2 = Instant::now();
            // Replicas: average the gradients, sum what the step counted, agree on stopping.
            sums.stop = stop.requested().is_some();
            if let Some(comm) = comm.as_deref_mut() {
                crate::dist::average_gradients(comm, &params)?;
            }
            let grad_norm = clip_grad_norm(&params, t.grad_clip);
            // The step's one synchronisation: loss, gradient norm and accuracy counts in one copy.
            let host = Vec::<f64>::try_from(
                Tensor::cat(&[loss_sum.view([1]).to_kind(Kind::Double), grad_norm.to_device(drafter_device).view([1]).to_kind(Kind::Double), counts.flatten(0, -1).to_kind(Kind::Double)], 0)
                    .to_device(Device::Cpu),
            )?;
            let (grad_norm, n) = (host[1], block_size as usize - 1);
            sums.loss = host[0];
            sums.correct = host[2..2 + n].iter().map(|&c| c as i64).collect();
            sums.count = host[2 + n..].iter().map(|&c| c as i64).collect();
            if let Some(comm) = comm.as_deref_mut() {
                sums.all_reduce(comm)?;
            }
            let step_loss = sums.loss;
            state.micro_batches += t.grad_accum * world;
            let w = &mut state.window;
            w.micro += t.grad_accum * world;
            w.tokens += sums.tokens;
            state.tokens += sums.tokens;
            for k in 0..sums.count.len() {
                w.correct[k] += sums.correct[k];
                w.count[k] += sums.count[k];
                w.draft_tokens += sums.count[k] as u64;
                state.draft_tokens += sums.count[k] as u64;
            }
            let scale = lr_scale(step, t.steps, t.warmup_frac, t.min_lr_frac);
            let apply = guard.check(step, step_loss, grad_norm).map_err(|e| {
                anyhow!("{e:#}; stopped, the last good checkpoint is {}", last_ckpt.as_deref().unwrap_or("(none yet)"))
            })?;
            if apply {
                state.window.loss_sum += step_loss;
                optimizer.step(scale).into_result().map_err(names.err(PluginKind::Optimizer, "step"))?;
            } else {
                state.skipped_steps += 1;
                state.window.skipped_micro += t.grad_accum * world;
            }
            state.nonfinite_in_a_row = guard.consecutive;
            // Gradients dropped, not zeroed (PyTorch's default): until the next backward they take
            // no memory, so the forward's activations never sit beside last step's gradients.
            for p in &params {
                kernels::autograd::clear_grad(p);
            }
            times.optim_s += t2.elapsed().as_secs_f64();
            state.window.steps += 1;
            state.step = step;
            if let (Some(pos), None) = (last_position, capture_ref) {
                (state.data_epoch, state.data_index) = (pos.epoch, pos.index);
            }

            if step % t.log_every == 0 || step == t.steps || step == 1 {
                let w = &state.window;
                let acc = w.acc();
                let secs = times.started.map_or(0.0, |s| s.elapsed().as_secs_f64()).max(1e-9);
                let busy_now = feed.worker_busy_s();
                let target_busy: Vec<f64> = busy_now.iter().zip(&busy_before).map(|(a, b)| (a - b) / secs).collect();
                let target_s: f64 = busy_now.iter().zip(&busy_before).map(|(a, b)| a - b).sum();
                times.wait_s = feed.wait_s - wait_before;
                let steps_w = w.steps.max(1) as f64;
                let (hs_bytes, hs_peak_bytes) = feed.bytes();
                let gpu = gpus.sample();
                let m = StepMetrics {
                    step,
                    epoch: state.data_epoch,
                    tokens: state.tokens,
                    draft_tokens: state.draft_tokens,
                    loss: w.loss_sum / (w.micro - w.skipped_micro).max(1) as f64,
                    tau_hat: tau_hat(&acc),
                    acc,
                    lr: scale * optimizer.base_lr(),
                    grad_norm,
                    skipped_steps: state.skipped_steps,
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
                    hs_total_bytes,
                    peak_rss_mb: peak_rss_mb(),
                    gpu_util: gpu.as_ref().map(|g| g.util.clone()),
                    gpu_power_w: gpu.as_ref().map(|g| g.power_w.clone()),
                    gpu_mem_mb: gpu.as_ref().map(|g| g.mem_mb.clone()),
                    eta_s: (t.steps - step) as f64 * secs / steps_w,
                    elapsed_s: elapsed_before + started.elapsed().as_secs_f64(),
                };
                exp.log(&m)?; // a no-op on ranks other than 0
                if let Some(tb) = tb.as_mut() {
                    tensorboard::log_metrics(tb, &serde_json::to_value(&m)?)?;
                }
                bar.set_message(format!("loss {:.3}  τ̂ {:.3}  {:.0} tok/s  q_hs {:.1}", m.loss, m.tau_hat, m.tok_per_s, m.q_hs));
                bar.suspend(|| {
                    tracing::info!(
                        "step {step}/{}  loss {:.4}  τ̂ {:.3}  acc@1 {:.3}  lr {:.2e}  |g| {:.3}  {:.0} tok/s  q_hs {:.1}",
                        t.steps,
                        m.loss,
                        m.tau_hat,
                        m.acc.first().copied().unwrap_or(0.0),
                        m.lr,
                        m.grad_norm,
                        m.tok_per_s,
                        m.q_hs
                    )
                });
                first.get_or_insert_with(|| m.clone());
                last = Some(m);
                state.window = WindowSums::new(block_size);
                times = WindowTimes::default();
                busy_before = busy_now;
                wait_before = feed.wait_s;
            }
            interrupted = stop.requested().or(sums.stop.then_some(143));
            if opts.stop_at == Some(step) && step < t.steps {
                stopped_at = Some(step);
            }
            let due = (t.checkpoint_every > 0 && step % t.checkpoint_every == 0)
                || step == t.steps
                || interrupted.is_some()
                || stopped_at.is_some();
            if due && !all_finite(&params) {
                // Never let a diverged state replace a good checkpoint.
                bar.suspend(|| tracing::warn!("step {step}: drafter weights are not finite; checkpoint not written"));
            } else if due && lead {
                state.elapsed_s = elapsed_before + started.elapsed().as_secs_f64();
                let dir = exp.save_checkpoint(
                    step,
                    &drafter.parameters(),
                    drafter.config_json().as_str(),
                    &optimizer.state(),
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
            if stopped_at.is_some() {
                bar.suspend(|| tracing::info!("--stop-at {step}: stopped; resume with `train --resume {}`", exp.dir.display()));
                break;
            }
        }
        Ok(())
    };
    pipeline::run(&pipe, producer, workers, consume)?;
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
        stopped_at,
    };
    if interrupted.is_none() && stopped_at.is_none() && lead {
        exp.write_summary(&summary)?;
    }
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
