//! The short causal conv of a Gated DeltaNet layer (depthwise over channels, along time).

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
        let want = x.transpose(1, 2).constant_pad_nd([3, 0]).conv1d(&w, None::<Tensor>, [1], [0], [1], 5).transpose(1, 2);
        let got = depthwise_conv(&x.constant_pad_nd([0, 0, 3, 0]), &w);
        assert!((&got - &want).abs().max().double_value(&[]) < 1e-5);
        assert!(causal_conv(&x, &w.squeeze_dim(1)).equal(&got));
        // The history really is read: continuing from the first 6 rows equals the whole.
        let tail = depthwise_conv(&x.narrow(1, 3, 6), &w);
        assert!((tail - want.narrow(1, 6, 3)).abs().max().double_value(&[]) < 1e-5);
    }
}
