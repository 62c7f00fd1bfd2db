//! The pipeline on the real target and data: several target workers give the same run as one
//! (deterministic order), and training from a capture equals training online.

mod common;

use common::cache;
use std::{path::Path, process::Command};

fn config(name: &str, pipeline: &str) -> String {
    common::tiny_config(
        &format!("name = \"{name}\"\nseed = 1\n[train]\nsteps = 12\nanchors_per_seq = 8\nlog_every = 2\n\n[pipeline]\n{pipeline}"),
        "plugin = \"adamw\"\nlr = 3e-3",
    )
}

fn host(args: &[&str], dir: &Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_dflash-host")).args(args).current_dir(dir).env("DFLASH_CACHE", cache()).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "dflash-host {args:?}: {err}");
    err
}

fn train(dir: &Path, name: &str, pipeline: &str) -> Vec<serde_json::Value> {
    common::require_model();
    std::fs::write(dir.join(format!("{name}.toml")), config(name, pipeline)).unwrap();
    host(&["train", "--config", &format!("{name}.toml"), "--exp-dir", name], dir);
    let keys = ["step", "tokens", "draft_tokens", "loss", "acc", "tau_hat", "grad_norm"];
    std::fs::read_to_string(dir.join(name).join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            keys.iter().map(|k| (k.to_string(), v[k].clone())).collect::<serde_json::Map<_, _>>().into()
        })
        .collect()
}

#[test]
fn two_target_workers_and_a_capture_give_the_online_run_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let online = train(dir.path(), "online", "buffer_mb = 64");
    assert_eq!(online.len(), 7);

    // Two CPU target workers: batches overtake each other, the drafter still sees data order.
    let two = train(dir.path(), "two", "targets = [\"cpu\", \"cpu\"]\nbuffer_mb = 64");
    assert_eq!(two, online, "two target workers changed the run");

    // Capture (f32, the run's dtype) then train from it: the same numbers.
    std::fs::write(dir.path().join("cap.toml"), config("cap", "buffer_mb = 64")).unwrap();
    host(&["capture", "--config", "cap.toml", "--out", "features", "--shard-mb", "1"], dir.path());
    let index: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("features/index.json")).unwrap()).unwrap();
    assert_eq!(index["batches"].as_array().unwrap().len(), 12);
    assert!(index["shards"].as_array().unwrap().len() > 1, "1 MiB shards: several");
    let offline = train(dir.path(), "offline", "capture = \"features\"");
    assert_eq!(offline, online, "training from the capture differs from online training");

    // fp8 e4m3 with per-row scales: a quarter of the bytes, nearly the same run.
    host(&["capture", "--config", "cap.toml", "--out", "features8", "--dtype", "fp8-e4m3"], dir.path());
    let fp8 = train(dir.path(), "fp8", "capture = \"features8\"");
    let (a, b) = (online.last().unwrap()["loss"].as_f64().unwrap(), fp8.last().unwrap()["loss"].as_f64().unwrap());
    assert!((a - b).abs() < 0.05 * a, "fp8 features: final loss {b} vs {a}");
    let size = |d: &str| -> u64 { std::fs::read_dir(dir.path().join(d)).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum() };
    assert!(size("features8") * 3 < size("features"), "fp8 {} vs f32 {}", size("features8"), size("features"));
}

#[test]
fn a_capture_from_another_target_or_layers_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("cap.toml"), config("cap", "")).unwrap();
    host(&["capture", "--config", "cap.toml", "--out", "features", "--batches", "2"], dir.path());
    let text = config("bad", "capture = \"features\"").replace("num_target_features = 2", "num_target_features = 3");
    std::fs::write(dir.path().join("bad.toml"), text).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_dflash-host"))
        .args(["train", "--config", "bad.toml"])
        .current_dir(dir.path())
        .env("DFLASH_CACHE", cache())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("captured target layers") && err.contains("the drafter reads"), "{err}");
}
