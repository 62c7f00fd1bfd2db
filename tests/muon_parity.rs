//! Parity of the `muon` optimizer plugin with torch.optim.Muon 2.11 (fixture from
//! `scripts/fixtures/make_fixtures.py`, see tests/fixtures/README.md): Newton-Schulz on its own, and 10
//! steps with a changing learning rate on tall [12, 5], wide [5, 12] and square [8, 8] matrices,
//! for both shape scalings ("original", "match_rms_adamw").
//!
//! torch runs Newton-Schulz in bf16 on every device, the CPU included, so there are two
//! references: torch as shipped (compared with `ns_dtype = "bf16"`) and torch with its
//! Newton-Schulz swapped for the same steps in float32 (compared with `ns_dtype = "f32"`).

use optim_muon::{adjusted_lr, zeropower_via_newtonschulz5, AdjustLr, Group, Muon, MuonConfig};
use plugin_api::{
    tch::{Kind, Tensor},
    NamedTensor, Optimizer,
};
use std::collections::HashMap;

mod common;
use common::Fixture;

const SHAPES: [&str; 3] = ["tall", "wide", "square"];
const SCALINGS: [&str; 2] = ["original", "match_rms_adamw"];

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_kind(Kind::Double) - b.to_kind(Kind::Double)).abs().max().double_value(&[])
}

/// Runs 10 steps of the plugin on the fixture's gradients; returns, per step, each shape's
/// parameter, and the final state.
fn run_plugin(f: &Fixture, scaling: &str, ns_dtype: &str) -> (Vec<Vec<Tensor>>, HashMap<String, Tensor>) {
    let h = f.json("hyper");
    let lrs: Vec<f64> = serde_json::from_value(f.json("lr")).unwrap();
    let lr_max = h["lr_max"].as_f64().unwrap();
    let config = format!(
        "lr = {lr_max:e}\nmomentum = {}\nnesterov = {}\nns_steps = {}\neps = {:e}\nweight_decay = {}\n\
         adjust_lr = \"{scaling}\"\nns_dtype = \"{ns_dtype}\"\nadamw_patterns = []\nno_decay_patterns = []\n",
        h["momentum"],
        h["nesterov"],
        h["ns_steps"],
        h["eps"].as_f64().unwrap(),
        h["weight_decay"],
    );
    let coefficients: Vec<f64> = serde_json::from_value(h["ns_coefficients"].clone()).unwrap();
    let (a, b, c) = optim_muon::NS_COEFFICIENTS;
    assert_eq!(coefficients, vec![a, b, c], "fixture made with other Newton-Schulz coefficients");

    // Copies: the steps update parameters in place, and the fixture's `init` serves every run.
    let params: Vec<Tensor> =
        SHAPES.iter().map(|n| f.get(&format!("init.{n}")).copy().set_requires_grad(true)).collect();
    let mut opt = plugin_api::author::Contained::new(Muon::new(MuonConfig::from_toml(&config).unwrap()));
    opt.init(SHAPES.iter().zip(&params).map(|(n, p)| NamedTensor::new(*n, p.shallow_clone())).collect()).unwrap();
    assert!(opt.groups().iter().all(|(_, g)| *g == Group::Muon));
    let mut history = Vec::new();
    for (t, lr) in lrs.iter().enumerate() {
        let t = t + 1;
        for (n, p) in SHAPES.iter().zip(&params) {
            let mut p = p.shallow_clone();
            p.zero_grad();
            // d/dp sum(p * g) = g exactly.
            (&p * f.get(&format!("grad.{n}.{t}"))).sum(Kind::Float).backward();
        }
        opt.step(lr / lr_max).unwrap();
        history.push(params.iter().map(|p| p.detach().copy()).collect());
    }
    let state = opt.state().unwrap().into_iter().map(|nt| (nt.name.to_string(), nt.tensor.into_tensor())).collect();
    (history, state)
}

/// The fixture says which dtype torch's Newton-Schulz used for float32 CPU gradients.
#[test]
fn torch_runs_newton_schulz_in_bf16_on_the_cpu() {
    let f = Fixture::load("muon.safetensors");
    assert_eq!(f.meta["torch_ns_dtype_cpu"], "bfloat16");
}

/// One bf16 ulp at 1.0 (2^-8): the tolerance on bf16 Newton-Schulz entries, which lie in about
/// [-1, 1]. torch and the plugin run the same ops in the same dtype, so they agree bit for bit when
/// libtorch picks the same kernels (the fixture's CPU and this one do: measured 0); on another CPU
/// or thread count an fp32 accumulation order can differ (the plugin's fused `b A + c A A` goes
/// through baddbmm where torch calls addmm) and flip a bf16 rounding, which later steps carry on
/// at about that size. bf16 vs f32 differ by 1.3e-2..1.4e-2 here, more than 3x this bound.
const BF16_NS_TOL: f64 = 1.0 / 256.0;

/// Newton-Schulz alone, on each shape's first gradient.
#[test]
fn newton_schulz_matches_torch() {
    let f = Fixture::load("muon.safetensors");
    for n in SHAPES {
        let g = f.get(&format!("grad.{n}.1"));
        // float32 vs torch's steps in float32: only fp32 rounding and summation order can differ
        // (~1e-7 on entries of size <= 1); 1e-5 is the band torch's own fp32 optimizer tests use.
        let ours = zeropower_via_newtonschulz5(&g, 5, 1e-7);
        let d32 = max_abs_diff(&ours, &f.get(&format!("ns.f32.{n}")));
        assert!(d32 < 1e-5, "{n}: f32 Newton-Schulz max|diff| {d32:e}");
        let ours = zeropower_via_newtonschulz5(&g.to_kind(Kind::BFloat16), 5, 1e-7);
        let want = f.get(&format!("ns.bf16.{n}"));
        let d = max_abs_diff(&ours, &want);
        let gap = max_abs_diff(&want, &f.get(&format!("ns.f32.{n}")));
        eprintln!("{n}: Newton-Schulz max|diff| vs torch: f32 {d32:e}, bf16 {d:e} (torch bf16 vs f32: {gap:e})");
        assert!(d <= BF16_NS_TOL, "{n}: bf16 Newton-Schulz max|diff| {d:e}");
        assert!(gap > 2.0 * BF16_NS_TOL, "{n}: the bf16 bound would not tell bf16 from f32 ({gap:e})");
    }
}

/// 10 steps with `ns_dtype = "f32"` against torch with a float32 Newton-Schulz: everything is
/// fp32, so the gap is rounding (the script's float64 cross-check of the torch run sees 6e-7);
/// torch's own fp32 optimizer tests use 1e-6..1e-5. Momentum buffers depend on the gradients
/// only, not on Newton-Schulz: 1e-6, AdamW's parity bound.
#[test]
fn ten_steps_f32_match_torch_muon() {
    let f = Fixture::load("muon.safetensors");
    for scaling in SCALINGS {
        let (history, state) = run_plugin(&f, scaling, "f32");
        let mut worst = 0.0f64;
        for (t, params) in history.iter().enumerate() {
            for (n, p) in SHAPES.iter().zip(params) {
                let want = f.get(&format!("{scaling}.f32.param.{n}.{}", t + 1));
                let d = max_abs_diff(p, &want);
                worst = worst.max(d);
                assert!(p.allclose(&want, 1e-5, 1e-5, false), "{scaling} {n} after step {}: max|diff| {d:e}", t + 1);
            }
        }
        eprintln!("{scaling}: f32 max|diff| over 10 steps and 3 shapes {worst:e}");
        for n in SHAPES {
            let (ours, want) = (&state[&format!("{n}.momentum_buffer")], f.get(&format!("momentum_buffer.{n}")));
            assert!(ours.allclose(&want, 1e-6, 1e-6, false), "{scaling} momentum buffer of {n}");
        }
        assert_eq!(state["step"].int64_value(&[]), 10);
    }
}

/// 10 steps with `ns_dtype = "bf16"` against torch as shipped (bf16 Newton-Schulz on the CPU).
///
/// Parameters, momentum and decay are fp32; only each step's orthogonalised update O carries bf16
/// error. Step t moves a parameter by adjusted_lr_t * O_t, so entries of O within BF16_NS_TOL move
/// it by at most adjusted_lr_t * BF16_NS_TOL: after step t the bound is BF16_NS_TOL times the sum
/// of adjusted_lr so far (6.7e-4 / 3.0e-4 after 10 steps for tall "original" / "match_rms_adamw").
/// A wrong lr scaling, decay or momentum moves parameters by 1e-3..1e-1 in the first steps, and
/// torch bf16 vs torch f32 already differ by more than the bound at step 1.
#[test]
fn ten_steps_bf16_match_torch_muon() {
    let f = Fixture::load("muon.safetensors");
    let lrs: Vec<f64> = serde_json::from_value(f.json("lr")).unwrap();
    for scaling in SCALINGS {
        let adjust = if scaling == "original" { AdjustLr::Original } else { AdjustLr::MatchRmsAdamw };
        let (history, _) = run_plugin(&f, scaling, "bf16");
        for (i, n) in SHAPES.iter().enumerate() {
            let shape = f.get(&format!("init.{n}")).size();
            let mut worst = 0.0f64;
            let mut bound = 0.0;
            for (t, params) in history.iter().enumerate() {
                bound += BF16_NS_TOL * adjusted_lr(lrs[t], adjust, shape[0], shape[1]);
                let want = f.get(&format!("{scaling}.bf16.param.{n}.{}", t + 1));
                let d = max_abs_diff(&params[i], &want);
                worst = worst.max(d);
                assert!(d <= bound, "{scaling} {n} after step {}: max|diff| {d:e} > {bound:e}", t + 1);
                if t == 0 {
                    let f32_gap = max_abs_diff(&want, &f.get(&format!("{scaling}.f32.param.{n}.1")));
                    assert!(f32_gap > bound, "{scaling} {n}: the bound would not tell bf16 from f32 ({f32_gap:e})");
                }
            }
            eprintln!("{scaling} {n}: bf16 max|diff| over 10 steps {worst:e} (bound after step 10: {bound:e})");
        }
    }
}
