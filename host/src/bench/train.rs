//! `dflash-host bench train --config configs/bench/<shape>.toml`: training throughput at real
//! shapes with random weights. Measures, in one process:
//! 1. the bf16 matmul ceiling (an n^3 product in a loop), the denominator of every MFU;
//! 2. the target forward (the features training asks for, and the full model with logits);
//! 3. one drafter train step (forward, DFlash loss, backward, clip, optimizer) fed by synthetic
//!    target hidden states; the drafter is whatever plugin the config's [drafter] names;
//! 4. the pipeline: target forward then drafter step on the same device, each step;
//! 5. device memory in use after each phase;
//! 6. with `--trace DIR`, a profiler trace of one drafter step and one target forward.
//!
//! A target spread over the ranks of one replica (`[target] tensor_parallel = T`, `--nproc T`)
//! runs as training runs it: rank 0 runs the phases, the other ranks serve its target's calls
//! (replica.rs); the target phases' MFU is then over the replica's T devices.
//!
//! Each figure comes with its FLOP count (flops.rs) and MFU; a table, then one JSON line.

use super::{
    flops::{self, Shape},
    memory::{self, mem},
    replica::{self, RankFigures},
    train_step::{drafter_flop, drafter_layout, fused_loss_error, synthetic_batch, DrafterStep, StepCounts},
};
use crate::{
    config::{Override, PluginSection},
    dist::{replica::Layout, DistEnv},
    plugins::{
        handles::{DrafterHandle, OptimizerHandle, TargetHandle},
        Registry,
    },
    train::{
        anchors::{AnchorRule, AnchorSampler},
        loss::default_gamma,
        step::{self, LossNormalization},
        step_runner::NonFiniteGuard,
        DraftLoss, StepRunner,
    },
};
use anyhow::{anyhow, bail, Context, Result};
use kernels::{ffi::AllocatorStats, profiler};
use plugin_api::{
    abi_stable::std_types::RSome,
    describe::FlopsQuery,
    tch::{self, Device, Kind, Tensor},
    HostContext, PluginInstance, PluginKind, TargetSpec, TensorHandle,
};
use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    time::Instant,
};

use super::train_report::phase;
pub use super::train_report::{print, BenchConfig, BenchShape, Phase, Report};

pub(crate) fn section(kind: &'static str, table: &toml::Table) -> Result<PluginSection> {
    let mut rest = table.clone();
    let plugin = match rest.remove("plugin") {
        Some(toml::Value::String(s)) => s,
        _ => bail!("[{kind}]: field `plugin` (a plugin name) is missing"),
    };
    Ok(PluginSection { kind, plugin, config_toml: toml::to_string(&rest)? })
}

/// The plugin a bench section names, for errors (`?` when it names none: `section` says so).
pub(crate) fn plugin_name(table: &toml::Table) -> String {
    table.get("plugin").and_then(|v| v.as_str()).unwrap_or("?").to_string()
}

pub(crate) fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

/// Median seconds of `iters` runs of `f` after `warmup` untimed ones, synchronising the device
/// around each so queued work is counted where it ran.
fn time(device: Device, warmup: usize, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..warmup {
        f()?;
    }
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters.max(1) {
        sync(device);
        let t = Instant::now();
        f()?;
        sync(device);
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// TFLOP/s of an n^3 matmul in `kind`, random operands (zeros run faster: METHOD.md).
fn matmul_ceiling(n: i64, device: Device, kind: Kind) -> Result<f64> {
    let a = Tensor::randn([n, n], (kind, device));
    let b = Tensor::randn([n, n], (kind, device));
    let reps = 10;
    let s = time(device, 1, 3, || {
        for _ in 0..reps {
            let _ = a.matmul(&b);
        }
        Ok(())
    })?;
    Ok(2.0 * (n as f64).powi(3) * reps as f64 / s / 1e12)
}

/// The target's forward FLOPs by part for `layers` over a [b, s] batch, as its plugin counts them
/// from its config (ABI `target_flops`: the hf plugin counts by architecture, hybrid and MoE
/// layers, active experts only); None where the plugin cannot tell.
fn plugin_flops(
    registry: &Registry,
    target: &toml::Table,
    ctx: &HostContext,
    layers: usize,
    (b, s): (usize, usize),
    logits: bool,
) -> Result<Option<BTreeMap<String, f64>>> {
    let section = section("target", target)?;
    let plugin = registry.find(PluginKind::Target, &section.plugin)?;
    let query = FlopsQuery { layers: layers as u32, batch: b as u32, seq_len: s as u32, logits };
    let parts = plugin.target_flops(&section, ctx, query)?;
    Ok(parts.map(|p| p.into_iter().map(|part| (part.name.into_string(), part.flop)).collect()))
}

/// The estimate of the device memory the bench's config needs in training (`memory_estimate.rs`),
/// at the bench's shapes with the full forward's logits; None where the target's plugin cannot tell.
pub(crate) fn bench_estimate(
    registry: &Registry,
    cfg: &BenchConfig,
    ctx: &HostContext,
) -> Result<Option<crate::memory_estimate::Estimate>> {
    use crate::memory_estimate::{estimate, Sections, Shape, Work};
    let (target, drafter, optimizer) =
        (section("target", &cfg.target)?, section("drafter", &cfg.drafter)?, section("optimizer", &cfg.optimizer)?);
    let sections = Sections { target: &target, drafter: Some(&drafter), optimizer: Some(&optimizer), data: None };
    let sh = &cfg.bench;
    let shape =
        Shape { batch: sh.batch_size as u32, seq_len: sh.seq_len as u32, anchors_per_seq: sh.anchors_per_seq as u32 };
    estimate(registry, &sections, ctx, Work::Train, shape, true)
}

/// `overrides`: `--set bench.batch_size=8` and `--device`, applied to the file's table. None on a
/// rank that served its replica's target (the lead reports).
pub fn train(
    registry: &Registry,
    config_path: &Path,
    overrides: &[Override],
    trace: Option<&Path>,
) -> Result<Option<Report>> {
    // 0. Setup: the config and the device; the device memory the config needs, estimated before
    // anything loads (the lead's: it holds the drafter), and refused where it cannot fit.
    let mut bench = Bench::setup(config_path, overrides)?;
    let estimate = bench.estimate(registry)?;
    let mut marks = Marks { start: bench.stats(true), ..Marks::default() };

    // 1. Plugins from the config's sections (any registered target, drafter, optimizer).
    let Some((mut target, held)) = bench.target(registry)? else { return Ok(None) };
    let device = bench.device;
    sync(device);
    marks.target_built = bench.stats(false);
    let spec = target.spec()?;
    bench.ctx.target = RSome(spec.clone());
    let (mut drafter, mut optimizer) = bench.drafter_and_optimizer(registry)?;
    let (named, params) = step::trainable_parameters(&drafter)?;
    let n_params: f64 = params.iter().map(|p| p.numel() as f64).sum();
    optimizer.init(named)?;
    let layer_ids: Vec<u32> = drafter.target_layer_ids()?;
    let block_size = drafter.block_size()? as i64;
    let layout = drafter_layout(&drafter, &spec);
    let drafter_name = plugin_name(&bench.cfg.drafter);
    let mut step = bench.drafter_step(&mut drafter, &mut optimizer, &target, params, block_size)?;
    sync(device);
    let built_mem_gib = mem(device);
    marks.all_built = bench.stats(false);
    let sh = &bench.cfg.bench;
    let fused_loss_error = fused_loss_error(&step.runner.draft, &spec, sh, device, bench.kind)?;

    // 2. The ceiling.
    let ceiling = matmul_ceiling(sh.matmul_size, device, bench.kind)?;

    // 3. Drafter step on synthetic target features (fixed; the drafter only reads them).
    let batch = synthetic_batch(&spec, sh.batch_size, sh.seq_len);
    let features = [sh.batch_size as i64, sh.seq_len as i64, layer_ids.len() as i64 * spec.hidden_size as i64];
    let (drafter_s, counts) = bench.time_drafter_step(&mut step, &batch, features, &mut marks)?;
    let (drafter_flop, exact) = drafter_flop(layout, &layer_ids, block_size, n_params, &counts, &spec, sh);
    let draft_tokens = (sh.batch_size * sh.anchors_per_seq) as f64 * block_size as f64;
    let drafter_step = phase(drafter_s, draft_tokens, drafter_flop, ceiling, mem(device));

    // 4. Target forward: to the deepest feature layer (training), and whole with logits.
    let ids_dev = TensorHandle::new(batch.0.to_device(device));
    let forwards = bench.time_target(registry, &mut target, (&ids_dev, &layer_ids, &spec), ceiling, &mut marks)?;

    // 5. The pipeline: each step, fresh ids through the target, its features into the drafter.
    let pipeline_s = time(device, 1, sh.iters, || {
        let (ids, loss_mask) = synthetic_batch(&spec, sh.batch_size, sh.seq_len);
        let hidden = target.forward(&TensorHandle::new(ids.to_device(device)), &layer_ids, false)?.hidden.into_tensor();
        step.run(&ids, &loss_mask, hidden).map(drop)
    })?;
    let flop = forwards.features.flop + drafter_flop;
    let pipeline = phase(pipeline_s, draft_tokens, flop, ceiling * bench.tensor_parallel as f64, mem(device));

    // 6. Traces of one drafter step and one target forward, after the timing.
    if let Some(dir) = trace {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let features = Tensor::randn(features, (bench.kind, device));
        profile(dir, device, "drafter_step", &mut || step.run(&batch.0, &batch.1, features.shallow_clone()).map(drop))?;
        drop(features);
        profile(dir, device, "target_forward", &mut || target.forward(&ids_dev, &layer_ids, false).map(drop))?;
    }

    // The report: each rank's memory, the estimate beside what was measured, the phases.
    drop(step);
    let ranks = rank_figures(&bench.device_name, device, built_mem_gib, held, target)?;
    let memory_rows = estimate.as_ref().map(|e| memory::rows(e, marks.measured(device))).unwrap_or_default();
    let target_tokens = (sh.batch_size * sh.seq_len) as f64;
    Ok(Some(Report {
        device: bench.device_name.clone(),
        memory: memory_rows,
        memory_estimate_gib: estimate.as_ref().map(|e| crate::memory_estimate::gib(e.total())),
        tensor_parallel: bench.tensor_parallel,
        ranks,
        dtype: bench.dtype.clone(),
        batch_size: sh.batch_size,
        seq_len: sh.seq_len,
        anchors_per_seq: sh.anchors_per_seq,
        drafter: drafter_name,
        drafter_flop_exact: exact,
        ceiling_tflop_per_s: ceiling,
        built_mem_gib,
        pipeline_target_tok_per_s: target_tokens / pipeline_s,
        pipeline_efficiency: (forwards.features.step_s + drafter_s) / pipeline_s,
        fused_loss_error,
        target_features: forwards.features,
        target_full: forwards.full,
        target_full_flop_split: forwards.full_flop_split,
        drafter_step,
        pipeline,
    }))
}

/// A bench run's setup: its config (the file's table with the overrides), the device and dtype,
/// the plugins' host context, the replica it runs in.
struct Bench {
    cfg: BenchConfig,
    /// The file's table with the overrides, and its path: what a replica's ranks compare.
    table: toml::Table,
    config_path: PathBuf,
    dtype: String,
    device_name: String,
    device: Device,
    kind: Kind,
    ctx: HostContext,
    place: Option<(DistEnv, Layout)>,
    tensor_parallel: usize,
}

impl Bench {
    fn setup(config_path: &Path, overrides: &[Override]) -> Result<Self> {
        let text =
            std::fs::read_to_string(config_path).with_context(|| format!("reading {}", config_path.display()))?;
        let mut table: toml::Table = toml::from_str(&text).with_context(|| format!("{}", config_path.display()))?;
        for o in overrides {
            o.apply(&mut table)?;
        }
        let shown = overrides.iter().map(|o| format!(" ({})", o.arg)).collect::<String>();
        let cfg: BenchConfig = toml::Value::Table(table.clone())
            .try_into()
            .with_context(|| format!("{}{shown}", config_path.display()))?;
        let dtype = cfg.dtype.clone().unwrap_or_else(|| if cfg.device == "cpu" { "f32" } else { "bf16" }.into());
        if cfg.device.starts_with("cuda") && !crate::environment::enable_cuda() {
            bail!("device `{}` asked for, but libtorch's CUDA libraries could not be loaded", cfg.device);
        }
        let place = crate::pipeline::replicas::one_replica(&cfg.target, "bench train")?;
        let device_name = replica::device(&cfg.device)?;
        let config_dir = config_path.parent().unwrap_or(Path::new("."));
        let mut ctx =
            crate::plugins::host_context(&device_name, &dtype, cfg.seed, config_dir, &crate::environment::cache_dir());
        ctx.replica = place.as_ref().map(|(env, l)| l.group(env)).into();
        let device = ctx.tch_device().map_err(|e| anyhow!("{e}"))?;
        let kind = ctx.tch_kind().map_err(|e| anyhow!("{e}"))?;
        tch::manual_seed(cfg.seed as i64);
        let tensor_parallel = place.as_ref().map_or(1, |(_, l)| l.size);
        let config_path = config_path.to_path_buf();
        Ok(Bench { cfg, table, config_path, dtype, device_name, device, kind, ctx, place, tensor_parallel })
    }

    /// The estimate on a replica's lead, checked against the device.
    fn estimate(&self, registry: &Registry) -> Result<Option<crate::memory_estimate::Estimate>> {
        let lead = self.place.as_ref().is_none_or(|(_, l)| l.is_lead());
        let estimate = match lead {
            true => bench_estimate(registry, &self.cfg, &self.ctx)?,
            false => None,
        };
        if let Some(e) = &estimate {
            crate::memory_estimate::check(e, &self.device_name)?;
        }
        Ok(estimate)
    }

    /// The allocator's readings (the peak reset when `reset`); None off CUDA.
    fn stats(&self, reset: bool) -> Option<AllocatorStats> {
        match self.device {
            Device::Cuda(i) => kernels::ffi::cuda_allocator_stats(i, reset).ok(),
            _ => None,
        }
    }

    fn create(&self, registry: &Registry, kind: PluginKind, table: &toml::Table) -> Result<PluginInstance> {
        Ok(registry.create(kind, &section(kind.as_str(), table)?, &self.ctx)?.0)
    }

    /// The target; a replica's other ranks serve it alone (None then), its lead's target posts
    /// every call.
    fn target(&self, registry: &Registry) -> Result<Option<(TargetHandle, Option<replica::Held>)>> {
        let PluginInstance::Target(target) = self.create(registry, PluginKind::Target, &self.cfg.target)? else {
            bail!("[target] made no target")
        };
        let target = TargetHandle::new(target, &plugin_name(&self.cfg.target));
        let identity = || replica::identity(&self.table, &self.config_path);
        Ok(Some(match &self.place {
            Some((env, layout)) if !layout.is_lead() => {
                sync(self.device);
                let device = (self.device, self.device_name.as_str());
                replica::serve(target, (env, layout), device, &identity()?, mem(self.device))?;
                return Ok(None);
            }
            Some((env, layout)) => {
                let (target, held) = replica::lead(target, (env, layout), self.device, &identity()?)?;
                (target, Some(held))
            }
            None => (target, None),
        }))
    }

    fn drafter_and_optimizer(&self, registry: &Registry) -> Result<(DrafterHandle, OptimizerHandle)> {
        let PluginInstance::Drafter(drafter) = self.create(registry, PluginKind::Drafter, &self.cfg.drafter)? else {
            bail!("[drafter] made no drafter")
        };
        let PluginInstance::Optimizer(optimizer) = self.create(registry, PluginKind::Optimizer, &self.cfg.optimizer)?
        else {
            bail!("[optimizer] made no optimizer")
        };
        Ok((
            DrafterHandle::new(drafter, &plugin_name(&self.cfg.drafter)),
            OptimizerHandle::new(optimizer, &plugin_name(&self.cfg.optimizer)),
        ))
    }

    /// The trainer's step runner over the drafter and optimizer, one micro-batch a step.
    fn drafter_step<'a>(
        &self,
        drafter: &'a mut DrafterHandle,
        optimizer: &'a mut OptimizerHandle,
        target: &TargetHandle,
        params: Vec<Tensor>,
        block_size: i64,
    ) -> Result<DrafterStep<'a>> {
        let sh = &self.cfg.bench;
        let draft = DraftLoss::for_drafter(
            drafter,
            target,
            self.device,
            AnchorSampler { per_seq: sh.anchors_per_seq, seed: self.cfg.seed, rule: AnchorRule::Response },
            Some(default_gamma(block_size as usize)),
            // One micro-batch a step: its mean is the step's loss (the loss checks read it).
            LossNormalization::PerMicroBatch,
        )?;
        let runner = StepRunner {
            drafter,
            optimizer,
            params,
            draft,
            grad_accum: 1,
            grad_clip: sh.grad_clip,
            comm: None,
            // A non-finite step stops the benchmark: its figures would mean nothing.
            guard: NonFiniteGuard { max: 1, consecutive: 0 },
        };
        Ok(DrafterStep { runner, draws: 0 })
    }

    /// The drafter step's median seconds (warm-up steps first), on fixed random features of
    /// `features`' shape, and what the last step counted.
    fn time_drafter_step(
        &self,
        step: &mut DrafterStep,
        (ids, loss_mask): &(Tensor, Tensor),
        features: [i64; 3],
        marks: &mut Marks,
    ) -> Result<(f64, StepCounts)> {
        let (device, sh) = (self.device, &self.cfg.bench);
        sync(device);
        marks.before_step = self.stats(true);
        let features = Tensor::randn(features, (self.kind, device));
        let mut counts = None;
        let drafter_s = time(device, sh.warmup, sh.iters, || {
            counts = Some(step.run(ids, loss_mask, features.shallow_clone())?);
            Ok(())
        })?;
        drop(features);
        sync(device);
        marks.after_step = self.stats(true);
        Ok((drafter_s, counts.expect("at least one step ran")))
    }

    /// The target's forward to the deepest feature layer and whole with logits, timed; its FLOPs
    /// its plugin's count where it gives one, else the dense decoder formula at its shape. The
    /// target runs on the replica's devices.
    fn time_target(
        &self,
        registry: &Registry,
        target: &mut TargetHandle,
        (ids, layer_ids, spec): (&TensorHandle, &[u32], &TargetSpec),
        ceiling: f64,
        marks: &mut Marks,
    ) -> Result<TargetForwards> {
        let (device, sh) = (self.device, &self.cfg.bench);
        let (b, s) = (sh.batch_size, sh.seq_len);
        let target_shape = Shape::of_target(spec);
        let target_flops = |layers: usize, logits: bool| -> Result<f64> {
            Ok(match plugin_flops(registry, &self.cfg.target, &self.ctx, layers, (b, s), logits)? {
                Some(parts) => parts.values().sum(),
                None => flops::target_forward(&target_shape, layers, b, s, logits),
            })
        };
        let mut forward = |want_logits: bool| -> Result<Tensor> {
            Ok(target.forward(ids, layer_ids, want_logits)?.hidden.into_tensor())
        };
        let features_s = time(device, sh.warmup, sh.iters, || forward(false).map(drop))?;
        let upto = layer_ids.iter().max().map_or(0, |&m| m as usize + 1);
        let tokens = (b * s) as f64;
        let replica_ceiling = ceiling * self.tensor_parallel as f64;
        let features = phase(features_s, tokens, target_flops(upto, false)?, replica_ceiling, mem(device));
        sync(device);
        marks.before_full = self.stats(true);
        let full_s = time(device, sh.warmup, sh.iters, || forward(true).map(drop))?;
        sync(device);
        marks.after_full = self.stats(false);
        let layers = spec.num_hidden_layers as usize;
        let full = phase(full_s, tokens, target_flops(layers, true)?, replica_ceiling, mem(device));
        let full_flop_split = plugin_flops(registry, &self.cfg.target, &self.ctx, layers, (b, s), true)?;
        Ok(TargetForwards { features, full, full_flop_split })
    }
}

/// Each rank's device memory: this one's, then (on a replica's lead) the ranks that served its
/// target.
fn rank_figures(
    device_name: &str,
    device: Device,
    built_mem_gib: Option<f64>,
    held: Option<replica::Held>,
    target: TargetHandle,
) -> Result<Vec<RankFigures>> {
    let mut ranks =
        vec![RankFigures { rank: 0, device: device_name.into(), built_mem_gib, mem_gib: mem(device), served_calls: 0 }];
    match held {
        Some(held) => ranks.extend(held.figures(target)?),
        None => drop(target),
    }
    Ok(ranks)
}

/// The target's two forwards as timed.
struct TargetForwards {
    features: Phase,
    full: Phase,
    full_flop_split: Option<BTreeMap<String, f64>>,
}

/// A profiler trace of `f` as `dir/<name>.trace.json`.
fn profile(dir: &Path, device: Device, name: &str, f: &mut dyn FnMut() -> Result<()>) -> Result<()> {
    let path = dir.join(format!("{name}.trace.json"));
    let p = profiler::Profiler::start(matches!(device, Device::Cuda(_)))
        .map_err(|e| anyhow!("starting the profiler: {e}"))?;
    f()?;
    sync(device);
    p.save(&path).map_err(|e| anyhow!("writing {}: {e}", path.display()))?;
    eprintln!("trace: {}", path.display());
    Ok(())
}

/// The allocator's readings between the phases (None off CUDA), for the measured memory.
#[derive(Default)]
struct Marks {
    start: Option<AllocatorStats>,
    target_built: Option<AllocatorStats>,
    all_built: Option<AllocatorStats>,
    before_step: Option<AllocatorStats>,
    after_step: Option<AllocatorStats>,
    before_full: Option<AllocatorStats>,
    after_full: Option<AllocatorStats>,
}

impl Marks {
    fn measured(&self, device: Device) -> Option<memory::Measured> {
        let (s0, t, a) = (self.start?, self.target_built?, self.all_built?);
        let (bs, st, bf, f) = (self.before_step?, self.after_step?, self.before_full?, self.after_full?);
        Some(memory::Measured {
            target_built: t.allocated - s0.allocated,
            all_built: a.allocated - s0.allocated,
            drafter_step_peak: st.peak.saturating_sub(bs.allocated),
            target_forward_peak: f.peak.saturating_sub(bf.allocated),
            outside_allocator: match device {
                Device::Cuda(i) => memory::device_used_bytes(i).unwrap_or(0).saturating_sub(f.reserved),
                _ => 0,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tiny_bench_runs_on_the_cpu_and_counts_its_work() {
        let registry = Registry::new(&[]).unwrap();
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/bench/tiny.toml");
        let trace = tempfile::tempdir().unwrap();
        let batch_3 = [Override::parse_set("bench.batch_size=3").unwrap()];
        let r = train(&registry, &path, &batch_3, Some(trace.path())).unwrap().unwrap();
        assert_eq!(r.batch_size, 3, "--set reaches the bench section");
        assert_eq!((r.tensor_parallel, r.ranks.len(), r.ranks[0].served_calls), (1, 1, 0));
        assert!(r.drafter_flop_exact);
        for p in [&r.target_features, &r.target_full, &r.drafter_step, &r.pipeline] {
            assert!(p.step_s > 0.0 && p.tok_per_s > 0.0 && p.flop > 0.0 && p.mfu > 0.0, "{p:?}");
        }
        assert!(r.target_full.flop > r.target_features.flop, "the full forward runs more layers and the head");
        assert!((r.pipeline.flop - r.target_features.flop - r.drafter_step.flop).abs() < 1.0);
        assert!(r.ceiling_tflop_per_s > 0.0);
        serde_json::to_string(&r).unwrap();
        // The traces hold the step's named ranges and the ops inside them.
        let text = std::fs::read_to_string(trace.path().join("drafter_step.trace.json")).unwrap();
        for name in ["\"forward + loss\"", "\"backward\"", "\"optimizer\"", "\"aten::mm\""] {
            assert!(text.contains(name), "{name} not in the drafter step's trace");
        }
        assert!(trace.path().join("target_forward.trace.json").exists());
    }

    /// The hybrid, MoE and sanitizer bench configs read through the plugins' ABI: the target's config
    /// without its weights (the Qwen3.6-27B one in its multimodal layout), the drafter section
    /// checked, and the FLOPs counted by architecture. (The drafter resolved against that
    /// target is drafter_dflash's own test.)
    #[test]
    fn the_hybrid_and_moe_bench_configs_read() {
        let registry = Registry::new(&[]).unwrap();
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/bench");
        for (name, layers) in [("qwen3.6-27b.toml", 64), ("qwen3-30b-a3b.toml", 48), ("smollm2-gdn-muon.toml", 30)] {
            let path = dir.join(name);
            let cfg: BenchConfig = toml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            let ctx = crate::plugins::host_context("cpu", "f32", 0, &dir, Path::new("/nonexistent"));
            let target = section("target", &cfg.target).unwrap();
            let check = registry.find(PluginKind::Target, "hf").unwrap().check(&target, &ctx).unwrap();
            let facts = check.target.into_option().unwrap_or_else(|| panic!("{name}: target config"));
            assert_eq!(facts.num_hidden_layers, layers, "{name}");
            assert_eq!(
                (facts.hybrid, facts.mixture_of_experts),
                (name.starts_with("qwen3.6"), name.starts_with("qwen3-30b"))
            );
            let drafter = section("drafter", &cfg.drafter).unwrap();
            registry.find(PluginKind::Drafter, &drafter.plugin).unwrap().check(&drafter, &ctx).unwrap();
            let f = plugin_flops(&registry, &cfg.target, &ctx, layers as usize, (4, 3072), true).unwrap().unwrap();
            assert!(f["mlp"] > 0.0 && f["attention"] > 0.0 && f["head"] > 0.0, "{name}: {f:?}");
            assert_eq!(f["gdn"] > 0.0, name.starts_with("qwen3.6"), "{name}: {f:?}");
        }
    }
}
