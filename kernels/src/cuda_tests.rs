//! The NVRTC kernels against the libtorch ops they replace, on a GPU. Ignored by `make test`;
//! `make gpu-test` runs them, and there a missing GPU fails them. One lock: the kernels' on/off
//! switch is process-wide.

use crate::{block_attention as ba, cross_entropy, nvrtc};
use std::sync::Mutex;
use tch::{Kind, Tensor};

static SWITCH: Mutex<()> = Mutex::new(());

fn max_abs(t: &Tensor) -> f64 {
    t.abs().max().double_value(&[])
}

/// Row statistics and (softmax - onehot) times a scale per row, of fp32 and of bf16 logit rows (a
/// strided chunk, a 152K vocabulary), against libtorch's log-softmax, argmax and exp in fp32 of
/// the same logits; bf16 logits get their gradient written over them.
#[test]
#[ignore = "needs a CUDA device: make gpu-test"]
fn cross_entropy_kernels_match_libtorch() {
    let dev = crate::cuda_test_device();
    let _lock = SWITCH.lock().unwrap();
    for kind in [Kind::Float, Kind::BFloat16] {
        tch::manual_seed(0);
        let (c, v) = (300, 151_936);
        // Rows of a wider tensor: the kernels take a row stride; logits up to ~|10| as a trained
        // head gives, some rows with their label at the argmax.
        let wide = (Tensor::randn([c, v + 8], (Kind::Float, dev)) * 3.0).to_kind(kind);
        let z = wide.narrow(1, 0, v);
        let (zf, padding) = (z.to_kind(Kind::Float), wide.narrow(1, v, 8).copy());
        let mut labels = Tensor::randint(v, [c], (Kind::Int64, dev));
        let argmax = zf.argmax(-1, false);
        let every_third = Tensor::arange(c, (Kind::Int64, dev)).remainder(3).eq(0);
        labels = argmax.where_self(&every_third, &labels);

        // Row scales (the loss weights) in [0, 1), the first row's 0.
        let scale =
            Tensor::rand([c], (Kind::Float, dev)).index_fill(0, &Tensor::from_slice(&[0i64]).to_device(dev), 0.0);
        let logp = zf.log_softmax(-1, Kind::Float);
        let want_label = logp.gather(1, &labels.unsqueeze(1), false).squeeze_dim(1);
        let want_hit = argmax.eq_tensor(&labels);
        let want_grad = (logp.exp() - labels.one_hot(v).to_kind(Kind::Float)) * scale.unsqueeze(1);

        let got = nvrtc::with_enabled(true, || {
            cross_entropy::rows(z.shallow_clone(), &labels, Some((Kind::BFloat16, &scale)))
        })
        .unwrap_or_else(|_| panic!("the {kind:?} kernels run on a GPU"));
        let err = max_abs(&(&got.logp_label - &want_label));
        eprintln!("{kind:?}: label log-probability: max |diff| {err:.3e} (|logp| up to {:.1})", max_abs(&want_label));
        assert!(err < 1e-4, "{kind:?}: log-probability of the label: max |diff| {err}");
        assert!(got.hit.equal(&want_hit), "{kind:?}: argmax hits differ");
        let grad = got.grad.expect("the gradient was asked for");
        if kind == Kind::BFloat16 {
            assert_eq!(grad.data_ptr(), z.data_ptr(), "bf16 logits take their gradient in place");
        }
        let grad = grad.to_kind(Kind::Float);
        // Each entry rounded once to bf16 (8 bits): within 2^-8 of its own size, plus fp32 noise.
        let excess = ((&grad - &want_grad).abs() - want_grad.abs() * (1.0 / 256.0)).max().double_value(&[]);
        eprintln!(
            "{kind:?}: (softmax - onehot) * scale: max |diff| {:.3e}, beyond bf16 rounding {excess:.3e}",
            max_abs(&(&grad - &want_grad))
        );
        assert!(excess < 1e-6, "{kind:?}: (softmax - onehot) * scale beyond bf16 rounding by {excess}");
        assert_eq!(max_abs(&grad.get(0)), 0.0, "{kind:?}: a row of scale 0");
        // The label's entry p - 1 keeps its size: not rounded to -1 where p is near 1.
        let at_label = |g: &Tensor| g.gather(1, &labels.unsqueeze(1), false);
        let err = max_abs(&(at_label(&grad) - at_label(&want_grad)));
        assert!(err < 4e-3, "{kind:?}: label entries: max |diff| {err}");
        // The padding past each row is untouched.
        assert!(wide.narrow(1, v, 8).equal(&padding), "{kind:?}: the row padding was written");
    }
}

/// Split attention in bf16 with the fused block part and with the composite, both against the
/// same masked attention in fp32: the kernels run (the saved state says so) and their errors are
/// those of bf16, close to the composite's. Full attention, and sliding windows: one as long as
/// the block (its last query sees no context), one that cuts most of the context (ranges that
/// start past key 0: with the 256-key tiles, the last run's smallest anchor 400 less 100 + 1).
/// Without a window the ranges' biased tails run on the tail kernels, one of them 376 keys long
/// (keys 256..632: a last key tile cut short).
/// Blocks of 16 run on the tensor-core kernels (head dims 128 and 64, 6 heads: a CTA of 4 with 2
/// idle warps), blocks of 8 on the SIMT ones.
#[test]
#[ignore = "needs a CUDA device: make gpu-test"]
fn fused_block_part_matches_the_composite() {
    let dev = crate::cuda_test_device();
    let _lock = SWITCH.lock().unwrap();
    let shapes = [(8, 2, 128, 16), (6, 2, 64, 16), (8, 2, 128, 8)];
    for (window, (nh, nkv, d, block)) in [None, Some(16), Some(100)].into_iter().flat_map(|w| shapes.map(|s| (w, s))) {
        tch::manual_seed(1);
        let (b, s, a) = (2, 632, 24);
        let n = a * block;
        let anchors: Vec<i64> = (0..b * a).map(|i| if i % a == 0 { 0 } else { (i % a) * 25 + i / a }).collect();
        let anchors = Tensor::from_slice(&anchors).view([b, a]);
        let f32 = (Kind::Float, dev);
        let (q, k, v) = (
            Tensor::randn([b, nh, n, d], f32),
            Tensor::randn([b, nkv, s + n, d], f32),
            Tensor::randn([b, nkv, s + n, d], f32),
        );
        let d_out = Tensor::randn([b, nh, n, d], f32);
        let scale = 1.0 / (d as f64).sqrt();

        // fp32 reference: masked SDPA over [context; blocks], GQA expanded.
        let (qr, kr, vr) = (q.set_requires_grad(true), k.set_requires_grad(true), v.set_requires_grad(true));
        let g = nh / nkv;
        let expand = |t: &Tensor| t.repeat_interleave_self_int(g, 1, None);
        let mask = ba::masked_sdpa_mask(&anchors.to_device(dev), s, block, window);
        let want = Tensor::scaled_dot_product_attention(
            &qr,
            &expand(&kr),
            &expand(&vr),
            Some(&mask),
            0.0,
            false,
            Some(scale),
            false,
        );
        (&want * &d_out).sum(Kind::Float).backward();
        let reference = [want.detach(), qr.grad(), kr.grad(), vr.grad()];

        let bf = |t: &Tensor| t.detach().to_kind(Kind::BFloat16);
        let run = |fused: bool| {
            let mask = ba::ContextMask::ranged(&anchors.to_device(dev), &anchors, s, block, Kind::BFloat16, 4, window);
            if window == Some(100) {
                assert!(mask.ranges.iter().any(|r| r.first_key > 0), "no range starts past key 0: {:?}", mask.ranges);
            }
            if window.is_none() {
                assert!(
                    mask.ranges.iter().any(|r| r.prefix > 0 && r.keys > r.prefix),
                    "no range splits off an unbiased prefix: {:?}",
                    mask.ranges
                );
            }
            let (out, saved) = tch::no_grad(|| ba::forward(&bf(&q), &bf(&k), &bf(&v), &mask, block, scale));
            assert_eq!(saved.fused(), fused, "fused block part asked for: {fused}");
            // The tails on their own kernels wherever they apply: blocks of 16, full attention.
            let tails = mask.ranges.iter().filter(|r| r.keys > r.prefix).count();
            let want_tails = if fused && block == 16 && window.is_none() { tails } else { 0 };
            assert_eq!(saved.tail_kernels(), want_tails, "tails on the tail kernels");
            let (dq, dk, dv) = tch::no_grad(|| ba::backward(&saved, &bf(&d_out)));
            [out, dq, dk, dv].map(|t| t.to_kind(Kind::Float))
        };
        let (fused, composite) = (nvrtc::with_enabled(true, || run(true)), nvrtc::with_enabled(false, || run(false)));
        for (i, name) in ["out", "dq", "dk", "dv"].iter().enumerate() {
            let rel = |x: &Tensor| max_abs(&(x - &reference[i])) / max_abs(&reference[i]);
            let (e_fused, e_composite) = (rel(&fused[i]), rel(&composite[i]));
            let case = format!("window {window:?} heads {nh}/{nkv} dim {d} block {block} {name}");
            eprintln!("{case}: fused {e_fused:.2e}, composite {e_composite:.2e}");
            assert!(
                e_fused < 1.6e-2 && e_fused < 2.0 * e_composite + 1e-3,
                "{case}: fused {e_fused:.2e}, composite {e_composite:.2e}"
            );
        }
    }
}

/// The loss's logits come out of the GEMM in fp32 (`mm` with an fp32 output, bf16 inputs, the LM
/// head transposed): the same numbers as the product in fp32.
#[test]
#[ignore = "needs a CUDA device: make gpu-test"]
fn bf16_matmul_with_fp32_output_matches_fp32() {
    let dev = crate::cuda_test_device();
    tch::manual_seed(2);
    let h = Tensor::randn([384, 4096], (Kind::BFloat16, dev));
    let head = Tensor::randn([151_936, 4096], (Kind::BFloat16, dev)) * 0.02;
    let z = h.mm_dtype(&head.tr(), Kind::Float);
    let want = h.to_kind(Kind::Float).mm(&head.tr().to_kind(Kind::Float));
    let (err, scale) = (max_abs(&(&z - &want)), max_abs(&want));
    eprintln!(
        "logits: std {:.3} (want {:.3}), max |diff| {err:.2e} of {scale:.2}",
        z.std(true).double_value(&[]),
        want.std(true).double_value(&[])
    );
    assert_eq!(z.kind(), Kind::Float);
    assert!(err < 1e-3 * scale, "max |diff| {err} against |logits| up to {scale}");
}

/// The SwiGLU kernels against libtorch's ops in fp32 on the same bf16 inputs: each output within
/// bf16 rounding of its own size (the kernels round once; libtorch's bf16 chain rounds between
/// ops, so it is the fp32 product that both are held to).
#[test]
#[ignore = "needs a CUDA device: make gpu-test"]
fn swiglu_kernels_match_libtorch() {
    let dev = crate::cuda_test_device();
    let _lock = SWITCH.lock().unwrap();
    tch::manual_seed(3);
    let bf = (Kind::BFloat16, dev);
    let (gate, up, dh) =
        (Tensor::randn([1000, 1536], bf) * 3.0, Tensor::randn([1000, 1536], bf), Tensor::randn([1000, 1536], bf));
    let h = nvrtc::with_enabled(true, || crate::swiglu::forward(&gate, &up));
    let (h2, d_gate, d_up) = nvrtc::with_enabled(true, || crate::swiglu::backward(&gate, &up, &dh));
    let f = |t: &Tensor| t.to_kind(Kind::Float);
    let (g, u, d) = (f(&gate), f(&up), f(&dh));
    let act = g.silu();
    let want_h = &act * &u;
    let want_gate = g.silu_backward(&(&d * &u));
    let want_up = &d * &act;
    for (name, got, want) in
        [("h", &h, &want_h), ("h (backward)", &h2, &want_h), ("d_gate", &d_gate, &want_gate), ("d_up", &d_up, &want_up)]
    {
        let diff = (f(got) - want).abs();
        let excess = (&diff - want.abs() * (1.0 / 256.0)).max().double_value(&[]);
        eprintln!("swiglu {name}: max |diff| {:.3e}, beyond bf16 rounding {excess:.3e}", max_abs(&diff));
        assert!(excess < 1e-5, "{name}: beyond bf16 rounding by {excess}");
    }
    assert!(h.equal(&h2), "forward and backward recompute the same h");
}

/// The q/k norm + RoPE kernels against libtorch's autograd in fp32 on the same bf16 inputs: a
/// strided dy as block attention hands it ([B, H, L, D] memory), the output within bf16 rounding,
/// dx and the weight's gradient (summed over 150K rows) within bf16-input noise.
#[test]
#[ignore = "needs a CUDA device: make gpu-test"]
fn norm_rope_kernels_match_autograd() {
    let dev = crate::cuda_test_device();
    let _lock = SWITCH.lock().unwrap();
    tch::manual_seed(4);
    let (b, l, h, d, eps) = (2i64, 600i64, 8i64, 128i64, 1e-6);
    let bf = (Kind::BFloat16, dev);
    let x = Tensor::randn([b, l, h, d], bf) * 2.0;
    let w = (Tensor::rand([d], bf) + 0.5).to_kind(Kind::BFloat16);
    let angle = Tensor::rand([b, 1, l, d / 2], (Kind::Float, dev)) * 6.0;
    let cos = Tensor::cat(&[angle.cos(), angle.cos()], -1).to_kind(Kind::BFloat16);
    let ssin = Tensor::cat(&[-angle.sin(), angle.sin()], -1).to_kind(Kind::BFloat16);
    let dy = Tensor::randn([b, h, l, d], bf).transpose(1, 2); // [B, L, H, D], strided

    assert!(crate::norm_rope::applies(&x, &cos));
    let y = crate::norm_rope::forward(&x, &w, eps, &cos, &ssin).expect("the forward kernel runs");
    let (dx, dw) = crate::norm_rope::backward(&x, &w, eps, &cos, &ssin, &dy).expect("the backward kernel runs");

    let f = |t: &Tensor| t.to_kind(Kind::Float);
    let (xr, wr) = (f(&x).set_requires_grad(true), f(&w).set_requires_grad(true));
    let normed = xr.rms_norm([d], Some(&wr), eps);
    let swap = |t: &Tensor| Tensor::cat(&[t.narrow(3, d / 2, d / 2), t.narrow(3, 0, d / 2)], 3);
    let (c, s) = (f(&cos).transpose(1, 2), f(&ssin).transpose(1, 2)); // [B, L, 1, D]
    let want = &normed * &c + swap(&normed) * &s;
    (&want * f(&dy)).sum(Kind::Float).backward();

    let excess = ((f(&y) - &want).abs() - want.abs() * (1.0 / 256.0)).max().double_value(&[]);
    eprintln!("norm + rope y: max |diff| {:.3e}, beyond bf16 rounding {excess:.3e}", max_abs(&(f(&y) - &want)));
    assert!(excess < 1e-4, "y beyond bf16 rounding by {excess}");
    for (name, got, want) in [("dx", f(&dx), xr.grad()), ("dw", dw, wr.grad())] {
        let rel = max_abs(&(&got - &want)) / max_abs(&want);
        eprintln!("norm + rope {name}: relative max error {rel:.2e}");
        assert!(rel < 1e-2, "{name}: relative max error {rel}");
    }
}

/// The residual add + RMSNorm kernels against libtorch's add, norm and autograd in fp32 on the
/// same bf16 inputs, for hidden sizes of whole warps of 8-element groups (4,096 and 2,560) and one
/// whose last warp has idle threads (1,000): the sum exact, y within bf16 rounding, dx (with the
/// residual's gradient) and the weight's gradient (over 1,200 rows) within bf16-input noise.
#[test]
#[ignore = "needs a CUDA device: make gpu-test"]
fn rms_norm_kernels_match_autograd() {
    let dev = crate::cuda_test_device();
    let _lock = SWITCH.lock().unwrap();
    tch::manual_seed(5);
    let eps = 1e-6;
    for h in [4096i64, 2560, 1000] {
        let bf = (Kind::BFloat16, dev);
        let x = Tensor::randn([2, 600, h], bf) * 2.0;
        let delta = Tensor::randn([2, 600, h], bf);
        let w = (Tensor::rand([h], bf) + 0.5).to_kind(Kind::BFloat16);
        let (dy, g) = (Tensor::randn([2, 600, h], bf), Tensor::randn([2, 600, h], bf));

        assert!(nvrtc::with_enabled(true, || crate::rms_norm::applies(&x)));
        let (sum, y) = crate::rms_norm::add_forward(&x, &delta, &w, eps).expect("the forward kernel runs");
        let (dx, dw) = crate::rms_norm::backward_add(&sum, &w, eps, &dy, &g).expect("the backward kernel runs");

        let f = |t: &Tensor| t.to_kind(Kind::Float);
        assert!(sum.equal(&(&x + &delta)), "H {h}: the sum is the bf16 add's");
        let (sr, wr) = (f(&sum).set_requires_grad(true), f(&w).set_requires_grad(true));
        let want = sr.rms_norm([h], Some(&wr), eps);
        (&want * f(&dy)).sum(Kind::Float).backward();
        let want_dx = sr.grad() + f(&g);

        let excess = ((f(&y) - &want).abs() - want.abs() * (1.0 / 256.0)).max().double_value(&[]);
        eprintln!(
            "H {h} add + norm y: max |diff| {:.3e}, beyond bf16 rounding {excess:.3e}",
            max_abs(&(f(&y) - &want))
        );
        assert!(excess < 1e-4, "H {h}: y beyond bf16 rounding by {excess}");
        for (name, got, want) in [("dx", f(&dx), want_dx), ("dw", dw, wr.grad())] {
            let rel = max_abs(&(&got - &want)) / max_abs(&want);
            eprintln!("H {h} norm backward + add {name}: relative max error {rel:.2e}");
            assert!(rel < 1e-2, "H {h} {name}: relative max error {rel}");
        }
    }
}

/// The master-weight AdamW kernel against libtorch's fused AdamW over fp32 copies (the path it
/// replaces), three steps with weight decay: masters and moments equal to fp32 rounding, the bf16
/// parameters the masters rounded. 300,699 elements: groups of 4 and a tail of 3.
#[test]
#[ignore = "needs a CUDA device: make gpu-test"]
fn adamw_master_kernel_matches_libtorch_fused() {
    let dev = crate::cuda_test_device();
    let _lock = SWITCH.lock().unwrap();
    tch::manual_seed(5);
    let f32 = (Kind::Float, dev);
    let init = Tensor::randn([999, 301], f32);
    let (param, master, m, v) = (init.to_kind(Kind::BFloat16), init.copy(), init.zeros_like(), init.zeros_like());
    let (ref_master, ref_m, ref_v) = (init.copy(), init.zeros_like(), init.zeros_like());
    let (lr, betas, wd, eps) = (1e-2, [0.9, 0.999], 0.1, 1e-8);
    for step in 1..=3 {
        let grad = Tensor::randn([999, 301], (Kind::BFloat16, dev));
        let h = crate::adamw::Step { lr, betas, weight_decay: wd, eps, step };
        nvrtc::with_enabled(true, || crate::adamw::master_step(&param, &grad, &master, &m, &v, h))
            .expect("the kernel runs");
        let step_t = Tensor::full([], step as f64, f32);
        crate::optim::fused_adamw(
            &[ref_master.shallow_clone()],
            &[grad.to_kind(Kind::Float)],
            &[ref_m.shallow_clone()],
            &[ref_v.shallow_clone()],
            &step_t,
            lr,
            betas,
            wd,
            eps,
        )
        .unwrap();
    }
    for (name, got, want) in [("master", &master, &ref_master), ("exp_avg", &m, &ref_m), ("exp_avg_sq", &v, &ref_v)] {
        let rel = max_abs(&(got - want)) / max_abs(want);
        eprintln!("adamw {name}: relative max error {rel:.2e}");
        assert!(rel < 1e-5, "{name}: relative max error {rel}");
    }
    assert!(param.equal(&master.to_kind(Kind::BFloat16)), "the parameter is its master rounded to bf16");
}
