//! Reference parity against PyTorch (fixtures from `scripts/make_fixtures.py`, see
//! tests/fixtures/README.md): the drafter forward, the DFlash loss and its gradients for a tiny
//! random drafter, and 10 AdamW steps with a changing learning rate.

use dflash_host::train::{
    anchors::block_token_ids,
    loss::{dflash_loss, tau_hat, LossInput},
};
use drafter_dflash::{
    config::{DFlashConfig, DFlashSection},
    DFlashPlugin,
};
use optim_adamw::{AdamW, ParamsAdamW};
use plugin_api::{
    tch::{Device, Kind, Tensor},
    DraftInput, Drafter, NamedTensor, Optimizer, TensorHandle,
};
use std::collections::HashMap;

mod common;
use common::Fixture;

/// ||a - b|| / ||b||, in f64.
fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (a.to_kind(Kind::Double), b.to_kind(Kind::Double));
    let diff = (&a - &b).norm().double_value(&[]);
    diff / b.norm().double_value(&[]).max(1e-30)
}

fn drafter_config(c: &serde_json::Value) -> DFlashConfig {
    let u = |k: &str| c[k].as_u64().unwrap() as usize;
    let layers = u("num_hidden_layers");
    DFlashConfig {
        architectures: vec!["DFlashDraftModel".into()],
        model_type: "qwen3".into(),
        hidden_size: u("hidden_size"),
        intermediate_size: u("intermediate_size"),
        num_hidden_layers: layers,
        num_attention_heads: u("num_attention_heads"),
        num_key_value_heads: u("num_key_value_heads"),
        head_dim: u("head_dim"),
        vocab_size: u("vocab_size"),
        rms_norm_eps: c["rms_norm_eps"].as_f64().unwrap(),
        rope_theta: c["rope_theta"].as_f64().unwrap(),
        attention_bias: false,
        hidden_act: "silu".into(),
        max_position_embeddings: 4096,
        tie_word_embeddings: false,
        block_size: u("block_size"),
        num_target_layers: 8,
        dflash_config: DFlashSection {
            mask_token_id: u("mask_token_id") as u32,
            target_layer_ids: (0..u("num_target_features") as u32).collect(),
        },
        layer_types: vec!["full_attention".into(); layers],
        sliding_window: None,
        torch_dtype: "float32".into(),
    }
}

#[test]
fn dflash_forward_loss_and_gradients_match_pytorch() {
    let f = Fixture::load("dflash_loss.safetensors");
    let c = f.json("config");
    let cfg = drafter_config(&c);
    let mut drafter = DFlashPlugin::new(&cfg, Device::Cpu, Kind::Float);
    let params = drafter.parameters();
    let weights: Vec<NamedTensor> = params.iter().map(|p| NamedTensor::new(p.name.as_str(), f.get(p.name.as_str()))).collect();
    drafter.load_weights(weights.into()).unwrap();

    // The host's side of a training step: block tokens, embedding, drafter, loss.
    let input_ids = f.get("in.input_ids");
    let anchors = f.get("in.anchors");
    let valid = f.get("in.anchor_valid").to_kind(Kind::Bool);
    let bk = cfg.block_size as i64;
    let block_ids = block_token_ids(&input_ids, &anchors, bk, cfg.dflash_config.mask_token_id as i64);
    assert!(block_ids.equal(&f.get("out.block_ids")), "block token ids differ");
    let embeds = Tensor::embedding(&f.get("frozen.embed_tokens"), &block_ids, -1, false, false);
    let input = DraftInput {
        target_hidden: TensorHandle::new(f.get("in.target_hidden")),
        block_embeds: TensorHandle::new(embeds),
        anchors: TensorHandle::new(anchors.shallow_clone()),
        anchor_valid: TensorHandle::new(valid.shallow_clone()),
    };
    let block_hidden = drafter.forward(&input).unwrap().into_tensor();
    let e = rel_err(&block_hidden, &f.get("out.block_hidden"));
    assert!(e < 1e-5, "block hidden states: relative error {e:e}");

    let lm_head = f.get("frozen.lm_head");
    let loss_mask = f.get("in.loss_mask");
    let out = dflash_loss(&LossInput {
        block_hidden: &block_hidden,
        lm_head: &lm_head,
        input_ids: &input_ids,
        loss_mask: &loss_mask,
        anchors: &anchors,
        anchor_valid: &valid,
        block_size: bk,
        gamma: c["loss_gamma"].as_f64().unwrap(),
    });
    let (ours, theirs) = (out.loss.double_value(&[]), f.get("out.loss").double_value(&[]));
    assert!(((ours - theirs) / theirs).abs() < 1e-5, "loss {ours} vs torch {theirs}");
    let counts: Vec<i64> = Vec::try_from(f.get("out.valid_count")).unwrap();
    let (correct, count) = out.host_counts();
    assert_eq!(count, counts, "counted labels per position");
    let acc: Vec<f64> = correct.iter().zip(&count).map(|(&c, &n)| c as f64 / n as f64).collect();
    let torch_acc: Vec<f64> = Vec::<f32>::try_from(f.get("out.acc")).unwrap().into_iter().map(f64::from).collect();
    assert_eq!(acc, torch_acc);
    assert!((tau_hat(&acc) - f.get("out.tau_hat").double_value(&[])).abs() < 1e-6);

    out.loss.backward();
    for p in drafter.parameters().iter() {
        let name = p.name.as_str();
        let e = rel_err(&p.tensor.tensor().grad(), &f.get(&format!("grad.{name}")));
        assert!(e < 1e-5, "gradient of {name}: relative error {e:e}");
    }
}

#[test]
fn adamw_ten_steps_match_torch_optim_adamw() {
    let f = Fixture::load("adamw.safetensors");
    let hyper = f.json("hyper");
    let lrs: Vec<f64> = serde_json::from_value(f.json("lr")).unwrap();
    let lr_max = hyper["lr_max"].as_f64().unwrap();
    let betas: Vec<f64> = serde_json::from_value(hyper["betas"].clone()).unwrap();
    let h = ParamsAdamW {
        lr: lr_max,
        betas: [betas[0], betas[1]],
        eps: hyper["eps"].as_f64().unwrap(),
        weight_decay: hyper["weight_decay"].as_f64().unwrap(),
        ..Default::default()
    };
    let names = ["p.w", "p.b", "p.m"];
    let params: Vec<Tensor> = names.iter().map(|n| f.get(&format!("init.{n}")).set_requires_grad(true)).collect();
    let mut opt = AdamW::new(h);
    opt.init(names.iter().zip(&params).map(|(n, p)| NamedTensor::new(*n, p.shallow_clone())).collect()).unwrap();
    for (t, lr) in lrs.iter().enumerate() {
        let t = t + 1;
        for (n, p) in names.iter().zip(&params) {
            let mut p = p.shallow_clone();
            p.zero_grad();
            // d/dp sum(p * g) = g exactly.
            (&p * f.get(&format!("grad.{n}.{t}"))).sum(Kind::Float).backward();
        }
        opt.step(lr / lr_max).unwrap();
        for (n, p) in names.iter().zip(&params) {
            let want = f.get(&format!("param.{n}.{t}"));
            // torch's own optimizer tests: atol = rtol = 1e-6 in fp32.
            assert!(p.allclose(&want, 1e-6, 1e-6, false), "{n} after step {t}: max diff {}", (p - &want).abs().max().double_value(&[]));
        }
    }
    let state: HashMap<String, Tensor> = opt.state().into_iter().map(|nt| (nt.name.to_string(), nt.tensor.into_tensor())).collect();
    assert_eq!(state["step"].int64_value(&[]), 10);
    for n in names {
        for slot in ["exp_avg", "exp_avg_sq"] {
            let (ours, want) = (&state[&format!("{n}.{slot}")], f.get(&format!("{slot}.{n}")));
            assert!(ours.allclose(&want, 1e-6, 1e-6, false), "{slot} of {n}");
        }
    }
}
