//! Tensors across the ABI.
//!
//! Ownership: a [`TensorHandle`] owns one reference to an `at::Tensor` (the same thing a
//! `tch::Tensor` owns). Dropping it releases that reference through libtorch, which is shared by
//! the host and every plugin (one libtorch per process), so either side may drop it.
//! Handles are shallow: storage and autograd history are shared, never copied.

use abi_stable::{std_types::RString, StableAbi};
use std::{ffi::c_void, mem::ManuallyDrop};
use tch::Tensor;

/// An owned `at::Tensor*`.
#[repr(transparent)]
#[derive(StableAbi)]
pub struct TensorHandle {
    raw: *mut c_void,
}

// at::Tensor is a refcounted pointer; libtorch's refcounts are atomic.
unsafe impl Send for TensorHandle {}
unsafe impl Sync for TensorHandle {}

impl TensorHandle {
    /// Take ownership of `t`'s reference.
    pub fn new(t: Tensor) -> Self {
        let t = ManuallyDrop::new(t);
        Self { raw: t.as_ptr() as *mut c_void }
    }

    /// Give the reference back as a `tch::Tensor`.
    pub fn into_tensor(self) -> Tensor {
        let me = ManuallyDrop::new(self);
        // SAFETY: `raw` came from a live tch::Tensor whose ownership this handle took.
        unsafe { Tensor::from_ptr(me.raw as *mut _) }
    }

    /// A new reference to the same tensor (shares storage and autograd history).
    pub fn tensor(&self) -> Tensor {
        // SAFETY: `raw` is a live at::Tensor* for as long as `self` lives.
        unsafe { Tensor::clone_from_ptr(self.raw as *mut _) }
    }
}

impl Clone for TensorHandle {
    fn clone(&self) -> Self {
        Self::new(self.tensor())
    }
}

impl Drop for TensorHandle {
    fn drop(&mut self) {
        // SAFETY: as in `into_tensor`; dropping the Tensor releases the reference.
        drop(unsafe { Tensor::from_ptr(self.raw as *mut _) });
    }
}

impl std::fmt::Debug for TensorHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = self.tensor();
        write!(f, "TensorHandle({:?}, {:?}, {:?})", t.size(), t.kind(), t.device())
    }
}

impl From<Tensor> for TensorHandle {
    fn from(t: Tensor) -> Self {
        Self::new(t)
    }
}

/// A tensor with its checkpoint name (parameters, optimizer state).
#[repr(C)]
#[derive(StableAbi, Clone, Debug)]
pub struct NamedTensor {
    pub name: RString,
    pub tensor: TensorHandle,
}

impl NamedTensor {
    pub fn new(name: impl Into<String>, t: Tensor) -> Self {
        Self { name: RString::from(name.into()), tensor: TensorHandle::new(t) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handle_round_trip_shares_storage_and_autograd() {
        let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0]).set_requires_grad(true);
        let h = TensorHandle::new(x.shallow_clone());
        let h2 = h.clone();
        let y = (h2.into_tensor() * 2.0).sum(tch::Kind::Float);
        y.backward();
        assert_eq!(Vec::<f32>::try_from(x.grad()).unwrap(), vec![2.0, 2.0, 2.0]);
        // Writes through one handle are seen through the other: no copy was made.
        tch::no_grad(|| {
            let _ = h.tensor().fill_(7.0);
        });
        assert_eq!(Vec::<f32>::try_from(&x).unwrap(), vec![7.0, 7.0, 7.0]);
    }
}
