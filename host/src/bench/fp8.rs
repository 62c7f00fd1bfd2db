//! `bench fp8`: the targets' linear layers as FP8 block-scaled GEMMs (`kernels::fp8`: weights e4m3
//! in 128x128 blocks, activations quantised per token per 128 channels, libtorch's block-scaled
//! `_scaled_mm`) beside the bf16 GEMM they replace, at the linear shapes of Qwen3-8B and
//! Qwen3.6-27B (configs/bench/), each shape timed both ways back to back in one process on one
//! GPU: bf16 `linear`, the FP8 GEMM alone on quantised activations, the activation quantiser
//! alone, and the whole FP8 layer (quantiser + GEMM); then each model's linear layers summed over
//! one forward (the layers it has of each kind).

use anyhow::{bail, Result};
use kernels::fp8::{self, Fp8Linear};
use serde::Serialize;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Tokens a GEMM (rows of the activations), comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [3072, 12288])]
    pub tokens: Vec<i64>,
    /// Timed samples a measurement (the median is kept), each the mean of 10 calls.
    #[arg(long, default_value_t = 7)]
    pub samples: usize,
    /// Only the shapes of this model (`qwen3-8b` or `qwen3.6-27b`).
    #[arg(long)]
    pub model: Option<String>,
    /// `cuda:N` (default cuda:0).
    #[arg(long, default_value = "cuda:0")]
    pub device: String,
    /// Accuracy instead of speed: `--config`'s target run over the first
    /// `--records` sequences of its data with `compute = "bf16"` then `"fp8"`, the relative error
    /// of every layer's features and of the logits, and the logits' top-1 agreement.
    #[arg(long, requires = "config")]
    pub accuracy: bool,
    /// The run config (TOML) whose target and data `--accuracy` measures.
    #[arg(long, requires = "accuracy")]
    pub config: Option<std::path::PathBuf>,
    /// With `--accuracy`: measure this bench config's target instead (random weights at its
    /// shape, e.g. configs/bench/qwen3-8b.toml), on the run config's token ids.
    #[arg(long, requires = "accuracy")]
    pub shape: Option<std::path::PathBuf>,
    /// With `--accuracy`: the sequences measured.
    #[arg(long, default_value_t = 16)]
    pub records: usize,
    /// With `--accuracy`: set a field of the run config, as `train --set` does (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE", requires = "accuracy")]
    pub set: Vec<String>,
}

/// One linear layer kind of a model: (name, out features, in features, layers that have it).
type Linear = (&'static str, i64, i64, i64);

/// The fused linear layers the target plugin runs, from configs/bench/qwen3-8b-config.json and
/// qwen3.6-27b-config.json: Qwen3-8B (36 layers; 32 / 8 heads of 128) and Qwen3.6-27B (48 Gated
/// DeltaNet layers: q|k|v|z of 16 / 48 heads of 128, and 16 gated attention layers: q|gate|k|v
/// of 24 / 4 heads of 256; every layer an MLP).
const MODELS: [(&str, &[Linear]); 2] = [
    (
        "qwen3-8b",
        &[
            ("attn qkv", 6144, 4096, 36),
            ("attn o", 4096, 4096, 36),
            ("mlp gate_up", 24576, 4096, 36),
            ("mlp down", 4096, 12288, 36),
        ],
    ),
    (
        "qwen3.6-27b",
        &[
            ("attn q|gate|k|v", 14336, 5120, 16),
            ("attn o", 5120, 6144, 16),
            ("gdn in_proj q|k|v|z", 16384, 5120, 48),
            ("gdn out", 5120, 6144, 48),
            ("mlp gate_up", 34816, 5120, 64),
            ("mlp down", 5120, 17408, 64),
        ],
    ),
];

#[derive(Debug, Serialize)]
pub struct Row {
    pub model: String,
    pub layer: String,
    pub tokens: i64,
    pub out_features: i64,
    pub in_features: i64,
    /// Layers of this kind in one forward of the model.
    pub layers: i64,
    /// Milliseconds a call.
    pub bf16_ms: f64,
    pub fp8_gemm_ms: f64,
    pub quantize_ms: f64,
    pub fp8_ms: f64,
    pub bf16_tflops: f64,
    pub fp8_gemm_tflops: f64,
    pub fp8_tflops: f64,
    /// Relative error (Frobenius) of the FP8 layer's output against the bf16 one's.
    pub fp8_error: f64,
}

#[derive(Debug, Serialize)]
pub struct Total {
    pub model: String,
    pub tokens: i64,
    /// The model's linear layers over one forward, milliseconds.
    pub bf16_ms: f64,
    pub fp8_ms: f64,
    pub fp8_gemm_ms: f64,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub device: String,
    pub rows: Vec<Row>,
    pub totals: Vec<Total>,
}

/// Median over `samples` of the mean milliseconds of 10 calls of `f` (its result dropped at once),
/// after 3 untimed calls; the device synchronised around each sample.
fn time<T>(device: Device, samples: usize, mut f: impl FnMut() -> Result<T>) -> Result<f64> {
    const CALLS: usize = 10;
    for _ in 0..3 {
        f()?;
    }
    let mut ms = Vec::with_capacity(samples);
    for _ in 0..samples.max(1) {
        super::train::sync(device);
        let t = Instant::now();
        for _ in 0..CALLS {
            f()?;
        }
        super::train::sync(device);
        ms.push(t.elapsed().as_secs_f64() * 1e3 / CALLS as f64);
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms[ms.len() / 2])
}

fn rel(a: &Tensor, b: &Tensor) -> Result<f64> {
    let (a, b) = (a.to_kind(Kind::Float), b.to_kind(Kind::Float));
    Ok(f64::try_from((&a - &b).norm())? / f64::try_from(b.norm())?)
}

pub fn fp8(args: &Args) -> Result<Report> {
    let device = crate::config::parse_device(&args.device)?;
    let Device::Cuda(ordinal) = device else { bail!("bench fp8 needs a CUDA device (asked for `{}`)", args.device) };
    if !crate::environment::enable_cuda() || !tch::Cuda::is_available() {
        bail!("bench fp8: libtorch sees no CUDA device (asked for `{}`)", args.device);
    }
    if !fp8::gemm_supported(device) {
        bail!("{}: libtorch runs block-scaled FP8 GEMMs on compute capability 9.x (Hopper) only", args.device);
    }
    let models: Vec<_> = MODELS.iter().filter(|(name, _)| args.model.as_deref().is_none_or(|m| m == *name)).collect();
    if models.is_empty() {
        bail!("--model: `{}` is none of qwen3-8b, qwen3.6-27b", args.model.as_deref().unwrap_or(""));
    }
    let _no_grad = tch::no_grad_guard();
    let mut rows = Vec::new();
    for (model, linears) in models {
        for &(layer, n, k, layers) in linears.iter() {
            tch::manual_seed(n * k);
            let w = Tensor::randn([n, k], (Kind::BFloat16, device)) * 0.02;
            let fp8_layer = Fp8Linear::quantize(&w, None)?;
            for &m in &args.tokens {
                let x = Tensor::randn([m, k], (Kind::BFloat16, device));
                let (q, s) = fp8::fp8_quantize_act(&x)?;
                let gemm = || -> Result<Tensor> {
                    let out = q.f_internal_scaled_mm(
                        &fp8_layer.weight.tr(),
                        &s,
                        &fp8_layer.scale_inv.tr(),
                        None::<&Tensor>,
                        None::<&Tensor>,
                        Kind::BFloat16,
                        false,
                    )?;
                    Ok(out)
                };
                let fp8_error = rel(&fp8_layer.forward(&x)?, &x.linear::<&Tensor>(&w, None))?;
                let bf16_ms = time(device, args.samples, || Ok(x.f_linear::<&Tensor>(&w, None)?))?;
                let fp8_gemm_ms = time(device, args.samples, gemm)?;
                let quantize_ms = time(device, args.samples, || Ok(fp8::fp8_quantize_act(&x)?))?;
                let fp8_ms = time(device, args.samples, || Ok(fp8_layer.forward(&x)?))?;
                let tflop = 2.0 * (m * n * k) as f64 / 1e12;
                let row = Row {
                    model: model.to_string(),
                    layer: layer.to_string(),
                    tokens: m,
                    out_features: n,
                    in_features: k,
                    layers,
                    bf16_ms,
                    fp8_gemm_ms,
                    quantize_ms,
                    fp8_ms,
                    bf16_tflops: tflop / bf16_ms * 1e3,
                    fp8_gemm_tflops: tflop / fp8_gemm_ms * 1e3,
                    fp8_tflops: tflop / fp8_ms * 1e3,
                    fp8_error,
                };
                print_row(&row);
                rows.push(row);
            }
        }
    }
    let mut totals = Vec::new();
    for (model, _) in MODELS.iter() {
        for &m in &args.tokens {
            let of = |f: fn(&Row) -> f64| {
                rows.iter().filter(|r| r.model == *model && r.tokens == m).map(|r| f(r) * r.layers as f64).sum::<f64>()
            };
            if rows.iter().any(|r| r.model == *model && r.tokens == m) {
                totals.push(Total {
                    model: model.to_string(),
                    tokens: m,
                    bf16_ms: of(|r| r.bf16_ms),
                    fp8_ms: of(|r| r.fp8_ms),
                    fp8_gemm_ms: of(|r| r.fp8_gemm_ms),
                });
            }
        }
    }
    let name = kernels::ffi::cuda_device_name(ordinal).unwrap_or_else(|| args.device.clone());
    Ok(Report { device: name, rows, totals })
}

fn print_row(r: &Row) {
    crate::say!(
        "{:<12} {:<20} M {:>6} N {:>6} K {:>6} | bf16 {:>5.0} | fp8 gemm {:>5.0} ({:.2}x) | fp8 layer {:>5.0} ({:.2}x) | quantise {:>7.3} ms | error {:.1e}",
        r.model,
        r.layer,
        r.tokens,
        r.out_features,
        r.in_features,
        r.bf16_tflops,
        r.fp8_gemm_tflops,
        r.bf16_ms / r.fp8_gemm_ms,
        r.fp8_tflops,
        r.bf16_ms / r.fp8_ms,
        r.quantize_ms,
        r.fp8_error
    );
}

pub fn print(r: &Report) {
    crate::say!("FP8 block-scaled linear layers on {} (TFLOP/s; ratio = bf16 time / FP8 time)", r.device);
    for t in &r.totals {
        crate::say!(
            "  {} at {} tokens, the linear layers of one forward: bf16 {:.1} ms, FP8 {:.1} ms ({:.2}x; the GEMMs alone {:.1} ms, {:.2}x)",
            t.model,
            t.tokens,
            t.bf16_ms,
            t.fp8_ms,
            t.bf16_ms / t.fp8_ms,
            t.fp8_gemm_ms,
            t.bf16_ms / t.fp8_gemm_ms
        );
    }
}
