//! Nothing lost to a crash, a kill or a bad file: exact resume, kill -9 at random moments
//! (including inside checkpoint writes), corrupt checkpoints, changed plugins, changed configs
//! and inputs, two processes on one experiment, a full disk (docs/RELIABILITY.md).
//!
//! The kill test runs `DFLASH_KILL_POINTS` kills (default 5 here; `scripts/test/crash_test.sh` runs 20).

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
/// resume round like the first time only without it: see docs/EXPERIMENTS.md, "Resume"), and
/// the validation split scored every 10 steps (its scores must survive a resume too).
fn config() -> String {
    common::tiny_config(
        &format!("name = \"rel\"\nseed = 3\n[train]\nsteps = {STEPS}\nanchors_per_seq = 8\nlog_every = 3\neval_every = 10\ncheckpoint_every = 1\nkeep_checkpoints = 3\nhidden_cache_mb = 0"),
        "plugin = \"adamw\"\nlr = 3e-3",
    )
    .replace("eval_holdout = 3", "eval_holdout = 3\nvalidation = 2")
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
    let keys =
        ["step", "epoch", "tokens", "draft_tokens", "loss", "acc", "tau_hat", "lr", "grad_norm", "skipped_steps"];
    common::metrics(exp, &[&keys[..], &["val_loss", "val_acc", "val_tau_hat"]].concat())
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
    // The validation split was scored at steps 10, 20 and 30 (each logged, off the log_every
    // grid), on every label of its 2 sequences, and nowhere else.
    let scored: Vec<u64> =
        want_metrics.iter().filter(|m| m["val_loss"].is_number()).map(|m| m["step"].as_u64().unwrap()).collect();
    assert_eq!(scored, [10, 20, 30]);
    let last = want_metrics.last().unwrap();
    assert_eq!(last["val_acc"].as_array().unwrap().len(), 3);
    assert!(last["val_tau_hat"].as_f64().unwrap() >= 1.0 && last["val_loss"].as_f64().unwrap() > 0.0, "{last}");
    assert!(want_metrics.iter().all(|m| m["val_loss"].is_number() || m["val_acc"].is_null()));
    let out = resume(&exp, &[]).output().unwrap();
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(&format!("nothing to do: the run is at step {STEPS} of {STEPS}"))
    );
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
    cmd.args(plugin(&so))
        .args(["train", "--config"])
        .arg(write_config(dir.path()))
        .arg("--exp-dir")
        .arg(&exp)
        .args(["--stop-at", "2"]);
    ok(cmd.output().unwrap());
    // The same library, one byte longer: a different file (SHA-256) that still loads.
    let changed = dir.path().join("liboptim_adamw.so");
    let mut bytes = std::fs::read(&so).unwrap();
    bytes.push(0);
    std::fs::write(&changed, bytes).unwrap();
    let out = host().args(plugin(&changed)).args(["train", "--resume"]).arg(&exp).output().unwrap();
    let line = refused(out);
    assert!(
        line.contains("cannot resume")
            && line.contains("is not one the run started with")
            && line.contains("--allow-plugin-change"),
        "{line}"
    );
    // A library that is no plugin at all: refused by its SHA-256 before any of its code runs,
    // in this process or any other (its constructor would write the marker).
    let evil = common::build_c_library("evil");
    let marker = dir.path().join("loaded-by");
    let out = host()
        .env("DFLASH_EVIL_MARKER", &marker)
        .args(plugin(&evil))
        .args(["train", "--resume"])
        .arg(&exp)
        .output()
        .unwrap();
    let line = refused(out);
    assert!(line.contains("is not one the run started with"), "{line}");
    assert!(!marker.exists(), "the replaced library's code ran");
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
        std::fs::read_dir(exp.join("checkpoints")).map_or(0, |d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("step-")?.parse().ok()).max().unwrap_or(0)
        })
    };
    let writing = |exp: &Path| -> bool {
        std::fs::read_dir(exp.join("checkpoints")).is_ok_and(|d| {
            d.filter_map(|e| e.ok()).any(|e| e.file_name().to_str().is_some_and(|n| n.ends_with(".tmp")))
        })
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

/// Every file under `dir` (but the lock) with its bytes: a refused command must leave it as it was.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.file_name().unwrap() != ".lock" {
                out.push((p.strip_prefix(dir).unwrap().to_path_buf(), std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// The command failed with exit code 2 and one `error:` line (no panic); that line.
fn refused(out: Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    err.lines().find(|l| l.starts_with("error: ")).unwrap_or_else(|| panic!("no error line:\n{err}")).to_string()
}

fn names(dir: &Path) -> Vec<String> {
    let mut n: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    n.sort();
    n
}

#[test]
fn a_resume_past_corrupt_checkpoints_keeps_the_checkpoint_it_writes() {
    let (want_metrics, _) = reference();
    let dir = tempfile::tempdir().unwrap();
    let exp = dir.path().join("exp");
    ok(fresh(&write_config(dir.path()), &exp, &["--stop-at", "5"]).output().unwrap());
    let ckpts = exp.join("checkpoints");
    assert_eq!(names(&ckpts), ["step-3", "step-4", "step-5"]);
    for step in [4, 5] {
        let model = ckpts.join(format!("step-{step}/model.safetensors"));
        let bytes = std::fs::read(&model).unwrap();
        std::fs::write(&model, &bytes[..bytes.len() / 3]).unwrap();
    }
    // Resumes from step 3, writes step 4: pruning (keep 3) once kept the two corrupt ones with
    // higher numbers and deleted the step-4 it had just written.
    let err = ok(resume(&exp, &["--stop-at", "4"]).output().unwrap());
    assert!(err.contains("resuming from") && err.contains("step-3"), "{err}");
    assert!(err.contains("moved checkpoint step-5 aside"), "{err}");
    assert_eq!(names(&ckpts), ["corrupt", "step-3", "step-4"]);
    assert_eq!(names(&ckpts.join("corrupt")), ["step-4", "step-5"]);
    dflash_host::experiment::verify_checkpoint(&ckpts.join("step-4")).unwrap();
    assert_eq!(&metrics(&exp)[..], &want_metrics[..2], "metrics through step 4 are the uninterrupted run's");
}

#[test]
fn a_resume_refuses_what_changed_and_a_refused_resume_changes_nothing() {
    common::require_model();
    let dir = tempfile::tempdir().unwrap();
    // Inputs of its own, to change: the data file and the target (a symlink to the real one).
    std::fs::copy(cache().join("chitchat.json"), dir.path().join("chat.json")).unwrap();
    std::os::unix::fs::symlink(cache().join("SmolLM2-135M-Instruct.Q4_1.gguf"), dir.path().join("model.gguf")).unwrap();
    let cfg = dir.path().join("run.toml");
    let text = config()
        .replace("steps = 30", "steps = 4")
        .replace("$DFLASH_CACHE/chitchat.json", "chat.json")
        .replace("$DFLASH_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf", "model.gguf");
    std::fs::write(&cfg, &text).unwrap();
    let exp = dir.path().join("exp");
    // Run from a folder outside any git repository: the manifest's revision is the build's.
    ok(fresh(&cfg, &exp, &["--stop-at", "2"]).current_dir(dir.path()).output().unwrap());
    let manifest = std::fs::read_to_string(exp.join("manifest.json")).unwrap();
    let m: serde_json::Value = serde_json::from_str(&manifest).unwrap();
    let inputs: Vec<&str> = m["inputs"].as_array().unwrap().iter().map(|i| i["field"].as_str().unwrap()).collect();
    assert_eq!(inputs, ["target.path", "data.path"]);
    assert_eq!(m["git_revision"], env!("DFLASH_GIT_REVISION"), "{manifest}");

    let before = snapshot(&exp);
    let exp_cfg = exp.join("config.toml");
    let original = std::fs::read_to_string(&exp_cfg).unwrap();
    let edit = |from: &str, to: &str| {
        assert!(original.contains(from), "{from}");
        std::fs::write(&exp_cfg, original.replace(from, to)).unwrap();
    };
    let check = |line: String, want: &[&str]| {
        for w in want {
            assert!(line.contains(w), "{w}: {line}");
        }
        let mut now = snapshot(&exp);
        now.retain(|(p, _)| p != Path::new("config.toml"));
        let mut was = before.clone();
        was.retain(|(p, _)| p != Path::new("config.toml"));
        assert!(now == was, "a refused resume changed the experiment: {line}");
    };
    edit("lr = 0.003", "lr = 0.01");
    check(
        refused(resume(&exp, &[]).output().unwrap()),
        &["config field `optimizer.lr` changed: 0.003 then, 0.01 now", "--allow-change optimizer.lr"],
    );
    edit("block_size = 4", "block_size = 8");
    check(refused(resume(&exp, &[]).output().unwrap()), &["`drafter.block_size` changed: 4 then, 8 now"]);
    edit("max_records = 6", "max_records = 7");
    check(refused(resume(&exp, &[]).output().unwrap()), &["`data.max_records`"]);
    std::fs::write(&exp_cfg, &original).unwrap();
    check(refused(resume(&exp, &["--stop-at", "2"]).output().unwrap()), &["--stop-at 2: the run is at step 2 already"]);
    // The same paths, other contents.
    let data = dir.path().join("chat.json");
    let mut bytes = std::fs::read(&data).unwrap();
    bytes.push(b'\n');
    std::fs::write(&data, &bytes).unwrap();
    check(
        refused(resume(&exp, &[]).output().unwrap()),
        &["the file `data.path` names changed", "--allow-change data.path"],
    );
    bytes.pop();
    std::fs::write(&data, &bytes).unwrap();
    let model = dir.path().join("model.gguf");
    std::fs::remove_file(&model).unwrap();
    let mut weights = std::fs::read(cache().join("SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap();
    weights.extend_from_slice(&[0; 32]); // still a loadable GGUF, another SHA-256
    std::fs::write(&model, &weights).unwrap();
    check(
        refused(resume(&exp, &[]).output().unwrap()),
        &["the file `target.path` names changed", "--allow-change target.path"],
    );
    std::fs::remove_file(&model).unwrap();
    std::os::unix::fs::symlink(cache().join("SmolLM2-135M-Instruct.Q4_1.gguf"), &model).unwrap();

    // Allowed: resumes, and the manifest records the change. Its stdout is closed (`| head`):
    // the run still ends normally, without a panic.
    edit("lr = 0.003", "lr = 0.002");
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = resume(&exp, &["--allow-change", "optimizer.lr", "--stop-at", "3"]).stdout(writer).output().unwrap();
    let err = ok(out);
    assert!(err.contains("resuming although the config field `optimizer.lr` changed"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(exp.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["changes"][0]["field"], "optimizer.lr", "{m}");
    assert_eq!(m["changes"][0]["at_step"], 2, "{m}");
    ok(resume(&exp, &[]).output().unwrap());
    assert!(exp.join("summary.json").exists());

    // A finished run: nothing to do, and nothing touched (its summary.json stays).
    let before = snapshot(&exp);
    let line = refused(resume(&exp, &[]).output().unwrap());
    assert!(line.contains("nothing to do: the run is at step 4 of 4"), "{line}");
    assert!(snapshot(&exp) == before, "a refused resume changed the experiment");
}

#[test]
fn one_process_at_a_time_and_a_killed_holder_leaves_no_stale_lock() {
    common::require_model();
    let dir = tempfile::tempdir().unwrap();
    let exp = dir.path().join("exp");
    ok(fresh(&write_config(dir.path()), &exp, &["--stop-at", "1"]).output().unwrap());
    let mut first =
        resume(&exp, &[]).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn().unwrap();
    let pid = first.id().to_string();
    let deadline = Instant::now() + Duration::from_secs(120);
    while std::fs::read_to_string(exp.join(".lock")).unwrap_or_default().trim() != pid {
        assert!(Instant::now() < deadline, "the first resume never took the lock");
        std::thread::sleep(Duration::from_millis(20));
    }
    let line = refused(resume(&exp, &["--stop-at", "3"]).output().unwrap());
    assert!(
        line.contains("the experiment is in use by another process") && line.contains(&format!("pid {pid}")),
        "{line}"
    );
    first.kill().unwrap(); // SIGKILL: the kernel releases its lock
    first.wait().unwrap();
    let at = dflash_host::experiment::checkpoint::find(&exp, None).unwrap().step;
    ok(resume(&exp, &["--stop-at", &(at + 1).to_string()]).output().unwrap());
    let steps: Vec<u64> = metrics(&exp).iter().map(|m| m["step"].as_u64().unwrap()).collect();
    assert!(steps.windows(2).all(|w| w[0] < w[1]), "a step logged twice: {steps:?}");
}

#[test]
fn a_full_disk_leaves_no_partial_checkpoint_and_names_the_file() {
    common::require_model();
    let dir = tempfile::tempdir().unwrap();
    let exp = dir.path().join("exp");
    let mut cmd = fresh(&write_config(dir.path()), &exp, &["--stop-at", "2"]);
    // A file-size limit makes writes past 2 MB fail (EFBIG) as a full disk would (ENOSPC), in
    // this process only; the checkpoint's weights are larger.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            let limit = libc::rlimit { rlim_cur: 2 << 20, rlim_max: 2 << 20 };
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let line = refused(cmd.output().unwrap());
    assert!(line.contains("checkpoint step-1 not written") && line.contains(".step-1.tmp"), "{line}");
    assert!(
        line.contains(".step-1.tmp/model.safetensors") || line.contains(".step-1.tmp/optimizer.safetensors"),
        "{line}"
    );
    assert!(names(&exp.join("checkpoints")).is_empty(), "{:?}", names(&exp.join("checkpoints")));
}
