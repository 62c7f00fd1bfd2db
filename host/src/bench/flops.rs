//! FLOP counts of the benchmarked work, written out so each figure can be checked by hand.
//! One multiply-add is 2 FLOPs; a matmul [m, k] x [k, n] is 2mkn. These are model FLOPs: work
//! the maths needs, not what a kernel happens to execute (masked SDPA computes every masked-out
//! score too; activation recomputation is not counted).

use plugin_api::TargetSpec;

/// The decoder shapes a count needs (target, or a dense Qwen3-style drafter layer).
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub hidden: f64,
    pub heads: f64,
    pub kv_heads: f64,
    pub head_dim: f64,
    pub ffn: f64,
    pub vocab: f64,
}

impl Shape {
    pub fn of_target(s: &TargetSpec) -> Self {
        Self {
            hidden: s.hidden_size as f64,
            heads: s.num_attention_heads as f64,
            kv_heads: s.num_key_value_heads as f64,
            head_dim: s.head_dim as f64,
            ffn: s.intermediate_size as f64,
            vocab: s.vocab_size as f64,
        }
    }

    /// q, k, v, o and the SwiGLU MLP (gate, up, down) for one token: 2 x their weights.
    fn layer_linear_per_token(&self) -> f64 {
        let (h, q, kv) = (self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim);
        2.0 * (h * q + 2.0 * h * kv + q * h + 3.0 * h * self.ffn)
    }

    /// QK^T and PV for one query over `keys` keys: 2 matmuls of 2 * head_dim per key and head.
    fn attention_per_query(&self, keys: f64) -> f64 {
        4.0 * self.heads * self.head_dim * keys
    }

    /// k and v projections of one context token (DFlash drafter layers project the context only to K/V).
    fn kv_per_token(&self) -> f64 {
        2.0 * 2.0 * self.hidden * self.kv_heads * self.head_dim
    }
}

/// Target forward over `batch` sequences of `seq` tokens through `layers` layers, causal
/// (query i sees i + 1 keys), plus the LM head on every token when `logits`.
pub fn target_forward(t: &Shape, layers: usize, batch: usize, seq: usize, logits: bool) -> f64 {
    let (b, s, l) = (batch as f64, seq as f64, layers as f64);
    let linear = b * s * l * t.layer_linear_per_token();
    let causal_keys = s * (s + 1.0) / 2.0; // summed over the queries of one sequence
    let attention = b * l * t.attention_per_query(1.0) * causal_keys;
    let head = if logits { 2.0 * b * s * t.hidden * t.vocab } else { 0.0 };
    linear + attention + head
}

/// One drafter train step (forward + backward) of a dense DFlash drafter.
pub struct DrafterWork {
    /// Drafter layer shape (hidden, heads, head_dim, vocab are the target's).
    pub shape: Shape,
    pub layers: usize,
    /// Target features concatenated into `fc`.
    pub features: usize,
    pub batch: usize,
    pub seq: usize,
    pub block_size: usize,
    /// Valid anchors in the batch and the sum of their positions (context keys each block sees).
    pub anchors: usize,
    pub anchor_pos_sum: f64,
    /// Labels the loss counts (LM-head rows).
    pub counted: usize,
}

impl DrafterWork {
    /// Forward FLOPs of the trained part (fc, layers, attention) and of the frozen LM head.
    fn forward_parts(&self) -> (f64, f64, f64) {
        let d = &self.shape;
        let (b, s, l) = (self.batch as f64, self.seq as f64, self.layers as f64);
        let block_tokens = self.anchors as f64 * self.block_size as f64;
        // fc: [B*S, n*H] x [n*H, H].
        let fc = 2.0 * b * s * self.features as f64 * d.hidden * d.hidden;
        // Per layer: block tokens through q/k/v/o + MLP, context tokens through k/v.
        let layers = l * (block_tokens * d.layer_linear_per_token() + b * s * d.kv_per_token());
        // Each block query sees the context before its anchor and the block's own keys.
        let keys = self.anchor_pos_sum * self.block_size as f64 + block_tokens * self.block_size as f64;
        let attention = l * d.attention_per_query(1.0) * keys;
        let head = 2.0 * self.counted as f64 * d.hidden * d.vocab;
        (fc, layers + attention, head)
    }

    /// Forward + backward: trained layers 3x forward (input and weight gradients); `fc` 2x (its
    /// input, the target features, needs no gradient); the frozen LM head 2x (gradient into the
    /// hidden states only).
    pub fn step(&self) -> f64 {
        let (fc, layers, head) = self.forward_parts();
        2.0 * fc + 3.0 * layers + 2.0 * head
    }
}

/// Dense drafter work for a plugin without a known layer layout: 6 FLOPs per trained weight and
/// block token (forward + backward), plus the LM head as above. An estimate, labelled as such.
pub fn drafter_step_estimate(params: f64, block_tokens: f64, counted: f64, shape: &Shape) -> f64 {
    6.0 * params * block_tokens + 4.0 * counted * shape.hidden * shape.vocab
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen3_8b() -> Shape {
        Shape { hidden: 4096.0, heads: 32.0, kv_heads: 8.0, head_dim: 128.0, ffn: 12288.0, vocab: 151936.0 }
    }

    #[test]
    fn qwen3_8b_forward_is_twice_its_weights_per_token_plus_attention() {
        let t = qwen3_8b();
        // Layer weights: 4096*(4096 + 2*1024 + 4096) + 3*4096*12288 = 184.5M; 36 layers = 6.64G.
        let per_token = 2.0 * 36.0 * (4096.0 * (4096.0 + 2048.0 + 4096.0) + 3.0 * 4096.0 * 12288.0);
        let f = target_forward(&t, 36, 1, 1, false);
        assert!((f - (per_token + 36.0 * 4.0 * 32.0 * 128.0)).abs() < 1.0);
        let with_head = target_forward(&t, 36, 1, 1, true);
        assert!((with_head - f - 2.0 * 4096.0 * 151936.0).abs() < 1.0);
    }

    #[test]
    fn the_published_drafter_step_is_about_290_tflop_at_batch_4() {
        // 4 x 512 anchors, mean anchor ~1535, ~15 counted labels a block.
        let w = DrafterWork {
            shape: qwen3_8b(),
            layers: 5,
            features: 5,
            batch: 4,
            seq: 3072,
            block_size: 16,
            anchors: 2048,
            anchor_pos_sum: 2048.0 * 1535.0,
            counted: 2048 * 15,
        };
        let tflop = w.step() / 1e12;
        assert!((270.0..310.0).contains(&tflop), "{tflop}");
    }
}
