//! Loading a decoder: from an HF folder (config.json, *.safetensors, tokenizer.json) or from one
//! GGUF file (renamed to HF names, dequantised as taken, llama's Q/K permutation undone). Either
//! way the weights stay in their file until the decoder takes them, so a tensor-parallel rank
//! materialises only its part.
//!
//! Every file is read through `input_files`: opened once, refused unless it is a regular file (a
//! FIFO or device as `tokenizer.json` is an error naming it, never a hang), capped in size
//! (`input_files::limits`), and read or memory-mapped (the weights) from that handle.

use crate::{
    config::{DecoderConfig, EosId},
    gguf::GgufError,
    gguf::GgufFile,
    gguf_tokenizer::{chat_template, tokenizer_from_gguf},
    quant::{QuantConfig, Stored},
    weights::{GgufWeight, Mapped, Weights},
};
use input_files::{limits, read_optional, read_to_string_capped, PathKind};
use plugin_api::tch::Tensor;
use std::{collections::HashMap, path::Path, sync::Arc};
use tokenizers::Tokenizer;

/// Everything a target needs from its files.
pub struct Loaded {
    pub cfg: DecoderConfig,
    pub weights: Weights,
    pub tokenizer: Tokenizer,
    pub chat_template: String,
}

pub fn load(path: &Path) -> Result<Loaded, String> {
    match input_files::check_path(path).map_err(|e| e.to_string())? {
        PathKind::Dir => load_hf_dir(path),
        PathKind::File => load_gguf(path),
    }
}

/// GGUF tensor name -> HF name (one map, STYLE.md).
fn hf_name(gguf: &str) -> Option<String> {
    let top = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(t) = top {
        return Some(t.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (part, suffix) = rest.split_once('.')?;
    let hf = match part {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

pub fn load_gguf(path: &Path) -> Result<Loaded, String> {
    let g = Arc::new(GgufFile::open(path).map_err(|e| e.to_string())?);
    let mut cfg = DecoderConfig::from_gguf(&g).map_err(|e| e.to_string())?;
    if g.tensor_info("rope_freqs.weight").is_some() {
        let (_, factors) = g.dequantize("rope_freqs.weight").map_err(|e| e.to_string())?;
        cfg.rope_freq_factors = Some(factors.into_iter().map(f64::from).collect());
    }
    cfg.validate().map_err(|e| format!("{}: {e}", path.display()))?;
    let permuted = cfg.model_type == "llama";
    // Mapped, dequantised as the decoder takes them; what would fail then is checked here.
    let mut tensors = HashMap::new();
    for info in g.tensors() {
        let Some(hf) = hf_name(&info.name) else {
            continue; // rope_freqs (read into the config above) and tensors the decoder does not use
        };
        if !info.ggml_type.can_dequantize() {
            let (path, name, ty) = (path.to_path_buf(), info.name.clone(), info.ggml_type.name());
            return Err(GgufError::UnsupportedType { path, name, ty }.to_string());
        }
        let shape: Vec<i64> = info.torch_shape().iter().map(|&d| d as i64).collect();
        let heads = if info.name.ends_with("attn_q.weight") {
            Some(cfg.num_attention_heads)
        } else if info.name.ends_with("attn_k.weight") {
            Some(cfg.num_kv_heads())
        } else {
            None
        };
        let permuted_heads = heads.filter(|_| permuted);
        if let Some(heads) = permuted_heads {
            if shape.len() != 2 || heads == 0 || shape[0] % (2 * heads as i64) != 0 {
                return Err(format!(
                    "{}: tensor {}: shape {shape:?} does not split into {heads} heads of row pairs",
                    path.display(),
                    info.name
                ));
            }
        }
        let name = info.name.clone();
        tensors.insert(hf, Mapped::Gguf(GgufWeight { file: Arc::clone(&g), name, shape, permuted_heads }));
    }
    let tokenizer = tokenizer_from_gguf(&g).map_err(|e| e.to_string())?;
    let chat_template = chat_template(&g).unwrap_or_default();
    let weights = Weights { tensors: HashMap::new(), mapped: tensors, source: path.display().to_string() };
    Ok(Loaded { cfg, weights, tokenizer, chat_template })
}

/// An HF folder: `config.json`, the weights (the shards `model.safetensors.index.json` names,
/// else every `*.safetensors`), `tokenizer.json`, the chat template (`tokenizer_config.json` or
/// `chat_template.jinja`). A multimodal checkpoint's language model is loaded from its
/// `model.language_model.*` tensors; the vision tower and the MTP head are skipped.
pub fn load_hf_dir(dir: &Path) -> Result<Loaded, String> {
    let cfg_path = dir.join("config.json");
    let text = read_to_string_capped(&cfg_path, limits::CONFIG_JSON).map_err(|e| e.to_string())?;
    let (mut cfg, arch_name) =
        DecoderConfig::from_hf_json(&text).map_err(|e| format!("{}: {e}", cfg_path.display()))?;
    cfg.validate().map_err(|e| format!("{}: {e}", cfg_path.display()))?;
    // What the checkpoint is quantised with, refused before a weight is read if not loadable.
    let outer: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", cfg_path.display()))?;
    let quant =
        QuantConfig::read(&outer).map_err(|e| format!("{}: field `quantization_config`: {e}", cfg_path.display()))?;
    if cfg.eos_token_id.is_none() {
        cfg.eos_token_id = generation_eos(dir)?;
    }
    // The small files first, so a bad one is named before gigabytes of weights are read.
    let tok_path = dir.join("tokenizer.json");
    let tok_bytes = input_files::read_capped(&tok_path, limits::TOKENIZER_JSON).map_err(|e| e.to_string())?;
    let tokenizer = Tokenizer::from_bytes(&tok_bytes).map_err(|e| format!("{}: {e}", tok_path.display()))?;
    drop(tok_bytes);
    let chat_template = chat_template_of(dir)?;
    let files = weight_files(dir)?;
    // Mapped, read as the decoder takes them: a tensor-parallel rank reads only its part.
    let mut tensors = HashMap::new();
    let (mut renamed, mut skipped) = (0usize, 0usize);
    for f in &files {
        let read = input_files::tensors::lazy_safetensors(f).map_err(|e| e.to_string())?;
        for (name, t) in read {
            let t = Stored::Plain(t);
            if name.starts_with("model.visual.") || name.starts_with("mtp.") {
                skipped += 1;
            } else if let Some(rest) = name.strip_prefix("model.language_model.") {
                renamed += 1;
                tensors.insert(format!("model.{rest}"), t);
            } else {
                tensors.insert(name, t);
            }
        }
    }
    if renamed > 0 || skipped > 0 {
        eprintln!(
            "note: {}: {}: loading the language model ({renamed} tensors), ignoring the vision tower and MTP head ({skipped})",
            dir.display(),
            arch_name.as_deref().unwrap_or(&cfg.model_type)
        );
    }
    if let Some(q) = &quant {
        let n = q.pair(&mut tensors).map_err(|e| format!("{}: {e}", dir.display()))?;
        eprintln!("note: {}: {n} quantised weights ({}), dequantised as they load", dir.display(), q.name());
    }
    let mapped = tensors.into_iter().map(|(n, t)| (n, Mapped::Safetensors(t))).collect();
    let weights = Weights { tensors: HashMap::new(), mapped, source: dir.display().to_string() };
    Ok(Loaded { cfg, weights, tokenizer, chat_template })
}

/// The folder's chat template: `tokenizer_config.json`'s `chat_template` (a string, or a list of
/// named templates, of which the `default` one), else `chat_template.jinja` (transformers 5 saves
/// it there), else none. A file that is there must be readable: a FIFO, a device or a file past
/// its cap is an error naming it.
pub fn chat_template_of(dir: &Path) -> Result<String, String> {
    let tc_path = dir.join("tokenizer_config.json");
    if let Some(text) = read_optional(&tc_path, limits::TOKENIZER_CONFIG_JSON).map_err(|e| e.to_string())? {
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", tc_path.display()))?;
        if let Some(t) = template_in_tokenizer_config(&v) {
            return Ok(t);
        }
    }
    let jinja = dir.join("chat_template.jinja");
    Ok(read_optional(&jinja, limits::CHAT_TEMPLATE).map_err(|e| e.to_string())?.unwrap_or_default())
}

/// `chat_template` of a parsed `tokenizer_config.json`: the string, or from a list of named
/// templates the one named `default`.
pub fn template_in_tokenizer_config(v: &serde_json::Value) -> Option<String> {
    match &v["chat_template"] {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(list) => {
            list.iter().find(|t| t["name"] == "default").and_then(|t| t["template"].as_str()).map(str::to_string)
        }
        _ => None,
    }
}

/// The shards the index names (each once, in order), or every `*.safetensors` of the folder.
fn weight_files(dir: &Path) -> Result<Vec<std::path::PathBuf>, String> {
    let index = dir.join("model.safetensors.index.json");
    if let Some(text) = read_optional(&index, limits::SAFETENSORS_INDEX).map_err(|e| e.to_string())? {
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", index.display()))?;
        let map = v["weight_map"].as_object().ok_or_else(|| format!("{}: no `weight_map` object", index.display()))?;
        let mut names: Vec<&str> = map.values().filter_map(|f| f.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        if let Some(bad) = names.iter().find(|n| n.contains('/') || n.contains('\\') || n.starts_with('.')) {
            return Err(format!("{}: shard `{bad}` is not a file name in the folder", index.display()));
        }
        return Ok(names.into_iter().map(|n| dir.join(n)).collect());
    }
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(format!("{}: no *.safetensors files", dir.display()));
    }
    Ok(files)
}

/// `generation_config.json`'s EOS id(s), where config.json has none (None without the file or
/// the key; a file that cannot be read or parsed is an error naming it).
fn generation_eos(dir: &Path) -> Result<Option<EosId>, String> {
    let path = dir.join("generation_config.json");
    let Some(text) = read_optional(&path, limits::CONFIG_JSON).map_err(|e| e.to_string())? else {
        return Ok(None);
    };
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(v.get("eos_token_id").and_then(|e| serde_json::from_value(e.clone()).ok()))
}

/// Write an HF folder (config.json, model.safetensors, tokenizer.json): for tests and for users
/// who want the dequantised model.
pub fn save_hf_dir(loaded: &Loaded, dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let cfg = serde_json::to_string_pretty(&loaded.cfg).expect("config serializes");
    std::fs::write(dir.join("config.json"), cfg).map_err(|e| e.to_string())?;
    let mut mapped = HashMap::new();
    for (name, lazy) in &loaded.weights.mapped {
        mapped.insert(name.clone(), lazy.read()?);
    }
    let mut named: Vec<(&String, &Tensor)> = loaded.weights.tensors.iter().chain(&mapped).collect();
    named.sort_by(|a, b| a.0.cmp(b.0));
    Tensor::write_safetensors(&named, dir.join("model.safetensors")).map_err(|e| e.to_string())?;
    loaded.tokenizer.save(dir.join("tokenizer.json"), false).map_err(|e| e.to_string())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gguf_names_map_to_hf() {
        assert_eq!(hf_name("blk.3.attn_q.weight").unwrap(), "model.layers.3.self_attn.q_proj.weight");
        assert_eq!(hf_name("blk.0.attn_k.bias").unwrap(), "model.layers.0.self_attn.k_proj.bias");
        assert_eq!(hf_name("blk.12.ffn_down.weight").unwrap(), "model.layers.12.mlp.down_proj.weight");
        assert_eq!(hf_name("token_embd.weight").unwrap(), "model.embed_tokens.weight");
        assert_eq!(hf_name("rope_freqs.weight"), None);
    }
}
