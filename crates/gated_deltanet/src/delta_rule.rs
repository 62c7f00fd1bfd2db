//! The gated delta rule (docs/GDN.md), computed in fp32.
//!
//! Layout is head-first: q, k [B, H, L, dk] (already L2-normalised), v [B, H, L, dv], g (log
//! decay, <= 0) and beta (write strength, in (0, 1)) [B, H, L], states [B, H, dk, dv]. Per step t:
//!
//! ```text
//! h = h * exp(g_t);   u_t = beta_t * (v_t - k_t^T h);   h = h + k_t u_t^T;   o_t = (q_t * dk^-0.5)^T h
//! ```
//!
//! [`naive`] runs that loop (the test reference). [`chunked`] is the WY form used for training
//! (HF transformers `torch_chunk_gated_delta_rule`, FLA `naive_chunk_gated_delta_rule`): inside a
//! chunk of C steps the writes u solve one unit lower-triangular system, so a chunk costs a few
//! matmuls and only the chunks run in order. [`states_at`] gives the state after any prefix
//! length from the same chunk quantities, which is how a DFlash block starts from the context
//! state at its anchor.

use tch::{Kind, Tensor};

/// Step-by-step recurrence from `initial` (zeros if None): the outputs [B, H, L, dv] and the
/// states after 0, 1, .., L steps [B, H, L+1, dk, dv].
pub fn naive(q: &Tensor, k: &Tensor, v: &Tensor, g: &Tensor, beta: &Tensor, initial: Option<&Tensor>) -> (Tensor, Tensor) {
    let (q, k, v, g, beta) = (f32(q), f32(k), f32(v), f32(g), f32(beta));
    let (l, dk) = (k.size()[2], k.size()[3]);
    let q = q * (dk as f64).powf(-0.5);
    let mut h = initial.map_or_else(|| zero_state(&k, &v), f32);
    let (mut outs, mut states) = (Vec::new(), vec![h.shallow_clone()]);
    for t in 0..l {
        let (q_t, k_t, v_t) = (q.select(2, t), k.select(2, t), v.select(2, t)); // [B, H, d]
        let g_t = g.select(2, t).exp().unsqueeze(-1).unsqueeze(-1);
        let beta_t = beta.select(2, t).unsqueeze(-1);
        h = h * g_t;
        let predicted = (&h * k_t.unsqueeze(-1)).sum_dim_intlist(-2, false, Kind::Float); // k^T h: [B, H, dv]
        let u = (v_t - predicted) * beta_t;
        h = h + k_t.unsqueeze(-1) * u.unsqueeze(-2);
        outs.push((&h * q_t.unsqueeze(-1)).sum_dim_intlist(-2, false, Kind::Float));
        states.push(h.shallow_clone());
    }
    let o = if outs.is_empty() { v.zeros_like() } else { Tensor::stack(&outs, 2) };
    (o, Tensor::stack(&states, 2))
}

/// The chunked (WY) form of [`naive`] from `initial` (zeros if None), chunks of `chunk` steps
/// (fewer if the sequence is shorter): outputs [B, H, L, dv] and the final state [B, H, dk, dv].
///
/// Everything that does not depend on the state (the WY writes, the intra-chunk scores, the keys
/// decayed to their chunk's end) is computed for all chunks at once in batched matmuls; the loop
/// over chunks carries only the state, five small batched matmuls a chunk, no per-step work.
pub fn chunked(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    initial: Option<&Tensor>,
    chunk: i64,
) -> (Tensor, Tensor) {
    let (q, k, v) = (f32(q), f32(k), f32(v));
    let l = k.size()[2];
    let initial = initial.map_or_else(|| zero_state(&k, &v), f32);
    if l == 0 {
        return (v.zeros_like(), initial);
    }
    let ch = Chunks::new(&k, &v, &f32(g), &f32(beta), chunk);
    let dk = k.size()[3];
    // Queries in chunks, scaled, and decayed to each step: q_i exp(G_i) reads the incoming state.
    let q = into_chunks(&(q * (dk as f64).powf(-0.5)), ch.n, ch.c);
    let q_decayed = &q * ch.g_cum.exp().unsqueeze(-1);
    // Intra-chunk part of every chunk: (q_i . k_j) exp(G_i - G_j) for j <= i, applied to the writes.
    let intra = q.matmul(&ch.k.transpose(-1, -2)) * &ch.decay; // [B, H, n, C, C]
    let mut state = initial;
    let mut outs = Vec::with_capacity(ch.n as usize);
    for c in 0..ch.n {
        let v_new = ch.v_new(c, &state);
        let intra_part = bmm(&intra.select(2, c), &v_new);
        outs.push(bmm_add(&intra_part, &q_decayed.select(2, c), &state, 1.0));
        state = ch.advance(c, &state, &v_new);
    }
    let o = Tensor::cat(&outs, 2).narrow(2, 0, l); // [B, H, n*C, dv] -> [B, H, L, dv]
    (o, state)
}

/// The state after the first `positions[b, a]` steps of sequence b (each in 0..=L), starting
/// from zeros: [B, A, H, dk, dv]. Chunk boundary states come from the chunked scan; inside a
/// chunk, the state after r of its steps is S exp(G_r) + sum_{i<r} exp(G_r - G_i) k_i u_i^T, where
/// u_i are the chunk's corrected writes (the WY system is lower triangular, so a prefix's writes
/// are the whole chunk's first r).
pub fn states_at(k: &Tensor, v: &Tensor, g: &Tensor, beta: &Tensor, positions: &Tensor, chunk: i64) -> Tensor {
    let (k, v) = (f32(k), f32(v));
    let (b, h, l, dk) = (k.size()[0], k.size()[1], k.size()[2], k.size()[3]);
    let (dv, a) = (v.size()[3], positions.size()[1]);
    if l == 0 {
        return Tensor::zeros([b, a, h, dk, dv], (Kind::Float, k.device()));
    }
    let ch = Chunks::new(&k, &v, &f32(g), &f32(beta), chunk);
    let (n, c_len) = (ch.n, ch.c);

    // 1. Scan: the state entering each chunk and each chunk's corrected writes.
    let mut state = zero_state(&k, &v);
    let (mut entering, mut writes) = (Vec::new(), Vec::new());
    for c in 0..n {
        let v_new = ch.v_new(c, &state);
        entering.push(state.shallow_clone());
        state = ch.advance(c, &state, &v_new);
        writes.push(v_new);
    }
    let entering = Tensor::stack(&entering, 2); // [B, H, n, dk, dv]
    let writes = Tensor::stack(&writes, 2); // [B, H, n, C, dv]

    // 2. Each position's chunk and offset in it; position n*C (only when L is a multiple of C)
    //    is the last chunk with all C steps taken.
    let pos = positions.to_kind(Kind::Int64).clamp(0, l);
    let chunk_of = pos.divide_scalar_mode(c_len, "floor").clamp_max(n - 1); // [B, A]
    let offset = &pos - &chunk_of * c_len; // in 0..=C
    let flat = (Tensor::arange(b, (Kind::Int64, k.device())).unsqueeze(1) * n + &chunk_of).view([-1]); // [B*A]
    let pick = |t: &Tensor| -> Tensor {
        // [B, H, n, ...] -> the anchor's chunk, [B*A, H, ...]
        let t = t.transpose(1, 2);
        let mut shape = t.size();
        shape.remove(0);
        shape[0] = b * n;
        t.reshape(shape.as_slice()).index_select(0, &flat)
    };
    let (s0, k_c, u_c, g_incl) = (pick(&entering), pick(&ch.k), pick(&writes), pick(&ch.g_cum));
    // G_r: log decay of the chunk's first r steps (0 for r = 0).
    let g_excl = Tensor::cat(&[g_incl.zeros_like().narrow(2, 0, 1), g_incl.shallow_clone()], 2); // [B*A, H, C+1]
    let r = offset.view([-1, 1, 1]).expand([b * a, h, 1], false);
    let g_r = g_excl.gather(2, &r, false); // [B*A, H, 1]

    // 3. S exp(G_r) + sum_{i<r} exp(G_r - G_i) k_i u_i^T; masked before exp (i >= r would overflow).
    let taken = Tensor::arange(c_len, (Kind::Int64, k.device())).view([1, 1, c_len]).lt_tensor(&r); // [B*A, H, C]
    let weight = (&g_r - &g_incl).masked_fill(&taken.logical_not(), f64::NEG_INFINITY).exp();
    let state = s0 * g_r.exp().unsqueeze(-1) + (k_c * weight.unsqueeze(-1)).transpose(-1, -2).matmul(&u_c);
    state.reshape([b, a, h, dk, dv])
}

/// Per-chunk quantities of the WY form, chunk length `c`, `n` chunks (L padded to n*c with
/// identity steps: g = 0, beta = 0, k = v = 0 leave the state unchanged).
struct Chunks {
    n: i64,
    c: i64,
    /// [B, H, n, C, dk]
    k: Tensor,
    /// Inclusive cumulative log decay G_i inside each chunk: [B, H, n, C].
    g_cum: Tensor,
    /// exp(G_i - G_j) for j <= i, else 0: [B, H, n, C, C].
    decay: Tensor,
    /// Writes of a chunk entered with a zero state, T (beta v): [B, H, n, C, dv].
    u: Tensor,
    /// How the entering state S shifts them, T (beta k exp(G)): writes = u - w S. [B, H, n, C, dk].
    w: Tensor,
    /// Keys decayed to their chunk's end, exp(G_last - G_i) k_i, transposed: [B, H, n, dk, C].
    k_to_end: Tensor,
    /// exp(G_last), the whole chunk's decay of the state: [B, H, n, 1, 1].
    chunk_decay: Tensor,
}

impl Chunks {
    fn new(k: &Tensor, v: &Tensor, g: &Tensor, beta: &Tensor, chunk: i64) -> Self {
        let l = k.size()[2];
        let c = chunk.clamp(1, l.max(1));
        let n = (l + c - 1) / c;
        let split = |t: &Tensor| into_chunks(t, n, c);
        let (k, v, g, beta) = (split(k), split(v), split(g), split(beta));
        // 1. Cumulative decay and the pairwise decay mask (upper part masked before exp).
        let g_cum = g.cumsum(-1, Kind::Float); // [B, H, n, C]
        let upper = Tensor::ones([c, c], (Kind::Bool, k.device())).triu(1);
        let decay = (g_cum.unsqueeze(-1) - g_cum.unsqueeze(-2)).masked_fill(&upper, f64::NEG_INFINITY).exp();
        // 2. WY: step i's write is beta_i (v_i - sum_{j<i} exp(G_i - G_j) (k_i . k_j) u_j - ...), i.e.
        //    (I + L) u = beta v with L strictly lower; solve for both right-hand sides at once.
        let beta = beta.unsqueeze(-1);
        let k_beta = &k * &beta;
        let strictly_lower = k_beta.matmul(&k.transpose(-1, -2)) * &decay;
        let strictly_lower = strictly_lower.masked_fill(&upper.logical_or(&Tensor::eye(c, (Kind::Bool, k.device()))), 0.0);
        let dv = v.size()[4];
        let rhs = Tensor::cat(&[&v * &beta, k_beta * g_cum.exp().unsqueeze(-1)], -1);
        let solved = strictly_lower.linalg_solve_triangular(&rhs, false, true, true);
        let u = solved.narrow(-1, 0, dv);
        let w = solved.narrow(-1, dv, solved.size()[4] - dv);
        // 3. What carries a state across a chunk: S exp(G_last) + sum_i exp(G_last - G_i) k_i write_i^T.
        let g_last = g_cum.narrow(-1, c - 1, 1); // [B, H, n, 1]
        let k_to_end = (&k * (&g_last - &g_cum).exp().unsqueeze(-1)).transpose(-1, -2);
        let chunk_decay = g_last.exp().unsqueeze(-1);
        Self { n, c, k, g_cum, decay, u, w, k_to_end, chunk_decay }
    }

    /// Chunk c's writes when entered with `state`: [B, H, C, dv].
    fn v_new(&self, c: i64, state: &Tensor) -> Tensor {
        bmm_add(&self.u.select(2, c), &self.w.select(2, c), state, -1.0)
    }

    /// The state after chunk c: S exp(G_last) + sum_i exp(G_last - G_i) k_i write_i^T.
    fn advance(&self, c: i64, state: &Tensor, v_new: &Tensor) -> Tensor {
        bmm_add(&(state * self.chunk_decay.select(2, c)), &self.k_to_end.select(2, c), v_new, 1.0)
    }
}

/// a @ b over [B, H, m, k] x [B, H, k, n], as one batched GEMM over B*H.
fn bmm(a: &Tensor, b: &Tensor) -> Tensor {
    let (s, bs) = (a.size(), b.size());
    a.reshape([-1, s[2], s[3]]).bmm(&b.reshape([-1, bs[2], bs[3]])).view([s[0], s[1], s[2], bs[3]])
}

/// acc + alpha * (a @ b) over [B, H, .., ..] in one batched GEMM (cuBLAS's beta = 1 epilogue).
fn bmm_add(acc: &Tensor, a: &Tensor, b: &Tensor, alpha: f64) -> Tensor {
    let (s, bs) = (a.size(), b.size());
    let acc3 = acc.reshape([-1, s[2], bs[3]]);
    acc3.baddbmm(&a.reshape([-1, s[2], s[3]]), &b.reshape([-1, bs[2], bs[3]]), 1.0, alpha).view([s[0], s[1], s[2], bs[3]])
}

/// [B, H, L] -> [B, H, n, C] or [B, H, L, d] -> [B, H, n, C, d], zero padded to n*C steps.
fn into_chunks(t: &Tensor, n: i64, c: i64) -> Tensor {
    let pad = n * c - t.size()[2];
    let t = match (pad, t.dim()) {
        (0, _) => t.shallow_clone(),
        (_, 3) => t.constant_pad_nd([0, pad]),
        _ => t.constant_pad_nd([0, 0, 0, pad]),
    };
    let mut shape = t.size();
    shape[2] = n;
    shape.insert(3, c);
    t.reshape(shape.as_slice())
}

fn f32(t: &Tensor) -> Tensor {
    t.to_kind(Kind::Float)
}

fn zero_state(k: &Tensor, v: &Tensor) -> Tensor {
    let (b, h, dk, dv) = (k.size()[0], k.size()[1], k.size()[3], v.size()[3]);
    Tensor::zeros([b, h, dk, dv], (Kind::Float, k.device()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    /// FLA's test metric: RMS of the difference relative to the reference's RMS.
    fn rel_rms(reference: &Tensor, got: &Tensor) -> f64 {
        let diff = (reference - got).square().mean(Kind::Double).sqrt().double_value(&[]);
        let base = reference.square().mean(Kind::Double).sqrt().double_value(&[]);
        diff / base.max(1e-30)
    }

    fn l2norm(x: &Tensor) -> Tensor {
        x * (x.square().sum_dim_intlist(-1, true, Kind::Float) + 1e-6).rsqrt()
    }

    /// Random inputs as FLA's tests draw them: q, k L2-normalised, g = logsigmoid, beta = sigmoid.
    struct Inputs {
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        h0: Tensor,
    }

    impl Inputs {
        fn new(b: i64, h: i64, l: i64, dk: i64, dv: i64) -> Self {
            let o = (Kind::Float, Device::Cpu);
            let leaf = |t: Tensor| t.set_requires_grad(true);
            Self {
                q: leaf(Tensor::randn([b, h, l, dk], o)),
                k: leaf(Tensor::randn([b, h, l, dk], o)),
                v: leaf(Tensor::randn([b, h, l, dv], o)),
                g: leaf(Tensor::rand([b, h, l], o)),
                beta: leaf(Tensor::randn([b, h, l], o)),
                h0: leaf(Tensor::randn([b, h, dk, dv], o)),
            }
        }
        /// (q, k, v, g, beta) as the rule takes them; gradients flow to the raw leaves through
        /// the L2 norm / logsigmoid / sigmoid, so the check covers dq, dk, dv, dg, dbeta.
        fn rule_args(&self) -> (Tensor, Tensor, Tensor, Tensor, Tensor) {
            (l2norm(&self.q), l2norm(&self.k), self.v.shallow_clone(), self.g.log_sigmoid(), self.beta.sigmoid())
        }
        fn leaves(&self) -> Vec<&Tensor> {
            vec![&self.q, &self.k, &self.v, &self.g, &self.beta, &self.h0]
        }
    }

    const NAMES: [&str; 6] = ["dq", "dk", "dv", "dg", "dbeta", "dh0"];
    /// FLA's chunk-vs-naive tolerances: 0.008 for dq/dk/dv, 0.02 for dg/dbeta (and dh0).
    const GRAD_TOL: [f64; 6] = [0.008, 0.008, 0.008, 0.02, 0.02, 0.008];

    /// Chunked == naive in outputs, final state and every gradient, on shapes that are shorter
    /// than, equal to, one more than and not a multiple of the chunk.
    #[test]
    fn chunked_matches_naive_forward_and_backward() {
        tch::manual_seed(0);
        let cases: &[(i64, i64, i64, i64, i64, i64)] = &[
            // (B, H, L, dk, dv, chunk)
            (2, 3, 16, 16, 8, 16),
            (1, 2, 17, 8, 16, 16),
            (2, 2, 37, 16, 16, 16),
            (1, 4, 32, 32, 16, 32),
            (2, 1, 33, 8, 8, 32),
            (1, 2, 100, 16, 32, 32),
            (1, 2, 64, 16, 16, 64),
            (2, 2, 65, 16, 16, 64),
            (1, 3, 150, 32, 32, 64),
            (3, 2, 5, 8, 8, 64),
            (1, 1, 1, 4, 4, 16),
        ];
        for &(b, h, l, dk, dv, chunk) in cases {
            let x = Inputs::new(b, h, l, dk, dv);
            let (q, k, v, g, beta) = x.rule_args();
            let (o_ref, states) = naive(&q, &k, &v, &g, &beta, Some(&x.h0));
            let ht_ref = states.select(2, l);
            let (o, ht) = chunked(&q, &k, &v, &g, &beta, Some(&x.h0), chunk);
            let case = format!("B={b} H={h} L={l} dk={dk} dv={dv} chunk={chunk}");
            let err = rel_rms(&o_ref, &o);
            assert!(err < 0.005, "{case}: output rel. RMS error {err:.2e}");
            let err = rel_rms(&ht_ref, &ht);
            assert!(err < 0.005, "{case}: final state rel. RMS error {err:.2e}");

            let (do_, dht) = (Tensor::randn_like(&o), Tensor::randn_like(&ht));
            let loss = |o: &Tensor, ht: &Tensor| (o * &do_).sum(Kind::Float) + (ht * &dht).sum(Kind::Float);
            // keep_graph: both runs share the graph of the input maps (L2 norm, logsigmoid, sigmoid).
            let want = Tensor::run_backward(&[loss(&o_ref, &ht_ref)], &x.leaves(), true, false);
            let got = Tensor::run_backward(&[loss(&o, &ht)], &x.leaves(), false, false);
            for i in 0..6 {
                let err = rel_rms(&want[i], &got[i]);
                assert!(err < GRAD_TOL[i], "{case}: {} rel. RMS error {err:.2e} (tolerance {})", NAMES[i], GRAD_TOL[i]);
            }
        }
    }

    /// The chunked form is exact math, not an approximation: in fp32 it agrees far inside FLA's
    /// tolerance (a wrong decay or mask gives errors of order 1).
    #[test]
    fn chunked_is_close_to_exact() {
        tch::manual_seed(1);
        let x = Inputs::new(2, 2, 45, 16, 16);
        let (q, k, v, g, beta) = x.rule_args();
        let (o_ref, _) = naive(&q, &k, &v, &g, &beta, None);
        let (o, _) = chunked(&q, &k, &v, &g, &beta, None, 16);
        let err = rel_rms(&o_ref, &o);
        assert!(err < 1e-4, "rel. RMS error {err:.2e}");
        // The metric can fail: the same inputs without their decay are far off.
        let (o_bad, _) = chunked(&q, &k, &v, &g.zeros_like(), &beta, None, 16);
        assert!(rel_rms(&o_ref, &o_bad) > 0.05);
    }

    /// states_at == the naive states at the same positions (0, chunk boundaries, inside chunks,
    /// the end), with gradients.
    #[test]
    fn states_at_matches_naive_states() {
        tch::manual_seed(2);
        for &(l, chunk) in &[(37i64, 16i64), (32, 16), (64, 64), (65, 64), (7, 32)] {
            let x = Inputs::new(2, 3, l, 16, 8);
            let (_, k, v, g, beta) = x.rule_args();
            let picks = Tensor::from_slice(&[0, 1, chunk.min(l), (chunk + 1).min(l), l / 2, l - 1, l]);
            let positions = Tensor::stack(&[picks.shallow_clone(), picks.flip([0])], 0); // [2, A], rows differ
            let (_, states) = naive(&k, &k, &v, &g, &beta, None);
            let a = positions.size()[1];
            let want = Tensor::stack(
                &(0..2)
                    .map(|bi| states.get(bi).index_select(1, &positions.get(bi)).transpose(0, 1)) // [A, H, dk, dv]
                    .collect::<Vec<_>>(),
                0,
            );
            let got = states_at(&k, &v, &g, &beta, &positions, chunk);
            assert_eq!(got.size(), vec![2, a, 3, 16, 8]);
            let case = format!("L={l} chunk={chunk}");
            let err = rel_rms(&want, &got);
            assert!(err < 0.005, "{case}: states rel. RMS error {err:.2e}");
            let d = Tensor::randn_like(&got);
            let leaves = [&x.k, &x.v, &x.g, &x.beta];
            let gw = Tensor::run_backward(&[(&want * &d).sum(Kind::Float)], &leaves, true, false);
            let gg = Tensor::run_backward(&[(&got * &d).sum(Kind::Float)], &leaves, false, false);
            for (i, name) in ["dk", "dv", "dg", "dbeta"].iter().enumerate() {
                let tol = if i < 2 { 0.008 } else { 0.02 };
                let err = rel_rms(&gw[i], &gg[i]);
                assert!(err < tol, "{case}: {name} rel. RMS error {err:.2e}");
            }
        }
    }

    /// Running a sequence in two pieces, the second from the first's final state, equals one run:
    /// what lets a block continue from its anchor's state.
    #[test]
    fn continuing_from_a_state_equals_one_run() {
        tch::manual_seed(3);
        let x = Inputs::new(1, 2, 40, 8, 8);
        let (q, k, v, g, beta) = x.rule_args();
        let (o_all, _) = chunked(&q, &k, &v, &g, &beta, None, 16);
        let split = 23;
        let (head, tail) = (|t: &Tensor| t.narrow(2, 0, split), |t: &Tensor| t.narrow(2, split, 40 - split));
        let s = states_at(&head(&k), &head(&v), &head(&g), &head(&beta), &Tensor::from_slice(&[split]).view([1, 1]), 16);
        let (o_tail, _) = chunked(&tail(&q), &tail(&k), &tail(&v), &tail(&g), &tail(&beta), Some(&s.select(1, 0)), 8);
        let err = rel_rms(&o_all.narrow(2, split, 40 - split), &o_tail);
        assert!(err < 1e-4, "rel. RMS error {err:.2e}");
    }
}
