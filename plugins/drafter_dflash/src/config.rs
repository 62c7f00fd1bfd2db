//! The drafter's config: z-lab's `config.json` fields (the DFlash paper), so a checkpoint's config
//! reads straight in and our export reads straight out. Every field is one the drafter honours
//! or plain metadata (token ids, `auto_map`, `transformers_version`); any other field is
//! refused by name, so a config never means a model other than the one trained.

use drafter_layers::{
    dflash::{layer_windows, FULL_ATTENTION, SLIDING_ATTENTION},
    rope::RopeScaling,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use drafter_layers::dflash::DFlashSection;

/// z-lab DFlash `config.json` (a Qwen3 config plus DFlash fields), as SpecForge ships them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DFlashConfig {
    #[serde(default = "default_architectures")]
    pub architectures: Vec<String>,
    /// transformers' remote-code hook (z-lab's `dflash.py`); metadata here.
    #[serde(default = "default_auto_map")]
    pub auto_map: Value,
    #[serde(default = "default_model_type")]
    pub model_type: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// HF's `rope_scaling` (null: none); serving engines build the drafter's rotary from it.
    #[serde(default, with = "rope_json")]
    pub rope_scaling: RopeScaling,
    /// The target's context length: SGLang and vLLM size the drafter's rotary tables from it.
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub attention_dropout: f64,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default = "default_init")]
    pub initializer_range: f64,
    /// Metadata: the drafter has no embedding of its own (it borrows the target's).
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// The target's special tokens (metadata; HF allows a list for EOS).
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Value,
    #[serde(default)]
    pub pad_token_id: Option<u32>,
    pub block_size: usize,
    pub num_target_layers: usize,
    pub dflash_config: DFlashSection,
    /// `full_attention` or `sliding_attention` per layer (empty in old configs: derived from
    /// `use_sliding_window` / `max_window_layers` as HF's Qwen3Config does).
    #[serde(default)]
    pub layer_types: Vec<String>,
    #[serde(default)]
    pub sliding_window: Option<usize>,
    #[serde(default)]
    pub use_sliding_window: bool,
    /// HF Qwen3's older way to say which layers slide (from this index on); `layer_types` rules.
    #[serde(default)]
    pub max_window_layers: Option<usize>,
    #[serde(default = "yes")]
    pub use_cache: bool,
    /// The weights' dtype as exported (`torch_dtype` in transformers 4 files).
    #[serde(default = "default_dtype", alias = "torch_dtype")]
    pub dtype: String,
    /// Which transformers wrote the file (metadata, kept when read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transformers_version: Option<String>,
}

fn default_architectures() -> Vec<String> {
    vec!["DFlashDraftModel".into()]
}
pub fn default_auto_map() -> Value {
    serde_json::json!({"AutoModel": "dflash.DFlashDraftModel"})
}
fn default_model_type() -> String {
    "qwen3".into()
}
fn default_act() -> String {
    "silu".into()
}
fn default_init() -> f64 {
    drafter_layers::layers::INITIALIZER_RANGE
}
/// What a config without the field meant before (HF's Qwen3 default).
pub fn default_max_pos() -> usize {
    32768
}
fn default_dtype() -> String {
    "bfloat16".into()
}
fn yes() -> bool {
    true
}

/// `rope_scaling` as HF writes it, through [`RopeScaling`] (refusing kinds it does not honour).
mod rope_json {
    use super::*;
    use serde::{de::Error, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(r: &RopeScaling, s: S) -> Result<S::Ok, S::Error> {
        r.to_json().serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<RopeScaling, D::Error> {
        let v = Value::deserialize(d)?;
        RopeScaling::from_json(&v).map_err(|e| D::Error::custom(format!("field `rope_scaling`: {e}")))
    }
}

impl drafter_layers::shell::DFlashConfigJson for DFlashConfig {
    fn block_size(&self) -> usize {
        self.block_size
    }
    fn dflash(&self) -> &DFlashSection {
        &self.dflash_config
    }
}

impl DFlashConfig {
    pub fn dense_shape(&self) -> drafter_layers::layers::DenseShape {
        drafter_layers::layers::DenseShape {
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            rope_theta: self.rope_theta,
            rope_scaling: self.rope_scaling,
            rms_norm_eps: self.rms_norm_eps,
            initializer_range: self.initializer_range,
        }
    }

    /// Each layer's sliding window (None: full attention); the config is [`check`](Self::check)ed.
    pub fn windows(&self) -> Vec<Option<i64>> {
        layer_windows(&self.layer_types, self.sliding_window, self.num_hidden_layers).expect("a checked config")
    }

    /// Every parameter the drafter has for this config, by checkpoint name, with its shape (what
    /// `DFlashDrafter::new` builds; a test holds the two equal). Call on a
    /// [`check`](Self::check)ed config (its sizes are bounded, so no product overflows).
    pub fn parameter_shapes(&self) -> Vec<(String, Vec<i64>)> {
        let (h, f) = (self.hidden_size as i64, self.intermediate_size as i64);
        let (nh, nkv, d) = (self.num_attention_heads as i64, self.num_key_value_heads as i64, self.head_dim as i64);
        let n_feat = self.dflash_config.target_layer_ids.len() as i64;
        let mut out = vec![
            ("fc.weight".to_string(), vec![h, n_feat * h]),
            ("hidden_norm.weight".to_string(), vec![h]),
            ("norm.weight".to_string(), vec![h]),
        ];
        for i in 0..self.num_hidden_layers {
            let p = |name: &str, shape: Vec<i64>| (format!("layers.{i}.{name}.weight"), shape);
            out.extend([
                p("self_attn.q_proj", vec![nh * d, h]),
                p("self_attn.k_proj", vec![nkv * d, h]),
                p("self_attn.v_proj", vec![nkv * d, h]),
                p("self_attn.o_proj", vec![h, nh * d]),
                p("self_attn.q_norm", vec![d]),
                p("self_attn.k_norm", vec![d]),
                p("mlp.gate_proj", vec![f, h]),
                p("mlp.up_proj", vec![f, h]),
                p("mlp.down_proj", vec![h, f]),
                p("input_layernorm", vec![h]),
                p("post_attention_layernorm", vec![h]),
            ]);
        }
        out
    }

    /// The sliding window of the drafter's sliding-window layers, if it has any.
    pub fn window(&self) -> Option<i64> {
        self.windows().into_iter().flatten().next()
    }

    /// Fill what an older config leaves out (`layer_types`, `use_sliding_window`) the way HF's
    /// Qwen3Config does, then check that every field describes a model this drafter computes:
    /// the first field it cannot honour is named.
    pub fn check(&mut self) -> Result<(), String> {
        if self.layer_types.is_empty() {
            // HF: sliding from `max_window_layers` on, when `use_sliding_window` and a window.
            let from = self.max_window_layers.unwrap_or(self.num_hidden_layers);
            let slide = self.use_sliding_window && self.sliding_window.is_some();
            self.layer_types = (0..self.num_hidden_layers)
                .map(|i| if slide && i >= from { SLIDING_ATTENTION } else { FULL_ATTENTION }.to_string())
                .collect();
        }
        let bad = |field: &str, why: String| Err(format!("field `{field}`: {why}"));
        if self.architectures != default_architectures() {
            return bad(
                "architectures",
                format!("{:?}: this plugin computes [\"DFlashDraftModel\"] only", self.architectures),
            );
        }
        if self.model_type != "qwen3" {
            return bad("model_type", format!("`{}`: the draft layers are Qwen3 layers (\"qwen3\")", self.model_type));
        }
        if self.attention_bias {
            return bad("attention_bias", "true: the layers have no biases".into());
        }
        if self.attention_dropout != 0.0 {
            return bad("attention_dropout", format!("{}: training runs without dropout", self.attention_dropout));
        }
        if self.hidden_act != "silu" {
            return bad("hidden_act", format!("`{}`: the MLP is SwiGLU (\"silu\")", self.hidden_act));
        }
        use drafter_layers::dflash::{check_size, MAX_LAYERS, MAX_LAYER_SIZE, MAX_VOCAB_OR_CONTEXT};
        for (field, n, max) in [
            ("hidden_size", self.hidden_size, MAX_LAYER_SIZE),
            ("intermediate_size", self.intermediate_size, MAX_LAYER_SIZE),
            ("num_hidden_layers", self.num_hidden_layers, MAX_LAYERS),
            ("num_attention_heads", self.num_attention_heads, MAX_LAYER_SIZE),
            ("num_key_value_heads", self.num_key_value_heads, MAX_LAYER_SIZE),
            ("head_dim", self.head_dim, MAX_LAYER_SIZE),
            ("vocab_size", self.vocab_size, MAX_VOCAB_OR_CONTEXT),
            ("max_position_embeddings", self.max_position_embeddings, MAX_VOCAB_OR_CONTEXT),
        ] {
            check_size(field, n, max)?;
        }
        if let Some(w) = self.sliding_window {
            check_size("sliding_window", w, MAX_VOCAB_OR_CONTEXT)?;
        }
        drafter_layers::dflash::check_saved(&self.dflash_config, self.num_target_layers, self.vocab_size)?;
        let fits = self.num_attention_heads.checked_mul(self.head_dim).is_some_and(|n| n <= MAX_LAYER_SIZE)
            && self.dflash_config.target_layer_ids.len().checked_mul(self.hidden_size).is_some();
        if !fits {
            return bad(
                "num_attention_heads",
                format!("{} heads of {} features: more than {MAX_LAYER_SIZE}", self.num_attention_heads, self.head_dim),
            );
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return bad(
                "num_attention_heads",
                format!(
                    "{} is not a multiple of num_key_value_heads {}",
                    self.num_attention_heads, self.num_key_value_heads
                ),
            );
        }
        if self.head_dim % 2 != 0 {
            return bad("head_dim", format!("{}: must be even for RoPE", self.head_dim));
        }
        if !(2..=64).contains(&self.block_size) {
            return bad("block_size", format!("must be in 2..=64, got {}", self.block_size));
        }
        for (field, value) in [
            ("rope_theta", self.rope_theta),
            ("rms_norm_eps", self.rms_norm_eps),
            ("initializer_range", self.initializer_range),
        ] {
            if value.is_nan() || value <= 0.0 {
                return bad(field, format!("{value}: must be > 0"));
            }
        }
        let windows = layer_windows(&self.layer_types, self.sliding_window, self.num_hidden_layers)?;
        let sliding = windows.iter().any(Option::is_some);
        if sliding && !self.use_sliding_window {
            // HF's Qwen3Config drops the window then, and SpecForge refuses the layout.
            return bad("use_sliding_window", "false, but `layer_types` has sliding_attention layers".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<DFlashConfig, String> {
        let mut c: DFlashConfig = serde_json::from_str(json).map_err(|e| e.to_string())?;
        c.check()?;
        Ok(c)
    }

    const BASE: &str = r#""hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 101, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "block_size": 4, "num_target_layers": 8, "dflash_config": {"mask_token_id": 100, "target_layer_ids": [1, 3]}"#;

    #[test]
    fn old_configs_read_and_layouts_are_checked() {
        let c = parse(&format!("{{{BASE}, \"torch_dtype\": \"float32\"}}")).unwrap();
        assert_eq!(c.layer_types, [FULL_ATTENTION, FULL_ATTENTION]);
        assert_eq!((c.dtype.as_str(), c.max_position_embeddings, c.window()), ("float32", 32768, None));
        // HF's older way: sliding from max_window_layers on.
        let c = parse(&format!(
            "{{{BASE}, \"use_sliding_window\": true, \"sliding_window\": 8, \"max_window_layers\": 1}}"
        ))
        .unwrap();
        assert_eq!(c.windows(), [None, Some(8)]);
        let c = parse(&format!("{{{BASE}, \"layer_types\": [\"sliding_attention\", \"full_attention\"], \"use_sliding_window\": true, \"sliding_window\": 6}}")).unwrap();
        assert_eq!(c.windows(), [Some(6), None]);
        // Shorter than the block (4): SpecForge trains it, so it is read.
        let c = parse(&format!("{{{BASE}, \"layer_types\": [\"sliding_attention\", \"full_attention\"], \"use_sliding_window\": true, \"sliding_window\": 3}}")).unwrap();
        assert_eq!(c.windows(), [Some(3), None]);
        // What the drafter cannot compute is named.
        for (extra, field) in [
            (
                r#""layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": true"#,
                "`sliding_window` is not set",
            ),
            (
                r#""layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": true, "sliding_window": 0"#,
                "field `sliding_window`: 0",
            ),
            (
                r#""layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8"#,
                "field `use_sliding_window`",
            ),
            (r#""layer_types": ["chunked_attention", "full_attention"]"#, "`chunked_attention`"),
            (r#""layer_types": ["full_attention"]"#, "lists 1 layers"),
            (r#""attention_bias": true"#, "field `attention_bias`"),
            (r#""hidden_act": "gelu""#, "field `hidden_act`"),
            (r#""rope_scaling": {"rope_type": "dynamic", "factor": 2.0}"#, "rope_type `dynamic`"),
            (r#""partial_rotary_factor": 0.5"#, "unknown field `partial_rotary_factor`"),
            (r#""max_position_embeddings": 1099511627776"#, "field `max_position_embeddings`"),
        ] {
            let e = parse(&format!("{{{BASE}, {extra}}}")).unwrap_err();
            assert!(e.contains(field), "{extra}: {e}");
        }
        // Sizes no drafter has, and ids outside what the config itself says, are refused by name.
        for (from, to, field) in [
            (
                "\"hidden_size\": 64",
                "\"hidden_size\": 1099511627776",
                "field `hidden_size`: 1099511627776: must be in 1..=1048576",
            ),
            ("\"vocab_size\": 101", "\"vocab_size\": 1099511627776", "field `vocab_size`"),
            ("\"num_target_layers\": 8", "\"num_target_layers\": 3", "layer 3 is not below `num_target_layers` 3"),
            ("\"mask_token_id\": 100", "\"mask_token_id\": 101", "`dflash_config.mask_token_id`: 101 is outside"),
            ("\"head_dim\": 16", "\"head_dim\": 1048576", "more than 1048576"),
        ] {
            assert!(BASE.contains(from), "{from}");
            let e = parse(&format!("{{{}}}", BASE.replace(from, to))).unwrap_err();
            assert!(e.contains(field), "{to}: {e}");
        }
        let e = parse(&format!("{{{}}}", BASE.replace("[1, 3]}", "[1, 3], \"projector_type\": \"mlp\"}"))).unwrap_err();
        assert!(e.contains("unknown field `projector_type`"), "{e}");
    }
}
