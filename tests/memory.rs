//! Out of device memory is a sentence, not a panic: a config the estimate says cannot fit is
//! refused before anything loads, naming its largest parts and what would fit (the device's size
//! given by DFLASH_DEVICE_MEMORY_BYTES, as for what-if planning); `--no-memory-check` runs it
//! anyway; a CUDA out-of-memory error at run time is one paragraph with the same advice, the
//! last step's weights checkpointed, exit code 2.

mod common;
use common::{build_plugin, cache, root};
use std::process::{Command, Output};

fn host() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dflash-host"));
    cmd.env("DFLASH_CACHE", cache()).env_remove("RUST_BACKTRACE");
    cmd
}

/// The one error line of a run that stopped with exit code 2, no panic printed.
fn error_line(out: &Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "expected exit code 2, got {:?}:\n{err}", out.status.code());
    assert!(!err.contains("panicked at") && !err.contains("frame #"), "a panic escaped:\n{err}");
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "{err}");
    errors[0].to_string()
}

fn bench_tiny(extra: &[&str], device_bytes: &str) -> Output {
    host()
        .args(["bench", "train", "--config"])
        .arg(root().join("configs/bench/tiny.toml"))
        .args(extra)
        .env("DFLASH_DEVICE_MEMORY_BYTES", device_bytes)
        .output()
        .unwrap()
}

/// configs/bench/tiny.toml at 1024 sequences (f32): 0.752 GiB fixed (the CUDA context's 0.75
/// and 1.6 MB of weights, gradients and AdamW state), 549,888 bytes a sequence, on a 1 GiB
/// device: 485 sequences fit. Refused before anything is built, in one line.
#[test]
fn bench_train_refuses_what_cannot_fit_and_names_what_would() {
    let out = bench_tiny(&["--set", "bench.batch_size=1024"], "1GiB");
    let line = error_line(&out);
    assert!(
        line.starts_with(
            "error: not enough device memory: this config needs about 1.3 GiB on cpu, which has 1.0 GiB (batch 1024 \
             x 64 tokens, 8 anchors a sequence): CUDA context and workspaces 0.8 GiB, drafter activations (blocks) \
             0.3 GiB, target forward (working set) 0.1 GiB, "
        ),
        "{line}"
    );
    assert!(line.contains("What would fit: a micro-batch of 485 sequences (now 1024)."), "{line}");
    assert!(line.ends_with("To run it anyway: --no-memory-check."), "{line}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("matmul ceiling"), "the bench ran");

    // Run anyway: the bench reports the estimate by part (measured only on CUDA).
    let out = bench_tiny(&["--no-memory-check"], "0.5GiB");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--no-memory-check: running it anyway"));
    for row in ["estimate GiB", "target weights", "drafter step (peak over those)", "total, phases one at a time"] {
        assert!(text.contains(row), "{row} not in:\n{text}");
    }
}

/// `train` refuses before the target loads: nothing trained, nothing written but the refusal.
#[test]
fn train_refuses_before_anything_loads() {
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        r#"name = "oom"
[train]
steps = 2
anchors_per_seq = 8

[target]
plugin = "hf"
path = "{}"
random_init = true

[drafter]
plugin = "dflash"
num_hidden_layers = 1
block_size = 4
num_target_features = 2
mask_token_id = 5

[optimizer]
plugin = "adamw"

[data]
plugin = "chat"
path = "$DFLASH_CACHE/chitchat.json"
format = "chitchat"
batch_size = 2
max_len = 96
max_records = 6
"#,
        root().join("configs/bench/tiny-config.json").display()
    );
    std::fs::write(dir.path().join("run.toml"), config).unwrap();
    let out = host()
        .args(["train", "--config"])
        .arg(dir.path().join("run.toml"))
        .arg("--exp-dir")
        .arg(dir.path().join("exp"))
        .env("DFLASH_DEVICE_MEMORY_BYTES", "512MiB")
        .output()
        .unwrap();
    let line = error_line(&out);
    let want = "not enough device memory: this config needs about 1.8 GiB on cpu, which has 0.5 GiB (batch 2 x 96 \
                tokens, 8 anchors a sequence): hidden-state buffer 1.0 GiB, CUDA context and workspaces 0.8 GiB, ";
    assert!(line.contains(want), "{line}");
    assert!(line.contains("Nothing of the batch, anchors"), "{line}");
    assert!(!dir.path().join("exp/checkpoints").exists());
}

const HEAD: &str = r#"
name = "oom"
seed = 5
[train]
steps = 6
anchors_per_seq = 8
checkpoint_every = 2
"#;

/// libtorch's out-of-memory error in the drafter's 4th forward, as its error: one paragraph (its
/// first sentences and what would fit), step 3's weights checkpointed beside step 2's, exit code
/// 2. As a panic, the plugin answers no more calls: the paragraph names the last checkpoint.
#[test]
fn an_oom_at_run_time_is_one_paragraph_and_the_last_step_is_checkpointed() {
    let drafter = build_plugin("tests/plugins/faulty_drafter", "faulty_drafter", &[], "faulty_drafter");
    let oom = "called `Result::unwrap()` on an `Err` value: Torch(\"CUDA out of memory. Tried to allocate 2.00 GiB. \
               GPU 0 has a total capacity of 79.19 GiB of which 1.05 GiB is free. Of the allocated memory 75.20 GiB \
               is allocated by PyTorch.\\nframe #0: c10::Error::Error(c10::SourceLocation, std::string)\\nframe #1: \
               at::native::empty_cuda\")";
    let run = |how: &str| {
        let section = format!("plugin = \"faulty_drafter\"\n{how}\npanic_with = '''{oom}'''");
        let config = common::tiny_config(HEAD, "plugin = \"adamw\"\nlr = 3e-3");
        let start = config.find("[drafter]\n").unwrap();
        let end = start + config[start..].find("\n[optimizer]").unwrap();
        common::train(&[&drafter], &format!("{}[drafter]\n{section}\n{}", &config[..start], &config[end..]))
    };
    let paragraph = "error: out of device memory in drafter plugin `faulty_drafter`: forward: CUDA out of memory. Tried \
                     to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.05 GiB is free. Lower the \
                     micro-batch or `anchors_per_seq`, set `checkpoint_layers = true` in [drafter]";
    let checkpoints = |exp: &std::path::Path| {
        let mut names: Vec<String> = std::fs::read_dir(exp.join("checkpoints"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    };

    let (out, dir) = run("error_at_forward = 4");
    let line = error_line(&out);
    assert!(line.starts_with(paragraph), "{line}");
    let exp = dir.path().join("exp");
    let want = format!(
        "The weights of step 3 are checkpointed in {}: resume with `train --resume {}` at a size that fits.",
        exp.join("checkpoints/step-3").display(),
        exp.display()
    );
    assert!(line.ends_with(&want), "{line}");
    assert_eq!(checkpoints(&exp), ["step-2", "step-3"]);

    let (out, dir) = run("panic_in = \"forward\"\npanic_at_call = 4");
    let line = error_line(&out);
    assert!(line.starts_with(paragraph), "{line}");
    let exp = dir.path().join("exp");
    let want = format!(
        "The weights of step 3 could not be checkpointed (a plugin that panicked answers no more calls); the last \
         checkpoint is {}.",
        exp.join("checkpoints/step-2").display()
    );
    assert!(line.ends_with(&want), "{line}");
    assert_eq!(checkpoints(&exp), ["step-2"]);
}
