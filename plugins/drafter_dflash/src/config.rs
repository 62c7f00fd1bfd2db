//! The drafter's config: z-lab's `config.json` fields (DFLASH.md), so a checkpoint's config
//! reads straight in and our export reads straight out.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DFlashSection {
    pub mask_token_id: u32,
    pub target_layer_ids: Vec<u32>,
}

/// z-lab DFlash `config.json` (a Qwen3 config plus DFlash fields).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DFlashConfig {
    #[serde(default = "default_architectures")]
    pub architectures: Vec<String>,
    #[serde(default = "default_model_type")]
    pub model_type: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    pub block_size: usize,
    pub num_target_layers: usize,
    pub dflash_config: DFlashSection,
    #[serde(default)]
    pub layer_types: Vec<String>,
    #[serde(default)]
    pub sliding_window: Option<usize>,
    #[serde(default = "default_dtype")]
    pub torch_dtype: String,
}

fn default_architectures() -> Vec<String> {
    vec!["DFlashDraftModel".into()]
}
fn default_model_type() -> String {
    "qwen3".into()
}
fn default_act() -> String {
    "silu".into()
}
fn default_max_pos() -> usize {
    32768
}
fn default_dtype() -> String {
    "bfloat16".into()
}

/// Target layers a drafter reads: `round(1 + i*(L-4)/(n-1))` for i in 0..n (`[L/2]` for n = 1),
/// spreading the features from shallow to deep (DFLASH.md).
pub fn default_target_layer_ids(num_target_layers: usize, n: usize) -> Vec<u32> {
    if n == 1 {
        return vec![(num_target_layers / 2) as u32];
    }
    let l = num_target_layers as f64;
    (0..n)
        .map(|i| (1.0 + i as f64 * (l - 4.0) / (n as f64 - 1.0)).round() as u32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_ids_match_published_drafters() {
        // Qwen3-8B (36 layers): z-lab's [1, 9, 17, 25, 33]; Qwen3.6-27B (64): [1, 16, 31, 46, 61].
        assert_eq!(default_target_layer_ids(36, 5), vec![1, 9, 17, 25, 33]);
        assert_eq!(default_target_layer_ids(64, 5), vec![1, 16, 31, 46, 61]);
        assert_eq!(default_target_layer_ids(30, 1), vec![15]);
    }
}
