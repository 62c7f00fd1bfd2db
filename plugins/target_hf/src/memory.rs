//! Device memory of the target, from its config.json without its weights (ABI `memory`, the host's
//! estimate before anything loads):
//! - its weights on one rank: every matrix of every layer (all the routed experts, not only the
//!   active ones), split over `tensor_parallel` ranks as `tp.rs` splits them (the embedding and
//!   the LM head replicated on each), at the run's dtype;
//! - with `compute = "fp8"`, the projections FP8 runs ([`fp8_projections`]) at one byte a weight
//!   (padded as `kernels::fp8` pads them) plus a float32 scale a 128x128 block instead;
//! - the forward's working set at a batch, the larger of a layer's and the head's: one layer's
//!   transient tensors (its input and normed copy, the mixer's projections, the MLP's gate, up
//!   and product; for routed experts the top-k copies of each token; for a Gated DeltaNet layer
//!   its chunk states in f32; with FP8 the quantised copy of a projection's input) over the
//!   batch's tokens, or the last hidden states, their normed copy and the logits when they are
//!   asked for. The features the forward returns are the drafter's to count (its input). Where
//!   FP8 quantises weights at load, one projection's quantisation (its weight in float32,
//!   blocked and scaled: ~16 bytes a weight) is the working set when it is the larger. No
//!   gradients: the target is frozen.
//!
//! Norm weights and biases are left out (a few parts in a million).

use crate::config::{DecoderConfig, Mixer, SharedExpert};
use crate::qwen3_5::CHUNK;

/// Parameters of the model, whole: `layers` (every decoder layer's matrices) and `embeddings`
/// (the input embedding, and the LM head unless tied).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Parameters {
    pub layers: f64,
    pub embeddings: f64,
}

impl Parameters {
    pub fn total(&self) -> f64 {
        self.layers + self.embeddings
    }

    /// On one of `tensor_parallel` ranks: the layers split, the embeddings replicated.
    pub fn per_rank(&self, tensor_parallel: usize) -> f64 {
        self.layers / tensor_parallel.max(1) as f64 + self.embeddings
    }
}

pub fn parameters(cfg: &DecoderConfig) -> Parameters {
    let h = cfg.hidden_size as f64;
    let (nh, nkv, d) = (cfg.num_attention_heads as f64, cfg.num_kv_heads() as f64, cfg.head_dim() as f64);
    let q_rows = if cfg.is_hybrid() { 2.0 * nh * d } else { nh * d };
    let attention = h * (q_rows + 2.0 * nkv * d + nh * d);
    let mla = cfg.mla().map_or(0.0, |m| {
        let (r, dn, dr, dv) = (m.kv_lora_rank as f64, m.nope_dim as f64, m.rope_dim as f64, m.v_dim as f64);
        let q = match m.q_lora_rank.map(|x| x as f64) {
            Some(rq) => h * rq + rq * nh * (dn + dr),
            None => h * nh * (dn + dr),
        };
        q + h * (r + dr) + r * nh * (dn + dv) + nh * dv * h
    });
    let l = cfg.linear();
    let (nv, dv) = (l.value_heads as f64, l.value_dim as f64);
    let channels = l.conv_channels() as f64;
    let gdn = h * (channels + nv * dv + 2.0 * nv) + nv * dv * h + l.conv_kernel as f64 * channels;
    let conv = 3.0 * h * h + cfg.short_conv_kernel() as f64 * h + h * h;
    let dense_mlp = 3.0 * h * cfg.dense_width().unwrap_or(0) as f64;
    let sparse_mlp = cfg.moe().map_or(0.0, |m| {
        let shared = match m.shared {
            Some(SharedExpert::Gated(w)) => 3.0 * h * w as f64 + h,
            Some(SharedExpert::Plain(w)) => 3.0 * h * w as f64,
            None => 0.0,
        };
        h * (m.experts + m.zero_experts) as f64 + m.experts as f64 * 3.0 * h * m.intermediate as f64 + shared
    });
    let longcat = cfg.mixers_per_layer() == 2;
    let mut layers = 0.0;
    for (i, mixer) in cfg.mixers().iter().enumerate() {
        layers += match mixer {
            Mixer::Attention => attention,
            Mixer::Mla => cfg.mixers_per_layer() as f64 * mla,
            Mixer::Linear => gdn,
            Mixer::ShortConv => conv,
        };
        layers += if longcat {
            2.0 * dense_mlp + sparse_mlp
        } else if cfg.is_sparse_layer(i) {
            sparse_mlp
        } else {
            dense_mlp
        };
    }
    let vocab = cfg.vocab_size as f64 * h;
    Parameters { layers, embeddings: if cfg.tie_word_embeddings { vocab } else { 2.0 * vocab } }
}

/// The weights `compute = "fp8"` runs as FP8 GEMMs, whole: (out, in) of each, fused as the
/// loader fuses them (attention's q|k|v; a Gated DeltaNet layer's q|k|v|z|b|a), every layer's.
pub fn fp8_projections(cfg: &DecoderConfig) -> Vec<(f64, f64)> {
    let h = cfg.hidden_size as f64;
    let (nh, nkv, d) = (cfg.num_attention_heads as f64, cfg.num_kv_heads() as f64, cfg.head_dim() as f64);
    let q_rows = if cfg.is_hybrid() { 2.0 * nh * d } else { nh * d };
    let attention = vec![(q_rows + 2.0 * nkv * d, h), (h, nh * d)];
    let mla = cfg.mla().map_or(Vec::new(), |m| {
        let (r, dn, dr, dv) = (m.kv_lora_rank as f64, m.nope_dim as f64, m.rope_dim as f64, m.v_dim as f64);
        let mut w = match m.q_lora_rank.map(|x| x as f64) {
            Some(rq) => vec![(rq, h), (nh * (dn + dr), rq)],
            None => vec![(nh * (dn + dr), h)],
        };
        w.extend([(r + dr, h), (nh * (dn + dv), r), (h, nh * dv)]);
        w
    });
    let l = cfg.linear();
    let (nv, dv) = (l.value_heads as f64, l.value_dim as f64);
    let gdn = vec![(l.conv_channels() as f64 + nv * dv + 2.0 * nv, h), (h, nv * dv)];
    let mlp = |w: f64| vec![(w, h), (w, h), (h, w)];
    let dense = cfg.dense_width().map_or(Vec::new(), |w| mlp(w as f64));
    let shared = cfg.moe().and_then(|m| m.shared).map_or(Vec::new(), |s| match s {
        SharedExpert::Gated(w) | SharedExpert::Plain(w) => mlp(w as f64),
    });
    let longcat = cfg.mixers_per_layer() == 2;
    let mut out = Vec::new();
    for (i, mixer) in cfg.mixers().iter().enumerate() {
        match mixer {
            Mixer::Attention => out.extend(&attention),
            Mixer::Mla => (0..cfg.mixers_per_layer()).for_each(|_| out.extend(&mla)),
            Mixer::Linear => out.extend(&gdn),
            Mixer::ShortConv => {}
        }
        if longcat {
            out.extend(dense.iter().chain(&dense).chain(&shared));
        } else if cfg.is_sparse_layer(i) {
            out.extend(&shared);
        } else {
            out.extend(&dense);
        }
    }
    out
}

/// Bytes of an FP8 block-scaled weight [out, in] as `kernels::fp8` holds it: out padded to 16
/// rows, in to 512 columns, one byte each, and a float32 scale a 128x128 block.
pub fn fp8_bytes((out, inp): (f64, f64)) -> f64 {
    let up = |x: f64, to: f64| (x / to).ceil() * to;
    let (n, k) = (up(out, 16.0), up(inp, 512.0));
    n * k + 4.0 * (n / 128.0).ceil() * (k / 128.0)
}

/// The target's weights on one of `tensor_parallel` ranks, in bytes: every weight at `elem`
/// bytes, or with `fp8` its projections as FP8 ([`fp8_bytes`]).
pub fn weight_bytes(cfg: &DecoderConfig, tensor_parallel: usize, elem: f64, fp8: bool) -> f64 {
    let whole = parameters(cfg).per_rank(tensor_parallel) * elem;
    if !fp8 {
        return whole;
    }
    let tp = tensor_parallel.max(1) as f64;
    let projections = fp8_projections(cfg);
    let dense: f64 = projections.iter().map(|(n, k)| n * k).sum::<f64>() * elem;
    let fp8: f64 = projections.iter().map(|&w| fp8_bytes(w)).sum();
    whole - (dense - fp8) / tp
}

/// Peak bytes the forward of the first `layers` layers over [batch, seq] holds besides the weights
/// and the features it returns, on one of `tensor_parallel` ranks, with `elem` bytes an element;
/// with `fp8`, its projections' quantised inputs and the quantisation of a weight at load.
pub fn forward_working_set(
    cfg: &DecoderConfig,
    (batch, seq): (usize, usize),
    layers: usize,
    logits: bool,
    tensor_parallel: usize,
    (elem, fp8): (f64, bool),
) -> f64 {
    let tokens = (batch * seq) as f64;
    let tp = tensor_parallel.max(1) as f64;
    let h = cfg.hidden_size as f64;
    let (nh, nkv, d) = (cfg.num_attention_heads as f64, cfg.num_kv_heads() as f64, cfg.head_dim() as f64);
    let q_rows = if cfg.is_hybrid() { 2.0 * nh * d } else { nh * d };
    // The layer's input, its normed copy and the residual sum.
    let stream = 3.0 * h;
    // q (+ gate), k, v, the attention's output (split by heads over the ranks).
    let attention = (q_rows + 2.0 * nkv * d + nh * d) / tp;
    let l = cfg.linear();
    let (nv, dk, dv) = (l.value_heads as f64, l.key_dim as f64, l.value_dim as f64);
    // Projections, the conv's output and the rule's output per token; the chunk states in f32.
    let gdn_rows = (2.0 * l.conv_channels() as f64 + 2.0 * nv * dv + 2.0 * nv) / tp;
    let gdn_states = batch as f64 * (nv / tp) * dk * dv * (seq as f64 / CHUNK as f64).ceil() * 4.0;
    let dense = 3.0 * cfg.dense_width().unwrap_or(0) as f64 / tp;
    // Routed experts: each token's top-k copies in and out, and their gate, up and product.
    let sparse = cfg.moe().map_or(0.0, |m| {
        let shared = match m.shared {
            Some(SharedExpert::Gated(w) | SharedExpert::Plain(w)) => 3.0 * w as f64 / tp,
            None => 0.0,
        };
        (m.experts + m.zero_experts) as f64 + m.top_k as f64 * (2.0 * h + 3.0 * m.intermediate as f64 / tp) + shared
    });
    // FP8: a projection's input quantised, one byte an element of its widest input, padded.
    let projections = if fp8 { fp8_projections(cfg) } else { Vec::new() };
    let quantised =
        projections.iter().map(|&(_, k)| (k / 512.0).ceil() * 512.0 * (1.0 + 4.0 / 128.0)).fold(0.0, f64::max);
    let mut peak: f64 = 0.0;
    for (i, mixer) in cfg.mixers().iter().enumerate().take(layers) {
        let mixer_rows = match mixer {
            Mixer::Attention | Mixer::Mla => attention,
            Mixer::Linear => gdn_rows,
            Mixer::ShortConv => 4.0 * h / tp,
        };
        let mlp_rows = if cfg.is_sparse_layer(i) { sparse } else { dense };
        let states = if matches!(mixer, Mixer::Linear) { gdn_states } else { 0.0 };
        peak = peak.max(tokens * ((stream + mixer_rows.max(mlp_rows)) * elem + quantised) + states);
    }
    // The last hidden states, their normed copy and the logits.
    let head = if logits { tokens * (2.0 * h + cfg.vocab_size as f64) * elem } else { 0.0 };
    let load = projections.iter().map(|&(n, k)| n * k * 16.0 / tp).fold(0.0, f64::max);
    peak.max(head).max(load)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(json: &str) -> DecoderConfig {
        let (c, _) = DecoderConfig::from_hf_json(json).unwrap();
        c.validate().unwrap();
        c
    }

    /// Qwen3-8B: 36 layers of 4096 x (4096 + 2 x 1024 + 4096) attention and 3 x 4096 x 12288 MLP,
    /// an untied 151936 x 4096 embedding and head: 8.19B, as its model card says.
    #[test]
    fn qwen3_8b_has_its_published_parameter_count() {
        let c = read(
            r#"{"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936}"#,
        );
        let p = parameters(&c);
        let layer = 4096.0 * (4096.0 + 2048.0 + 4096.0) + 3.0 * 4096.0 * 12288.0;
        assert_eq!(p.layers, 36.0 * layer);
        assert_eq!(p.embeddings, 2.0 * 151936.0 * 4096.0);
        assert!((p.total() / 1e9 - 8.19).abs() < 0.01, "{}", p.total());
        assert_eq!(p.per_rank(2), 18.0 * layer + p.embeddings);
        // One layer's working set at 4 x 3072 in bf16: the stream and the MLP's 3 x 12288 rows.
        let w = forward_working_set(&c, (4, 3072), 36, false, 1, (2.0, false));
        assert_eq!(w, 4.0 * 3072.0 * (3.0 * 4096.0 + 3.0 * 12288.0) * 2.0);
        // With logits the head is the larger: the last hidden states, their normed copy, the logits.
        let with_logits = forward_working_set(&c, (4, 3072), 36, true, 1, (2.0, false));
        assert_eq!(with_logits, 4.0 * 3072.0 * (2.0 * 4096.0 + 151936.0) * 2.0);
        // FP8: the layers' projections at one byte and a scale a block (all of them whole 128 x 512
        // multiples here), the embedding and head in bf16; the down projection's input quantised.
        let proj: f64 = fp8_projections(&c).iter().map(|(n, k)| n * k).sum();
        assert_eq!(proj, p.layers, "every matrix of a Qwen3 layer runs in FP8");
        let fp8 = weight_bytes(&c, 1, 2.0, true);
        let scales = 36.0 * 4.0 * (48.0 * 32.0 + 32.0 * 32.0 + 2.0 * 96.0 * 32.0 + 32.0 * 96.0);
        assert_eq!(fp8, p.layers + scales + p.embeddings * 2.0);
        let w8 = forward_working_set(&c, (4, 3072), 36, false, 1, (2.0, true));
        assert_eq!(w8 - w, 4.0 * 3072.0 * 12288.0 * (1.0 + 4.0 / 128.0));
    }

    /// SmolLM2-135M's hidden 576 is padded to 1024 input columns for the FP8 GEMM, its 1536 MLP
    /// width is not; the quantisation of the largest weight at load is counted where it is the
    /// larger.
    #[test]
    fn fp8_weights_are_padded_as_the_gemm_pads_them() {
        let c = read(
            r#"{"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
                "tie_word_embeddings": true}"#,
        );
        let layer = fp8_bytes((960.0, 576.0))
            + fp8_bytes((576.0, 576.0))
            + 2.0 * fp8_bytes((1536.0, 576.0))
            + fp8_bytes((576.0, 1536.0));
        assert_eq!(fp8_bytes((960.0, 576.0)), 960.0 * 1024.0 + 4.0 * 8.0 * 8.0);
        let p = parameters(&c);
        assert_eq!(weight_bytes(&c, 1, 2.0, true), p.embeddings * 2.0 + 30.0 * layer);
        let tiny = forward_working_set(&c, (1, 4), 30, false, 1, (2.0, true));
        assert_eq!(tiny, 1536.0 * 576.0 * 16.0, "the load's quantisation outweighs 4 tokens");
    }
}
