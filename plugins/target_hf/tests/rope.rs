//! RoPE scaling in the target against transformers 5.8.1: one tiny random Llama
//! (`tests/fixtures/target_llama_rope`, made by `scripts/fixtures/make_target_fixtures.py`) loaded as an
//! HF folder under each kind's `config.json` (default, linear, dynamic NTK, yarn with and without
//! mscale, llama3), 96 positions past every context the scalings name. Layer 0's output and the
//! logits must match within 1e-4 (relative to the largest entry), and each scaled run must be
//! far from the unscaled reference (so a scaling that is read and ignored fails).

use plugin_api::tch::{Device, Kind, Tensor};
use std::{collections::HashMap, path::PathBuf};
use target_hf::HfTarget;

const KINDS: [&str; 6] = ["default", "linear", "dynamic", "yarn", "yarn_mscale", "llama3"];

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/target_llama_rope")
}

/// max |got - want| / max |want|.
fn rel_err(got: &Tensor, want: &Tensor) -> f64 {
    assert_eq!(got.size(), want.size());
    (got - want).abs().max().double_value(&[]) / want.abs().max().double_value(&[])
}

/// The fixture's weights and tokenizer with `config.{kind}.json` as the folder's config.
fn target(kind: &str) -> (tempfile::TempDir, HfTarget) {
    let src = fixture_dir();
    let dir = tempfile::tempdir().unwrap();
    for f in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    std::fs::copy(src.join(format!("config.{kind}.json")), dir.path().join("config.json")).unwrap();
    let t = HfTarget::load(dir.path(), Device::Cpu, Kind::Float, 1).unwrap_or_else(|e| panic!("{kind}: {e}"));
    (dir, t)
}

#[test]
fn every_rope_scaling_matches_transformers_past_the_context() {
    let refs: HashMap<String, Tensor> =
        Tensor::read_safetensors(fixture_dir().join("reference.safetensors")).unwrap().into_iter().collect();
    let ids = &refs["in.input_ids"];
    for kind in KINDS {
        let (_dir, t) = target(kind);
        let (hidden, logits) = t.features(ids, &[0], true).unwrap();
        let logits = logits.unwrap();
        let err = rel_err(&hidden, &refs[&format!("{kind}.layer.0")]);
        assert!(err < 1e-4, "{kind} layer 0: relative error {err:.2e}");
        let err = rel_err(&logits, &refs[&format!("{kind}.logits")]);
        assert!(err < 1e-4, "{kind} logits: relative error {err:.2e}");
        if kind != "default" {
            let off = rel_err(&logits, &refs["default.logits"]);
            assert!(off > 1e-2, "{kind}: within {off:.2e} of the unscaled logits, the scaling does not show");
        }
        eprintln!("{kind}: logits within {err:.1e} of transformers'");
    }
}

/// Dynamic NTK leaves a sequence within `max_position_embeddings` (32) unscaled: the first 32
/// positions alone give the default RoPE's logits.
#[test]
fn dynamic_ntk_is_plain_rope_within_the_context() {
    let refs: HashMap<String, Tensor> =
        Tensor::read_safetensors(fixture_dir().join("reference.safetensors")).unwrap().into_iter().collect();
    let (_dir, t) = target("dynamic");
    let (_, logits) = t.features(&refs["in.input_ids"].narrow(1, 0, 32), &[0], true).unwrap();
    let err = rel_err(&logits.unwrap(), &refs["default.logits"].narrow(1, 0, 32));
    assert!(err < 1e-4, "dynamic within the context: relative error {err:.2e} to the default RoPE");
}
