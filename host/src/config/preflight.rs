//! Checks that run before anything heavy loads: a typo in `[data]`, a missing dataset or an
//! experiment folder that exists already must not wait for an 8B target to load first.

use crate::{
    config::{self, RunConfig},
    experiment::manifest,
    plugins::Registry,
};
use anyhow::{anyhow, bail, Result};
use plugin_api::{HostContext, PluginKind};
use std::path::Path;
use target_hf::hub;

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
/// parses (the built-in plugins' with their own types, and their ranges checked as far as they
/// go without the target; an optimizer of any plugin by creating it, which allocates nothing),
/// and every file a section names is there and readable (a target's hub name is looked up as the
/// target plugin looks it up: `target_hf::hub::locate`).
pub fn check(cfg: &RunConfig, config_path: &Path, ctx: &HostContext, registry: &Registry) -> Result<()> {
    for (kind, table) in cfg.plugin_sections() {
        let section = cfg.section(kind);
        let plugin_kind = plugin_kind(kind);
        let plugin = registry
            .find(plugin_kind, &section.plugin)
            .map_err(|e| locate(cfg, config_path, format!("[{kind}] {e}")))?;
        let fail = |e: String| locate(cfg, config_path, format!("[{kind}] plugin `{}`: {e}", section.plugin));
        // 1. Paths: no FIFO or device where a file belongs (any plugin).
        manifest::section_paths(kind, table, ctx).map_err(|(key, e)| fail(format!("field `{key}`: {e}")))?;
        // 2. The section's own fields.
        let builtin = plugin.record.origin == "builtin";
        let paths: Vec<(&str, Option<String>)> = match (kind, section.plugin.as_str(), builtin) {
            ("optimizer", _, _) => {
                registry
                    .create(plugin_kind, &section, ctx)
                    .map_err(|e| anyhow!("{}", located_text(cfg, config_path, e)))?;
                vec![]
            }
            ("target", "hf", true) => {
                let s: target_hf::TargetSection = parse(&section.config_toml).map_err(fail)?;
                let shard = target_hf::tp::Shard::new(0, s.tensor_parallel, s.expert_parallel).map_err(fail)?;
                // As the plugin finds it (one lookup): a local path, or a hub name in the HF cache.
                match hub::locate(&s.path, ctx.resolve_path(&s.path), s.revision.as_deref()).map_err(fail)? {
                    hub::Location::Local(p) => {
                        // The model splits as `tensor_parallel` / `expert_parallel` say.
                        if !shard.is_whole() || s.expert_parallel > 1 {
                            let cfg = target_hf::config::DecoderConfig::read(&p).map_err(fail)?;
                            target_hf::tp::check(&cfg, shard).map_err(fail)?;
                        }
                        vec![("path", Some(s.path))]
                    }
                    hub::Location::Snapshot { .. } => vec![],
                    hub::Location::NotCached(missing) if hub::offline() => {
                        return Err(fail(format!("field `path`: {missing}; not downloaded, as HF_HUB_OFFLINE is set")))
                    }
                    hub::Location::NotCached(_) => vec![], // the plugin downloads it
                }
            }
            ("drafter", "dflash", true) => {
                let s: drafter_dflash::DrafterSection = parse(&section.config_toml).map_err(fail)?;
                s.check().map_err(|e| fail(e.to_string()))?;
                vec![("init_from", s.init_from)]
            }
            ("drafter", "gdn", true) => {
                let s: drafter_gdn::DrafterSection = parse(&section.config_toml).map_err(fail)?;
                s.check().map_err(|e| fail(e.to_string()))?;
                vec![("init_from", s.init_from)]
            }
            ("data", "chat", true) => {
                let s: data_chat::ChatSection = parse(&section.config_toml).map_err(fail)?;
                s.validate().map_err(|e| fail(e.to_string()))?;
                vec![("path", Some(s.path)), ("chat_template", s.chat_template.filter(|t| t != "chatml"))]
            }
            _ => vec![], // a library's section is its own to check when it is created
        };
        // 3. The files the section needs are there.
        for (key, value) in paths {
            let Some(value) = value else { continue };
            let path = ctx.resolve_path(&value);
            if !path.exists() {
                return Err(fail(format!("field `{key}`: {}: no such file or folder", path.display())));
            }
        }
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

fn parse<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, String> {
    plugin_api::parse_section(text).map_err(|e| e.to_string())
}

/// A registry error (`[kind] plugin `name`: ...`) pointed at its source.
fn located_text(cfg: &RunConfig, config_path: &Path, e: anyhow::Error) -> String {
    locate(cfg, config_path, format!("{e:#}")).to_string()
}

fn plugin_kind(kind: &str) -> PluginKind {
    match kind {
        "target" => PluginKind::Target,
        "drafter" => PluginKind::Drafter,
        "optimizer" => PluginKind::Optimizer,
        _ => PluginKind::DataLoader,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example for a target larger than one GPU passes preflight (its model splits as its
    /// `tensor_parallel` / `expert_parallel` say); a split its shapes do not allow, or a family
    /// without that parallelism, is refused before anything loads, naming the field.
    #[test]
    fn the_tensor_parallel_example_passes_preflight_and_a_bad_split_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/examples");
        let text = std::fs::read_to_string(examples.join("qwen3.5-397b-a17b.toml")).unwrap();
        std::fs::copy(examples.join("qwen3.5-397b-a17b-config.json"), dir.path().join("qwen3.5-397b-a17b-config.json"))
            .unwrap();
        std::fs::write(dir.path().join("train.jsonl"), "{\"messages\": []}\n").unwrap();
        let text = text.replace("$DFLASH_CACHE/data/train.jsonl", "train.jsonl");
        let registry = Registry::new(&[]).unwrap();
        let check = |text: &str| {
            let path = dir.path().join("run.toml");
            std::fs::write(&path, text).unwrap();
            let cfg = RunConfig::load(&path).unwrap();
            let ctx = manifest::plugin_context(&cfg, dir.path(), dir.path());
            check(&cfg, &path, &ctx, &registry).map_err(|e| format!("{e:#}"))
        };
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
        let e = check(&gemma.replace("expert_parallel = 8", "expert_parallel = 1")).unwrap_err();
        assert!(e.contains("field `tensor_parallel` = 8: `gemma2` models run on a single device"), "{e}");
    }
}
