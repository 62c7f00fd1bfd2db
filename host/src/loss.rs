//! The DFlash loss (DFLASH.md, "Training"): same-position labels, the anchor itself excluded,
//! weights exp(-(k-1)/gamma) normalised by their sum over counted positions; per-position top-1
//! accuracy for tau-hat. Logits are formed only for positions that count, through the target's
//! frozen LM head.

use plugin_api::tch::{Kind, Tensor};

pub struct LossOut {
    /// Scalar, differentiable w.r.t. the block hidden states.
    pub loss: Tensor,
    /// Per block position k = 1..Bk-1: correct top-1 predictions and counted labels.
    pub correct: Vec<i64>,
    pub count: Vec<i64>,
}

pub struct LossInput<'a> {
    /// [B, A*Bk, H] drafter output after its final norm.
    pub block_hidden: &'a Tensor,
    /// [V, H] the target's output head.
    pub lm_head: &'a Tensor,
    /// [B, S] int64 tokens and response mask.
    pub input_ids: &'a Tensor,
    pub loss_mask: &'a Tensor,
    /// [B, A] anchor positions and validity.
    pub anchors: &'a Tensor,
    pub anchor_valid: &'a Tensor,
    pub block_size: i64,
    pub gamma: f64,
}

/// Default gamma by block size (DFLASH.md: 7 for 16, 5 for 10, 4 for 8), linear in between.
pub fn default_gamma(block_size: usize) -> f64 {
    match block_size {
        16 => 7.0,
        10 => 5.0,
        8 => 4.0,
        b => (b as f64 * 0.5 - 1.0).max(1.0),
    }
}

pub fn dflash_loss(x: &LossInput) -> LossOut {
    let (b, s) = (x.input_ids.size()[0], x.input_ids.size()[1]);
    let a = x.anchors.size()[1];
    let bk = x.block_size;
    let device = x.block_hidden.device();
    let hidden = *x.block_hidden.size().last().expect("hidden dim");

    // 1. Labels: block position k of anchor a predicts token[a + k].
    let k = Tensor::arange(bk, (Kind::Int64, device));
    let pos = x.anchors.to_device(device).unsqueeze(-1) + &k; // [B, A, Bk]
    let in_range = pos.lt(s);
    let pos_flat = pos.clamp_max(s - 1).view([b, a * bk]);
    let labels = x.input_ids.to_device(device).gather(1, &pos_flat, false).view([b, a, bk]);
    let in_response = x.loss_mask.to_device(device).gather(1, &pos_flat, false).view([b, a, bk]).gt(0);
    let valid = x
        .anchor_valid
        .to_device(device)
        .unsqueeze(-1)
        .logical_and(&in_range)
        .logical_and(&in_response)
        .logical_and(&k.gt(0).view([1, 1, bk])); // position 0 is the anchor itself

    // 2. Weights exp(-(k-1)/gamma).
    let w = ((k.to_kind(Kind::Float) - 1.0) / -x.gamma).exp().view([1, 1, bk]);
    let weights = valid.to_kind(Kind::Float) * w;

    // 3. Logits and CE for counted positions only.
    let idx = valid.flatten(0, -1).nonzero().squeeze_dim(-1);
    let m = idx.size()[0];
    if m == 0 {
        let zero = x.block_hidden.sum(Kind::Float) * 0.0;
        return LossOut { loss: zero, correct: vec![0; (bk - 1) as usize], count: vec![0; (bk - 1) as usize] };
    }
    let h = x.block_hidden.reshape([-1, hidden]).index_select(0, &idx);
    let logits = h.matmul(&x.lm_head.tr()).to_kind(Kind::Float); // [M, V]
    let target = labels.flatten(0, -1).index_select(0, &idx);
    let ce = -logits.log_softmax(-1, Kind::Float).gather(1, &target.unsqueeze(1), false).squeeze_dim(1);
    let wsel = weights.flatten(0, -1).index_select(0, &idx);
    let loss = (ce * &wsel).sum(Kind::Float) / wsel.sum(Kind::Float);

    // 4. Per-position accuracy counts.
    let kk = idx.remainder(bk);
    let hit = logits.argmax(-1, false).eq_tensor(&target).to_kind(Kind::Int64);
    let correct = Tensor::zeros([bk], (Kind::Int64, device)).index_add(0, &kk, &hit);
    let count = kk.bincount::<&Tensor>(None, bk);
    let to_vec = |t: Tensor| -> Vec<i64> { Vec::try_from(t.to_device(plugin_api::tch::Device::Cpu).narrow(0, 1, bk - 1)).expect("counts") };
    LossOut { loss, correct: to_vec(correct), count: to_vec(count) }
}

/// tau-hat = 1 + sum_k prod_{i<=k} acc_i (DFLASH.md, "Metrics").
pub fn tau_hat(acc: &[f64]) -> f64 {
    let mut prod = 1.0;
    let mut tau = 1.0;
    for &p in acc {
        prod *= p;
        tau += prod;
    }
    tau
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tau_hat_is_one_plus_sum_of_prefix_products() {
        assert_eq!(tau_hat(&[]), 1.0);
        assert!((tau_hat(&[0.5, 0.5]) - 1.75).abs() < 1e-12);
        assert!((tau_hat(&[1.0; 15]) - 16.0).abs() < 1e-12);
        assert!((tau_hat(&[0.8, 0.0, 0.9]) - 1.8).abs() < 1e-12);
    }

    #[test]
    fn gamma_defaults_follow_the_paper() {
        assert_eq!(default_gamma(16), 7.0);
        assert_eq!(default_gamma(10), 5.0);
        assert_eq!(default_gamma(8), 4.0);
    }
}
