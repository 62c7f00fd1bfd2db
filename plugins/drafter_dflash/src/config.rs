//! The drafter's config: z-lab's `config.json` fields (DFLASH.md), so a checkpoint's config
//! reads straight in and our export reads straight out.

use serde::{Deserialize, Serialize};

pub use drafter_layers::dflash::DFlashSection;

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

impl DFlashConfig {
    pub fn dense_shape(&self) -> drafter_layers::layers::DenseShape {
        drafter_layers::layers::DenseShape {
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            rope_theta: self.rope_theta,
            rms_norm_eps: self.rms_norm_eps,
        }
    }
}
