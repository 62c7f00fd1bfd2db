//! The DFlash fields every drafter has, whatever its layers: block size, target layers and mask
//! token (resolved against the target), and reading a saved drafter folder back.

use plugin_api::{NamedTensor, PluginError, TargetSpec};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use std::path::Path;

/// z-lab's `dflash_config`: the token fed at masked block positions and the target layers read.
/// Other keys (SpecForge's `projector_type`, `shift_label`, ...) change the model and are refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DFlashSection {
    pub mask_token_id: u32,
    pub target_layer_ids: Vec<u32>,
}

/// The `[drafter]` section's DFlash fields, checked as far as they can be without the target
/// (so a bad value is refused before it loads); [`resolve`] runs this first.
pub fn check(
    block_size: usize,
    num_target_features: usize,
    target_layer_ids: Option<&[u32]>,
) -> Result<(), PluginError> {
    let bad = |field: &str, why: String| Err(PluginError::new(format!("field `{field}`: {why}")));
    if !(2..=64).contains(&block_size) {
        return bad("block_size", format!("must be in 2..=64, got {block_size}"));
    }
    if target_layer_ids.is_none() && num_target_features == 0 {
        return bad("num_target_features", "must be >= 1, got 0".into());
    }
    if target_layer_ids.is_some_and(<[u32]>::is_empty) {
        return bad("target_layer_ids", "must not be empty".into());
    }
    Ok(())
}

/// The `[drafter]` section's DFlash fields, checked and resolved against `target`: explicit
/// target layers or `num_target_features` spread by the DFlash paper's formula; the mask token, by
/// default the target's pad token when it is not its EOS token.
pub fn resolve(
    block_size: usize,
    num_target_features: usize,
    target_layer_ids: Option<&[u32]>,
    mask_token_id: Option<u32>,
    target: &TargetSpec,
) -> Result<DFlashSection, PluginError> {
    let bad = |field: &str, why: String| Err(PluginError::new(format!("field `{field}`: {why}")));
    check(block_size, num_target_features, target_layer_ids)?;
    let l = target.num_hidden_layers as usize;
    let ids = match target_layer_ids {
        Some(ids) => ids.to_vec(),
        None => {
            if num_target_features == 0 || num_target_features > l {
                return bad(
                    "num_target_features",
                    format!("must be in 1..={l} (the target's layers), got {num_target_features}"),
                );
            }
            crate::target_layer_ids(l, num_target_features)
        }
    };
    if ids.is_empty() {
        return bad("target_layer_ids", "must not be empty".into());
    }
    if let Some(bad_id) = ids.iter().find(|&&i| i as usize >= l) {
        return bad("target_layer_ids", format!("layer {bad_id} does not exist (the target has {l} layers)"));
    }
    let mask_token_id =
        match mask_token_id {
            Some(id) => id,
            None => match target.pad_token_id.into_option() {
                Some(pad) if pad != target.eos_token_id => pad,
                _ => return bad(
                    "mask_token_id",
                    "not set and the target has no pad token distinct from EOS to use; set it to an unused token id"
                        .into(),
                ),
            },
        };
    if mask_token_id >= target.vocab_size {
        return bad("mask_token_id", format!("{mask_token_id} is outside the vocabulary ({})", target.vocab_size));
    }
    Ok(DFlashSection { mask_token_id, target_layer_ids: ids })
}

/// The largest a saved drafter's config.json may make a layer's size or head count (2^20: far past
/// any model), its layer counts (1024) and its vocabulary or context (2^24): a config beyond them
/// is refused by name before any shape is computed from it.
pub const MAX_LAYER_SIZE: usize = 1 << 20;
pub const MAX_LAYERS: usize = 1024;
pub const MAX_VOCAB_OR_CONTEXT: usize = 1 << 24;

/// `n` (field `field`) in 1..=`max`.
pub fn check_size(field: &str, n: usize, max: usize) -> Result<(), String> {
    if n == 0 || n > max {
        return Err(format!("field `{field}`: {n}: must be in 1..={max}"));
    }
    Ok(())
}

/// A saved drafter config's DFlash fields against its own sizes: `num_target_layers` bounded, the
/// target layers inside it (and some), the mask token inside the vocabulary.
pub fn check_saved(dflash: &DFlashSection, num_target_layers: usize, vocab_size: usize) -> Result<(), String> {
    check_size("num_target_layers", num_target_layers, MAX_LAYERS)?;
    if dflash.target_layer_ids.is_empty() {
        return Err("field `dflash_config.target_layer_ids`: must not be empty".into());
    }
    if let Some(id) = dflash.target_layer_ids.iter().find(|&&i| i as usize >= num_target_layers) {
        return Err(format!(
            "field `dflash_config.target_layer_ids`: layer {id} is not below `num_target_layers` {num_target_layers}"
        ));
    }
    if dflash.mask_token_id as usize >= vocab_size {
        return Err(format!(
            "field `dflash_config.mask_token_id`: {} is outside the vocabulary ({vocab_size})",
            dflash.mask_token_id
        ));
    }
    Ok(())
}

/// HF's `layer_types` names for a dense drafter's attention layers.
pub const FULL_ATTENTION: &str = "full_attention";
pub const SLIDING_ATTENTION: &str = "sliding_attention";

/// Each layer's sliding window (None: full attention) from HF's `layer_types` and
/// `sliding_window`, checked: one entry per layer, known names, a window of at least one position
/// for sliding layers. A window applies to the context keys (the query at block offset i sees
/// the context from anchor + i - W + 1 on); a block's own keys up to the query are always seen,
/// whatever W, as SpecForge trains it. A window shorter than the block is allowed: its queries
/// at offsets W - 1 and on see no context, only their block. (SGLang and vLLM run a sliding
/// DFlash layer as a causal sliding-window decoder layer, which also cuts a block's keys older
/// than W: the same model where W >= block_size, not below it.)
pub fn layer_windows(
    layer_types: &[String],
    sliding_window: Option<usize>,
    num_layers: usize,
) -> Result<Vec<Option<i64>>, String> {
    if layer_types.len() != num_layers {
        return Err(format!("`layer_types` lists {} layers, `num_hidden_layers` is {num_layers}", layer_types.len()));
    }
    layer_types
        .iter()
        .map(|t| match t.as_str() {
            FULL_ATTENTION => Ok(None),
            SLIDING_ATTENTION => match sliding_window {
                None => Err(format!("`layer_types` has `{SLIDING_ATTENTION}` layers but `sliding_window` is not set")),
                Some(0) => Err("`sliding_window` 0: a window holds at least the query's own position".into()),
                Some(w) => Ok(Some(w as i64)),
            },
            other => Err(format!("`layer_types` entry `{other}` is not `{FULL_ATTENTION}` or `{SLIDING_ATTENTION}`")),
        })
        .collect()
}

/// A saved drafter folder's `config.json` (a regular file of at most
/// `input_files::limits::CONFIG_JSON` bytes: a FIFO is refused, not waited on); errors name the
/// file.
pub fn read_config<C: DeserializeOwned>(dir: &Path) -> Result<C, PluginError> {
    let path = dir.join("config.json");
    let text = input_files::read_to_string_capped(&path, input_files::limits::CONFIG_JSON)
        .map_err(|e| PluginError::new(e.to_string()))?;
    serde_json::from_str(&text).map_err(|e| PluginError::new(format!("{}: {e}", path.display())))
}

/// A saved drafter folder's `model.safetensors`, memory-mapped from the handle that was checked
/// to be a regular file; errors name the file.
pub fn read_weights(dir: &Path) -> Result<Vec<NamedTensor>, PluginError> {
    let path = dir.join("model.safetensors");
    let weights = input_files::tensors::read_safetensors(&path).map_err(|e| PluginError::new(e.to_string()))?;
    Ok(weights.into_iter().map(|(n, t)| NamedTensor::new(n, t)).collect())
}

/// A saved drafter's sizes against the target it is loaded for.
pub fn check_fits(
    dir: &Path,
    hidden_size: usize,
    vocab_size: usize,
    dflash: &DFlashSection,
    target: &TargetSpec,
) -> Result<(), PluginError> {
    let mismatch = |what: &str, ours: usize, theirs: u32| {
        Err(PluginError::new(format!("{}: {what} {ours} does not fit the target's {theirs}", dir.display())))
    };
    if hidden_size != target.hidden_size as usize {
        return mismatch("hidden_size", hidden_size, target.hidden_size);
    }
    if vocab_size != target.vocab_size as usize {
        return mismatch("vocab_size", vocab_size, target.vocab_size);
    }
    if let Some(&id) = dflash.target_layer_ids.iter().find(|&&i| i >= target.num_hidden_layers) {
        return mismatch("target layer", id as usize, target.num_hidden_layers);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn types(t: &[&str]) -> Vec<String> {
        t.iter().map(|s| s.to_string()).collect()
    }

    /// A window shorter than the block is a model (SpecForge trains it); 0 is none, and a sliding
    /// layer needs a window.
    #[test]
    fn sliding_windows_of_any_length_from_one_are_accepted() {
        let layout = types(&[SLIDING_ATTENTION, FULL_ATTENTION]);
        for w in [1, 3, 16, 2048] {
            assert_eq!(layer_windows(&layout, Some(w), 2), Ok(vec![Some(w as i64), None]));
        }
        assert_eq!(
            layer_windows(&layout, Some(0), 2),
            Err("`sliding_window` 0: a window holds at least the query's own position".into())
        );
        assert!(layer_windows(&layout, None, 2).unwrap_err().contains("`sliding_window` is not set"));
        assert!(layer_windows(&layout, Some(4), 3).unwrap_err().contains("lists 2 layers"));
        let e = layer_windows(&types(&["chunked_attention"]), Some(4), 1).unwrap_err();
        assert!(e.contains("`chunked_attention`"), "{e}");
    }
}
