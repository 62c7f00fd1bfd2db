//! Nothing lost to a crash, a kill or a bad file: exact resume, kill -9 at random moments
//! (including inside checkpoint writes), corrupt checkpoints, changed plugins.
//!
//! The kill test runs `DFLASH_KILL_POINTS` kills (default 5 here; `scripts/crash_test.sh` runs 20).

mod common;

use common::cache;
use rand::{Rng, SeedableRng};
use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Output},
    time::{Duration, Instant},
};

const STEPS: u64 = 30;

/// A 30-step run with a checkpoint every step, no feature cache (features recomputed after a
/// resume round like the first time only without it: see docs/EXPERIMENTS.md, "Resume").
fn config() -> String {
    common::tiny_config(
        &format!("name = \"rel\"\nseed = 3\n[train]\nsteps = {STEPS}\nanchors_per_seq = 8\nlog_every = 3\ncheckpoint_every = 1\nkeep_checkpoints = 3\nhidden_cache_mb = 0"),
        "plugin = \"adamw\"\nlr = 3e-3",
    )
}

fn host() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dflash-host"));
    cmd.env("DFLASH_CACHE", cache()).env_remove("RUST_BACKTRACE");
    cmd
}

fn write_config(dir: &Path) -> PathBuf {
    let path = dir.join("run.toml");
    std::fs::write(&path, config()).unwrap();
    path
}

fn ok(out: Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{err}");
    err
}

fn fresh(cfg: &Path, exp: &Path, extra: &[&str]) -> Command {
    let mut cmd = host();
    cmd.args(["train", "--config"]).arg(cfg).arg("--exp-dir").arg(exp).args(extra);
    cmd
}

fn resume(exp: &Path, extra: &[&str]) -> Command {
    let mut cmd = host();
    cmd.args(["train", "--resume"]).arg(exp).args(extra);
    cmd
}

/// metrics.jsonl without the timing fields, which no two runs share.
fn metrics(exp: &Path) -> Vec<serde_json::Value> {
    common::metrics(exp, &["step", "epoch", "tokens", "draft_tokens", "loss", "acc", "tau_hat", "lr", "grad_norm", "skipped_steps"])
}

fn final_weights(exp: &Path) -> Vec<u8> {
    std::fs::read(exp.join(format!("checkpoints/step-{STEPS}/model.safetensors"))).unwrap()
}

/// The uninterrupted run every interrupted one must equal (made once per test process).
fn reference() -> &'static (Vec<serde_json::Value>, Vec<u8>) {
    static REF: std::sync::OnceLock<(Vec<serde_json::Value>, Vec<u8>)> = std::sync::OnceLock::new();
    REF.get_or_init(|| {
        common::require_model();
        let dir = tempfile::tempdir().unwrap();
        let exp = dir.path().join("ref");
        ok(fresh(&write_config(dir.path()), &exp, &[]).output().unwrap());
        (metrics(&exp), final_weights(&exp))
    })
}

#[test]
fn stop_and_resume_equals_the_uninterrupted_run_bit_for_bit() {
    let (want_metrics, want_weights) = reference();
    let dir = tempfile::tempdir().unwrap();
    let exp = dir.path().join("exp");
    ok(fresh(&write_config(dir.path()), &exp, &["--stop-at", "8"]).output().unwrap());
    assert!(!exp.join("summary.json").exists(), "a stopped run is not complete");
    let err = ok(resume(&exp, &["--stop-at", "13"]).output().unwrap());
    assert!(err.contains("resuming from") && err.contains("step-8"), "{err}");
    ok(resume(&exp, &[]).output().unwrap());
    assert_eq!(&metrics(&exp), want_metrics);
    assert!(&final_weights(&exp) == want_weights, "final weights differ from the uninterrupted run's");
    let out = resume(&exp, &[]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains(&format!("nothing to do: the run is at step {STEPS} of {STEPS}")));
}

#[test]
fn a_corrupt_checkpoint_is_reported_and_the_previous_one_used() {
    let (want_metrics, want_weights) = reference();
    let dir = tempfile::tempdir().unwrap();
    let exp = dir.path().join("exp");
    ok(fresh(&write_config(dir.path()), &exp, &["--stop-at", "10"]).output().unwrap());
    // Truncate the newest checkpoint's weights, as a full disk or a crash mid-copy would.
    let newest = exp.join("checkpoints/step-10/model.safetensors");
    let bytes = std::fs::read(&newest).unwrap();
    std::fs::write(&newest, &bytes[..bytes.len() / 2]).unwrap();
    let err = ok(resume(&exp, &[]).output().unwrap());
    assert!(err.contains("skipping checkpoint step-10") && err.contains("checksum mismatch"), "{err}");
    assert!(err.contains("resuming from") && err.contains("step-9"), "{err}");
    assert_eq!(&metrics(&exp), want_metrics);
    assert!(&final_weights(&exp) == want_weights);
}

#[test]
fn resuming_with_a_changed_plugin_library_is_refused_unless_allowed() {
    let so = common::root().join("target/release/liboptim_adamw.so");
    assert!(so.exists(), "{} missing: `cargo build --release --workspace` builds it (make test does)", so.display());
    let dir = tempfile::tempdir().unwrap();
    let exp = dir.path().join("exp");
    let plugin = |p: &Path| ["--plugin".to_string(), p.display().to_string()];
    let mut cmd = host();
    cmd.args(plugin(&so)).args(["train", "--config"]).arg(write_config(dir.path())).arg("--exp-dir").arg(&exp).args(["--stop-at", "2"]);
    ok(cmd.output().unwrap());
    // The same library, one byte longer: a different file (SHA-256) that still loads.
    let changed = dir.path().join("liboptim_adamw.so");
    let mut bytes = std::fs::read(&so).unwrap();
    bytes.push(0);
    std::fs::write(&changed, bytes).unwrap();
    let out = host().args(plugin(&changed)).args(["train", "--resume"]).arg(&exp).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("cannot resume: the optimizer plugin `adamw` changed") && err.contains("--allow-plugin-change"), "{err}");
    // Without --plugin the built-in would be used: also a change.
    let err = String::from_utf8_lossy(&resume(&exp, &[]).output().unwrap().stderr).to_string();
    assert!(err.contains("cannot resume") && err.contains("built-in"), "{err}");
    let mut cmd = host();
    cmd.args(plugin(&changed)).args(["train", "--resume"]).arg(&exp).args(["--allow-plugin-change", "--stop-at", "4"]);
    let err = ok(cmd.output().unwrap());
    assert!(err.contains("resuming although"), "{err}");
}

/// kill -9 the trainer at random moments until it has been killed `points` times, resuming after
/// each kill; the finished run must equal the uninterrupted one.
#[test]
fn kill_9_at_random_moments_loses_nothing() {
    let points: usize = std::env::var("DFLASH_KILL_POINTS").ok().and_then(|p| p.parse().ok()).unwrap_or(5);
    let (want_metrics, want_weights) = reference();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path());
    let exp = dir.path().join("exp");
    let mut rng = rand::rngs::StdRng::seed_from_u64(points as u64);
    let start = |exp: &Path| -> Child {
        let mut cmd = if exp.exists() { resume(exp, &[]) } else { fresh(&cfg, exp, &[]) };
        cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn().unwrap()
    };
    let (mut kills, mut mid_checkpoint, mut before_first) = (0, 0, 0);
    let deadline = Instant::now() + Duration::from_secs(1800);
    let newest = |exp: &Path| -> u64 {
        std::fs::read_dir(exp.join("checkpoints"))
            .map_or(0, |d| d.filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("step-")?.parse().ok()).max().unwrap_or(0))
    };
    let writing = |exp: &Path| -> bool {
        std::fs::read_dir(exp.join("checkpoints"))
            .is_ok_and(|d| d.filter_map(|e| e.ok()).any(|e| e.file_name().to_str().is_some_and(|n| n.ends_with(".tmp"))))
    };
    while kills < points {
        assert!(Instant::now() < deadline, "the crash test ran too long");
        let before = newest(&exp);
        let mut child = start(&exp);
        // Three kinds of moment, in turn: while starting up; at a random moment once this attempt
        // has trained a step; the instant a checkpoint write is seen under way.
        let kind = kills % 3;
        let t0 = Instant::now();
        let startup_wait = Duration::from_millis(rng.random_range(100..1500));
        let mut trained_at = None;
        let after_step = Duration::from_millis(rng.random_range(0..600));
        loop {
            if child.try_wait().unwrap().is_some() {
                break;
            }
            let now = Instant::now();
            if trained_at.is_none() && newest(&exp) > before {
                trained_at = Some(now);
            }
            let due = match kind {
                0 => t0.elapsed() >= startup_wait,
                1 => trained_at.is_some_and(|t| now - t >= after_step),
                _ => trained_at.is_some() && writing(&exp),
            };
            if due {
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "the run failed on its own: {status}");
            break; // finished before this kill: a kill later in the run is no longer possible
        }
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        kills += 1;
        if writing(&exp) {
            mid_checkpoint += 1;
        }
        if newest(&exp) == 0 {
            before_first += 1;
        }
    }
    // Let the last attempt finish.
    while !exp.join("summary.json").exists() {
        let status = start(&exp).wait().unwrap();
        assert!(status.success(), "resume failed: {status}");
    }
    assert_eq!(kills, points, "the run finished before every kill was made");
    eprintln!("kill -9 points survived: {kills} ({mid_checkpoint} inside a checkpoint write, {before_first} before the first checkpoint)");
    assert_eq!(&metrics(&exp), want_metrics);
    assert!(&final_weights(&exp) == want_weights, "final weights differ from the uninterrupted run's");
}
