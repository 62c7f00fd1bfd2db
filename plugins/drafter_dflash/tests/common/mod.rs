//! What the drafter's integration tests share.

use plugin_api::{
    abi_stable::std_types::{RNone, RString},
    TargetSpec,
};

/// A 4-layer target small enough for drafters built in milliseconds.
pub fn tiny_target() -> TargetSpec {
    TargetSpec {
        architecture: RString::from("llama"),
        num_hidden_layers: 4,
        hidden_size: 16,
        vocab_size: 32,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        head_dim: 8,
        intermediate_size: 24,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-6,
        bos_token_id: RNone,
        eos_token_id: 1,
        pad_token_id: RNone,
        chat_template: RString::new(),
        source: RString::from("test"),
        source_sha256: RString::new(),
    }
}
