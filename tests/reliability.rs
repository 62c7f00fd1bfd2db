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
    // To its end with stdout and stderr on one pipe whose reader leaves after a line
    // (`2>&1 | head -1`): the logs stop, the run does not (exit 0, not a panic's 101).
    let (reader, writer) = std::io::pipe().unwrap();
    let mut run = resume(&exp, &[]).stdout(writer.try_clone().unwrap()).stderr(writer).spawn().unwrap();
    let mut first = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(reader), &mut first).unwrap();
    assert!(!first.is_empty());
    assert_eq!(run.wait().unwrap().code(), Some(0), "after the line {first:?}");
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
    ok(fresh(&write_config(dir.path()), &exp, &["--stop-at", "1"]).output().unwrap());
    // `ulimit -f` (2 MiB, below the checkpoint's weights) in the resumed process only: the kernel
    // sends SIGXFSZ on the write past it, which kills a process that does not ignore it (no
    // message, a partial folder left). The binary ignores it, so the write fails with EFBIG as on
    // a full disk (ENOSPC).
    let mut cmd = resume(&exp, &["--stop-at", "2"]);
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            let limit = libc::rlimit { rlim_cur: 2 << 20, rlim_max: 2 << 20 };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let line = refused(cmd.output().unwrap());
    assert!(line.contains("stopped at step 2; the last good checkpoint is ") && line.contains("step-1: "), "{line}");
    assert!(line.contains("checkpoint step-2 not written") && line.contains(".step-2.tmp"), "{line}");
    assert!(
        line.contains(".step-2.tmp/model.safetensors") || line.contains(".step-2.tmp/optimizer.safetensors"),
        "{line}"
    );
    // No partial folder; the last good checkpoint is there and verifies.
    assert_eq!(names(&exp.join("checkpoints")), ["step-1"]);
    assert_eq!(dflash_host::experiment::checkpoint::find(&exp, None).unwrap().step, 1);
}

/// `train --resume DIR --steps N` (or `--set train.steps=N`) extends a finished run, and an
/// interrupted one, to N steps: it continues from the newest checkpoint, the experiment's
/// config.toml says N and the manifest's `changes` records the change as `--allow-change`
/// would. Any other field changed with `--set` is refused (saying how to allow it), changing
/// nothing, unless allowed. On a tiny HF model from tests/fixtures, so seconds.
#[test]
fn a_resume_with_more_steps_extends_the_run_and_records_it() {
    let dir = tempfile::tempdir().unwrap();
    common::write_tiny_hf_model(&dir.path().join("tiny"));
    std::fs::write(dir.path().join("chats.jsonl"), common::tiny_chats(12)).unwrap();
    let cfg = dir.path().join("run.toml");
    let text = common::tiny_hf_config("name = \"more\"", "path = \"tiny\"", "chats.jsonl")
        .replace("log_every = 1", "log_every = 1\ncheckpoint_every = 1\nkeep_checkpoints = 2");
    std::fs::write(&cfg, text.replace("steps = 4", "steps = 2")).unwrap();
    let exp = dir.path().join("exp");
    ok(fresh(&cfg, &exp, &[]).output().unwrap());
    let steps = || metrics(&exp).iter().map(|m| m["step"].as_u64().unwrap()).collect::<Vec<_>>();
    let recorded = || std::fs::read_to_string(exp.join("config.toml")).unwrap();
    let changes = || {
        let m: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(exp.join("manifest.json")).unwrap()).unwrap();
        m["changes"].clone()
    };
    let line = refused(resume(&exp, &[]).output().unwrap());
    assert!(
        line.contains(&format!(
            "nothing to do: the run is at step 2 of 2; extend it with `train --resume {} --steps N`",
            exp.display()
        )),
        "{line}"
    );

    // Finished at 2: on to 4 (stopped at 3, as if interrupted), then to 5 by --set.
    let err = ok(resume(&exp, &["--steps", "4", "--stop-at", "3"]).output().unwrap());
    assert!(err.contains("--steps 4: train.steps 2 -> 4; the learning-rate schedule now spans 4 steps"), "{err}");
    assert!(err.contains("resuming from") && err.contains("step-2"), "{err}");
    // Settings are logged as the config writes them.
    assert!(err.contains("loss_normalization global, anchors response"), "{err}");
    assert_eq!(steps(), [1, 2, 3]);
    assert!(recorded().contains("steps = 4"), "{}", recorded());
    assert_eq!(changes(), serde_json::json!([{"at_step": 2, "field": "train.steps", "then": "2", "now": "4"}]));
    ok(resume(&exp, &["--set", "train.steps=5"]).output().unwrap());
    assert_eq!(steps(), [1, 2, 3, 4, 5]);
    assert_eq!(changes()[1], serde_json::json!({"at_step": 3, "field": "train.steps", "then": "4", "now": "5"}));
    assert!(exp.join("summary.json").exists() && exp.join("checkpoints/step-5").exists());

    // Another field: refused, saying how, and nothing changes; allowed, it is recorded too.
    let before = snapshot(&exp);
    let line = refused(resume(&exp, &["--steps", "6", "--set", "optimizer.lr=2e-3"]).output().unwrap());
    assert!(
        line.contains("config field `optimizer.lr` changed: 0.001 then, 0.002 now; pass --allow-change optimizer.lr"),
        "{line}"
    );
    assert!(snapshot(&exp) == before, "a refused resume changed the experiment");
    ok(resume(&exp, &["--steps", "6", "--set", "optimizer.lr=2e-3", "--allow-change", "optimizer.lr"])
        .output()
        .unwrap());
    assert_eq!(steps(), [1, 2, 3, 4, 5, 6]);
    let fields: Vec<String> =
        changes().as_array().unwrap().iter().map(|c| c["field"].as_str().unwrap().to_string()).collect();
    assert_eq!(fields, ["train.steps", "train.steps", "optimizer.lr", "train.steps"]);
    assert!(recorded().contains("lr = 0.002") && recorded().contains("steps = 6"), "{}", recorded());
}

/// A run on the synthetic target (a plugin: seconds to start, milliseconds a step) for the
/// data-parallel tests, written to `dir/dp.toml`.
fn dp_config(dir: &Path, steps: u64) -> PathBuf {
    let text = common::tiny_config(
        &format!("name = \"dp\"\nseed = 1\n[train]\nsteps = {steps}\nanchors_per_seq = 8\nlog_every = 1\nhidden_cache_mb = 0"),
        "plugin = \"adamw\"\nlr = 3e-3",
    )
    .replace(
        "plugin = \"hf\"\npath = \"$DFLASH_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf\"",
        "plugin = \"synthetic\"\nforward_ms = 5",
    )
    .replace("distill_max_new_tokens = 12", "distill = false")
    .replace("mask_token_id = 16", "mask_token_id = 0");
    let path = dir.join("dp.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// `dflash-host --plugin SYNTHETIC train --config dir/dp.toml --exp-dir dir/dp` as `rank` of
/// `world`, as a launcher starts it (stdout and stderr piped).
fn dp_rank(dir: &Path, rank: usize, world: usize, port: u16, extra: &[&str]) -> Command {
    let so = common::build_plugin("tests/plugins/synthetic_target", "synthetic_target", &[], "synthetic_target");
    let mut cmd = host();
    cmd.arg("--plugin")
        .arg(so)
        .args(["train", "--config", "dp.toml", "--exp-dir", "dp"])
        .args(extra)
        .current_dir(dir)
        .envs([("RANK", rank.to_string()), ("WORLD_SIZE", world.to_string()), ("MASTER_PORT", port.to_string())])
        .env("MASTER_ADDR", "127.0.0.1")
        .env("DFLASH_DIST_TIMEOUT", "60")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    cmd
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The `error:` line of a rank's stderr (after its `[rankN]: ` tag).
fn rank_error(out: &Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    err.lines().find(|l| l.contains("error: ")).unwrap_or_else(|| panic!("no error line in:\n{err}")).to_string()
}

/// Two processes claiming rank 1 of a world of 2: the second is refused at once, naming the
/// first, and the run goes on with the first. With several ranks every log line carries its
/// rank, rank 1 logs warnings only, and rank 0 alone prints the summary.
#[test]
fn a_rank_claimed_twice_is_refused_at_once_and_the_run_goes_on() {
    common::require_model();
    let dir = tempfile::tempdir().unwrap();
    dp_config(dir.path(), 40);
    let port = free_port();
    let zero = dp_rank(dir.path(), 0, 2, port, &[]).spawn().unwrap();
    let ones =
        [dp_rank(dir.path(), 1, 2, port, &[]).spawn().unwrap(), dp_rank(dir.path(), 1, 2, port, &[]).spawn().unwrap()];
    let pids: Vec<u32> = ones.iter().map(|c| c.id()).collect();
    let started = Instant::now();
    let outs: Vec<Output> = ones.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    let zero = zero.wait_with_output().unwrap();
    assert!(started.elapsed() < Duration::from_secs(240), "{:?}", started.elapsed());
    let refused: Vec<usize> = (0..2).filter(|&i| !outs[i].status.success()).collect();
    assert_eq!(
        refused.len(),
        1,
        "exactly one claim of rank 1 is refused: {:?}",
        outs.iter().map(|o| o.status).collect::<Vec<_>>()
    );
    let (lost, won) = (refused[0], 1 - refused[0]);
    let line = rank_error(&outs[lost]);
    assert!(
        line.starts_with("[rank1]: error: rank 1 is taken: ")
            && line.contains(&format!("pid {} on ", pids[won]))
            && line.contains("every process needs its own RANK"),
        "{line}"
    );
    // The run: rank 0 logs (tagged) and prints the summary; rank 1 only warns, prints nothing.
    let (err0, err1) = (String::from_utf8_lossy(&zero.stderr), String::from_utf8_lossy(&outs[won].stderr));
    assert!(zero.status.success(), "{err0}");
    // (libtorch's own C++ warnings, if any, go to stderr untagged.)
    let ours = |err: &str, tag: &str| {
        err.lines()
            .filter(|l| l.contains(" INFO ") || l.contains(" WARN ") || l.contains("error:"))
            .all(|l| l.starts_with(tag))
    };
    assert!(ours(&err0, "[rank0]: ") && err0.contains(" INFO "), "{err0}");
    assert!(ours(&err1, "[rank1]: ") && !err1.contains(" INFO "), "{err1}");
    assert!(String::from_utf8_lossy(&zero.stdout).contains("experiment "), "rank 0 prints the summary");
    assert!(outs[won].stdout.is_empty(), "rank 1 printed: {}", String::from_utf8_lossy(&outs[won].stdout));
    assert!(dir.path().join("dp/summary.json").exists());
}

/// Each rendezvous failure is one line within the timeout: a MASTER_PORT held by a program that
/// accepts connections and never answers, and a rank whose config differs (named by field).
#[test]
fn a_silent_master_port_and_a_differing_config_are_one_line_each_within_the_timeout() {
    common::require_model();
    let dir = tempfile::tempdir().unwrap();
    dp_config(dir.path(), 4);
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let held = std::thread::spawn(move || silent.incoming().take(1).collect::<Vec<_>>());
    let started = Instant::now();
    let out = dp_rank(dir.path(), 1, 2, port, &[]).env("DFLASH_DIST_TIMEOUT", "3").output().unwrap();
    let line = rank_error(&out);
    assert!(line.contains(&format!("127.0.0.1:{port}")) && line.contains("did not answer"), "{line}");
    assert!(started.elapsed() < Duration::from_secs(60), "{:?}", started.elapsed());
    drop(held);

    let port = free_port();
    let zero = dp_rank(dir.path(), 0, 2, port, &[]).spawn().unwrap();
    let one = dp_rank(dir.path(), 1, 2, port, &["--set", "optimizer.lr=0.01"]).spawn().unwrap();
    for (rank, out) in [one.wait_with_output().unwrap(), zero.wait_with_output().unwrap()].iter().enumerate() {
        let line = rank_error(out);
        assert!(
            line.ends_with("error: rank 1 differs from rank 0 in its config: optimizer.lr = 0.01 vs 0.003 on rank 0; every rank must run the same build with the same config"),
            "{rank}: {line}"
        );
    }
}

/// An experiment made without training, as `train` lays one out: config.toml, a manifest, and
/// checkpoints step-1 and step-2 of a tiny DFlash drafter (z-lab config.json and weights) for the
/// tiny test target. Seconds faster than a run, for the commands that only read checkpoints.
fn made_experiment(dir: &Path) {
    use plugin_api::tch::{Device, Kind};
    use test_support::TinySpec;
    let section: drafter_dflash::DrafterSection =
        plugin_api::parse_section("num_hidden_layers = 1\nblock_size = 4\nnum_target_features = 3\nmask_token_id = 63")
            .unwrap();
    let cfg = section.resolve(&plugin_api::TargetSpec::tiny()).unwrap();
    let d = plugin_api::author::Contained::new(drafter_dflash::DFlashPlugin::new(&cfg, Device::Cpu, Kind::Float));
    let manifest = serde_json::json!({
        "host_version": "test", "git_revision": "test", "command_line": [], "started_at_unix": 0, "seed": 1,
        "device": "cpu", "dtype": "f32", "build_id": "test", "plugins": [],
        "target_source": "/nowhere/models--Org--Tiny-Model/snapshots/abc", "target_sha256": "00", "config_dir": "/nowhere",
    });
    let exp = dflash_host::experiment::Experiment::create(dir, "name = \"made\"\n", &manifest).unwrap();
    for step in [1, 2] {
        exp.save_checkpoint(
            step,
            &plugin_api::Drafter::parameters(&d).unwrap(),
            plugin_api::Drafter::config_json(&d).unwrap().as_str(),
            &[],
            &serde_json::json!({"step": step}),
            2,
        )
        .unwrap();
    }
}

fn export_cmd(exp: &Path, out: &Path, extra: &[&str]) -> Command {
    let mut cmd = host();
    cmd.args(["export", "--exp-dir"]).arg(exp).arg("--out").arg(out).args(extra);
    cmd
}

/// `export --out` holding the experiment (its parent folder, with `--force`) once deleted it and
/// everything beside it; `compare --out EXP` wrote into an experiment. Every command that writes
/// an output refuses one that is an experiment, lies inside one or holds one, before any work,
/// `--force` or not, and leaves every file as it was.
#[test]
fn no_command_writes_into_or_deletes_a_folder_that_holds_an_experiment() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (run1, run2) = (root.join("experiments/run1"), root.join("experiments/run2"));
    made_experiment(&run1);
    made_experiment(&run2);
    std::fs::write(root.join("experiments/notes.txt"), "mine").unwrap();
    std::os::unix::fs::symlink(&run2, root.join("link")).unwrap();
    let before = snapshot(root);
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec!["--out".into(), root.join("experiments").display().to_string(), "--force".into()],
            "holds an experiment folder",
        ),
        (vec!["--out".into(), root.display().to_string(), "--force".into()], "holds an experiment folder"),
        (vec!["--out".into(), run2.display().to_string(), "--force".into()], "is an experiment folder"),
        (vec!["--out".into(), run1.join("zlab").display().to_string()], "lies inside an experiment folder"),
        (
            vec!["--out".into(), root.join("experiments/run1/../run2").display().to_string(), "--force".into()],
            "is an experiment folder",
        ),
        (vec!["--out".into(), root.join("link").display().to_string(), "--force".into()], "is an experiment folder"),
    ];
    for (args, why) in cases {
        let mut cmd = host();
        cmd.args(["export", "--exp-dir"]).arg(&run1).args(&args);
        let line = refused(cmd.output().unwrap());
        assert!(line.contains(why) && line.contains("--out"), "export {args:?}: {line}");
    }
    // The other commands with an output, each refused before it reads its config or trains.
    let missing = root.join("absent.toml").display().to_string();
    let s = |p: &Path| p.display().to_string();
    let commands: Vec<Vec<String>> = vec![
        vec!["compare".into(), s(&run1), s(&run2), "--out".into(), s(&run2)],
        vec!["compare".into(), s(&run1), "--out".into(), s(&root.join("experiments"))],
        vec![
            "capture".into(),
            "--config".into(),
            s(&common::root().join("configs/tiny.toml")),
            "--out".into(),
            s(&run1.join("features")),
        ],
        vec![
            "distill".into(),
            "--config".into(),
            s(&common::root().join("configs/tiny.toml")),
            "--out".into(),
            s(&run1.join("metrics.jsonl")),
        ],
        vec!["ab".into(), "--config".into(), missing, "--out".into(), s(&run1)],
        vec![
            "plugins".into(),
            "new".into(),
            "mine".into(),
            "--kind".into(),
            "optimizer".into(),
            "--out".into(),
            s(&run1.join("mine")),
        ],
        vec!["bench".into(), "attention".into(), "--json".into(), s(&run1.join("bench.json"))],
    ];
    for args in commands {
        let line = refused(host().args(&args).output().unwrap());
        assert!(line.contains("experiment"), "{args:?}: {line}");
    }
    assert!(snapshot(root) == before, "a refused command changed a file");
    // Beside the experiments, export works (and a second one replaces the first with --force).
    let zlab = root.join("zlab");
    for extra in [&[][..], &["--force"]] {
        let out = export_cmd(&run1, &zlab, extra).output().unwrap();
        let printed = String::from_utf8_lossy(&out.stdout).to_string();
        ok(out);
        // It prints the lines that serve the export from where it is, with the hub name of the
        // target (its folder lay in a hub cache), for a target whose layout is unknown here.
        let at = zlab.canonicalize().unwrap().display().to_string();
        for want in [
            format!("--speculative-draft-model-path {at}"),
            "--model-path Org/Tiny-Model".into(),
            format!("vllm serve Org/Tiny-Model \\\n  --speculative-config '{{\"method\": \"dflash\", \"model\": \"{at}\", \"num_speculative_tokens\": 3}}'"),
            "--attention-backend flash_attn".into(),
            "--mamba-scheduler-strategy extra_buffer".into(),
        ] {
            assert!(printed.contains(&want), "{want:?} not in:\n{printed}");
        }
        assert!(!printed.contains("```"), "{printed}");
    }
    assert_eq!(names(&zlab), ["README.md", "config.json", "dflash.py", "model.safetensors"]);
    assert_eq!(names(root), ["experiments", "link", "zlab"]);
}

/// A kill -9 between the two renames an export once made to replace `--out` left it missing (the
/// old export in `.out.replaced-PID`, the new one in `.out.export-PID`). The swap is now one
/// rename; where a file system cannot swap, what such a kill leaves is put back by the next
/// export to the same `--out`.
#[test]
fn what_a_killed_export_leaves_is_put_back_by_the_next() {
    let dir = tempfile::tempdir().unwrap();
    let exp = dir.path().join("exp");
    made_experiment(&exp);
    let zlab = dir.path().join("zlab");
    ok(export_cmd(&exp, &zlab, &["--checkpoint", "1"]).output().unwrap());
    let old = std::fs::read(zlab.join("README.md")).unwrap();
    std::fs::rename(&zlab, dir.path().join(".zlab.replaced-2147483646")).unwrap();
    std::fs::create_dir(dir.path().join(".zlab.export-2147483646")).unwrap();
    std::fs::write(dir.path().join(".zlab.export-2147483646/config.json"), "{").unwrap();
    // Without --force the export put back is kept, whole.
    let err = String::from_utf8_lossy(&export_cmd(&exp, &zlab, &[]).output().unwrap().stderr).to_string();
    assert!(err.contains("put back the export") && err.contains("exists and is not empty"), "{err}");
    assert_eq!(std::fs::read(zlab.join("README.md")).unwrap(), old);
    assert_eq!(names(dir.path()), ["exp", "zlab"]);
    ok(export_cmd(&exp, &zlab, &["--force"]).output().unwrap());
    assert!(String::from_utf8_lossy(&std::fs::read(zlab.join("README.md")).unwrap()).contains("step 2 of"));
    assert_eq!(names(dir.path()), ["exp", "zlab"]);
}

/// Rewrite `file`'s safetensors header text with `edit` (the data untouched) and record the file's new
/// CRC-32C in the checkpoint's checksums.json, as a careful tamperer would.
fn tamper(ckpt: &Path, file: &str, edit: impl Fn(String) -> String) {
    let path = ckpt.join(file);
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = edit(String::from_utf8(bytes[8..8 + n].to_vec()).unwrap());
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(&path, &out).unwrap();
    recompute_checksum(ckpt, file);
}

fn recompute_checksum(ckpt: &Path, file: &str) {
    let crc = crc32c::crc32c(&std::fs::read(ckpt.join(file)).unwrap());
    let sums = ckpt.join("checksums.json");
    let mut s: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&sums).unwrap()).unwrap();
    s[file] = format!("{crc:08x}").into();
    std::fs::write(&sums, s.to_string()).unwrap();
}

/// Checkpoints whose checksums were recomputed after tampering were accepted: F32 weights
/// relabelled I32 by eval, export and resume; a transposed `fc.weight`, a config.json with sizes
/// of 2^40, NaN weights and a tensor name given twice by export. Each is refused now, in one line
/// naming the file, the tensor and what was expected; a resume passes over it, saying so.
#[test]
fn a_tampered_checkpoint_with_recomputed_checksums_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let exp = dir.path().join("exp");
    let ckpt = exp.join("checkpoints/step-2");
    let zlab = dir.path().join("zlab");
    let pristine = dir.path().join("pristine");
    made_experiment(&exp);
    std::fs::create_dir(&pristine).unwrap();
    for f in std::fs::read_dir(&ckpt).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), pristine.join(f.file_name())).unwrap();
    }
    let restore = || {
        for f in std::fs::read_dir(&pristine).unwrap() {
            let f = f.unwrap();
            std::fs::copy(f.path(), ckpt.join(f.file_name())).unwrap();
        }
    };
    let model = ckpt.join("model.safetensors").display().to_string();
    let header = |h: &str| serde_json::from_str::<serde_json::Value>(h).unwrap();
    let relabel = |h: String| {
        let mut v = header(&h);
        v["fc.weight"]["dtype"] = "I32".into(); // 4 bytes an element, as F32: the offsets still fit
        v.to_string()
    };
    let transpose = |h: String| {
        let mut v = header(&h);
        let shape = v["fc.weight"]["shape"].as_array().unwrap().clone();
        v["fc.weight"]["shape"] = serde_json::json!([shape[1], shape[0]]);
        v.to_string()
    };
    let twice = |h: String| {
        // `fc.weight` named again at the end: a JSON parser keeps one of the two silently.
        let v = header(&h);
        let text = v.to_string();
        format!("{},\"fc.weight\":{}}}", &text[..text.len() - 1], v["fc.weight"])
    };
    type Case<'a> = (&'a str, Box<dyn Fn() + 'a>, Vec<String>);
    let cases: Vec<Case> = vec![
        (
            "F32 relabelled I32",
            Box::new(|| tamper(&ckpt, "model.safetensors", relabel)),
            vec![model.clone(), "tensor `fc.weight` is I32; a drafter's weights are floating-point".into()],
        ),
        (
            "fc.weight transposed",
            Box::new(|| tamper(&ckpt, "model.safetensors", transpose)),
            vec![model.clone(), "tensor `fc.weight` has shape [96, 32], the drafter declares [32, 96]".into()],
        ),
        (
            "a name twice",
            Box::new(|| tamper(&ckpt, "model.safetensors", twice)),
            vec![model.clone(), "tensor name `fc.weight` appears twice".into()],
        ),
        (
            "NaN weights",
            Box::new(|| {
                let path = ckpt.join("model.safetensors");
                let mut bytes = std::fs::read(&path).unwrap();
                let n = bytes.len();
                bytes[n - 4..].copy_from_slice(&f32::NAN.to_le_bytes());
                std::fs::write(&path, bytes).unwrap();
                recompute_checksum(&ckpt, "model.safetensors");
            }),
            vec![model.clone(), "non-finite values".into()],
        ),
        (
            "sizes of 2^40",
            Box::new(|| {
                let path = ckpt.join("config.json");
                let text = std::fs::read_to_string(&path)
                    .unwrap()
                    .replace("\"hidden_size\": 32", "\"hidden_size\": 1099511627776");
                std::fs::write(&path, text).unwrap();
                recompute_checksum(&ckpt, "config.json");
            }),
            vec![
                ckpt.join("config.json").display().to_string(),
                "field `hidden_size`: 1099511627776: must be in 1..=1048576".into(),
            ],
        ),
    ];
    for (what, make, want) in cases {
        restore();
        make();
        let line = refused(export_cmd(&exp, &zlab, &["--checkpoint", "2"]).output().unwrap());
        for w in &want {
            assert!(line.contains(w.as_str()), "{what}: export: {w:?} not in {line}");
        }
        assert!(!zlab.exists(), "{what}: exported");
    }
    // eval reads checkpoints through the same finder: the relabelled one is refused before any
    // model loads, and the newest that reads is used when none is named.
    restore();
    tamper(&ckpt, "model.safetensors", relabel);
    let mut eval = host();
    eval.args(["eval", "--checkpoint", "2", "--exp-dir"]).arg(&exp);
    let line = refused(eval.output().unwrap());
    assert!(line.contains("checkpoint step-2 is not usable") && line.contains("is I32"), "{line}");
    let err = ok(export_cmd(&exp, &zlab, &[]).output().unwrap());
    assert!(err.contains("skipping checkpoint step-2") && err.contains("is I32"), "{err}");
    assert!(String::from_utf8_lossy(&std::fs::read(zlab.join("README.md")).unwrap()).contains("step 1 of"));
}

/// With `checkpoint_every = 1, keep_checkpoints = 1` training removes each checkpoint a step
/// after writing it: eval failed 3 of 3 and export 1 of 8 with "no such file" when the one they
/// chose went between their check and their read (eval loads the target in between). They open
/// its files once and read from those handles now, and take the newest again if it goes before
/// they are open, so neither fails for it.
#[test]
fn eval_and_export_while_training_prunes_every_step_never_fail() {
    common::require_model();
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("run.toml");
    let text = config().replace("keep_checkpoints = 3", "keep_checkpoints = 1").replace("steps = 30", "steps = 2000");
    std::fs::write(&cfg, text).unwrap();
    let exp = dir.path().join("exp");
    let mut train =
        fresh(&cfg, &exp, &[]).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(300);
    while dflash_host::experiment::checkpoint::list(&exp).is_empty() {
        assert!(Instant::now() < deadline, "training wrote no checkpoint");
        assert!(train.try_wait().unwrap().is_none(), "training stopped");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut eval = host();
    eval.args(["eval", "--limit", "1", "--max-new-tokens", "4", "--exp-dir"]).arg(&exp);
    let eval = eval.output().unwrap();
    let zlab = dir.path().join("zlab");
    let exports: Vec<Output> = (0..8).map(|_| export_cmd(&exp, &zlab, &["--force"]).output().unwrap()).collect();
    let still_training = train.try_wait().unwrap().is_none();
    train.kill().unwrap();
    train.wait().unwrap();
    assert!(still_training, "training ended before the readers did: nothing was pruned under them");
    ok(eval);
    for out in exports {
        ok(out);
    }
    assert_eq!(names(&zlab), ["README.md", "config.json", "dflash.py", "model.safetensors"]);
}

/// `dflash-host ARGS` in `dir`: its exit code and stderr, refused with one error line (exit 2,
/// no panic) and the peak memory it was seen holding (MiB, sampled).
fn refused_in(dir: &Path, args: &[&str]) -> (String, u64) {
    let mut child = host()
        .args(args)
        .current_dir(dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let status = format!("/proc/{}/status", child.id());
    let (mut peak, started) = (0u64, Instant::now());
    let status_code = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        let rss = std::fs::read_to_string(&status).ok().and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmRSS:"))?.to_string();
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        });
        peak = peak.max(rss.unwrap_or(0) >> 10);
        if peak > 3 << 10 || started.elapsed() > Duration::from_secs(600) {
            child.kill().unwrap();
            panic!("{args:?}: {peak} MiB after {:?}", started.elapsed());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert_eq!(status_code.code(), Some(2), "{args:?}: {err}");
    assert!(!err.contains("panicked") && err.contains("error: "), "{args:?}: {err}");
    (err, peak)
}

/// What a hostile tester feeds the binary is refused with one line, in seconds and small memory:
/// `--nproc 0` (or an absurd count) for every command that starts ranks, `report --plan --gpus
/// 1000000000`, a metrics line past the 1 MiB cap every reader uses, and a chat template that
/// doubles a list in a loop (its lazy concatenation is made whole uncharged by minijinja's fuel:
/// the memory limit stops it, naming the template and the limit).
#[test]
fn absurd_counts_long_lines_and_a_growing_template_are_refused_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for command in [&["train", "--config", "c.toml"][..], &["fork", "exp"], &["eval", "--exp-dir", "exp"]]
        .into_iter()
        .chain([
            &["distill", "--config", "c.toml", "--out", "o.jsonl"][..],
            &["capture", "--config", "c.toml", "--out", "o"],
        ])
        .chain([&["bench", "train", "--config", "c.toml"][..]])
    {
        for (n, want) in [("0", "0 ranks: from 1 to 1024"), ("1000000", "1000000 ranks: from 1 to 1024")] {
            let args = [command, &["--nproc", n]].concat();
            let (err, _) = refused_in(d, &args);
            assert!(err.starts_with("error: invalid value") && err.contains(want), "{args:?}: {err}");
        }
    }

    let bench = d.join("bench.json");
    std::fs::write(
        &bench,
        r#"{"target_features": {"step_s": 0.3}, "drafter_step": {"step_s": 0.1}, "pipeline": {"step_s": 0.4}, "batch_size": 2, "seq_len": 96}"#,
    )
    .unwrap();
    let (err, peak) = refused_in(d, &["report", "--plan", "bench.json", "--gpus", "1000000000"]);
    assert!(err.contains("--gpus 1000000000: at most 4096"), "{err}");
    assert!(peak < 200, "{peak} MiB");
    let out = host().args(["report", "--plan", "bench.json", "--gpus", "4096"]).current_dir(d).output().unwrap();
    assert!(out.status.success() && out.stdout.split(|b| *b == b'\n').count() > 4096);

    let exp = d.join("exp");
    std::fs::create_dir_all(&exp).unwrap();
    std::fs::write(exp.join("config.toml"), "[train]\nsteps = 10\n").unwrap();
    let step = r#"{"step": 1, "target_s": 0.1, "drafter_s": 0.1, "optim_s": 0.0, "wait_s": 0.0, "q_hs": 1.0}"#;
    std::fs::write(exp.join("metrics.jsonl"), format!("{step}\n{{\"pad\": \"{}\"}}\n", "x".repeat(2 << 20))).unwrap();
    let (err, _) = refused_in(d, &["report", "exp"]);
    assert!(err.contains("metrics.jsonl:2: line longer than 1048576 bytes"), "{err}");

    common::require_model();
    let doubling = "{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l | length }}";
    std::fs::write(d.join("doubling.jinja"), doubling).unwrap();
    std::fs::write(
        d.join("run.toml"),
        config().replace("format = \"chitchat\"", "format = \"chitchat\"\nchat_template = \"doubling.jinja\""),
    )
    .unwrap();
    let (err, peak) = refused_in(d, &["train", "--config", "run.toml", "--exp-dir", "t"]);
    assert!(
        err.contains("doubling.jinja") && err.contains("its rendering passed its memory limit of 1024 MiB"),
        "{err}"
    );
    assert!(peak < 5 << 9, "{peak} MiB"); // the target (~0.6 GiB) and the limit (1 GiB)
    assert!(!d.join("t").exists());
}
