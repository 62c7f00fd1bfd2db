//! `dflash-host export`: a checkpoint as a z-lab format drafter (the DFlash paper: config.json +
//! model.safetensors in bf16, no embedding / LM head), which SGLang and vLLM serve and which
//! `[drafter] init_from = DIR` reads back. The config is the one the drafter trained with: its
//! `max_position_embeddings`, `rope_theta` and `rope_scaling` are the target's (the drafter took
//! them from the target when the run started), `layer_types` and `sliding_window` the layers'.
//!
//! The checkpoint is verified first (the finder every reader uses); the folder is written under
//! a temporary name and renamed, so `--out` holds a whole export or none; `--out` may not lie
//! inside the experiment (a checkpoint folder would be overwritten) nor be a non-empty folder
//! unless `--force`.

use crate::experiment::{self, checkpoint};
use anyhow::{bail, Context, Result};
use plugin_api::tch::{Kind, Tensor};
use std::path::{Path, PathBuf};

/// Export checkpoint `step` of `exp_dir` (default: the newest that verifies) to `out`; returns
/// the checkpoint folder.
pub fn export_experiment(exp_dir: &Path, step: Option<u64>, out: &Path, force: bool) -> Result<PathBuf> {
    let ckpt = checkpoint::find(exp_dir, step)?;
    let card = model_card(exp_dir, ckpt.step, &ckpt.dir.join("config.json"), out)?;
    export_with_card(&ckpt.dir, out, force, Some(&card))?;
    Ok(ckpt.dir)
}

/// The export's README.md: what the drafter is for and how it was trained, the acceptance length
/// measured (when `eval` ran), and the SGLang and vLLM command lines that serve it (the flags
/// z-lab's DFlash README documents for both).
pub fn model_card(exp_dir: &Path, step: u64, config_json: &Path, out: &Path) -> Result<String> {
    let manifest = experiment::Manifest::read(exp_dir)?;
    let cfg: serde_json::Value = experiment::read_json(config_json)?;
    let run: toml::Table = toml::from_str(&std::fs::read_to_string(exp_dir.join(experiment::CONFIG))?)?;
    let field = |section: &str, key: &str| {
        run.get(section).and_then(|s| s.get(key)).map(|v| v.to_string().trim_matches('"').to_string())
    };
    let block = cfg["block_size"].as_u64().unwrap_or(16);
    let id = |k: &str| if cfg[k].is_null() { "none".to_string() } else { cfg[k].to_string() };
    let target = &manifest.target_source;
    let served_target =
        if target.ends_with(".gguf") { "HF_CHECKPOINT_OF_THE_TARGET".to_string() } else { target.clone() };
    let here = out.display();
    let eval = experiment::read_json::<serde_json::Value>(&exp_dir.join("eval.json")).ok();
    let tau = match &eval {
        Some(e) => {
            let at =
                e["evaluated"]["checkpoint_step"].as_u64().map_or(String::new(), |s| format!(", checkpoint step-{s}"));
            format!(
                "τ {:.3} per response, {:.3} over {} verify cycles (accepted + 1 per cycle), on {} prompts ({}{at}); lossless: {}",
                e["tau"].as_f64().unwrap_or(f64::NAN),
                e["tau_pooled"].as_f64().unwrap_or(f64::NAN),
                e["cycles"],
                e["prompts"],
                e["source"].as_str().unwrap_or("?"),
                e["lossless"]
            )
        }
        None => "not measured (run `dflash-host eval --exp-dir EXP`, then export again)".into(),
    };
    let name = Path::new(target).file_name().map_or(target.clone(), |n| n.to_string_lossy().to_string());
    let text = |section: &str, key: &str, or: &str| field(section, key).unwrap_or_else(|| or.to_string());
    let mut card = format!("# DFlash drafter for `{name}`\n\n");
    card +=
        "A block-diffusion speculative-decoding drafter (DFlash): it reads the target's hidden states and drafts a \
             block of tokens in one forward; the target verifies them, so the output is the target's own. It borrows \
             the target's embedding and LM head and works only with this target.\n\n";
    card += "| | |\n| --- | --- |\n";
    card += &format!("| target | `{target}` (SHA-256 `{}`) |\n", manifest.target_sha256);
    card += &format!(
        "| target token ids | bos {}, eos {}, pad {} |\n",
        id("bos_token_id"),
        id("eos_token_id"),
        id("pad_token_id")
    );
    card += &format!("| data | `{}` (format {}) |\n", text("data", "path", "?"), text("data", "format", "auto"));
    card += &format!(
        "| training | step {step} of {}, seed {}, optimizer {} |\n",
        text("train", "steps", "?"),
        manifest.seed,
        text("optimizer", "plugin", "?")
    );
    card += &format!(
        "| drafter | layers: {}, block size {block}, target layers {} |\n",
        cfg["num_hidden_layers"], cfg["dflash_config"]["target_layer_ids"]
    );
    card += "| weights | bfloat16 (`model.safetensors`) |\n";
    card += &format!("| acceptance length | {tau} |\n\n");
    card += "## Serving\n\n";
    if served_target != *target {
        card += "The target was read from a GGUF file; the servers load the same model as an HF checkpoint.\n\n";
    }
    card += &format!(
        "SGLang:\n\n```sh\npython -m sglang.launch_server --model-path {served_target} \\\n  --speculative-algorithm DFLASH \\\n  \
         --speculative-draft-model-path {here} \\\n  --speculative-num-draft-tokens {block}\n```\n\n"
    );
    card += &format!(
        r#"vLLM:

```sh
vllm serve {served_target} \
  --speculative-config '{{"method": "dflash", "model": "{here}", "num_speculative_tokens": {}}}'
```
"#,
        block.saturating_sub(1)
    );
    Ok(card)
}

/// Write `checkpoint`'s drafter to `out` in the z-lab format (see the module doc for the rules).
pub fn export(checkpoint: &Path, out: &Path, force: bool) -> Result<()> {
    export_with_card(checkpoint, out, force, None)
}

/// The temporary folders of exports to `name` whose process is gone (killed mid-export): an
/// export that dies leaves `.NAME.export-PID` beside `--out`, never a partial `--out`.
fn remove_dead_exports(parent: &Path, name: &str) {
    let prefix = format!(".{name}.export-");
    let Ok(entries) = std::fs::read_dir(parent) else { return };
    for e in entries.flatten() {
        let file = e.file_name();
        let Some(pid) = file.to_str().and_then(|f| f.strip_prefix(&prefix)).and_then(|p| p.parse::<i32>().ok()) else {
            continue;
        };
        // SAFETY: kill(pid, 0) only asks whether the process exists.
        let alive = pid > 0
            && (unsafe { libc::kill(pid, 0) } == 0
                || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM));
        if !alive {
            tracing::info!("removing {}, left by an export that did not finish", e.path().display());
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// As [`export`], with a README.md model card.
pub fn export_with_card(checkpoint: &Path, out: &Path, force: bool, card: Option<&str>) -> Result<()> {
    checkpoint::verify(checkpoint)?;
    let out = check_out(checkpoint, out, force)?;
    let cfg_path = checkpoint.join("config.json");
    let mut cfg: serde_json::Value = experiment::read_json(&cfg_path)?;
    // transformers 5's name for the weights' dtype (4.x wrote `torch_dtype`; both read back).
    if let Some(obj) = cfg.as_object_mut() {
        obj.remove("torch_dtype");
    }
    cfg["dtype"] = "bfloat16".into();
    // Other drafter plugins (gdn) export the same way, but only z-lab's architecture is servable.
    let arch = cfg["architectures"][0].as_str().unwrap_or("?").to_string();
    if arch != "DFlashDraftModel" {
        tracing::warn!(
            "{}: drafter `{arch}` is not z-lab's DFlashDraftModel: the folder keeps its own config.json and bf16 weights \
             (its plugin's `init_from` reads it back); SGLang and vLLM cannot serve it",
            checkpoint.display()
        );
    }
    let weights = experiment::read_safetensors(&checkpoint.join("model.safetensors"))?;
    let bf16: Vec<(String, Tensor)> =
        weights.into_iter().map(|nt| (nt.name.to_string(), nt.tensor.into_tensor().to_kind(Kind::BFloat16))).collect();

    let parent = out.parent().expect("check_out gives a path with a parent");
    let name = out.file_name().expect("check_out gives a path with a name").to_string_lossy().to_string();
    remove_dead_exports(parent, &name);
    let tmp = parent.join(format!(".{name}.export-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let written = (|| -> Result<()> {
        std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        crate::atomic_write::write_synced(
            &tmp.join("config.json"),
            (serde_json::to_string_pretty(&cfg)? + "\n").as_bytes(),
        )?;
        if let Some(card) = card {
            crate::atomic_write::write_synced(&tmp.join("README.md"), card.as_bytes())?;
        }
        let model = tmp.join("model.safetensors");
        Tensor::write_safetensors(&bf16, &model).with_context(|| format!("writing {}", model.display()))?;
        std::fs::File::open(&model)
            .and_then(|f| f.sync_all())
            .with_context(|| format!("syncing {}", model.display()))?;
        std::fs::File::open(&tmp).and_then(|d| d.sync_all()).with_context(|| format!("syncing {}", tmp.display()))
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    // Replace: the old folder (empty, or --force) steps aside first, so a crash leaves one whole.
    let old = parent.join(format!(".{name}.replaced-{}", std::process::id()));
    if out.exists() {
        std::fs::rename(&out, &old).with_context(|| format!("moving {} aside", out.display()))?;
    }
    std::fs::rename(&tmp, &out).with_context(|| format!("renaming {} to {}", tmp.display(), out.display()))?;
    let _ = std::fs::remove_dir_all(&old);
    std::fs::File::open(parent).and_then(|d| d.sync_all()).with_context(|| format!("syncing {}", parent.display()))?;
    Ok(())
}

/// `out` as an absolute path whose parent exists, after the checks: not inside the checkpoint's
/// experiment, not a file, not a non-empty folder unless `force`.
fn check_out(checkpoint: &Path, out: &Path, force: bool) -> Result<PathBuf> {
    let name = out.file_name().with_context(|| format!("--out {}: not a folder name", out.display()))?;
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    let out_abs = parent.canonicalize().with_context(|| format!("{}", parent.display()))?.join(name);
    let exp = checkpoint.parent().and_then(Path::parent).map(Path::canonicalize).transpose()?;
    if let Some(exp) = exp.filter(|e| out_abs.starts_with(e)) {
        bail!("--out {}: inside the experiment {}; export to a folder outside it (it would overwrite the experiment's files)", out.display(), exp.display());
    }
    if out_abs.exists() {
        if !out_abs.is_dir() {
            bail!("--out {}: exists and is not a folder", out.display());
        }
        let empty = std::fs::read_dir(&out_abs).with_context(|| format!("reading {}", out.display()))?.next().is_none();
        if !empty && !force {
            bail!("--out {}: exists and is not empty; pass --force to replace it", out.display());
        }
    }
    Ok(out_abs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::experiment::Experiment;
    use plugin_api::{tch::Device, NamedTensor};

    fn checkpoint(root: &Path) -> PathBuf {
        let exp = Experiment::create(&root.join("exp"), "", &serde_json::json!({})).unwrap();
        let w = vec![NamedTensor::new("fc.weight", Tensor::ones([4, 4], (Kind::Float, Device::Cpu)))];
        exp.save_checkpoint(3, &w, "{\"architectures\": [\"DFlashDraftModel\"]}", &[], &serde_json::json!({}), 1)
            .unwrap()
    }

    fn listing(dir: &Path) -> Vec<String> {
        let mut n: Vec<String> =
            std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        n.sort();
        n
    }

    #[test]
    fn export_never_writes_into_the_experiment_and_replaces_only_with_force() {
        let root = tempfile::tempdir().unwrap();
        let ckpt = checkpoint(root.path());
        let before = std::fs::read(ckpt.join("model.safetensors")).unwrap();
        for inside in [ckpt.clone(), root.path().join("exp"), root.path().join("exp/zlab")] {
            let err = export(&ckpt, &inside, true).unwrap_err().to_string();
            assert!(err.contains("inside the experiment"), "{}: {err}", inside.display());
        }
        assert_eq!(std::fs::read(ckpt.join("model.safetensors")).unwrap(), before, "the checkpoint was touched");
        checkpoint::verify(&ckpt).unwrap();

        let out = root.path().join("zlab");
        std::fs::create_dir(&out).unwrap();
        std::fs::write(out.join("notes.txt"), "mine").unwrap();
        let err = export(&ckpt, &out, false).unwrap_err().to_string();
        assert!(err.contains("exists and is not empty; pass --force"), "{err}");
        assert_eq!(listing(&out), ["notes.txt"]);
        export(&ckpt, &out, true).unwrap();
        assert_eq!(listing(&out), ["config.json", "model.safetensors"]);
        assert_eq!(listing(root.path()), ["exp", "zlab"], "no temporary folder left behind");
        let back = Tensor::read_safetensors(out.join("model.safetensors")).unwrap();
        assert_eq!(back[0].1.kind(), Kind::BFloat16);
    }

    #[test]
    fn a_corrupt_checkpoint_is_not_exported() {
        let root = tempfile::tempdir().unwrap();
        let ckpt = checkpoint(root.path());
        let model = ckpt.join("model.safetensors");
        let mut bytes = std::fs::read(&model).unwrap();
        let n = bytes.len();
        bytes[n - 1] ^= 0x40; // one flipped bit in the weights: still a valid safetensors file
        std::fs::write(&model, bytes).unwrap();
        let out = root.path().join("zlab");
        let err = format!("{:#}", export(&ckpt, &out, false).unwrap_err());
        assert!(err.contains("model.safetensors: checksum mismatch"), "{err}");
        assert!(!out.exists());
        let err = format!("{:#}", export_experiment(&root.path().join("exp"), Some(3), &out, false).unwrap_err());
        assert!(err.contains("checkpoint step-3 is not usable"), "{err}");
    }
}
