//! libtorch's multi-tensor optimizer ops through csrc/fused_adamw.cpp (tch binds neither): fused
//! AdamW, and the scaling of every gradient by a clip coefficient.

use crate::ffi::{dflash_foreach_mul_, dflash_fused_adamw, with_error_buffer};
use std::ffi::c_void;
use tch::Tensor;

/// One AdamW step over every tensor at once, as `torch.optim.AdamW(fused=True)` does: `params`,
/// `grads` and the moments are equal-length lists of same-shape tensors of one dtype and device;
/// `step` a float scalar tensor on that device holding the step number (counted from 1).
#[allow(clippy::too_many_arguments)]
pub fn fused_adamw(
    params: &[Tensor], grads: &[Tensor], exp_avgs: &[Tensor], exp_avg_sqs: &[Tensor], step: &Tensor,
    lr: f64, betas: [f64; 2], weight_decay: f64, eps: f64,
) -> Result<(), String> {
    let n = params.len();
    if [grads.len(), exp_avgs.len(), exp_avg_sqs.len()].iter().any(|&l| l != n) {
        return Err(format!("fused AdamW: {n} parameters but {} / {} / {} gradients / moments", grads.len(), exp_avgs.len(), exp_avg_sqs.len()));
    }
    let ptrs = |ts: &[Tensor]| ts.iter().map(|t| t.as_ptr() as *const c_void).collect::<Vec<_>>();
    let (p, g, m, v) = (ptrs(params), ptrs(grads), ptrs(exp_avgs), ptrs(exp_avg_sqs));
    // SAFETY: tch handles are at::Tensor*; the shim reads n of each list and updates the
    // tensors in place; the error buffer has the length passed.
    with_error_buffer(|err, err_len| unsafe {
        dflash_fused_adamw(
            p.as_ptr(), g.as_ptr(), m.as_ptr(), v.as_ptr(), n, step.as_ptr() as *const c_void, lr, betas[0], betas[1],
            weight_decay, eps, err, err_len,
        )
    })
}

/// Every tensor times `scale` (a one-element tensor on their device, no host synchronisation), in
/// place, as one multi-tensor kernel (torch's `_foreach_mul_`).
pub fn foreach_mul_(tensors: &[Tensor], scale: &Tensor) -> Result<(), String> {
    let ptrs: Vec<*const c_void> = tensors.iter().map(|t| t.as_ptr() as *const c_void).collect();
    // SAFETY: tch handles are at::Tensor*; the shim reads n of them and scales them in place.
    with_error_buffer(|err, err_len| unsafe { dflash_foreach_mul_(ptrs.as_ptr(), ptrs.len(), scale.as_ptr() as *const c_void, err, err_len) })
}
