//! End to end through the binary on the hybrid and MoE targets: for a tiny random `qwen3_5`
//! (written in the multimodal checkpoint layout), `qwen3_5_moe` and `qwen3_moe`, an HF folder
//! (sharded safetensors, SmolLM2's tokenizer, a chat template) is written here, `dflash-host
//! train` self-distils and trains a drafter on it, and `dflash-host eval` decodes speculatively,
//! output identical to the target's greedy decoding (the Gated DeltaNet states rolled back into
//! each verified block), with the dense drafter keeping its context between cycles and with the
//! Gated DeltaNet drafter, which does not. A config naming an unknown architecture fails with one line.

use plugin_api::tch::{Device, Kind, Tensor};
use std::{collections::HashMap, path::Path, process::Command};
use target_hf::{config::DecoderConfig, gguf::GgufFile, gguf_tokenizer::tokenizer_from_gguf, random::random_weights};

mod common;
use common::cache;

const HEAD: &str = r#"
name = "hybrid"
seed = 5

[train]
steps = 4
anchors_per_seq = 8
log_every = 1
checkpoint_every = 4
keep_checkpoints = 1
"#;

/// The tiny text config of each architecture (SmolLM2's 49,152 tokens; `<|im_end|>` = 2 ends a
/// reply).
fn text_config(arch: &str) -> serde_json::Value {
    let mut c = serde_json::json!({
        "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 49152, "rms_norm_eps": 1e-6, "eos_token_id": 2, "tie_word_embeddings": false,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    });
    let extra = match arch {
        "qwen3_5" => {
            serde_json::json!({"model_type": "qwen3_5_text", "intermediate_size": 48, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "full_attention_interval": 2})
        }
        "qwen3_5_moe" => {
            serde_json::json!({"model_type": "qwen3_5_moe_text", "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 8, "linear_value_head_dim": 8, "num_experts": 6, "num_experts_per_tok": 2,
            "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
            "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"]})
        }
        "qwen3_moe" => serde_json::json!({"model_type": "qwen3_moe", "intermediate_size": 48, "num_experts": 6,
            "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": true}),
        _ => unreachable!(),
    };
    c.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    c
}

/// An HF folder for `arch` with random weights scaled so activations and logits are O(1) (a
/// greedy choice is then not a near-tie that float rounding could flip), in two shards with an
/// index; qwen3_5 as a multimodal checkpoint (`text_config`, `model.language_model.*`, a
/// vision tensor to skip).
fn write_target(arch: &str, dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let text = text_config(arch);
    let (cfg, _) = DecoderConfig::from_hf_json(&text.to_string()).unwrap();
    plugin_api::tch::manual_seed(7);
    let mut tensors: Vec<(String, Tensor)> = random_weights(&cfg, Device::Cpu, Kind::Float)
        .tensors
        .into_iter()
        .map(|(name, t)| {
            let size = t.size();
            let t = match size.len() {
                1 if name.ends_with("A_log") || name.ends_with("dt_bias") => t,
                1 => Tensor::randn(size.as_slice(), (Kind::Float, Device::Cpu)) * 0.1 + t,
                _ if name.contains("embed_tokens") => Tensor::randn(size.as_slice(), (Kind::Float, Device::Cpu)),
                _ => Tensor::randn(size.as_slice(), (Kind::Float, Device::Cpu)) / (*size.last().unwrap() as f64).sqrt(),
            };
            (name, t)
        })
        .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let config = if arch == "qwen3_5" {
        for (name, _) in tensors.iter_mut() {
            if let Some(rest) = name.strip_prefix("model.") {
                *name = format!("model.language_model.{rest}");
            }
        }
        tensors.push((
            "model.visual.patch_embed.proj.weight".into(),
            Tensor::zeros([8, 3, 2, 2, 2], (Kind::Float, Device::Cpu)),
        ));
        serde_json::json!({"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "text_config": text, "vision_config": {"depth": 1}, "tie_word_embeddings": false})
    } else {
        text
    };
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let half = tensors.len() / 2;
    let mut map = serde_json::Map::new();
    for (i, part) in [&tensors[..half], &tensors[half..]].into_iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", i + 1);
        let named: Vec<(&str, &Tensor)> = part.iter().map(|(n, t)| (n.as_str(), t)).collect();
        Tensor::write_safetensors(&named, dir.join(&file)).unwrap();
        for (n, _) in part {
            map.insert(n.clone(), file.clone().into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let g = GgufFile::open(cache().join("SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap();
    tokenizer_from_gguf(&g).unwrap().save(dir.join("tokenizer.json"), false).unwrap();
    let template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}";
    std::fs::write(dir.join("tokenizer_config.json"), serde_json::json!({"chat_template": template}).to_string())
        .unwrap();
}

fn config_for(target: &Path) -> String {
    let gguf = "path = \"$DFLASH_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf\"";
    let cfg = common::tiny_config(HEAD, "plugin = \"adamw\"\nlr = 3e-3\nweight_decay = 0.0");
    assert!(cfg.contains(gguf));
    cfg.replace(gguf, &format!("path = \"{}\"", target.display()))
}

#[test]
fn train_and_lossless_eval_on_hybrid_and_moe_targets() {
    common::require_model();
    for arch in ["qwen3_5", "qwen3_5_moe", "qwen3_moe"] {
        let root = tempfile::tempdir().unwrap();
        let target = root.path().join(arch);
        write_target(arch, &target);
        // The last one with the Gated DeltaNet drafter, which keeps no decoding context: eval
        // then gives it the whole context every cycle.
        let drafter = if arch == "qwen3_moe" { "plugin = \"gdn\"" } else { "plugin = \"dflash\"" };
        let config = config_for(&target).replace("plugin = \"dflash\"", drafter);
        let (out, dir) = common::train(&[], &config);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{arch}: train failed:\n{stderr}");
        if arch == "qwen3_5" {
            let note = stderr.lines().filter(|l| l.contains("Qwen3_5ForConditionalGeneration")).collect::<Vec<_>>();
            assert!(note.len() == 1 && note[0].contains("ignoring the vision tower"), "{arch}: {stderr}");
        }
        let exp = dir.path().join("exp");
        let metrics = common::metrics(&exp, &["loss"]);
        assert_eq!(metrics.len(), 4, "{arch}");
        let manifest: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(exp.join("manifest.json")).unwrap()).unwrap();
        assert_eq!(manifest["plugins"][0]["name"], "hf", "{arch}");
        let out = Command::new(env!("CARGO_BIN_EXE_dflash-host"))
            .args(["eval", "--limit", "2", "--max-new-tokens", "16", "--exp-dir"])
            .arg(&exp)
            .env("DFLASH_CACHE", cache())
            .env_remove("RUST_BACKTRACE")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{arch}: eval failed:\n{}\n{stdout}", String::from_utf8_lossy(&out.stderr));
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(exp.join("eval.json")).unwrap()).unwrap();
        assert_eq!(report["lossless"], true, "{arch}: speculative output differs from greedy:\n{stdout}");
        assert!(
            report["cycles"].as_u64().unwrap() > 0 && report["new_tokens"].as_u64().unwrap() > 0,
            "{arch}: {report}"
        );
    }
}

#[test]
fn an_unknown_architecture_fails_with_one_line_naming_it() {
    common::require_model();
    let root = tempfile::tempdir().unwrap();
    let target = root.path().join("mamba");
    write_target("qwen3_moe", &target);
    let mut cfg: HashMap<String, serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(target.join("config.json")).unwrap()).unwrap();
    cfg.insert("model_type".into(), "mamba2".into());
    std::fs::write(target.join("config.json"), serde_json::to_string(&cfg).unwrap()).unwrap();
    let (out, _dir) = common::train(&[], &config_for(&target));
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = err.lines().filter(|l| l.contains("mamba2")).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(
        lines[0].contains(
            "model_type `mamba2` is not supported (supported: llama, mistral, ministral, qwen2, qwen3, qwen3_moe, qwen3_5, \
             qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text, gemma2, gemma3_text, gpt_oss, lfm2, deepseek_v3, kimi_k2, \
             glm4_moe, longcat_flash)"
        ),
        "{err}"
    );
}

/// `dflash-host ARGS` in `dir`, every rank logging its info lines.
fn host_in(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_dflash-host"))
        .args(args)
        .current_dir(dir)
        .env("DFLASH_CACHE", cache())
        .env("DFLASH_DIST_TIMEOUT", "120")
        .env("RUST_LOG", "info")
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap()
}

/// How many target calls rank 1 served, as it logs it (0 when it did not).
fn served(log: &str) -> u64 {
    let line = log.lines().find_map(|l| l.strip_prefix("[rank1]: ").and_then(|l| l.split_once("rank 1: served ")));
    line.map_or(0, |(_, n)| n.split(' ').next().unwrap().parse().unwrap())
}

/// A target replica spread over two ranks (`train --nproc 2`, Gloo): the Qwen3.5-MoE target's
/// attention, Gated DeltaNet heads and MLP widths split in two, its experts over two groups. The
/// replica's lead trains, the other rank builds the target alone (no drafter, optimizer or data)
/// and serves the target's calls (self-distillation, then every forward); the run takes the
/// steps one rank holding the whole target takes. `distill --nproc 2` writes the replies one
/// rank writes, and `eval --nproc 2` of the one-rank run's drafter gives its acceptance.
#[test]
fn a_target_replica_over_two_ranks_trains_as_one_rank_does() {
    common::require_model();
    let root = tempfile::tempdir().unwrap();
    let target = root.path().join("qwen3_5_moe");
    write_target("qwen3_5_moe", &target);
    let whole = config_for(&target);
    let path = format!("path = \"{}\"", target.display());
    let split = whole.replace(&path, &format!("{path}\ntensor_parallel = 2\nexpert_parallel = 2"));
    let (out, one) = common::train(&[], &whole);
    assert!(out.status.success(), "one rank: {}", String::from_utf8_lossy(&out.stderr));
    std::fs::write(root.path().join("tp.toml"), &split).unwrap();
    let out = host_in(root.path(), &["train", "--nproc", "2", "--config", "tp.toml", "--exp-dir", "tp"]);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "two ranks: {log}");
    // Rank 1 builds the target only.
    let made = |rank: &str, kind: &str| {
        log.lines()
            .filter(|l| l.starts_with(&format!("[{rank}]")) && l.contains(&format!("creating {kind} plugin")))
            .count()
    };
    assert_eq!((made("rank0", "target"), made("rank0", "drafter"), made("rank0", "data")), (1, 1, 1), "{log}");
    assert_eq!((made("rank1", "target"), made("rank1", "drafter"), made("rank1", "optimizer")), (1, 0, 0), "{log}");
    assert_eq!(made("rank1", "data"), 0, "{log}");
    assert!(log.contains("[rank1]: ") && log.contains("serving the target of replica 0 (no drafter"), "{log}");
    let keys = ["step", "tokens", "loss"];
    let (a, b) = (common::metrics(&one.path().join("exp"), &keys), common::metrics(&root.path().join("tp"), &keys));
    assert_eq!(a.len(), 4);
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert_eq!((&x["step"], &x["tokens"]), (&y["step"], &y["tokens"]), "{x} vs {y}");
        let (l1, l2) = (x["loss"].as_f64().unwrap(), y["loss"].as_f64().unwrap());
        assert!((l1 - l2).abs() <= 1e-4 * l1.abs().max(1e-3), "loss {l1} (one rank) vs {l2} (two-rank replica)");
    }

    // Self-distillation: rank 0 drives, rank 1 serves; the replies are those of the whole target.
    std::fs::write(root.path().join("whole.toml"), &whole).unwrap();
    let out = host_in(root.path(), &["distill", "--config", "whole.toml", "--out", "one.jsonl"]);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "distill, one rank: {log}");
    // The replica generates every reply (none from the cache the runs above filled).
    let cached = log.lines().find_map(|l| l.split_once("replies cached in ")).expect("the reply cache").1;
    std::fs::remove_file(cached.split(" (").next().unwrap()).unwrap();
    let out = host_in(root.path(), &["distill", "--nproc", "2", "--config", "tp.toml", "--out", "tp.jsonl"]);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "distill, two ranks: {log}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("(0 from the cache"), "{log}");
    assert!(served(&log) > 0, "{log}");
    let (a, b) = (root.path().join("one.jsonl"), root.path().join("tp.jsonl"));
    let (a, b) = (std::fs::read_to_string(a).unwrap(), std::fs::read_to_string(b).unwrap());
    assert!(a.lines().count() >= 3, "{a}");
    assert_eq!(a, b, "distilled replies: one rank vs a two-rank replica");

    // Eval of the one-rank run's drafter, its target whole and split over two ranks.
    let exp = one.path().join("exp");
    let copy = root.path().join("one-tp");
    assert!(Command::new("cp").arg("-r").arg(&exp).arg(&copy).status().unwrap().success());
    let config = std::fs::read_to_string(copy.join("config.toml")).unwrap();
    let replicated = config.replace(&path, &format!("{path}\ntensor_parallel = 2\nexpert_parallel = 2"));
    assert_ne!(config, replicated);
    std::fs::write(copy.join("config.toml"), replicated).unwrap();
    let eval = |dir: &Path, nproc: &[&str]| {
        let mut args = vec!["eval", "--limit", "2", "--max-new-tokens", "16"];
        args.extend(nproc);
        args.extend(["--exp-dir", dir.to_str().unwrap()]);
        let out = host_in(root.path(), &args);
        let log = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "eval {nproc:?}: {log}");
        assert_eq!(served(&log) > 0, !nproc.is_empty(), "{log}");
        serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(dir.join("eval.json")).unwrap()).unwrap()
    };
    let (a, b) = (eval(&exp, &[]), eval(&copy, &["--nproc", "2"]));
    assert!(a["cycles"].as_u64().unwrap() > 0, "{a}");
    for key in ["lossless", "cycles", "new_tokens", "tau", "tau_pooled", "acceptance_per_position"] {
        assert_eq!(a[key], b[key], "{key}: one rank {a} vs a two-rank replica {b}");
    }
}

/// The replica's second rank is killed mid-run (SIGKILL; no feature cache, so every step runs the
/// target): its lead stops within seconds with an error naming the rank that is gone.
#[test]
fn a_replica_rank_killed_mid_run_stops_its_lead_naming_it() {
    common::require_model();
    let root = tempfile::tempdir().unwrap();
    let target = root.path().join("qwen3_5");
    write_target("qwen3_5", &target);
    let path = format!("path = \"{}\"", target.display());
    let config = config_for(&target)
        .replace(&path, &format!("{path}\ntensor_parallel = 2"))
        .replace("steps = 4", "steps = 200\nhidden_cache_mb = 0")
        .replace("checkpoint_every = 4", "checkpoint_every = 200");
    std::fs::write(root.path().join("kill.toml"), config).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let mut ranks: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(env!("CARGO_BIN_EXE_dflash-host"))
                .args(["train", "--config", "kill.toml", "--exp-dir", "kill"])
                .current_dir(root.path())
                .env("DFLASH_CACHE", cache())
                .env_remove("RUST_BACKTRACE")
                .envs([
                    ("RANK", rank.to_string()),
                    ("WORLD_SIZE", "2".into()),
                    ("MASTER_ADDR", "127.0.0.1".into()),
                    ("MASTER_PORT", port.clone()),
                    ("DFLASH_RUN_TOKEN", "kill".into()),
                    ("DFLASH_DIST_TIMEOUT", "120".into()),
                ])
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let metrics = root.path().join("kill/metrics.jsonl");
    let waited = std::time::Instant::now();
    while std::fs::read_to_string(&metrics).map_or(0, |m| m.lines().count()) < 2 {
        assert!(waited.elapsed().as_secs() < 120, "no step 2 after {:?}", waited.elapsed());
        for r in ranks.iter_mut() {
            assert!(r.try_wait().unwrap().is_none(), "a rank ended before the kill");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let mut dead = ranks.pop().unwrap();
    dead.kill().unwrap();
    let _ = dead.wait();
    let killed = std::time::Instant::now();
    let out = ranks.pop().unwrap().wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    let line = err.lines().find(|l| l.starts_with("[rank0]: error:")).unwrap_or_default();
    assert!(line.contains("tensor-parallel rank 1 gone"), "{err}");
    assert!(killed.elapsed().as_secs() < 60, "the lead took {:?} to stop", killed.elapsed());
}

/// The Qwen3.5-MoE target written in `root`, and the config with its target whole and spread
/// over a replica of two ranks (`tensor_parallel = 2`, `expert_parallel = 2`), `head` replacing
/// the config's `[train]` lines where given.
fn whole_and_split(root: &Path, train: Option<(&str, &str)>) -> (String, String) {
    let target = root.join("qwen3_5_moe");
    write_target("qwen3_5_moe", &target);
    let mut whole = config_for(&target);
    if let Some((from, to)) = train {
        assert!(whole.contains(from), "{whole}");
        whole = whole.replace(from, to);
    }
    let path = format!("path = \"{}\"", target.display());
    let split = whole.replace(&path, &format!("{path}\ntensor_parallel = 2\nexpert_parallel = 2"));
    assert_ne!(whole, split);
    std::fs::write(root.join("whole.toml"), &whole).unwrap();
    std::fs::write(root.join("tp.toml"), &split).unwrap();
    (whole, split)
}

/// `capture --nproc 2` of a target replica over two ranks: rank 0 captures, rank 1 serves its
/// target; the captured micro-batches are those of a one-rank capture (ids, masks, lengths,
/// positions identical), their features equal to rounding, not bitwise (the split target sums
/// its row-parallel parts over the ranks: about 1e-6 here on values of about 5).
#[test]
fn a_capture_over_a_two_rank_replica_writes_what_one_rank_captures() {
    common::require_model();
    let root = tempfile::tempdir().unwrap();
    whole_and_split(root.path(), None);
    let capture = |config: &str, out: &str, nproc: &[&str]| {
        let mut args = vec!["capture", "--config", config, "--out", out, "--batches", "3", "--dtype", "f32"];
        args.extend(nproc);
        let out = host_in(root.path(), &args);
        let log = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "capture {nproc:?}: {log}");
        assert_eq!(served(&log) > 0, !nproc.is_empty(), "{log}");
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    capture("whole.toml", "one", &[]);
    let said = capture("tp.toml", "tp", &["--nproc", "2"]);
    assert_eq!(said.lines().filter(|l| l.starts_with("captured     3 micro-batches")).count(), 1, "{said}");
    let index = |dir: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(root.path().join(dir).join("index.json")).unwrap()).unwrap()
    };
    let (a, b) = (index("one"), index("tp"));
    for key in ["target_source", "target_sha256", "layer_ids", "hidden_size", "dtype", "batches", "shards"] {
        assert_eq!(a[key], b[key], "index.json `{key}`: one rank {a} vs a two-rank replica {b}");
    }
    assert_eq!(a["batches"].as_array().unwrap().len(), 3);
    let mut compared = 0;
    for shard in a["shards"].as_array().unwrap() {
        let read = |dir: &str| -> HashMap<String, Tensor> {
            Tensor::read_safetensors(root.path().join(dir).join(shard.as_str().unwrap())).unwrap().into_iter().collect()
        };
        let (one, tp) = (read("one"), read("tp"));
        let sorted = |m: &HashMap<String, Tensor>| {
            let mut names: Vec<String> = m.keys().cloned().collect();
            names.sort();
            names
        };
        assert_eq!(sorted(&one), sorted(&tp));
        for name in &sorted(&one) {
            let (x, y) = (&one[name], &tp[name]);
            assert_eq!((x.size(), x.kind()), (y.size(), y.kind()), "{name}");
            if name.ends_with(".hidden") {
                let scale = x.abs().max().double_value(&[]);
                let diff = (x - y).abs().max().double_value(&[]);
                assert!(scale > 0.0 && diff <= 1e-5 * scale, "{name}: max |diff| {diff} against max |x| {scale}");
                compared += 1;
            } else {
                assert!(x.equal(y), "{name}: one rank vs a two-rank replica");
            }
        }
    }
    assert_eq!(compared, 3);
}

/// `fork --nproc 2` of a parent trained over a two-rank target replica: the fork trains as its
/// parent did (rank 0 forks and trains, rank 1 serves its target), and with the parent's
/// optimizer state kept, or carried into the same optimizer, it continues exactly as the parent
/// did after the fork point; with a fresh state it trains on from there too.
#[test]
fn a_fork_of_a_two_rank_replica_continues_its_parent_exactly() {
    common::require_model();
    let root = tempfile::tempdir().unwrap();
    let train = (
        "checkpoint_every = 4\nkeep_checkpoints = 1",
        "checkpoint_every = 2\nkeep_checkpoints = 2\nhidden_cache_mb = 0",
    );
    whole_and_split(root.path(), Some(train));
    let out = host_in(root.path(), &["train", "--nproc", "2", "--config", "tp.toml", "--exp-dir", "parent"]);
    assert!(out.status.success(), "parent: {}", String::from_utf8_lossy(&out.stderr));
    let keys = ["step", "loss", "lr"];
    let parent = common::metrics(&root.path().join("parent"), &keys);
    assert_eq!(parent.len(), 4);
    let weights =
        |exp: &str| std::fs::read(root.path().join(exp).join("checkpoints/step-4/model.safetensors")).unwrap();
    for (fork, choice) in [("keep", "keep"), ("carry", "carry"), ("fresh", "fresh")] {
        let args = ["fork", "--nproc", "2", "parent", "--at", "2", "--optimizer-state", choice, "--exp-dir", fork];
        let out = host_in(root.path(), &args);
        let log = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "fork ({choice}): {log}");
        assert!(served(&log) > 0, "fork ({choice}): {log}");
        let manifest: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(root.path().join(fork).join("manifest.json")).unwrap())
                .unwrap();
        assert_eq!(
            (manifest["parent"]["step"].as_u64(), manifest["parent"]["optimizer_state"].as_str()),
            (Some(2), Some(choice))
        );
        let mine = common::metrics(&root.path().join(fork), &keys);
        assert_eq!(mine.iter().map(|m| m["step"].as_u64().unwrap()).collect::<Vec<_>>(), [3, 4], "{choice}");
        if choice == "fresh" {
            assert_ne!(mine[..], parent[2..], "a fresh optimizer state trains differently");
        } else {
            assert_eq!(mine[..], parent[2..], "{choice}: the fork's steps vs the parent's after step 2");
            assert!(weights(fork) == weights("parent"), "{choice}: the step-4 weights differ from the parent's");
        }
    }
}

/// `fork --nproc 2` of a parent trained data-parallel over two ranks (each rank a whole target
/// and its own batches): both ranks read the parent's checkpoint, rank 0 writes the fork, and with
/// the optimizer state kept the fork continues exactly as the parent did after the fork point.
#[test]
fn a_fork_of_a_data_parallel_parent_continues_it_exactly() {
    common::require_model();
    let root = tempfile::tempdir().unwrap();
    let train = (
        "checkpoint_every = 4\nkeep_checkpoints = 1",
        "checkpoint_every = 2\nkeep_checkpoints = 2\nhidden_cache_mb = 0",
    );
    whole_and_split(root.path(), Some(train));
    let out = host_in(root.path(), &["train", "--nproc", "2", "--config", "whole.toml", "--exp-dir", "parent"]);
    assert!(out.status.success(), "parent: {}", String::from_utf8_lossy(&out.stderr));
    let keys = ["step", "loss", "lr"];
    let parent = common::metrics(&root.path().join("parent"), &keys);
    assert_eq!(parent.len(), 4);
    let args = ["fork", "--nproc", "2", "parent", "--at", "2", "--exp-dir", "fork"];
    let out = host_in(root.path(), &args);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "fork: {log}");
    assert_eq!(served(&log), 0, "no rank serves a target in data parallel: {log}");
    let mine = common::metrics(&root.path().join("fork"), &keys);
    assert_eq!(mine[..], parent[2..], "the fork's steps vs the parent's after step 2");
    let weights =
        |exp: &str| std::fs::read(root.path().join(exp).join("checkpoints/step-4/model.safetensors")).unwrap();
    assert!(weights("fork") == weights("parent"), "the step-4 weights differ from the parent's");
}

/// `bench train --nproc 2` of a target replica over two ranks: rank 0 runs the phases, rank 1
/// serves every target forward they make, and the report lists both ranks. Without
/// `tensor_parallel` two ranks are refused, naming the field.
#[test]
fn bench_train_measures_a_two_rank_replica_and_lists_its_ranks() {
    let root = tempfile::tempdir().unwrap();
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/bench/tiny.toml");
    let config = config.to_str().unwrap();
    let args = ["bench", "train", "--nproc", "2", "--config", config, "--json", "bench.json"];
    let out = host_in(root.path(), &[&args[..], &["--set", "target.tensor_parallel=2"]].concat());
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.path().join("bench.json")).unwrap()).unwrap();
    // Each timed phase runs the target `warmup` + `iters` times (the pipeline warms up once).
    let bench: toml::Table = toml::from_str(&std::fs::read_to_string(config).unwrap()).unwrap();
    let (warmup, iters) =
        (bench["bench"]["warmup"].as_integer().unwrap(), bench["bench"]["iters"].as_integer().unwrap());
    let forwards = (2 * (warmup + iters) + 1 + iters) as u64;
    assert_eq!(report["tensor_parallel"], 2, "{report}");
    let ranks = report["ranks"].as_array().unwrap();
    let rows: Vec<_> =
        ranks.iter().map(|r| (r["rank"].as_u64(), r["device"].as_str(), r["served_calls"].as_u64())).collect();
    assert_eq!(rows, [(Some(0), Some("cpu"), Some(0)), (Some(1), Some("cpu"), Some(forwards))], "{report}");
    assert_eq!(served(&log), forwards, "{log}");
    assert!(report["target_features"]["step_s"].as_f64().unwrap() > 0.0, "{report}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("target replica over 2 ranks:"), "{stdout}");

    let out = host_in(root.path(), &args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("bench train runs in one process with [target] `tensor_parallel` = 1, not over WORLD_SIZE 2"),
        "{err}"
    );
}

/// The signal policy over a target replica of two ranks (`train --nproc 2`): SIGTERM to the
/// launcher reaches both ranks once; the lead finishes its step and writes a checkpoint while
/// rank 1 keeps serving it, and the run exits 143 with no rank named gone. A Ctrl-C to the
/// launcher's whole process group (as a terminal sends it) stops the resumed run the same way
/// with 130: the ranks, in a group of their own, hear it once, from the launcher.
#[test]
fn a_signal_to_a_two_rank_replica_stops_it_with_a_checkpoint() {
    use std::os::unix::process::CommandExt;
    common::require_model();
    let root = tempfile::tempdir().unwrap();
    let target = root.path().join("qwen3_5");
    write_target("qwen3_5", &target);
    let path = format!("path = \"{}\"", target.display());
    let config = config_for(&target)
        .replace(&path, &format!("{path}\ntensor_parallel = 2"))
        .replace("steps = 4", "steps = 400\nhidden_cache_mb = 0")
        .replace("checkpoint_every = 4", "checkpoint_every = 0");
    std::fs::write(root.path().join("sig.toml"), config).unwrap();
    let launch = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_dflash-host"))
            .args(args)
            .current_dir(root.path())
            .env("DFLASH_CACHE", cache())
            .env("DFLASH_DIST_TIMEOUT", "120")
            .env("RUST_LOG", "info")
            .env_remove("RUST_BACKTRACE")
            .process_group(0)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let metrics = root.path().join("sig/metrics.jsonl");
    let logged = || std::fs::read_to_string(&metrics).map_or(0, |m| m.lines().count());
    let wait_for = |run: &mut std::process::Child, lines: usize| {
        let waited = std::time::Instant::now();
        while logged() < lines {
            assert!(waited.elapsed().as_secs() < 120, "no step {lines} after {:?}", waited.elapsed());
            assert!(run.try_wait().unwrap().is_none(), "the run ended before the signal");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    };
    let checkpoints = || {
        let mut steps: Vec<String> = std::fs::read_dir(root.path().join("sig/checkpoints"))
            .map(|d| d.map(|e| e.unwrap().file_name().to_string_lossy().to_string()).collect())
            .unwrap_or_default();
        steps.sort();
        steps
    };
    let signal = |sig: &str, target: String| {
        assert!(Command::new("kill").args(["-s", sig, "--", &target]).status().unwrap().success());
    };

    let mut run = launch(&["train", "--nproc", "2", "--config", "sig.toml", "--exp-dir", "sig"]);
    wait_for(&mut run, 2);
    signal("TERM", run.id().to_string());
    let out = run.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(143), "{err}");
    assert!(!err.contains("gone") && !err.contains("error:"), "{err}");
    assert!(err.contains("[rank0]: ") && err.contains("SIGTERM: stopped after step"), "{err}");
    assert_eq!(checkpoints().len(), 1, "one checkpoint, written when it stopped");

    let before = logged();
    let mut run = launch(&["train", "--nproc", "2", "--resume", "sig"]);
    wait_for(&mut run, before + 2);
    signal("INT", format!("-{}", run.id())); // the whole group, as Ctrl-C at a terminal
    let out = run.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(!err.contains("gone") && !err.contains("error:"), "{err}");
    assert!(err.contains("SIGINT: stopped after step"), "{err}");
    let last = checkpoints().pop().unwrap();
    let step: u64 = last.trim_start_matches("step-").parse().unwrap();
    assert!(step as usize >= before + 2, "{last}: the resumed run's checkpoint");
}
