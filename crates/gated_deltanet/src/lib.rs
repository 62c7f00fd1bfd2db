//! Gated DeltaNet's math in tch, shared by the GDN drafter (`drafter_gdn`) and the hybrid
//! targets (`target_hf`: Qwen3.5 / Qwen3.6 `linear_attn` layers):
//! - [`delta_rule`]: the gated delta rule step by step (the reference), in chunked WY form (a few
//!   batched matmuls a chunk, used for any sequence longer than a step) and the state after any
//!   prefix;
//! - [`conv`]: the short causal depthwise conv that feeds it;
//! - [`l2norm`]: the q/k normalisation FLA and transformers apply before the rule;
//! - [`fused`]: a hybrid target's layer on a GPU, the rule straight from the conv output and the
//!   output's gated RMSNorm as kernels.
//!
//! Layouts, gates and the recurrence are described in docs/GDN.md.

pub mod conv;
pub mod delta_rule;
pub mod fused;

pub use conv::{causal_conv, conv_silu, depthwise_conv};
pub use delta_rule::{chunked, chunked_with, naive, states_at, unit_lower_inverse, Precision};
pub use fused::{chunked_from_conv, gated_rms_norm};

use tch::{Kind, Tensor};

/// x / sqrt(sum(x^2) + 1e-6) over the last dim in fp32 (FLA's `l2norm`, transformers' too).
pub fn l2norm(x: &Tensor) -> Tensor {
    let x = x.to_kind(Kind::Float);
    &x * (x.square().sum_dim_intlist(-1, true, Kind::Float) + 1e-6).rsqrt()
}
