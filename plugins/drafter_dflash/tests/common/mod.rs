//! What the drafter's integration tests share.

use plugin_api::TargetSpec;
use test_support::TinySpec;

/// A 4-layer target small enough for drafters built in milliseconds.
pub fn tiny_target() -> TargetSpec {
    TargetSpec {
        num_hidden_layers: 4,
        hidden_size: 16,
        vocab_size: 32,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        intermediate_size: 24,
        eos_token_id: 1,
        ..TargetSpec::tiny()
    }
}
