//! Helpers shared by the cross-crate tests (each test file includes this with `mod common;`).
#![allow(dead_code)] // not every test file uses every helper

use plugin_api::tch::Tensor;
use std::{collections::HashMap, path::Path, path::PathBuf, process::Command, process::Output};

/// The asset cache `make setup` fills (DFLASH_CACHE, default ~/.cache/dflash).
pub fn cache() -> PathBuf {
    std::env::var_os("DFLASH_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/dflash"))
}

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// The real SmolLM2 GGUF, or a failure that says how to get it.
pub fn require_model() {
    let p = cache().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.exists(), "{} is missing: run `make setup`", p.display());
}

/// `dflash-host [--plugin P]... train --config <config written to a temp dir> --exp-dir <tmp>/exp`,
/// as a user would run it (no RUST_BACKTRACE); the temp dir lives as long as the returned guard.
pub fn train(plugins: &[&Path], config: &str) -> (Output, tempfile::TempDir) {
    require_model();
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("run.toml");
    std::fs::write(&cfg, config).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dflash-host"));
    for p in plugins {
        cmd.arg("--plugin").arg(p);
    }
    let out = cmd
        .args(["train", "--config"])
        .arg(&cfg)
        .arg("--exp-dir")
        .arg(dir.path().join("exp"))
        .env("DFLASH_CACHE", cache())
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    (out, dir)
}

/// A small run on the real target and data, seconds a step: `head` is the top of the file
/// (name, seed, `[train]`), `optimizer` the body of `[optimizer]`.
pub fn tiny_config(head: &str, optimizer: &str) -> String {
    format!(
        r#"{head}
[target]
plugin = "hf"
path = "$DFLASH_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf"

[drafter]
plugin = "dflash"
num_hidden_layers = 1
block_size = 4
num_target_features = 2
mask_token_id = 16

[optimizer]
{optimizer}

[data]
plugin = "chat"
path = "$DFLASH_CACHE/chitchat.json"
format = "chitchat"
batch_size = 2
max_len = 96
max_records = 6
eval_holdout = 3
distill_max_new_tokens = 12
"#
    )
}

/// A PyTorch fixture from tests/fixtures/ (scripts/fixtures/make_fixtures.py): tensors and metadata.
pub struct Fixture {
    tensors: HashMap<String, Tensor>,
    pub meta: HashMap<String, String>,
}

impl Fixture {
    pub fn load(name: &str) -> Self {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures").join(name);
        let tensors = Tensor::read_safetensors(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let bytes = std::fs::read(&path).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        Self { tensors: tensors.into_iter().collect(), meta: meta.metadata().clone().unwrap_or_default() }
    }

    pub fn get(&self, name: &str) -> Tensor {
        self.tensors.get(name).unwrap_or_else(|| panic!("fixture tensor `{name}` missing")).shallow_clone()
    }

    pub fn json(&self, key: &str) -> serde_json::Value {
        serde_json::from_str(&self.meta[key]).unwrap()
    }
}

pub static BUILDS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Build an out-of-tree plugin crate into the workspace's target dir (sharing its compiled
/// dependencies) and copy the library to a name of its own.
pub fn build_plugin(crate_dir: &str, lib: &str, features: &[&str], name: &str) -> PathBuf {
    let _one_at_a_time = BUILDS.lock().unwrap_or_else(|e| e.into_inner());
    let dir = root().join(crate_dir);
    // The workspace's lock file pins the same dependency versions, so nothing is rebuilt.
    std::fs::copy(root().join("Cargo.lock"), dir.join("Cargo.lock")).unwrap();
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.args(["build", "--release", "--quiet", "--manifest-path"])
        .arg(dir.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(root().join("target"));
    if !features.is_empty() {
        cmd.arg("--features").arg(features.iter().map(|f| format!("plugin-api/{f}")).collect::<Vec<_>>().join(","));
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "building {crate_dir}: {}", String::from_utf8_lossy(&out.stderr));
    let dest_dir = root().join("target/test-plugins");
    std::fs::create_dir_all(&dest_dir).unwrap();
    let dest = dest_dir.join(format!("{name}.so"));
    // Copy, then rename over: another test's host may have `dest` mapped, and overwriting that
    // file in place would crash it (SIGBUS); a rename gives it a new inode instead.
    let tmp = dest_dir.join(format!("{name}.so.{}", std::process::id()));
    std::fs::copy(root().join(format!("target/release/lib{lib}.so")), &tmp).unwrap();
    std::fs::rename(&tmp, &dest).unwrap();
    dest
}

/// Compile `tests/plugins/<name>.c` into a shared library (`target/test-plugins/<name>.so`).
pub fn build_c_library(name: &str) -> PathBuf {
    let _one_at_a_time = BUILDS.lock().unwrap_or_else(|e| e.into_inner());
    let dest_dir = root().join("target/test-plugins");
    std::fs::create_dir_all(&dest_dir).unwrap();
    let tmp = dest_dir.join(format!("{name}.so.{}", std::process::id()));
    let out = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&tmp)
        .arg(root().join(format!("tests/plugins/{name}.c")))
        .output()
        .expect("a C compiler (cc) to build a test library");
    assert!(out.status.success(), "cc {name}.c: {}", String::from_utf8_lossy(&out.stderr));
    let dest = dest_dir.join(format!("{name}.so"));
    std::fs::rename(&tmp, &dest).unwrap();
    dest
}

/// `exp/metrics.jsonl` with only `keys` in each record (timings differ between any two runs).
pub fn metrics(exp: &Path, keys: &[&str]) -> Vec<serde_json::Value> {
    std::fs::read_to_string(exp.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            keys.iter().map(|k| (k.to_string(), v[k].clone())).collect::<serde_json::Map<_, _>>().into()
        })
        .collect()
}

/// `dflash-host ARGS` with `env` set, as a user would run it (no RUST_BACKTRACE).
pub fn host(args: &[&str], env: &[(&str, &Path)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dflash-host"));
    cmd.args(args).env("DFLASH_CACHE", cache()).env_remove("RUST_BACKTRACE");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

/// A snapshot's files: (name in the snapshot, its bytes).
pub type SnapshotFiles = Vec<(String, Vec<u8>)>;

/// An HF hub cache holding `repo` as the `hf` CLI writes it: `models--Owner--Name/blobs/<sha256>`,
/// `snapshots/<commit>/<file>` symlinks to `../../blobs/<sha256>`, `refs/<branch>` holding the
/// commit. Each `(branch, commit, files)` is one snapshot; `files` are (name in the snapshot,
/// its bytes). Files with the same bytes share a blob, as in the hub cache.
pub fn hf_cache(cache: &Path, repo: &str, snapshots: &[(&str, &str, SnapshotFiles)]) {
    use sha2::{Digest, Sha256};
    let folder = cache.join(format!("models--{}", repo.replace('/', "--")));
    std::fs::create_dir_all(folder.join("blobs")).unwrap();
    std::fs::create_dir_all(folder.join("refs")).unwrap();
    for (branch, commit, files) in snapshots {
        let snapshot = folder.join("snapshots").join(commit);
        std::fs::create_dir_all(&snapshot).unwrap();
        for (name, bytes) in files {
            let blob = format!("{:x}", Sha256::digest(bytes));
            std::fs::write(folder.join("blobs").join(&blob), bytes).unwrap();
            std::os::unix::fs::symlink(format!("../../blobs/{blob}"), snapshot.join(name)).unwrap();
        }
        std::fs::write(folder.join("refs").join(branch), commit).unwrap();
    }
}

/// The files of a tiny HF model from tests/fixtures (`target_qwen3_moe`: Qwen3-MoE, 3 layers,
/// 64 word-level tokens `t0`..`t63`, EOS `t63`, sharded safetensors with an index) plus a
/// `tokenizer_config.json` holding a chat template in those tokens, as (name, bytes).
pub fn tiny_hf_model() -> Vec<(String, Vec<u8>)> {
    let fixture = root().join("tests/fixtures/target_qwen3_moe");
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&fixture)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "reference.safetensors")
        .map(|n| (n.clone(), std::fs::read(fixture.join(&n)).unwrap()))
        .collect();
    files.sort();
    let template = "{% for m in messages %}t1 {{ m['role'] }} {{ m['content'] }} t2 {% endfor %}\
                    {% if add_generation_prompt %}t1 assistant {% endif %}";
    files.push(("tokenizer_config.json".into(), serde_json::json!({ "chat_template": template }).to_string().into()));
    files
}

/// `n` chat records (JSONL, OpenAI `messages`) in the tiny model's words.
pub fn tiny_chats(n: usize) -> String {
    let words = |seed: usize, len: usize| {
        (0..len).map(|i| format!("t{}", 3 + (seed * 7 + i * 5) % 59)).collect::<Vec<_>>().join(" ")
    };
    (0..n)
        .map(|i| {
            let rec = serde_json::json!({"messages": [
                {"role": "user", "content": words(i, 6)},
                {"role": "assistant", "content": words(i + 100, 10)},
            ]});
            rec.to_string() + "\n"
        })
        .collect()
}

/// A run of seconds on [`tiny_hf_model`] and [`tiny_chats`]: `head` is the top of the file
/// (name, ...), `target` the `[target]` lines after `plugin = "hf"`, `data` the data file.
pub fn tiny_hf_config(head: &str, target: &str, data: &str) -> String {
    format!(
        r#"{head}
[train]
steps = 4
anchors_per_seq = 4
log_every = 1

[target]
plugin = "hf"
{target}

[drafter]
plugin = "dflash"
num_hidden_layers = 1
block_size = 4
num_target_features = 2
mask_token_id = 62

[optimizer]
plugin = "adamw"
lr = 1e-3

[data]
plugin = "chat"
path = "{data}"
batch_size = 2
max_len = 32
eval_holdout = 2
distill_max_new_tokens = 8
"#
    )
}

/// [`tiny_hf_model`] written as a plain HF folder.
pub fn write_tiny_hf_model(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    for (name, bytes) in tiny_hf_model() {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}

/// A Python that imports `modules`: `$DFLASH_PYTHON`, else `python3`; None (and why, for the
/// skip message) when neither does.
pub fn python_with(modules: &[&str]) -> Result<String, String> {
    let candidates: Vec<String> =
        std::env::var("DFLASH_PYTHON").ok().filter(|p| !p.is_empty()).into_iter().chain(["python3".into()]).collect();
    let import = format!("import {}", modules.join(", "));
    for python in &candidates {
        if Command::new(python).args(["-c", &import]).output().is_ok_and(|o| o.status.success()) {
            return Ok(python.clone());
        }
    }
    Err(format!("no Python that can `{import}` (tried {}; set DFLASH_PYTHON)", candidates.join(", ")))
}
