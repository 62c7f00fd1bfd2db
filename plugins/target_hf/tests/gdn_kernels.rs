//! On a GPU (`make gpu-test`): a random Qwen3.5 hybrid whose Gated DeltaNet layers have
//! Qwen3.6's 128-dim heads (the dims the layer's kernels take: the chunk quantities straight from
//! the conv output, the scan, the gated RMSNorm), in bf16, against the same model with the kernels
//! off (libtorch's composites): every layer's features and the logits, over sequences of a partial
//! chunk, and a rollback of the decoding cache equal to a forward over the kept tokens.

use plugin_api::tch::{Device, Kind, Tensor};
use target_hf::HfTarget;

/// The test fixture's config with 128-dim Gated DeltaNet heads, 2 key heads shared by 4 value heads.
fn config(dir: &std::path::Path) -> std::path::PathBuf {
    // Embedded, so the test binary runs where the sources are not.
    let fixture = include_str!("../../../tests/fixtures/target_qwen3_5/config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(fixture).unwrap();
    let text = &mut cfg["text_config"];
    for (key, value) in [
        ("hidden_size", 256),
        ("intermediate_size", 512),
        ("head_dim", 64),
        ("linear_key_head_dim", 128),
        ("linear_value_head_dim", 128),
    ] {
        text[key] = value.into();
    }
    let path = dir.join("config.json");
    std::fs::write(&path, cfg.to_string()).unwrap();
    path
}

/// ||got - want|| / ||want||.
fn rel_norm(got: &Tensor, want: &Tensor) -> f64 {
    let (got, want) =
        (got.to_device(Device::Cpu).to_kind(Kind::Double), want.to_device(Device::Cpu).to_kind(Kind::Double));
    (&got - &want).norm().double_value(&[]) / want.norm().double_value(&[])
}

#[test]
#[ignore = "needs a CUDA device: make gpu-test"]
fn cuda_gdn_kernels_match_the_composites_in_a_hybrid_target() {
    let dev = kernels::cuda_test_device();
    let dir = tempfile::tempdir().unwrap();
    plugin_api::tch::manual_seed(5);
    let mut t = HfTarget::random(&config(dir.path()), dev, Kind::BFloat16, 1).unwrap();
    let layers = t.spec.num_hidden_layers as i64;
    let all: Vec<u32> = (0..layers as u32).collect();
    let ids = Tensor::randint(64, [2, 200], (Kind::Int64, dev));
    let run = |on: bool| kernels::nvrtc::with_enabled(on, || t.features(&ids, &all, true).unwrap());
    let ((h_on, l_on), (h_off, l_off)) = (run(true), run(false));
    let (l_on, l_off) = (l_on.unwrap(), l_off.unwrap());
    let h = h_on.size()[2] / layers;
    let by_layer: Vec<f64> =
        (0..layers).map(|i| rel_norm(&h_on.narrow(2, i * h, h), &h_off.narrow(2, i * h, h))).collect();
    let logits = rel_norm(&l_on, &l_off);
    let shown: Vec<String> = by_layer.iter().map(|e| format!("{e:.2e}")).collect();
    eprintln!("kernels vs composites, bf16: features by layer [{}], logits {logits:.2e}", shown.join(", "));
    // bf16 rounding in different places (a wrong layout or gate is off by order 1).
    for (i, e) in by_layer.iter().enumerate() {
        assert!(*e < 5e-2, "layer {i}: features off by {e:.2e}");
    }
    assert!(logits < 5e-2, "logits off by {logits:.2e}");
    assert!(!h_on.equal(&h_off), "the kernels did not run (bit-identical to the composites)");

    // Extend by a prompt then a block, roll back into the block, extend again: the logits equal
    // the rows of one forward over the tokens kept (the rolled-back state recomputed as the
    // forward computes it, by the same kernels).
    let seq: Vec<i64> = Vec::try_from(ids.get(0).to_device(Device::Cpu)).unwrap();
    let row = |s: &[i64]| Tensor::from_slice(s).unsqueeze(0).to_device(dev);
    let (prompt, block, kept, more) = (&seq[..100], &seq[100..116], 5usize, &seq[150..160]);
    t.session = t.model.new_cache(true);
    drop(t.extend(&row(prompt), &[0]).unwrap());
    drop(t.extend(&row(block), &[0]).unwrap());
    t.model.truncate(&mut t.session, (100 + kept) as i64).unwrap();
    let (_, logits) = t.extend(&row(more), &[0]).unwrap();
    let whole: Vec<i64> = [prompt, &block[..kept], more].concat();
    let (_, full) = t.features(&row(&whole), &[0], true).unwrap();
    let want = full.unwrap().narrow(1, (100 + kept) as i64, more.len() as i64);
    let err = rel_norm(&logits, &want);
    eprintln!("logits after a rollback against one forward: {err:.2e}");
    assert!(err < 5e-2, "logits after the rollback off by {err:.2e}");
}
