//! The drafter as a whole: DFlash's visibility rule, weights in and out, the plugin trait
//! object, Muon's routing of the GDN parameters, and the default config with one line changed.

use crate::{config::LayerType, DrafterSection, GdnConfig, GdnPlugin};
use optim_muon::config::{Group, MuonConfig};
use plugin_api::{
    abi_stable::std_types::RSome,
    author::Contained,
    tch::{Device, Kind, Tensor},
    DraftInput, Drafter, HostContext, PluginInstance, TargetSpec, TensorHandle,
};
use test_support::TinySpec;

/// The plugin as the host holds it (the ABI's methods, panics contained).
fn contained(cfg: &GdnConfig, device: Device, kind: Kind) -> Contained<GdnPlugin> {
    Contained::new(GdnPlugin::new(cfg, device, kind))
}

fn tiny_config(section: &str) -> GdnConfig {
    let s: DrafterSection = plugin_api::parse_section(section).unwrap();
    s.resolve(&TargetSpec::tiny()).unwrap()
}

/// A hybrid with a small chunk, so contexts span several chunks.
fn hybrid() -> GdnConfig {
    tiny_config("layer_types = [\"gdn\", \"attention\", \"gdn\"]\nblock_size = 4\nnum_target_features = 2\nmask_token_id = 63\nchunk_size = 4")
}

fn forward(d: &mut Contained<GdnPlugin>, target_hidden: &Tensor, block_embeds: &Tensor, anchors: &Tensor) -> Tensor {
    let input = DraftInput {
        target_hidden: TensorHandle::new(target_hidden.shallow_clone()),
        block_embeds: TensorHandle::new(block_embeds.shallow_clone()),
        anchors: TensorHandle::new(anchors.shallow_clone()),
        anchor_valid: TensorHandle::new(anchors.ones_like().to_kind(Kind::Bool)),
    };
    d.forward(&input).into_result().unwrap().into_tensor()
}

/// DFlash's rule for the hybrid: a block's output depends on the context strictly before its
/// anchor and on its own tokens; never on later context or on another block.
#[test]
fn blocks_see_only_context_before_their_anchor_and_themselves() {
    tch::manual_seed(0);
    let cfg = hybrid();
    let mut d = contained(&cfg, Device::Cpu, Kind::Float);
    let (b, s, bk) = (2, 19, 4);
    let anchors = Tensor::from_slice(&[0i64, 4, 9, 13, 3, 8, 12, 19]).view([b, 4]);
    let a = anchors.size()[1];
    let th = Tensor::randn([b, s, 2 * 32], (Kind::Float, Device::Cpu));
    let be = Tensor::randn([b, a * bk, 32], (Kind::Float, Device::Cpu));
    let base = forward(&mut d, &th, &be, &anchors).view([b, a, bk, 32]);
    let block_diff = |other: &Tensor| (other.view([b, a, bk, 32]) - &base).abs().amax([2, 3], false); // [B, A]
    let anchor_at = |bi: i64, j: i64| anchors.int64_value(&[bi, j]);

    // 1. Context position p changes exactly the blocks whose anchor is after p.
    for p in [0i64, 3, 4, 8, 11, 12, 18] {
        let th2 = th.copy();
        let _ = th2.narrow(1, p, 1).f_add_scalar_(1.0).unwrap();
        let diff = block_diff(&forward(&mut d, &th2, &be, &anchors));
        for bi in 0..b {
            for j in 0..a {
                let dj = diff.double_value(&[bi, j]);
                if anchor_at(bi, j) > p {
                    assert!(dj > 1e-4, "context {p} should reach block {j} (anchor {}) of row {bi}", anchor_at(bi, j));
                } else {
                    assert!(
                        dj < 1e-6,
                        "context {p} leaked into block {j} (anchor {}) of row {bi}: {dj:.2e}",
                        anchor_at(bi, j)
                    );
                }
            }
        }
    }
    // 2. A block's tokens change that block only.
    for (bi, j) in [(0i64, 1i64), (1, 3)] {
        let be2 = be.copy();
        let _ = be2.get(bi).narrow(0, j * bk + 1, 1).f_add_scalar_(1.0).unwrap();
        let diff = block_diff(&forward(&mut d, &th, &be2, &anchors));
        for (bj, jj) in (0..b).flat_map(|x| (0..a).map(move |y| (x, y))) {
            let dj = diff.double_value(&[bj, jj]);
            if (bj, jj) == (bi, j) {
                assert!(dj > 1e-4, "block ({bi}, {j}) did not see its own token");
            } else {
                assert!(dj < 1e-6, "block ({bi}, {j})'s token leaked into block ({bj}, {jj}): {dj:.2e}");
            }
        }
    }
    // 3. A block's output does not depend on which other anchors share the batch.
    let alone = forward(
        &mut d,
        &th.narrow(0, 0, 1),
        &be.narrow(0, 0, 1).narrow(1, 2 * bk, bk),
        &anchors.narrow(0, 0, 1).narrow(1, 2, 1),
    );
    let err = (alone.view([bk, 32]) - base.get(0).get(2)).abs().max().double_value(&[]);
    assert!(err < 1e-5, "block 2 alone differs from block 2 among others by {err:.2e}");
}

/// parameters() / load_weights() round trip: a second drafter with other weights gives the
/// first's outputs once loaded; names are the checkpoint's (HF / FLA style).
#[test]
fn weights_round_trip() {
    let cfg = tiny_config("block_size = 4\nnum_target_features = 2\nmask_token_id = 63");
    tch::manual_seed(1);
    let mut a = contained(&cfg, Device::Cpu, Kind::Float);
    tch::manual_seed(2);
    let mut b = contained(&cfg, Device::Cpu, Kind::Float);
    let th = Tensor::randn([1, 9, 64], (Kind::Float, Device::Cpu));
    let be = Tensor::randn([1, 8, 32], (Kind::Float, Device::Cpu));
    let anchors = Tensor::from_slice(&[2i64, 6]).view([1, 2]);
    let want = forward(&mut a, &th, &be, &anchors);
    assert!((forward(&mut b, &th, &be, &anchors) - &want).abs().max().double_value(&[]) > 1e-3);

    let params = a.parameters().unwrap();
    let names: Vec<String> = params.iter().map(|p| p.name.to_string()).collect();
    for expected in [
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "layers.0.linear_attn.q_proj.weight",
        "layers.0.linear_attn.k_proj.weight",
        "layers.0.linear_attn.v_proj.weight",
        "layers.0.linear_attn.z_proj.weight",
        "layers.0.linear_attn.a_proj.weight",
        "layers.0.linear_attn.b_proj.weight",
        "layers.0.linear_attn.conv1d.weight",
        "layers.0.linear_attn.A_log",
        "layers.0.linear_attn.dt_bias",
        "layers.0.linear_attn.norm.weight",
        "layers.0.linear_attn.out_proj.weight",
        "layers.0.mlp.gate_proj.weight",
        "layers.3.input_layernorm.weight",
        "layers.4.self_attn.q_proj.weight",
        "layers.4.self_attn.k_norm.weight",
        "layers.4.post_attention_layernorm.weight",
    ] {
        assert!(names.iter().any(|n| n == expected), "no parameter `{expected}` in {names:?}");
    }
    assert!(!names.iter().any(|n| n.starts_with("layers.4.linear_attn") || n.starts_with("layers.0.self_attn")));
    let shape = |n: &str| params.iter().find(|p| p.name.as_str() == n).unwrap().tensor.tensor().size();
    // 4 heads of 8: q/k/v 32 channels each; conv over q|k|v = 96 channels.
    assert_eq!(shape("layers.0.linear_attn.conv1d.weight"), vec![96, 1, 4]);
    assert_eq!(shape("layers.0.linear_attn.A_log"), vec![4]);
    assert_eq!(shape("layers.0.linear_attn.a_proj.weight"), vec![4, 32]);
    assert_eq!(shape("layers.0.linear_attn.norm.weight"), vec![8]);

    let copies = || {
        params
            .iter()
            .map(|p| plugin_api::NamedTensor::new(p.name.to_string(), p.tensor.tensor().copy()))
            .collect::<Vec<_>>()
    };
    b.load_weights(copies().into()).unwrap();
    let err = (forward(&mut b, &th, &be, &anchors) - &want).abs().max().double_value(&[]);
    assert_eq!(err, 0.0);

    // Missing, misshapen and unknown tensors are named.
    let mut missing = copies();
    missing.retain(|p| p.name.as_str() != "layers.0.linear_attn.A_log");
    let e = b.load_weights(missing.into()).unwrap_err().to_string();
    assert!(e.contains("missing tensor `layers.0.linear_attn.A_log`"), "{e}");
    let mut misshapen = copies();
    let i = misshapen.iter().position(|p| p.name.as_str() == "layers.0.linear_attn.conv1d.weight").unwrap();
    misshapen[i] = plugin_api::NamedTensor::new(
        "layers.0.linear_attn.conv1d.weight",
        Tensor::zeros([96, 4], (Kind::Float, Device::Cpu)),
    );
    let e = b.load_weights(misshapen.into()).unwrap_err().to_string();
    assert!(e.contains("`layers.0.linear_attn.conv1d.weight` has shape [96, 4]"), "{e}");
    let mut extra = copies();
    extra.push(plugin_api::NamedTensor::new(
        "layers.9.linear_attn.A_log",
        Tensor::zeros([4], (Kind::Float, Device::Cpu)),
    ));
    let e = b.load_weights(extra.into()).unwrap_err().to_string();
    assert!(e.contains("unexpected tensor `layers.9.linear_attn.A_log`"), "{e}");
}

/// Created through the plugin's root module, as the host does; the forward returns
/// [B, A*Bk, H] and every parameter gets a gradient (none is left out of the graph).
#[test]
fn forward_and_backward_through_the_plugin_trait_object() {
    let mut ctx = HostContext::cpu();
    ctx.target = RSome(TargetSpec::tiny());
    let module = crate::plugin_module();
    assert_eq!(module.info()().name.as_str(), "gdn");
    let section = "num_hidden_layers = 5\nblock_size = 4\nnum_target_features = 3\nmask_token_id = 63";
    let created = module.create()(section.into(), &ctx).into_result().unwrap();
    let PluginInstance::Drafter(mut d) = created else { panic!("not a drafter") };
    assert_eq!(d.target_layer_ids().unwrap().into_vec(), vec![1, 3, 5]);
    assert_eq!((d.block_size().unwrap(), d.mask_token_id().unwrap()), (4, 63));
    let json: serde_json::Value = serde_json::from_str(d.config_json().unwrap().as_str()).unwrap();
    assert_eq!(json["architectures"][0], "DFlashGdnDraftModel");
    assert_eq!(
        json["layer_types"],
        serde_json::json!([
            "linear_attention",
            "linear_attention",
            "linear_attention",
            "linear_attention",
            "full_attention"
        ])
    );

    let (b, s, a, bk) = (2, 11, 3, 4);
    let input = DraftInput {
        target_hidden: TensorHandle::new(Tensor::randn([b, s, 3 * 32], (Kind::Float, Device::Cpu))),
        block_embeds: TensorHandle::new(Tensor::randn([b, a * bk, 32], (Kind::Float, Device::Cpu))),
        anchors: TensorHandle::new(Tensor::from_slice(&[1i64, 5, 10, 0, 0, 7]).view([b, a])),
        anchor_valid: TensorHandle::new(Tensor::from_slice(&[true, true, true, true, false, true]).view([b, a])),
    };
    let out = d.forward(&input).into_result().unwrap().into_tensor();
    assert_eq!(out.size(), vec![b, a * bk, 32]);
    assert_eq!(out.isfinite().all().int64_value(&[]), 1);
    out.square().sum(Kind::Float).backward();
    for p in d.parameters().unwrap().iter() {
        let g = p.tensor.tensor().grad();
        assert!(g.defined(), "`{}` got no gradient", p.name);
        assert!(g.abs().sum(Kind::Float).double_value(&[]) > 0.0, "`{}` got a zero gradient", p.name);
    }
    // A bad section is refused with the field named.
    let e = match module.create()("layer_types = [\"gdn\"]\nnum_hidden_layers = 2\nmask_token_id = 63".into(), &ctx)
        .into_result()
    {
        Err(e) => e.to_string(),
        Ok(_) => panic!("accepted a layer count that contradicts layer_types"),
    };
    assert!(e.contains("field `num_hidden_layers`"), "{e}");
}

/// `init_from` reads a folder as `dflash-host export` writes it (config.json + safetensors) and
/// gives the same drafter, its config replacing the section's.
#[test]
fn init_from_reads_an_exported_folder() {
    let cfg = hybrid();
    tch::manual_seed(3);
    let mut original = contained(&cfg, Device::Cpu, Kind::Float);
    let dir = std::env::temp_dir().join(format!("drafter_gdn_init_from_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), original.config_json().unwrap().as_str()).unwrap();
    let weights: Vec<(String, Tensor)> =
        original.parameters().unwrap().iter().map(|p| (p.name.to_string(), p.tensor.tensor().detach())).collect();
    Tensor::write_safetensors(&weights, dir.join("model.safetensors")).unwrap();

    let mut ctx = HostContext::cpu();
    ctx.target = RSome(TargetSpec::tiny());
    ctx.seed = 99; // other random weights, were they not loaded
    let section = format!("num_hidden_layers = 1\ninit_from = \"{}\"", dir.display());
    let created = crate::plugin_module().create()(section.as_str().into(), &ctx).into_result();
    let PluginInstance::Drafter(mut d) = created.unwrap() else { panic!("not a drafter") };
    let json: serde_json::Value = serde_json::from_str(d.config_json().unwrap().as_str()).unwrap();
    assert_eq!(json["num_hidden_layers"], 3, "the folder's config, not the section's");
    let th = Tensor::randn([1, 10, 64], (Kind::Float, Device::Cpu));
    let be = Tensor::randn([1, 8, 32], (Kind::Float, Device::Cpu));
    let anchors = Tensor::from_slice(&[4i64, 10]).view([1, 2]);
    let want = forward(&mut original, &th, &be, &anchors);
    let input = DraftInput {
        target_hidden: TensorHandle::new(th),
        block_embeds: TensorHandle::new(be),
        anchors: TensorHandle::new(anchors.shallow_clone()),
        anchor_valid: TensorHandle::new(anchors.ones_like().to_kind(Kind::Bool)),
    };
    let got = d.forward(&input).into_result().unwrap().into_tensor();
    assert_eq!((got - want).abs().max().double_value(&[]), 0.0);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// bf16 weights (the GPU dtype): the recurrence runs in fp32 inside, the output is bf16 and
/// close to the fp32 model's.
#[test]
fn bf16_forward_is_close_to_fp32() {
    let cfg = hybrid();
    tch::manual_seed(4);
    let mut f = contained(&cfg, Device::Cpu, Kind::Float);
    let mut h = contained(&cfg, Device::Cpu, Kind::BFloat16);
    h.load_weights(
        f.parameters()
            .unwrap()
            .iter()
            .map(|p| plugin_api::NamedTensor::new(p.name.to_string(), p.tensor.tensor().copy()))
            .collect::<Vec<_>>()
            .into(),
    )
    .unwrap();
    let th = Tensor::randn([1, 12, 64], (Kind::Float, Device::Cpu));
    let be = Tensor::randn([1, 8, 32], (Kind::Float, Device::Cpu));
    let anchors = Tensor::from_slice(&[3i64, 12]).view([1, 2]);
    let want = forward(&mut f, &th, &be, &anchors);
    let got = forward(&mut h, &th.to_kind(Kind::BFloat16), &be.to_kind(Kind::BFloat16), &anchors);
    assert_eq!(got.kind(), Kind::BFloat16);
    let err = (got.to_kind(Kind::Float) - &want).square().mean(Kind::Float).sqrt().double_value(&[]);
    assert!(err < 0.05, "bf16 vs fp32 RMS difference {err}");
}

/// Muon's groups for this drafter's parameters: every projection, q/k/v
/// separately, to Muon; the depthwise conv kernels to AdamW; A_log and dt_bias to AdamW without
/// weight decay; norms to AdamW. Checked with the plugin's default rules and with the named
/// rules the GDN A/B config spells out.
#[test]
fn muon_routes_gdn_parameters() {
    let cfg = tiny_config("mask_token_id = 63"); // 5 layers: 4 GDN, 1 attention
    let d = contained(&cfg, Device::Cpu, Kind::Float);
    let named = MuonConfig::from_toml(
        "adamw_patterns = [\"*embed*\", \"*lm_head*\", \"*conv1d.weight\"]\nno_decay_patterns = [\"*A_log\", \"*dt_bias\"]",
    )
    .unwrap();
    let (mut muon, mut seen_conv, mut seen_gates) = (0, 0, 0);
    for rules in [MuonConfig::default(), named] {
        for p in d.parameters().unwrap().iter() {
            let (name, shape) = (p.name.as_str(), p.tensor.tensor().size());
            let want = if name.ends_with(".A_log") || name.ends_with(".dt_bias") {
                seen_gates += 1;
                Group::AdamWNoDecay
            } else if name.ends_with("conv1d.weight") || name.contains("norm") {
                seen_conv += name.ends_with("conv1d.weight") as usize;
                Group::AdamW
            } else {
                assert!(name.ends_with("proj.weight") || name == "fc.weight", "unexpected parameter `{name}`");
                muon += 1;
                Group::Muon
            };
            assert_eq!(rules.route(name, &shape), want, "`{name}` {shape:?}");
        }
    }
    // Per rule set: 4 GDN layers x (conv; A_log + dt_bias; 7 projections) + attention's 4 + 3 MLPs x 5 + fc.
    assert_eq!((seen_conv, seen_gates), (2 * 4, 2 * 8));
    assert_eq!(muon, 2 * (4 * 7 + 4 + 5 * 3 + 1));
}

/// The README's default config with `plugin = "dflash"` changed to `"gdn"` resolves (a single
/// GDN layer there), and configs/smollm2-chitchat-gdn.toml is that config.
#[test]
fn default_config_with_one_line_changed() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dense = std::fs::read_to_string(root.join("configs/smollm2-chitchat.toml")).unwrap();
    assert_eq!(dense.matches("plugin = \"dflash\"").count(), 1);
    let gdn_text = dense.replace("plugin = \"dflash\"", "plugin = \"gdn\"");
    let smollm2 = TargetSpec::smollm2_135m();
    let drafter_section = |text: &str| {
        let mut table: toml::Table = toml::from_str(text).unwrap();
        let mut section = table.remove("drafter").unwrap().as_table().unwrap().clone();
        assert_eq!(section.remove("plugin").unwrap().as_str(), Some("gdn"));
        let s: DrafterSection = plugin_api::parse_section(&toml::to_string(&section).unwrap()).unwrap();
        s.resolve(&smollm2).unwrap()
    };
    let cfg = drafter_section(&gdn_text);
    assert_eq!(cfg.layer_types, vec![LayerType::Gdn]);
    assert_eq!((cfg.block_size, cfg.dflash_config.mask_token_id, cfg.dflash_config.target_layer_ids.len()), (4, 16, 3));
    assert_eq!((cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim), (9, 64, 64));
    let shipped = std::fs::read_to_string(root.join("configs/smollm2-chitchat-gdn.toml")).unwrap();
    assert_eq!(drafter_section(&shipped), cfg);
}

/// A zero MLP width is refused with the field named, not trained as a layer without an MLP.
#[test]
fn a_zero_mlp_width_is_refused() {
    let s: DrafterSection = plugin_api::parse_section("mask_token_id = 63\nintermediate_size = 0").unwrap();
    let e = s.resolve(&TargetSpec::tiny()).unwrap_err().to_string();
    assert!(e.contains("field `intermediate_size`: 0: must be >= 1"), "{e}");
}

/// What `parameter_shapes` says a config builds is what the drafter builds (export checks
/// checkpoints against it); a saved config with sizes no drafter has is refused by name.
#[test]
fn parameter_shapes_are_the_built_drafters() {
    let cfg = hybrid();
    cfg.check_saved().unwrap();
    let d = contained(&cfg, Device::Cpu, Kind::Float);
    let mut built: Vec<(String, Vec<i64>)> =
        d.parameters().unwrap().iter().map(|p| (p.name.to_string(), p.tensor.tensor().size())).collect();
    let mut said = cfg.parameter_shapes();
    built.sort();
    said.sort();
    assert_eq!(said, built);
    let mut huge = cfg.clone();
    huge.hidden_size = 1 << 40;
    assert!(huge.check_saved().unwrap_err().contains("field `hidden_size`"));
    let mut short = cfg;
    short.layer_types.pop();
    assert!(short.check_saved().unwrap_err().contains("field `layer_types`"));
}
