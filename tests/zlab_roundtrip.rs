//! z-lab format: a checkpoint exported (config.json + bf16 model.safetensors) and read back as
//! `[drafter] init_from` gives a drafter with identical outputs (weights already bf16-exact).

use dflash_host::{experiment::Experiment, export};
use drafter_dflash::{read_zlab, DFlashPlugin, DrafterSection};
use plugin_api::{
    abi_stable::std_types::{RNone, RString},
    tch::{Device, Kind, Tensor},
    DraftInput, Drafter, TargetSpec, TensorHandle,
};

fn target_spec() -> TargetSpec {
    TargetSpec {
        architecture: RString::from("llama"),
        num_hidden_layers: 8,
        hidden_size: 32,
        vocab_size: 64,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 8,
        intermediate_size: 48,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-6,
        bos_token_id: RNone,
        eos_token_id: 2,
        pad_token_id: RNone,
        chat_template: RString::new(),
        source: RString::from("test"),
        source_sha256: RString::new(),
    }
}

#[test]
fn export_then_import_gives_identical_outputs() {
    let spec = target_spec();
    let section: DrafterSection =
        plugin_api::parse_section("num_hidden_layers = 2\nblock_size = 4\nnum_target_features = 3\nmask_token_id = 63").unwrap();
    let cfg = section.resolve(&spec).unwrap();
    plugin_api::tch::manual_seed(1);
    let a = DFlashPlugin::new(&cfg, Device::Cpu, Kind::Float);
    // Round the weights to bf16 so the bf16 export is exact.
    plugin_api::tch::no_grad(|| {
        for p in a.parameters().iter() {
            let mut t = p.tensor.tensor();
            let _ = t.copy_(&(t.to_kind(Kind::BFloat16).to_kind(Kind::Float) + 0.01 * t.sign()));
            let _ = t.copy_(&t.to_kind(Kind::BFloat16).to_kind(Kind::Float));
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let exp = Experiment::create(&dir.path().join("exp"), "", &serde_json::json!({})).unwrap();
    let ckpt = exp
        .save_checkpoint(7, &a.parameters(), a.config_json().as_str(), &[], &serde_json::json!({}), 1)
        .unwrap();
    assert_eq!(dflash_host::experiment::checkpoint::find(&dir.path().join("exp"), None).unwrap().dir, ckpt);
    let out = dir.path().join("zlab");
    export::export(&ckpt, &out, false).unwrap();

    // The folder is the z-lab format: config fields and bf16 tensors with z-lab names.
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(json["architectures"][0], "DFlashDraftModel");
    assert_eq!(json["model_type"], "qwen3");
    assert_eq!(json["torch_dtype"], "bfloat16");
    assert_eq!(json["block_size"], 4);
    assert_eq!(json["num_target_layers"], 8);
    assert_eq!(json["dflash_config"]["mask_token_id"], 63);
    assert_eq!(json["dflash_config"]["target_layer_ids"], serde_json::json!([1, 3, 5]));
    let tensors = Tensor::read_safetensors(out.join("model.safetensors")).unwrap();
    assert!(tensors.iter().all(|(_, t)| t.kind() == Kind::BFloat16));
    let names: Vec<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
    for n in ["fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight", "layers.0.mlp.gate_proj.weight"] {
        assert!(names.contains(&n), "{n} missing: {names:?}");
    }
    assert!(!names.iter().any(|n| n.contains("embed") || n.contains("lm_head")));

    let (cfg_b, weights) = read_zlab(&out, &spec).unwrap();
    assert_eq!(cfg_b.dflash_config, cfg.dflash_config);
    let mut b = DFlashPlugin::new(&cfg_b, Device::Cpu, Kind::Float);
    b.load(weights.into()).unwrap();

    let input = || DraftInput {
        target_hidden: TensorHandle::new(Tensor::randn([2, 10, 96], (Kind::Float, Device::Cpu))),
        block_embeds: TensorHandle::new(Tensor::randn([2, 8, 32], (Kind::Float, Device::Cpu))),
        anchors: TensorHandle::new(Tensor::from_slice(&[2i64, 6, 1, 9]).view([2, 2])),
        anchor_valid: TensorHandle::new(Tensor::ones([2, 2], (Kind::Bool, Device::Cpu))),
    };
    plugin_api::tch::manual_seed(3);
    let x = input();
    let mut a = a;
    let ya = a.forward(&x).unwrap().into_tensor();
    let yb = b.forward(&x).unwrap().into_tensor();
    assert!(ya.equal(&yb), "outputs differ after export/import");

    // A folder for another target is refused with the reason.
    let mut other = target_spec();
    other.hidden_size = 64;
    let err = read_zlab(&out, &other).unwrap_err().to_string();
    assert!(err.contains("hidden_size 32 does not fit the target's 64"), "{err}");
}
