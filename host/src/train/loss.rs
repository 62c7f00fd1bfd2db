//! The DFlash loss (the DFlash paper, "Training"): same-position labels, the anchor itself excluded,
//! weights exp(-(k-1)/gamma) (or 1 without decay); the weighted cross-entropy summed, or divided
//! by the weight sum of the micro-batch ([`Reduction`]); per-position top-1 accuracy for tau-hat.
//! A step normalised globally (SpecForge's) takes the sums and divides its gradients by the
//! weight sum of all its micro-batches on all ranks (train/step.rs). Logits are formed only for positions that count, through the target's
//! frozen LM head, a chunk of positions at a time: no [positions, vocabulary] tensor outlives its
//! chunk, so memory stays flat in the number of anchors.

use plugin_api::tch::{self, Kind, Tensor};

/// Logits formed at once (one chunk), at most: 1,536 positions of bf16 logits for a 152K
/// vocabulary (their gradient is written over them), on top of every activation the backward
/// will need. Chunks of 1,536 positions feed the LM head's GEMMs better than chunks of 384 did:
/// 0.3-1.2% off the drafter step at the benchmark's shapes.
pub const LOGIT_CHUNK_BYTES: i64 = 1 << 29;

pub struct LossOut {
    /// Scalar, differentiable w.r.t. the block hidden states: the weighted cross-entropy summed
    /// ([`Reduction::Sum`]) or over the weight sum ([`Reduction::Mean`]).
    pub loss: Tensor,
    /// The weight sum of the counted labels (scalar fp32, no graph).
    pub weight_sum: Tensor,
    /// [2, Bk-1] int64 on the loss's device: per block position k = 1..Bk-1, correct top-1
    /// predictions (row 0) and counted labels (row 1). Left there so the step needs no host
    /// synchronisation; [`host_counts`](Self::host_counts) fetches them.
    pub counts: Tensor,
}

impl LossOut {
    /// (correct, count) per block position, on the host (a synchronisation).
    pub fn host_counts(&self) -> (Vec<i64>, Vec<i64>) {
        let c = self.counts.to_device(tch::Device::Cpu);
        let row = |i: i64| Vec::<i64>::try_from(c.get(i)).expect("counts");
        (row(0), row(1))
    }
}

pub struct LossInput<'a> {
    /// [B, A*Bk, H] drafter output after its final norm.
    pub block_hidden: &'a Tensor,
    /// [V, H] the target's output head.
    pub lm_head: &'a Tensor,
    /// [B, S] int64 tokens and response mask. These and the anchors may stay on the host (as
    /// training passes them): the loss then picks its positions without waiting for the GPU.
    pub input_ids: &'a Tensor,
    pub loss_mask: &'a Tensor,
    /// [B, A] anchor positions and validity.
    pub anchors: &'a Tensor,
    pub anchor_valid: &'a Tensor,
    pub block_size: i64,
    /// Decay of the weights over block positions; None: every label weighs 1.
    pub gamma: Option<f64>,
    pub reduction: Reduction,
}

/// What the loss returns of the weighted cross-entropy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduction {
    /// Over the micro-batch's own weight sum.
    Mean,
    /// The weighted sum (the caller divides by a weight sum of its own).
    Sum,
}

/// Default gamma by block size (the DFlash paper: 7 for 16, 5 for 10, 4 for 8), linear in between.
pub fn default_gamma(block_size: usize) -> f64 {
    match block_size {
        16 => 7.0,
        10 => 5.0,
        8 => 4.0,
        b => (b as f64 * 0.5 - 1.0).max(1.0),
    }
}

/// The gamma a run trains with: the config's (None for "none": no decay), else the paper's
/// default for the block size.
pub fn resolve_gamma(config: Option<crate::config::LossGamma>, block_size: usize) -> Option<f64> {
    match config {
        Some(g) => g.value(),
        None => Some(default_gamma(block_size)),
    }
}

/// The loss with chunks of at most `LOGIT_CHUNK_BYTES` of logits, in whole multiples of 384
/// positions where that fits (the GEMMs' row tiles are 128 or 192: a partial last tile is wasted
/// work).
pub fn dflash_loss(x: &LossInput) -> LossOut {
    let vocab = x.lm_head.size()[0];
    let rows = (LOGIT_CHUNK_BYTES / (x.block_hidden.kind().elt_size_in_bytes() as i64 * vocab)).max(1);
    dflash_loss_chunked(x, if rows >= 384 { rows / 384 * 384 } else { rows })
}

/// The loss with logits formed for `chunk` counted positions at a time.
///
/// tch has no custom autograd functions, so each chunk's gradient w.r.t. its hidden states is
/// computed here, while its logits exist: dCE/dh = (softmax(z) - onehot(label)) * w / sum(w) @ W.
/// The returned loss is `value + (s - s.detach())` with `s = sum(h * g)`: it equals the loss and
/// backpropagates exactly `g` into the hidden states. The head is frozen, so no other gradient
/// is needed. Without grad (evaluation) the gradients are skipped.
pub fn dflash_loss_chunked(x: &LossInput, chunk: i64) -> LossOut {
    let bk = x.block_size;
    let device = x.block_hidden.device();
    let hidden = *x.block_hidden.size().last().expect("hidden dim");

    // 1-3 run where the token ids, masks and anchors are (the host, in training): which positions
    // count is then known without waiting for the GPU, and only the counted positions' indices,
    // labels and weights travel, queued behind the forward.
    let meta = x.input_ids.device();
    let on_device = |t: Tensor| kernels::autograd::to_device_async(&t, device);

    let (labels, valid, weights) = labels_and_weights(x, meta);

    // 3. Counted positions only.
    let idx = valid.flatten(0, -1).nonzero().squeeze_dim(-1);
    let m = idx.size()[0];
    if m == 0 {
        let zero = x.block_hidden.sum(Kind::Float) * 0.0;
        let weight_sum = Tensor::zeros([], (Kind::Float, device));
        return LossOut { loss: zero, weight_sum, counts: Tensor::zeros([2, bk - 1], (Kind::Int64, device)) };
    }
    let target = on_device(labels.flatten(0, -1).index_select(0, &idx));
    let wsel = on_device(weights.flatten(0, -1).index_select(0, &idx));
    let kk = on_device(idx.remainder(bk));
    let idx = on_device(idx);
    let rows = x.block_hidden.reshape([-1, hidden]);
    let want_grad = rows.requires_grad();
    let h = rows.detach().index_select(0, &idx); // [M, H]; its gradient goes back into `rows` below
    let wsum = wsel.sum(Kind::Float);

    // 4. Per chunk: weighted CE, top-1 hits and (training) the gradient w.r.t. h, written into
    //    its rows of `grad`. The chunk's logits come out of the GEMM in the hidden states' type,
    //    as the model's own LM head gives them (HF's and SpecForge's loss: bf16 logits, the
    //    statistics in fp32); each row's weight scales its softmax gradient as that is written,
    //    before the GEMM back to [c, H].
    let mut ce_sum = Tensor::zeros([], (Kind::Float, device));
    let mut hits = Vec::new();
    let grad = want_grad.then(|| Tensor::empty(h.size(), (h.kind(), device)));
    tch::no_grad(|| {
        let head_t = x.lm_head.tr();
        for start in (0..m).step_by(chunk as usize) {
            let len = chunk.min(m - start);
            let hc = h.narrow(0, start, len);
            let wc = wsel.narrow(0, start, len);
            let z = hc.mm(&head_t); // [c, V]
            let scale = grad.is_some().then(|| match x.reduction {
                Reduction::Mean => &wc / &wsum,
                Reduction::Sum => wc.shallow_clone(),
            });
            let (logp_label, hit, d_logits) =
                cross_entropy_rows(z, &target.narrow(0, start, len), scale.as_ref().map(|s| (h.kind(), s)));
            hits.push(hit);
            ce_sum -= (logp_label * &wc).sum(Kind::Float);
            if let (Some(d_logits), Some(grad)) = (d_logits, &grad) {
                let _ = d_logits.mm_out(&grad.narrow(0, start, len), x.lm_head);
            }
        }
    });
    let value = match x.reduction {
        Reduction::Mean => ce_sum / &wsum,
        Reduction::Sum => ce_sum,
    };
    let loss = if let Some(g) = grad {
        // The gradient back in the block's rows, each written once (index_select's own backward
        // adds them with atomics, 1.3 ms a step at the bench shapes), then handed to autograd
        // as the gradient of a term whose value is zero.
        let mut full = Tensor::zeros_like(&rows);
        let _ = full.index_copy_(0, &idx, &g);
        let s = (&rows * full).sum(Kind::Float);
        value + (&s - s.detach())
    } else {
        value
    };

    // 5. Per-position accuracy counts.
    // (index_add, not bincount: libtorch's CUDA bincount reads the maximum back to the host.)
    let hit = Tensor::cat(&hits, 0).to_kind(Kind::Int64);
    let correct = Tensor::zeros([bk], (Kind::Int64, device)).index_add(0, &kk, &hit);
    let count = Tensor::zeros([bk], (Kind::Int64, device)).index_add(0, &kk, &Tensor::ones_like(&kk));
    LossOut { loss, weight_sum: wsum, counts: Tensor::stack(&[correct, count], 0).narrow(1, 1, bk - 1) }
}

/// Steps 1-2 of the loss: each block position's label, whether it counts, and its weight
/// ([B, A, Bk] each), computed where the token ids are (`meta`).
fn labels_and_weights(x: &LossInput, meta: tch::Device) -> (Tensor, Tensor, Tensor) {
    let (b, s) = (x.input_ids.size()[0], x.input_ids.size()[1]);
    let a = x.anchors.size()[1];
    let bk = x.block_size;
    // 1. Labels: block position k of anchor a predicts token[a + k].
    let k = Tensor::arange(bk, (Kind::Int64, meta));
    let pos = x.anchors.to_device(meta).unsqueeze(-1) + &k; // [B, A, Bk]
    let in_range = pos.lt(s);
    let pos_flat = pos.clamp_max(s - 1).view([b, a * bk]);
    let labels = x.input_ids.gather(1, &pos_flat, false).view([b, a, bk]);
    let in_response = x.loss_mask.to_device(meta).gather(1, &pos_flat, false).view([b, a, bk]).gt(0);
    let valid = x
        .anchor_valid
        .to_device(meta)
        .unsqueeze(-1)
        .logical_and(&in_range)
        .logical_and(&in_response)
        .logical_and(&k.gt(0).view([1, 1, bk])); // position 0 is the anchor itself

    // 2. Weights exp(-(k-1)/gamma) (or 1) on every counted position.
    let weights = match x.gamma {
        Some(gamma) => valid.to_kind(Kind::Float) * ((k.to_kind(Kind::Float) - 1.0) / -gamma).exp().view([1, 1, bk]),
        None => valid.to_kind(Kind::Float),
    };
    (labels, valid, weights)
}

/// Per row of logits z [c, V] against `labels` [c]: the label's log-probability (fp32), whether
/// the argmax is the label, and with `grad` = (kind, row scale [c]) the gradient (softmax -
/// onehot) times each row's scale, in that kind. On CUDA two passes over the logits
/// (`kernels::cross_entropy`), on the CPU three (`kernels::cross_entropy_cpu`); elsewhere
/// libtorch's ops: one log-softmax in fp32, then exp written straight into the kind, each label's
/// entry expm1(logp) from fp32 (p - 1 near 1 would round away), then the scale.
fn cross_entropy_rows(z: Tensor, labels: &Tensor, grad: Option<(Kind, &Tensor)>) -> (Tensor, Tensor, Option<Tensor>) {
    let z = match kernels::cross_entropy::rows(z, labels, grad) {
        Ok(r) => return (r.logp_label, r.hit, r.grad),
        Err(z) => z,
    };
    let z = match kernels::cross_entropy_cpu::rows(z, labels, grad) {
        Ok(r) => return (r.logp_label, r.hit, r.grad),
        Err(z) => z,
    };
    let hit = z.argmax(-1, false).eq_tensor(labels);
    let logp = z.log_softmax(-1, Kind::Float);
    drop(z);
    let tc = labels.unsqueeze(1);
    let logp_label = logp.gather(1, &tc, false); // [c, 1]
    let grad = grad.map(|(kind, scale)| {
        let mut d = logp.exp_out(&Tensor::empty(logp.size(), (kind, logp.device())));
        let _ = d.scatter_(1, &tc, &logp_label.expm1().to_kind(kind));
        d *= scale.unsqueeze(1);
        d
    });
    (logp_label.squeeze_dim(1), hit, grad)
}

/// Top-1 accuracy per block position from its correct predictions and counted labels (0 where
/// nothing was counted).
pub fn accuracy(correct: &[i64], count: &[i64]) -> Vec<f64> {
    correct.iter().zip(count).map(|(&c, &n)| if n > 0 { c as f64 / n as f64 } else { 0.0 }).collect()
}

/// tau-hat = 1 + sum_k prod_{i<=k} acc_i (the DFlash paper, "Metrics").
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

    /// The loss as plain autograd over the full logits (the unchunked form).
    fn reference(x: &LossInput) -> (Tensor, Tensor) {
        let (b, s) = (x.input_ids.size()[0], x.input_ids.size()[1]);
        let (a, bk) = (x.anchors.size()[1], x.block_size);
        let k = Tensor::arange(bk, (Kind::Int64, tch::Device::Cpu));
        let pos = x.anchors.unsqueeze(-1) + &k;
        let pos_flat = pos.clamp_max(s - 1).view([b, a * bk]);
        let labels = x.input_ids.gather(1, &pos_flat, false).flatten(0, -1);
        let valid = x
            .anchor_valid
            .unsqueeze(-1)
            .logical_and(&pos.lt(s))
            .logical_and(&x.loss_mask.gather(1, &pos_flat, false).view([b, a, bk]).gt(0))
            .logical_and(&k.gt(0).view([1, 1, bk]));
        let decay = ((k.to_kind(Kind::Float) - 1.0) / -x.gamma.unwrap_or(f64::INFINITY)).exp();
        let w = (valid.to_kind(Kind::Float) * decay).flatten(0, -1);
        let logits = x.block_hidden.reshape([b * a * bk, -1]).matmul(&x.lm_head.tr());
        let ce = -logits.log_softmax(-1, Kind::Float).gather(1, &labels.unsqueeze(1), false).squeeze_dim(1);
        let mut loss = (ce * &w).sum(Kind::Float);
        if x.reduction == Reduction::Mean {
            loss = loss / w.sum(Kind::Float);
        }
        let g = Tensor::run_backward(&[&loss], &[x.block_hidden], false, false).remove(0);
        (loss.detach(), g)
    }

    #[test]
    fn chunked_loss_and_gradients_equal_the_unchunked_loss() {
        tch::manual_seed(5);
        let (b, s, a, bk, h, v) = (2, 40, 5, 4, 16, 50);
        let block_hidden = Tensor::randn([b, a * bk, h], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        let lm_head = Tensor::randn([v, h], (Kind::Float, tch::Device::Cpu));
        let input_ids = Tensor::randint(v, [b, s], (Kind::Int64, tch::Device::Cpu));
        // Row 0 answers from position 10, row 1 from 30 (its late anchors run past the end).
        let mask: Vec<i64> = (0..b * s).map(|i| i64::from(i % s >= if i < s { 10 } else { 30 })).collect();
        let loss_mask = Tensor::from_slice(&mask).view([b, s]);
        let anchors = Tensor::from_slice(&[9i64, 14, 20, 31, 37, 29, 32, 36, 38, 0]).view([b, a]);
        let anchor_valid =
            Tensor::from_slice(&[true, true, true, true, true, true, true, true, true, false]).view([b, a]);
        let x = LossInput {
            block_hidden: &block_hidden,
            lm_head: &lm_head,
            input_ids: &input_ids,
            loss_mask: &loss_mask,
            anchors: &anchors,
            anchor_valid: &anchor_valid,
            block_size: bk,
            gamma: Some(2.0),
            reduction: Reduction::Mean,
        };
        let (want_loss, _) = reference(&x);
        let whole = dflash_loss_chunked(&x, 1 << 20);
        // Counted labels per position (k = 1, 2, 3), so the weight sums are known.
        let n: Vec<f64> = whole.host_counts().1.iter().map(|&c| c as f64).collect();
        for (gamma, reduction) in
            [(Some(2.0), Reduction::Mean), (Some(2.0), Reduction::Sum), (None, Reduction::Mean), (None, Reduction::Sum)]
        {
            let x = LossInput { gamma, reduction, ..x };
            let (want_loss, want_grad) = reference(&x);
            let want_wsum: f64 =
                n.iter().enumerate().map(|(i, c)| c * gamma.map_or(1.0, |g| (-(i as f64) / g).exp())).sum();
            for chunk in [1, 3, 7, 1 << 20] {
                let out = dflash_loss_chunked(&x, chunk);
                let (ours, theirs) = (out.loss.double_value(&[]), want_loss.double_value(&[]));
                assert!(
                    (ours - theirs).abs() < 1e-5 * theirs.abs(),
                    "{gamma:?} {reduction:?} chunk {chunk}: loss {ours} vs {theirs}"
                );
                let g = Tensor::run_backward(&[&out.loss], &[&block_hidden], false, false).remove(0);
                let e = (&g - &want_grad).norm().double_value(&[]) / want_grad.norm().double_value(&[]);
                assert!(e < 1e-5, "{gamma:?} {reduction:?} chunk {chunk}: gradient relative error {e:e}");
                assert_eq!(out.host_counts(), whole.host_counts(), "chunk {chunk}");
                let wsum = out.weight_sum.double_value(&[]);
                assert!((wsum - want_wsum).abs() < 1e-5 * want_wsum, "{gamma:?}: weight sum {wsum} vs {want_wsum}");
            }
        }
        // Counted: row 0 anchors 9..37 (positions past 39 drop), row 1 anchors 29..38 (response from 30).
        assert_eq!(whole.host_counts().1.iter().sum::<i64>(), (3 + 3 + 3 + 3 + 2) + (3 + 3 + 3 + 1));
        // Without grad the value is the same and nothing is differentiable.
        let plain = tch::no_grad(|| dflash_loss_chunked(&LossInput { block_hidden: &block_hidden.detach(), ..x }, 3));
        assert!(
            (plain.loss.double_value(&[]) - want_loss.double_value(&[])).abs()
                < 1e-5 * want_loss.double_value(&[]).abs()
        );
        assert!(!plain.loss.requires_grad());
    }
}
