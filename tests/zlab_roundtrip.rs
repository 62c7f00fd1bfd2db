//! z-lab format: a checkpoint exported (config.json + bf16 model.safetensors) and read back as
//! `[drafter] init_from` gives a drafter with identical outputs (weights already bf16-exact),
//! sliding-window layers included; a config field the drafter cannot honour is refused by name;
//! and each preset in configs/presets/ exports the config.json SpecForge ships for it.

use dflash_host::{
    config::{PluginSection, RunConfig},
    experiment::Experiment,
    export,
    plugins::Registry,
};
use drafter_dflash::{read_zlab, DFlashPlugin, DrafterSection, DrafterShell};
use plugin_api::{
    abi_stable::std_types::RSome,
    author::Contained,
    tch::{Device, Kind, Tensor},
    DraftInput, Drafter, HostContext, PluginInstance, PluginKind, TargetSpec, TensorHandle,
};
use std::path::Path;
use test_support::TinySpec;

mod common;

/// The drafter as the host holds it (the ABI's methods).
fn dflash(cfg: &drafter_dflash::config::DFlashConfig, device: Device, kind: Kind) -> Contained<DFlashPlugin> {
    Contained::new(DFlashPlugin::new(cfg, device, kind))
}

#[test]
fn export_then_import_gives_identical_outputs() {
    export_then_import("");
}

/// A sliding-window layer (window 5, shorter than the context) survives export -> import.
#[test]
fn export_then_import_keeps_sliding_window_layers() {
    let json = export_then_import("layer_types = [\"sliding_attention\", \"full_attention\"]\nsliding_window = 5");
    assert_eq!(json["layer_types"], serde_json::json!(["sliding_attention", "full_attention"]));
    assert_eq!((json["sliding_window"].as_u64(), json["use_sliding_window"].as_bool()), (Some(5), Some(true)));
}

/// A 2-layer drafter for the tiny target (`extra` added to its section) whose f32 weights are
/// bf16-exact, so the bf16 export holds them exactly; its config.
fn bf16_exact_drafter(extra: &str) -> (Contained<DFlashPlugin>, drafter_dflash::config::DFlashConfig) {
    let section: DrafterSection = plugin_api::parse_section(&format!(
        "num_hidden_layers = 2\nblock_size = 4\nnum_target_features = 3\nmask_token_id = 63\n{extra}"
    ))
    .unwrap();
    let cfg = section.resolve(&TargetSpec::tiny()).unwrap();
    plugin_api::tch::manual_seed(1);
    let a = dflash(&cfg, Device::Cpu, Kind::Float);
    plugin_api::tch::no_grad(|| {
        for p in a.parameters().unwrap().iter() {
            let mut t = p.tensor.tensor();
            t.copy_(&(t.to_kind(Kind::BFloat16).to_kind(Kind::Float) + 0.01 * t.sign()));
            t.copy_(&t.to_kind(Kind::BFloat16).to_kind(Kind::Float));
        }
    });
    (a, cfg)
}

/// Inputs for the tiny drafter: 2 sequences of 10 context positions, 2 blocks of 4 each.
fn tiny_input() -> DraftInput {
    DraftInput {
        target_hidden: TensorHandle::new(Tensor::randn([2, 10, 96], (Kind::Float, Device::Cpu))),
        block_embeds: TensorHandle::new(Tensor::randn([2, 8, 32], (Kind::Float, Device::Cpu))),
        anchors: TensorHandle::new(Tensor::from_slice(&[2i64, 6, 1, 9]).view([2, 2])),
        anchor_valid: TensorHandle::new(Tensor::ones([2, 2], (Kind::Bool, Device::Cpu))),
    }
}

/// Export a 2-layer drafter (`extra` added to its section), read it back, compare outputs; the
/// exported config.json.
fn export_then_import(extra: &str) -> serde_json::Value {
    let spec = TargetSpec::tiny();
    let (a, cfg) = bf16_exact_drafter(extra);
    let dir = tempfile::tempdir().unwrap();
    let exp = Experiment::create(&dir.path().join("exp"), "", &serde_json::json!({})).unwrap();
    let ckpt = exp
        .save_checkpoint(7, &a.parameters().unwrap(), a.config_json().unwrap().as_str(), &[], &serde_json::json!({}), 1)
        .unwrap();
    assert_eq!(dflash_host::experiment::checkpoint::find(&dir.path().join("exp"), None).unwrap().dir, ckpt);
    let out = dir.path().join("zlab");
    // What an export killed mid-write leaves (a dead process's temporary folder) goes; a live
    // one's (this process's parent: alive) stays.
    let dead = dir.path().join(".zlab.export-2147483646");
    let live = dir.path().join(format!(".zlab.export-{}", std::os::unix::process::parent_id()));
    std::fs::create_dir_all(&dead).unwrap();
    std::fs::create_dir_all(&live).unwrap();
    export::export(&ckpt, &out, false, &dflash_host::plugins::Registry::new(&[]).unwrap()).unwrap();
    assert!(!dead.exists() && live.exists(), "stale export folders: dead {}, live {}", dead.exists(), live.exists());

    // The folder is the z-lab format: config fields and bf16 tensors with z-lab names.
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(json["architectures"][0], "DFlashDraftModel");
    assert_eq!(json["model_type"], "qwen3");
    assert_eq!(json["dtype"], "bfloat16");
    assert!(json.get("torch_dtype").is_none());
    // A synthetic target says nothing of its context: HF's Qwen3 default.
    assert_eq!(json["max_position_embeddings"], 32768);
    assert_eq!(json["block_size"], 4);
    assert_eq!(json["num_target_layers"], 8);
    assert_eq!(json["dflash_config"]["mask_token_id"], 63);
    assert_eq!(json["dflash_config"]["target_layer_ids"], serde_json::json!([1, 3, 5]));
    let tensors = Tensor::read_safetensors(out.join("model.safetensors")).unwrap();
    assert!(tensors.iter().all(|(_, t)| t.kind() == Kind::BFloat16));
    let names: Vec<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
    for n in [
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "layers.1.self_attn.k_norm.weight",
        "layers.0.mlp.gate_proj.weight",
    ] {
        assert!(names.contains(&n), "{n} missing: {names:?}");
    }
    assert!(!names.iter().any(|n| n.contains("embed") || n.contains("lm_head")));

    let (cfg_b, weights) = read_zlab(&out, &spec).unwrap();
    assert_eq!(cfg_b.dflash_config, cfg.dflash_config);
    assert_eq!(cfg_b.windows(), cfg.windows());
    let mut b = DFlashPlugin::new(&cfg_b, Device::Cpu, Kind::Float);
    b.load(weights.into()).unwrap();
    let mut b = Contained::new(b);

    plugin_api::tch::manual_seed(3);
    let x = tiny_input();
    let mut a = a;
    let ya = a.forward(&x).unwrap().into_tensor();
    let yb = b.forward(&x).unwrap().into_tensor();
    let diff = || (&ya - &yb).abs().max().double_value(&[]);
    assert!(ya.equal(&yb), "outputs differ after export/import: max |diff| {:e}", diff());

    // A folder for another target is refused with the reason.
    let mut other = TargetSpec::tiny();
    other.hidden_size = 64;
    let err = read_zlab(&out, &other).unwrap_err().to_string();
    assert!(err.contains("hidden_size 32 does not fit the target's 64"), "{err}");
    json
}

/// The export loads with transformers' `AutoModel` (`trust_remote_code`: the `dflash.py` it ships)
/// and computes what our drafter computes, a sliding-window layer and GQA included:
/// scripts/test/check_dflash_py.py runs it on inputs and the output ours gave, written here. Needs a
/// Python with torch and transformers (`DFLASH_PYTHON`, else `python3`); without one the test
/// says so and passes.
#[test]
fn automodel_loads_the_export_and_matches_our_forward() {
    let python = match common::python_with(&["torch", "transformers", "safetensors"]) {
        Ok(p) => p,
        Err(why) => {
            eprintln!("skipped: {why}");
            return;
        }
    };
    let (mut a, _) = bf16_exact_drafter(
        "num_attention_heads = 4\nnum_key_value_heads = 2\nhead_dim = 8\n\
         layer_types = [\"sliding_attention\", \"full_attention\"]\nsliding_window = 5",
    );
    let dir = tempfile::tempdir().unwrap();
    let exp = Experiment::create(&dir.path().join("exp"), "", &serde_json::json!({})).unwrap();
    let ckpt = exp
        .save_checkpoint(7, &a.parameters().unwrap(), a.config_json().unwrap().as_str(), &[], &serde_json::json!({}), 1)
        .unwrap();
    let out = dir.path().join("zlab");
    export::export(&ckpt, &out, false, &dflash_host::plugins::Registry::new(&[]).unwrap()).unwrap();
    assert!(out.join("dflash.py").is_file());
    plugin_api::tch::manual_seed(3);
    let x = tiny_input();
    let hidden = a.forward(&x).unwrap().into_tensor().detach();
    let reference = dir.path().join("reference.safetensors");
    Tensor::write_safetensors(
        &[
            ("target_hidden", &x.target_hidden.tensor()),
            ("block_embeds", &x.block_embeds.tensor()),
            ("anchors", &x.anchors.tensor()),
            ("hidden", &hidden),
        ],
        &reference,
    )
    .unwrap();
    let run = std::process::Command::new(&python)
        .arg(common::root().join("scripts/test/check_dflash_py.py"))
        .arg(&out)
        .arg(&reference)
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_MODULES_CACHE", dir.path().join("hf_modules"))
        .output()
        .unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "{python} scripts/test/check_dflash_py.py: {said}");
    eprintln!("{}", said.trim());
}

/// `init_from` refuses a config.json field the drafter does not honour, in one line that names
/// it: an unknown field, a RoPE scaling it does not compute, a layout it cannot serve as trained.
#[test]
fn init_from_refuses_fields_it_cannot_honour() {
    let spec = TargetSpec::tiny();
    let section: DrafterSection =
        plugin_api::parse_section("num_hidden_layers = 2\nblock_size = 4\nnum_target_features = 3\nmask_token_id = 63")
            .unwrap();
    let a = dflash(&section.resolve(&spec).unwrap(), Device::Cpu, Kind::Float);
    let dir = tempfile::tempdir().unwrap();
    let exp = Experiment::create(&dir.path().join("exp"), "", &serde_json::json!({})).unwrap();
    let ckpt = exp
        .save_checkpoint(1, &a.parameters().unwrap(), a.config_json().unwrap().as_str(), &[], &serde_json::json!({}), 1)
        .unwrap();
    let out = dir.path().join("zlab");
    export::export(&ckpt, &out, false, &dflash_host::plugins::Registry::new(&[]).unwrap()).unwrap();
    let good: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    read_zlab(&out, &spec).unwrap();
    for (key, value, want) in [
        ("partial_rotary_factor", serde_json::json!(0.5), "unknown field `partial_rotary_factor`"),
        (
            "rope_scaling",
            serde_json::json!({"rope_type": "longrope", "factor": 2.0}),
            "rope_type `longrope` is not supported",
        ),
        ("attention_bias", serde_json::json!(true), "field `attention_bias`"),
        ("layer_types", serde_json::json!(["sliding_attention", "full_attention"]), "`sliding_window` is not set"),
        ("hidden_act", serde_json::json!("gelu"), "field `hidden_act`"),
        ("rms_norm_eps", serde_json::json!(0.0), "field `rms_norm_eps`: 0: must be > 0"),
    ] {
        let mut cfg = good.clone();
        cfg[key] = value;
        std::fs::write(out.join("config.json"), cfg.to_string()).unwrap();
        let e = read_zlab(&out, &spec).unwrap_err().to_string();
        assert!(e.contains(want) && e.contains("config.json") && !e.contains('\n'), "{key}: {e}");
    }
}

/// Each preset's drafter, built against a random target of its target's shape and exported,
/// carries every field of the config.json SpecForge ships (tests/fixtures/specforge/). The
/// targets are tiny (hidden 32, MLP 96, one shared embedding; layers, heads, vocabulary, RoPE,
/// context length and special tokens as the real ones; the Qwen3.5 / 3.6 targets Gated DeltaNet
/// hybrids, 3 linear-attention layers to 1 full, partial rotary, the 35B-A3B with routed and
/// shared experts; LFM2.5 short convolutions with attention); the hidden size and MLP width are
/// compared at the tiny sizes.
#[test]
fn presets_export_the_published_configs() {
    const TINY_HIDDEN: u64 = 32;
    const TINY_MLP: u64 = 96;
    let root = common::root();
    let registry = Registry::new(&[]).unwrap();
    let presets = [
        "qwen3-8b",
        "qwen3-4b",
        "qwen2.5-0.5b",
        "qwen3.5-4b",
        "qwen3.5-35b-a3b",
        "qwen3.6-27b",
        "lfm2.5-1.2b-instruct",
        "longcat-flash",
    ];
    let on_disk = std::fs::read_dir(root.join("configs/presets")).unwrap().count();
    assert_eq!(on_disk, presets.len(), "a preset without a published config to check it against");
    for name in presets {
        let published: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(root.join(format!("tests/fixtures/specforge/{name}-dflash.json"))).unwrap(),
        )
        .unwrap();
        let cfg = RunConfig::load(&root.join(format!("configs/presets/{name}.toml"))).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let mut drafter_section = cfg.section("drafter");
        let mut table: toml::Table = toml::from_str(&drafter_section.config_toml).unwrap();

        // 1. The stand-in target: the published config's target facts, at tiny sizes.
        let p = |k: &str| published[k].clone();
        let hybrid = name.starts_with("qwen3.5") || name.starts_with("qwen3.6");
        let model_type = match name {
            _ if name.starts_with("qwen2.5") => "qwen2",
            "qwen3.5-35b-a3b" => "qwen3_5_moe_text",
            _ if hybrid => "qwen3_5_text",
            _ if name.starts_with("lfm2") => "lfm2",
            "longcat-flash" => "longcat_flash",
            _ => "qwen3",
        };
        let own_heads = table.contains_key("num_attention_heads");
        let heads = |k: &str, small: u64| if own_heads { small.into() } else { p(k) };
        let mut target = serde_json::json!({
            "model_type": model_type, "hidden_size": TINY_HIDDEN, "intermediate_size": TINY_MLP,
            "num_hidden_layers": p("num_target_layers"), "num_attention_heads": heads("num_attention_heads", 4),
            "num_key_value_heads": heads("num_key_value_heads", 2), "head_dim": heads("head_dim", 16), "vocab_size": p("vocab_size"),
            "rms_norm_eps": p("rms_norm_eps"), "rope_theta": p("rope_theta"), "rope_scaling": null,
            "max_position_embeddings": p("max_position_embeddings"), "bos_token_id": p("bos_token_id"),
            "eos_token_id": p("eos_token_id"), "tie_word_embeddings": true,
        });
        if hybrid {
            let layers = p("num_target_layers").as_u64().unwrap();
            let types: Vec<&str> =
                (0..layers).map(|i| if i % 4 == 3 { "full_attention" } else { "linear_attention" }).collect();
            let hybrid_fields = serde_json::json!({
                "layer_types": types, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8, "linear_num_key_heads": 2,
                "linear_num_value_heads": 4, "linear_value_head_dim": 8, "partial_rotary_factor": 0.25,
                "rope_parameters": {"rope_type": "default", "rope_theta": p("rope_theta"), "partial_rotary_factor": 0.25},
            });
            let experts = serde_json::json!({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "shared_expert_intermediate_size": 16});
            let moe = model_type.contains("moe");
            for (k, v) in
                hybrid_fields.as_object().unwrap().iter().chain(experts.as_object().unwrap().iter().filter(|_| moe))
            {
                target[k] = v.clone();
            }
        }
        if model_type == "lfm2" {
            // LFM2.5-1.2B's layout: short convolutions with attention at layers 2, 5, 8, 10, 12, 14.
            let attention = [2, 5, 8, 10, 12, 14];
            let layers = p("num_target_layers").as_u64().unwrap();
            let types: Vec<&str> =
                (0..layers).map(|i| if attention.contains(&i) { "full_attention" } else { "conv" }).collect();
            target["layer_types"] = serde_json::json!(types);
            target["conv_L_cache"] = 3.into();
            target["block_auto_adjust_ff_dim"] = false.into();
        }
        if model_type == "longcat_flash" {
            // LongCat-Flash's own facts, not its drafter's: RoPE base 1e7, RMS epsilon 1e-5 and a
            // context of 131072 (the preset states the drafter's); latent attention and experts.
            let layers = p("num_target_layers").as_u64().unwrap();
            let longcat = serde_json::json!({
                "num_layers": layers, "num_hidden_layers": 2 * layers, "ffn_hidden_size": TINY_MLP,
                "expert_ffn_hidden_size": 8, "n_routed_experts": 8, "zero_expert_num": 4, "moe_topk": 3,
                "routed_scaling_factor": 6.0, "kv_lora_rank": 12, "q_lora_rank": 16, "qk_nope_head_dim": 8,
                "qk_rope_head_dim": 4, "qk_head_dim": 12, "v_head_dim": 6, "head_dim": 4,
                "num_attention_heads": 4, "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "rope_theta": 1e7,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e7}, "max_position_embeddings": 131072,
            });
            for (k, v) in longcat.as_object().unwrap() {
                target[k] = v.clone();
            }
            target.as_object_mut().unwrap().remove("intermediate_size");
        }
        if let Some(pad) = published.get("pad_token_id") {
            target["pad_token_id"] = pad.clone();
        }
        let target_json = dir.path().join("config.json");
        std::fs::write(&target_json, target.to_string()).unwrap();
        let ctx = HostContext::cpu();
        let section = PluginSection {
            kind: "target",
            plugin: "hf".into(),
            config_toml: format!("path = {:?}\nrandom_init = true", target_json.display().to_string()),
        };
        let PluginInstance::Target(t) = registry.create(PluginKind::Target, &section, &ctx).unwrap().0 else {
            panic!("not a target")
        };

        // 2. The preset's drafter against it (an explicit MLP width shrunk too).
        if table.contains_key("intermediate_size") {
            table.insert("intermediate_size".into(), (TINY_MLP as i64).into());
        }
        drafter_section.config_toml = toml::to_string(&table).unwrap();
        let ctx = HostContext { target: RSome(t.spec().unwrap()), ..ctx };
        let PluginInstance::Drafter(d) = registry.create(PluginKind::Drafter, &drafter_section, &ctx).unwrap().0 else {
            panic!("not a drafter")
        };

        // 3. Checkpoint and export as a run does, then every published field.
        let exp = Experiment::create(&dir.path().join("exp"), "", &serde_json::json!({})).unwrap();
        let ckpt = exp
            .save_checkpoint(
                1,
                &d.parameters().unwrap(),
                d.config_json().unwrap().as_str(),
                &[],
                &serde_json::json!({}),
                1,
            )
            .unwrap();
        let out = dir.path().join("export");
        export::export(&ckpt, &out, false, &dflash_host::plugins::Registry::new(&[]).unwrap()).unwrap();
        let ours: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
        for (key, want) in published.as_object().unwrap() {
            // Which transformers wrote SpecForge's file: not a property of the drafter.
            if key == "transformers_version" {
                continue;
            }
            let want = match key.as_str() {
                "hidden_size" => TINY_HIDDEN.into(),
                "intermediate_size" => TINY_MLP.into(),
                _ => want.clone(),
            };
            let got = ours.get(key).unwrap_or_else(|| panic!("{name}: exported config has no `{key}`"));
            assert!(same_json(got, &want), "{name}: `{key}` is {got}, the published config says {want}");
        }
        // And it reads back as `init_from` for the same target.
        let (back, _) = read_zlab(&out, &t.spec().unwrap()).unwrap();
        assert_eq!(
            back.layer_types,
            published["layer_types"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap().to_string())
                .collect::<Vec<_>>()
        );
        assert!(Path::new(&out.join("model.safetensors")).exists());
    }
}

/// JSON values equal, numbers by value (1000000 and 1e6 alike).
fn same_json(a: &serde_json::Value, b: &serde_json::Value) -> bool {
    use serde_json::Value::*;
    match (a, b) {
        (Number(x), Number(y)) => x.as_f64() == y.as_f64(),
        (Array(x), Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same_json(x, y)),
        (Object(x), Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same_json(v, w)))
        }
        _ => a == b,
    }
}
