//! The drafter's device memory in training, for the host's estimate (ABI `memory`), counted from
//! what its training step keeps (model.rs, the split-attention path a GPU runs):
//! - its weights and their gradients, in the run's dtype;
//! - the micro-batch's target features [B, S, n x H] and the context they make (fc's output and
//!   hidden_norm's: [B, S, H] each), and each layer's context keys [B, S, kv x d] before and after
//!   their norm and RoPE, and values;
//! - each layer's block activations kept for backward over the B x A x block tokens: its input,
//!   its two normed copies and the residual sum after attention (4 x H), q before and after its
//!   norm and RoPE and the attention's output (3 x heads x d), the block's keys before and after
//!   and values (3 x kv x d), the MLP's gate and up (2 x F), the attention's log-sum-exp (f32);
//!   once, the last layer's output and its norm (2 x H), and the larger of the loss's transients
//!   (the host's DFlash loss: one chunk of at most 512 MiB of logits, over which their gradient is
//!   written, and four H-wide copies of the block's hidden states and their gradient) and the last
//!   layer's backward's (its MLP's three F-wide gradients, the incoming and outgoing H-wide ones),
//!   each of which runs while every activation is still held.
//!
//! With `checkpoint_layers` a layer keeps only its input; one layer's activations (and its
//! context keys and values) are rebuilt at a time in backward.

use crate::config::DFlashConfig;
use plugin_api::describe::{MemoryPart, MemoryQuery, MemoryScale, SectionMemory};

/// Bytes of one layer's activations: (the context part [B, S], the blocks' part [B, A x block]).
fn layer(cfg: &DFlashConfig, q: MemoryQuery, elem: f64) -> (f64, f64) {
    let (h, f) = (cfg.hidden_size as f64, cfg.intermediate_size as f64);
    let (nh, nkv, d) = (cfg.num_attention_heads as f64, cfg.num_key_value_heads as f64, cfg.head_dim as f64);
    let context = (q.batch as f64 * q.seq_len as f64) * 3.0 * nkv * d * elem;
    let rows = 4.0 * h + 3.0 * nh * d + 3.0 * nkv * d + 2.0 * f + 4.0 / elem * nh;
    (context, block_tokens(cfg, q) * rows * elem)
}

/// The most bytes of logits the host's loss forms at once (`LOGIT_CHUNK_BYTES` in its loss.rs),
/// in whole multiples of 384 rows.
const LOGIT_CHUNK_BYTES: f64 = (1u64 << 29) as f64;

/// Bytes held once, not per layer, over the block tokens: the last layer's output and its norm,
/// and the larger of the loss's transients and the last layer's backward's.
fn once(cfg: &DFlashConfig, q: MemoryQuery, elem: f64) -> f64 {
    let (h, f, v) = (cfg.hidden_size as f64, cfg.intermediate_size as f64, cfg.vocab_size as f64);
    let n = block_tokens(cfg, q);
    let rows = (LOGIT_CHUNK_BYTES / (elem * v)).floor();
    let rows = if rows >= 384.0 { (rows / 384.0).floor() * 384.0 } else { rows.max(1.0) };
    let loss = rows.min(n) * v * elem + 4.0 * n * h * elem;
    let backward = n * (3.0 * f + 2.0 * h) * elem;
    n * 2.0 * h * elem + loss.max(backward)
}

fn block_tokens(cfg: &DFlashConfig, q: MemoryQuery) -> f64 {
    q.batch as f64 * q.anchors_per_seq as f64 * cfg.block_size as f64
}

pub fn estimate(cfg: &DFlashConfig, q: MemoryQuery, elem: f64, checkpoint_layers: bool) -> SectionMemory {
    let params: i64 = cfg.parameter_shapes().iter().map(|(_, s)| s.iter().product::<i64>()).sum();
    let (h, layers) = (cfg.hidden_size as f64, cfg.num_hidden_layers as f64);
    let n_feat = cfg.dflash_config.target_layer_ids.len() as f64;
    let tokens = q.batch as f64 * q.seq_len as f64;
    let (features, fused) = (tokens * n_feat * h * elem, tokens * 2.0 * h * elem);
    let (context, blocks) = layer(cfg, q, elem);
    let inputs = block_tokens(cfg, q) * h * elem;
    let once = once(cfg, q, elem);
    let (kept_context, kept_blocks) = match checkpoint_layers {
        true => (context, blocks + layers * inputs + once),
        false => (layers * context, layers * blocks + once),
    };
    let part = MemoryPart::new;
    SectionMemory {
        parts: vec![
            part("drafter weights", params as f64 * elem, MemoryScale::Fixed),
            part("drafter gradients", params as f64 * elem, MemoryScale::Fixed),
            part("target features", features, MemoryScale::Batch),
            part("drafter context", fused + kept_context, MemoryScale::Batch),
            part("drafter activations (blocks)", kept_blocks, MemoryScale::BatchAnchors),
        ]
        .into(),
        trained_parameters: params as u64,
        checkpointed_bytes: (!checkpoint_layers)
            .then_some((features + fused + context + blocks + layers * inputs + once).round() as u64)
            .into(),
        ..SectionMemory::default()
    }
}
