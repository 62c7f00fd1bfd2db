//! The drafter's device memory in training, for the host's estimate (ABI `memory`):
//! - its weights and their gradients, in the run's dtype;
//! - the micro-batch's target features [B, S, n x H] and the context they make (fc and
//!   hidden_norm: [B, S, H] each), and each layer's context keys and values [B, S, 2 x kv x d];
//! - each layer's block activations kept for backward over the B x A x block tokens: the layer's
//!   input and its two normed copies, q, k, v and the attention's output with its q/k-normed and
//!   rotated copies, o_proj's output, the MLP's gate, up and product and down's output.
//!
//! With `checkpoint_layers` a layer keeps only its input; one layer's activations (and its
//! context keys and values) are rebuilt at a time in backward.

use crate::config::DFlashConfig;
use plugin_api::describe::{MemoryPart, MemoryQuery, MemoryScale, SectionMemory};

/// Bytes of one layer's activations: (the context part [B, S], the blocks' part [B, A x block]).
fn layer(cfg: &DFlashConfig, q: MemoryQuery, elem: f64) -> (f64, f64) {
    let (h, f) = (cfg.hidden_size as f64, cfg.intermediate_size as f64);
    let (nh, nkv, d) = (cfg.num_attention_heads as f64, cfg.num_key_value_heads as f64, cfg.head_dim as f64);
    let context = (q.batch as f64 * q.seq_len as f64) * 2.0 * nkv * d * elem;
    let rows = 5.0 * h + 3.0 * nh * d + 4.0 * nkv * d + 3.0 * f;
    (context, block_tokens(cfg, q) * rows * elem)
}

fn block_tokens(cfg: &DFlashConfig, q: MemoryQuery) -> f64 {
    q.batch as f64 * q.anchors_per_seq as f64 * cfg.block_size as f64
}

pub fn estimate(cfg: &DFlashConfig, q: MemoryQuery, elem: f64, checkpoint_layers: bool) -> SectionMemory {
    let params: i64 = cfg.parameter_shapes().iter().map(|(_, s)| s.iter().product::<i64>()).sum();
    let (h, layers) = (cfg.hidden_size as f64, cfg.num_hidden_layers as f64);
    let n_feat = cfg.dflash_config.target_layer_ids.len() as f64;
    let tokens = q.batch as f64 * q.seq_len as f64;
    let features = tokens * (n_feat + 2.0) * h * elem;
    let (context, blocks) = layer(cfg, q, elem);
    let inputs = block_tokens(cfg, q) * h * elem;
    let (kept_context, kept_blocks) = match checkpoint_layers {
        true => (context, blocks + layers * inputs),
        false => (layers * context, layers * blocks),
    };
    let part = MemoryPart::new;
    SectionMemory {
        parts: vec![
            part("drafter weights", params as f64 * elem, MemoryScale::Fixed),
            part("drafter gradients", params as f64 * elem, MemoryScale::Fixed),
            part("target features and drafter context", features + kept_context, MemoryScale::Batch),
            part("drafter activations (blocks)", kept_blocks, MemoryScale::BatchAnchors),
        ]
        .into(),
        trained_parameters: params as u64,
        checkpointed_bytes: (!checkpoint_layers)
            .then_some((features + context + blocks + layers * inputs).round() as u64)
            .into(),
        ..SectionMemory::default()
    }
}
