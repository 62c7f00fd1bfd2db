//! Model FLOPs of a forward pass over `batch` sequences of `seq` tokens, by layer part, for
//! MFU (`dflash-host bench train`). One multiply-add is 2 FLOPs; a matmul [m, k] x [k, n] is
//! 2mkn. Work the maths needs, counted per token from the config:
//! - attention layers: the q (+ gate) / k / v / o projections and the causal scores (query i
//!   against i + 1 keys, or the last `window` of them in a sliding layer; QK^T and PV);
//!   latent attention: q (through its rank where it has one), the latent and rotary key
//!   (kv_a), each head's key part and value from the latent (kv_b), o, and the scores over
//!   qk_nope + qk_rope dims (PV over v dims);
//! - Gated DeltaNet layers: the four input projections and out_proj, the conv (2K a channel),
//!   and the chunked delta rule's matmuls as it runs them with chunks of c = min(64, seq): per
//!   token and value head 2c dk (the WY system's k k^T), c (dk + dv) (its triangular solve),
//!   2c dk and 2c dv (intra-chunk scores and their product), and 3 x 2 dk dv (the state read
//!   twice and written once);
//! - short-conv layers (LFM2): in_proj (3H), the conv (2K a channel), out_proj;
//! - MLPs: dense gated 6 H F; sparse: the router 2 H E, the top-k experts 6 H I each (active
//!   parameters only; with zero-computation experts, the share of the k picks expected to land
//!   on real ones, E / (E + Z), as uniform routing would give), the shared expert 6 H I_s (and
//!   Qwen3.5's gate, 2 H); LongCat-Flash: two attention sublayers, two dense MLPs and the MoE a
//!   layer;
//! - the LM head 2 H V a token, when logits are asked for.
//!
//! Elementwise work (norms, activations, gates, biases) is not counted.

use crate::{
    config::{DecoderConfig, Mixer, SharedExpert},
    qwen3_5::CHUNK,
};
use serde::Serialize;

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct ForwardFlops {
    /// Attention layers' projections and scores (latent attention's too).
    pub attention: f64,
    /// Gated DeltaNet layers' projections, conv and delta rule.
    pub gdn: f64,
    /// Short-conv layers' projections and conv.
    pub conv: f64,
    /// Every layer's MLP (dense or the active experts).
    pub mlp: f64,
    pub head: f64,
}

impl ForwardFlops {
    pub fn total(&self) -> f64 {
        self.attention + self.gdn + self.conv + self.mlp + self.head
    }
}

/// Query-key pairs of a causal sequence of `s` tokens where each sees at most `window` keys.
fn pairs(s: f64, window: Option<usize>) -> f64 {
    match window.map(|w| w as f64) {
        Some(w) if w < s => w * (w + 1.0) / 2.0 + (s - w) * w,
        _ => s * (s + 1.0) / 2.0,
    }
}

/// The first `layers` layers (the deepest feature layer + 1 when training), plus the LM head
/// when `logits`.
pub fn forward(cfg: &DecoderConfig, layers: usize, batch: usize, seq: usize, logits: bool) -> ForwardFlops {
    let (b, s) = (batch as f64, seq as f64);
    let tokens = b * s;
    let h = cfg.hidden_size as f64;
    let (nh, nkv, d) = (cfg.num_attention_heads as f64, cfg.num_kv_heads() as f64, cfg.head_dim() as f64);
    let q_rows = if cfg.is_hybrid() { 2.0 * nh * d } else { nh * d };
    let attention_layer =
        |window| tokens * 2.0 * h * (q_rows + 2.0 * nkv * d + nh * d) + b * 4.0 * nh * d * pairs(s, window);
    let mla_layer = cfg.mla().map_or(0.0, |m| {
        let (r, dn, dr, dv) = (m.kv_lora_rank as f64, m.nope_dim as f64, m.rope_dim as f64, m.v_dim as f64);
        let q = match m.q_lora_rank.map(|x| x as f64) {
            Some(rq) => 2.0 * h * rq + 2.0 * rq * nh * (dn + dr),
            None => 2.0 * h * nh * (dn + dr),
        };
        let projections = q + 2.0 * h * (r + dr) + 2.0 * r * nh * (dn + dv) + 2.0 * nh * dv * h;
        tokens * projections + b * 2.0 * nh * (dn + dr + dv) * pairs(s, None)
    });
    let l = cfg.linear();
    let (nv, dk, dv) = (l.value_heads as f64, l.key_dim as f64, l.value_dim as f64);
    let (channels, kernel) = (l.conv_channels() as f64, l.conv_kernel as f64);
    let c = (CHUNK as f64).min(s);
    let rule_per_head = 2.0 * c * dk + c * (dk + dv) + 2.0 * c * dk + 2.0 * c * dv + 6.0 * dk * dv;
    let gdn_layer = tokens
        * (2.0 * h * (channels + nv * dv + 2.0 * nv)
            + 2.0 * nv * dv * h
            + 2.0 * kernel * channels
            + nv * rule_per_head);
    let conv_layer = tokens * (2.0 * h * 3.0 * h + 2.0 * cfg.short_conv_kernel() as f64 * h + 2.0 * h * h);
    let dense_mlp = tokens * 6.0 * h * cfg.dense_width().unwrap_or(0) as f64;
    let sparse_mlp = cfg.moe().map_or(0.0, |m| {
        let shared = match m.shared {
            Some(SharedExpert::Gated(w)) => 6.0 * h * w as f64 + 2.0 * h,
            Some(SharedExpert::Plain(w)) => 6.0 * h * w as f64,
            None => 0.0,
        };
        let (e, z) = (m.experts as f64, m.zero_experts as f64);
        let routed = m.top_k as f64 * e / (e + z);
        tokens * (2.0 * h * (e + z) + routed * 6.0 * h * m.intermediate as f64 + shared)
    });
    let longcat = cfg.mixers_per_layer() == 2;
    let mut f = ForwardFlops::default();
    for (i, mixer) in cfg.mixers().iter().enumerate().take(layers) {
        let per_layer = cfg.mixers_per_layer() as f64;
        match mixer {
            Mixer::Attention => f.attention += attention_layer(cfg.window(i)),
            Mixer::Mla => f.attention += per_layer * mla_layer,
            Mixer::Linear => f.gdn += gdn_layer,
            Mixer::ShortConv => f.conv += conv_layer,
        }
        f.mlp += if longcat {
            2.0 * dense_mlp + sparse_mlp
        } else if cfg.is_sparse_layer(i) {
            sparse_mlp
        } else {
            dense_mlp
        };
    }
    if logits {
        f.head = tokens * 2.0 * h * cfg.vocab_size as f64;
    }
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(json: &str) -> DecoderConfig {
        let (c, _) = DecoderConfig::from_hf_json(json).unwrap();
        c.validate().unwrap();
        c
    }

    #[test]
    fn a_dense_forward_is_twice_its_weights_per_token_plus_attention() {
        let c = read(
            r#"{"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936}"#,
        );
        let f = forward(&c, 36, 1, 1, true);
        let per_token = 2.0 * 36.0 * (4096.0 * (4096.0 + 2048.0 + 4096.0) + 3.0 * 4096.0 * 12288.0);
        assert!((f.attention + f.mlp - (per_token + 36.0 * 4.0 * 32.0 * 128.0)).abs() < 1.0);
        assert_eq!((f.gdn, f.head), (0.0, 2.0 * 4096.0 * 151936.0));
    }

    /// Qwen3.6-27B's shapes: the projections and MLPs are twice the layer weights a token (the
    /// 26.9B of the text model without the embedding and head: 24.35B), the delta rule and the
    /// scores a few percent on top at 3072 tokens.
    #[test]
    fn the_qwen3_6_27b_forward_counts_its_active_weights() {
        let c = read(
            r#"{"model_type": "qwen3_5_text", "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
                "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 248320,
                "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
                "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}"#,
        );
        let f = forward(&c, 64, 1, 3072, true);
        let gdn_weights = 5120.0 * (10240.0 + 6144.0 + 96.0) + 6144.0 * 5120.0;
        let attn_weights = 5120.0 * (12288.0 + 2048.0) + 6144.0 * 5120.0;
        let layer_weights: f64 = 48.0 * gdn_weights + 16.0 * attn_weights + 64.0 * 3.0 * 5120.0 * 17408.0;
        assert!((layer_weights / 1e9 - 24.35).abs() < 0.005, "{layer_weights}");
        let weights_part = 2.0 * 3072.0 * layer_weights;
        let extra = f.attention + f.gdn + f.mlp - weights_part;
        assert!(extra > 0.0 && extra / weights_part < 0.05, "{extra:e} on top of {weights_part:e}");
        assert_eq!(f.mlp, 3072.0 * 64.0 * 6.0 * 5120.0 * 17408.0);
        // Only the layers asked for: 62 of 64 (features up to layer 61) has 46 GDN + 15 attention + 1 GDN.
        let part = forward(&c, 62, 1, 3072, false);
        assert_eq!(part.head, 0.0);
        assert!(
            (part.gdn / f.gdn - 47.0 / 48.0).abs() < 1e-12
                && (part.attention / f.attention - 15.0 / 16.0).abs() < 1e-12
        );
    }

    /// Qwen3-30B-A3B: 3.3B active parameters a token in its layers (8 of 128 experts of 768 +
    /// attention + the router), against 30.5B in all.
    #[test]
    fn a_moe_forward_counts_the_active_experts_only() {
        let c = read(
            r#"{"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
                "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": true}"#,
        );
        let f = forward(&c, 48, 1, 1, false);
        let active = (f.attention + f.mlp - 48.0 * 4.0 * 32.0 * 128.0) / 2.0;
        assert!((active / 1e9 - 2.73).abs() < 0.005, "{active}"); // + 0.62B embedding + head = 3.35B
        assert_eq!(f.mlp, 48.0 * (2.0 * 2048.0 * 128.0 + 8.0 * 6.0 * 2048.0 * 768.0));
    }
}
