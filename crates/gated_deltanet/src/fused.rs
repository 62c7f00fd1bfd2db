//! A hybrid target's Gated DeltaNet layer on a GPU: the rule straight from the layer's conv output
//! in two kernels (`kernels::gdn_prep` builds each chunk's quantities on chip, `kernels::gdn_scan`
//! carries the state across chunks), and the output's gated RMSNorm in one. bf16, forward only.
//! Where they do not apply, the callers run the composites: the heads laid out and normalised,
//! then [`chunked_with`](crate::chunked_with); libtorch's norm and SiLU.

use kernels::{gdn_prep, gdn_scan, nvrtc};
use std::sync::atomic::AtomicBool;
use tch::{Kind, Tensor};

pub use kernels::gdn_prep::Heads;

/// The gated delta rule over a layer's conv output `qkv` [B, L, q | k | v] (q, k as the conv
/// leaves them: normalised and scaled here, each key head read by its value heads), gates `g`,
/// `beta` [B, value heads, L] fp32, from `initial` [B, value heads, dk, dv] (zeros if None):
/// outputs fp32 [B, value heads, L, dv] and the final state fp32 [B, value heads, dk, dv], with
/// the numerics of [`Precision::Bf16`](crate::Precision::Bf16). None where the kernels do not
/// apply (not bf16 on CUDA, autograd, head dims they do not take) or failed once in this
/// process; the caller then runs the composite.
pub fn chunked_from_conv(
    qkv: &Tensor,
    heads: &Heads,
    g: &Tensor,
    beta: &Tensor,
    initial: Option<&Tensor>,
) -> Option<(Tensor, Tensor)> {
    static FAILED: AtomicBool = AtomicBool::new(false);
    let (dk, dv) = (heads.key_dim, heads.value_dim);
    let grad =
        qkv.requires_grad() || g.requires_grad() || beta.requires_grad() || initial.is_some_and(|s| s.requires_grad());
    if grad || !gdn_prep::applies(qkv, heads) || !gdn_scan::applies(qkv.device(), gdn_scan::CHUNK, dk, dv) {
        return None;
    }
    nvrtc::try_kernel(&FAILED, "the Gated DeltaNet chunk kernel", || {
        let (b, l, nv) = (qkv.size()[0], qkv.size()[1], heads.value_heads);
        let ch = gdn_prep::chunks(qkv, heads, g, beta)?;
        let n = ch.u.size()[1];
        let state = match initial {
            Some(s) => s.to_kind(Kind::Float),
            None => Tensor::zeros([b * nv, dk, dv], (Kind::Float, qkv.device())),
        };
        let scan = gdn_scan::ScanInputs {
            u: &ch.u,
            w: &ch.w,
            q_decayed: &ch.q_decayed,
            intra: &ch.intra,
            k_to_end: &ch.k_to_end,
            decay: &ch.decay,
            state: &state,
        };
        let (o, last) = gdn_scan::forward(&scan)?;
        let o = o.view([b, nv, n * gdn_scan::CHUNK, dv]).narrow(2, 0, l);
        Ok((o, last.view([b, nv, dk, dv])))
    })
}

/// rmsnorm(o) * weight * silu(z) per value head, the Gated DeltaNet layer's output gate: `o`
/// fp32 [B, H, L, dv], `z` [B, L, H * dv], `weight` [dv] -> [B, L, H * dv] in z's dtype. One kernel
/// for bf16 on CUDA without autograd; libtorch's norm and SiLU elsewhere.
pub fn gated_rms_norm(o: &Tensor, z: &Tensor, weight: &Tensor, eps: f64) -> Tensor {
    static FAILED: AtomicBool = AtomicBool::new(false);
    let (b, h, l, dv) = (o.size()[0], o.size()[1], o.size()[2], o.size()[3]);
    let kernel = nvrtc::enabled()
        && o.device().is_cuda()
        && z.kind() == Kind::BFloat16
        && o.kind() == Kind::Float
        && dv % 64 == 0
        && !(o.requires_grad() || z.requires_grad() || weight.requires_grad());
    if kernel {
        if let Some(y) =
            nvrtc::try_kernel(&FAILED, "the gated RMSNorm kernel", || gdn_prep::gated_norm(o, z, weight, eps))
        {
            return y;
        }
    }
    let normed = o.transpose(1, 2).rms_norm([dv], Some(weight), eps); // [B, L, H, dv]
    let gated = normed * z.reshape([b, l, h, dv]).silu();
    gated.to_kind(z.kind()).reshape([b, l, h * dv])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{chunked_with, l2norm, naive, Precision};

    fn rel_rms(reference: &Tensor, got: &Tensor) -> f64 {
        let diff = (reference.to_kind(Kind::Double) - got.to_kind(Kind::Double)).square().mean(Kind::Double).sqrt();
        let base = reference.to_kind(Kind::Double).square().mean(Kind::Double).sqrt();
        diff.double_value(&[]) / base.double_value(&[]).max(1e-30)
    }

    /// q, k [B, nv, L, dk] (normalised, q scaled, key heads repeated) and v [B, nv, L, dv], fp32,
    /// from a conv output: what the composite path lays out.
    fn heads_of(qkv: &Tensor, x: &Heads) -> (Tensor, Tensor, Tensor) {
        let (b, l) = (qkv.size()[0], qkv.size()[1]);
        let (nk, nv, dk, dv) = (x.key_heads, x.value_heads, x.key_dim, x.value_dim);
        let part = |from: i64, heads: i64, d: i64| {
            qkv.narrow(2, from, heads * d).reshape([b, l, heads, d]).transpose(1, 2).to_kind(Kind::Float)
        };
        let repeat = |t: Tensor| {
            let t = l2norm(&t).unsqueeze(2).expand([b, nk, nv / nk, l, dk], false);
            t.reshape([b, nv, l, dk])
        };
        let q = repeat(part(0, nk, dk));
        let k = repeat(part(nk * dk, nk, dk));
        (q, k, part(2 * nk * dk, nv, dv))
    }

    /// On a GPU (`make gpu-test`): the rule from a conv output against the fp32 step-by-step
    /// reference and the bf16 composite, on sequences shorter than a chunk, of whole chunks and
    /// with a partial last chunk, from a state, with key heads shared by two value heads.
    #[test]
    #[ignore = "needs a CUDA device: make gpu-test"]
    fn the_rule_from_the_conv_output_matches_the_composite_on_cuda() {
        let dev = kernels::cuda_test_device();
        let _guard = tch::no_grad_guard();
        tch::manual_seed(17);
        let x = Heads { key_heads: 2, value_heads: 4, key_dim: 128, value_dim: 128 };
        for (b, l) in [(2, 300), (1, 128), (1, 5), (3, 1)] {
            let qkv = Tensor::randn([b, l, x.channels()], (Kind::Float, dev)).to_kind(Kind::BFloat16);
            let g = Tensor::rand([b, x.value_heads, l], (Kind::Float, dev)).log_sigmoid();
            let beta = Tensor::randn([b, x.value_heads, l], (Kind::Float, dev)).sigmoid();
            let h0 = Tensor::randn([b, x.value_heads, 128, 128], (Kind::Float, dev)) * 0.1;
            let (q, k, v) = heads_of(&qkv, &x);
            let (o_ref, states) = naive(&q, &k, &v, &g, &beta, Some(&h0));
            let s_ref = states.select(2, l);
            let composite = kernels::nvrtc::with_enabled(false, || {
                chunked_with(&q, &k, &v, &g, &beta, Some(&h0), 64, Precision::Bf16)
            });
            let (o, s) = chunked_from_conv(&qkv, &x, &g, &beta, Some(&h0)).expect("the kernels apply");
            let case = format!("B={b} L={l}");
            let (e_c, e_f) = (rel_rms(&o_ref, &composite.0), rel_rms(&o_ref, &o));
            let (s_c, s_f) = (rel_rms(&s_ref, &composite.1), rel_rms(&s_ref, &s));
            eprintln!("{case}: vs fp32, composite {e_c:.2e} / {s_c:.2e}, kernels {e_f:.2e} / {s_f:.2e}");
            assert_eq!(o.size(), o_ref.size(), "{case}");
            assert!(e_f < 2e-2 && s_f < 2e-2, "{case}: kernels vs fp32: output {e_f:.2e}, state {s_f:.2e}");
            assert!(e_f < 1.5 * e_c + 1e-4 && s_f < 1.5 * s_c + 1e-4, "{case}: kernels' error above the composite's");
        }
    }

    /// On a GPU (`make gpu-test`): the gated norm kernel against libtorch's ops, o a view of the
    /// scan's padded buffer and z a slice of a wider projection, as the layer passes them.
    #[test]
    #[ignore = "needs a CUDA device: make gpu-test"]
    fn the_gated_norm_kernel_matches_the_composite_on_cuda() {
        let dev = kernels::cuda_test_device();
        let _guard = tch::no_grad_guard();
        tch::manual_seed(19);
        let (b, h, l, dv) = (2, 3, 70, 128);
        let o = Tensor::randn([b, h, 128, dv], (Kind::Float, dev)).narrow(2, 0, l);
        let proj = Tensor::randn([b, l, h * dv + 40], (Kind::Float, dev)).to_kind(Kind::BFloat16);
        let z = proj.narrow(2, 8, h * dv);
        let weight = Tensor::rand([dv], (Kind::Float, dev)) + 0.5;
        let want = kernels::nvrtc::with_enabled(false, || gated_rms_norm(&o, &z, &weight, 1e-6));
        // The kernel itself (an error here, not a quiet fallback): its bf16 results may equal
        // libtorch's bit for bit, so equality cannot tell whether it ran.
        let got = gdn_prep::gated_norm(&o, &z, &weight, 1e-6).expect("the gated norm kernel runs");
        let err = rel_rms(&want, &got);
        eprintln!("gated norm: kernel vs libtorch {err:.2e}");
        assert_eq!(got.size(), want.size());
        assert!(err < 4e-3, "rel. RMS error {err:.2e}");
        assert!(!got.equal(&want.zeros_like()), "the kernel wrote nothing");
        assert!(gated_rms_norm(&o, &z, &weight, 1e-6).equal(&got), "the layer's norm is the kernel on a GPU");
    }
}
