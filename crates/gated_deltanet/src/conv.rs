//! The short causal conv of a Gated DeltaNet layer (depthwise over channels, along time).

use kernels::{causal_conv as conv_kernel, nvrtc};
use std::sync::atomic::AtomicBool;
use tch::Tensor;

/// Depthwise conv over time with no padding: x [B, L+K-1, C], w [C, 1, K] or [C, K] -> [B, L, C],
/// out_t = sum_j w_j x_{t+j}, so w_{K-1} weighs step t itself (torch's causal conv1d). The
/// caller puts the K-1 rows of history in front (zeros at a sequence's start, the cached rows
/// when continuing). One multiply and K-1 fused multiply-adds, each a pass in the input's
/// layout (no transposes to [B, C, L]).
pub fn depthwise_conv(x: &Tensor, w: &Tensor) -> Tensor {
    let w = if w.dim() == 3 { w.squeeze_dim(1) } else { w.shallow_clone() };
    let k = w.size()[1];
    let l = x.size()[1] - k + 1;
    let w = w.to_kind(x.kind()); // [C, K]
    (1..k).fold(x.narrow(1, 0, l) * w.select(1, 0), |acc, j| acc.addcmul(&x.narrow(1, j, l), &w.select(1, j)))
}

/// silu(conv) of `x` [B, L, C] after its K-1 rows of `history` [B, K-1, C], w [C, K]: what a
/// layer feeds its q, k and v from. Without autograd on a GPU in bf16 one kernel
/// (`kernels::causal_conv`: one pass, an fp32 sum rounded once); elsewhere the concatenation and
/// [`depthwise_conv`]. A kernel that fails is reported once and not tried again.
pub fn conv_silu(history: &Tensor, x: &Tensor, w: &Tensor) -> Tensor {
    static FAILED: AtomicBool = AtomicBool::new(false);
    let grad = history.requires_grad() || x.requires_grad() || w.requires_grad();
    if !grad && conv_kernel::applies(x) {
        if let Some(out) = nvrtc::try_kernel(&FAILED, "the fused causal conv", || conv_kernel::forward(history, x, w)) {
            return out;
        }
    }
    depthwise_conv(&Tensor::cat(&[history, x], 1), w).silu()
}

/// The conv with K-1 zero rows of history: a sequence from its start. x [B, L, C] -> [B, L, C].
pub fn causal_conv(x: &Tensor, w: &Tensor) -> Tensor {
    let k = *w.size().last().expect("conv weight has a kernel dim");
    depthwise_conv(&x.constant_pad_nd([0, 0, k - 1, 0]), w)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn depthwise_conv_is_torch_causal_conv1d() {
        tch::manual_seed(6);
        let x = Tensor::randn([2, 9, 5], (Kind::Float, Device::Cpu));
        let w = Tensor::randn([5, 1, 4], (Kind::Float, Device::Cpu));
        // torch: conv1d over [B, C, L] with K-1 zeros of left padding, groups = C.
        let want =
            x.transpose(1, 2).constant_pad_nd([3, 0]).conv1d(&w, None::<Tensor>, [1], [0], [1], 5).transpose(1, 2);
        let got = depthwise_conv(&x.constant_pad_nd([0, 0, 3, 0]), &w);
        assert!((&got - &want).abs().max().double_value(&[]) < 1e-5);
        assert!(causal_conv(&x, &w.squeeze_dim(1)).equal(&got));
        // The history really is read: continuing from the first 6 rows equals the whole.
        let tail = depthwise_conv(&x.narrow(1, 3, 6), &w);
        assert!((tail - want.narrow(1, 6, 3)).abs().max().double_value(&[]) < 1e-5);
    }

    /// On a GPU (`make gpu-test`): the fused conv + SiLU against the composite in fp32, from
    /// zeros and from a history, with x a column slice of a wider tensor (as the input
    /// projections give it); in bf16 its error is no larger than the bf16 composite's.
    #[test]
    #[ignore = "needs a CUDA device: make gpu-test"]
    fn fused_conv_silu_matches_the_composite_on_cuda() {
        let dev = kernels::cuda_test_device();
        let _guard = tch::no_grad_guard();
        tch::manual_seed(12);
        let (b, l, c, k) = (2, 77, 300, 4);
        let wide = Tensor::randn([b, l, c + 40], (Kind::Float, dev)).to_kind(Kind::BFloat16);
        let x = wide.narrow(2, 8, c);
        let w = (Tensor::randn([c, k], (Kind::Float, dev)) * 0.5).to_kind(Kind::BFloat16);
        for history in [
            Tensor::zeros([b, k - 1, c], (Kind::BFloat16, dev)),
            Tensor::randn([b, k - 1, c], (Kind::Float, dev)).to_kind(Kind::BFloat16),
        ] {
            let f = |t: &Tensor| t.to_kind(Kind::Float);
            let want = depthwise_conv(&Tensor::cat(&[f(&history), f(&x)], 1), &f(&w)).silu();
            let composite = kernels::nvrtc::with_enabled(false, || conv_silu(&history, &x, &w));
            let fused = kernels::nvrtc::with_enabled(true, || conv_silu(&history, &x, &w));
            assert_eq!(fused.size(), vec![b, l, c]);
            let err = |t: &Tensor| (f(t) - &want).abs().max().double_value(&[]);
            let (e_fused, e_comp) = (err(&fused), err(&composite));
            eprintln!("conv + silu vs fp32: fused {e_fused:.2e}, composite {e_comp:.2e}");
            assert!(e_fused <= e_comp + 1e-6, "fused error {e_fused:.2e} above the composite's {e_comp:.2e}");
            assert!(e_fused < 0.05, "fused error {e_fused:.2e}");
            assert!(!fused.equal(&composite), "the fused kernel did not run (bit-identical to the composite)");
        }
    }
}
