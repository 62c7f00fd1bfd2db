//! What a drafter's `config.json` copies from its target beyond [`TargetSpec`]: the context
//! length serving engines size their rotary tables from (`max_position_embeddings`) and the RoPE
//! scaling. Read from where the target came from (`TargetSpec::source`): an HF folder's
//! `config.json` (its `text_config` for multimodal checkpoints; transformers 5's
//! `rope_parameters` too; a config.json path itself, as a random-weights target has) or a GGUF
//! file's metadata. A target whose source is neither (a
//! synthetic test target) says nothing, and the drafter keeps its own defaults.

use plugin_api::{PluginError, TargetSpec};
use serde_json::Value;
use std::{
    io::{BufReader, Read, Seek, SeekFrom},
    path::Path,
};

#[derive(Debug, Clone, Default, PartialEq)]
pub struct TargetFacts {
    pub max_position_embeddings: Option<usize>,
    /// HF's `rope_scaling` (null for none); None when the source does not say.
    pub rope_scaling: Option<Value>,
}

/// The facts of `target`'s source; errors name the file.
pub fn read(target: &TargetSpec) -> Result<TargetFacts, PluginError> {
    let path = Path::new(target.source.as_str());
    let hf_config = if path.is_dir() { path.join("config.json") } else { path.to_path_buf() };
    if hf_config.is_file() && hf_config.extension().is_some_and(|e| e.eq_ignore_ascii_case("json")) {
        let err = |e: String| PluginError::new(format!("{}: {e}", hf_config.display()));
        let text = input_files::read_to_string_capped(&hf_config, input_files::limits::CONFIG_JSON)
            .map_err(|e| PluginError::new(e.to_string()))?;
        let json: Value = serde_json::from_str(&text).map_err(|e| err(e.to_string()))?;
        return Ok(from_hf_config(&json));
    }
    if path.is_file() && path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
        return from_gguf(path).map_err(|e| PluginError::new(format!("{}: {e}", path.display())));
    }
    Ok(TargetFacts::default())
}

/// From an HF `config.json` (the text model's part where there is one).
pub fn from_hf_config(json: &Value) -> TargetFacts {
    let text = json.get("text_config").filter(|t| t.is_object()).unwrap_or(json);
    let get = |k: &str| text.get(k).or_else(|| json.get(k));
    let max_position_embeddings = get("max_position_embeddings").and_then(Value::as_u64).map(|n| n as usize);
    let rope_scaling = match (get("rope_scaling"), get("rope_parameters")) {
        (Some(v), _) => Some(v.clone()),
        // transformers 5: one object with rope_theta (the spec carries it) and, for the default
        // kind, keys of the target's own attention (mrope sections, partial rotary) that a
        // drafter's full-rotary Qwen3 layers do not take.
        (None, Some(Value::Object(p))) => Some(match p.get("rope_type").and_then(Value::as_str) {
            None | Some("default") => Value::Null,
            Some(_) => {
                let mut p = p.clone();
                p.remove("rope_theta");
                Value::Object(p)
            }
        }),
        (None, _) => Some(Value::Null),
    };
    TargetFacts { max_position_embeddings, rope_scaling }
}

/// From GGUF metadata: `{arch}.context_length` and `{arch}.rope.scaling.*` (llama.cpp's names).
fn from_gguf(path: &Path) -> Result<TargetFacts, String> {
    let file = input_files::open_regular(path).map_err(|e| e.to_string())?;
    let meta = gguf_metadata(&mut BufReader::new(file), |key| {
        key == "general.architecture" || key.contains(".context_length") || key.contains(".rope.scaling.")
    })?;
    let arch = match meta.iter().find(|(k, _)| k == "general.architecture") {
        Some((_, Value::String(a))) => a.clone(),
        _ => return Err("no general.architecture".into()),
    };
    let get = |k: &str| meta.iter().find(|(key, _)| key == &format!("{arch}.{k}")).map(|(_, v)| v.clone());
    let max_position_embeddings = get("context_length").and_then(|v| v.as_u64()).map(|n| n as usize);
    let factor = get("rope.scaling.factor");
    let original = get("rope.scaling.original_context_length");
    let rope_scaling = match get("rope.scaling.type").as_ref().and_then(Value::as_str) {
        None | Some("none") => Value::Null,
        Some("linear") => serde_json::json!({"rope_type": "linear", "factor": factor}),
        Some("yarn") => {
            serde_json::json!({"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original})
        }
        Some(other) => serde_json::json!({"rope_type": other}),
    };
    Ok(TargetFacts { max_position_embeddings, rope_scaling: Some(rope_scaling) })
}

/// The metadata values whose keys `want` selects (numbers, strings and booleans; arrays are
/// skipped). The target plugin has read the file already; this walks the key-value section only,
/// with every length bounded by the file.
fn gguf_metadata<R: Read + Seek>(r: &mut R, want: impl Fn(&str) -> bool) -> Result<Vec<(String, Value)>, String> {
    let size = r.seek(SeekFrom::End(0)).map_err(|e| e.to_string())?;
    r.seek(SeekFrom::Start(0)).map_err(|e| e.to_string())?;
    let mut magic = [0u8; 4];
    r.read_exact(&mut magic).map_err(|e| e.to_string())?;
    if &magic != b"GGUF" {
        return Err("not a GGUF file".into());
    }
    let version = read_u32(r)?;
    if !(2..=3).contains(&version) {
        return Err(format!("GGUF version {version}"));
    }
    let _tensors = read_u64(r)?;
    let count = read_u64(r)?;
    let mut out = Vec::new();
    for _ in 0..count {
        let key = read_string(r, size)?;
        let ty = read_u32(r)?;
        if want(&key) && ty != 9 {
            out.push((key, read_value(r, ty, size)?));
        } else {
            skip_value(r, ty, size)?;
        }
    }
    Ok(out)
}

fn read_u32<R: Read>(r: &mut R) -> Result<u32, String> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b).map_err(|e| format!("truncated metadata: {e}"))?;
    Ok(u32::from_le_bytes(b))
}

fn read_u64<R: Read>(r: &mut R) -> Result<u64, String> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b).map_err(|e| format!("truncated metadata: {e}"))?;
    Ok(u64::from_le_bytes(b))
}

fn read_string<R: Read>(r: &mut R, size: u64) -> Result<String, String> {
    let len = read_u64(r)?;
    if len > size {
        return Err(format!("a string of {len} bytes in a file of {size}"));
    }
    let mut b = vec![0u8; len as usize];
    r.read_exact(&mut b).map_err(|e| format!("truncated metadata: {e}"))?;
    String::from_utf8(b).map_err(|e| e.to_string())
}

/// Bytes of a scalar of GGUF type `ty` (None: string or array).
fn scalar_bytes(ty: u32) -> Result<Option<u64>, String> {
    Ok(match ty {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        10..=12 => Some(8),
        8 | 9 => None,
        other => return Err(format!("metadata value type {other}")),
    })
}

fn read_value<R: Read>(r: &mut R, ty: u32, size: u64) -> Result<Value, String> {
    if ty == 8 {
        return Ok(Value::String(read_string(r, size)?));
    }
    let n = scalar_bytes(ty)?.expect("a scalar");
    let mut b = [0u8; 8];
    r.read_exact(&mut b[..n as usize]).map_err(|e| format!("truncated metadata: {e}"))?;
    Ok(match ty {
        0 => b[0].into(),
        1 => (b[0] as i8).into(),
        2 => u16::from_le_bytes([b[0], b[1]]).into(),
        3 => i16::from_le_bytes([b[0], b[1]]).into(),
        4 => u32::from_le_bytes([b[0], b[1], b[2], b[3]]).into(),
        5 => i32::from_le_bytes([b[0], b[1], b[2], b[3]]).into(),
        6 => (f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64).into(),
        7 => (b[0] != 0).into(),
        10 => u64::from_le_bytes(b).into(),
        11 => i64::from_le_bytes(b).into(),
        _ => f64::from_le_bytes(b).into(),
    })
}

fn skip_value<R: Read + Seek>(r: &mut R, ty: u32, size: u64) -> Result<(), String> {
    let skip = |r: &mut R, n: u64| -> Result<(), String> {
        if n > size {
            return Err(format!("a value of {n} bytes in a file of {size}"));
        }
        // Read through (a buffered reader's seek would drop its buffer at every token string).
        let read = std::io::copy(&mut r.by_ref().take(n), &mut std::io::sink()).map_err(|e| e.to_string())?;
        if read < n {
            return Err("truncated metadata".into());
        }
        Ok(())
    };
    match scalar_bytes(ty)? {
        Some(n) => skip(r, n),
        None if ty == 8 => {
            let len = read_u64(r)?;
            skip(r, len)
        }
        None => {
            let (item, count) = (read_u32(r)?, read_u64(r)?);
            if count > size {
                return Err(format!("an array of {count} items in a file of {size}"));
            }
            match scalar_bytes(item)? {
                Some(n) => skip(r, n * count),
                None => (0..count).try_for_each(|_| skip_value(r, item, size)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::io::Cursor;

    #[test]
    fn hf_configs_give_their_context_length_and_rope_scaling() {
        let f = from_hf_config(&json!({"max_position_embeddings": 40960, "rope_scaling": null, "rope_theta": 1e6}));
        assert_eq!(f, TargetFacts { max_position_embeddings: Some(40960), rope_scaling: Some(Value::Null) });
        // A multimodal checkpoint's text model, transformers 5's rope_parameters with mrope keys.
        let f = from_hf_config(&json!({"text_config": {"max_position_embeddings": 262144,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25}}}));
        assert_eq!(f, TargetFacts { max_position_embeddings: Some(262144), rope_scaling: Some(Value::Null) });
        let f = from_hf_config(
            &json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768}}),
        );
        assert_eq!(
            f.rope_scaling,
            Some(json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}))
        );
    }

    /// A GGUF header with a token array before the keys wanted, as llama.cpp writes them.
    #[test]
    fn gguf_metadata_is_walked_past_arrays() {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        b.extend_from_slice(&4u64.to_le_bytes());
        let key = |b: &mut Vec<u8>, k: &str, ty: u32| {
            b.extend_from_slice(&(k.len() as u64).to_le_bytes());
            b.extend_from_slice(k.as_bytes());
            b.extend_from_slice(&ty.to_le_bytes());
        };
        key(&mut b, "general.architecture", 8);
        b.extend_from_slice(&5u64.to_le_bytes());
        b.extend_from_slice(b"llama");
        key(&mut b, "tokenizer.ggml.tokens", 9);
        b.extend_from_slice(&8u32.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        for t in ["a", "bc"] {
            b.extend_from_slice(&(t.len() as u64).to_le_bytes());
            b.extend_from_slice(t.as_bytes());
        }
        key(&mut b, "llama.context_length", 4);
        b.extend_from_slice(&8192u32.to_le_bytes());
        key(&mut b, "llama.rope.scaling.type", 8);
        b.extend_from_slice(&6u64.to_le_bytes());
        b.extend_from_slice(b"linear");
        let meta = gguf_metadata(&mut Cursor::new(b.clone()), |_| true).unwrap();
        assert_eq!(meta.len(), 3, "{meta:?}");
        assert_eq!(meta[1], ("llama.context_length".to_string(), json!(8192)));
        // Truncated anywhere: an error, not a panic.
        for cut in [3, 20, 40, b.len() - 1] {
            assert!(gguf_metadata(&mut Cursor::new(b[..cut].to_vec()), |_| true).is_err(), "cut at {cut}");
        }
    }
}
