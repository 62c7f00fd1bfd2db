//! Muon's math as pure functions, named after KellerJordan/Muon's `muon.py`, with the order of
//! operations of torch.optim.Muon 2.11 (`torch/optim/_muon.py`) so results match it to rounding.
//!
//! Scope: 2-D hidden-layer weights only. Embeddings, the LM head, gains and biases belong to AdamW
//! (the optimizer plugin routes them there).

use plugin_api::tch::{Kind, Tensor};
use serde::Deserialize;

/// Quintic Newton-Schulz coefficients (a, b, c) of KellerJordan's Muon and torch.optim.Muon.
/// Chosen to maximise the slope at zero, not to converge: after 5 steps the singular values land
/// roughly in [0.7, 1.2] instead of exactly 1, which trains as well as an exact U V^T.
pub const NS_COEFFICIENTS: (f64, f64, f64) = (3.4445, -4.7750, 2.0315);

/// Approximate `U V^T` of `g = U S V^T` (the "zeroth power"), computed in `g`'s dtype; callers
/// cast first (torch.optim.Muon always casts to bf16, on the CPU too).
///
/// torch 2.11's steps: transpose a tall matrix (`X X^T` is then the smaller Gram matrix); divide by
/// the Frobenius norm clamped below at `eps` (Frobenius >= spectral norm, so every singular value
/// starts in [0, 1]; KellerJordan divides by `norm + eps` instead, a difference far below bf16
/// rounding); then `steps` times `A = X X^T; B = b A + c A A; X = a X + B X`, where torch computes
/// the last two with `addmm(.., beta, alpha)`: product and sum in fp32, one rounding to bf16.
pub fn zeropower_via_newtonschulz5(g: &Tensor, steps: i64, eps: f64) -> Tensor {
    let (a, b, c) = NS_COEFFICIENTS;
    let size = g.size();
    assert_eq!(size.len(), 2, "Newton-Schulz needs a 2-D matrix, got shape {size:?}");
    let tall = size[0] > size[1];
    let x = if tall { g.tr() } else { g.shallow_clone() };
    let mut x = &x / x.norm().clamp_min(eps);
    // beta * input + alpha * m1 @ m2 in one op: torch's addmm with beta/alpha, which tch binds
    // without them; baddbmm over a batch of one is the same fused op.
    let addmm = |input: &Tensor, m1: &Tensor, m2: &Tensor, beta: f64, alpha: f64| {
        input.unsqueeze(0).baddbmm(&m1.unsqueeze(0), &m2.unsqueeze(0), beta, alpha).squeeze_dim(0)
    };
    for _ in 0..steps {
        let gram = x.matmul(&x.tr()); // A = X X^T
        let poly = addmm(&gram, &gram, &gram, b, c); // B = b A + c A A
        x = addmm(&x, &poly, &x, a, 1.0); // X = a X + B X
    }
    if tall {
        x.tr()
    } else {
        x
    }
}

/// Muon's direction for one matrix, in fp32 (not yet scaled by the learning rate):
/// `buf = lerp(buf, g, 1 - beta)` (in place); the Nesterov look-ahead `lerp(g, buf, beta)` or
/// plain `buf`; then [`zeropower_via_newtonschulz5`] computed in `ns_kind`.
///
/// `grad` and `momentum_buffer` are fp32 and may be row slices (`narrow`) of a larger matrix: a
/// fused matrix is orthogonalised part by part by calling this once per part.
pub fn muon_update(
    grad: &Tensor,
    momentum_buffer: &mut Tensor,
    beta: f64,
    ns_steps: i64,
    nesterov: bool,
    eps: f64,
    ns_kind: Kind,
) -> Tensor {
    let update = muon_momentum(grad, momentum_buffer, beta, nesterov);
    zeropower_via_newtonschulz5(&update.to_kind(ns_kind), ns_steps, eps).to_kind(Kind::Float)
}

/// The first half of [`muon_update`]: the momentum buffer updated in place and the direction
/// Newton-Schulz orthogonalises. Distributed Muon runs it on every rank (each keeps the whole
/// state) and the orthogonalisation only on the rank that owns the matrix.
pub fn muon_momentum(grad: &Tensor, momentum_buffer: &mut Tensor, beta: f64, nesterov: bool) -> Tensor {
    let _ = momentum_buffer.lerp_(grad, 1.0 - beta);
    if nesterov {
        grad.lerp(momentum_buffer, beta)
    } else {
        momentum_buffer.shallow_clone()
    }
}

/// Newton-Schulz's cost for a `[rows, cols]` matrix, in multiply-adds per step: with m the short
/// side and n the long one, `X X^T` (m*m*n), `A A` (m^3) and `B X` (m*m*n).
pub fn newton_schulz_cost(rows: i64, cols: i64) -> f64 {
    let (m, n) = (rows.min(cols) as f64, rows.max(cols) as f64);
    2.0 * m * m * n + m * m * m
}

/// Distributed Muon's split of the Newton-Schulz work: the rank (0..world) that orthogonalises
/// each matrix, given each matrix's cost. Largest first, each to the least loaded rank (ties: the
/// lower rank), so every rank computes the same split and the busiest rank carries at most the
/// largest matrix above an even share.
pub fn shard_by_cost(costs: &[f64], world: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..costs.len()).collect();
    order.sort_by(|&a, &b| costs[b].total_cmp(&costs[a]).then(a.cmp(&b)));
    let mut load = vec![0.0f64; world.max(1)];
    let mut owner = vec![0; costs.len()];
    for i in order {
        let r = (0..load.len()).min_by(|&a, &b| load[a].total_cmp(&load[b]).then(a.cmp(&b))).expect("world >= 1");
        owner[i] = r;
        load[r] += costs[i];
    }
    owner
}

/// How the learning rate is scaled by a matrix's shape (torch's `adjust_lr_fn`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, plugin_api::Describe)]
#[serde(rename_all = "snake_case")]
pub enum AdjustLr {
    /// KellerJordan: `lr * sqrt(max(1, rows/cols))`, so tall matrices' updates keep their RMS.
    /// torch's default (`adjust_lr_fn=None`).
    #[default]
    Original,
    /// Moonlight: `lr * 0.2 * sqrt(max(rows, cols))`, an update RMS of about 0.2 like AdamW's, so
    /// AdamW's learning rate and weight decay carry over.
    MatchRmsAdamw,
}

/// The learning rate a `[rows, cols]` matrix's orthogonalised update is applied with (torch's
/// `_adjust_lr`, same float operations). Weight decay uses the unadjusted `lr`.
pub fn adjusted_lr(lr: f64, adjust: AdjustLr, rows: i64, cols: i64) -> f64 {
    let (rows, cols) = (rows as f64, cols as f64);
    let ratio = match adjust {
        AdjustLr::Original => (rows / cols).max(1.0).sqrt(),
        AdjustLr::MatchRmsAdamw => 0.2 * rows.max(cols).sqrt(),
    };
    lr * ratio
}

#[cfg(test)]
mod tests {
    use super::*;
    use plugin_api::tch::Device;

    /// (tch's `linalg_svd*` always pass a `driver`, which the CPU refuses; `svd` is the same LAPACK.)
    fn singular_values(x: &Tensor) -> Vec<f64> {
        let (_, s, _) = x.to_kind(Kind::Double).svd(true, false);
        Vec::<f64>::try_from(s).unwrap()
    }

    /// The quintic's output is U S' V^T with S' in a band around 1 ([0.6, 1.3]),
    /// in f32 and in bf16, for wide, tall, square and rank-deficient-looking (very skewed) shapes.
    #[test]
    fn newton_schulz_singular_values_fall_in_band() {
        plugin_api::tch::manual_seed(0);
        for &(r, c) in &[(8, 8), (12, 5), (5, 12), (64, 16), (16, 64), (128, 96), (3, 200)] {
            for kind in [Kind::Float, Kind::BFloat16] {
                let g = Tensor::randn([r, c], (Kind::Float, Device::Cpu));
                let o = zeropower_via_newtonschulz5(&g.to_kind(kind), 5, 1e-7);
                assert_eq!(o.size(), vec![r, c]);
                assert_eq!(o.kind(), kind);
                let s = singular_values(&o);
                let (lo, hi) = s.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
                eprintln!("[{r}, {c}] {kind:?}: singular values in [{lo:.3}, {hi:.3}]");
                assert!(lo >= 0.6 && hi <= 1.3, "[{r}, {c}] {kind:?}: singular values in [{lo}, {hi}]");
            }
        }
    }

    /// Same singular vectors as the input: O ~ U V^T, so O's row space equals G's and
    /// `U^T O V` is (nearly) diagonal.
    #[test]
    fn newton_schulz_keeps_singular_vectors() {
        plugin_api::tch::manual_seed(1);
        let g = Tensor::randn([6, 10], (Kind::Double, Device::Cpu));
        let o = zeropower_via_newtonschulz5(&g, 5, 1e-7);
        let (u, _s, v) = g.svd(true, true); // g = U diag(s) V^T
        let d = u.tr().matmul(&o).matmul(&v); // [6, 6]
        let off = &d - d.diagonal(0, 0, 1).diag_embed(0, 0, 1);
        let off = off.abs().max().double_value(&[]);
        assert!(off < 1e-6, "off-diagonal of U^T O V: {off:e}");
    }

    /// A zero gradient stays zero (the eps clamp avoids 0/0).
    #[test]
    fn newton_schulz_of_zero_is_zero() {
        let o = zeropower_via_newtonschulz5(&Tensor::zeros([4, 7], (Kind::Float, Device::Cpu)), 5, 1e-7);
        assert_eq!(o.abs().sum(Kind::Float).double_value(&[]), 0.0);
    }

    #[test]
    fn adjusted_lr_matches_torch_formulas() {
        let close = |a: f64, b: f64| (a - b).abs() < 1e-15;
        assert!(close(adjusted_lr(0.02, AdjustLr::Original, 12, 5), 0.02 * (12.0f64 / 5.0).sqrt()));
        assert!(close(adjusted_lr(0.02, AdjustLr::Original, 5, 12), 0.02));
        assert!(close(adjusted_lr(0.02, AdjustLr::MatchRmsAdamw, 5, 12), 0.02 * 0.2 * 12f64.sqrt()));
        assert!(close(adjusted_lr(0.02, AdjustLr::MatchRmsAdamw, 8, 8), 0.02 * 0.2 * 8f64.sqrt()));
    }

    /// Every matrix goes to one rank; the load is balanced (each rank within the largest matrix
    /// of an even share), deterministic, and one rank takes everything.
    #[test]
    fn shards_balance_the_newton_schulz_work() {
        let costs: Vec<f64> = [(64, 16), (16, 64), (128, 96), (3, 200), (8, 8), (96, 128), (32, 32)]
            .iter()
            .map(|&(r, c)| newton_schulz_cost(r, c))
            .collect();
        assert_eq!(shard_by_cost(&costs, 1), vec![0; costs.len()]);
        for world in 2..=4 {
            let owner = shard_by_cost(&costs, world);
            assert_eq!(owner, shard_by_cost(&costs, world));
            let mut load = vec![0.0; world];
            for (i, &r) in owner.iter().enumerate() {
                load[r] += costs[i];
            }
            let even = costs.iter().sum::<f64>() / world as f64;
            let largest = costs.iter().cloned().fold(0.0, f64::max);
            assert!(load.iter().all(|&l| l <= even + largest), "world {world}: loads {load:?}, even share {even}");
            assert!(load.iter().all(|&l| l > 0.0), "world {world}: an idle rank: {load:?}");
        }
        assert_eq!(newton_schulz_cost(12, 5), newton_schulz_cost(5, 12));
    }

    /// Momentum: buf = 0.95 buf + 0.05 g; Nesterov direction = g + 0.95 (buf - g) before NS.
    #[test]
    fn muon_update_momentum_and_nesterov() {
        plugin_api::tch::manual_seed(2);
        let opts = (Kind::Float, Device::Cpu);
        let (g1, g2) = (Tensor::randn([4, 6], opts), Tensor::randn([4, 6], opts));
        let mut buf = Tensor::zeros([4, 6], opts);
        let _ = muon_update(&g1, &mut buf, 0.95, 5, true, 1e-7, Kind::Float);
        let o = muon_update(&g2, &mut buf, 0.95, 5, true, 1e-7, Kind::Float);
        let want_buf = (&g1 * 0.05) * 0.95 + &g2 * 0.05;
        assert!(buf.allclose(&want_buf, 1e-6, 1e-7, false));
        let want = zeropower_via_newtonschulz5(&(&g2 + (&buf - &g2) * 0.95), 5, 1e-7);
        assert!(o.allclose(&want, 1e-5, 1e-6, false));
        let plain = muon_update(&g2, &mut buf.copy(), 0.95, 5, false, 1e-7, Kind::Float);
        let want_buf2 = &buf * 0.95 + &g2 * 0.05;
        assert!(plain.allclose(&zeropower_via_newtonschulz5(&want_buf2, 5, 1e-7), 1e-5, 1e-6, false));
    }
}
