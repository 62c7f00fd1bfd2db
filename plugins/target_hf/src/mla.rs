//! Multi-head latent attention (`model.layers.{i}.self_attn`, transformers' `DeepseekV3Attention`
//! and `LongcatFlashMLA`), the token mixer of DeepSeek-V3 / Kimi-K2 and LongCat-Flash.
//!
//! Weights: `q_a_proj` [r_q, H], `q_a_layernorm` [r_q], `q_b_proj` [nh (dn + dr), r_q] (or one
//! `q_proj` [nh (dn + dr), H] where `q_lora_rank` is null); `kv_a_proj_with_mqa` [r_kv + dr, H],
//! `kv_a_layernorm` [r_kv], `kv_b_proj` [nh (dn + dv), r_kv]; `o_proj` [H, nh dv].
//!
//! Per token: q = q_b(norm(q_a x)) split per head into a part without RoPE (dn) and one with
//! (dr); the latent c = norm(kv_a x)[..r_kv] gives each head's key part and value (kv_b c);
//! the rotary key part, kv_a x[r_kv..], is one for all heads. Keys are [k_nope | rope(k_rot)],
//! queries [q_nope | rope(q_rot)]; RoPE on pairs stored interleaved (`rope_interleave`: the
//! checkpoint's layout) is de-interleaved first. LongCat-Flash scales q by sqrt(H / r_q) and the
//! latent by sqrt(H / r_kv). The two low-rank norms use eps 1e-6 whatever the config says (as
//! transformers builds them). The cache holds each head's keys and values.
//!
//! Tensor parallelism splits by heads: the low-rank projections (q_a, kv_a) and their norms are
//! replicated, q_b (or q_proj) and kv_b column-parallel by heads, o_proj row-parallel.

use crate::{
    attention::{append, attend, Scores},
    common::{none, rms_norm},
    config::DecoderConfig,
    linear::Linear,
    rope::apply_rope,
    tp::rows,
    weights::Loader,
};
use plugin_api::tch::Tensor;

/// transformers' `DeepseekV3RMSNorm(dim)`'s default.
const LORA_NORM_EPS: f64 = 1e-6;

enum QProj {
    Full(Linear),
    Lora { a: Linear, norm: Tensor, b: Linear },
}

pub struct Mla {
    q: QProj,
    kv_a: Linear,
    kv_a_norm: Tensor,
    kv_b: Linear,
    o_proj: Linear,
    heads: i64,
    kv_rank: i64,
    nope: i64,
    rope: i64,
    v_dim: i64,
    interleaved: bool,
    /// LongCat-Flash's scales of q and of the latent.
    lora_scales: Option<(f64, f64)>,
    scores: Scores,
}

impl Mla {
    pub(crate) fn load(cfg: &DecoderConfig, ld: &mut Loader, p: &str) -> Result<Self, String> {
        let m = cfg.mla().ok_or_else(|| format!("{p}: latent attention in a model without its shapes"))?;
        let h = cfg.hidden_size as i64;
        let nh = cfg.num_attention_heads as i64;
        let (rank, nope, rope, v_dim) = (m.kv_lora_rank as i64, m.nope_dim as i64, m.rope_dim as i64, m.v_dim as i64);
        let q_rows = nh * (nope + rope);
        // This rank's heads (`tp.rs`): their rows of q_b and kv_b, their columns of o_proj.
        let heads = ld.shard.split(nh, "the attention heads")?;
        let q_keep = vec![rows(&heads, nope + rope)];
        let bias = cfg.attention_bias.unwrap_or(false);
        let q = match m.q_lora_rank {
            Some(r) => {
                let r = r as i64;
                QProj::Lora {
                    a: ld.linear_selected(&format!("{p}.q_a_proj.weight"), &[r, h], &[], |ld| {
                        bias.then(|| ld.get(&format!("{p}.q_a_proj.bias"), &[r])).transpose()
                    })?,
                    norm: ld.norm(&format!("{p}.q_a_layernorm.weight"), r, false)?,
                    b: ld.linear_selected(&format!("{p}.q_b_proj.weight"), &[q_rows, r], &[q_keep], none)?,
                }
            }
            None => QProj::Full(ld.linear_selected(&format!("{p}.q_proj.weight"), &[q_rows, h], &[q_keep], none)?),
        };
        let kv_a = ld.linear_selected(&format!("{p}.kv_a_proj_with_mqa.weight"), &[rank + rope, h], &[], |ld| {
            bias.then(|| ld.get(&format!("{p}.kv_a_proj_with_mqa.bias"), &[rank + rope])).transpose()
        })?;
        let lora_scales = (cfg.arch() == crate::config::Arch::LongcatFlash).then(|| {
            let q_rank = m.q_lora_rank.unwrap_or(cfg.hidden_size) as f64;
            ((cfg.hidden_size as f64 / q_rank).sqrt(), (cfg.hidden_size as f64 / rank as f64).sqrt())
        });
        Ok(Self {
            q,
            kv_a,
            kv_a_norm: ld.norm(&format!("{p}.kv_a_layernorm.weight"), rank, false)?,
            kv_b: ld.linear_selected(
                &format!("{p}.kv_b_proj.weight"),
                &[nh * (nope + v_dim), rank],
                &[vec![rows(&heads, nope + v_dim)]],
                none,
            )?,
            o_proj: ld.linear_selected(
                &format!("{p}.o_proj.weight"),
                &[h, nh * v_dim],
                &[vec![], vec![rows(&heads, v_dim)]],
                |ld| if bias { ld.row_bias(&format!("{p}.o_proj.bias"), h) } else { Ok(None) },
            )?,
            heads: heads.end - heads.start,
            kv_rank: rank,
            nope,
            rope,
            v_dim,
            interleaved: m.interleaved,
            lora_scales,
            scores: Scores { scale: cfg.attention_scale(), ..Default::default() },
        })
    }

    /// x [B, L, H] (normed) -> [B, L, H]; `mask` as `attention::attend`'s.
    pub fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
        cache: Option<&mut Option<(Tensor, Tensor)>>,
    ) -> Tensor {
        let (b, l) = (x.size()[0], x.size()[1]);
        let (nh, dn, dr, dv) = (self.heads, self.nope, self.rope, self.v_dim);
        // 1. Queries [B, nh, L, dn + dr], split into the parts without and with RoPE.
        let q = match &self.q {
            QProj::Full(w) => w.forward(x),
            QProj::Lora { a, norm, b } => b.forward(&rms_norm(&a.forward(x), norm, LORA_NORM_EPS)),
        };
        let mut q = q.view([b, l, nh, dn + dr]).transpose(1, 2);
        // 2. The latent (normed) and the shared rotary key part.
        let kv = self.kv_a.forward(x);
        let mut latent = rms_norm(&kv.narrow(2, 0, self.kv_rank), &self.kv_a_norm, LORA_NORM_EPS);
        if let Some((q_scale, kv_scale)) = self.lora_scales {
            q = q * q_scale;
            latent = latent * kv_scale;
        }
        let k_rot = kv.narrow(2, self.kv_rank, dr).view([b, l, 1, dr]).transpose(1, 2);
        // 3. Each head's key part and value from the latent: [B, nh, L, dn], [B, nh, L, dv].
        let kv = self.kv_b.forward(&latent).view([b, l, nh, dn + dv]).transpose(1, 2);
        let (k_nope, v) = (kv.narrow(3, 0, dn), kv.narrow(3, dn, dv));
        // 4. RoPE on the rotary parts (de-interleaved first where the checkpoint interleaves).
        let rotate = |t: &Tensor| {
            let t = if self.interleaved { deinterleave(t) } else { t.shallow_clone() };
            apply_rope(&t, cos, sin)
        };
        let q = Tensor::cat(&[q.narrow(3, 0, dn), rotate(&q.narrow(3, dn, dr))], 3);
        let k_rot = rotate(&k_rot).expand([b, nh, l, dr], false);
        let k = Tensor::cat(&[&k_nope, &k_rot], 3);
        // 5. The cache, attention over the heads' keys, o_proj.
        let (k, v) = append(cache, k, v.contiguous(), None);
        let o = attend(&q, &k, &v, mask, &self.scores);
        self.o_proj.forward(&o.transpose(1, 2).reshape([b, l, nh * dv]))
    }
}

/// [..., (d/2 pairs) x 2] -> [evens | odds]: interleaved rotary pairs in rotate-half order.
fn deinterleave(t: &Tensor) -> Tensor {
    let mut size = t.size();
    let d = size.pop().expect("a head dim");
    let mut pairs = size.clone();
    pairs.extend([d / 2, 2]);
    let last = pairs.len() as i64;
    t.reshape(pairs.as_slice()).transpose(last - 2, last - 1).reshape(t.size().as_slice())
}

#[cfg(test)]
mod tests {
    use super::*;
    use plugin_api::tch::{Device, Kind};

    #[test]
    fn deinterleaving_puts_evens_first() {
        let t = Tensor::arange(8, (Kind::Float, Device::Cpu)).view([1, 1, 1, 8]);
        let got: Vec<f32> = Vec::try_from(deinterleave(&t).flatten(0, -1)).unwrap();
        assert_eq!(got, [0.0, 2.0, 4.0, 6.0, 1.0, 3.0, 5.0, 7.0]);
    }
}
