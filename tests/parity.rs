//! Reference parity against PyTorch (fixtures from `scripts/fixtures/make_fixtures.py`, see
//! tests/fixtures/README.md): the drafter forward, the DFlash loss and its gradients for a tiny
//! random drafter (with full attention, and with a sliding-window layer), one optimizer step's
//! gradients normalised over 3 micro-batches on each of 2 ranks, RoPE scaling, and 10 AdamW
//! steps with a changing learning rate.

use dflash_host::{
    dist::{group::C10dCommunicator, Communicator, DistEnv, Identity},
    plugins::handles::DrafterHandle,
    train::{
        anchors::{block_token_ids, AnchorRule, AnchorSampler},
        loss::{dflash_loss, tau_hat, LossInput, Reduction},
        step::{normalize_gradients, LossNormalization, StepSums},
        DraftLoss,
    },
};
use drafter_dflash::{config::DFlashConfig, DFlashPlugin};
use drafter_layers::rope::RopeScaling;
use optim_adamw::{AdamW, ParamsAdamW};
use plugin_api::{
    abi_stable::sabi_trait::TD_Opaque,
    author::Contained,
    tch::{Device, Kind, Tensor},
    DraftInput, DrafterBox, DrafterInput, DrafterPlugin, Drafter_TO, NamedTensor, Optimizer, TensorHandle,
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

/// The fixture's drafter as a z-lab `config.json` says it (its `layer_types` and
/// `sliding_window` where it has them), read and checked as `init_from` reads one.
fn drafter_config(c: &serde_json::Value) -> DFlashConfig {
    let layers = c["num_hidden_layers"].as_u64().unwrap() as usize;
    let mut json = serde_json::json!({
        "num_target_layers": 8,
        "max_position_embeddings": 4096,
        "dtype": "float32",
        "dflash_config": {
            "mask_token_id": c["mask_token_id"],
            "target_layer_ids": (0..c["num_target_features"].as_u64().unwrap()).collect::<Vec<_>>(),
        },
        "layer_types": c.get("layer_types").cloned().unwrap_or_else(|| serde_json::json!(vec!["full_attention"; layers])),
    });
    for k in [
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "rms_norm_eps",
        "rope_theta",
        "block_size",
    ] {
        json[k] = c[k].clone();
    }
    if let Some(w) = c.get("sliding_window") {
        json["sliding_window"] = w.clone();
        json["use_sliding_window"] = true.into();
    }
    let mut cfg: DFlashConfig = serde_json::from_value(json).unwrap();
    cfg.check().unwrap();
    cfg
}

/// The fixture drafter (dflash_loss.safetensors' weights) built from `c`.
fn fixture_drafter(c: &serde_json::Value) -> (DFlashConfig, DFlashPlugin) {
    let f = Fixture::load("dflash_loss.safetensors");
    let cfg = drafter_config(c);
    let mut drafter = DFlashPlugin::new(&cfg, Device::Cpu, Kind::Float);
    let weights = drafter.parameters().into_iter().map(|(n, _)| (n.clone(), f.get(&n))).collect();
    drafter.load_weights(weights).unwrap();
    (cfg, drafter)
}

#[test]
fn dflash_forward_loss_and_gradients_match_pytorch() {
    let f = Fixture::load("dflash_loss.safetensors");
    let c = f.json("config");
    let cfg = drafter_config(&c);
    let mut drafter = DFlashPlugin::new(&cfg, Device::Cpu, Kind::Float);
    let weights = drafter.parameters().into_iter().map(|(n, _)| (n.clone(), f.get(&n))).collect();
    drafter.load_weights(weights).unwrap();

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
    let block_hidden = drafter.forward(&DrafterInput::from_abi(&input)).unwrap();
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
        gamma: c["loss_gamma"].as_f64(),
        reduction: Reduction::Mean,
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
    for (name, p) in drafter.parameters() {
        let e = rel_err(&p.grad(), &f.get(&format!("grad.{name}")));
        assert!(e < 1e-5, "gradient of {name}: relative error {e:e}");
    }
}

/// A drafter whose first layer is `sliding_attention` (window 6, cutting the context of every
/// block but the earliest): forward, loss and gradients equal PyTorch's, through masked attention
/// (the eval's path) and through split attention run by the drafter's own backward (training).
#[test]
fn sliding_window_drafter_matches_pytorch() {
    let f = Fixture::load("dflash_loss.safetensors");
    let fs = Fixture::load("dflash_sliding.safetensors");
    let c = fs.json("config");
    for split in [false, true] {
        let (cfg, drafter) = fixture_drafter(&c);
        assert_eq!(cfg.windows(), [Some(6), None]);
        let mut drafter: DrafterBox = Drafter_TO::from_value(
            Contained::new(
                drafter
                    .with_mode(drafter_dflash::model::TrainMode { split_attention: split, checkpoint_layers: false }),
            ),
            TD_Opaque,
        );
        let (input_ids, anchors) = (f.get("in.input_ids"), f.get("in.anchors"));
        let valid = f.get("in.anchor_valid").to_kind(Kind::Bool);
        let bk = cfg.block_size as i64;
        let block_ids = block_token_ids(&input_ids, &anchors, bk, cfg.dflash_config.mask_token_id as i64);
        let input = DraftInput {
            target_hidden: TensorHandle::new(f.get("in.target_hidden")),
            block_embeds: TensorHandle::new(Tensor::embedding(
                &f.get("frozen.embed_tokens"),
                &block_ids,
                -1,
                false,
                false,
            )),
            anchors: TensorHandle::new(anchors.shallow_clone()),
            anchor_valid: TensorHandle::new(valid.shallow_clone()),
        };
        drafter.anchors_on_host(&TensorHandle::new(anchors.shallow_clone())).unwrap();
        let out = drafter.forward(&input).unwrap().into_tensor();
        let e = rel_err(&out, &fs.get("out.block_hidden"));
        assert!(e < 1e-5, "split {split}: block hidden states: relative error {e:e}");
        let loss = dflash_loss(&LossInput {
            block_hidden: &out,
            lm_head: &f.get("frozen.lm_head"),
            input_ids: &input_ids,
            loss_mask: &f.get("in.loss_mask"),
            anchors: &anchors,
            anchor_valid: &valid,
            block_size: bk,
            gamma: c["loss_gamma"].as_f64(),
            reduction: Reduction::Mean,
        });
        let (ours, theirs) = (loss.loss.double_value(&[]), fs.get("out.loss").double_value(&[]));
        assert!(((ours - theirs) / theirs).abs() < 1e-5, "split {split}: loss {ours} vs torch {theirs}");
        loss.loss.backward();
        if out.is_leaf() {
            drafter.backward(&TensorHandle::new(out.grad())).unwrap();
        }
        for p in drafter.parameters().unwrap().iter() {
            let name = p.name.as_str();
            let e = rel_err(&p.tensor.tensor().grad(), &fs.get(&format!("grad.{name}")));
            assert!(e < 1e-5, "split {split}: gradient of {name}: relative error {e:e}");
        }
    }
}

/// One step of 3 micro-batches on each of 2 data-parallel ranks (threads talking TCP), with label
/// counts from 1 to 63: through the trainer's own parts (anchor sampling, drafter, loss, backward,
/// the step's normalisation and loss), the global normalisation gives PyTorch's gradients of the
/// step's token-weighted mean on both ranks; per micro-batch gives the mean of the six means.
#[test]
fn global_normalisation_over_micro_batches_and_ranks_matches_pytorch() {
    let g = Fixture::load("dflash_global.safetensors");
    for normalization in [LossNormalization::Global, LossNormalization::PerMicroBatch] {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let results: Vec<(f64, Vec<(String, Tensor)>)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2usize)
                .map(|rank| {
                    s.spawn(move || {
                        // Per thread: tch tensors are not shared between threads.
                        let (f, g) =
                            (Fixture::load("dflash_loss.safetensors"), Fixture::load("dflash_global.safetensors"));
                        let c = &f.json("config");
                        let env = DistEnv {
                            rank,
                            world: 2,
                            local_rank: rank,
                            master_addr: "127.0.0.1".into(),
                            master_port: port,
                            timeout: std::time::Duration::from_secs(120),
                            run_token: None,
                        };
                        let identity = Identity::new("parity".into(), "parity".into(), "parity".into());
                        let mut comm: Box<dyn Communicator> =
                            Box::new(C10dCommunicator::connect(&env, plugin_api::tch::Device::Cpu, &identity).unwrap());
                        let (_, drafter) = fixture_drafter(c);
                        let mut drafter =
                            DrafterHandle::new(Drafter_TO::from_value(Contained::new(drafter), TD_Opaque), "dflash");
                        let draft = DraftLoss {
                            embedding: f.get("frozen.embed_tokens"),
                            lm_head: f.get("frozen.lm_head"),
                            sampler: AnchorSampler { per_seq: 64, seed: 1, rule: AnchorRule::Response },
                            block_size: c["block_size"].as_i64().unwrap(),
                            mask_token_id: c["mask_token_id"].as_i64().unwrap(),
                            gamma: c["loss_gamma"].as_f64(),
                            normalization,
                        };
                        let (k, n) = (3u64, draft.block_size as usize - 1);
                        let mut sums = StepSums {
                            loss: 0.0,
                            weight: 0.0,
                            tokens: 0,
                            correct: vec![0; n],
                            count: vec![0; n],
                            stop: false,
                        };
                        let mut weight_sum = Tensor::zeros([], (Kind::Float, Device::Cpu));
                        for m in 0..k {
                            let at = |name: &str| g.get(&format!("in.r{rank}.m{m}.{name}"));
                            let d = draft
                                .compute(&mut drafter, &at("input_ids"), &at("loss_mask"), &at("target_hidden"), m)
                                .unwrap();
                            // Every candidate taken: the fixture's anchors are the trainer's.
                            assert!(d.anchors.positions.equal(&at("anchors")), "rank {rank} micro-batch {m}: anchors");
                            assert!(d.anchors.valid.equal(&at("anchor_valid").to_kind(Kind::Bool)));
                            let w = d.loss.weight_sum.double_value(&[]);
                            let want = g.get(&format!("out.r{rank}.m{m}.weight_sum")).double_value(&[]);
                            assert!(
                                (w - want).abs() < 1e-5 * want,
                                "rank {rank} micro-batch {m}: weight sum {w} vs {want}"
                            );
                            d.backward(&mut drafter, draft.backward_scale(k)).unwrap();
                            sums.loss += d.loss.loss.double_value(&[]);
                            weight_sum += &d.loss.weight_sum;
                        }
                        let params: Vec<Tensor> =
                            drafter.parameters().unwrap().iter().map(|p| p.tensor.tensor()).collect();
                        normalize_gradients(Some(&mut comm), &params, normalization, &weight_sum).unwrap();
                        sums.weight = weight_sum.double_value(&[]);
                        sums.all_reduce(comm.as_mut()).unwrap();
                        let grads = drafter
                            .parameters()
                            .unwrap()
                            .iter()
                            .map(|p| (p.name.to_string(), p.tensor.tensor().grad()))
                            .collect();
                        (sums.step_loss(normalization, k * 2), grads)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let want_loss = match normalization {
            LossNormalization::Global => g.get("out.loss").double_value(&[]),
            LossNormalization::PerMicroBatch => g.get("out.loss_per_micro_batch").double_value(&[]),
        };
        for (rank, (loss, grads)) in results.iter().enumerate() {
            assert!(
                ((loss - want_loss) / want_loss).abs() < 1e-5,
                "{normalization:?} rank {rank}: step loss {loss} vs torch {want_loss}"
            );
            let errors: Vec<f64> =
                grads.iter().map(|(name, grad)| rel_err(grad, &g.get(&format!("grad.{name}")))).collect();
            let worst = errors.iter().cloned().fold(0.0, f64::max);
            match normalization {
                LossNormalization::Global => {
                    assert!(worst < 1e-5, "rank {rank}: gradients: relative error up to {worst:e}")
                }
                // The other normalisation is another step: the fixture tells the two apart.
                LossNormalization::PerMicroBatch => {
                    assert!(worst > 0.1, "rank {rank}: per micro-batch gave the global gradients ({worst:e})")
                }
            }
        }
    }
}

/// The drafter's RoPE frequencies and cos/sin factor for each scaling kind equal transformers'.
#[test]
fn rope_scaling_matches_transformers() {
    let f = Fixture::load("rope.safetensors");
    let cases: serde_json::Map<String, serde_json::Value> = serde_json::from_value(f.json("cases")).unwrap();
    let factors = f.json("attention_factor");
    assert_eq!(cases.len(), 4);
    for (name, json) in &cases {
        let scaling = RopeScaling::from_json(json).unwrap();
        let (freqs, attention) = scaling.inv_freq(16, 10000.0);
        let e = rel_err(&Tensor::from_slice(&freqs), &f.get(&format!("inv_freq.{name}")));
        assert!(e < 1e-6, "{name}: inv_freq relative error {e:e}");
        let want = factors[name].as_f64().unwrap();
        assert!((attention - want).abs() < 1e-12, "{name}: attention factor {attention} vs {want}");
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
    let mut opt = Contained::new(AdamW::new(h));
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
            assert!(
                p.allclose(&want, 1e-6, 1e-6, false),
                "{n} after step {t}: max diff {}",
                (p - &want).abs().max().double_value(&[])
            );
        }
    }
    let state: HashMap<String, Tensor> =
        opt.state().unwrap().into_iter().map(|nt| (nt.name.to_string(), nt.tensor.into_tensor())).collect();
    assert_eq!(state["step"].int64_value(&[]), 10);
    for n in names {
        for slot in ["exp_avg", "exp_avg_sq"] {
            let (ours, want) = (&state[&format!("{n}.{slot}")], f.get(&format!("{slot}.{n}")));
            assert!(ours.allclose(&want, 1e-6, 1e-6, false), "{slot} of {n}");
        }
    }
}
