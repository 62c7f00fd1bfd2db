//! Checks that run before anything heavy loads: a typo in `[data]`, a missing dataset or an
//! experiment folder that exists already must not wait for an 8B target to load first.

use crate::{
    config::{self, RunConfig},
    experiment::manifest,
    plugins::Registry,
};
use anyhow::{anyhow, bail, Result};
use plugin_api::{describe::SectionDoc, HostContext, PluginKind};
use std::path::Path;

/// A plugin's error pointed at its source: the `--set` argument that set the field, else the
/// config line that did (or the section's header for a missing field).
pub fn locate(cfg: &RunConfig, config_path: &Path, msg: String) -> anyhow::Error {
    if let Some(o) = cfg.overrides.iter().rev().find(|o| o.names_field_of(&msg)) {
        return anyhow!("{}: {msg}", o.arg);
    }
    let text = input_files::read_to_string_capped(config_path, config::MAX_CONFIG_BYTES).unwrap_or_default();
    match config::locate_plugin_error(&text, &msg) {
        Some(line) => anyhow!("{}:{line}: {msg}", config_path.display()),
        None => anyhow!("{}: {msg}", config_path.display()),
    }
}

/// A new run's experiment folder must be free (Experiment::create checks again, atomically).
pub fn check_exp_dir(dir: &Path) -> Result<()> {
    if std::fs::read_dir(dir).is_ok_and(|mut d| d.next().is_some()) {
        bail!(
            "experiment directory {} already exists and is not empty (resume it with `train --resume {}`)",
            dir.display(),
            dir.display()
        );
    }
    Ok(())
}

/// Everything that can be checked without the target: every plugin named exists, every section
/// has only the fields its plugin describes (an unknown one named with the closest known one),
/// every plugin checks its section (ABI `check`: ranges as far as they go without the target, the
/// files it reads are there; an optimizer that does not describe its section is created
/// instead, which allocates nothing), and no value names a FIFO or device where a file belongs.
pub fn check(cfg: &RunConfig, config_path: &Path, ctx: &HostContext, registry: &Registry) -> Result<()> {
    for (kind, table) in cfg.plugin_sections() {
        let section = cfg.section(kind);
        let plugin_kind = crate::plugins::kind_of_section(kind);
        let plugin = registry
            .find(plugin_kind, &section.plugin)
            .map_err(|e| locate(cfg, config_path, format!("[{kind}] {e}")))?;
        let fail = |e: String| locate(cfg, config_path, format!("[{kind}] plugin `{}`: {e}", section.plugin));
        // 1. Every field is one the plugin describes.
        let doc = plugin.describe()?;
        if let Some(doc) = &doc {
            if let Some(e) = unknown_field(doc, table) {
                return Err(fail(e));
            }
            if let Some(switch) = cfg.switches.iter().find(|s| s.section == kind) {
                crate::say!("{}", config::effective_section(switch, doc, table, &cfg.overrides));
            }
        }
        // 2. The plugin's own check, or an optimizer created.
        let checked = match (&doc, plugin_kind) {
            (None, PluginKind::Optimizer) => {
                registry
                    .create(plugin_kind, &section, ctx)
                    .map_err(|e| anyhow!("{}", located_text(cfg, config_path, e)))?;
                Default::default()
            }
            _ => plugin.check(&section, ctx).map_err(|e| anyhow!("{}", located_text(cfg, config_path, e)))?,
        };
        // 3. Paths: no FIFO or device where a file belongs (any plugin).
        manifest::section_paths(kind, table, ctx, &checked.inputs)
            .map_err(|(key, e)| fail(format!("field `{key}`: {e}")))?;
    }
    if let Some(capture) = &cfg.pipeline.capture {
        let path = Path::new(capture); // read as given, from the working folder
        if !path.exists() {
            bail!(
                "{}: field `pipeline.capture`: {}: no such folder",
                cfg.blame(config_path, "field `pipeline.capture`"),
                path.display()
            );
        }
    }
    Ok(())
}

/// The first key of a section (or of a table within it) that its plugin's description does not
/// have: `unknown field `lrr`, did you mean `lr`?`.
pub fn unknown_field(doc: &SectionDoc, table: &toml::Table) -> Option<String> {
    fn walk(doc: &SectionDoc, prefix: &str, table: &toml::Table) -> Option<String> {
        for (key, value) in table {
            if prefix.is_empty() && key == "plugin" {
                continue;
            }
            let dotted = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
            if let Some(e) = doc.unknown_field(&dotted) {
                return Some(e);
            }
            // Tables within: a described table's fields, or each table of an array of them.
            let inner: Vec<&toml::Table> = match value {
                toml::Value::Table(t) => vec![t],
                toml::Value::Array(items) => items.iter().filter_map(toml::Value::as_table).collect(),
                _ => Vec::new(),
            };
            if doc.table(&dotted).is_some() {
                if let Some(e) = inner.into_iter().find_map(|t| walk(doc, &dotted, t)) {
                    return Some(e);
                }
            }
        }
        None
    }
    walk(doc, "", table)
}

/// A registry error (`[kind] plugin `name`: ...`) pointed at its source.
fn located_text(cfg: &RunConfig, config_path: &Path, e: anyhow::Error) -> String {
    locate(cfg, config_path, format!("{e:#}")).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Preflight of the config `text`, written as run.toml in `dir`; the error in full.
    fn preflight(dir: &Path, text: &str) -> Result<(), String> {
        let path = dir.join("run.toml");
        std::fs::write(&path, text).unwrap();
        let cfg = RunConfig::load(&path).unwrap();
        let ctx = manifest::plugin_context(&cfg, dir, dir);
        check(&cfg, &path, &ctx, &Registry::new(&[]).unwrap()).map_err(|e| format!("{e:#}"))
    }

    /// The example for a target larger than one GPU passes preflight (its model splits as its
    /// `tensor_parallel` / `expert_parallel` say); a split its shapes do not allow, or expert
    /// parallelism for a model without routed experts, is refused before anything loads, naming
    /// the field.
    #[test]
    fn the_tensor_parallel_example_passes_preflight_and_a_bad_split_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/examples");
        let text = std::fs::read_to_string(examples.join("qwen3.5-397b-a17b.toml")).unwrap();
        std::fs::copy(examples.join("qwen3.5-397b-a17b-config.json"), dir.path().join("qwen3.5-397b-a17b-config.json"))
            .unwrap();
        std::fs::write(dir.path().join("train.jsonl"), "{\"messages\": []}\n").unwrap();
        let text = text.replace("$DFLASH_CACHE/data/train.jsonl", "train.jsonl");
        let check = |text: &str| preflight(dir.path(), text);
        check(&text).unwrap();
        let split = |t: usize, e: usize| {
            text.replace("tensor_parallel = 8", &format!("tensor_parallel = {t}"))
                .replace("expert_parallel = 8", &format!("expert_parallel = {e}"))
        };
        let e = check(&split(3, 8)).unwrap_err();
        assert!(e.contains("field `expert_parallel` = 8: must divide `tensor_parallel` = 3"), "{e}");
        let e = check(&split(3, 1)).unwrap_err();
        assert!(e.contains("field `tensor_parallel` = 3: the attention heads (32) is not a multiple of 3"), "{e}");
        let e = check(&split(64, 64)).unwrap_err();
        assert!(
            e.contains("field `tensor_parallel` = 64: the Gated DeltaNet value heads (64)") || e.contains("(32)"),
            "{e}"
        );
        let gemma = text.replace("qwen3.5-397b-a17b-config.json", "gemma.json");
        std::fs::write(
            dir.path().join("gemma.json"),
            r#"{"model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100}"#,
        )
        .unwrap();
        let e = check(&gemma).unwrap_err();
        assert!(e.contains("field `expert_parallel` = 8: `gemma2` has no routed experts that split"), "{e}");
        let e = check(&gemma.replace("expert_parallel = 8", "expert_parallel = 1")).unwrap_err();
        assert!(e.contains("field `tensor_parallel` = 8: the attention heads (4) is not a multiple of 8"), "{e}");
    }

    /// The LongCat-Flash preset's split (one replica of 16 ranks, 16 expert groups) passes
    /// preflight against the real model's shapes (transformers' `LongcatFlashConfig`), weights
    /// aside; 12 ranks do not divide its 64 heads.
    #[test]
    fn the_longcat_preset_splits_the_real_shapes() {
        let dir = tempfile::tempdir().unwrap();
        let presets = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/presets");
        std::fs::write(
            dir.path().join("longcat.json"),
            r#"{"model_type": "longcat_flash", "vocab_size": 131072, "hidden_size": 6144, "num_hidden_layers": 56,
            "num_layers": 28, "num_attention_heads": 64, "num_key_value_heads": 64, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-05, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": false,
            "rope_parameters": {"rope_theta": 10000000.0, "rope_type": "default"}, "ffn_hidden_size": 12288,
            "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "head_dim": 64, "v_head_dim": 128, "qk_head_dim": 192, "moe_topk": 12, "n_routed_experts": 512,
            "zero_expert_num": 256, "expert_ffn_hidden_size": 2048, "routed_scaling_factor": 6.0}"#,
        )
        .unwrap();
        std::fs::write(dir.path().join("train.jsonl"), "{\"messages\": []}\n").unwrap();
        let text = std::fs::read_to_string(presets.join("longcat-flash.toml"))
            .unwrap()
            .replace("\"meituan-longcat/LongCat-Flash-Chat\"", "\"longcat.json\"\nrandom_init = true")
            .replace("$DFLASH_CACHE/data/train.jsonl", "train.jsonl");
        let check = |text: &str| preflight(dir.path(), text);
        check(&text).unwrap();
        let twelve = text
            .replace("tensor_parallel = 16", "tensor_parallel = 12")
            .replace("expert_parallel = 16", "expert_parallel = 4");
        let e = check(&twelve).unwrap_err();
        assert!(e.contains("field `tensor_parallel` = 12") && e.contains("(64) is not a multiple of 12"), "{e}");
    }
}
