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

static BUILDS: std::sync::Mutex<()> = std::sync::Mutex::new(());

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
