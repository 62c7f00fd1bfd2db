//! The drafter's mask token when the config leaves `mask_token_id` out and the target has no pad
//! token distinct from EOS (Llama, Mistral): a special token of the target's vocabulary that the
//! chat template never renders, picked here and said in the log and the manifest; or, when there
//! is none, an error listing the special tokens and why each is taken.

use crate::config::PluginSection;
use anyhow::{bail, Result};
use plugin_api::TargetSpec;
use serde::{Deserialize, Serialize};

/// The token picked, and why it is free.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MaskToken {
    pub id: u32,
    pub token: String,
    pub why: String,
}

/// A special token of the tokenizer (`added_tokens` with `special: true`).
struct Special {
    id: u32,
    content: String,
}

/// `section` (the drafter's) with `mask_token_id` set to a picked token where it needs one: the
/// drafter describes the field (`describes`), the section leaves it out, and the target has no
/// pad token distinct from EOS. `templates` are the chat templates the data is rendered with.
pub fn fill(
    section: &mut PluginSection,
    describes: bool,
    spec: &TargetSpec,
    tokenizer_json: &str,
    templates: &[String],
) -> Result<Option<MaskToken>> {
    let table: toml::Table = toml::from_str(&section.config_toml).unwrap_or_default();
    let pad = spec.pad_token_id.into_option().filter(|&p| p != spec.eos_token_id);
    if !describes || table.contains_key("mask_token_id") || pad.is_some() {
        return Ok(None);
    }
    let tokenizer: serde_json::Value = serde_json::from_str(tokenizer_json).unwrap_or_default();
    let unk = tokenizer["model"]["unk_token"].as_str().unwrap_or("");
    let mut specials: Vec<Special> = tokenizer["added_tokens"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|t| t["special"].as_bool() == Some(true))
        .filter_map(|t| Some(Special { id: t["id"].as_u64()? as u32, content: t["content"].as_str()?.to_string() }))
        .collect();
    specials.sort_by_key(|s| s.id);
    let taken = |s: &Special| -> Option<&'static str> {
        if s.id >= spec.vocab_size {
            Some("outside the vocabulary")
        } else if Some(s.id) == spec.bos_token_id.into_option() {
            Some("BOS")
        } else if s.id == spec.eos_token_id {
            Some("EOS")
        } else if s.content == unk {
            Some("the unknown-word token")
        } else if templates.iter().any(|t| t.contains(&s.content)) {
            Some("in the chat template")
        } else {
            None
        }
    };
    if let Some(s) = specials.iter().find(|s| taken(s).is_none()) {
        let picked = MaskToken {
            id: s.id,
            token: s.content.clone(),
            why: "the target has no pad token; a special token its chat template never renders".into(),
        };
        tracing::info!("[drafter] mask_token_id = {} (`{}`): {}", picked.id, picked.token, picked.why);
        section.config_toml = format!("{}\nmask_token_id = {}\n", section.config_toml, picked.id);
        return Ok(Some(picked));
    }
    let listed: Vec<String> =
        specials.iter().map(|s| format!("`{}` {} ({})", s.content, s.id, taken(s).unwrap_or("free"))).collect();
    let seen = if listed.is_empty() {
        "its tokenizer declares no special tokens".to_string()
    } else {
        format!("its special tokens are all in use: {}", listed.join(", "))
    };
    bail!(
        "[drafter] field `mask_token_id`: not set, and the target has no pad token distinct from EOS and no special \
         token its chat template never renders ({seen}); set `mask_token_id` to a token id the training data never \
         contains"
    )
}

/// The chat templates the data is rendered with: the target's, and the one `[data]
/// chat_template` names (`chatml`'s markers, or the file's text; a path relative to
/// `config_dir`).
pub fn templates(spec: &TargetSpec, data: &toml::Table, config_dir: &std::path::Path) -> Vec<String> {
    let mut out = vec![spec.chat_template.to_string()];
    match data.get("chat_template").and_then(toml::Value::as_str) {
        Some("chatml") => out.push("<|im_start|><|im_end|>".into()),
        Some(path) => {
            let path = config_dir.join(path);
            out.extend(input_files::read_to_string_capped(&path, 16 << 20).ok());
        }
        None => {}
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use plugin_api::abi_stable::std_types::{RNone, RSome};

    fn spec(pad: Option<u32>) -> TargetSpec {
        TargetSpec {
            architecture: "mistral".into(),
            num_hidden_layers: 2,
            hidden_size: 8,
            vocab_size: 64,
            num_attention_heads: 2,
            num_key_value_heads: 1,
            head_dim: 4,
            intermediate_size: 16,
            rope_theta: 1e4,
            rms_norm_eps: 1e-5,
            bos_token_id: RSome(1),
            eos_token_id: 2,
            pad_token_id: pad.map_or(RNone, RSome),
            chat_template: "{{ bos_token }}[INST] {{ m }} [/INST]".into(),
            source: "".into(),
            source_sha256: "".into(),
        }
    }

    const TOKENIZER: &str = r#"{"model": {"unk_token": "<unk>"}, "added_tokens": [
        {"id": 0, "content": "<unk>", "special": true}, {"id": 1, "content": "<s>", "special": true},
        {"id": 2, "content": "</s>", "special": true}, {"id": 3, "content": "[INST]", "special": true},
        {"id": 4, "content": "[/INST]", "special": true}, {"id": 5, "content": "hello", "special": false},
        {"id": 10, "content": "[control_8]", "special": true}, {"id": 99, "content": "[big]", "special": true}]}"#;

    fn section(text: &str) -> PluginSection {
        PluginSection { kind: "drafter", plugin: "dflash".into(), config_toml: text.into() }
    }

    #[test]
    fn a_special_token_the_template_never_renders_is_picked_else_the_error_lists_them() {
        let templates = [spec(None).chat_template.to_string()];
        let mut s = section("block_size = 4");
        let picked = fill(&mut s, true, &spec(None), TOKENIZER, &templates).unwrap().unwrap();
        assert_eq!((picked.id, picked.token.as_str()), (10, "[control_8]"));
        assert!(s.config_toml.ends_with("mask_token_id = 10\n"), "{}", s.config_toml);
        // Given, a pad token, or a drafter without the field: nothing picked.
        for (text, pad, describes) in [("mask_token_id = 7", None, true), ("", Some(0), true), ("", None, false)] {
            assert_eq!(fill(&mut section(text), describes, &spec(pad), TOKENIZER, &templates).unwrap(), None);
        }
        // Every special token in use: the error lists them and why.
        let used = [format!("{} [control_8]", templates[0])];
        let e = fill(&mut section(""), true, &spec(None), TOKENIZER, &used).unwrap_err().to_string();
        assert!(
            e.contains(
                "`<unk>` 0 (the unknown-word token), `<s>` 1 (BOS), `</s>` 2 (EOS), `[INST]` 3 (in the chat template)"
            ) && e.contains("`[control_8]` 10 (in the chat template), `[big]` 99 (outside the vocabulary)"),
            "{e}"
        );
        let e = fill(&mut section(""), true, &spec(None), r#"{"added_tokens": []}"#, &used).unwrap_err().to_string();
        assert!(e.contains("its tokenizer declares no special tokens"), "{e}");
    }
}
