//! Qwen3.5's Gated DeltaNet layer (`model.layers.{i}.linear_attn`, transformers'
//! `Qwen3_5GatedDeltaNet`), the token mixer of three layers in four of Qwen3.5 / Qwen3.6. The
//! recurrence and the conv are the `gated_deltanet` crate's (shared with the GDN drafter).
//!
//! Weights: `in_proj_qkv` [2*nk*dk + nv*dv, H] (q | k | v), `in_proj_z` [nv*dv, H] (output gate),
//! `in_proj_b`, `in_proj_a` [nv, H] (write strength, decay), `conv1d.weight` [C, 1, K] (depthwise,
//! no bias), `A_log`, `dt_bias` [nv], `norm.weight` [dv] (gated RMSNorm, plain gain), `out_proj`
//! [H, nv*dv].
//!
//! Per token: q|k|v = silu(causal_conv(in_proj_qkv x)); q, k L2-normalised and repeated to the
//! value heads; g = -exp(A_log) softplus(a + dt_bias); beta = sigmoid(b); the gated delta rule
//! (q scaled by dk^-0.5); out = out_proj(rmsnorm(o) * w * silu(z)) per value head.

use crate::{
    cache::{conv_tail, LinearState, Undo},
    common::none,
    config::DecoderConfig,
    linear::Linear,
    tp::rows,
    weights::Loader,
};
use gated_deltanet::{chunked_from_conv, chunked_with, conv_silu, fused::Heads, gated_rms_norm, l2norm, Precision};
use plugin_api::tch::{Kind, Tensor};
use std::ops::Range;

/// Steps per chunk of the chunked delta rule (transformers' and FLA's 64).
pub const CHUNK: i64 = 64;

pub struct GatedDeltaNet {
    /// in_proj_qkv | in_proj_z | in_proj_b | in_proj_a in one matrix: one GEMM for all four.
    in_proj: Linear,
    /// [C, K], the model's dtype.
    conv: Tensor,
    /// -exp(A_log) [nv], fp32.
    neg_a: Tensor,
    /// [nv], fp32.
    dt_bias: Tensor,
    /// [dv], fp32.
    norm: Tensor,
    out_proj: Linear,
    key_heads: i64,
    value_heads: i64,
    key_dim: i64,
    value_dim: i64,
    kernel: i64,
    eps: f64,
    /// The delta rule's matmul operands: bf16 (fp32 accumulation and state, as FLA's kernels)
    /// in a bf16 model, fp32 otherwise.
    precision: Precision,
}

impl GatedDeltaNet {
    pub(crate) fn load(cfg: &DecoderConfig, ld: &mut Loader, p: &str) -> Result<Self, String> {
        let s = cfg.linear();
        let h = cfg.hidden_size as i64;
        let (nk, nv, dk, dv) = (s.key_heads as i64, s.value_heads as i64, s.key_dim as i64, s.value_dim as i64);
        let c = s.conv_channels() as i64;
        let k = s.conv_kernel as i64;
        // This rank's value heads and the key heads they read (`tp.rs`): rows of q | k | v, of
        // the conv's channels, of z, b and a; columns of out_proj.
        let vh = ld.shard.split(nv, "the Gated DeltaNet value heads")?;
        let kh = ld.shard.kv_heads(nk, "the Gated DeltaNet key heads")?;
        let shift = |r: Range<i64>, by: i64| r.start + by..r.end + by;
        let channels = vec![rows(&kh, dk), shift(rows(&kh, dk), nk * dk), shift(rows(&vh, dv), 2 * nk * dk)];
        let parts = [
            ("in_proj_qkv", c, channels.clone()),
            ("in_proj_z", nv * dv, vec![rows(&vh, dv)]),
            ("in_proj_b", nv, vec![vh.clone()]),
            ("in_proj_a", nv, vec![vh.clone()]),
        ];
        let fused: Vec<_> = parts.into_iter().map(|(n, r, keep)| (format!("{p}.{n}.weight"), r, keep)).collect();
        let in_proj = ld.linear(&fused, h, none)?;
        let conv = ld.get_selected(&format!("{p}.conv1d.weight"), &[c, 1, k], &[channels])?.squeeze_dim(1);
        // transformers: `-self.A_log.float().exp()`.
        let neg_a = -ld.get_f32_selected(&format!("{p}.A_log"), &[nv], &[vec![vh.clone()]])?.exp();
        let out_proj =
            ld.linear_selected(&format!("{p}.out_proj.weight"), &[h, nv * dv], &[vec![], vec![rows(&vh, dv)]], none)?;
        let (nk, nv) = (kh.end - kh.start, vh.end - vh.start);
        Ok(Self {
            in_proj,
            conv,
            neg_a,
            dt_bias: ld.get_f32_selected(&format!("{p}.dt_bias"), &[s.value_heads as i64], &[vec![vh]])?,
            norm: ld.get_f32(&format!("{p}.norm.weight"), &[dv])?,
            out_proj,
            key_heads: nk,
            value_heads: nv,
            key_dim: dk,
            value_dim: dv,
            kernel: k,
            eps: cfg.rms_norm_eps,
            precision: if ld.kind == Kind::BFloat16 { Precision::Bf16 } else { Precision::F32 },
        })
    }

    fn conv_channels(&self) -> i64 {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }

    /// x [B, L, H] (input-normed) -> [B, L, H].
    /// - `valid` [B, L]: false rows (left padding) are zeroed first, as transformers does, so
    ///   they leave the conv history and the state at zero;
    /// - `state`: the layer's cache slot, continued and updated when given;
    /// - `keep_undo`: also keep what [`rewind`](Self::rewind) needs for this extension.
    pub fn forward(
        &self,
        x: &Tensor,
        valid: Option<&Tensor>,
        state: Option<&mut Option<LinearState>>,
        keep_undo: bool,
    ) -> Tensor {
        let b = x.size()[0];
        let (nv, dv) = (self.value_heads, self.value_dim);
        let c = self.conv_channels();
        let x = match valid {
            Some(v) => x * v.unsqueeze(-1).to_kind(x.kind()),
            None => x.shallow_clone(),
        };
        // 1. The four input projections in one GEMM: q|k|v (pre-conv), z, b, a.
        let proj = self.in_proj.forward(&x);
        let mixed = proj.narrow(2, 0, c);
        let z = proj.narrow(2, c, nv * dv);
        let b_in = proj.narrow(2, c + nv * dv, nv);
        let a_in = proj.narrow(2, c + nv * dv + nv, nv);
        // 2. Causal conv over q|k|v, after the cached rows (zeros at a sequence's start).
        let prev = state.as_ref().and_then(|s| s.as_ref());
        let history = match prev {
            Some(s) => s.conv.shallow_clone(),
            None => Tensor::zeros([b, self.kernel - 1, c], (x.kind(), x.device())),
        };
        let conv = conv_silu(&history, &mixed, &self.conv);
        // 3. Gates, fp32: [B, L, nv] -> [B, nv, L].
        let (g, beta) = self.gates(&a_in, &b_in);
        // 4. The delta rule from the cached state (zeros at the start), chunked.
        let initial = prev.map(|s| s.state.shallow_clone());
        let (o, last) = self.rule(&conv, &g, &beta, initial.as_ref());
        // 5. Gated RMSNorm per value head, norm(o) * w * silu(z), then out_proj.
        let out = gated_rms_norm(&o, &z, &self.norm, self.eps); // in z's dtype, the model's
        let out = self.out_proj.forward(&out);
        // 6. The cache: the last K-1 pre-conv rows, the final state (and the undo record).
        if let Some(slot) = state {
            let undo = keep_undo.then(|| Undo {
                conv: history.shallow_clone(),
                state: initial,
                mixed: mixed.shallow_clone(),
                g: g.shallow_clone(),
                beta: beta.shallow_clone(),
            });
            *slot = Some(LinearState { conv: conv_tail(&history, &mixed), state: last, undo });
        }
        out
    }

    /// The state as it was after the first `keep` positions of the last extension: conv rows
    /// from the kept pre-conv rows, the recurrent state recomputed over them from the state the
    /// extension started at.
    pub fn rewind(&self, s: &mut LinearState, keep: i64) {
        let u = s.undo.as_ref().expect("rewind needs the undo record of a rollback cache");
        let kept = u.mixed.narrow(1, 0, keep);
        s.conv = conv_tail(&u.conv, &kept);
        s.state = if keep == 0 {
            u.state.as_ref().map_or_else(|| s.state.zeros_like(), Tensor::shallow_clone)
        } else {
            // As the forward computes it (the fused kernel on a GPU), so a rewound state equals
            // the one a forward over the kept positions leaves.
            let conv = conv_silu(&u.conv, &kept, &self.conv);
            let (g, beta) = (u.g.narrow(2, 0, keep), u.beta.narrow(2, 0, keep));
            self.rule(&conv, &g, &beta, u.state.as_ref()).1
        };
    }

    /// The delta rule over the conv output `conv` [B, L, C] from `initial`: outputs fp32 [B, nv, L,
    /// dv] and the final state. In bf16 on a GPU, kernels straight from the conv output; else the
    /// heads laid out fp32 and the chunked composite.
    fn rule(&self, conv: &Tensor, g: &Tensor, beta: &Tensor, initial: Option<&Tensor>) -> (Tensor, Tensor) {
        if self.precision == Precision::Bf16 {
            let heads = Heads {
                key_heads: self.key_heads,
                value_heads: self.value_heads,
                key_dim: self.key_dim,
                value_dim: self.value_dim,
            };
            if let Some(out) = chunked_from_conv(conv, &heads, g, beta, initial) {
                return out;
            }
        }
        let (q, k, v) = self.heads(conv);
        chunked_with(&q, &k, &v, g, beta, initial, CHUNK, self.precision)
    }

    /// conv output [B, L, C] -> q, k [B, nv, L, dk] (L2-normalised, each key head repeated to its
    /// value heads) and v [B, nv, L, dv], fp32, head-first.
    fn heads(&self, qkv: &Tensor) -> (Tensor, Tensor, Tensor) {
        let (b, l) = (qkv.size()[0], qkv.size()[1]);
        let (nk, nv, dk, dv) = (self.key_heads, self.value_heads, self.key_dim, self.value_dim);
        let ck = nk * dk;
        let repeat = |t: Tensor| {
            // [B, L, nk, dk] -> [B, nk, r, L, dk] -> [B, nv, L, dk]: value head h reads key head h / r.
            let t = l2norm(&t).permute([0, 2, 1, 3]).unsqueeze(2);
            t.expand([b, nk, nv / nk, l, dk], false).reshape([b, nv, l, dk])
        };
        let q = repeat(qkv.narrow(2, 0, ck).reshape([b, l, nk, dk]));
        let k = repeat(qkv.narrow(2, ck, ck).reshape([b, l, nk, dk]));
        // v head-first in fp32 in one pass (the chunked rule wants it contiguous).
        let v = qkv.narrow(2, 2 * ck, nv * dv).reshape([b, l, nv, dv]).transpose(1, 2);
        let mut v32 = Tensor::empty([b, nv, l, dv], (Kind::Float, qkv.device()));
        v32.copy_(&v);
        (q, k, v32)
    }

    /// g = -exp(A_log) softplus(a + dt_bias) (log decay), beta = sigmoid(b): [B, nv, L] fp32.
    fn gates(&self, a: &Tensor, b: &Tensor) -> (Tensor, Tensor) {
        let g = (a.to_kind(Kind::Float) + &self.dt_bias).softplus() * &self.neg_a;
        let beta = b.to_kind(Kind::Float).sigmoid();
        (g.transpose(1, 2), beta.transpose(1, 2))
    }
}
