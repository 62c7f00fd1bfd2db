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
    // The summary's wall time (compare's `wall total`) counts every process: the parent's up to
    // the fork, the stopped one and the resumed one, so never less than the training time the
    // metrics count over them (the last process alone trained 3 of the 12 steps).
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(exp.join("summary.json")).unwrap()).unwrap();
    let elapsed = common::metrics(&exp, &["elapsed_s"]).last().unwrap()["elapsed_s"].as_f64().unwrap();
    assert!(summary["wall_s"].as_f64().unwrap() >= elapsed, "{summary} vs elapsed_s {elapsed}");
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

/// The optimizer switched from the command line both ways, as a user types it: AdamW to Muon with
/// a table, then that Muon run back to AdamW, whose Muon fields are dropped (not refused as
/// unknown); each fork prints the effective section, saying which values were kept, set or
/// defaulted, and the learning rate carries over.
#[test]
fn a_fork_switches_the_optimizer_both_ways_printing_the_effective_section() {
    let parent = parent();
    let dir = tempfile::tempdir().unwrap();
    let muon = dir.path().join("muon");
    let stop = (AT + 1).to_string();
    let table = "optimizer={plugin=\"muon\", momentum=0.9}";
    let out = ok(fork(parent, &muon, &["--set", table, "--stop-at", &stop]));
    let section = |out: &str| -> Vec<String> {
        let from = out.find("[optimizer] switched from").unwrap_or_else(|| panic!("no effective section:\n{out}"));
        out[from..].lines().skip(1).take_while(|l| l.starts_with("  ")).map(|l| l.trim().to_string()).collect()
    };
    let rows = section(&out);
    let row = |rows: &[String], field: &str| -> String {
        rows.iter()
            .find(|r| r.starts_with(&format!("{field} =")))
            .cloned()
            .unwrap_or_else(|| panic!("{field}: {rows:#?}"))
    };
    assert!(out.contains("[optimizer] switched from `adamw` to `muon`; the effective section:"), "{out}");
    assert!(row(&rows, "lr").contains("0.003") && row(&rows, "lr").ends_with("# kept from `adamw`"), "{rows:#?}");
    assert!(row(&rows, "momentum").ends_with(&format!("# set by --set {table}")), "{rows:#?}");
    assert!(row(&rows, "adjust_lr").contains("match_rms_adamw") && row(&rows, "adjust_lr").ends_with("# default"));
    assert!(row(&rows, "weight_decay").contains("0.0"), "{rows:#?}");
    assert!(row(&rows, "adamw.lr").contains("the section's `lr`"), "{rows:#?}");
    let saved = std::fs::read_to_string(muon.join("config.toml")).unwrap();
    let saved: toml::Table = toml::from_str(&saved).unwrap();
    assert_eq!(saved["optimizer"]["plugin"].as_str(), Some("muon"));
    assert_eq!(saved["optimizer"]["momentum"].as_float(), Some(0.9));

    // Back to AdamW: Muon's `momentum` is dropped, the lr kept.
    let back = dir.path().join("back");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dflash-host"));
    cmd.arg("fork").arg(&muon).args(["--at", &stop, "--exp-dir"]).arg(&back);
    cmd.args(["--set", "optimizer.plugin=adamw", "--stop-at", &(AT + 2).to_string()]);
    let out = ok(cmd.env("DFLASH_CACHE", cache()).env_remove("RUST_BACKTRACE").output().unwrap());
    let rows = section(&out);
    assert!(out.contains("[optimizer] switched from `muon` to `adamw`"), "{out}");
    assert!(row(&rows, "lr").contains("0.003") && row(&rows, "lr").ends_with("# kept from `muon`"), "{rows:#?}");
    assert!(row(&rows, "betas").ends_with("# default") && !rows.iter().any(|r| r.starts_with("momentum")));
    let p = &manifest(&back)["parent"];
    assert_eq!((p["optimizer_then"].as_str(), p["optimizer_now"].as_str()), (Some("muon"), Some("adamw")));
    let saved: toml::Table = toml::from_str(&std::fs::read_to_string(back.join("config.toml")).unwrap()).unwrap();
    let want: toml::Table = toml::from_str("plugin = \"adamw\"\nlr = 3e-3").unwrap();
    assert_eq!(saved["optimizer"].as_table(), Some(&want));
    assert_eq!(losses_after(&back, 0).len(), 1);
}

#[test]
fn report_names_the_bound_stage_of_a_real_run() {
    let out = ok(host(&["report"], &[parent()]));
    let done = format!("finished: all {STEPS} steps done");
    for want in [
        "batches/s per worker",
        "bound by",
        "queue q_hs",
        "what if        2x faster drafter step",
        done.as_str(),
        "epochs         ",
    ] {
        assert!(out.contains(want), "no `{want}` in:\n{out}");
    }
    // A finished run has no ETA to give (not "ETA 0 s").
    assert!(!out.contains("ETA"), "{out}");
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

/// `ab` with `[fork]`: every arm forks the parent's checkpoint (the parent untouched), records
/// its parent and arm, switches what its arm says, and the comparison reads the arms after the
/// fork with the parent's curve before it.
#[test]
fn an_ab_of_forks_runs_each_arm_from_the_checkpoint_and_compares_them() {
    let parent = parent();
    let before = hashes(parent);
    let dir = tempfile::tempdir().unwrap();
    let ab = format!(
        "name = \"switch\"\nseeds = [1]\n[fork]\nexp = \"{}\"\nat = {AT}\n[arms.adamw]\n[arms.muon]\n\
         optimizer = {{ plugin = \"muon\", lr = 3e-3 }}\nfork = {{ optimizer_state = \"fresh\", rewarm = 2 }}\n",
        parent.display()
    );
    std::fs::write(dir.path().join("ab.toml"), ab).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_dflash-host"))
        .args(["ab", "--config", "ab.toml"])
        .current_dir(dir.path())
        .env("DFLASH_CACHE", cache())
        .output()
        .unwrap();
    ok(out);
    let root = dir.path().join("experiments/switch");
    for (arm, optimizer) in [("adamw", "adamw"), ("muon", "muon")] {
        let run = root.join(format!("{arm}-s1"));
        let manifest: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(run.join("manifest.json")).unwrap()).unwrap();
        assert_eq!((manifest["arm"].as_str(), manifest["parent"]["step"].as_u64()), (Some(arm), Some(AT)));
        assert_eq!(manifest["parent"]["optimizer_now"].as_str(), Some(optimizer));
        let steps: Vec<u64> = common::metrics(&run, &["step"]).iter().map(|l| l["step"].as_u64().unwrap()).collect();
        assert_eq!(steps.first(), Some(&(AT + 1)), "the fork's own lines continue the parent's count");
    }
    let md = std::fs::read_to_string(root.join("report/report.md")).unwrap();
    assert!(
        md.contains("adamw") && md.contains("muon") && md.contains(&format!("steps up to {AT} are its parent's")),
        "{md}"
    );
    assert_eq!(hashes(parent), before, "the parent is only read");
}

/// A checkpoint's optimizer state by name.
fn optimizer_state(exp: &Path, step: u64) -> BTreeMap<String, tch::Tensor> {
    let path = exp.join(format!("checkpoints/step-{step}/optimizer.safetensors"));
    tch::Tensor::read_safetensors(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())).into_iter().collect()
}

fn equal(a: &tch::Tensor, b: &tch::Tensor) -> bool {
    a.size() == b.size() && a.equal(b)
}

/// `carry` AdamW -> Muon -> AdamW: at each fork the new optimizer's state, as its first
/// checkpoint holds it, is the old one's by role, read from the old checkpoint: Muon's momentum of
/// a matrix is AdamW's `exp_avg`; Muon's AdamW group keeps both moments; back in AdamW, a matrix's
/// `exp_avg` is Muon's momentum and its `exp_avg_sq` is seeded as the square, bias-corrected.
#[test]
fn carry_hands_adamws_first_moment_to_muons_momentum_and_back() {
    let parent = parent();
    let dir = tempfile::tempdir().unwrap();
    let muon = dir.path().join("muon");
    let out = ok(fork(
        parent,
        &muon,
        &["--set", "optimizer.plugin=muon", "--optimizer-state", "carry", "--stop-at", &(AT + 2).to_string()],
    ));
    let (adamw_state, muon_state) = (optimizer_state(parent, AT), optimizer_state(&muon, AT));
    let matrices: Vec<&str> = muon_state.keys().filter_map(|k| k.strip_suffix(".momentum_buffer")).collect::<Vec<_>>();
    let others: Vec<&str> = muon_state.keys().filter_map(|k| k.strip_suffix(".exp_avg_sq")).collect();
    assert!(!matrices.is_empty() && !others.is_empty(), "{:?}", muon_state.keys());
    for p in &matrices {
        assert!(equal(&muon_state[&format!("{p}.momentum_buffer")], &adamw_state[&format!("{p}.exp_avg")]), "{p}");
    }
    for p in &others {
        for slot in ["exp_avg", "exp_avg_sq"] {
            let k = format!("{p}.{slot}");
            assert!(equal(&muon_state[&k], &adamw_state[&k]), "{k}");
        }
    }
    assert_eq!(muon_state["step"].int64_value(&[]), AT as i64);
    let p = &manifest(&muon)["parent"];
    assert_eq!(p["optimizer_state"], "carry");
    let c = &p["carried"];
    let n = (matrices.len() + others.len()) as u64;
    assert_eq!(c["exported_params"], n);
    assert_eq!(c["used"]["first_moment"], n);
    assert_eq!(c["used"]["second_moment"], others.len() as u64);
    assert_eq!(c["ignored"]["second_moment"], matrices.len() as u64, "{c}");
    assert_eq!(c["step"], true);
    assert!(out.contains("carried the optimizer state adamw -> muon: took first_moment of"), "{out}");
    let losses = losses_after(&muon, 0);
    assert_eq!(losses.len(), 2);
    assert!(losses.iter().all(|l| l["loss"].as_f64().unwrap().is_finite()));

    // Back to AdamW from the Muon fork's own checkpoint.
    let at = AT + 2;
    let back = dir.path().join("back");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dflash-host"));
    cmd.arg("fork").arg(&muon).args(["--at", &at.to_string(), "--exp-dir"]).arg(&back);
    cmd.args(["--set", "optimizer.plugin=adamw", "--optimizer-state", "carry", "--stop-at", &(at + 1).to_string()]);
    ok(cmd.env("DFLASH_CACHE", cache()).env_remove("RUST_BACKTRACE").output().unwrap());
    let (muon_state, adamw_state) = (optimizer_state(&muon, at), optimizer_state(&back, at));
    let t = at as i32;
    let seed_scale = (1.0 - 0.999f64.powi(t)) / (1.0 - 0.9f64.powi(t)).powi(2);
    for p in &matrices {
        let m = &muon_state[&format!("{p}.momentum_buffer")];
        assert!(equal(&adamw_state[&format!("{p}.exp_avg")], m), "{p}");
        let v = &adamw_state[&format!("{p}.exp_avg_sq")];
        assert!(v.allclose(&(m.square() * seed_scale), 1e-6, 0.0, false), "{p}: exp_avg_sq not seeded as m^2");
    }
    for p in &others {
        for slot in ["exp_avg", "exp_avg_sq"] {
            let k = format!("{p}.{slot}");
            assert!(equal(&adamw_state[&k], &muon_state[&k]), "{k}");
        }
    }
    let c = &manifest(&back)["parent"]["carried"];
    assert_eq!(c["used"]["first_moment"], n);
    assert_eq!(c["notes"][0], format!("second_moment seeded from first_moment for {} parameters", matrices.len()));
}

/// Carrying AdamW's state into AdamW continues exactly as keeping it does.
#[test]
fn carry_into_the_same_optimizer_continues_exactly_as_keep() {
    let parent = parent();
    let dir = tempfile::tempdir().unwrap();
    let exp = dir.path().join("carry");
    ok(fork(parent, &exp, &["--optimizer-state", "carry"]));
    assert_eq!(losses_after(&exp, 0), losses_after(parent, AT));
    assert_eq!(weights(&exp, STEPS), weights(parent, STEPS));
    let c = &manifest(&exp)["parent"]["carried"];
    assert!(c["ignored"].as_object().unwrap().is_empty() && c["notes"].as_array().unwrap().is_empty(), "{c}");
}

/// An optimizer that cannot take state by role (one built against plugin ABI 2.0, or one that does
/// not import) refuses `carry`, naming the field, before the fork's folder exists.
#[test]
fn an_optimizer_that_cannot_carry_is_refused_naming_the_field() {
    let parent = parent();
    let dir = tempfile::tempdir().unwrap();
    let exp = dir.path().join("fork");
    let older = common::build_plugin("tests/plugins/faulty", "faulty", &["test-older-minor"], "faulty-older-minor");
    let current = common::build_plugin("tests/plugins/faulty", "faulty", &[], "faulty");
    for (so, want) in [(&older, "built against plugin ABI 2.0.0"), (&current, "does not import its state by role")] {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_dflash-host"));
        cmd.arg("--plugin").arg(so).arg("fork").arg(parent).args(["--at", &AT.to_string(), "--exp-dir"]).arg(&exp);
        cmd.args(["--set", "optimizer.plugin=faulty", "--optimizer-state", "carry"]);
        let out = cmd.env("DFLASH_CACHE", cache()).env_remove("RUST_BACKTRACE").output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{err}");
        assert!(err.contains("field `fork.optimizer_state`") && err.contains(want), "{want}: {err}");
        assert!(!exp.exists());
    }
}
