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
    flops::{self, DrafterWork, Shape},
    memory::{self, mem},
    replica::{self, RankFigures},
    train_step::{drafter_layout, fused_loss_error, synthetic_batch, DrafterStep},
};
use crate::{
    config::{Override, PluginSection},
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
use kernels::profiler;
use plugin_api::{
    abi_stable::std_types::RSome,
    describe::FlopsQuery,
    tch::{self, Device, Kind, Tensor},
    HostContext, PluginInstance, PluginKind, TensorHandle,
};
use std::{collections::BTreeMap, path::Path, time::Instant};

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
    let text = std::fs::read_to_string(config_path).with_context(|| format!("reading {}", config_path.display()))?;
    let mut table: toml::Table = toml::from_str(&text).with_context(|| format!("{}", config_path.display()))?;
    for o in overrides {
        o.apply(&mut table)?;
    }
    let shown = overrides.iter().map(|o| format!(" ({})", o.arg)).collect::<String>();
    // What a replica's ranks compare when they meet (the binary's hash: read only under a launcher).
    let identity = || replica::identity(&table, config_path);
    let cfg: BenchConfig =
        toml::Value::Table(table.clone()).try_into().with_context(|| format!("{}{shown}", config_path.display()))?;
    let sh = &cfg.bench;
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
    let (device, kind) = (ctx.tch_device().map_err(|e| anyhow!("{e}"))?, ctx.tch_kind().map_err(|e| anyhow!("{e}"))?);
    tch::manual_seed(cfg.seed as i64);
    let tensor_parallel = place.as_ref().map_or(1, |(_, l)| l.size);

    // 0. The device memory the config needs, estimated before anything loads (the lead's: it
    // holds the drafter), and refused where it cannot fit.
    let lead = place.as_ref().is_none_or(|(_, l)| l.is_lead());
    let estimate = match lead {
        true => bench_estimate(registry, &cfg, &ctx)?,
        false => None,
    };
    if let Some(e) = &estimate {
        crate::memory_estimate::check(e, &device_name)?;
    }
    let stats = |reset: bool| match device {
        Device::Cuda(i) => kernels::ffi::cuda_allocator_stats(i, reset).ok(),
        _ => None,
    };
    let start = stats(true);

    // 1. Plugins from the config's sections (any registered target, drafter, optimizer).
    let create = |kind: PluginKind, table: &toml::Table, ctx: &HostContext| -> Result<PluginInstance> {
        Ok(registry.create(kind, &section(kind.as_str(), table)?, ctx)?.0)
    };
    let PluginInstance::Target(target) = create(PluginKind::Target, &cfg.target, &ctx)? else {
        bail!("[target] made no target")
    };
    let target = TargetHandle::new(target, &plugin_name(&cfg.target));
    // A replica's other ranks serve the target alone; its lead's target posts every call.
    let (mut target, held) = match &place {
        Some((env, layout)) if !layout.is_lead() => {
            sync(device);
            replica::serve(target, (env, layout), (device, &device_name), &identity()?, mem(device))?;
            return Ok(None);
        }
        Some((env, layout)) => {
            let (target, held) = replica::lead(target, (env, layout), device, &identity()?)?;
            (target, Some(held))
        }
        None => (target, None),
    };
    sync(device);
    let target_built = stats(false);
    let spec = target.spec()?;
    ctx.target = RSome(spec.clone());
    let PluginInstance::Drafter(drafter) = create(PluginKind::Drafter, &cfg.drafter, &ctx)? else {
        bail!("[drafter] made no drafter")
    };
    let PluginInstance::Optimizer(optimizer) = create(PluginKind::Optimizer, &cfg.optimizer, &ctx)? else {
        bail!("[optimizer] made no optimizer")
    };
    let mut drafter = DrafterHandle::new(drafter, &plugin_name(&cfg.drafter));
    let mut optimizer = OptimizerHandle::new(optimizer, &plugin_name(&cfg.optimizer));
    let (named, params) = step::trainable_parameters(&drafter)?;
    let n_params: f64 = params.iter().map(|p| p.numel() as f64).sum();
    optimizer.init(named)?;
    let layer_ids: Vec<u32> = drafter.target_layer_ids()?;
    let block_size = drafter.block_size()? as i64;
    let layout = drafter_layout(&drafter, &spec);
    let drafter_name = plugin_name(&cfg.drafter);
    let draft = DraftLoss::for_drafter(
        &drafter,
        &target,
        device,
        AnchorSampler { per_seq: sh.anchors_per_seq, seed: cfg.seed, rule: AnchorRule::Response },
        Some(default_gamma(block_size as usize)),
        // One micro-batch a step: its mean is the step's loss (the loss checks read it).
        LossNormalization::PerMicroBatch,
    )?;
    let runner = StepRunner {
        drafter: &mut drafter,
        optimizer: &mut optimizer,
        params,
        draft,
        grad_accum: 1,
        grad_clip: sh.grad_clip,
        comm: None,
        // A non-finite step stops the benchmark: its figures would mean nothing.
        guard: NonFiniteGuard { max: 1, consecutive: 0 },
    };
    let mut step = DrafterStep { runner, draws: 0 };
    sync(device);
    let built_mem_gib = mem(device);
    let all_built = stats(false);
    let fused_loss_error = fused_loss_error(&step.runner.draft, &spec, sh, device, kind)?;

    // 2. The ceiling.
    let ceiling = matmul_ceiling(sh.matmul_size, device, kind)?;

    // 3. Drafter step on synthetic target features (fixed; the drafter only reads them).
    let (b, s) = (sh.batch_size, sh.seq_len);
    let (ids, loss_mask) = synthetic_batch(&spec, b, s);
    sync(device);
    let before_step = stats(true);
    let features =
        Tensor::randn([b as i64, s as i64, layer_ids.len() as i64 * spec.hidden_size as i64], (kind, device));
    let mut counts = None;
    let drafter_s = time(device, sh.warmup, sh.iters, || {
        counts = Some(step.run(&ids, &loss_mask, features.shallow_clone())?);
        Ok(())
    })?;
    drop(features);
    sync(device);
    let after_step = stats(true);
    let c = counts.expect("at least one step ran");
    let target_shape = Shape::of_target(&spec);
    // The target's FLOPs: its plugin's count from its config where it gives one, else the dense
    // decoder formula at the loaded target's shape.
    let target_flops = |layers: usize, logits: bool| -> Result<f64> {
        Ok(match plugin_flops(registry, &cfg.target, &ctx, layers, (b, s), logits)? {
            Some(parts) => parts.values().sum(),
            None => flops::target_forward(&target_shape, layers, b, s, logits),
        })
    };
    let (drafter_flop, exact) = match layout {
        Some((shape, layers)) => {
            let work = DrafterWork {
                shape,
                layers,
                features: layer_ids.len(),
                batch: b,
                seq: s,
                block_size: block_size as usize,
                anchors: c.anchors,
                anchor_pos_sum: c.anchor_pos_sum,
                counted: c.counted,
            };
            (work.step(), true)
        }
        None => (
            flops::drafter_step_estimate(
                n_params,
                (c.anchors as i64 * block_size) as f64,
                c.counted as f64,
                &target_shape,
            ),
            false,
        ),
    };
    let draft_tokens = (b * sh.anchors_per_seq) as f64 * block_size as f64;
    let drafter_step = phase(drafter_s, draft_tokens, drafter_flop, ceiling, mem(device));

    // 4. Target forward: to the deepest feature layer (training), and whole with logits.
    let ids_dev = TensorHandle::new(ids.to_device(device));
    let mut forward = |want_logits: bool| -> Result<Tensor> {
        Ok(target.forward(&ids_dev, &layer_ids, want_logits)?.hidden.into_tensor())
    };
    let features_s = time(device, sh.warmup, sh.iters, || forward(false).map(drop))?;
    let upto = layer_ids.iter().max().map_or(0, |&m| m as usize + 1);
    let target_tokens = (b * s) as f64;
    // The target (and so the pipeline) runs on the replica's devices, the drafter on one.
    let replica_ceiling = ceiling * tensor_parallel as f64;
    let target_features = phase(features_s, target_tokens, target_flops(upto, false)?, replica_ceiling, mem(device));
    sync(device);
    let before_full = stats(true);
    let full_s = time(device, sh.warmup, sh.iters, || forward(true).map(drop))?;
    sync(device);
    let after_full = stats(false);
    let layers = spec.num_hidden_layers as usize;
    let target_full = phase(full_s, target_tokens, target_flops(layers, true)?, replica_ceiling, mem(device));
    let target_full_flop_split = plugin_flops(registry, &cfg.target, &ctx, layers, (b, s), true)?;

    // 5. The pipeline: each step, fresh ids through the target, its features into the drafter.
    let pipeline_s = time(device, 1, sh.iters, || {
        let (ids, loss_mask) = synthetic_batch(&spec, b, s);
        let hidden = target.forward(&TensorHandle::new(ids.to_device(device)), &layer_ids, false)?.hidden.into_tensor();
        step.run(&ids, &loss_mask, hidden).map(drop)
    })?;
    let pipeline = phase(pipeline_s, draft_tokens, target_features.flop + drafter_flop, replica_ceiling, mem(device));

    // 6. Traces of one drafter step and one target forward, after the timing.
    if let Some(dir) = trace {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let cuda = matches!(device, Device::Cuda(_));
        let profile = |name: &str, f: &mut dyn FnMut() -> Result<()>| -> Result<()> {
            let path = dir.join(format!("{name}.trace.json"));
            let p = profiler::Profiler::start(cuda).map_err(|e| anyhow!("starting the profiler: {e}"))?;
            f()?;
            sync(device);
            p.save(&path).map_err(|e| anyhow!("writing {}: {e}", path.display()))?;
            eprintln!("trace: {}", path.display());
            Ok(())
        };
        let features =
            Tensor::randn([b as i64, s as i64, layer_ids.len() as i64 * spec.hidden_size as i64], (kind, device));
        profile("drafter_step", &mut || step.run(&ids, &loss_mask, features.shallow_clone()).map(drop))?;
        drop(features);
        profile("target_forward", &mut || target.forward(&ids_dev, &layer_ids, false).map(drop))?;
    }

    drop(step);
    let mut ranks = vec![RankFigures {
        rank: 0,
        device: device_name.clone(),
        built_mem_gib,
        mem_gib: mem(device),
        served_calls: 0,
    }];
    match held {
        Some(held) => ranks.extend(held.figures(target)?),
        None => drop(target),
    }
    let measured = match (start, target_built, all_built, before_step, after_step, before_full, after_full) {
        (Some(s0), Some(t), Some(a), Some(bs), Some(st), Some(bf), Some(f)) => Some(memory::Measured {
            target_built: t.allocated - s0.allocated,
            all_built: a.allocated - s0.allocated,
            drafter_step_peak: st.peak.saturating_sub(bs.allocated),
            target_forward_peak: f.peak.saturating_sub(bf.allocated),
            outside_allocator: match device {
                Device::Cuda(i) => memory::device_used_bytes(i).unwrap_or(0).saturating_sub(f.reserved),
                _ => 0,
            },
        }),
        _ => None,
    };
    let memory_rows = estimate.as_ref().map(|e| memory::rows(e, measured)).unwrap_or_default();
    Ok(Some(Report {
        device: device_name,
        memory: memory_rows,
        memory_estimate_gib: estimate.as_ref().map(|e| crate::memory_estimate::gib(e.total())),
        tensor_parallel,
        ranks,
        dtype,
        batch_size: b,
        seq_len: s,
        anchors_per_seq: sh.anchors_per_seq,
        drafter: drafter_name,
        drafter_flop_exact: exact,
        ceiling_tflop_per_s: ceiling,
        built_mem_gib,
        pipeline_target_tok_per_s: target_tokens / pipeline_s,
        pipeline_efficiency: (features_s + drafter_s) / pipeline_s,
        fused_loss_error,
        target_features,
        target_full,
        target_full_flop_split,
        drafter_step,
        pipeline,
    }))
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
