//! `torch::autograd::backward` with output gradients, through csrc/autograd.cpp (tch's
//! `backward` takes none): what a drafter running its own backward hands autograd.

use crate::ffi::{dflash_backward, dflash_clear_grad, dflash_empty_pinned_like, with_error_buffer};
use std::ffi::c_void;
use tch::Tensor;

/// An uninitialised tensor of `t`'s shape and kind (`t` on any device) in pinned CPU memory, for
/// asynchronous copies between it and a GPU. Needs a CUDA runtime.
pub fn empty_pinned_like(t: &Tensor) -> Result<Tensor, String> {
    let mut out = std::ptr::null_mut::<c_void>();
    // SAFETY: a tch handle is an at::Tensor*; on success the shim returns a new at::Tensor* that
    // the Tensor below owns; the error buffer has the length passed.
    with_error_buffer(|err, err_len| unsafe {
        dflash_empty_pinned_like(t.as_ptr() as *const c_void, &mut out, err, err_len)
    })?;
    // SAFETY: see above.
    Ok(unsafe { Tensor::from_ptr(out as _) })
}

/// A copy of `t` (a CPU tensor) in pinned memory.
pub fn pinned(t: &Tensor) -> Result<Tensor, String> {
    let mut p = empty_pinned_like(t)?;
    p.copy_(t);
    Ok(p)
}

/// `t` on `device` without the host waiting: a CPU tensor goes through pinned memory with a
/// non-blocking copy (a copy from pageable memory first waits for all the GPU work queued).
pub fn to_device_async(t: &Tensor, device: tch::Device) -> Tensor {
    match (t.device(), device.is_cuda()) {
        (tch::Device::Cpu, true) => match pinned(t) {
            Ok(p) => p.to_device_(device, t.kind(), true, false),
            Err(_) => t.to_device(device),
        },
        _ => t.to_device(device),
    }
}

/// Drop `t`'s gradient, as PyTorch's `zero_grad()` does by default (set_to_none): between a step
/// and the next backward the gradients then take no memory, which lowers the peak (the forward's
/// activations and last step's gradients never coexist); the next backward allocates them anew.
pub fn clear_grad(t: &Tensor) {
    // SAFETY: a tch handle is an at::Tensor*; the shim resets its gradient slot.
    unsafe { dflash_clear_grad(t.as_ptr() as *const c_void) }
}

/// One backward pass from several outputs, each with its gradient (same shape and dtype):
/// gradients accumulate into the leaves as `torch.autograd.backward(tensors, grads)` does. An
/// output may be a leaf itself, which then just receives its gradient.
pub fn backward(pairs: &[(&Tensor, &Tensor)]) -> Result<(), String> {
    let ts: Vec<*const c_void> = pairs.iter().map(|(t, _)| t.as_ptr() as *const c_void).collect();
    let gs: Vec<*const c_void> = pairs.iter().map(|(_, g)| g.as_ptr() as *const c_void).collect();
    // SAFETY: tch handles are at::Tensor*; the shim reads n of each; the error buffer has the
    // length passed.
    with_error_buffer(|err, err_len| unsafe { dflash_backward(ts.as_ptr(), gs.as_ptr(), pairs.len(), err, err_len) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn gradients_of_several_outputs_add_up_in_the_leaves() {
        let x = Tensor::from_slice(&[1.0f64, 2.0, 3.0]).set_requires_grad(true);
        let w = Tensor::from_slice(&[0.5f64, -1.0]).set_requires_grad(true);
        let y1 = &x * 2.0; // dy1/dx = 2
        let y2 = x.square(); // dy2/dx = 2x
        let g1 = Tensor::from_slice(&[1.0f64, 10.0, 100.0]);
        let g2 = Tensor::ones([3], (Kind::Double, Device::Cpu));
        let gw = Tensor::from_slice(&[7.0f64, 8.0]);
        backward(&[(&y1, &g1), (&y2, &g2), (&w, &gw)]).unwrap();
        assert_eq!(Vec::<f64>::try_from(x.grad()).unwrap(), vec![2.0 + 2.0, 20.0 + 4.0, 200.0 + 6.0]);
        assert_eq!(Vec::<f64>::try_from(w.grad()).unwrap(), vec![7.0, 8.0], "a leaf output takes its gradient");
        let err = backward(&[(&y1, &Tensor::ones([2], (Kind::Double, Device::Cpu)))]).unwrap_err();
        assert!(!err.is_empty());
        clear_grad(&x);
        assert!(!x.grad().defined(), "cleared");
        backward(&[(&(&x * 3.0), &g2)]).unwrap();
        assert_eq!(Vec::<f64>::try_from(x.grad()).unwrap(), vec![3.0; 3], "a fresh gradient, not added to the old one");
    }
}
