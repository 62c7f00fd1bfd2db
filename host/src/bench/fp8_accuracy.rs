//! `bench fp8 --accuracy --config RUN.toml`: how far `[target] compute = "fp8"` moves what the
//! drafter learns from. The run's target runs twice over the first sequences of its data (the
//! conversations rendered with the target's chat template, as training sees them): with
//! `compute = "bf16"` (the checkpoint in the run's dtype, a quantised one dequantised on load: the
//! reference) and with `compute = "fp8"`. For every layer of the target it reports the relative
//! error ||fp8 - bf16|| / ||bf16|| of the features over the sequences' tokens, and the same for
//! the logits with how often their top-1 tokens agree.
//!
//! With `--shape BENCH.toml` the measured target is that bench config's (random weights at a real
//! shape, drawn from the same seed both times, so both loads hold the same weights) fed the run
//! config's token ids; random weights lack the outlier channels real checkpoints have, which are
//! what FP8's per-block scales struggle with, so they flatter FP8.
//!
//! One target is loaded at a time: the reference's outputs wait on the host.

use super::train::{plugin_name, section};
use crate::{
    config::{Override, RunConfig},
    plugins::{handles::TargetHandle, Registry},
};
use anyhow::{anyhow, bail, Context, Result};
use plugin_api::{
    abi_stable::std_types::RSome,
    tch::{self, Device, Kind, Tensor},
    HostContext, PluginInstance, PluginKind, TensorHandle,
};
use serde::Serialize;
use std::path::Path;

#[derive(Debug, Serialize)]
pub struct Report {
    pub device: String,
    /// The measured target (its path) and where its token ids came from.
    pub target: String,
    pub tokens_from: String,
    pub sequences: usize,
    pub tokens: usize,
    /// Relative error of each layer's features (layer id, error), every layer of the target.
    pub layers: Vec<(u32, f64)>,
    pub logits: f64,
    /// The share of tokens whose top-1 logit is the same token in both.
    pub top1_agreement: f64,
}

/// One batch of the data as the target sees it: ids [B, S] and a mask of the real tokens.
struct Batch {
    ids: Tensor,
    mask: Tensor,
}

/// What the reference forward gave for one batch, on the host.
struct Outputs {
    features: Tensor,
    logits: Tensor,
}

pub fn accuracy(registry: &Registry, args: &super::fp8::Args) -> Result<Report> {
    compare(registry, args, "fp8")
}

/// The target with `compute` against itself with `compute = "bf16"`.
fn compare(registry: &Registry, args: &super::fp8::Args, compute: &str) -> Result<Report> {
    let config = args.config.as_deref().ok_or_else(|| anyhow!("--accuracy needs --config (a run config)"))?;
    let overrides = Override::from_args(&args.set, Some(&args.device))?;
    let cfg = RunConfig::load_with(config, &overrides)?;
    if cfg.device.starts_with("cuda") && !crate::environment::enable_cuda() {
        bail!("device `{}` asked for, but libtorch's CUDA libraries could not be loaded", cfg.device);
    }
    let cache = crate::environment::cache_dir();
    let config_dir = config.parent().unwrap_or(Path::new("."));
    let ctx = crate::plugins::host_context(&cfg.device, cfg.dtype(), cfg.seed, config_dir, &cache);
    let device = ctx.tch_device().map_err(|e| anyhow!("{e}"))?;
    // The measured target: the run's, or the bench config's at its shape (paths relative to it).
    let (target, target_ctx, seed) = match &args.shape {
        Some(shape) => {
            let text = std::fs::read_to_string(shape).with_context(|| format!("reading {}", shape.display()))?;
            let bench: super::train::BenchConfig =
                toml::from_str(&text).with_context(|| shape.display().to_string())?;
            let dir = shape.parent().unwrap_or(Path::new("."));
            let ctx = crate::plugins::host_context(&cfg.device, cfg.dtype(), bench.seed, dir, &cache);
            (bench.target, ctx, bench.seed)
        }
        None => (cfg.target.clone(), ctx.clone(), cfg.seed),
    };
    let load = |compute: &str, ctx: &HostContext| -> Result<TargetHandle> {
        let mut table = target.clone();
        table.insert("compute".into(), compute.into());
        // The same draws for both loads of a random target.
        tch::manual_seed(seed as i64);
        let PluginInstance::Target(t) = registry.create(PluginKind::Target, &section("target", &table)?, ctx)?.0 else {
            bail!("[target] made no target")
        };
        Ok(TargetHandle::new(t, &plugin_name(&table)))
    };
    let _no_grad = tch::no_grad_guard();
    let mut reference = load("bf16", &target_ctx)?;
    let spec = reference.spec()?;
    // The token ids: the run's data through the run's target's tokenizer and chat template (a
    // bench shape's random target has neither: the run's own target is loaded on the host for them).
    let host_target = match &args.shape {
        Some(_) => {
            let mut table = cfg.target.clone();
            table.remove("compute");
            let cpu = crate::plugins::host_context("cpu", "f32", cfg.seed, config_dir, &cache);
            let PluginInstance::Target(t) = registry.create(PluginKind::Target, &section("target", &table)?, &cpu)?.0
            else {
                bail!("[target] made no target")
            };
            Some(TargetHandle::new(t, &plugin_name(&table)))
        }
        None => None,
    };
    let tokens_from = host_target.as_ref().unwrap_or(&reference);
    let batches = read_batches(registry, &cfg, &ctx, tokens_from, args.records, spec.vocab_size as i64)?;
    let tokens_source = tokens_from.spec()?.source.to_string();
    drop(host_target);
    let layer_ids: Vec<u32> = (0..spec.num_hidden_layers).collect();
    let mut outputs = Vec::new();
    for b in &batches {
        let out = forward(&mut reference, b, &layer_ids, device)?;
        outputs.push(Outputs { features: out.0.to_device(Device::Cpu), logits: out.1.to_device(Device::Cpu) });
    }
    drop(reference);
    let mut fp8 = load(compute, &target_ctx)?;
    let hidden = spec.hidden_size as i64;
    let n = layer_ids.len();
    let (mut diff, mut norm) = (vec![0.0; n + 1], vec![0.0; n + 1]);
    let (mut agree, mut tokens) = (0.0, 0.0);
    for (b, want) in batches.iter().zip(&outputs) {
        let (features, logits) = forward(&mut fp8, b, &layer_ids, device)?;
        let mask = b.mask.to_device(device).to_kind(Kind::Bool);
        let valid = |t: &Tensor| t.to_kind(Kind::Float).index(&[Some(&mask)]);
        let (got, reference) = (valid(&features), valid(&want.features.to_device(device)));
        for (i, _) in layer_ids.iter().enumerate() {
            let (g, r) = (got.narrow(1, i as i64 * hidden, hidden), reference.narrow(1, i as i64 * hidden, hidden));
            diff[i] += f64::try_from((&g - &r).square().sum(Kind::Double))?;
            norm[i] += f64::try_from(r.square().sum(Kind::Double))?;
        }
        let (got, reference) = (valid(&logits), valid(&want.logits.to_device(device)));
        diff[n] += f64::try_from((&got - &reference).square().sum(Kind::Double))?;
        norm[n] += f64::try_from(reference.square().sum(Kind::Double))?;
        agree += f64::try_from(got.argmax(-1, false).eq_tensor(&reference.argmax(-1, false)).sum(Kind::Double))?;
        tokens += got.size()[0] as f64;
    }
    let rel = |i: usize| (diff[i] / norm[i].max(f64::MIN_POSITIVE)).sqrt();
    Ok(Report {
        device: match device {
            Device::Cuda(i) => kernels::ffi::cuda_device_name(i).unwrap_or_else(|| cfg.device.clone()),
            _ => cfg.device.clone(),
        },
        target: spec.source.to_string(),
        tokens_from: tokens_source,
        sequences: batches.iter().map(|b| b.ids.size()[0] as usize).sum(),
        tokens: tokens as usize,
        layers: layer_ids.iter().enumerate().map(|(i, &l)| (l, rel(i))).collect(),
        logits: rel(n),
        top1_agreement: agree / tokens.max(1.0),
    })
}

/// Every layer's features [B, S, L*H] and the logits [B, S, V] of one batch.
fn forward(target: &mut TargetHandle, b: &Batch, layer_ids: &[u32], device: Device) -> Result<(Tensor, Tensor)> {
    let out = target.forward(&TensorHandle::new(b.ids.to_device(device)), layer_ids, true)?;
    let logits = out.logits.into_option().ok_or_else(|| anyhow!("the target gave no logits"))?;
    Ok((out.hidden.into_tensor(), logits.into_tensor()))
}

/// The first `records` sequences of the run's data, tokenised by `tokens_from` (ids past the
/// measured target's vocabulary wrapped into it: only a bench shape's random target can have a
/// smaller one).
fn read_batches(
    registry: &Registry,
    cfg: &RunConfig,
    ctx: &HostContext,
    tokens_from: &TargetHandle,
    records: usize,
    vocab: i64,
) -> Result<Vec<Batch>> {
    let mut ctx = ctx.clone();
    ctx.target = RSome(tokens_from.spec()?);
    let PluginInstance::DataLoader(data) = registry.create(PluginKind::DataLoader, &cfg.section("data"), &ctx)?.0
    else {
        bail!("[data] made no data loader")
    };
    let mut data = crate::plugins::handles::DataHandle::new(data, &cfg.section("data").plugin);
    data.open(&tokens_from.tokenizer_json()?)?;
    if !data.distill_request()?.prompts.is_empty() {
        bail!("[data] asks for self-distilled replies: measure on the data as it is (`--set data.distill=false`)");
    }
    let (mut batches, mut seen) = (Vec::new(), 0);
    while seen < records.max(1) {
        let Some(b) = data.next_batch()? else { break };
        let ids = b.input_ids.into_tensor().remainder(vocab);
        let lengths: Vec<i64> = b.lengths.iter().map(|&l| l as i64).collect();
        let take = (records - seen).min(lengths.len()).max(1) as i64;
        let width = ids.size()[1];
        let mask = Tensor::arange(width, (Kind::Int64, Device::Cpu))
            .unsqueeze(0)
            .lt_tensor(&Tensor::from_slice(&lengths).unsqueeze(1));
        batches.push(Batch { ids: ids.narrow(0, 0, take), mask: mask.narrow(0, 0, take) });
        seen += take as usize;
    }
    if batches.is_empty() {
        bail!("[data] gave no sequences");
    }
    Ok(batches)
}

pub fn print(r: &Report) {
    crate::say!(
        "FP8 compute against bf16 on {}: {} ({} sequences, {} tokens of {})",
        r.device,
        r.target,
        r.sequences,
        r.tokens,
        r.tokens_from
    );
    let errors: Vec<f64> = r.layers.iter().map(|l| l.1).collect();
    for (layer, e) in &r.layers {
        crate::say!("  layer {layer:>3}: relative error {e:.4}");
    }
    let (lo, hi) = errors.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &e| (lo.min(e), hi.max(e)));
    let mean = errors.iter().sum::<f64>() / errors.len().max(1) as f64;
    crate::say!(
        "  features: {lo:.4} to {hi:.4} a layer (mean {mean:.4}); logits {:.4}; top-1 agreement {:.2}%",
        r.logits,
        100.0 * r.top1_agreement
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: super::super::fp8::Args,
    }

    fn args(shape: Option<&str>) -> super::super::fp8::Args {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let config = root.join("configs/smollm2-chitchat.toml");
        let mut argv =
            vec!["x", "--accuracy", "--config", config.to_str().unwrap(), "--records", "2", "--device", "cpu"];
        argv.extend(["--set", "data.distill=false", "--set", "dtype=\"f32\""]);
        let shape = shape.map(|s| root.join(s));
        if let Some(shape) = &shape {
            argv.extend(["--shape", shape.to_str().unwrap()]);
        }
        Cli::parse_from(argv).args
    }

    /// The comparison itself, where the CPU can run it: the run's target (SmolLM2 from its GGUF)
    /// against itself is exact at every layer and agrees on every top-1 token, over the chitchat
    /// conversations through its chat template.
    #[test]
    fn a_target_against_itself_is_exact_at_every_layer() {
        let r = compare(&Registry::new(&[]).unwrap(), &args(None), "bf16").unwrap();
        assert_eq!(r.sequences, 2);
        assert!(r.tokens > 2 * 20, "{} tokens", r.tokens);
        assert_eq!(r.layers.iter().map(|l| l.0).collect::<Vec<_>>(), (0..30).collect::<Vec<_>>());
        assert!(r.layers.iter().all(|l| l.1 == 0.0) && r.logits == 0.0, "{r:?}");
        assert_eq!(r.top1_agreement, 1.0);
        assert!(r.target.ends_with("SmolLM2-135M-Instruct.Q4_1.gguf"), "{}", r.target);
        // FP8 itself is refused on the CPU, naming the field.
        let err = accuracy(&Registry::new(&[]).unwrap(), &args(None)).unwrap_err().to_string();
        assert!(err.contains("compute") && err.contains("Hopper"), "{err}");
    }

    /// With `--shape`, the bench config's random target (configs/bench/tiny.toml: 4 layers,
    /// vocabulary 100) is measured on the run's token ids, wrapped into its vocabulary. Its two
    /// loads draw from torch's global generator, which the tests running beside this one share,
    /// so only the report's shape is checked here; the run above checks the arithmetic.
    #[test]
    fn a_bench_shape_is_measured_on_the_runs_token_ids() {
        let r = compare(&Registry::new(&[]).unwrap(), &args(Some("configs/bench/tiny.toml")), "bf16").unwrap();
        assert_eq!(r.layers.iter().map(|l| l.0).collect::<Vec<_>>(), [0, 1, 2, 3]);
        assert!(r.tokens > 2 * 20 && r.layers.iter().all(|l| l.1.is_finite()), "{r:?}");
        assert!(r.tokens_from.ends_with("SmolLM2-135M-Instruct.Q4_1.gguf"), "{}", r.tokens_from);
        assert!(r.target.ends_with("tiny-config.json"), "{}", r.target);
    }
}
