//! Attention kernels for DFlash drafters, with their own backward (libtorch's autograd does not
//! see them; a drafter cuts its graph around them and runs `Drafter::backward`).
//!
//! - `block_attention`: DFlash block attention split into the context part (libtorch's fused
//!   attention with a staircase bias) and each block's own keys, merged exactly.

pub mod block_attention;
