//! Softmax attention with grouped-query heads (`model.layers.{i}.self_attn`), in every family's
//! variant, and the scaled-dot-product core the latent attention shares:
//! - q|k|v in one GEMM, with biases where the family has them (Qwen2, gpt-oss, GLM-4.5), and
//!   Qwen3.5's sigmoid output gate projected with q (interleaved per head, [q_h | gate_h]);
//! - q/k RMSNorms per head (Qwen3 and successors, Gemma 3 with (1 + w), LFM2's `q_layernorm`);
//! - RoPE over the first `rotary_dim` dims of a head (partial: Qwen3.5, GLM-4.5);
//! - the scale (Gemma: 1/sqrt(query_pre_attn_scalar)), a sliding window (the mask's), Gemma 2's
//!   tanh soft cap on the scores, gpt-oss's per-head sinks (a logit in the softmax whose value
//!   is dropped), an output bias (gpt-oss).

use crate::{
    cache::StaticWrite,
    common::{causal_mask, rms_norm},
    config::DecoderConfig,
    linear::Linear,
    rope::apply_rope,
    tp::rows,
    weights::Loader,
};
use plugin_api::tch::{Kind, Tensor};

/// How scores become weights.
#[derive(Default)]
pub struct Scores {
    pub scale: f64,
    /// Scores -> cap tanh(scores / cap) before the mask (Gemma 2's `attn_logit_softcapping`).
    pub softcap: Option<f64>,
    /// Per-head sink logits [H] (gpt-oss), in the model's dtype.
    pub sinks: Option<Tensor>,
}

/// softmax(q k^T scale + mask) v over grouped heads: q [B, H, L, D], k [B, Hkv, T, D], v [B,
/// Hkv, T, Dv] -> [B, H, L, Dv]. `mask` [B or 1, 1, L, T] bool, true = visible; None = causal
/// (L = T).
///
/// Plain scores run libtorch's fused attention (`kernels::sdpa`). Sinks do too: a sink is one more key every query
/// sees, with value 0 and score s_h for head h, so q gains a dim holding s_h / scale and k the
/// dim 1 on the sink key and 0 elsewhere (grouped heads share keys, and the sink is per query
/// head: it has to ride on q); the extra dims are padded to a multiple of 8 with zeros, which
/// the fused kernels want. A soft cap is computed in the open (no fused kernel applies it).
pub fn attend(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>, s: &Scores) -> Tensor {
    let (b, h, l, d) = (q.size()[0], q.size()[1], q.size()[2], q.size()[3]);
    let t = k.size()[2];
    if let Some(cap) = s.softcap {
        return attend_in_the_open(q, k, v, mask, s.scale, cap, s.sinks.as_ref());
    }
    let Some(sinks) = &s.sinks else {
        let causal = mask.is_none() && l > 1;
        return kernels::sdpa::grouped(q, k, v, mask, causal, s.scale);
    };
    let (hkv, dv) = (k.size()[1], v.size()[3]);
    let extra = 8;
    let opts = (q.kind(), q.device());
    let sink_q = (sinks / s.scale).to_kind(q.kind()).view([1, h, 1, 1]).expand([b, h, l, 1], false);
    let q = Tensor::cat(&[q, &sink_q, &Tensor::zeros([b, h, l, extra - 1], opts)], 3);
    let k = Tensor::cat(&[k, &Tensor::zeros([b, hkv, t, extra], opts)], 3);
    let sink_k = Tensor::zeros([b, hkv, 1, d + extra], opts);
    let _ = sink_k.narrow(3, d, 1).fill_(1.0);
    let k = Tensor::cat(&[k, sink_k], 2);
    let v = Tensor::cat(&[v, &Tensor::zeros([b, hkv, 1, dv], opts)], 2);
    let visible = match mask {
        Some(m) => m.shallow_clone(),
        None => causal_mask(l, t, q.device()),
    };
    let sees_sink = Tensor::ones([visible.size()[0], 1, l, 1], (Kind::Bool, q.device()));
    let visible = Tensor::cat(&[visible.expand([-1, 1, l, t], false), sees_sink], 3);
    Tensor::scaled_dot_product_attention(&q, &k, &v, Some(&visible), 0.0, false, Some(s.scale), true)
}

/// transformers' eager attention with a soft cap: scores in the model's dtype, capped, masked,
/// softmax in fp32 (with the sink column where there are sinks, then dropped).
fn attend_in_the_open(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
    cap: f64,
    sinks: Option<&Tensor>,
) -> Tensor {
    let (b, h, l) = (q.size()[0], q.size()[1], q.size()[2]);
    let (hkv, t) = (k.size()[1], k.size()[2]);
    let repeat = |x: &Tensor| {
        let s = x.size();
        x.unsqueeze(2).expand([b, hkv, h / hkv, s[2], s[3]], false).reshape([b, h, s[2], s[3]])
    };
    let (k, v) = (repeat(k), repeat(v));
    let scores = (q.matmul(&k.transpose(2, 3)) * scale / cap).tanh() * cap;
    let visible = match mask {
        Some(m) => m.shallow_clone(),
        None => causal_mask(l, t, q.device()),
    };
    let mut scores = scores.masked_fill(&visible.logical_not(), f64::NEG_INFINITY).to_kind(Kind::Float);
    if let Some(s) = sinks {
        let column = s.to_kind(Kind::Float).view([1, h, 1, 1]).expand([b, h, l, 1], false);
        scores = Tensor::cat(&[scores, column], 3);
    }
    let weights = scores.softmax(-1, Kind::Float).narrow(3, 0, t).to_kind(q.kind());
    weights.matmul(&v)
}

pub struct Attention {
    qkv: Linear,
    o_proj: Linear,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    gated: bool,
    num_heads: i64,
    num_kv_heads: i64,
    head_dim: i64,
    scores: Scores,
}

impl Attention {
    /// This rank's heads (`ld.shard`, see `tp.rs`): q/k/v rows and o_proj columns by head.
    pub(crate) fn load(cfg: &DecoderConfig, ld: &mut Loader, p: &str) -> Result<Self, String> {
        let h = cfg.hidden_size as i64;
        let (nh, nkv, d) = (cfg.num_attention_heads as i64, cfg.num_kv_heads() as i64, cfg.head_dim() as i64);
        let heads = ld.shard.split(nh, "the attention heads")?;
        let kv = ld.shard.kv_heads(nkv, "the key/value heads")?;
        let gated = cfg.is_hybrid();
        // Qwen3.5's q_proj holds [q_h | gate_h] per head.
        let q_width = if gated { 2 * d } else { d };
        let names = [
            ("q_proj", nh * q_width, rows(&heads, q_width)),
            ("k_proj", nkv * d, rows(&kv, d)),
            ("v_proj", nkv * d, rows(&kv, d)),
        ];
        let weights = names.clone().map(|(n, r, keep)| (format!("{p}.{n}.weight"), r, vec![keep]));
        let qkv = ld.linear(&weights, h, |ld| {
            if !cfg.qkv_bias() {
                return Ok(None);
            }
            let b = names
                .iter()
                .map(|(n, r, keep)| ld.get_selected(&format!("{p}.{n}.bias"), &[*r], &[vec![keep.clone()]]))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Some(Tensor::cat(&b, 0)))
        })?;
        let (q_norm, k_norm) = if cfg.qk_norm() {
            let centred = cfg.centred_norms();
            let (qn, kn) = if cfg.arch() == crate::config::Arch::Lfm2 {
                ("q_layernorm", "k_layernorm")
            } else {
                ("q_norm", "k_norm")
            };
            (
                Some(ld.norm(&format!("{p}.{qn}.weight"), d, centred)?),
                Some(ld.norm(&format!("{p}.{kn}.weight"), d, centred)?),
            )
        } else {
            (None, None)
        };
        let o = if cfg.arch() == crate::config::Arch::Lfm2 { "out_proj" } else { "o_proj" };
        let o_proj =
            ld.linear_selected(&format!("{p}.{o}.weight"), &[h, nh * d], &[vec![], vec![rows(&heads, d)]], |ld| {
                if cfg.o_bias() {
                    ld.row_bias(&format!("{p}.{o}.bias"), h)
                } else {
                    Ok(None)
                }
            })?;
        let sinks = if cfg.arch() == crate::config::Arch::GptOss {
            Some(ld.get_selected(&format!("{p}.sinks"), &[nh], &[vec![heads.clone()]])?)
        } else {
            None
        };
        let (nh, nkv) = (heads.end - heads.start, kv.end - kv.start);
        let scores = Scores { scale: cfg.attention_scale(), softcap: cfg.attn_logit_softcapping, sinks };
        Ok(Self { qkv, o_proj, q_norm, k_norm, gated, num_heads: nh, num_kv_heads: nkv, head_dim: d, scores })
    }

    /// x [B, L, H] (normed) -> [B, L, H]; `mask` as [`attend`]'s (a sliding layer's with its
    /// window); `cache` extended in place (a static cache's at `write_at`, see [`append`]).
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
        cache: Option<&mut Option<(Tensor, Tensor)>>,
        write_at: Option<&StaticWrite>,
        eps: f64,
    ) -> Tensor {
        let (b, l) = (x.size()[0], x.size()[1]);
        let (nh, nkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        // 1. Project, split, (Qwen3.5) split q from its gate, normalise per head,
        //    (B, L, H, D) -> (B, H, L, D), rotate.
        let qkv = self.qkv.forward(x);
        let q_rows = if self.gated { 2 * nh * d } else { nh * d };
        let (mut q, gate) = if self.gated {
            let qg = qkv.narrow(2, 0, q_rows).view([b, l, nh, 2 * d]);
            (qg.narrow(3, 0, d), Some(qg.narrow(3, d, d)))
        } else {
            (qkv.narrow(2, 0, q_rows).view([b, l, nh, d]), None)
        };
        let mut k = qkv.narrow(2, q_rows, nkv * d).view([b, l, nkv, d]);
        let v = qkv.narrow(2, q_rows + nkv * d, nkv * d).view([b, l, nkv, d]);
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            q = rms_norm(&q, qn, eps);
            k = rms_norm(&k, kn, eps);
        }
        let q = apply_rope(&q.transpose(1, 2), cos, sin);
        let k = apply_rope(&k.transpose(1, 2), cos, sin);
        // 2. Append to the cache.
        let (k, v) = append(cache, k, v.transpose(1, 2), write_at);
        // 3. Attention (GQA by head groups), (B, H, L, D) -> (B, L, H*D), (Qwen3.5) times
        //    sigmoid(gate), o_proj.
        let o = attend(&q, &k, &v, mask, &self.scores).transpose(1, 2);
        let o = match gate {
            Some(g) => o * g.sigmoid(),
            None => o,
        };
        self.o_proj.forward(&o.reshape([b, l, nh * d]))
    }
}

/// Keys and values [B, Hkv, L, D] after the cached ones, the cache then holding all of them. A
/// static cache (`at`) holds buffers of `capacity` positions, made at its first write, written in
/// place at the new positions and returned whole: their addresses never change, which a CUDA
/// graph of the forward needs.
pub(crate) fn append(
    cache: Option<&mut Option<(Tensor, Tensor)>>,
    k: Tensor,
    v: Tensor,
    at: Option<&StaticWrite>,
) -> (Tensor, Tensor) {
    let Some(slot) = cache else { return (k, v) };
    if let Some(at) = at {
        let buffer = |x: &Tensor| {
            let s = x.size();
            Tensor::zeros([s[0], s[1], at.capacity, s[3]], (x.kind(), x.device()))
        };
        let (kb, vb) = slot.get_or_insert_with(|| (buffer(&k), buffer(&v)));
        let _ = kb.index_copy_(2, &at.positions, &k);
        let _ = vb.index_copy_(2, &at.positions, &v);
        return (kb.shallow_clone(), vb.shallow_clone());
    }
    let (k, v) = match slot.as_ref() {
        Some((pk, pv)) => (Tensor::cat(&[pk, &k], 2), Tensor::cat(&[pv, &v], 2)),
        None => (k, v),
    };
    *slot = Some((k.shallow_clone(), v.shallow_clone()));
    (k, v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use plugin_api::tch::Device;

    /// The sink riding on an extra dim of q equals the softmax with a sink column written out,
    /// for grouped heads, with a mask and causally; a soft cap is tanh on the scaled scores.
    #[test]
    fn sinks_and_soft_caps_are_the_written_out_softmax() {
        plugin_api::tch::manual_seed(4);
        let r = |s: &[i64]| Tensor::randn(s, (Kind::Float, Device::Cpu));
        let (q, k, v) = (r(&[2, 4, 5, 8]), r(&[2, 2, 5, 8]), r(&[2, 2, 5, 6]));
        let sinks = r(&[4]) * 2.0;
        let scale = 0.3;
        let reference = |mask: &Tensor, cap: Option<f64>, sinks: Option<&Tensor>| {
            let rep = |x: &Tensor| x.repeat_interleave_self_int(2, 1, None);
            let mut s = q.matmul(&rep(&k).transpose(2, 3)) * scale;
            if let Some(c) = cap {
                s = (s / c).tanh() * c;
            }
            let s = s.masked_fill(&mask.logical_not(), f64::NEG_INFINITY);
            let s = match sinks {
                Some(z) => Tensor::cat(&[s, z.view([1, 4, 1, 1]).expand([2, 4, 5, 1], false)], 3),
                None => s,
            };
            s.softmax(-1, Kind::Float).narrow(3, 0, 5).matmul(&rep(&v))
        };
        let causal = causal_mask(5, 5, Device::Cpu);
        let padded = causal.logical_and(&Tensor::from_slice(&[false, true, true, true, true]).view([1, 1, 1, 5]));
        let padded =
            Tensor::cat(&[causal.shallow_clone(), padded.logical_or(&Tensor::eye(5, (Kind::Bool, Device::Cpu)))], 0);
        for (mask, given) in [(&causal, None), (&padded, Some(&padded))] {
            let with_sinks = Scores { scale, softcap: None, sinks: Some(sinks.shallow_clone()) };
            let got = attend(&q, &k, &v, given, &with_sinks);
            let err = (got - reference(mask, None, Some(&sinks))).abs().max().double_value(&[]);
            assert!(err < 1e-5, "sinks: {err:.2e}");
            let capped = Scores { scale, softcap: Some(0.7), sinks: Some(sinks.shallow_clone()) };
            let err = (attend(&q, &k, &v, given, &capped) - reference(mask, Some(0.7), Some(&sinks)))
                .abs()
                .max()
                .double_value(&[]);
            assert!(err < 1e-5, "cap and sinks: {err:.2e}");
            let plain = Scores { scale, ..Default::default() };
            let err = (attend(&q, &k, &v, given, &plain) - reference(mask, None, None)).abs().max().double_value(&[]);
            assert!(err < 1e-5, "plain: {err:.2e}");
        }
        // The sinks take weight: without them the output differs.
        let plain = attend(&q, &k, &v, None, &Scores { scale, ..Default::default() });
        let sunk = attend(&q, &k, &v, None, &Scores { scale, softcap: None, sinks: Some(sinks) });
        assert!((plain - sunk).abs().max().double_value(&[]) > 1e-2);
    }

    /// On CUDA a masked attention over grouped heads (every query head given its group's keys)
    /// equals the CPU's.
    #[test]
    #[ignore = "needs a CUDA device: make gpu-test"]
    fn cuda_masked_grouped_attention_equals_the_cpus() {
        let device = kernels::cuda_test_device();
        plugin_api::tch::manual_seed(9);
        let r = |s: &[i64]| Tensor::randn(s, (Kind::Float, Device::Cpu));
        let (q, k, v) = (r(&[1, 6, 3, 16]), r(&[1, 2, 40, 16]), r(&[1, 2, 40, 16]));
        let keys = Tensor::arange(40, (Kind::Int64, Device::Cpu)).unsqueeze(0);
        let mask = keys.le_tensor(&Tensor::from_slice(&[20i64, 21, 22]).view([3, 1])).view([1, 1, 3, 40]);
        let s = Scores { scale: 0.25, ..Default::default() };
        let cpu = attend(&q, &k, &v, Some(&mask), &s);
        let on = |x: &Tensor| x.to_device(device);
        let gpu = attend(&on(&q), &on(&k), &on(&v), Some(&on(&mask)), &s).to_device(Device::Cpu);
        let err = (gpu - cpu).abs().max().double_value(&[]);
        assert!(err < 1e-5, "{err:.2e}");
    }
}
