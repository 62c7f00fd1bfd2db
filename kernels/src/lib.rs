//! Kernels and libtorch entry points that tch does not bind, through small C++ shims (csrc/).
//!
//! - `autograd`: backward from several outputs with their gradients; gradients dropped; pinned
//!   copies.
//! - `block_attention`: DFlash block attention split into the context part (libtorch's fused
//!   attention with a staircase bias) and each block's own keys, merged exactly, with its own
//!   backward (autograd does not see it: a drafter cuts its graph around it and runs
//!   `Drafter::backward`).
//! - `optim`: libtorch's fused multi-tensor AdamW.
//! - `profiler`: libtorch's Kineto profiler (Chrome traces with named ranges), for the benches.

pub mod autograd;
pub mod block_attention;
pub mod optim;
pub mod profiler;
