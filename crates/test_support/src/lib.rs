//! What the workspace's tests share, so no test spells out a whole ABI struct (and breaks when
//! the ABI grows a field) and the GGUF test writer exists once:
//! - [`TinySpec`]: `TargetSpec::tiny()` and the real shapes tests resolve drafters against;
//! - [`gguf`]: GGUF v3 bytes from key-values and tensors, remembering where each field sits.
//!
//! A dev-dependency only; nothing here is built into the binary or a plugin.

pub mod gguf;

use plugin_api::{
    abi_stable::std_types::{RNone, RSome, RString},
    TargetSpec,
};

/// Target specs for tests. Tests that need another shape change fields of these
/// (`TargetSpec { hidden_size: 24, ..TargetSpec::tiny() }`).
pub trait TinySpec {
    /// A small llama-like target: 8 layers, hidden 32, 4 heads of 8 (2 KV heads), MLP 48,
    /// vocabulary 64, EOS 2, no pad token.
    fn tiny() -> Self;
    /// SmolLM2-135M-Instruct's shape (30 layers, hidden 576, 9 heads of 64, 3 KV heads; pad = EOS).
    fn smollm2_135m() -> Self;
    /// The Qwen3.6-27B hybrid's shape (64 layers, hidden 5120, gated attention 24 heads of 256,
    /// 4 KV heads), for resolving drafter configs against; nothing of that size is built.
    fn qwen3_6_27b() -> Self;
}

impl TinySpec for TargetSpec {
    fn tiny() -> Self {
        TargetSpec {
            architecture: RString::from("llama"),
            num_hidden_layers: 8,
            hidden_size: 32,
            vocab_size: 64,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 8,
            intermediate_size: 48,
            rope_theta: 10000.0,
            rms_norm_eps: 1e-6,
            bos_token_id: RNone,
            eos_token_id: 2,
            pad_token_id: RNone,
            chat_template: RString::new(),
            source: RString::from("test"),
            source_sha256: RString::new(),
        }
    }

    fn smollm2_135m() -> Self {
        TargetSpec {
            num_hidden_layers: 30,
            hidden_size: 576,
            vocab_size: 49152,
            num_attention_heads: 9,
            num_key_value_heads: 3,
            head_dim: 64,
            intermediate_size: 1536,
            rope_theta: 100000.0,
            eos_token_id: 2,
            pad_token_id: RSome(2),
            ..Self::tiny()
        }
    }

    fn qwen3_6_27b() -> Self {
        TargetSpec {
            architecture: RString::from("qwen3_5"),
            num_hidden_layers: 64,
            hidden_size: 5120,
            vocab_size: 248320,
            num_attention_heads: 24,
            num_key_value_heads: 4,
            head_dim: 256,
            intermediate_size: 17408,
            rope_theta: 1e7,
            eos_token_id: 248044,
            ..Self::tiny()
        }
    }
}
