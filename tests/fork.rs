//! `fork` and `report` through the binary on the real tiny target: a fork with the parent's
//! config continues bit-identically to the parent's own continuation and never touches the
//! parent; a fork is a normal experiment afterwards (resume, refused changes); a fork may switch
//! the optimizer with a fresh state; `report` reads a real run's metrics.

mod common;

use common::{cache, require_model};
use sha2::{Digest, Sha256};
use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::{Command, Output},
};

const STEPS: u64 = 12;
const AT: u64 = 6;

/// A 12-step run with a checkpoint every step (all kept), a metrics line every step, no
/// feature cache (a resumed run computes every feature as the uninterrupted one did).
fn config() -> String {
    common::tiny_config(
        &format!(
            "name = \"fork\"\nseed = 5\n[train]\nsteps = {STEPS}\nanchors_per_seq = 8\nlog_every = 1\neval_every = 0\n\
             checkpoint_every = 1\nkeep_checkpoints = {STEPS}\nhidden_cache_mb = 0"
        ),
        "plugin = \"adamw\"\nlr = 3e-3",
    )
}

fn host(args: &[&str], paths: &[&Path]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dflash-host"));
    cmd.args(args).args(paths).env("DFLASH_CACHE", cache()).env_remove("RUST_BACKTRACE");
    cmd.output().unwrap()
}

fn ok(out: Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{err}");
    String::from_utf8_lossy(&out.stdout).to_string() + &err
}

fn fork(parent: &Path, dir: &Path, extra: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dflash-host"));
    cmd.arg("fork").arg(parent).args(["--at", &AT.to_string(), "--exp-dir"]).arg(dir).args(extra);
    cmd.env("DFLASH_CACHE", cache()).env_remove("RUST_BACKTRACE").output().unwrap()
}

/// The parent run, trained to its end once per test process. A static is never dropped, so it
/// lives in cargo's folder for test files, replaced by the next run, rather than in a temporary
/// folder that would outlive every run.
fn parent() -> &'static PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        require_model();
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fork-parent");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = dir.join("run.toml");
        std::fs::write(&cfg, config()).unwrap();
        let exp = dir.join("parent");
        ok(host(&["train", "--config"], &[&cfg, Path::new("--exp-dir"), &exp]));
        exp
    })
}

/// SHA-256 of every file under `dir`, by relative path.
fn hashes(dir: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().map(|e| e.unwrap()) {
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else {
                let rel = e.path().strip_prefix(dir).unwrap().display().to_string();
                out.insert(rel, format!("{:x}", Sha256::digest(std::fs::read(e.path()).unwrap())));
            }
        }
    }
    out
}

/// metrics.jsonl's training values (no timings) for steps after `after`.
fn losses_after(exp: &Path, after: u64) -> Vec<serde_json::Value> {
    let keys = ["step", "epoch", "tokens", "draft_tokens", "loss", "acc", "tau_hat", "lr", "grad_norm"];
    common::metrics(exp, &keys).into_iter().filter(|m| m["step"].as_u64().unwrap() > after).collect()
}

fn weights(exp: &Path, step: u64) -> Vec<u8> {
    std::fs::read(exp.join(format!("checkpoints/step-{step}/model.safetensors"))).unwrap()
}

fn manifest(exp: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(exp.join("manifest.json")).unwrap()).unwrap()
}

#[test]
fn a_fork_with_the_parents_config_continues_it_exactly_and_leaves_it_alone() {
    let parent = parent();
    let before = hashes(parent);
    let dir = tempfile::tempdir().unwrap();
    let exp = dir.path().join("fork");
    ok(fork(parent, &exp, &[]));
    assert_eq!(hashes(parent), before, "the parent's files changed");

    let (mine, theirs) = (losses_after(&exp, 0), losses_after(parent, AT));
    assert_eq!(mine[0]["step"], AT + 1, "the fork's first line continues the parent's steps");
    assert_eq!(mine, theirs);
    assert_eq!(weights(&exp, STEPS), weights(parent, STEPS), "final weights differ from the parent's");

    let p = &manifest(&exp)["parent"];
    assert_eq!(p["step"], AT);
    assert_eq!(p["path"], parent.canonicalize().unwrap().display().to_string());
    assert_eq!(p["checkpoint_sha256"], format!("{:x}", Sha256::digest(weights(parent, AT))));
    assert_eq!(p["optimizer_state"], "keep");
    assert_eq!(p["schedule"], "continue");
}

#[test]
fn a_fork_stopped_midway_resumes_exactly_and_refuses_a_changed_config() {
    let parent = parent();
    let dir = tempfile::tempdir().unwrap();
    let exp = dir.path().join("fork");
    ok(fork(parent, &exp, &["--stop-at", "9"]));
    // A resume with a field changed is refused, the fork's files untouched (the lock file names
    // the last process that held it).
    let unlocked = |exp: &Path| hashes(exp).into_iter().filter(|(k, _)| k != ".lock").collect::<BTreeMap<_, _>>();
    let before = unlocked(&exp);
    let out = host(&["train", "--set", "optimizer.lr=1e-2", "--resume"], &[&exp]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("optimizer.lr"), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(unlocked(&exp), before);
    ok(host(&["train", "--resume"], &[&exp]));
    assert_eq!(losses_after(&exp, 0), losses_after(parent, AT));
    assert_eq!(weights(&exp, STEPS), weights(parent, STEPS));
    // A fork's folder is taken: a second fork into it is refused.
    let out = fork(parent, &exp, &[]);
    assert!(!out.status.success());
}

#[test]
fn a_fork_switches_adamw_to_muon_with_a_fresh_state() {
    let parent = parent();
    let dir = tempfile::tempdir().unwrap();
    let exp = dir.path().join("muon");
    // Keeping AdamW's state for Muon is refused.
    let out = fork(parent, &exp, &["--set", "optimizer.plugin=muon", "--optimizer-state", "keep"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--optimizer-state fresh"));
    ok(fork(parent, &exp, &["--set", "optimizer.plugin=muon", "--rewarm", "2"]));
    let p = &manifest(&exp)["parent"];
    assert_eq!((p["optimizer_then"].as_str(), p["optimizer_now"].as_str()), (Some("adamw"), Some("muon")));
    assert_eq!(p["optimizer_state"], "fresh");
    assert_eq!(p["rewarm"], 2);
    let m = losses_after(&exp, 0);
    assert_eq!(m[0]["step"], AT + 1);
    assert_eq!(m.len() as u64, STEPS - AT);
    let losses: Vec<f64> = m.iter().map(|l| l["loss"].as_f64().unwrap()).collect();
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    assert_ne!(losses, losses_after(parent, AT).iter().map(|l| l["loss"].as_f64().unwrap()).collect::<Vec<_>>());
    // The re-warm of 2 steps: half the continued schedule's learning rate at the first step after
    // the fork, all of it from the second (both optimizers' lr is 3e-3).
    let lr = |exp: &Path, step: u64| {
        common::metrics(exp, &["step", "lr"]).into_iter().find(|l| l["step"] == step).unwrap()["lr"].as_f64().unwrap()
    };
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs();
    assert!(close(lr(&exp, AT + 1), 0.5 * lr(parent, AT + 1)), "{} vs {}", lr(&exp, AT + 1), lr(parent, AT + 1));
    assert!(close(lr(&exp, AT + 2), lr(parent, AT + 2)));
    assert_ne!(weights(&exp, STEPS), weights(parent, STEPS));
}

#[test]
fn report_names_the_bound_stage_of_a_real_run() {
    let out = ok(host(&["report"], &[parent()]));
    for want in ["batches/s per worker", "bound by", "queue q_hs", "what if        2x faster drafter step", "ETA"] {
        assert!(out.contains(want), "no `{want}` in:\n{out}");
    }
    assert!(out.contains(&format!("steps          {STEPS} of {STEPS}")), "{out}");
}

#[test]
fn a_fork_killed_at_any_moment_resumes_to_the_parents_result() {
    use std::{process::Stdio, time::Duration};
    let parent = parent();
    let dir = tempfile::tempdir().unwrap();
    let exp = dir.path().join("fork");
    let newest = |exp: &Path| -> u64 {
        std::fs::read_dir(exp.join("checkpoints")).map_or(0, |d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("step-")?.parse().ok()).max().unwrap_or(0)
        })
    };
    let start = |exp: &Path| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_dflash-host"));
        if exp.exists() {
            cmd.args(["train", "--resume"]).arg(exp);
        } else {
            cmd.arg("fork").arg(parent).args(["--at", &AT.to_string(), "--exp-dir"]).arg(exp);
        }
        cmd.env("DFLASH_CACHE", cache()).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap()
    };
    // Killed the instant the fork's folder appears (its first checkpoint is there already), then
    // once it has trained a step.
    let mut child = start(&exp);
    while !exp.exists() && child.try_wait().unwrap().is_none() {
        std::thread::sleep(Duration::from_micros(200));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(exp.exists(), "the fork ended before its folder was seen");
    assert_eq!(newest(&exp), AT, "the fork's folder appeared without its first checkpoint");
    let mut child = start(&exp);
    while newest(&exp) <= AT && child.try_wait().unwrap().is_none() {
        std::thread::sleep(Duration::from_micros(200));
    }
    assert!(child.try_wait().unwrap().is_none(), "the resumed fork ended before it could be killed");
    child.kill().unwrap();
    child.wait().unwrap();
    while !exp.join("summary.json").exists() {
        assert!(start(&exp).wait().unwrap().success(), "resuming the fork failed");
    }
    assert_eq!(losses_after(&exp, 0), losses_after(parent, AT));
    assert_eq!(weights(&exp, STEPS), weights(parent, STEPS));
}

#[test]
fn a_parent_still_training_is_forked_without_being_disturbed() {
    use std::{process::Stdio, time::Duration};
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("run.toml");
    std::fs::write(&cfg, config()).unwrap();
    // A long parent, so it still trains (holding its lock) while the fork opens its checkpoint.
    let live = dir.path().join("live");
    let mut train = Command::new(env!("CARGO_BIN_EXE_dflash-host"));
    train.args(["train", "--set", "train.steps=200", "--set", "train.keep_checkpoints=200", "--config"]);
    train.arg(&cfg).arg("--exp-dir").arg(&live);
    let mut train = train.env("DFLASH_CACHE", cache()).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let ready = live.join(format!("checkpoints/step-{AT}/checksums.json"));
    while !ready.exists() && train.try_wait().unwrap().is_none() {
        std::thread::sleep(Duration::from_millis(5));
    }
    let fork_dir = dir.path().join("fork");
    let out = fork(&live, &fork_dir, &["--stop-at", &(AT + 2).to_string()]);
    let still_training = train.try_wait().unwrap().is_none();
    ok(out);
    assert!(still_training, "the parent finished before the fork did: nothing was forked from a live run");
    // The parent trained on past the fork's steps; its lines there are the fork's.
    let upto = |exp: &Path| -> Vec<serde_json::Value> {
        let m = common::metrics(exp, &["step", "loss", "grad_norm", "lr"]);
        m.into_iter().filter(|l| (AT + 1..=AT + 2).contains(&l["step"].as_u64().unwrap())).collect()
    };
    while upto(&live).len() < 2 {
        assert!(train.try_wait().unwrap().is_none(), "the parent stopped");
        std::thread::sleep(Duration::from_millis(50));
    }
    train.kill().unwrap();
    train.wait().unwrap();
    assert_eq!(upto(&fork_dir), upto(&live));
    assert_eq!(weights(&fork_dir, AT + 2), weights(&live, AT + 2));
}
