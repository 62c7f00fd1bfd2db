//! "My model, my data" through the binary: a ShareGPT file rendered with a Llama-3-style chat
//! template given in the config, self-distilled by the real SmolLM2 target, trained on, then
//! exported as a text dataset with `dflash-host distill --out`; and `dflash-host doctor`.

use std::process::Command;

mod common;
use common::cache;

/// Llama-3's turn layout, with SmolLM2's tokenizer (its markers are plain text there, so the
/// closing marker is not one token: replies stop at EOS or at the cap).
const LLAMA3_STYLE: &str = "{{- bos_token }}{%- for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{%- endfor %}{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}";

fn sharegpt() -> String {
    let topics = ["the sea", "a cat", "rain", "bread", "a train", "the moon", "tea", "snow"];
    let rows: Vec<String> = topics
        .iter()
        .enumerate()
        .map(|(i, t)| {
            format!(
                r#"  {{"id": "{i}", "conversations": [{{"from": "human", "value": "Say one thing about {t}."}}, {{"from": "gpt", "value": "Here is one thing about {t}: it is nice."}}]}}"#
            )
        })
        .collect();
    format!("[\n{}\n]\n", rows.join(",\n"))
}

const CONFIG: &str = r#"
name = "mydata"
seed = 1

[train]
steps = 4
anchors_per_seq = 8
log_every = 1
checkpoint_every = 4

[target]
plugin = "hf"
path = "$DFLASH_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf"

[drafter]
plugin = "dflash"
num_hidden_layers = 1
block_size = 4
num_target_features = 2
mask_token_id = 16

[optimizer]
plugin = "adamw"
lr = 3e-3

[data]
plugin = "chat"
path = "sharegpt.json"
chat_template = "llama3.jinja"
batch_size = 2
max_len = 96
distill = "last"
distill_max_new_tokens = 8
"#;

fn host(args: &[&str], dir: &std::path::Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_dflash-host"))
        .args(args)
        .current_dir(dir)
        .env("DFLASH_CACHE", cache())
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap()
}

#[test]
fn a_sharegpt_file_with_a_llama3_style_template_trains_and_exports() {
    common::require_model();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("sharegpt.json"), sharegpt()).unwrap();
    std::fs::write(dir.path().join("llama3.jinja"), LLAMA3_STYLE).unwrap();
    std::fs::write(dir.path().join("run.toml"), CONFIG).unwrap();

    let out = host(&["train", "--config", "run.toml", "--exp-dir", "exp"], dir.path());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "train failed:\n{stderr}");
    for want in [
        "template: field `chat_template`",
        "self-distillation (distill = \"last\"): the target regenerates 8 of the dataset's 8 replies",
        "set distill = false in [data]",
        "self-distillation: the target answers 8 prompts",
    ] {
        assert!(stderr.contains(want), "stderr lacks {want:?}:\n{stderr}");
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("distill      8 replies in"), "{stdout}");
    let metrics = common::metrics(&dir.path().join("exp"), &["loss"]);
    assert_eq!(metrics.len(), 4);
    assert!(metrics.iter().all(|m| m["loss"].as_f64().unwrap().is_finite()));
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("exp/summary.json")).unwrap()).unwrap();
    assert_eq!(summary["distill"]["replies"], 8);

    // The same replies, from the cache, as a text dataset.
    let out = host(&["distill", "--config", "run.toml", "--out", "distilled.jsonl"], dir.path());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "distill failed:\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("distilled    8 replies in") && stdout.contains("(8 from the cache"), "{stdout}");
    assert!(stdout.contains("wrote        8 records"), "{stdout}");
    let text = std::fs::read_to_string(dir.path().join("distilled.jsonl")).unwrap();
    let records: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(records.len(), 8);
    for r in &records {
        let m = r["messages"].as_array().unwrap();
        assert_eq!((m.len(), m[0]["role"].as_str(), m[1]["role"].as_str()), (2, Some("user"), Some("assistant")));
        assert!(m[0]["content"].as_str().unwrap().starts_with("Say one thing about"));
    }

    // With a validation split and test records, the summary accounts for every reply and every
    // record: 5 written with 5 replies, the 2 validation ones answered but held out, the test one
    // never distilled.
    std::fs::write(
        dir.path().join("split.toml"),
        CONFIG.replace("distill = \"last\"", "distill = \"last\"\nvalidation = 2\neval_holdout = 1"),
    )
    .unwrap();
    let out = host(&["distill", "--config", "split.toml", "--out", "split.jsonl"], dir.path());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "distill failed:\n{}", String::from_utf8_lossy(&out.stderr));
    for want in [
        "distilled    7 replies in",
        "wrote        5 records with 5 of those replies -> split.jsonl",
        "not written  2 validation records with their 2 replies (held out for validation, never trained on)",
        "             1 test record (held out as eval's prompts (`eval_holdout`), not distilled)",
    ] {
        assert!(stdout.contains(want), "stdout lacks {want:?}:\n{stdout}");
    }
    assert_eq!(std::fs::read_to_string(dir.path().join("split.jsonl")).unwrap().lines().count(), 5);

    // Nothing to export when the config keeps the dataset's replies.
    std::fs::write(dir.path().join("keep.toml"), CONFIG.replace("distill = \"last\"", "distill = false")).unwrap();
    let out = host(&["distill", "--config", "keep.toml", "--out", "kept.jsonl"], dir.path());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("keep.toml: the data loader regenerates no replies (in [data], distill = false?)"),
        "{stderr}"
    );
    assert!(!dir.path().join("kept.jsonl").exists());
}

#[test]
fn doctor_prints_the_setup_in_one_screen() {
    let dir = tempfile::tempdir().unwrap();
    let out = host(&["doctor"], dir.path());
    let stdout = String::from_utf8_lossy(&out.stdout);
    for want in ["libtorch     2.11.0", "CUDA ", "cuDNN ", "NCCL ", "GPU", "=> "] {
        assert!(stdout.contains(want), "doctor output lacks {want:?}:\n{stdout}");
    }
    assert!(stdout.lines().count() <= 24, "more than a screen:\n{stdout}");
    // No driver here: CPU runs are fine and the exit code says so.
    if !std::path::Path::new("/proc/driver/nvidia/version").exists() {
        assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        assert!(stdout.contains("ready for device = \"cpu\""), "{stdout}");
    }
}

/// A Mistral-style target (no pad token, a `[INST]`-style template) and a config without
/// `mask_token_id`, as a user writes it: the run trains, the log and the manifest name the token
/// picked (a special token the chat template never renders); with no such token in the
/// vocabulary the error lists the special tokens and why each is taken.
#[test]
fn a_target_without_a_pad_token_trains_without_mask_token_id() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("mistral");
    std::fs::create_dir(&model).unwrap();
    let fixture = common::root().join("tests/fixtures/target_mistral");
    for entry in std::fs::read_dir(&fixture).unwrap() {
        let name = entry.unwrap().file_name();
        if name != "reference.safetensors" {
            std::fs::copy(fixture.join(&name), model.join(&name)).unwrap();
        }
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    assert!(config["pad_token_id"].is_null(), "the fixture has a pad token");
    // Mistral's layout in the fixture's words: t1 BOS, t2 and t61 its `[INST]` `[/INST]`, t63 EOS;
    // t62 a special token nothing renders.
    let template = "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}t2 {{ m['content'] }} t61 \
                    {% else %}{{ m['content'] }} t63 {% endif %}{% endfor %}";
    std::fs::write(
        model.join("tokenizer_config.json"),
        serde_json::json!({"chat_template": template, "bos_token": "t1", "eos_token": "t63"}).to_string(),
    )
    .unwrap();
    let plain = std::fs::read_to_string(model.join("tokenizer.json")).unwrap();
    let mut tokenizer: serde_json::Value = serde_json::from_str(&plain).unwrap();
    tokenizer["added_tokens"] = [0, 1, 2, 61, 62, 63]
        .iter()
        .map(|&id| {
            serde_json::json!({"id": id, "content": format!("t{id}"), "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    std::fs::write(model.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    std::fs::write(dir.path().join("chats.jsonl"), common::tiny_chats(12)).unwrap();
    let run = common::tiny_hf_config("name = \"nopad\"", "path = \"mistral\"", "chats.jsonl");
    let run = run.replace("mask_token_id = 62\n", "");
    assert!(!run.contains("mask_token_id"));
    std::fs::write(dir.path().join("run.toml"), &run).unwrap();
    let train = |exp: &str| {
        Command::new(env!("CARGO_BIN_EXE_dflash-host"))
            .args(["train", "--config", "run.toml", "--exp-dir", exp])
            .current_dir(dir.path())
            .env("DFLASH_CACHE", cache())
            .env_remove("RUST_BACKTRACE")
            .output()
            .unwrap()
    };
    let out = train("exp");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains(
            "[drafter] mask_token_id = 62 (`t62`): the target has no pad token; a special token its chat \
                      template never renders"
        ),
        "{err}"
    );
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("exp/manifest.json")).unwrap()).unwrap();
    assert_eq!(
        (manifest["mask_token"]["id"].as_u64(), manifest["mask_token"]["token"].as_str()),
        (Some(62), Some("t62"))
    );
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("exp/checkpoints/step-4/config.json")).unwrap())
            .unwrap();
    assert_eq!(saved["dflash_config"]["mask_token_id"], 62);

    // The fixture's own tokenizer declares no special token: one line says so and what to set.
    std::fs::write(model.join("tokenizer.json"), plain).unwrap();
    let out = train("exp2");
    let err = String::from_utf8_lossy(&out.stderr);
    let line = err.lines().find(|l| l.starts_with("error:")).unwrap_or_else(|| panic!("{err}"));
    assert!(
        line.contains("field `mask_token_id`: not set")
            && line.contains("its tokenizer declares no special tokens")
            && line.contains("set `mask_token_id` to a token id the training data never contains"),
        "{line}"
    );
}
