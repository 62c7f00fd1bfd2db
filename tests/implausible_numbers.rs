//! Numbers a run cannot have, through the binary as a user meets them: a reply budget that
//! leaves no room for a prompt, a checkpoint claiming a step it is not, metrics and configs with
//! absurd values for `report`. Each is refused in one line naming the file (or the fields), or
//! printed sanely, before any work (docs/RELIABILITY.md).

mod common;

use common::cache;
use std::{
    path::Path,
    process::{Command, Output},
};

fn host() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dflash-host"));
    cmd.env("DFLASH_CACHE", cache()).env_remove("RUST_BACKTRACE");
    cmd
}

/// The `error:` line of a refusal (exit code 2, no panic).
fn refused(out: Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    err.lines().find(|l| l.starts_with("error: ")).unwrap_or_else(|| panic!("no error line:\n{err}")).to_string()
}

fn ok(out: Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{err}");
    err
}

/// With `distill = false` the reply budget still sets the room eval's prompts leave: at
/// `max_len = 64` the default budget of 64 left none (eval then found "no evaluation prompts"
/// without saying why) and at 32 the subtraction wrapped. Both are refused before the target
/// loads, naming both fields, and no experiment folder is made; the same config for `eval`
/// names them too.
#[test]
fn a_reply_budget_that_leaves_no_room_for_a_prompt_names_both_fields() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("run.toml");
    std::fs::write(&cfg, common::tiny_config("name = \"budget\"\n[train]\nsteps = 2", "plugin = \"adamw\"\nlr = 1e-3"))
        .unwrap();
    let exp = dir.path().join("exp");
    for max_len in ["64", "32"] {
        let mut cmd = host();
        cmd.args(["train", "--config"]).arg(&cfg).arg("--exp-dir").arg(&exp).args([
            "--set",
            "data.distill=false",
            "--set",
            &format!("data.max_len={max_len}"),
            "--set",
            "data.distill_max_new_tokens=64",
        ]);
        let line = refused(cmd.output().unwrap());
        for want in [
            "field `distill_max_new_tokens`",
            &format!("got 64 with max_len {max_len}"),
            "with distill = false it still sets the room eval's prompts leave",
        ] {
            assert!(line.contains(want), "max_len {max_len}: {want:?} not in {line}");
        }
        assert!(!exp.exists(), "max_len {max_len}: an experiment folder was made");
    }
}

/// `trainer_state.json` claiming step 2^64-1 in checkpoint step-2 was exported and resumed
/// unchecked. The one finder of checkpoints refuses it, naming the file: `export --checkpoint 2`
/// in one line, a plain export and a resume pass over it to step-1 saying so; a checkpoint
/// beyond the run's `train.steps` likewise.
#[test]
fn a_checkpoint_claiming_a_step_it_is_not_is_refused_naming_the_file() {
    common::require_model();
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("run.toml");
    let head = "name = \"claims\"\nseed = 1\n[train]\nsteps = 2\nanchors_per_seq = 4\nlog_every = 1\ncheckpoint_every = 1\nkeep_checkpoints = 3";
    std::fs::write(&cfg, common::tiny_config(head, "plugin = \"adamw\"\nlr = 1e-3")).unwrap();
    let exp = dir.path().join("exp");
    let mut train = host();
    train.args(["train", "--config"]).arg(&cfg).arg("--exp-dir").arg(&exp);
    ok(train.output().unwrap());
    let ckpts = exp.join("checkpoints");
    let claim = |ckpt: &Path, step: u64| {
        let path = ckpt.join("trainer_state.json");
        let mut state: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        state["step"] = step.into();
        std::fs::write(&path, state.to_string()).unwrap();
        // As a careful tamperer would: the checksum matches the new text.
        let sums_path = ckpt.join("checksums.json");
        let mut sums: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&sums_path).unwrap()).unwrap();
        sums["trainer_state.json"] = format!("{:08x}", crc32c::crc32c(&std::fs::read(&path).unwrap())).into();
        std::fs::write(&sums_path, sums.to_string()).unwrap();
    };
    let export = |extra: &[&str], out: &Path| {
        let mut cmd = host();
        cmd.args(["export", "--exp-dir"]).arg(&exp).arg("--out").arg(out).args(extra);
        cmd.output().unwrap()
    };
    let state_file = ckpts.join("step-2/trainer_state.json").display().to_string();
    claim(&ckpts.join("step-2"), u64::MAX);
    let out = dir.path().join("zlab");
    let line = refused(export(&["--checkpoint", "2"], &out));
    assert!(line.contains(&format!("{state_file}: step 18446744073709551615, but the checkpoint is step-2")), "{line}");
    assert!(!out.exists());
    let err = ok(export(&[], &out));
    assert!(err.contains("skipping checkpoint step-2") && err.contains(&state_file), "{err}");
    let card = std::fs::read_to_string(out.join("README.md")).unwrap();
    assert!(card.contains("step 1 of 2") && !card.contains("18446744073709551615"), "{card}");
    // A resume passes over it (setting it aside) and trains step 2 again from step 1.
    let mut resume = host();
    resume.args(["train", "--resume"]).arg(&exp);
    let err = ok(resume.output().unwrap());
    assert!(err.contains("skipping checkpoint step-2") && err.contains(&state_file), "{err}");
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ckpts.join("step-2/trainer_state.json")).unwrap()).unwrap();
    assert_eq!(state["step"], 2, "the resumed run's own step-2");
    // A checkpoint past the run's train.steps (2), named and claimed alike.
    std::fs::rename(ckpts.join("step-2"), ckpts.join("step-9")).unwrap();
    claim(&ckpts.join("step-9"), 9);
    let out9 = dir.path().join("zlab9");
    let line = refused(export(&["--checkpoint", "9"], &out9));
    let want =
        format!("{}: step 9 is beyond the run's train.steps (2)", ckpts.join("step-9/trainer_state.json").display());
    assert!(line.contains(&want), "{line}");
    assert!(!out9.exists());
}

/// `report` on metrics no run writes: each is refused naming the file, line and field (or the
/// config's field), never printed as "ETA 5124095576030431h", "NaNx" or "step 4 of
/// 18446744073709551615"; a slow but real run reads in days.
#[test]
fn report_refuses_absurd_numbers_and_prints_long_runs_sanely() {
    let dir = tempfile::tempdir().unwrap();
    let exp = dir.path().join("exp");
    std::fs::create_dir(&exp).unwrap();
    let line = |step: u64, drafter_s: &str| {
        format!(
            r#"{{"step": {step}, "loss": 1.0, "target_s": 1.0, "drafter_s": {drafter_s}, "optim_s": 0.5, "wait_s": 0.0, "target_busy": [0.5], "q_hs": 1.0, "q_hs_now": 1}}"#
        )
    };
    let report = |config: &str, metrics: &str| {
        std::fs::write(exp.join("config.toml"), config).unwrap();
        std::fs::write(exp.join("metrics.jsonl"), metrics).unwrap();
        let mut cmd = host();
        cmd.arg("report").arg(&exp);
        cmd.output().unwrap()
    };
    let metrics = exp.join("metrics.jsonl").display().to_string();
    let config = exp.join("config.toml").display().to_string();
    let steps = "[train]\nsteps = 100\n";
    for (cfg, text, want) in [
        (steps, line(10, "1e300"), format!("{metrics}:1: `drafter_s` is 1e300, not in 0..=86400")),
        (steps, line(10, "-2"), format!("{metrics}:1: `drafter_s` is -2, not in 0..=86400")),
        (steps, line(u64::MAX, "1"), format!("{metrics}:1: `step` is 18446744073709551615, beyond any run's steps")),
        (
            steps,
            format!("{}\n{}", line(10, "1"), line(400, "1")),
            format!("{metrics}:2: step 400 is beyond the run's train.steps (100)"),
        ),
        ("[train]\nsteps = -1\n", line(10, "1"), format!("{config}: train.steps is -1, not a count in 1..=")),
        (
            "[train]\nsteps = 100\ngrad_accum = 0\n",
            line(10, "1"),
            format!("{config}: train.grad_accum is 0, not a count"),
        ),
    ] {
        let got = refused(report(cfg, &text));
        assert!(got.contains(&want), "{want:?} not in {got}");
    }
    // 80,000 s a step for 10,000 steps: days, and no NaN or inf anywhere.
    let slow = r#"{"step": 1, "loss": 1.0, "target_s": 80000.0, "drafter_s": 80000.0, "optim_s": 0.0, "wait_s": 0.0, "target_busy": [1.0], "q_hs": 0.0, "q_hs_now": 0}"#;
    let out = report("[train]\nsteps = 10000\n", slow);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("ETA 9258 days to step 10000"), "{text}");
    let absurd = |w: &str| matches!(w.trim_end_matches(['x', ',', ';', ')']), "NaN" | "inf" | "-inf");
    assert!(!text.split_whitespace().any(absurd), "{text}");
}
