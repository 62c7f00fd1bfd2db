//! The decoder's config, read from an HF `config.json` (field names are HF's) or from GGUF
//! metadata (`{arch}.block_count`, ...).

use crate::gguf::{GgufError, GgufFile};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecoderConfig {
    /// `llama`, `qwen2` or `qwen3`.
    pub model_type: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    pub vocab_size: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Biases on q/k/v (Qwen2 has them; HF's qwen2 config does not say so, the model does).
    #[serde(default)]
    pub attention_bias: Option<bool>,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Option<EosId>,
    #[serde(default)]
    pub pad_token_id: Option<u32>,
}

/// HF allows one EOS id or a list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum EosId {
    One(u32),
    Many(Vec<u32>),
}

fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10000.0
}

impl DecoderConfig {
    pub fn num_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        // 0 heads is refused by `validate`; until then it must not divide by zero.
        self.head_dim.unwrap_or(self.hidden_size.checked_div(self.num_attention_heads).unwrap_or(0))
    }

    pub fn qkv_bias(&self) -> bool {
        self.attention_bias.unwrap_or(self.model_type == "qwen2")
    }

    /// Qwen3 normalises q and k per head before RoPE.
    pub fn qk_norm(&self) -> bool {
        self.model_type == "qwen3"
    }

    pub fn eos(&self) -> Option<u32> {
        match &self.eos_token_id {
            Some(EosId::One(id)) => Some(*id),
            Some(EosId::Many(ids)) => ids.first().copied(),
            None => None,
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        if !["llama", "qwen2", "qwen3"].contains(&self.model_type.as_str()) {
            return Err(format!("model_type `{}` is not supported (llama, qwen2, qwen3)", self.model_type));
        }
        if self.num_attention_heads == 0 {
            return Err("num_attention_heads 0: must be >= 1".into());
        }
        if self.num_kv_heads() == 0 {
            return Err("num_key_value_heads 0: must be >= 1".into());
        }
        if self.num_attention_heads % self.num_kv_heads() != 0 {
            return Err(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads,
                self.num_kv_heads()
            ));
        }
        if self.head_dim() % 2 != 0 {
            return Err(format!("head_dim {} must be even for RoPE", self.head_dim()));
        }
        Ok(())
    }

    /// From GGUF metadata. Vocabulary size is the token list's length.
    pub fn from_gguf(g: &GgufFile) -> Result<Self, GgufError> {
        let arch = g.meta_str("general.architecture")?.to_string();
        let key = |k: &str| format!("{arch}.{k}");
        let heads = g.meta_usize(&key("attention.head_count"))?;
        let hidden = g.meta_usize(&key("embedding_length"))?;
        let head_dim = g.meta_usize(&key("attention.key_length")).ok();
        let vocab = g.meta_str_array("tokenizer.ggml.tokens")?.len();
        Ok(Self {
            model_type: arch.clone(),
            hidden_size: hidden,
            intermediate_size: g.meta_usize(&key("feed_forward_length"))?,
            num_hidden_layers: g.meta_usize(&key("block_count"))?,
            num_attention_heads: heads,
            num_key_value_heads: Some(g.meta_usize(&key("attention.head_count_kv")).unwrap_or(heads)),
            // 0 heads (refused by `validate`) leaves it unset rather than dividing by zero.
            head_dim: head_dim.or(hidden.checked_div(heads)),
            vocab_size: vocab,
            rms_norm_eps: g.meta_f32(&key("attention.layer_norm_rms_epsilon")).map(f64::from).unwrap_or(1e-6),
            rope_theta: g.meta_f32(&key("rope.freq_base")).map(f64::from).unwrap_or(10000.0),
            tie_word_embeddings: g.tensor_info("output.weight").is_none(),
            attention_bias: Some(g.tensor_info("blk.0.attn_q.bias").is_some()),
            bos_token_id: g.meta_u32("tokenizer.ggml.bos_token_id").ok(),
            eos_token_id: g.meta_u32("tokenizer.ggml.eos_token_id").ok().map(EosId::One),
            pad_token_id: g.meta_u32("tokenizer.ggml.padding_token_id").ok(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_heads_are_refused_not_divided_by() {
        let mut c: DecoderConfig = serde_json::from_str(
            r#"{"model_type": "llama", "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 1,
                "num_attention_heads": 0, "vocab_size": 8}"#,
        )
        .unwrap();
        assert_eq!(c.head_dim(), 0);
        assert_eq!(c.validate().unwrap_err(), "num_attention_heads 0: must be >= 1");
        c.num_attention_heads = 2;
        c.num_key_value_heads = Some(0);
        assert_eq!(c.validate().unwrap_err(), "num_key_value_heads 0: must be >= 1");
        c.num_key_value_heads = Some(2);
        c.validate().unwrap();
        assert_eq!(c.head_dim(), 16);
    }
}
