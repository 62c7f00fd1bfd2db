//! Every family against transformers 5.8.1: tiny random models saved by transformers itself as
//! HF folders (`tests/fixtures/target_*`, made by
//! `scripts/fixtures/make_target_fixtures.py`), loaded here
//! like any checkpoint (sharded, the multimodal layout for qwen3_5): the Qwen3.5 hybrid (Gated
//! DeltaNet + gated attention), Qwen3.5-MoE, Qwen3-MoE, Mistral and Ministral (sliding windows),
//! Gemma 2 (soft caps) and Gemma 3 (a RoPE per layer kind), gpt-oss (sinks, sliding layers,
//! clamped experts), LFM2 (short convs), DeepSeek-V3 (latent attention, grouped routing),
//! GLM-4.5 (partial RoPE) and LongCat-Flash (sublayers, zero-computation experts). Checked, in
//! f32 on the CPU:
//! - every layer's output and the logits on fixed ids, within 1e-4 of transformers (relative to
//!   the largest entry); the last layer's feature is `hidden_states[n]`, after the final norm;
//! - greedy generation with the KV / recurrent cache equals transformers' `generate` and, batched
//!   with left padding, each prompt generated alone;
//! - the speculative-decoding session: extending the cache, cutting it back into the last
//!   extension and extending again gives what a full recomputation gives, and greedy
//!   speculative decoding with a drafter that is often wrong is lossless.

use plugin_api::tch::{Device, Kind, Tensor};
use std::{collections::HashMap, path::PathBuf};
use target_hf::{generate, HfTarget};

const ARCHS: [&str; 12] = [
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_moe",
    "mistral",
    "ministral",
    "gemma2",
    "gemma3_text",
    "gpt_oss",
    "lfm2",
    "deepseek_v3",
    "glm4_moe",
    "longcat_flash",
];

/// The families whose state is recurrent (cut only within the last extension).
fn recurrent(arch: &str) -> bool {
    matches!(arch, "qwen3_5" | "qwen3_5_moe" | "lfm2")
}
const EOS: u32 = 63;

fn dir(arch: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(format!("target_{arch}"))
}

fn fixture(arch: &str) -> (HfTarget, HashMap<String, Tensor>) {
    let d = dir(arch);
    let t = HfTarget::load(&d, Device::Cpu, Kind::Float, 2).unwrap_or_else(|e| panic!("{arch}: {e}"));
    let refs = Tensor::read_safetensors(d.join("reference.safetensors")).unwrap().into_iter().collect();
    (t, refs)
}

/// max |got - want| / max |want|.
fn rel_err(got: &Tensor, want: &Tensor) -> f64 {
    assert_eq!(got.size(), want.size());
    (got - want).abs().max().double_value(&[]) / want.abs().max().double_value(&[])
}

fn ids(v: &[u32]) -> Tensor {
    Tensor::from_slice(&v.iter().map(|&i| i as i64).collect::<Vec<_>>()).unsqueeze(0)
}

fn to_vec(t: &Tensor) -> Vec<u32> {
    Vec::<i64>::try_from(t.flatten(0, -1)).unwrap().into_iter().map(|i| i as u32).collect()
}

#[test]
fn every_layer_and_the_logits_match_transformers() {
    for arch in ARCHS {
        let (t, r) = fixture(arch);
        assert_eq!(t.spec.architecture.as_str(), arch);
        let n = t.spec.num_hidden_layers;
        let h = t.spec.hidden_size as i64;
        let all: Vec<u32> = (0..n).collect();
        let (hidden, logits) = t.features(&r["in.input_ids"], &all, true).unwrap();
        for i in 0..n as i64 - 1 {
            let err = rel_err(&hidden.narrow(2, i * h, h), &r[&format!("out.layer.{i}")]);
            assert!(err < 1e-4, "{arch} layer {i}: relative error {err:.2e}");
        }
        let logits = logits.unwrap();
        let err = rel_err(&logits, &r["out.logits"]);
        assert!(err < 1e-4, "{arch} logits: relative error {err:.2e}");
        // The last layer's feature is transformers' `hidden_states[n]` (DFlash's
        // `hidden_states[id + 1]`), taken after the final norm: the LM head's input, so the head
        // applied to it gives transformers' logits, and it is not the layer's raw output.
        let last = hidden.narrow(2, (n as i64 - 1) * h, h);
        assert!(t.model.logits(&last).equal(&logits), "{arch}: the last layer's feature is not the LM head's input");
        let err = rel_err(&t.model.logits(&last), &r["out.logits"]);
        assert!(err < 1e-4, "{arch} logits from the last feature: relative error {err:.2e}");
        let raw = rel_err(&last, &r[&format!("out.layer.{}", n - 1)]);
        assert!(raw > 1e-2, "{arch}: the last layer's feature is its output before the final norm");
        // Asked for alone, without logits, it is the same.
        let (alone, _) = t.features(&r["in.input_ids"], &[n - 1], false).unwrap();
        assert!(alone.equal(&last), "{arch}: the last layer's feature differs when asked for alone");
        eprintln!("{arch}: logits within {err:.1e} of transformers'");
        // Only the layers up to the deepest feature run; their outputs are the same.
        let (first, none) = t.features(&r["in.input_ids"], &[0], false).unwrap();
        assert!(none.is_none() && first.equal(&hidden.narrow(2, 0, h)), "{arch}: a partial forward differs");
    }
}

/// In bf16 (what runs on the GPU: bf16 weights and activations, the delta rule's matmuls on
/// bf16 operands) the whole path runs, cached decoding and rollback included, and the logits
/// stay near transformers' fp32 ones. Loosely: hidden size 32 averages no rounding away (layer
/// 0 is already ~2.5% off in RMS), and in the MoE models bf16 flips some tokens' expert choice.
#[test]
fn a_bf16_target_runs_and_stays_near() {
    for arch in ARCHS {
        let (_, r) = fixture(arch);
        let mut t = HfTarget::load(&dir(arch), Device::Cpu, Kind::BFloat16, 2).unwrap();
        let (_, logits) = t.features(&r["in.input_ids"], &[0], true).unwrap();
        let (got, want) = (logits.unwrap().to_kind(Kind::Float), &r["out.logits"]);
        let rms = ((&got - want).square().mean(Kind::Float) / want.square().mean(Kind::Float)).sqrt().double_value(&[]);
        let agree = got
            .argmax(-1, false)
            .eq_tensor(&want.argmax(-1, false))
            .to_kind(Kind::Float)
            .mean(Kind::Float)
            .double_value(&[]);
        assert!(rms < 0.3 && agree > 0.8, "{arch} in bf16: logits RMS error {rms:.2e}, argmax agreement {agree:.3}");
        let out = generate::greedy(&t.model, &[to_vec(&r["gen.prompt"])], 4, &[], 1);
        assert_eq!(out[0].len(), 4);
        t.session = t.model.new_cache(true);
        drop(t.extend(&ids(&to_vec(&r["gen.prompt"])), &[0]).unwrap());
        drop(t.extend(&ids(&[1, 2, 3]), &[0]).unwrap());
        t.model.truncate(&mut t.session, 13).unwrap();
    }
}

#[test]
fn cached_greedy_generation_matches_transformers_and_batching() {
    for arch in ARCHS {
        let (t, r) = fixture(arch);
        let prompt = to_vec(&r["gen.prompt"]);
        let want = to_vec(&r["gen.ids"]);
        let got = generate::greedy(&t.model, std::slice::from_ref(&prompt), 10, &[EOS], 1).remove(0);
        assert_eq!(got, want, "{arch}: greedy generation differs from transformers'");
        // Batched with a shorter prompt (left-padded: its recurrence must start at its first
        // token), each row equals its prompt generated alone.
        let short = to_vec(&r["in.input_ids"].get(1).narrow(0, 0, 7));
        let alone = generate::greedy(&t.model, std::slice::from_ref(&short), 10, &[EOS], 1).remove(0);
        let both = generate::greedy(&t.model, &[prompt.clone(), short.clone()], 10, &[EOS], 2);
        assert_eq!(both, vec![want, alone], "{arch}: batched generation differs");
    }
}

/// Extend by a prompt, then a block; cut into the block; extend again: the logits equal the
/// rows of one forward over the sequence kept. Cutting before the last extension is refused.
#[test]
fn the_session_rolls_back_into_its_last_extension() {
    for arch in ARCHS {
        let (mut t, r) = fixture(arch);
        let seq = to_vec(&r["in.input_ids"].get(0));
        let (prompt, block, kept, more) = (&seq[..20], &seq[20..26], 2usize, &seq[40..45]);
        t.session = t.model.new_cache(true);
        drop(t.extend(&ids(prompt), &[0]).unwrap());
        drop(t.extend(&ids(block), &[0]).unwrap());
        t.model.truncate(&mut t.session, (20 + kept) as i64).unwrap();
        let (_, logits) = t.extend(&ids(more), &[0]).unwrap();
        let whole: Vec<u32> = [prompt, &block[..kept], more].concat();
        let (_, full) = t.features(&ids(&whole), &[0], true).unwrap();
        let want = full.unwrap().narrow(1, (20 + kept) as i64, more.len() as i64);
        let err = rel_err(&logits, &want);
        assert!(err < 1e-4, "{arch}: logits after the rollback: relative error {err:.2e}");
        // Back to the start of the last extension (keep 0 of it), then extend: also exact.
        t.model.truncate(&mut t.session, (20 + kept) as i64).unwrap();
        let (_, again) = t.extend(&ids(more), &[0]).unwrap();
        assert!(rel_err(&again, &want) < 1e-4, "{arch}: keeping none of an extension");
        let err = t.model.truncate(&mut t.session, 10).map(|_| ()).err();
        if !recurrent(arch) {
            assert!(err.is_none(), "{arch}: attention alone cuts anywhere");
        } else {
            let err = err.expect("a recurrent state cannot be cut before the last extension");
            assert!(err.contains("cache_truncate(10)") && err.contains("positions 22..27"), "{err}");
        }
    }
}

/// Greedy speculative decoding (as `dflash-host eval` runs it) with a drafter that proposes the
/// target's own next tokens with some of them replaced: the output equals plain greedy decoding.
#[test]
fn speculative_decoding_is_lossless() {
    for arch in ARCHS {
        let (mut t, r) = fixture(arch);
        let prompt = to_vec(&r["gen.prompt"]);
        let max_new = 24;
        let greedy = generate::greedy(&t.model, std::slice::from_ref(&prompt), max_new, &[], 1).remove(0);
        let block = 5;
        t.session = t.model.new_cache(true);
        let (_, logits) = t.extend(&ids(&prompt), &[0]).unwrap();
        let mut out = vec![logits.get(0).get(prompt.len() as i64 - 1).argmax(-1, false).int64_value(&[]) as u32];
        let mut cycle = 0;
        while out.len() < max_new {
            // Drafts: the true continuation, wrong from a cycle-dependent position on.
            let at = out.len();
            let wrong_from = cycle % block;
            let drafts: Vec<u32> = (0..block - 1)
                .map(|j| {
                    if j < wrong_from {
                        greedy.get(at + j).copied().unwrap_or(0)
                    } else {
                        (7 * cycle as u32 + j as u32) % 60
                    }
                })
                .collect();
            let base = (prompt.len() + out.len() - 1) as i64;
            let mut verify = vec![*out.last().unwrap()];
            verify.extend(&drafts);
            let (_, logits) = t.extend(&ids(&verify), &[0]).unwrap();
            let posterior: Vec<u32> = to_vec(&logits.get(0).argmax(-1, false));
            let accepted = drafts.iter().zip(&posterior).take_while(|(d, p)| d == p).count();
            t.model.truncate(&mut t.session, base + accepted as i64 + 1).unwrap();
            out.extend(&drafts[..accepted]);
            out.push(posterior[accepted]);
            cycle += 1;
        }
        out.truncate(max_new);
        assert_eq!(out, greedy, "{arch}: speculative output differs from greedy decoding");
    }
}
