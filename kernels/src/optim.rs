//! libtorch's fused multi-tensor AdamW through csrc/fused_adamw.cpp (tch does not bind it).

use std::ffi::{c_char, c_int, c_void, CStr};
use tch::Tensor;

extern "C" {
    fn dflash_fused_adamw(
        params: *const *const c_void, grads: *const *const c_void, exp_avgs: *const *const c_void,
        exp_avg_sqs: *const *const c_void, n: usize, step: *const c_void, lr: f64, beta1: f64, beta2: f64,
        weight_decay: f64, eps: f64, err: *mut c_char, err_len: usize,
    ) -> c_int;
}

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
    let mut err = [0 as c_char; 1024];
    // SAFETY: tch handles are at::Tensor*; the shim reads n of each list and updates the
    // tensors in place; `err` is a buffer of the length passed.
    let rc = unsafe {
        dflash_fused_adamw(
            p.as_ptr(), g.as_ptr(), m.as_ptr(), v.as_ptr(), n, step.as_ptr() as *const c_void, lr, betas[0], betas[1],
            weight_decay, eps, err.as_mut_ptr(), err.len(),
        )
    };
    if rc == 0 {
        return Ok(());
    }
    // SAFETY: on failure the shim wrote a NUL-terminated message into `err`.
    Err(unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy().lines().next().unwrap_or("").to_string())
}
