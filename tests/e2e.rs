//! End to end through the real binary: a short run on the real SmolLM2 target and chitchat data
//! writes a complete experiment directory and learns; bad configs fail with one clear line.

use std::{path::Path, process::Command};

mod common;
use common::cache;

const HEAD: &str = r#"
name = "tiny"
seed = 3

[train]
steps = 8
anchors_per_seq = 8
log_every = 1
checkpoint_every = 4
keep_checkpoints = 1
"#;

fn tiny() -> String {
    common::tiny_config(HEAD, "plugin = \"adamw\"\nlr = 3e-3\nweight_decay = 0.0")
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    format!("{:x}", Sha256::digest(bytes))
}

fn run(config: &str) -> (std::process::Output, tempfile::TempDir) {
    common::train(&[], config)
}

#[test]
fn a_short_run_writes_a_complete_experiment_and_learns() {
    let (out, dir) = run(&tiny());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "train failed:\n{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("experiment") && stdout.contains("tau_hat"), "{stdout}");
    // stderr is no terminal here: the log lines are the progress, each with the time so far and
    // the ETA, unknown during the first steps' warm-up, then from their pace; none left at the end.
    let line = |step: &str| stderr.lines().find(|l| l.contains(&format!("step {step}/8  loss"))).unwrap_or_default();
    assert!(line("2").contains(" elapsed, ETA -"), "{stderr}");
    assert!(line("6").contains(" elapsed, ETA ") && !line("6").ends_with("ETA -"), "{stderr}");
    assert!(line("8").ends_with(" elapsed, ETA 0s"), "{stderr}");
    let exp = dir.path().join("exp");

    let metrics: Vec<serde_json::Value> = std::fs::read_to_string(exp.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(metrics.len(), 8);
    let loss = |i: usize| metrics[i]["loss"].as_f64().unwrap();
    assert!(loss(7) < loss(0) * 0.5, "loss did not fall: {} -> {}", loss(0), loss(7));
    for m in &metrics {
        assert_eq!(m["acc"].as_array().unwrap().len(), 3);
        for key in ["step", "tokens", "tau_hat", "lr", "grad_norm", "tok_per_s", "elapsed_s"] {
            assert!(m[key].is_number(), "metrics lack {key}: {m}");
        }
    }

    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(exp.join("manifest.json")).unwrap()).unwrap();
    let names: Vec<&str> =
        manifest["plugins"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["hf", "dflash", "adamw", "chat"]);
    assert_eq!(manifest["seed"], 3);
    assert_eq!(manifest["target_sha256"].as_str().unwrap().len(), 64);

    // Only the newest checkpoint is kept; it holds z-lab-named weights and config.
    let ckpts: Vec<_> = std::fs::read_dir(exp.join("checkpoints")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(ckpts, vec![std::ffi::OsString::from("step-8")]);
    let ck = exp.join("checkpoints/step-8");
    let weights = plugin_api::tch::Tensor::read_safetensors(ck.join("model.safetensors")).unwrap();
    let names: Vec<&str> = weights.iter().map(|(n, _)| n.as_str()).collect();
    for want in [
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.mlp.down_proj.weight",
    ] {
        assert!(names.contains(&want), "checkpoint lacks {want}: {names:?}");
    }
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ck.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["block_size"], 4);
    assert_eq!(cfg["dflash_config"]["mask_token_id"], 16);
    assert_eq!(cfg["dflash_config"]["target_layer_ids"], serde_json::json!([1, 27]));
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ck.join("trainer_state.json")).unwrap()).unwrap();
    assert_eq!(state["step"], 8);
    assert!(exp.join("summary.json").exists() && exp.join("config.toml").exists());
}

#[test]
fn config_errors_name_the_file_line_and_field() {
    let (out, _dir) = run(&tiny().replace("lr = 3e-3", "lr = 3e-3\nlearning_rate = 1"));
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("run.toml") && err.contains("[optimizer]") && err.contains("learning_rate"), "{err}");

    let (out, _dir) = run(&tiny().replace("lr = 3e-3", "lr = -1.0"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2));
    assert!(err.contains("`lr`") && err.contains("-1"), "{err}");

    let (out, _dir) = run(&tiny().replace("steps = 8", "steps = 0"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("train.steps") && err.contains("run.toml"), "{err}");

    let (out, _dir) = run(&tiny().replace("name = \"tiny\"", "name = \"../escape\""));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a valid experiment name"), "{err}");

    // One line says it all: file, line, section, plugin, field, why.
    let (out, _dir) = run(&tiny().replace("max_len = 96", "max_len = \"long\""));
    let err = String::from_utf8_lossy(&out.stderr);
    let line = err.lines().find(|l| l.starts_with("error:")).unwrap_or_default();
    assert!(
        line.contains("run.toml:") && line.contains("[data]") && line.contains("field `max_len`: invalid type"),
        "{err}"
    );
}

#[test]
fn eval_is_lossless_and_reports_acceptance() {
    let (out, dir) = run(&tiny());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let exp = dir.path().join("exp");
    let out = Command::new(env!("CARGO_BIN_EXE_dflash-host"))
        .args(["eval", "--limit", "3", "--max-new-tokens", "12", "--time-split", "--keep-tokens", "--exp-dir"])
        .arg(&exp)
        .env("DFLASH_CACHE", cache())
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}\n{stdout}");
    assert!(stdout.contains("lossless     yes") && stdout.contains(" ms verify"), "{stdout}");
    assert!(stderr.contains("eval: 3 prompts, at most 12 new tokens each"), "{stderr}");
    assert!(stdout.contains("(vLLM's mean acceptance length)") && stdout.contains("(SGLang's accept length)"));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(exp.join("eval.json")).unwrap()).unwrap();
    assert_eq!(report["prompts"], 3);
    assert_eq!(report["lossless"], true);
    // What it measured: the decode settings, and with --keep-tokens the token ids per prompt.
    assert_eq!((report["max_new_tokens"].as_u64(), report["decoding"].as_str()), (Some(12), Some("greedy")));
    assert_eq!(report["tokens_file"], "eval.tokens.jsonl");
    let kept = std::fs::read_to_string(exp.join("eval.tokens.jsonl")).unwrap();
    let kept: Vec<serde_json::Value> = kept.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(kept.len(), 3);
    for (i, k) in kept.iter().enumerate() {
        let (target, spec) = (k["target_ids"].as_array().unwrap(), k["speculative_ids"].as_array().unwrap());
        assert_eq!(k["prompt"], i);
        assert!(!k["prompt_ids"].as_array().unwrap().is_empty() && target == spec && target.len() <= 12, "{k}");
    }
    let new_tokens: usize = kept.iter().map(|k| k["speculative_ids"].as_array().unwrap().len()).sum();
    assert_eq!(report["new_tokens"].as_u64(), Some(new_tokens as u64));
    // z-lab's tau (every cycle whole), the tokens kept per cycle and the pooled one: all within a
    // block (4).
    for key in ["tau", "tau_kept", "tau_pooled"] {
        let tau = report[key].as_f64().unwrap();
        assert!((1.0..=4.0).contains(&tau), "{key} {tau}");
    }
    assert_eq!(report["acceptance_per_position"].as_array().unwrap().len(), 3);
    assert_eq!((report["block_size"].as_u64(), report["draft_tokens"].as_u64()), (Some(4), Some(3)));
    assert!(report["speedup"].as_f64().unwrap() > 0.0 && report["tau_hat"].is_number());
    assert!(report["cycle_ms"]["verify"].as_f64().unwrap() > 0.0 && report["device"] == "cpu", "{report}");
    assert!(report["prefill_ms"].as_f64().unwrap() > 0.0 && stdout.contains(" ms a prompt"), "{report}");

    // Export, then evaluate the exported z-lab folder: the same drafter up to bf16 rounding.
    let zlab = dir.path().join("zlab");
    let out = Command::new(env!("CARGO_BIN_EXE_dflash-host"))
        .args(["export", "--exp-dir"])
        .arg(&exp)
        .arg("--out")
        .arg(&zlab)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The target was a GGUF file: the printed lines hold a placeholder and say what to put there.
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(printed.contains("vllm serve HF_CHECKPOINT_OF_THE_TARGET \\\n"), "{printed}");
    assert!(printed.contains("no HF checkpoint of it is known: put the hub id or the folder"), "{printed}");
    // Each config states the dtype of the weights beside it; the model card says how to serve.
    let dtype = |p: &std::path::Path| {
        serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(p).unwrap()).unwrap()["dtype"].clone()
    };
    assert_eq!(dtype(&exp.join("checkpoints/step-8/config.json")), "float32");
    assert_eq!(dtype(&zlab.join("config.json")), "bfloat16");
    let card = std::fs::read_to_string(zlab.join("README.md")).unwrap();
    for want in [
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "chitchat.json",
        "step 8 of 8",
        "| target token ids | bos ",
        "--speculative-algorithm DFLASH",
        "--speculative-num-draft-tokens 4",
        "\"method\": \"dflash\"",
        "\"num_speculative_tokens\": 3",
        "verify cycles",
        "greedy decoding of at most 12 new tokens each",
    ] {
        assert!(card.contains(want), "model card lacks {want:?}:\n{card}");
    }
    // `eval` of the exported folder, with these arguments.
    let eval_exported = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_dflash-host"))
            .arg("eval")
            .args(args)
            .arg("--exp-dir")
            .arg(&exp)
            .arg("--drafter")
            .arg(&zlab)
            .env("DFLASH_CACHE", cache())
            .output()
            .unwrap()
    };
    let out = eval_exported(&["--limit", "2", "--max-new-tokens", "8", "--draft-tokens", "1", "--draft-vocab", "3"]);
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("lossless     yes"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The run's own eval.json stays; the drafter's results name it and its weights' hash.
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(exp.join("eval.json")).unwrap()).unwrap(),
        report
    );
    assert_eq!(report["evaluated"]["checkpoint_step"], 8);
    let sha = sha256_hex(&std::fs::read(zlab.join("model.safetensors")).unwrap());
    let file = exp.join(format!("eval-drafter-{}.json", &sha[..12]));
    let theirs: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(theirs["evaluated"]["drafter_sha256"], sha.as_str());
    assert!(theirs["cycles"].as_u64().unwrap() > 0 && theirs["loadavg_before"].is_number());
    // Verifying only the first of the block's drafts (`--draft-tokens 1`), drafted among the 3
    // tokens most often predicted in training (`--draft-vocab 3`), is lossless too.
    assert_eq!(theirs["draft_tokens"], 1);
    let coverage = theirs["draft_vocab"]["coverage"].as_f64().unwrap();
    assert!(theirs["draft_vocab"]["tokens"] == 3 && coverage > 0.0 && coverage <= 1.0, "{theirs}");
    assert_eq!(theirs["acceptance_per_position"].as_array().unwrap().len(), 1);
    assert_eq!(report["dtype"], "f32");
    // Decoded in another precision than the run's (`--dtype bf16`): said in the results; bf16's
    // block verify may round a near-tie the other way, which warns instead of failing.
    let out = eval_exported(&["--limit", "1", "--max-new-tokens", "4", "--dtype", "bf16"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let bf16: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!((bf16["dtype"].as_str(), bf16["prompts"].as_u64()), (Some("bf16"), Some(1)), "{bf16}");
    let out = Command::new(env!("CARGO_BIN_EXE_dflash-host"))
        .args(["eval", "--limit", "1", "--max-new-tokens", "4", "--draft-tokens", "4", "--exp-dir"])
        .arg(&exp)
        .env("DFLASH_CACHE", cache())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--draft-tokens 4: the drafter proposes 3 a block"), "{err}");

    // An MT-Bench file (first turns, prompt-only) by its format name, into its own file.
    std::fs::write(dir.path().join("question.jsonl"), "{\"question_id\": 81, \"category\": \"writing\", \"turns\": [\"Say hello to a friend.\", \"Shorter.\"]}\n{\"question_id\": 82, \"turns\": [\"Name a colour.\", \"Another.\"]}\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_dflash-host"))
        .args(["eval", "--limit", "2", "--max-new-tokens", "8", "--prompt-format", "mt-bench", "--prompts"])
        .arg(dir.path().join("question.jsonl"))
        .arg("--exp-dir")
        .arg(&exp)
        .env("DFLASH_CACHE", cache())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mt: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(exp.join("eval-question-step-8.json")).unwrap()).unwrap();
    assert_eq!((mt["prompts"].as_u64(), mt["prompt_format"].as_str()), (Some(2), Some("mtbench")));
}

#[test]
fn ctrl_c_and_sighup_finish_the_step_write_a_checkpoint_and_exit_130_129() {
    common::require_model();
    for (signal, name, code) in [("-INT", "SIGINT", 130), ("-HUP", "SIGHUP", 129)] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("run.toml");
        std::fs::write(
            &cfg,
            tiny().replace("steps = 8", "steps = 500").replace("checkpoint_every = 4", "checkpoint_every = 0"),
        )
        .unwrap();
        let exp = dir.path().join("exp");
        let child = Command::new(env!("CARGO_BIN_EXE_dflash-host"))
            .args(["train", "--config"])
            .arg(&cfg)
            .arg("--exp-dir")
            .arg(&exp)
            .env("DFLASH_CACHE", cache())
            .env_remove("RUST_BACKTRACE")
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Wait until training is under way (two logged steps), then interrupt.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(300);
        while std::fs::read_to_string(exp.join("metrics.jsonl")).map_or(0, |m| m.lines().count()) < 2 {
            assert!(std::time::Instant::now() < deadline, "training never started");
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        let killed = Command::new("kill").args([signal, &child.id().to_string()]).status().unwrap();
        assert!(killed.success());
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{err}");
        let said = format!("{name}: stopped after step ");
        assert!(err.contains(&said), "{err}");
        assert!(!exp.join("summary.json").exists(), "an interrupted run is not complete");
        let step: u64 = err.split(&said).nth(1).unwrap().split(';').next().unwrap().trim().parse().unwrap();
        assert!((2..500).contains(&step), "stopped at step {step}");
        let ckpt = exp.join(format!("checkpoints/step-{step}"));
        assert!(
            plugin_api::tch::Tensor::read_safetensors(ckpt.join("model.safetensors")).is_ok(),
            "{}",
            ckpt.display()
        );
    }
}

/// The command's one `error:` line (exit code 2, no panic).
fn error_line(out: &std::process::Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    err.lines().find(|l| l.starts_with("error:")).unwrap_or_else(|| panic!("no error line:\n{err}")).to_string()
}

#[test]
fn arguments_that_cannot_work_are_refused_before_any_work() {
    let host = || {
        let mut c = Command::new(env!("CARGO_BIN_EXE_dflash-host"));
        c.env_remove("RUST_BACKTRACE");
        c
    };
    let dir = tempfile::tempdir().unwrap();
    let exp = dir.path();
    std::fs::write(exp.join("eval.json"), "{\"tau\": 2.5}\n").unwrap();
    // No experiment is read before these are refused (this folder is not even one).
    for (args, want) in [
        (vec!["--max-new-tokens", "0"], "--max-new-tokens 0"),
        (vec!["--max-new-tokens", "4294967295"], "--max-new-tokens 4294967295: at most 131072"),
        (vec!["--limit", "0"], "--limit 0"),
        (vec!["--prompts", "/dev/zero"], "--prompts /dev/zero: not a regular file (a character device)"),
    ] {
        let out = host().args(["eval", "--exp-dir"]).arg(exp).args(&args).output().unwrap();
        let line = error_line(&out);
        assert!(line.contains(want), "{args:?}: {line}");
    }
    assert_eq!(std::fs::read_to_string(exp.join("eval.json")).unwrap(), "{\"tau\": 2.5}\n");
    // Where the results cannot be written is known before the evaluation runs.
    let sub = exp.join("ro");
    std::fs::create_dir_all(sub.join("eval.json")).unwrap();
    std::fs::write(sub.join("config.toml"), "").unwrap();
    let line = error_line(&host().args(["eval", "--exp-dir"]).arg(&sub).output().unwrap());
    assert!(line.contains(&format!("cannot write {}: it is a folder", sub.join("eval.json").display())), "{line}");
    // --stop-at 0 is no step.
    let out = host().args(["train", "--config", "x.toml", "--stop-at", "0"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--stop-at"));
    // The build's git revision, whatever folder it runs in; a closed stdout is no panic.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = host().arg("--version").current_dir(exp).stdout(writer).output().unwrap();
    assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"), "{}", String::from_utf8_lossy(&out.stderr));
    let out = host().arg("--version").current_dir(exp).output().unwrap();
    let version = String::from_utf8_lossy(&out.stdout);
    assert!(version.contains(&format!("(git {})", env!("DFLASH_GIT_REVISION"))), "{version}");
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = host().args(["plugins", "list"]).stdout(writer).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn an_ab_rerun_resumes_the_unfinished_arm_and_leaves_the_finished_one() {
    common::require_model();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("base.toml"),
        tiny()
            .replace("keep_checkpoints = 1", "keep_checkpoints = 3")
            .replace("checkpoint_every = 4", "checkpoint_every = 1"),
    )
    .unwrap();
    // Arm b sweeps its learning rate, chosen on the validation split's tau-hat.
    std::fs::write(
        dir.path().join("ab.toml"),
        "name = \"rerun\"\nbase = \"base.toml\"\nseeds = [0]\n[common]\ntrain = { steps = 3, eval_every = 3 }\n\
         data = { validation = 2 }\n[arms.a]\noptimizer = { lr = 3e-3 }\n[arms.b]\nsweep = { \"optimizer.lr\" = [1e-3, 2e-3] }\n",
    )
    .unwrap();
    let ab = || {
        Command::new(env!("CARGO_BIN_EXE_dflash-host"))
            .args(["ab", "--config", "ab.toml", "--out", "reports/rerun"])
            .current_dir(dir.path())
            .env("DFLASH_CACHE", cache())
            .env_remove("RUST_BACKTRACE")
            .output()
            .unwrap()
    };
    let out = ab();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (a, b) = (dir.path().join("experiments/rerun/a-s0"), dir.path().join("experiments/rerun/b-lr=0.001-s0"));
    let selection: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("experiments/rerun/selection.json")).unwrap())
            .unwrap();
    let scores: Vec<f64> =
        selection["arms"][0]["points"].as_array().unwrap().iter().map(|p| p["score"].as_f64().unwrap()).collect();
    let chosen = if scores[1] > scores[0] { "lr=0.002" } else { "lr=0.001" };
    assert_eq!(
        (selection["select"].as_str(), selection["arms"][0]["chosen"].as_str()),
        (Some("val_tau_hat"), Some(chosen)),
        "{selection}"
    );
    let md = std::fs::read_to_string(dir.path().join("reports/rerun/report.md")).unwrap();
    assert!(md.contains("## Sweeps") && md.contains("| b | 1 |"), "{md}");
    // Arm a as if killed after step 2; arm b finished.
    std::fs::remove_file(a.join("summary.json")).unwrap();
    std::fs::remove_dir_all(a.join("checkpoints/step-3")).unwrap();
    let b_metrics = std::fs::read(b.join("metrics.jsonl")).unwrap();
    let b_summary = std::fs::read(b.join("summary.json")).unwrap();
    let out = ab();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("is unfinished: resuming it") && err.contains("resuming from") && err.contains("step-2"),
        "{err}"
    );
    assert!(
        err.contains("b-lr=0.001-s0 is complete already") && err.contains("b-lr=0.002-s0 is complete already"),
        "{err}"
    );
    assert!(a.join("summary.json").exists());
    // The report goes where --out says, not into the A/B folder.
    assert!(
        dir.path().join("reports/rerun/report.md").exists() && !dir.path().join("experiments/rerun/report").exists()
    );
    assert_eq!(std::fs::read(b.join("metrics.jsonl")).unwrap(), b_metrics);
    assert_eq!(std::fs::read(b.join("summary.json")).unwrap(), b_summary);
    let steps: Vec<u64> = std::fs::read_to_string(a.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [1, 2, 3], "arm a continued, not retrained");
}

/// `ab --jobs 3` trains a phase's runs three at a time, each its own process with its log lines
/// tagged by its folder: the same runs, the same metrics and the same choice as one at a time.
#[test]
fn ab_jobs_trains_runs_at_once_and_matches_one_at_a_time() {
    common::require_model();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("base.toml"), tiny()).unwrap();
    let ab_file = |name: &str| {
        format!(
            "name = \"{name}\"\nbase = \"base.toml\"\nseeds = [0, 1]\n[common]\ntrain = {{ steps = 3, eval_every = 3, \
             checkpoint_every = 0 }}\ndata = {{ validation = 2 }}\n[arms.a]\noptimizer = {{ lr = 3e-3 }}\n[arms.b]\n\
             sweep = {{ \"optimizer.lr\" = [1e-3, 2e-3] }}\n"
        )
    };
    let ab = |name: &str, jobs: &str| {
        std::fs::write(dir.path().join(format!("{name}.toml")), ab_file(name)).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_dflash-host"))
            .args(["ab", "--config", &format!("{name}.toml"), "--jobs", jobs])
            .current_dir(dir.path())
            .env("DFLASH_CACHE", cache())
            .env_remove("RUST_BACKTRACE")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "ab --jobs {jobs}: {err}");
        err
    };
    let err = ab("par", "3");
    for run in ["a-s0", "b-lr=0.001-s0", "b-lr=0.002-s0"] {
        assert!(err.lines().any(|l| l.starts_with(&format!("[{run}]: "))), "no line tagged {run}: {err}");
    }
    assert!(err.contains("(3 at once)"), "{err}");
    ab("seq", "1");
    let root = dir.path().join("experiments");
    let chosen = |name: &str| -> serde_json::Value {
        let text = std::fs::read_to_string(root.join(name).join("selection.json")).unwrap();
        serde_json::from_str::<serde_json::Value>(&text).unwrap()["arms"][0]["chosen"].clone()
    };
    assert_eq!(chosen("par"), chosen("seq"));
    let runs = |name: &str| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(root.join(name))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .filter(|n| n.ends_with("-s0") || n.ends_with("-s1"))
            .collect();
        v.sort();
        v
    };
    assert_eq!(runs("par"), runs("seq"));
    assert_eq!(runs("par").len(), 5, "{:?}", runs("par"));
    let keys = ["step", "loss", "lr", "tau_hat", "val_loss"];
    for run in runs("seq") {
        let (p, s) = (
            common::metrics(&root.join("par").join(&run), &keys),
            common::metrics(&root.join("seq").join(&run), &keys),
        );
        assert_eq!(p, s, "{run}: --jobs 3 against one at a time");
    }
    assert!(root.join("par/report/report.md").is_file());
}

/// SIGTERM to `ab --jobs 2` reaches both running runs: each writes a checkpoint and stops, the A/B
/// exits 143 and starts nothing more, and rerunning it resumes both from their checkpoints.
#[test]
fn sigterm_to_ab_jobs_stops_its_runs_with_checkpoints_and_a_rerun_resumes_them() {
    common::require_model();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("base.toml"), tiny()).unwrap();
    std::fs::write(
        dir.path().join("stop.toml"),
        "name = \"stop\"\nbase = \"base.toml\"\nseeds = [0]\n[common]\ntrain = { steps = 60, checkpoint_every = 0 }\n\
         [arms.a]\noptimizer = { lr = 3e-3 }\n[arms.b]\noptimizer = { lr = 1e-3 }\n",
    )
    .unwrap();
    let ab = || {
        let mut c = Command::new(env!("CARGO_BIN_EXE_dflash-host"));
        c.args(["ab", "--config", "stop.toml", "--jobs", "2"])
            .current_dir(dir.path())
            .env("DFLASH_CACHE", cache())
            .env_remove("RUST_BACKTRACE");
        c
    };
    let child = ab().stderr(std::process::Stdio::piped()).spawn().unwrap();
    let runs = ["a-s0", "b-s0"].map(|r| dir.path().join("experiments/stop").join(r));
    let logged = |exp: &Path| std::fs::read_to_string(exp.join("metrics.jsonl")).map_or(0, |m| m.lines().count());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(300);
    while runs.iter().any(|r| logged(r) < 2) {
        assert!(std::time::Instant::now() < deadline, "the runs never started");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    assert!(Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(143), "{err}");
    for (run, exp) in ["a-s0", "b-s0"].iter().zip(&runs) {
        assert!(err.contains(&format!("[{run}]: ")) && !exp.join("summary.json").exists(), "{run}: {err}");
        let steps = std::fs::read_dir(exp.join("checkpoints")).map_or(0, |d| d.count());
        assert_eq!(steps, 1, "{run}: one checkpoint, written when it stopped");
    }
    let out = ab().output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert_eq!(err.matches("is unfinished: resuming it").count(), 2, "{err}");
    assert!(runs.iter().all(|r| r.join("summary.json").exists()));
}

/// `dflash-host train --config <tiny> --exp-dir <exp> ARGS...` in a fresh folder.
fn train_with(config: &str, args: &[&str], exp_exists: bool) -> (std::process::Output, tempfile::TempDir) {
    common::require_model();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("run.toml"), config).unwrap();
    if exp_exists {
        std::fs::create_dir_all(dir.path().join("exp")).unwrap();
        std::fs::write(dir.path().join("exp/metrics.jsonl"), "").unwrap();
    }
    let out = Command::new(env!("CARGO_BIN_EXE_dflash-host"))
        .args(["train", "--config", "run.toml", "--exp-dir", "exp"])
        .args(args)
        .current_dir(dir.path())
        .env("DFLASH_CACHE", cache())
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    (out, dir)
}

#[test]
fn set_and_device_override_fields_and_the_experiment_records_the_result() {
    let args = [
        "--set",
        "train.steps=2",
        "--set",
        "optimizer.lr=1e-3",
        "--set",
        "train.log_every=2",
        "--set",
        "train.tensorboard_every=1",
        "--device",
        "cpu",
    ];
    let (out, dir) = train_with(&tiny(), &args, false);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // Logs into a pipe carry no colour codes.
    assert!(stderr.contains(" INFO ") && !stderr.contains('\u{1b}'), "{stderr}");
    let recorded: toml::Table =
        toml::from_str(&std::fs::read_to_string(dir.path().join("exp/config.toml")).unwrap()).unwrap();
    assert_eq!(recorded["train"]["steps"].as_integer(), Some(2));
    assert_eq!(recorded["train"]["log_every"].as_integer(), Some(2));
    assert_eq!(recorded["optimizer"]["lr"].as_float(), Some(1e-3));
    assert_eq!(recorded["device"].as_str(), Some("cpu"));
    let metrics = std::fs::read_to_string(dir.path().join("exp/metrics.jsonl")).unwrap();
    let steps: Vec<u64> = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps.last(), Some(&2), "the run stopped at the overridden step count: {metrics}");
    // tensorboard_every = 1: each step's own values beside the metrics lines' (tags are stored as text).
    let events = std::fs::read_dir(dir.path().join("exp"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().contains("tfevents"))
        .unwrap();
    let bytes = std::fs::read(events).unwrap();
    let count = |tag: &str| bytes.windows(tag.len()).filter(|w| *w == tag.as_bytes()).count();
    assert_eq!((count("train_step/loss"), count("train_step/grad_norm")), (2, 2), "one point a step");
}

#[test]
fn config_mistakes_are_refused_naming_the_argument_before_the_target_loads() {
    for (args, exists, want) in [
        (
            vec!["--set", "train.steps=many"],
            false,
            vec!["--set train.steps=many", "field `train.steps`", "invalid type"],
        ),
        (vec!["--set", "train.stepz=3"], false, vec!["--set train.stepz=3", "unknown field `stepz`"]),
        (
            vec!["--set", "train.warmup_frac=2"],
            false,
            vec!["--set train.warmup_frac=2", "train.warmup_frac", "out of range"],
        ),
        (
            vec!["--set", "data.batch_sise=2"],
            false,
            vec!["--set data.batch_sise=2", "[data] plugin `chat`", "unknown field `batch_sise`"],
        ),
        (vec!["--set", "data.max_len=long"], false, vec!["--set data.max_len=long", "field `max_len`", "invalid type"]),
        (vec!["--set", "optimizer.lr=-1"], false, vec!["--set optimizer.lr=-1", "[optimizer] plugin `adamw`", "`lr`"]),
        (
            vec!["--set", "data.max_len=8"],
            false,
            vec!["--set data.max_len=8", "[data] plugin `chat`", "field `max_len`", "must be >= 16"],
        ),
        (
            vec!["--set", "drafter.num_hidden_layers=0"],
            false,
            vec![
                "--set drafter.num_hidden_layers=0",
                "[drafter] plugin `dflash`",
                "field `num_hidden_layers`",
                "1..=64",
            ],
        ),
        (
            vec!["--set", "data.path=missing.jsonl"],
            false,
            vec!["--set data.path=missing.jsonl", "field `path`", "missing.jsonl: no such file"],
        ),
        (vec!["--device", "gpu"], false, vec!["--device gpu", "expected `cpu`, `cuda` or `cuda:N`"]),
        (vec!["--set", "steps"], false, vec!["--set steps: expected KEY=VALUE"]),
        (vec![], true, vec!["experiment directory exp already exists"]),
    ] {
        let (out, _dir) = train_with(&tiny(), &args, exists);
        let line = error_line(&out);
        for w in &want {
            assert!(line.contains(w), "{args:?}: want {w:?} in {line}");
        }
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("creating target plugin"), "{args:?}: the target was loaded first:\n{err}");
    }
    // A mistake in the file itself keeps its line, with overrides given or not.
    let (out, _dir) =
        train_with(&tiny().replace("max_len = 96", "max_len = \"long\""), &["--set", "train.steps=2"], false);
    let line = error_line(&out);
    assert!(line.contains("run.toml:") && line.contains("field `max_len`"), "{line}");
    // A range the drafter checks (not the parse), in the file: refused at its line, target unloaded.
    let bad = tiny().replace("block_size = 4", "block_size = 1");
    let at = bad.lines().position(|l| l == "block_size = 1").unwrap() + 1;
    let (out, _dir) = train_with(&bad, &[], false);
    let line = error_line(&out);
    assert!(
        line.contains(&format!("run.toml:{at}: ")) && line.contains("field `block_size`: must be in 2..=64"),
        "{line}"
    );
    assert!(!String::from_utf8_lossy(&out.stderr).contains("creating target plugin"), "the target was loaded first");
}

/// A fake finished run: config, manifest (its A/B arm), metrics, summary.
fn fake_run(dir: &std::path::Path, arm: &str, steps: u64, scale: f64) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.toml"), "name = \"ab\"\n").unwrap();
    std::fs::write(dir.join("manifest.json"), format!("{{\"arm\": \"{arm}\"}}")).unwrap();
    let lines: Vec<String> = (1..=steps)
        .map(|s| {
            serde_json::json!({"step": s, "tokens": s * 100, "loss": scale / s as f64, "acc": [0.5], "tau_hat": 1.5,
                "lr": 1e-3, "grad_norm": 2.0, "elapsed_s": s as f64})
            .to_string()
        })
        .collect();
    std::fs::write(dir.join("metrics.jsonl"), lines.join("\n") + "\n").unwrap();
    std::fs::write(dir.join("summary.json"), "{\"wall_s\": 1.0}").unwrap();
}

#[test]
fn compare_reads_an_ab_folder_into_one_report_folder_and_config_explain_prints_the_reference() {
    let dir = tempfile::tempdir().unwrap();
    let ab = dir.path().join("ab");
    fake_run(&ab.join("a-s0"), "a", 20, 10.0);
    fake_run(&ab.join("b-s0"), "b", 200, 10.0);
    std::fs::write(
        ab.join("b-s0/eval-gsm8k-step-200.json"),
        "{\"tau\": 2.25, \"tau_pooled\": 2.5, \"cycles\": 10, \"source\": \"gsm8k.jsonl\"}",
    )
    .unwrap();
    let host = || Command::new(env!("CARGO_BIN_EXE_dflash-host"));
    for _ in 0..2 {
        let out = host().arg("compare").arg(&ab).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        // b's own end (loss 10/200) apart from the comparison at a's end (20 steps).
        assert!(
            stdout.contains("final values") && stdout.contains("0.0500") && stdout.contains("equal-token comparison"),
            "{stdout}"
        );
        assert!(stdout.contains("eval-gsm8k-step-200.json") && stdout.contains("2.250"), "{stdout}");
    }
    let mut entries: Vec<String> =
        std::fs::read_dir(&ab).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    entries.sort();
    assert_eq!(entries, ["a-s0", "b-s0", "report"], "one report folder, reused");
    assert!(ab.join("report/lr_vs_tokens.png").exists() && ab.join("report/grad_norm_vs_tokens.svg").exists());

    let out = host().args(["config", "explain", "data"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.contains("`[data.fields]`") && stdout.contains("| `distill` |"), "{stdout}");
    assert!(!stdout.contains("[train]"), "one section only: {stdout}");
    let committed = std::fs::read_to_string(common::root().join("docs/CONFIG.md")).unwrap();
    let all = host().args(["config", "explain"]).output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&all.stdout).trim_end(),
        committed.trim_end(),
        "config explain prints docs/CONFIG.md"
    );
    let line = error_line(&host().args(["config", "explain", "nope"]).output().unwrap());
    assert!(line.contains("no config section `nope`"), "{line}");

    // Which plugin's fields: every built-in's by default, one by --plugin, the config's by --config.
    let explain = |args: &[&str]| {
        let out = host().args(["config", "explain"]).args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let both = explain(&["drafter"]);
    assert!(both.contains("plugin = \"dflash\"") && both.contains("plugin = \"gdn\""), "{both}");
    let gdn = explain(&["drafter", "--plugin", "gdn"]);
    assert!(gdn.starts_with("Plugin `gdn`, as `--plugin gdn` asks."), "{gdn}");
    assert!(gdn.contains("`[drafter]` plugin = \"gdn\"") && !gdn.contains("plugin = \"dflash\""), "{gdn}");
    let cfg = ab.parent().unwrap().join("explain.toml");
    std::fs::write(
        &cfg,
        "name = \"x\"\n[train]\nsteps = 1\n[drafter]\nplugin = \"gdn\"\n[optimizer]\nplugin = \"muon\"\n",
    )
    .unwrap();
    let picked = explain(&["--config", cfg.to_str().unwrap()]);
    assert!(picked.contains("- `[drafter]` plugin = \"gdn\" (line 5)"), "{picked}");
    assert!(picked.contains("- `[optimizer]` plugin = \"muon\" (line 7)"), "{picked}");
    assert!(picked.contains("- `[target]`: no `plugin` field"), "{picked}");
    assert!(picked.contains("`[optimizer.adamw]` plugin = \"muon\"") && picked.contains("`[train]`"), "{picked}");
    assert!(
        !picked.contains("plugin = \"dflash\"") && !picked.contains("`[optimizer]` plugin = \"adamw\""),
        "{picked}"
    );
    let line = error_line(&host().args(["config", "explain", "--plugin", "lora"]).output().unwrap());
    assert!(line.contains("--plugin lora: no plugin of that name (known: hf, dflash, gdn"), "{line}");
}

/// `[target] path = "Org/Tiny"` with `revision`: a tiny HF model from tests/fixtures laid out in
/// an HF hub cache as the `hf` CLI writes it (`$HF_HUB_CACHE`, blobs, refs, symlinked
/// snapshots), nothing downloaded (`HF_HUB_OFFLINE`): `train`, `distill`, `eval` and `export`
/// all run through the name, the manifest records the name, revision and commit, and a revision
/// the cache does not hold is refused before anything loads, naming where it looked.
#[test]
fn a_hub_name_trains_distils_evaluates_and_exports_from_the_hf_cache() {
    let dir = tempfile::tempdir().unwrap();
    let hub = dir.path().join("hub");
    let (main, v1) = ("a".repeat(40), "1234567890abcdef1234567890abcdef12345678");
    let model = common::tiny_hf_model();
    // `main` moved on to other weights' config; the run asks for the `v1` branch.
    let mut newer = model.clone();
    for (name, bytes) in newer.iter_mut() {
        if name == "config.json" {
            *bytes = String::from_utf8(bytes.clone())
                .unwrap()
                .replace("\"rms_norm_eps\": 1e-06", "\"rms_norm_eps\": 1e-05")
                .into();
        }
    }
    common::hf_cache(&hub, "Org/Tiny", &[("main", &main, newer), ("v1", v1, model)]);
    std::fs::write(dir.path().join("chats.jsonl"), common::tiny_chats(12)).unwrap();
    let config = common::tiny_hf_config("name = \"hub\"", "path = \"Org/Tiny\"\nrevision = \"v1\"", "chats.jsonl");
    let cfg = dir.path().join("run.toml");
    std::fs::write(&cfg, config).unwrap();
    let env = [("HF_HUB_CACHE", hub.as_path()), ("HF_HUB_OFFLINE", Path::new("1"))];
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let ok = |out: std::process::Output, what: &str| {
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{what} failed:\n{stderr}\n{}", String::from_utf8_lossy(&out.stdout));
        stderr
    };
    let exp = dir.path().join("exp");
    ok(common::host(&["train", "--config", &s(&cfg), "--exp-dir", &s(&exp)], &env), "train");
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(exp.join("manifest.json")).unwrap()).unwrap();
    let snapshot = hub.join("models--Org--Tiny/snapshots").join(v1);
    assert_eq!(manifest["target_source"].as_str(), Some(s(&snapshot).as_str()), "{manifest}");
    assert_eq!(manifest["target_hub"], serde_json::json!({"repo": "Org/Tiny", "revision": "v1", "commit": v1}));
    assert_eq!(common::metrics(&exp, &["step"]).len(), 4);

    // The revision as a commit hash.
    let out_file = dir.path().join("distilled.jsonl");
    let set = format!("target.revision={v1}");
    let out = common::host(&["distill", "--config", &s(&cfg), "--set", &set, "--out", &s(&out_file)], &env);
    ok(out, "distill");
    assert_eq!(std::fs::read_to_string(&out_file).unwrap().lines().count(), 10, "the training records");

    let out = common::host(&["eval", "--exp-dir", &s(&exp), "--limit", "2", "--max-new-tokens", "6"], &env);
    ok(out, "eval");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(exp.join("eval.json")).unwrap()).unwrap();
    assert_eq!((report["prompts"].as_u64(), report["lossless"].as_bool()), (Some(2), Some(true)), "{report}");

    let drafter = dir.path().join("drafter");
    let out = common::host(&["export", "--exp-dir", &s(&exp), "--out", &s(&drafter)], &env);
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    ok(out, "export");
    let card = std::fs::read_to_string(drafter.join("README.md")).unwrap();
    assert!(card.contains("# DFlash drafter for `Org/Tiny`"), "{card}");
    assert!(card.contains("--model-path Org/Tiny --revision v1"), "{card}");
    // The printed lines name the hub id and revision the manifest records.
    assert!(printed.contains("vllm serve Org/Tiny --revision v1 \\\n"), "{printed}");

    // The same run with its target in a plain folder (no hub record): the printed lines name the
    // folder by its absolute path, which exists, not by its bare name (a hub lookup to vLLM).
    let folder = dir.path().join("tiny-model");
    std::fs::create_dir_all(&folder).unwrap();
    for entry in std::fs::read_dir(&snapshot).unwrap() {
        let entry = entry.unwrap().path();
        std::fs::copy(&entry, folder.join(entry.file_name().unwrap())).unwrap();
    }
    let local = dir.path().join("exp-local");
    std::fs::create_dir_all(&local).unwrap();
    let status = Command::new("cp").arg("-r").arg(exp.join("checkpoints")).arg(&local).status().unwrap();
    assert!(status.success());
    let mut m = manifest.clone();
    m["target_source"] = s(&folder).into();
    m.as_object_mut().unwrap().remove("target_hub");
    std::fs::write(local.join("manifest.json"), serde_json::to_string_pretty(&m).unwrap()).unwrap();
    let config = std::fs::read_to_string(exp.join("config.toml")).unwrap();
    let config = config.replace("path = \"Org/Tiny\"", &format!("path = {:?}", s(&folder)));
    std::fs::write(local.join("config.toml"), config.replace("revision = \"v1\"\n", "")).unwrap();
    let out = common::host(&["export", "--exp-dir", &s(&local), "--out", &s(&dir.path().join("drafter2"))], &env);
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    ok(out, "export of the folder's run");
    let at = folder.canonicalize().unwrap();
    assert!(at.is_dir() && printed.contains(&format!("vllm serve {} \\\n", at.display())), "{printed}");
    assert!(printed.contains(&format!("--model-path {} \\\n", at.display())), "{printed}");

    // A revision the cache lacks: one line naming the name, the revision, the local path tried
    // and the cache folder, before the target loads or the experiment folder is made.
    let exp2 = dir.path().join("exp2");
    let out =
        common::host(&["train", "--config", &s(&cfg), "--exp-dir", &s(&exp2), "--set", "target.revision=v9"], &env);
    let line = error_line(&out);
    let want = format!(
        "[target] plugin `hf`: field `path`: `Org/Tiny` (revision `v9`) is not a local path \
         ({}: no such file or folder) and not in the HF hub cache (looked in {}, from $HF_HUB_CACHE: it has no refs/v9, \
         and `v9` is not a commit hash); not downloaded, as HF_HUB_OFFLINE is set",
        dir.path().join("Org/Tiny").display(),
        hub.join("models--Org--Tiny").display()
    );
    assert!(line.ends_with(&want), "{line}\nshould end with\n{want}");
    assert!(line.starts_with(&format!("error: {}:9: ", cfg.display())), "the line of `path`: {line}");
    assert!(!String::from_utf8_lossy(&out.stderr).contains("creating target plugin") && !exp2.exists());
}

/// The pids whose parent is `parent` (from /proc).
fn children_of(parent: u32) -> Vec<u32> {
    let parent_of = |pid: &str| -> Option<u32> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        stat.rsplit_once(") ")?.1.split(' ').nth(1)?.parse().ok()
    };
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str().map(String::from))
        .filter(|pid| pid.bytes().all(|b| b.is_ascii_digit()) && parent_of(pid) == Some(parent))
        .filter_map(|pid| pid.parse().ok())
        .collect()
}

/// Whether `pid` still runs (a zombie does not).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z')))
}

/// SIGINT sent to `ab --jobs 2`'s pid (not to its terminal's group) reaches its running runs as
/// SIGTERM does: both checkpoint and stop, the third arm never starts, and the A/B exits 130 with
/// the phase not done (no report). Killed with SIGKILL, the A/B takes its runs with it: each is
/// told to stop and leaves a checkpoint; none trains on as an orphan.
#[test]
fn sigint_to_ab_jobs_stops_the_phase_and_kill_9_takes_its_runs_with_it() {
    common::require_model();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("base.toml"), tiny()).unwrap();
    std::fs::write(
        dir.path().join("int.toml"),
        "name = \"int\"\nbase = \"base.toml\"\nseeds = [0]\n[common]\ntrain = { steps = 200, checkpoint_every = 0 }\n\
         [arms.a]\noptimizer = { lr = 3e-3 }\n[arms.b]\noptimizer = { lr = 1e-3 }\n[arms.c]\noptimizer = { lr = 2e-3 }\n",
    )
    .unwrap();
    let ab = |stderr: std::process::Stdio| {
        Command::new(env!("CARGO_BIN_EXE_dflash-host"))
            .args(["ab", "--config", "int.toml", "--jobs", "2"])
            .current_dir(dir.path())
            .env("DFLASH_CACHE", cache())
            .env_remove("RUST_BACKTRACE")
            .stderr(stderr)
            .spawn()
            .unwrap()
    };
    let runs = ["a-s0", "b-s0", "c-s0"].map(|r| dir.path().join("experiments/int").join(r));
    let logged = |exp: &Path| std::fs::read_to_string(exp.join("metrics.jsonl")).map_or(0, |m| m.lines().count());
    let wait_for = |lines: [usize; 2]| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(300);
        while runs[..2].iter().zip(lines).any(|(r, n)| logged(r) < n) {
            assert!(std::time::Instant::now() < deadline, "the runs never got to {lines:?} lines");
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    };
    let checkpoint_steps = |exp: &Path| -> Vec<u64> {
        let mut steps: Vec<u64> = std::fs::read_dir(exp.join("checkpoints"))
            .map(|d| d.filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("step-")?.parse().ok()).collect())
            .unwrap_or_default();
        steps.sort();
        steps
    };

    let child = ab(std::process::Stdio::piped());
    wait_for([2, 2]);
    assert!(Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap().success());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    let stopped_at: Vec<u64> = runs[..2].iter().map(|exp| *checkpoint_steps(exp).last().unwrap()).collect();
    for exp in &runs[..2] {
        assert_eq!(checkpoint_steps(exp).len(), 1, "{}: one checkpoint, written when it stopped: {err}", exp.display());
    }
    assert_eq!(logged(&runs[2]), 0, "the third run never started: {err}");
    assert!(!dir.path().join("experiments/int/report").exists(), "{err}");

    // kill -9 of the rerun: its runs (resumed) stop with a checkpoint of their own.
    let log = std::fs::File::create(dir.path().join("rerun.log")).unwrap();
    let mut parent = ab(log.into());
    let at = [logged(&runs[0]), logged(&runs[1])];
    wait_for([at[0] + 2, at[1] + 2]);
    let kids = children_of(parent.id());
    assert_eq!(kids.len(), 2, "{kids:?}");
    parent.kill().unwrap();
    parent.wait().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while kids.iter().any(|&k| running(k)) {
        assert!(std::time::Instant::now() < deadline, "runs of a killed A/B still train: {kids:?}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let rerun = std::fs::read_to_string(dir.path().join("rerun.log")).unwrap();
    assert_eq!(rerun.matches("is unfinished: resuming it").count(), 2, "{rerun}");
    assert_eq!(rerun.matches("SIGTERM: stopped after step").count(), 2, "{rerun}");
    for (exp, before) in runs[..2].iter().zip(stopped_at) {
        let now = *checkpoint_steps(exp).last().unwrap();
        assert!(now > before, "{}: a checkpoint at step {now}, after {before}: {rerun}", exp.display());
    }
}
