//! `dflash-host export`: a checkpoint as a z-lab format drafter (DFLASH.md: config.json +
//! model.safetensors in bf16, no embedding / LM head), which SGLang and vLLM serve and which
//! `[drafter] init_from = DIR` reads back. The config is the one the drafter trained with: its
//! `max_position_embeddings`, `rope_theta` and `rope_scaling` are the target's (the drafter took
//! them from the target when the run started), `layer_types` and `sliding_window` the layers'.

use anyhow::{bail, Context, Result};
use plugin_api::tch::{Kind, Tensor};
use std::path::{Path, PathBuf};

/// `checkpoints/step-N` of an experiment: `step`, or the newest.
pub fn find_checkpoint(exp_dir: &Path, step: Option<u64>) -> Result<PathBuf> {
    let root = exp_dir.join("checkpoints");
    if let Some(n) = step {
        let dir = root.join(format!("step-{n}"));
        if !dir.join("model.safetensors").exists() {
            bail!("{}: no checkpoint step-{n}", exp_dir.display());
        }
        return Ok(dir);
    }
    let newest = std::fs::read_dir(&root)
        .with_context(|| format!("{}: no checkpoints folder", exp_dir.display()))?
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("step-")?.parse::<u64>().ok())
        .max();
    match newest {
        Some(n) => Ok(root.join(format!("step-{n}"))),
        None => bail!("{}: no checkpoints yet", exp_dir.display()),
    }
}

/// Write `checkpoint`'s drafter to `out` in the z-lab format.
pub fn export(checkpoint: &Path, out: &Path) -> Result<()> {
    let cfg_path = checkpoint.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).with_context(|| format!("reading {}", cfg_path.display()))?;
    let mut cfg: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("parsing {}", cfg_path.display()))?;
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
    let weights = Tensor::read_safetensors(checkpoint.join("model.safetensors"))
        .with_context(|| format!("reading {}", checkpoint.join("model.safetensors").display()))?;
    let bf16: Vec<(String, Tensor)> = weights.into_iter().map(|(n, t)| (n, t.to_kind(Kind::BFloat16))).collect();
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    std::fs::write(out.join("config.json"), serde_json::to_string_pretty(&cfg)? + "\n")?;
    Tensor::write_safetensors(&bf16, out.join("model.safetensors"))?;
    Ok(())
}
