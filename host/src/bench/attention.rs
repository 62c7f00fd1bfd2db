//! `bench attention`: one layer's DFlash block attention at real shapes, masked SDPA (what the
//! drafter runs by default) next to split attention (`kernels::block_attention`), over the whole
//! context and in runs of blocks that score only the keys they see: first checked against an fp32
//! masked-SDPA reference (forward and the three gradients), then timed in bf16, forward and
//! forward + backward, in the same process.

use anyhow::Result;
use kernels::block_attention;
use serde::Serialize;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

#[derive(Debug, Clone, clap::Args)]
pub struct Shape {
    #[arg(long, default_value_t = 4)]
    pub batch: i64,
    #[arg(long, default_value_t = 32)]
    pub heads: i64,
    #[arg(long, default_value_t = 8)]
    pub kv_heads: i64,
    #[arg(long, default_value_t = 128)]
    pub head_dim: i64,
    /// Context tokens a sequence.
    #[arg(long, default_value_t = 3072)]
    pub context: i64,
    #[arg(long, default_value_t = 512)]
    pub anchors: i64,
    #[arg(long, default_value_t = 16)]
    pub block: i64,
    /// Timed repetitions (after two warm-up runs).
    #[arg(long, default_value_t = 10)]
    pub iters: usize,
    /// `cuda:N` (default cuda:0) or `cpu` (small shapes only).
    #[arg(long, default_value = "cuda:0")]
    pub device: String,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub shape: String,
    /// Max |x - ref| / max |ref| against the fp32 masked-SDPA reference, for out, dq, dk, dv
    /// (on the first sequence).
    pub error_split_f32: [f64; 4],
    pub error_split_bf16: [f64; 4],
    /// Split attention in the drafter's runs of blocks (`CONTEXT_RANGES`), bf16: with the fused
    /// block part (`kernels::block_part`, where it applies) and with the composite.
    pub error_ranged_bf16: [f64; 4],
    pub error_ranged_composite_bf16: [f64; 4],
    pub error_masked_bf16: [f64; 4],
    /// Milliseconds, bf16.
    pub masked_fwd_ms: f64,
    pub masked_fwd_bwd_ms: f64,
    pub split_fwd_ms: f64,
    pub split_fwd_bwd_ms: f64,
    /// Split attention in runs of blocks: (runs asked for, runs made, forward ms, forward +
    /// backward ms), with the fused block part where it applies.
    pub ranged: Vec<(usize, usize, f64, f64)>,
    /// The drafter's runs with the composite block part: forward ms, forward + backward ms.
    pub ranged_composite_ms: (f64, f64),
    /// The drafter's runs, fused block part, each run's keys all under the bias (no unbiased
    /// prefix): forward ms, forward + backward ms.
    pub ranged_biased_whole_ms: (f64, f64),
    /// Forward + backward FLOPs of the keys each query needs (context before its anchor + its
    /// block), and the useful TFLOP/s of each.
    pub useful_tflop: f64,
    pub masked_tflops: f64,
    pub split_tflops: f64,
}

struct Problem {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    anchors: Tensor,
    d_out: Tensor,
    scale: f64,
}

impl Problem {
    fn new(sh: &Shape, device: Device) -> Self {
        tch::manual_seed(0);
        let n = sh.anchors * sh.block;
        let opts = (Kind::Float, device);
        // Anchors spread over the sequence (sorted, distinct), one at 0 (no context).
        let anchors = Tensor::randperm(sh.context - 1, (Kind::Int64, device))
            .narrow(0, 0, sh.anchors)
            .sort(0, false)
            .0
            .unsqueeze(0)
            .repeat([sh.batch, 1]);
        let _ = anchors.get(0).get(0).fill_(0);
        Self {
            q: Tensor::randn([sh.batch, sh.heads, n, sh.head_dim], opts),
            k: Tensor::randn([sh.batch, sh.kv_heads, sh.context + n, sh.head_dim], opts),
            v: Tensor::randn([sh.batch, sh.kv_heads, sh.context + n, sh.head_dim], opts),
            anchors,
            d_out: Tensor::randn([sh.batch, sh.heads, n, sh.head_dim], opts),
            scale: (sh.head_dim as f64).powf(-0.5),
        }
    }

    fn inputs(&self, kind: Kind, grad: bool) -> (Tensor, Tensor, Tensor) {
        let f = |t: &Tensor| t.to_kind(kind).detach().set_requires_grad(grad);
        (f(&self.q), f(&self.k), f(&self.v))
    }

    /// Masked SDPA through autograd, as the drafter calls it: (out, dq, dk, dv).
    fn masked(&self, sh: &Shape, kind: Kind, backward: bool) -> Vec<Tensor> {
        let (q, k, v) = self.inputs(kind, backward);
        let mask = block_attention::masked_sdpa_mask(&self.anchors, sh.context, sh.block, None);
        let out = Tensor::scaled_dot_product_attention(&q, &k, &v, Some(&mask), 0.0, false, Some(self.scale), true);
        if !backward {
            return vec![out];
        }
        (&out * self.d_out.to_kind(kind)).sum(Kind::Float).backward();
        vec![out, q.grad(), k.grad(), v.grad()]
    }

    /// The context mask over the whole context (`ranges` = 1) or in up to `ranges` runs.
    fn mask(&self, sh: &Shape, kind: Kind, ranges: usize) -> block_attention::ContextMask {
        self.mask_with(sh, kind, ranges, true)
    }

    /// `prefix` false: every run's keys under the bias (no unbiased prefix split off).
    fn mask_with(&self, sh: &Shape, kind: Kind, ranges: usize, prefix: bool) -> block_attention::ContextMask {
        let mut mask = match ranges {
            1 => block_attention::ContextMask::whole(&self.anchors, sh.context, sh.block, kind, None),
            r => block_attention::ContextMask::ranged(
                &self.anchors,
                &self.anchors.to_device(Device::Cpu),
                sh.context,
                sh.block,
                kind,
                r,
                None,
            ),
        };
        if !prefix {
            mask.ranges.iter_mut().for_each(|r| r.prefix = r.first_key);
        }
        mask
    }

    /// `fused`: the fused block part where it applies, or the composite.
    fn split(&self, sh: &Shape, kind: Kind, backward: bool, ranges: usize, fused: bool) -> Vec<Tensor> {
        self.split_with(sh, kind, backward, ranges, fused, true)
    }

    fn split_with(
        &self,
        sh: &Shape,
        kind: Kind,
        backward: bool,
        ranges: usize,
        fused: bool,
        prefix: bool,
    ) -> Vec<Tensor> {
        let run = || {
            let (q, k, v) = self.inputs(kind, false);
            let mask = self.mask_with(sh, kind, ranges, prefix);
            let (out, saved) = block_attention::forward(&q, &k, &v, &mask, sh.block, self.scale);
            if !backward {
                return vec![out];
            }
            let (dq, dk, dv) = block_attention::backward(&saved, &self.d_out.to_kind(kind));
            vec![out, dq, dk, dv]
        };
        kernels::nvrtc::with_enabled(fused, || tch::no_grad(run))
    }
}

fn errors(got: &[Tensor], want: &[Tensor]) -> [f64; 4] {
    let mut e = [0.0; 4];
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let w = w.to_kind(Kind::Float);
        e[i] = (g.to_kind(Kind::Float) - &w).abs().max().double_value(&[]) / w.abs().max().double_value(&[]);
    }
    e
}

fn time(device: Device, iters: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..2 {
        f();
    }
    super::train::sync(device);
    let t = Instant::now();
    for _ in 0..iters {
        f();
    }
    super::train::sync(device);
    t.elapsed().as_secs_f64() * 1e3 / iters as f64
}

pub fn attention(sh: &Shape) -> Result<Report> {
    let device = crate::config::parse_device(&sh.device)?;
    if device != Device::Cpu && !crate::environment::enable_cuda() {
        anyhow::bail!("device `{}` asked for, but libtorch's CUDA libraries could not be loaded", sh.device);
    }
    // Checked on one sequence: the fp32 reference's mask alone is 12 GB a sequence.
    let low = if device == Device::Cpu { Kind::Float } else { Kind::BFloat16 };
    let one = Shape { batch: 1, ..sh.clone() };
    let runs = kernels::block_attention::CONTEXT_RANGES;
    let (error_split_f32, error_split_bf16, error_ranged_bf16, error_ranged_composite_bf16, error_masked_bf16) = {
        let p = Problem::new(&one, device);
        let reference = p.masked(&one, Kind::Float, true);
        (
            errors(&p.split(&one, Kind::Float, true, 1, false), &reference),
            errors(&p.split(&one, low, true, 1, false), &reference),
            errors(&p.split(&one, low, true, runs, true), &reference),
            errors(&p.split(&one, low, true, runs, false), &reference),
            errors(&p.masked(&one, low, true), &reference),
        )
    };
    let p = Problem::new(sh, device);

    let it = sh.iters;
    let masked_fwd_ms = time(device, it, || drop(tch::no_grad(|| p.masked(sh, low, false))));
    let masked_fwd_bwd_ms = time(device, it, || drop(p.masked(sh, low, true)));
    let split_fwd_ms = time(device, it, || drop(p.split(sh, low, false, 1, false)));
    let split_fwd_bwd_ms = time(device, it, || drop(p.split(sh, low, true, 1, false)));
    let ranged_composite_ms = (
        time(device, it, || drop(p.split(sh, low, false, runs, false))),
        time(device, it, || drop(p.split(sh, low, true, runs, false))),
    );
    let ranged_biased_whole_ms = (
        time(device, it, || drop(p.split_with(sh, low, false, runs, true, false))),
        time(device, it, || drop(p.split_with(sh, low, true, runs, true, false))),
    );
    let ranged = [1, 2, 4, 8, 16]
        .into_iter()
        .map(|r| {
            let made = p.mask(sh, low, r).ranges.len();
            let fwd = time(device, it, || drop(p.split(sh, low, false, r, true)));
            (r, made, fwd, time(device, it, || drop(p.split(sh, low, true, r, true))))
        })
        .collect();

    // Keys a query needs: its anchor's context + its block; 4 FLOPs per (query, key, dim) forward
    // (QK^T and PV), 2.5x that for forward + backward.
    let visible = f64::try_from(p.anchors.to_kind(Kind::Double).sum(Kind::Double))? * sh.block as f64
        + (sh.batch * sh.anchors * sh.block * sh.block) as f64;
    let useful_tflop = 4.0 * 3.5 * visible * (sh.heads * sh.head_dim) as f64 / 1e12;
    Ok(Report {
        shape: format!(
            "batch {} heads {}/{} dim {} context {} anchors {} block {} ({:?})",
            sh.batch, sh.heads, sh.kv_heads, sh.head_dim, sh.context, sh.anchors, sh.block, low
        ),
        error_split_f32,
        error_split_bf16,
        error_ranged_bf16,
        error_ranged_composite_bf16,
        error_masked_bf16,
        masked_fwd_ms,
        masked_fwd_bwd_ms,
        split_fwd_ms,
        split_fwd_bwd_ms,
        ranged,
        ranged_composite_ms,
        ranged_biased_whole_ms,
        useful_tflop,
        masked_tflops: useful_tflop / masked_fwd_bwd_ms * 1e3,
        split_tflops: useful_tflop / split_fwd_bwd_ms * 1e3,
    })
}

pub fn print(r: &Report) {
    crate::say!("block attention, one layer: {}", r.shape);
    let e = |x: &[f64; 4]| format!("out {:.1e}  dq {:.1e}  dk {:.1e}  dv {:.1e}", x[0], x[1], x[2], x[3]);
    crate::say!("  error vs fp32 masked SDPA: split fp32 {}", e(&r.error_split_f32));
    crate::say!("                             split low  {}", e(&r.error_split_bf16));
    crate::say!("                             ranged low {} (fused block part)", e(&r.error_ranged_bf16));
    crate::say!("                             ranged low {} (composite)", e(&r.error_ranged_composite_bf16));
    crate::say!("                             masked low {}", e(&r.error_masked_bf16));
    crate::say!(
        "  masked SDPA: forward {:.2} ms, forward + backward {:.2} ms ({:.1} useful TFLOP/s)",
        r.masked_fwd_ms,
        r.masked_fwd_bwd_ms,
        r.masked_tflops
    );
    crate::say!("  split, whole context, composite block part: forward {:.2} ms, forward + backward {:.2} ms ({:.1} useful TFLOP/s)", r.split_fwd_ms, r.split_fwd_bwd_ms, r.split_tflops);
    let (cf, cfb) = r.ranged_composite_ms;
    crate::say!(
        "  split, the drafter's runs, composite block part: forward {cf:.2} ms, forward + backward {cfb:.2} ms"
    );
    let (bf, bfb) = r.ranged_biased_whole_ms;
    crate::say!("  split, the drafter's runs, no unbiased prefix: forward {bf:.2} ms, forward + backward {bfb:.2} ms");
    for &(asked, made, fwd, fwd_bwd) in &r.ranged {
        let tflops = r.useful_tflop / fwd_bwd * 1e3;
        crate::say!("  split, fused block part, {asked:>2} runs ({made:>2} made): forward {fwd:.2} ms, forward + backward {fwd_bwd:.2} ms ({tflops:.1} useful TFLOP/s)");
    }
    crate::say!(
        "  split vs masked: forward {:.2}x, forward + backward {:.2}x",
        r.masked_fwd_ms / r.split_fwd_ms,
        r.masked_fwd_bwd_ms / r.split_fwd_bwd_ms
    );
}
