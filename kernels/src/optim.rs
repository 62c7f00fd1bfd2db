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
    params: &[Tensor],
    grads: &[Tensor],
    exp_avgs: &[Tensor],
    exp_avg_sqs: &[Tensor],
    step: &Tensor,
    lr: f64,
    betas: [f64; 2],
    weight_decay: f64,
    eps: f64,
) -> Result<(), String> {
    let n = params.len();
    if [grads.len(), exp_avgs.len(), exp_avg_sqs.len()].iter().any(|&l| l != n) {
        return Err(format!(
            "fused AdamW: {n} parameters but {} / {} / {} gradients / moments",
            grads.len(),
            exp_avgs.len(),
            exp_avg_sqs.len()
        ));
    }
    let ptrs = |ts: &[Tensor]| ts.iter().map(|t| t.as_ptr() as *const c_void).collect::<Vec<_>>();
    let (p, g, m, v) = (ptrs(params), ptrs(grads), ptrs(exp_avgs), ptrs(exp_avg_sqs));
    // SAFETY: tch handles are at::Tensor*; the shim reads n of each list and updates the
    // tensors in place; the error buffer has the length passed.
    with_error_buffer(|err, err_len| unsafe {
        dflash_fused_adamw(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            n,
            step.as_ptr() as *const c_void,
            lr,
            betas[0],
            betas[1],
            weight_decay,
            eps,
            err,
            err_len,
        )
    })
}

/// Every tensor times `scale` (a one-element tensor on their device, no host synchronisation), in
/// place, as one multi-tensor kernel (torch's `_foreach_mul_`).
fn foreach_mul_(tensors: &[Tensor], scale: &Tensor) -> Result<(), String> {
    let ptrs: Vec<*const c_void> = tensors.iter().map(|t| t.as_ptr() as *const c_void).collect();
    // SAFETY: tch handles are at::Tensor*; the shim reads n of them and scales them in place.
    with_error_buffer(|err, err_len| unsafe {
        dflash_foreach_mul_(ptrs.as_ptr(), ptrs.len(), scale.as_ptr() as *const c_void, err, err_len)
    })
}

/// Every tensor times `scale` in place (a one-element tensor, no host synchronisation): one
/// multi-tensor kernel per dtype, with `scale` in that dtype (libtorch takes its fast multi-tensor
/// path only for a scalar of the tensors' own dtype); a kernel a tensor where that fails.
pub fn scale_all_(tensors: &[Tensor], scale: &Tensor) {
    let mut kinds: Vec<tch::Kind> = vec![];
    for t in tensors {
        if !kinds.contains(&t.kind()) {
            kinds.push(t.kind());
        }
    }
    for kind in kinds {
        let group: Vec<Tensor> = tensors.iter().filter(|t| t.kind() == kind).map(|t| t.shallow_clone()).collect();
        let scale = scale.to_kind(kind);
        if foreach_mul_(&group, &scale).is_err() {
            for mut t in group {
                let _ = t.g_mul_(&scale);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind, Tensor};

    /// Tensors of two dtypes, each times the scale in its own dtype, as one multiply each would.
    #[test]
    fn scale_all_scales_every_tensor_in_its_dtype() {
        tch::manual_seed(6);
        let ts = [
            Tensor::randn([5, 3], (Kind::Float, Device::Cpu)),
            Tensor::randn([4], (Kind::Double, Device::Cpu)),
            Tensor::randn([2, 2], (Kind::Float, Device::Cpu)),
        ];
        let want: Vec<Tensor> = ts.iter().map(|t| t * 0.37).collect();
        super::scale_all_(&ts, &Tensor::from(0.37f32));
        for (t, w) in ts.iter().zip(&want) {
            assert_eq!(t.kind(), w.kind());
            assert!((t - w).abs().max().double_value(&[]) < 1e-6, "{t} vs {w}");
        }
    }
}
