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

use kernels::{gdn_scan, nvrtc, unit_lower_inverse as inverse_kernel};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use tch::{Kind, Tensor};

/// Step-by-step recurrence from `initial` (zeros if None): the outputs [B, H, L, dv] and the
/// states after 0, 1, .., L steps [B, H, L+1, dk, dv].
pub fn naive(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    initial: Option<&Tensor>,
) -> (Tensor, Tensor) {
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

/// How the chunked form's matmuls take their operands.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Precision {
    /// fp32 operands: the reference, and what training uses.
    #[default]
    F32,
    /// bf16 operands with fp32 accumulation, fp32 results and an fp32 state: the numerics of
    /// FLA's chunked kernels (the state and the triangular inverse cast to bf16 where they enter
    /// a matmul), for bf16 models on tensor cores. On the CPU the operands are rounded to bf16
    /// and multiplied in fp32, which is the same arithmetic.
    Bf16,
}

/// The chunked (WY) form of [`naive`] from `initial` (zeros if None), chunks of `chunk` steps
/// (fewer if the sequence is shorter): outputs [B, H, L, dv] and the final state [B, H, dk, dv],
/// in fp32.
pub fn chunked(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    initial: Option<&Tensor>,
    chunk: i64,
) -> (Tensor, Tensor) {
    chunked_with(q, k, v, g, beta, initial, chunk, Precision::F32)
}

/// [`chunked`] with the matmuls' operands in `precision`.
///
/// Everything that does not depend on the state (the WY writes, the intra-chunk scores, the keys
/// decayed to their chunk's end) is computed for all chunks at once in batched matmuls; the loop
/// over chunks carries only the state, five small batched matmuls a chunk, no per-step work. A
/// target's forward (bf16, no autograd, on a GPU) runs that loop as one kernel instead.
#[allow(clippy::too_many_arguments)]
pub fn chunked_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    initial: Option<&Tensor>,
    chunk: i64,
    precision: Precision,
) -> (Tensor, Tensor) {
    let (q, k, v) = (f32(q), f32(k), f32(v));
    let l = k.size()[2];
    let initial = initial.map_or_else(|| zero_state(&k, &v), f32);
    if l == 0 {
        return (v.zeros_like(), initial);
    }
    let p = precision;
    let ch = Chunks::new(&k, &v, &f32(g), &f32(beta), chunk, p);
    let dk = k.size()[3];
    // Queries in chunks, scaled, and decayed to each step: q_i exp(G_i) reads the incoming state.
    let q = into_chunks(&(q * (dk as f64).powf(-0.5)), ch.n, ch.c);
    let q_decayed = operand(&(&q * ch.g_cum.exp().unsqueeze(-1)), p);
    // Intra-chunk part of every chunk: (q_i . k_j) exp(G_i - G_j) for j <= i, applied to the writes.
    let intra = operand(&(mm(&q, &ch.k.transpose(-1, -2), p) * &ch.decay), p); // [B, H, n, C, C]
                                                                               // The loop over chunks on [B*H, ...] views made once: a dozen calls a chunk (the loop is
                                                                               // launch-bound on a GPU, so it stays free of reshapes).
    let (b, h, n) = (k.size()[0], k.size()[1], ch.n);
    let (dv, bh) = (v.size()[3], b * h);
    let flat = |t: &Tensor| {
        let s = t.size();
        t.reshape([bh, n, s[3], s[4]])
    };
    let (u, w, kte) = (flat(&ch.u), flat(&ch.w), flat(&ch.k_to_end));
    let (qd, intra) = (flat(&q_decayed), flat(&intra));
    let chunk_decay = ch.chunk_decay.reshape([bh, n, 1, 1]);
    let decay = ch.chunk_decay.reshape([bh, n]);
    let scan = gdn_scan::ScanInputs {
        u: &u,
        w: &w,
        q_decayed: &qd,
        intra: &intra,
        k_to_end: &kte,
        decay: &decay,
        state: &initial,
    };
    if let Some((o, state)) = fused_scan(&scan, ch.c, p) {
        let o = o.view([b, h, n * ch.c, dv]).narrow(2, 0, l);
        return (o, state.view([b, h, dk, dv]));
    }
    let mut state = initial.reshape([bh, dk, dv]);
    let mut outs = Vec::with_capacity(n as usize);
    for i in 0..n {
        let state_op = operand(&state, p);
        let v_new = gemm_add(&u.select(1, i), &w.select(1, i), &state_op, -1.0, p);
        let v_new_op = operand(&v_new, p);
        let o = gemm(&intra.select(1, i), &v_new_op, p);
        outs.push(gemm_add(&o, &qd.select(1, i), &state_op, 1.0, p));
        state = gemm_add(&(&state * chunk_decay.select(1, i)), &kte.select(1, i), &v_new_op, 1.0, p);
    }
    let o = Tensor::cat(&outs, 1).view([b, h, n * ch.c, dv]).narrow(2, 0, l); // [B, H, L, dv]
    (o, state.view([b, h, dk, dv]))
}

/// The loop over chunks as one CUDA kernel (`kernels::gdn_scan`): bf16 operands, no autograd
/// (a target's forward), chunks of 64; None where it does not apply, and the loop runs. A kernel
/// that fails to build or launch is reported once and not tried again.
fn fused_scan(x: &gdn_scan::ScanInputs, chunk: i64, p: Precision) -> Option<(Tensor, Tensor)> {
    static FAILED: AtomicBool = AtomicBool::new(false);
    let (dk, dv) = (x.w.size()[3], x.u.size()[3]);
    let grad = [x.u, x.w, x.q_decayed, x.intra, x.k_to_end, x.state].iter().any(|t| t.requires_grad());
    if p != Precision::Bf16 || grad || !gdn_scan::applies(x.u.device(), chunk, dk, dv) {
        return None;
    }
    nvrtc::try_kernel(&FAILED, "the fused Gated DeltaNet scan", || gdn_scan::forward(x))
}

/// a @ b over [N, m, k] x [N, k, n], fp32 result (see [`mm`]).
fn gemm(a: &Tensor, b: &Tensor, p: Precision) -> Tensor {
    match p {
        Precision::F32 => a.bmm(b),
        Precision::Bf16 => lowp_or(
            a.device().is_cuda(),
            || a.f_bmm_dtype(b, Kind::Float),
            || a.to_kind(Kind::Float).bmm(&b.to_kind(Kind::Float)),
        ),
    }
}

/// acc + alpha * (a @ b) over [N, m, k] x [N, k, n], `acc` fp32 (see [`mm_add`]).
fn gemm_add(acc: &Tensor, a: &Tensor, b: &Tensor, alpha: f64, p: Precision) -> Tensor {
    match p {
        Precision::F32 => acc.baddbmm(a, b, 1.0, alpha),
        Precision::Bf16 => lowp_or(
            a.device().is_cuda(),
            || acc.f_baddbmm_dtype(a, b, Kind::Float, 1.0, alpha),
            || acc.baddbmm(&a.to_kind(Kind::Float), &b.to_kind(Kind::Float), 1.0, alpha),
        ),
    }
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
    let ch = Chunks::new(&k, &v, &f32(g), &f32(beta), chunk, Precision::F32);
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
    p: Precision,
}

impl Chunks {
    fn new(k: &Tensor, v: &Tensor, g: &Tensor, beta: &Tensor, chunk: i64, p: Precision) -> Self {
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
        let strictly_lower = mm(&k_beta, &k.transpose(-1, -2), p) * &decay;
        let strictly_lower =
            strictly_lower.masked_fill(&upper.logical_or(&Tensor::eye(c, (Kind::Bool, k.device()))), 0.0);
        let (v_beta, k_decayed) = (&v * &beta, k_beta * g_cum.exp().unsqueeze(-1));
        let (u, w) = if strictly_lower.requires_grad() || v_beta.requires_grad() || k_decayed.requires_grad() {
            // Training: libtorch's triangular solve, which has a backward, for both at once.
            let dv = v.size()[4];
            let solved =
                strictly_lower.linalg_solve_triangular(&Tensor::cat(&[&v_beta, &k_decayed], -1), false, true, true);
            (solved.narrow(-1, 0, dv), solved.narrow(-1, dv, solved.size()[4] - dv))
        } else {
            // Inference: the blocked inverse, applied to each right-hand side (dense results).
            let inverse = unit_lower_inverse(&strictly_lower);
            (mm(&inverse, &v_beta, p), mm(&inverse, &k_decayed, p))
        };
        let w = operand(&w, p);
        // 3. What carries a state across a chunk: S exp(G_last) + sum_i exp(G_last - G_i) k_i write_i^T.
        let g_last = g_cum.narrow(-1, c - 1, 1); // [B, H, n, 1]
        let k_to_end = operand(&(&k * (&g_last - &g_cum).exp().unsqueeze(-1)).transpose(-1, -2), p);
        let chunk_decay = g_last.exp().unsqueeze(-1);
        Self { n, c, k, g_cum, decay, u, w, k_to_end, chunk_decay, p }
    }

    /// Chunk c's writes when entered with `state`: [B, H, C, dv].
    fn v_new(&self, c: i64, state: &Tensor) -> Tensor {
        mm_add(&self.u.select(2, c), &self.w.select(2, c), state, -1.0, self.p)
    }

    /// The state after chunk c: S exp(G_last) + sum_i exp(G_last - G_i) k_i write_i^T (fp32).
    fn advance(&self, c: i64, state: &Tensor, v_new: &Tensor) -> Tensor {
        mm_add(&(state * self.chunk_decay.select(2, c)), &self.k_to_end.select(2, c), v_new, 1.0, self.p)
    }
}

/// (I + A)^{-1} for strictly lower-triangular A [.., C, C], without autograd (on a GPU: a kernel
/// of its own, `kernels::unit_lower_inverse`): forward
/// substitution by blocks of 16 (libtorch's batched triangular solve runs one small system at a
/// time). The 16 x 16 diagonal blocks are inverted row by row, all at once (X_i = -A_i X, 15
/// steps); then each block row below is -D_r^{-1} A_{r,<r} X_{<r}: two batched matmuls a block row.
pub fn unit_lower_inverse(a: &Tensor) -> Tensor {
    // On a GPU, one kernel: forward substitution on chip, a matrix a CTA.
    static FAILED: AtomicBool = AtomicBool::new(false);
    if !a.requires_grad() && inverse_kernel::applies(a) {
        if let Some(x) = nvrtc::try_kernel(&FAILED, "the unit lower inverse kernel", || inverse_kernel::forward(a)) {
            return x;
        }
    }
    const BS: i64 = 16;
    let size = a.size();
    let c = size[size.len() - 1];
    let cp = (c + BS - 1) / BS * BS;
    let nb = cp / BS;
    let a = if cp == c { f32(a) } else { f32(a).constant_pad_nd([0, cp - c, 0, cp - c]) };
    let a = a.reshape([-1, cp, cp]);
    let batch = a.size()[0];
    let eye = Tensor::eye(BS, (Kind::Float, a.device()));
    // 1. The diagonal blocks [batch, nb, 16, 16], inverted by substitution.
    let diag = a.view([batch, nb, BS, nb, BS]).diagonal(0, 1, 3).permute([0, 3, 1, 2]).reshape([batch * nb, BS, BS]);
    let d_inv = eye.expand([batch * nb, BS, BS], false).contiguous();
    for i in 1..BS {
        let row = -diag.narrow(1, i, 1).narrow(2, 0, i).bmm(&d_inv.narrow(1, 0, i).narrow(2, 0, i)); // [.., 1, i]
        d_inv.narrow(1, i, 1).narrow(2, 0, i).copy_(&row);
    }
    let d_inv = d_inv.view([batch, nb, BS, BS]);
    // 2. Block rows, top to bottom: X_{r,<r} = -D_r^{-1} (A_{r,<r} X_{<r,<r}).
    let x = Tensor::zeros([batch, cp, cp], (Kind::Float, a.device()));
    x.view([batch, nb, BS, nb, BS]).diagonal(0, 1, 3).copy_(&d_inv.permute([0, 2, 3, 1]));
    for r in 1..nb {
        let (lo, hi) = (r * BS, (r + 1) * BS);
        let a_row = a.narrow(1, lo, BS).narrow(2, 0, lo); // [batch, 16, lo]
        let x_top = x.narrow(1, 0, lo).narrow(2, 0, lo); // [batch, lo, lo]
        let block = -d_inv.select(1, r).bmm(&a_row.bmm(&x_top));
        x.narrow(1, lo, hi - lo).narrow(2, 0, lo).copy_(&block);
    }
    let x = x.view([batch, cp, cp]).narrow(1, 0, c).narrow(2, 0, c);
    let mut out = size.clone();
    let last = out.len() - 1;
    out[last - 1] = c;
    out[last] = c;
    x.reshape(out.as_slice())
}

/// A matmul operand in `p`: fp32 as is, or rounded to bf16.
fn operand(t: &Tensor, p: Precision) -> Tensor {
    match p {
        Precision::F32 => t.shallow_clone(),
        Precision::Bf16 if t.kind() == Kind::BFloat16 => t.shallow_clone(),
        Precision::Bf16 => t.to_kind(Kind::BFloat16),
    }
}

/// Whether cuBLAS took bf16 operands with an fp32 result here (0 not tried, 1 yes, 2 refused: then
/// the operands are widened instead, without raising an error per call).
static BF16_FP32_OUT: AtomicU8 = AtomicU8::new(0);

/// `f` with bf16 operands and an fp32 result on CUDA, or `widened` (the same arithmetic on
/// fp32 copies of the rounded operands) where that is not available.
fn lowp_or(cuda: bool, f: impl FnOnce() -> Result<Tensor, tch::TchError>, widened: impl FnOnce() -> Tensor) -> Tensor {
    if !cuda || BF16_FP32_OUT.load(Ordering::Relaxed) == 2 {
        return widened();
    }
    match f() {
        Ok(t) => {
            BF16_FP32_OUT.store(1, Ordering::Relaxed);
            t
        }
        Err(_) => {
            BF16_FP32_OUT.store(2, Ordering::Relaxed);
            widened()
        }
    }
}

/// a @ b over [.., m, k] x [.., k, n] as one batched GEMM, fp32 result. Bf16 operands on CUDA
/// go through cuBLAS with fp32 accumulation and output (`bmm(.., out_dtype)`); elsewhere (or if
/// that is refused) they are widened and multiplied in fp32: the same arithmetic.
fn mm(a: &Tensor, b: &Tensor, p: Precision) -> Tensor {
    let (sa, sb) = (a.size(), b.size());
    let (m, kk, n) = (sa[sa.len() - 2], sa[sa.len() - 1], sb[sb.len() - 1]);
    let out = gemm(&operand(a, p).reshape([-1, m, kk]), &operand(b, p).reshape([-1, kk, n]), p);
    let mut shape = sa.clone();
    let last = shape.len() - 1;
    shape[last] = n;
    out.view(shape.as_slice())
}

/// acc + alpha * (a @ b), `acc` fp32, in one batched GEMM (cuBLAS's beta = 1 epilogue).
fn mm_add(acc: &Tensor, a: &Tensor, b: &Tensor, alpha: f64, p: Precision) -> Tensor {
    let (sa, sb) = (a.size(), b.size());
    let (m, kk, n) = (sa[sa.len() - 2], sa[sa.len() - 1], sb[sb.len() - 1]);
    let (a3, b3) = (operand(a, p).reshape([-1, m, kk]), operand(b, p).reshape([-1, kk, n]));
    gemm_add(&acc.reshape([-1, m, n]), &a3, &b3, alpha, p).view(acc.size().as_slice())
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

    /// The blocked inverse (used without autograd) equals libtorch's triangular solve, for sizes
    /// below, at and between multiples of its 16-row blocks, with entries as large as the WY
    /// system's can be (|beta k.k exp(..)| <= 1, all of one sign: the hard case for cancellation).
    #[test]
    fn the_blocked_inverse_equals_the_triangular_solve() {
        tch::manual_seed(4);
        for c in [1i64, 5, 16, 37, 64] {
            for scale in [0.3, 1.0] {
                let a = (Tensor::rand([3, 2, c, c], (Kind::Float, Device::Cpu)) * scale).tril(-1);
                let eye = Tensor::eye(c, (Kind::Float, Device::Cpu)).expand([3, 2, c, c], false);
                let want = a.linalg_solve_triangular(&eye, false, true, true);
                let got = unit_lower_inverse(&a);
                let err = rel_rms(&want, &got);
                assert!(err < 1e-5, "C={c} scale {scale}: rel. RMS error {err:.2e}");
            }
        }
    }

    /// Without autograd (the targets' path: the blocked inverse) the chunked form is as exact
    /// as with it; bf16 operands (FLA's numerics) stay within bf16 rounding of it, and are
    /// really rounded.
    #[test]
    fn inference_paths_match_the_reference() {
        let _guard = tch::no_grad_guard();
        tch::manual_seed(7);
        let x = Inputs::new(2, 3, 150, 32, 16);
        let (q, k, v, g, beta) = x.rule_args();
        let (o_ref, states) = naive(&q, &k, &v, &g, &beta, Some(&x.h0));
        let (o, ht) = chunked(&q, &k, &v, &g, &beta, Some(&x.h0), 64);
        assert!(rel_rms(&o_ref, &o) < 1e-4 && rel_rms(&states.select(2, 150), &ht) < 1e-4);
        let (o16, ht16) = chunked_with(&q, &k, &v, &g, &beta, Some(&x.h0), 64, Precision::Bf16);
        let (e_o, e_h) = (rel_rms(&o_ref, &o16), rel_rms(&states.select(2, 150), &ht16));
        assert!(e_o < 2e-2 && e_h < 2e-2, "bf16 operands: output {e_o:.2e}, state {e_h:.2e}");
        assert!(e_o > 1e-5, "bf16 operands are rounded ({e_o:.2e})");
    }

    /// On a GPU (`make gpu-test`): the fused scan kernel against the libtorch loop it
    /// replaces, both with bf16 operands, and both against the fp32 step-by-step reference, at a
    /// target's head dims (128), a length that is not a multiple of the chunk, from a state; and
    /// value dims 64 and 32 (the kernel's other tilings).
    #[test]
    #[ignore = "needs a CUDA device: make gpu-test"]
    fn fused_scan_matches_the_loop_on_cuda() {
        let dev = kernels::cuda_test_device();
        let _guard = tch::no_grad_guard();
        tch::manual_seed(11);
        for (b, h, l, dk, dv) in [(2, 3, 300, 128, 128), (1, 2, 64, 128, 64), (1, 2, 130, 64, 32)] {
            let x = Inputs::new(b, h, l, dk, dv);
            let (q, k, v, g, beta) = x.rule_args();
            let [q, k, v, g, beta, h0] = [&q, &k, &v, &g, &beta, &x.h0].map(|t| t.to_device(dev));
            let (o_ref, states) = naive(&q, &k, &v, &g, &beta, Some(&h0));
            let ht_ref = states.select(2, l);
            let run = |fused: bool| {
                kernels::nvrtc::with_enabled(fused, || {
                    chunked_with(&q, &k, &v, &g, &beta, Some(&h0), 64, Precision::Bf16)
                })
            };
            let ((o_loop, ht_loop), (o, ht)) = (run(false), run(true));
            let case = format!("B={b} H={h} L={l} dk={dk} dv={dv}");
            let (e_loop, e_fused) = (rel_rms(&o_ref, &o_loop), rel_rms(&o_ref, &o));
            let (s_loop, s_fused) = (rel_rms(&ht_ref, &ht_loop), rel_rms(&ht_ref, &ht));
            let between = (rel_rms(&o_loop, &o), rel_rms(&ht_loop, &ht));
            eprintln!("{case}: vs fp32, loop {e_loop:.2e} / {s_loop:.2e}, fused {e_fused:.2e} / {s_fused:.2e}; fused vs loop {:.2e} / {:.2e}", between.0, between.1);
            // bf16 rounding, no more than the loop's own (a wrong fragment layout is off by O(1)).
            assert!(
                e_fused < 2e-2 && s_fused < 2e-2,
                "{case}: fused vs fp32: output {e_fused:.2e}, state {s_fused:.2e}"
            );
            assert!(
                e_fused < 1.5 * e_loop + 1e-4 && s_fused < 1.5 * s_loop + 1e-4,
                "{case}: fused error above the loop's"
            );
            assert!(between.0 < 1e-2 && between.1 < 1e-2, "{case}: fused vs loop {between:?}");
            assert!(between.0 > 0.0, "{case}: the fused kernel did not run (its results equal the loop's bit for bit)");
        }
    }

    /// On a GPU (`make gpu-test`): the inverse kernel against libtorch's triangular solve and
    /// against the blocked substitution it replaces, in the hard case of the CPU test above.
    #[test]
    #[ignore = "needs a CUDA device: make gpu-test"]
    fn the_inverse_kernel_equals_the_triangular_solve_on_cuda() {
        let dev = kernels::cuda_test_device();
        tch::manual_seed(13);
        for c in [1i64, 16, 37, 64] {
            for scale in [0.3, 1.0] {
                let a = (Tensor::rand([3, 2, c, c], (Kind::Float, dev)) * scale).tril(-1);
                let eye = Tensor::eye(c, (Kind::Float, dev)).expand([3, 2, c, c], false);
                let want = a.linalg_solve_triangular(&eye, false, true, true);
                let fused = kernels::nvrtc::with_enabled(true, || unit_lower_inverse(&a));
                let blocked = kernels::nvrtc::with_enabled(false, || unit_lower_inverse(&a));
                let (e_fused, e_blocked) = (rel_rms(&want, &fused), rel_rms(&want, &blocked));
                eprintln!("C={c} scale {scale}: kernel {e_fused:.2e}, blocked {e_blocked:.2e}");
                assert!(e_fused < 1e-5, "C={c} scale {scale}: kernel rel. RMS error {e_fused:.2e}");
                assert!(
                    c == 1 || !fused.equal(&blocked),
                    "C={c}: the kernel did not run (bit-identical to the blocked substitution)"
                );
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
        let s =
            states_at(&head(&k), &head(&v), &head(&g), &head(&beta), &Tensor::from_slice(&[split]).view([1, 1]), 16);
        let (o_tail, _) = chunked(&tail(&q), &tail(&k), &tail(&v), &tail(&g), &tail(&beta), Some(&s.select(1, 0)), 8);
        let err = rel_rms(&o_all.narrow(2, split, 40 - split), &o_tail);
        assert!(err < 1e-4, "rel. RMS error {err:.2e}");
    }
}
