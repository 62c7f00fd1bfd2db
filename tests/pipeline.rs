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
    let out = Command::new(env!("CARGO_BIN_EXE_dflash-host"))
        .args(args)
        .current_dir(dir)
        .env("DFLASH_CACHE", cache())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "dflash-host {args:?}: {err}");
    err
}

fn train(dir: &Path, name: &str, pipeline: &str) -> Vec<serde_json::Value> {
    common::require_model();
    std::fs::write(dir.join(format!("{name}.toml")), config(name, pipeline)).unwrap();
    host(&["train", "--config", &format!("{name}.toml"), "--exp-dir", name], dir);
    common::metrics(&dir.join(name), &["step", "tokens", "draft_tokens", "loss", "acc", "tau_hat", "grad_norm"])
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
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("features/index.json")).unwrap()).unwrap();
    assert_eq!(index["batches"].as_array().unwrap().len(), 12);
    assert!(index["shards"].as_array().unwrap().len() > 1, "1 MiB shards: several");
    let offline = train(dir.path(), "offline", "capture = \"features\"");
    assert_eq!(offline, online, "training from the capture differs from online training");

    // fp8 e4m3 with per-row scales: a quarter of the bytes, nearly the same run.
    host(&["capture", "--config", "cap.toml", "--out", "features8", "--dtype", "fp8-e4m3"], dir.path());
    let fp8 = train(dir.path(), "fp8", "capture = \"features8\"");
    let (a, b) = (online.last().unwrap()["loss"].as_f64().unwrap(), fp8.last().unwrap()["loss"].as_f64().unwrap());
    assert!((a - b).abs() < 0.05 * a, "fp8 features: final loss {b} vs {a}");
    let size = |d: &str| -> u64 {
        std::fs::read_dir(dir.path().join(d)).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum()
    };
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
    assert!(
        !out.status.success() && err.contains("captured target layers") && err.contains("the drafter reads"),
        "{err}"
    );
}

/// A target that fails (error or panic) at its 4th forward, on one of two workers: the run stops
/// with an error naming the worker, exit code 2, no hang, and its last checkpoint intact.
#[test]
fn a_failing_target_worker_stops_the_run_cleanly() {
    let so = common::build_plugin("tests/plugins/synthetic_target", "synthetic_target", &[], "synthetic_target");
    for panic in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let text = config("fail", "targets = [\"cpu\", \"cpu\"]\nbuffer_mb = 1")
            .replace("steps = 12", "steps = 50\ncheckpoint_every = 1\nhidden_cache_mb = 0")
            .replace(
                "plugin = \"hf\"\npath = \"$DFLASH_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf\"",
                &format!("plugin = \"synthetic\"\nforward_ms = 30\nfail_at_forward = 4\npanic = {panic}"),
            )
            .replace("distill_max_new_tokens = 12", "distill = false")
            .replace("mask_token_id = 16", "mask_token_id = 0");
        std::fs::write(dir.path().join("fail.toml"), text).unwrap();
        let started = std::time::Instant::now();
        let out = Command::new(env!("CARGO_BIN_EXE_dflash-host"))
            .arg("--plugin")
            .arg(&so)
            .args(["train", "--config", "fail.toml", "--exp-dir", "exp"])
            .current_dir(dir.path())
            .env("DFLASH_CACHE", cache())
            .env_remove("RUST_BACKTRACE")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        let line = err.lines().find(|l| l.starts_with("error:")).unwrap_or_default();
        let what = if panic { "deliberate panic at forward 4" } else { "deliberate failure at forward 4" };
        assert!(
            line.contains("target worker") && line.contains("target plugin `synthetic`") && line.contains(what),
            "{line}"
        );
        assert!(started.elapsed().as_secs() < 120, "the failure took {:?} to stop the run", started.elapsed());
        let newest = dflash_host::experiment::checkpoint::find(&dir.path().join("exp"), None)
            .expect("a checkpoint before the failure");
        dflash_host::experiment::verify_checkpoint(&newest.dir).unwrap();
    }
}

/// `world` ranks of `dflash-host train --config NAME.toml --exp-dir NAME` in `dir` (processes,
/// through c10d's Gloo), started by hand as a launcher would; `extra` adds arguments and
/// variables. Returns the children.
fn spawn_ranks(
    dir: &Path,
    name: &str,
    world: usize,
    extra_args: &[&str],
    vars: &[(&str, &str)],
) -> Vec<std::process::Child> {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    (0..world)
        .map(|rank| {
            Command::new(env!("CARGO_BIN_EXE_dflash-host"))
                .args(extra_args)
                .args(["train", "--config", &format!("{name}.toml"), "--exp-dir", name])
                .current_dir(dir)
                .env("DFLASH_CACHE", cache())
                .envs([
                    ("RANK", rank.to_string()),
                    ("WORLD_SIZE", world.to_string()),
                    ("MASTER_ADDR", "127.0.0.1".into()),
                    ("MASTER_PORT", port.clone()),
                ])
                .envs(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())))
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect()
}

/// R data-parallel ranks with K = 1 take the same steps as one replica with K = R: same
/// micro-batches, gradients summed across ranks (c10d, Gloo), metrics summed across ranks. With
/// Muon the Newton-Schulz work is split across the ranks (distributed Muon) and the updates
/// all-gathered.
fn ranks_equal_one_replica(world: usize, optimizer: &str, steps: u64, weight_tol: f64) {
    common::require_model();
    let dir = tempfile::tempdir().unwrap();
    let with_k = |k: usize| {
        common::tiny_config(
            &format!("name = \"dp\"\nseed = 1\n[train]\nsteps = {steps}\ngrad_accum = {k}\nhidden_cache_mb = 0\nanchors_per_seq = 8\nlog_every = 1\n\n[pipeline]\nbuffer_mb = 64"),
            optimizer,
        )
    };
    std::fs::write(dir.path().join("one.toml"), with_k(world)).unwrap();
    std::fs::write(dir.path().join("dp.toml"), with_k(1)).unwrap();
    host(&["train", "--config", "one.toml", "--exp-dir", "one"], dir.path());
    for r in spawn_ranks(dir.path(), "dp", world, &[], &[]) {
        let out = r.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let read = |name: &str| -> Vec<serde_json::Value> {
        std::fs::read_to_string(dir.path().join(name).join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let (one, dp) = (read("one"), read("dp"));
    assert_eq!(one.len(), dp.len());
    for (a, b) in one.iter().zip(&dp) {
        for key in ["step", "tokens", "draft_tokens", "acc"] {
            assert_eq!(a[key], b[key], "{world} ranks, step {}: {key}", a["step"]);
        }
        for key in ["loss", "grad_norm", "tau_hat"] {
            let (x, y) = (a[key].as_f64().unwrap(), b[key].as_f64().unwrap());
            assert!(
                (x - y).abs() <= 1e-5 * x.abs().max(1e-3),
                "{world} ranks, step {}: {key} {x} (one replica) vs {y}",
                a["step"]
            );
        }
    }
    let weights = |name: &str| {
        plugin_api::tch::Tensor::read_safetensors(
            dir.path().join(name).join(format!("checkpoints/step-{steps}/model.safetensors")),
        )
        .unwrap()
    };
    let dp_weights: std::collections::HashMap<String, plugin_api::tch::Tensor> = weights("dp").into_iter().collect();
    for (n, a) in weights("one") {
        let b = &dp_weights[&n];
        // Adam divides by sqrt(v): float-rounding differences in tiny gradients show up more in
        // the weights than in the loss, so compare norms.
        let rel = ((&a - b).norm() / a.norm()).double_value(&[]);
        assert!(rel < weight_tol, "{world} ranks: weight {n}: relative difference {rel}");
    }
}

#[test]
fn two_data_parallel_ranks_equal_one_replica_with_twice_the_accumulation() {
    ranks_equal_one_replica(2, "plugin = \"adamw\"\nlr = 3e-3", 8, 1e-4);
}

#[test]
fn three_data_parallel_ranks_with_distributed_muon_equal_one_replica_with_three_times_the_accumulation() {
    ranks_equal_one_replica(3, "plugin = \"muon\"\nlr = 3e-3\nns_dtype = \"f32\"", 4, 1e-4);
}

/// One of three ranks is killed mid-run (SIGKILL): the other two stop within seconds, not at the
/// timeout, each with an error naming the dead rank, and the last checkpoint rank 0 wrote
/// verifies.
#[test]
fn a_killed_rank_stops_the_others_with_an_error_naming_it() {
    let so = common::build_plugin("tests/plugins/synthetic_target", "synthetic_target", &[], "synthetic_target");
    let dir = tempfile::tempdir().unwrap();
    let text = config("kill", "buffer_mb = 8")
        .replace("steps = 12", "steps = 400\ncheckpoint_every = 2\nhidden_cache_mb = 0")
        .replace(
            "plugin = \"hf\"\npath = \"$DFLASH_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf\"",
            "plugin = \"synthetic\"\nforward_ms = 5",
        )
        .replace("distill_max_new_tokens = 12", "distill = false")
        .replace("mask_token_id = 16", "mask_token_id = 0");
    std::fs::write(dir.path().join("kill.toml"), text).unwrap();
    let so = so.display().to_string();
    let mut ranks = spawn_ranks(dir.path(), "kill", 3, &["--plugin", &so], &[("DFLASH_DIST_TIMEOUT", "120")]);
    let exp = dir.path().join("kill");
    let waited = std::time::Instant::now();
    while !exp.join("checkpoints/step-4").exists() {
        assert!(waited.elapsed().as_secs() < 300, "no checkpoint at step 4 after {:?}", waited.elapsed());
        for r in ranks.iter_mut() {
            assert!(r.try_wait().unwrap().is_none(), "a rank ended before the kill");
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let mut dead = ranks.pop().unwrap();
    dead.kill().unwrap();
    let _ = dead.wait();
    let killed = std::time::Instant::now();
    for (rank, r) in ranks.into_iter().enumerate() {
        let out = r.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "rank {rank}: {err}");
        let line = err.lines().find(|l| l.starts_with(&format!("[rank{rank}]: error:"))).unwrap_or_default();
        assert!(line.contains("rank 2 gone"), "rank {rank}: {line}");
    }
    assert!(killed.elapsed().as_secs() < 60, "the others took {:?} to stop", killed.elapsed());
    let (newest, _) = dflash_host::experiment::checkpoint::newest_good(&exp);
    let newest = newest.expect("checkpoints before the kill");
    dflash_host::experiment::checkpoint::verify(&newest.dir).unwrap();
}
