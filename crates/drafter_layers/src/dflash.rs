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

/// HF's `layer_types` names for a dense drafter's attention layers.
pub const FULL_ATTENTION: &str = "full_attention";
pub const SLIDING_ATTENTION: &str = "sliding_attention";

/// Each layer's sliding window (None: full attention) from HF's `layer_types` and
/// `sliding_window`, checked: one entry per layer, known names, a window for sliding layers that
/// is at least a block (a shorter one would cut the block's own keys, which neither SpecForge
/// nor SGLang agree on).
pub fn layer_windows(
    layer_types: &[String],
    sliding_window: Option<usize>,
    num_layers: usize,
    block_size: usize,
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
                Some(w) if w < block_size => {
                    Err(format!("`sliding_window` {w} is shorter than a block ({block_size})"))
                }
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
