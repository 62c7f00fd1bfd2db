//! Every file read inside a model folder is opened once, checked to be a regular file and read
//! with a size cap: a FIFO or a link to `/dev/zero` as any of them makes the command fail at
//! once with an error naming the file, where it used to hang or fill memory
//! (docs/RELIABILITY.md).

mod common;

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

/// A tiny Llama config (no weights needed: each case fails before weights are read, or at them).
const CONFIG: &str = r#"{"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 2, "vocab_size": 32, "eos_token_id": 1}"#;

/// A word-level tokenizer of two tokens.
const TOKENIZER: &str = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,"pre_tokenizer":null,"post_processor":null,"decoder":null,"model":{"type":"WordLevel","vocab":{"<unk>":0,"a":1},"unk_token":"<unk>"}}"#;

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo {}", path.display());
}

/// A model folder in `dir` with `config.json` and `tokenizer.json`, and a run config training on it.
fn model_folder(dir: &Path) -> (PathBuf, PathBuf) {
    let model = dir.join("model");
    std::fs::create_dir(&model).unwrap();
    std::fs::write(model.join("config.json"), CONFIG).unwrap();
    std::fs::write(model.join("tokenizer.json"), TOKENIZER).unwrap();
    std::fs::write(
        dir.join("chat.jsonl"),
        "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"assistant\",\"content\":\"a\"}]}\n",
    )
    .unwrap();
    let run = dir.join("run.toml");
    std::fs::write(
        &run,
        "name = \"t\"\n[train]\nsteps = 1\n\n[target]\nplugin = \"hf\"\npath = \"model\"\n\n[drafter]\nplugin = \"dflash\"\n\
         num_hidden_layers = 1\nblock_size = 4\nnum_target_features = 1\nmask_token_id = 0\n\n\
         [optimizer]\nplugin = \"adamw\"\nlr = 1e-3\n\n[data]\nplugin = \"chat\"\nformat = \"jsonl\"\npath = \"chat.jsonl\"\ndistill = false\n",
    )
    .unwrap();
    (model, run)
}

/// `dflash-host ARGS` must fail within a minute (a hang is killed and reported); its stderr.
fn fails_fast(args: &[&std::ffi::OsStr]) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dflash-host"))
        .args(args)
        .env("DFLASH_CACHE", common::cache())
        .env_remove("RUST_BACKTRACE")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("dflash-host {args:?} hung");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success(), "dflash-host {args:?} succeeded");
    String::from_utf8_lossy(&out.stderr).to_string()
}

fn train(dir: &Path, run: &Path) -> String {
    let exp = dir.join("exp");
    fails_fast(&["train".as_ref(), "--config".as_ref(), run.as_os_str(), "--exp-dir".as_ref(), exp.as_os_str()])
}

/// In a fresh model folder, `name` replaced by a FIFO (or a link to `/dev/zero`) after `prepare`:
/// `train` names it.
fn refused(name: &str, zero: bool, prepare: impl FnOnce(&Path)) {
    let dir = tempfile::tempdir().unwrap();
    let (model, run) = model_folder(dir.path());
    prepare(&model);
    let file = model.join(name);
    let _ = std::fs::remove_file(&file);
    let kind = if zero {
        std::os::unix::fs::symlink("/dev/zero", &file).unwrap();
        "not a regular file (a character device, reached through a link to /dev/zero)"
    } else {
        mkfifo(&file);
        "not a regular file (a FIFO)"
    };
    let err = train(dir.path(), &run);
    let want = format!("{}: {kind}", file.display());
    assert!(err.contains(&want), "{name}: {err}\nshould contain\n{want}");
}

#[test]
fn a_fifo_or_dev_zero_in_a_model_folder_is_named_not_waited_on() {
    refused("config.json", false, |_| {});
    refused("config.json", true, |_| {});
    refused("tokenizer.json", false, |_| {});
    refused("tokenizer.json", true, |_| {});
    refused("tokenizer_config.json", false, |_| {});
    refused("tokenizer_config.json", true, |_| {});
    refused("chat_template.jinja", false, |_| {});
    refused("chat_template.jinja", true, |_| {});
    refused("generation_config.json", false, |m| {
        std::fs::write(m.join("config.json"), CONFIG.replace(", \"eos_token_id\": 1", "")).unwrap()
    });
    refused("model.safetensors.index.json", false, |_| {});
    refused("model.safetensors", false, |_| {});
    refused("model-00001-of-00002.safetensors", true, |m| {
        let index = r#"{"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}"#;
        std::fs::write(m.join("model.safetensors.index.json"), index).unwrap();
    });
}

#[test]
fn a_fifo_as_the_configured_chat_template_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let (_, run) = model_folder(dir.path());
    let fifo = dir.path().join("chat.jinja");
    mkfifo(&fifo);
    let text = std::fs::read_to_string(&run)
        .unwrap()
        .replace("distill = false", "distill = false\nchat_template = \"chat.jinja\"");
    std::fs::write(&run, text).unwrap();
    let err = train(dir.path(), &run);
    let want = format!("{}: not a regular file (a FIFO)", fifo.display());
    assert!(err.contains(&want), "{err}\nshould contain\n{want}");
}

#[test]
fn eval_drafter_and_init_from_with_a_fifo_are_named() {
    // A drafter folder whose config.json is a FIFO: `eval --drafter` and `init_from` both name it.
    let dir = tempfile::tempdir().unwrap();
    let (_, run) = model_folder(dir.path());
    let drafter = dir.path().join("drafter");
    std::fs::create_dir(&drafter).unwrap();
    mkfifo(&drafter.join("config.json"));
    std::fs::write(drafter.join("model.safetensors"), b"").unwrap();
    let want = format!("{}: not a regular file (a FIFO)", drafter.join("config.json").display());
    // An experiment folder (its config.toml) to evaluate in.
    std::fs::copy(&run, dir.path().join("config.toml")).unwrap();
    let exp = dir.path().as_os_str();
    let err = fails_fast(&["eval".as_ref(), "--exp-dir".as_ref(), exp, "--drafter".as_ref(), drafter.as_os_str()]);
    assert!(err.contains(&want), "{err}\nshould contain\n{want}");
    let text = std::fs::read_to_string(&run)
        .unwrap()
        .replace("mask_token_id = 0\n", "mask_token_id = 0\ninit_from = \"drafter\"\n")
        // Random weights for the target (the folder holds none), so the drafter is reached.
        .replace("path = \"model\"\n", "path = \"model\"\nrandom_init = true\n");
    std::fs::write(&run, text).unwrap();
    let err = train(dir.path(), &run);
    assert!(err.contains(&want), "{err}\nshould contain\n{want}");
}

#[test]
fn a_template_that_loops_for_ever_stops_at_its_limit_naming_itself() {
    // Random weights at a tiny shape (no model files), and a template of nested loops that ran
    // for minutes before templates had limits.
    let dir = tempfile::tempdir().unwrap();
    let (model, run) = model_folder(dir.path());
    let template = dir.path().join("loop.jinja");
    std::fs::write(&template, "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}")
        .unwrap();
    let text = std::fs::read_to_string(&run)
        .unwrap()
        .replace("path = \"model\"", &format!("path = \"{}\"\nrandom_init = true", model.join("config.json").display()))
        .replace("distill = false", "distill = false\nchat_template = \"loop.jinja\"");
    std::fs::write(&run, text).unwrap();
    let err = train(dir.path(), &run);
    let want = format!("field `chat_template` ({}): chat template stopped: it used up its fuel", template.display());
    assert!(err.contains(&want), "{err}\nshould contain\n{want}");
}
