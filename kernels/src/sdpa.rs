//! libtorch's scaled-dot-product attention over grouped heads, kept on a fused kernel when a mask
//! is given. On CUDA, grouped heads (fewer key/value heads than query heads) with a mask leave
//! libtorch only its unfused math kernel: flash attention takes no mask, the memory-efficient
//! kernel no groups. Giving every query head its group's keys and values costs a copy of each
//! and lets the memory-efficient kernel run.

use tch::Tensor;

/// softmax(q k^T scale + mask) v over grouped heads: q [B, H, L, D], k [B, Hkv, T, D], v [B,
/// Hkv, T, Dv] -> [B, H, L, Dv]; query head i reads key/value head i / (H / Hkv). `mask` bool,
/// broadcast to [B, H, L, T], true = visible; without one, `causal` or every key.
pub fn grouped(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>, causal: bool, scale: f64) -> Tensor {
    let h = q.size()[1];
    if mask.is_some() && q.device().is_cuda() && k.size()[1] < h {
        let every_head = |x: &Tensor| {
            let s = x.size();
            x.unsqueeze(2).expand([s[0], s[1], h / s[1], s[2], s[3]], false).reshape([s[0], h, s[2], s[3]])
        };
        return Tensor::scaled_dot_product_attention(
            q,
            &every_head(k),
            &every_head(v),
            mask,
            0.0,
            false,
            Some(scale),
            false,
        );
    }
    Tensor::scaled_dot_product_attention(q, k, v, mask, 0.0, causal, Some(scale), true)
}
