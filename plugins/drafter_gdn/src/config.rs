//! The GDN drafter's `config.json` (a DFlash config plus Qwen3-Next's linear-attention fields,
//! same key names) and the `[drafter]` section that resolves to it against a target.

use drafter_layers::rope::RopeScaling;
use plugin_api::{PluginError, TargetSpec};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// What mixes the tokens in one draft layer; HF's `layer_types` names, with short aliases for
/// config files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, plugin_api::Describe)]
pub enum LayerType {
    /// Gated DeltaNet (`layers.{i}.linear_attn`).
    #[serde(rename = "linear_attention", alias = "gdn")]
    Gdn,
    /// DFlash's dense block attention (`layers.{i}.self_attn`).
    #[serde(rename = "full_attention", alias = "attention")]
    Attention,
}

pub use drafter_layers::dflash::DFlashSection;

/// The drafter's `config.json`: DFlash fields as z-lab names them, Qwen3-Next's for GDN. Other
/// fields are refused by name (a config never means a model other than the one computed).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GdnConfig {
    #[serde(default = "default_architectures")]
    pub architectures: Vec<String>,
    #[serde(default = "default_model_type")]
    pub model_type: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub layer_types: Vec<LayerType>,
    // Dense attention layers (Qwen3 attention, as drafter_dflash).
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f64,
    /// HF's `rope_scaling` (null: none), the target's.
    #[serde(default, with = "rope_json")]
    pub rope_scaling: RopeScaling,
    /// The target's context length (HF's Qwen3 default for configs written without it).
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    // GDN layers: q/k heads, value heads (a multiple: grouped values), head dims, conv width.
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_conv_kernel_dim: usize,
    /// Chunk length of the chunked (WY) delta rule; changes rounding only, not the model.
    #[serde(default = "default_chunk")]
    pub chunk_size: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    pub block_size: usize,
    pub num_target_layers: usize,
    pub dflash_config: DFlashSection,
    /// The weights' dtype as exported (`torch_dtype` in older files).
    #[serde(default = "default_dtype", alias = "torch_dtype")]
    pub dtype: String,
}

fn default_max_pos() -> usize {
    32768
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

fn default_architectures() -> Vec<String> {
    vec!["DFlashGdnDraftModel".into()]
}
fn default_model_type() -> String {
    "dflash_gdn".into()
}
fn default_act() -> String {
    "silu".into()
}
fn default_dtype() -> String {
    "bfloat16".into()
}
fn default_chunk() -> usize {
    64
}

impl drafter_layers::shell::DFlashConfigJson for GdnConfig {
    fn block_size(&self) -> usize {
        self.block_size
    }
    fn dflash(&self) -> &DFlashSection {
        &self.dflash_config
    }
}

impl GdnConfig {
    /// A saved config's sizes: each bounded (see `drafter_layers::dflash::MAX_LAYER_SIZE`), one
    /// layer type a layer, the DFlash fields inside its own sizes; the first wrong field named.
    pub fn check_saved(&self) -> Result<(), String> {
        use drafter_layers::dflash::{check_size, MAX_LAYERS, MAX_LAYER_SIZE, MAX_VOCAB_OR_CONTEXT};
        for (field, n, max) in [
            ("hidden_size", self.hidden_size, MAX_LAYER_SIZE),
            ("intermediate_size", self.intermediate_size, MAX_LAYER_SIZE),
            ("num_hidden_layers", self.num_hidden_layers, MAX_LAYERS),
            ("num_attention_heads", self.num_attention_heads, MAX_LAYER_SIZE),
            ("num_key_value_heads", self.num_key_value_heads, MAX_LAYER_SIZE),
            ("head_dim", self.head_dim, MAX_LAYER_SIZE),
            ("linear_num_key_heads", self.linear_num_key_heads, MAX_LAYER_SIZE),
            ("linear_num_value_heads", self.linear_num_value_heads, MAX_LAYER_SIZE),
            ("linear_key_head_dim", self.linear_key_head_dim, MAX_LAYER_SIZE),
            ("linear_value_head_dim", self.linear_value_head_dim, MAX_LAYER_SIZE),
            ("linear_conv_kernel_dim", self.linear_conv_kernel_dim, MAX_LAYER_SIZE),
            ("vocab_size", self.vocab_size, MAX_VOCAB_OR_CONTEXT),
            ("max_position_embeddings", self.max_position_embeddings, MAX_VOCAB_OR_CONTEXT),
        ] {
            check_size(field, n, max)?;
        }
        if self.layer_types.len() != self.num_hidden_layers {
            return Err(format!(
                "field `layer_types`: {} entries, `num_hidden_layers` is {}",
                self.layer_types.len(),
                self.num_hidden_layers
            ));
        }
        for (field, a, b) in [
            ("num_attention_heads", self.num_attention_heads, self.head_dim),
            ("linear_num_key_heads", self.linear_num_key_heads, self.linear_key_head_dim),
            ("linear_num_value_heads", self.linear_num_value_heads, self.linear_value_head_dim),
        ] {
            if a.checked_mul(b).is_none_or(|n| n > MAX_LAYER_SIZE) {
                return Err(format!("field `{field}`: {a} heads of {b} features: more than {MAX_LAYER_SIZE}"));
            }
        }
        drafter_layers::dflash::check_saved(&self.dflash_config, self.num_target_layers, self.vocab_size)
    }

    /// Every parameter the drafter has for this config, by checkpoint name, with its shape (what
    /// `GdnDrafter::new` builds; a test holds the two equal). Call on a config that passed
    /// [`check_saved`](Self::check_saved).
    pub fn parameter_shapes(&self) -> Vec<(String, Vec<i64>)> {
        let (h, f) = (self.hidden_size as i64, self.intermediate_size as i64);
        let (nh, nkv, d) = (self.num_attention_heads as i64, self.num_key_value_heads as i64, self.head_dim as i64);
        let (nk, nv) = (self.linear_num_key_heads as i64, self.linear_num_value_heads as i64);
        let (dk, dv) = (self.linear_key_head_dim as i64, self.linear_value_head_dim as i64);
        let n_feat = self.dflash_config.target_layer_ids.len() as i64;
        let mut out = vec![
            ("fc.weight".to_string(), vec![h, n_feat * h]),
            ("hidden_norm.weight".to_string(), vec![h]),
            ("norm.weight".to_string(), vec![h]),
        ];
        for (i, kind) in self.layer_types.iter().enumerate() {
            let p = |name: &str, shape: Vec<i64>| (format!("layers.{i}.{name}"), shape);
            match kind {
                LayerType::Gdn => out.extend([
                    p("linear_attn.q_proj.weight", vec![nk * dk, h]),
                    p("linear_attn.k_proj.weight", vec![nk * dk, h]),
                    p("linear_attn.v_proj.weight", vec![nv * dv, h]),
                    p("linear_attn.z_proj.weight", vec![nv * dv, h]),
                    p("linear_attn.a_proj.weight", vec![nv, h]),
                    p("linear_attn.b_proj.weight", vec![nv, h]),
                    p("linear_attn.out_proj.weight", vec![h, nv * dv]),
                    p("linear_attn.conv1d.weight", vec![2 * nk * dk + nv * dv, 1, self.linear_conv_kernel_dim as i64]),
                    p("linear_attn.A_log", vec![nv]),
                    p("linear_attn.dt_bias", vec![nv]),
                    p("linear_attn.norm.weight", vec![dv]),
                ]),
                LayerType::Attention => out.extend([
                    p("self_attn.q_proj.weight", vec![nh * d, h]),
                    p("self_attn.k_proj.weight", vec![nkv * d, h]),
                    p("self_attn.v_proj.weight", vec![nkv * d, h]),
                    p("self_attn.o_proj.weight", vec![h, nh * d]),
                    p("self_attn.q_norm.weight", vec![d]),
                    p("self_attn.k_norm.weight", vec![d]),
                ]),
            }
            out.extend([
                p("mlp.gate_proj.weight", vec![f, h]),
                p("mlp.up_proj.weight", vec![f, h]),
                p("mlp.down_proj.weight", vec![h, f]),
                p("input_layernorm.weight", vec![h]),
                p("post_attention_layernorm.weight", vec![h]),
            ]);
        }
        out
    }

    /// The dense attention layers' shape.
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
            initializer_range: drafter_layers::layers::INITIALIZER_RANGE,
        }
    }
}

drafter_layers::drafter_section! {
    /// The `[drafter]` section. The dense drafter's fields mean the same here, so switching
    /// `plugin = "dflash"` to `plugin = "gdn"` is the only change a config needs; the GDN fields
    /// default from the target.
    #[derive(Debug, Clone, Deserialize, plugin_api::Describe)]
    #[serde(deny_unknown_fields)]
    pub struct DrafterSection {
        /// Draft layers (default 5, or the length of `layer_types`).
        #[describe(range = "in 1..=64")]
        #[serde(default)]
        pub num_hidden_layers: Option<usize>,
        /// Every n-th layer is dense attention, the others GDN: 5 gives 4 GDN : 1 attention
        /// (`g g g g a`); a drafter with fewer than n layers is all GDN (1 layer: one GDN layer).
        #[describe(range = ">= 1")]
        #[serde(default = "default_interval")]
        pub full_attention_interval: usize,
        /// Explicit pattern, e.g. `["gdn", "gdn", "attention"]` (overrides the interval).
        #[serde(default)]
        pub layer_types: Option<Vec<LayerType>>,
        /// GDN q/k heads (default: the target's attention heads).
        #[serde(default)]
        pub linear_num_key_heads: Option<usize>,
        /// GDN value heads, a multiple of the key heads (default: the key heads).
        #[describe(range = "a multiple of linear_num_key_heads")]
        #[serde(default)]
        pub linear_num_value_heads: Option<usize>,
        /// GDN key head dim (default: the target's head_dim).
        #[describe(range = "> 0")]
        #[serde(default)]
        pub linear_key_head_dim: Option<usize>,
        /// GDN value head dim (default: the target's head_dim).
        #[serde(default)]
        pub linear_value_head_dim: Option<usize>,
        /// Short causal conv width.
        #[describe(range = "in 1..=16")]
        #[serde(default = "default_conv")]
        pub linear_conv_kernel_dim: usize,
        /// Chunk length of the chunked delta rule (16, 32 or 64 are usual).
        #[describe(range = "in 1..=256")]
        #[serde(default = "default_chunk")]
        pub chunk_size: usize,
    }
}

fn default_interval() -> usize {
    5
}
fn default_conv() -> usize {
    4
}

impl DrafterSection {
    /// The layer pattern: explicit, or every `full_attention_interval`-th layer attention.
    pub fn layer_types(&self) -> Result<Vec<LayerType>, PluginError> {
        let bad = |field: &str, why: String| Err(PluginError::new(format!("field `{field}`: {why}")));
        if let Some(types) = &self.layer_types {
            if let Some(n) = self.num_hidden_layers.filter(|&n| n != types.len()) {
                return bad("num_hidden_layers", format!("{n}, but `layer_types` lists {} layers", types.len()));
            }
            return Ok(types.clone());
        }
        if self.full_attention_interval == 0 {
            return bad("full_attention_interval", "must be >= 1".into());
        }
        let n = self.num_hidden_layers.unwrap_or_else(drafter_layers::section::default_num_hidden_layers);
        let every = self.full_attention_interval;
        Ok((0..n).map(|i| if (i + 1) % every == 0 { LayerType::Attention } else { LayerType::Gdn }).collect())
    }

    /// What can be checked without the target (the layer pattern, ranges), so a bad section is
    /// refused before the target loads; `resolve` runs it first.
    pub fn check(&self) -> Result<(), PluginError> {
        let bad = |field: &str, why: String| Err(PluginError::new(format!("field `{field}`: {why}")));
        let layers = self.layer_types()?.len();
        if layers == 0 || layers > 64 {
            return bad("num_hidden_layers", format!("must be in 1..=64, got {layers}"));
        }
        drafter_layers::dflash::check(self.block_size, self.num_target_features, self.target_layer_ids.as_deref())?;
        if let (Some(k), Some(v)) = (self.linear_num_key_heads, self.linear_num_value_heads) {
            if k == 0 || v % k != 0 {
                return bad(
                    "linear_num_value_heads",
                    format!("{v} must be a multiple of linear_num_key_heads ({k}), both > 0"),
                );
            }
        }
        if self.linear_key_head_dim == Some(0) || self.linear_value_head_dim == Some(0) {
            return bad("linear_key_head_dim", "head dims must be > 0".into());
        }
        if self.intermediate_size == Some(0) {
            return bad("intermediate_size", "0: must be >= 1".into());
        }
        if !(1..=16).contains(&self.linear_conv_kernel_dim) {
            return bad("linear_conv_kernel_dim", format!("must be in 1..=16, got {}", self.linear_conv_kernel_dim));
        }
        if !(1..=256).contains(&self.chunk_size) {
            return bad("chunk_size", format!("must be in 1..=256, got {}", self.chunk_size));
        }
        Ok(())
    }

    /// The full drafter config for `target`, validated.
    pub fn resolve(&self, target: &TargetSpec) -> Result<GdnConfig, PluginError> {
        let bad = |field: &str, why: String| Err(PluginError::new(format!("field `{field}`: {why}")));
        self.check()?;
        let l = target.num_hidden_layers as usize;
        let layer_types = self.layer_types()?;
        let dflash_config = drafter_layers::dflash::resolve(
            self.block_size,
            self.num_target_features,
            self.target_layer_ids.as_deref(),
            self.mask_token_id,
            target,
        )?;
        let key_heads = self.linear_num_key_heads.unwrap_or(target.num_attention_heads as usize);
        let value_heads = self.linear_num_value_heads.unwrap_or(key_heads);
        if key_heads == 0 || value_heads % key_heads != 0 {
            return bad(
                "linear_num_value_heads",
                format!("{value_heads} must be a multiple of linear_num_key_heads ({key_heads}), both > 0"),
            );
        }
        let key_dim = self.linear_key_head_dim.unwrap_or(target.head_dim as usize);
        let value_dim = self.linear_value_head_dim.unwrap_or(target.head_dim as usize);
        if key_dim == 0 || value_dim == 0 {
            return bad("linear_key_head_dim", "head dims must be > 0".into());
        }
        // The dense layers' RoPE and the context length, as the target has them.
        let facts = drafter_layers::target_facts::read(target)?;
        let rope_scaling = match facts.rope_scaling {
            Some(v) => RopeScaling::from_json(&v)
                .map_err(|e| PluginError::new(format!("the target's rope_scaling ({}): {e}", target.source)))?,
            None => RopeScaling::Default,
        };
        Ok(GdnConfig {
            architectures: default_architectures(),
            model_type: default_model_type(),
            hidden_size: target.hidden_size as usize,
            intermediate_size: self.intermediate_size.unwrap_or(target.intermediate_size as usize),
            num_hidden_layers: layer_types.len(),
            layer_types,
            num_attention_heads: target.num_attention_heads as usize,
            num_key_value_heads: target.num_key_value_heads as usize,
            head_dim: target.head_dim as usize,
            rope_theta: target.rope_theta,
            rope_scaling,
            max_position_embeddings: facts.max_position_embeddings.unwrap_or_else(default_max_pos),
            linear_num_key_heads: key_heads,
            linear_num_value_heads: value_heads,
            linear_key_head_dim: key_dim,
            linear_value_head_dim: value_dim,
            linear_conv_kernel_dim: self.linear_conv_kernel_dim,
            chunk_size: self.chunk_size,
            vocab_size: target.vocab_size as usize,
            rms_norm_eps: target.rms_norm_eps,
            hidden_act: default_act(),
            block_size: self.block_size,
            num_target_layers: l,
            dflash_config,
            dtype: default_dtype(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use LayerType::{Attention as A, Gdn as G};

    fn section(text: &str) -> DrafterSection {
        plugin_api::parse_section(text).unwrap()
    }

    #[test]
    fn layer_patterns() {
        assert_eq!(section("").layer_types().unwrap(), vec![G, G, G, G, A]);
        assert_eq!(section("num_hidden_layers = 1").layer_types().unwrap(), vec![G]);
        assert_eq!(section("num_hidden_layers = 8").layer_types().unwrap(), vec![G, G, G, G, A, G, G, G]);
        assert_eq!(
            section("num_hidden_layers = 4\nfull_attention_interval = 2").layer_types().unwrap(),
            vec![G, A, G, A]
        );
        let explicit = section("layer_types = [\"gdn\", \"attention\", \"linear_attention\", \"full_attention\"]");
        assert_eq!(explicit.layer_types().unwrap(), vec![G, A, G, A]);
        let e = section("num_hidden_layers = 3\nlayer_types = [\"gdn\"]").layer_types().unwrap_err().to_string();
        assert!(e.contains("field `num_hidden_layers`"), "{e}");
        let e = plugin_api::parse_section::<DrafterSection>("layer_types = [\"mamba\"]").unwrap_err().to_string();
        assert!(e.contains("unknown variant `mamba`"), "{e}");
    }

    /// config.json writes HF's layer type names and reads them back.
    #[test]
    fn layer_types_serialize_with_hf_names() {
        assert_eq!(serde_json::to_string(&[G, A]).unwrap(), r#"["linear_attention","full_attention"]"#);
        assert_eq!(
            serde_json::from_str::<Vec<LayerType>>(r#"["linear_attention","full_attention"]"#).unwrap(),
            vec![G, A]
        );
    }
}
