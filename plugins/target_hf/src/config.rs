//! The decoder's config, read from an HF `config.json` (field names are HF's) or from GGUF
//! metadata (`{arch}.block_count`, ...).
//!
//! One struct serves every architecture; the fields a family lacks are `None` (HF's own class
//! defaults apply where transformers 5.8.1 has one: the Qwen3.5 linear-attention shapes, head_dim
//! 256, `full_attention_interval` 4, `partial_rotary_factor` 0.25). A multimodal checkpoint's
//! config (`Qwen3_5ForConditionalGeneration`) nests the language model's under `text_config`:
//! [`DecoderConfig::from_hf_json`] reads that one.

use crate::gguf::{GgufError, GgufFile};
use rope_scaling::RopeScaling;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The `model_type`s this plugin runs (the `_text` variants of the Qwen3.5 configs read as their
/// family).
pub const SUPPORTED: [&str; 6] = ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe"];

/// The families, by how their layers are built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    /// Qwen3 attention, routed experts (no shared expert).
    Qwen3Moe,
    /// Gated DeltaNet + gated attention hybrid, dense MLP (Qwen3.5, Qwen3.6).
    Qwen35,
    /// The same hybrid with routed experts and a gated shared expert.
    Qwen35Moe,
}

/// What a layer mixes tokens with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mixer {
    /// Softmax attention (Qwen3.5's: with an output gate and partial RoPE).
    Attention,
    /// Gated DeltaNet (`linear_attention` in `layer_types`).
    Linear,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DecoderConfig {
    /// `llama`, `qwen2`, `qwen3`, `qwen3_moe`, `qwen3_5` or `qwen3_5_moe`.
    pub model_type: String,
    pub hidden_size: usize,
    /// The dense MLP's width (absent in Qwen3.5-MoE configs: every layer is sparse).
    #[serde(default)]
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    pub vocab_size: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// Absent: transformers' default for the model type ([`hf_default_theta`]), logged.
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    /// The context length; dynamic NTK scaling starts past it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_position_embeddings: Option<usize>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Biases on q/k/v (Qwen2 has them; HF's qwen2 config does not say so, the model does).
    #[serde(default)]
    pub attention_bias: Option<bool>,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Option<EosId>,
    #[serde(default)]
    pub pad_token_id: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_act: Option<String>,
    /// transformers 5's RoPE settings (`rope_theta`, `rope_type`, `partial_rotary_factor`); older
    /// configs have `rope_theta` at the top level.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partial_rotary_factor: Option<f64>,
    /// A GGUF's `rope_freqs.weight`: each frequency divided by its factor (how llama.cpp stores
    /// Llama 3's scaling); not an HF key.
    #[serde(skip)]
    pub rope_freq_factors: Option<Vec<f64>>,

    // Hybrids (Qwen3.5): which layers are Gated DeltaNet, and its shapes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_types: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub full_attention_interval: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linear_conv_kernel_dim: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linear_key_head_dim: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linear_value_head_dim: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linear_num_key_heads: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linear_num_value_heads: Option<usize>,

    // Mixture of experts. transformers 5 writes qwen3_moe's count as `num_local_experts`.
    #[serde(default, alias = "num_local_experts", skip_serializing_if = "Option::is_none")]
    pub num_experts: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_experts_per_tok: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe_intermediate_size: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_expert_intermediate_size: Option<usize>,
    /// Renormalise the top-k router weights to sum 1 (qwen3_moe; Qwen3.5-MoE always does).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub norm_topk_prob: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decoder_sparse_step: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlp_only_layers: Option<Vec<usize>>,
}

/// HF allows one EOS id or a list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum EosId {
    One(u32),
    Many(Vec<u32>),
}

fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10000.0
}

/// transformers 5.8.1's `default_theta` for a model type: 10000 for every family this plugin
/// runs (none of their config classes overrides the mixin's).
pub fn hf_default_theta(_model_type: &str) -> f64 {
    10000.0
}

/// llama.cpp's `{arch}.rope.scaling.*` metadata as HF's `rope_scaling` (linear, yarn; another
/// type is refused by [`DecoderConfig::validate`] naming it). Llama 3's scaling is no metadata
/// but the `rope_freqs.weight` tensor ([`DecoderConfig::rope_freq_factors`]).
fn gguf_rope_scaling(g: &GgufFile, arch: &str) -> Option<serde_json::Value> {
    let key = |k: &str| format!("{arch}.rope.scaling.{k}");
    let kind = g.meta_str(&key("type")).ok()?;
    let factor = g.meta_f32(&key("factor")).ok().map(f64::from);
    let context = g.meta_usize(&key("original_context_length")).ok();
    Some(match kind {
        "none" => return None,
        "linear" => serde_json::json!({"rope_type": "linear", "factor": factor}),
        "yarn" => {
            serde_json::json!({"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": context})
        }
        other => serde_json::json!({"rope_type": other}),
    })
}

/// The Gated DeltaNet shapes of a hybrid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearShape {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    pub conv_kernel: usize,
}

impl LinearShape {
    /// Channels of the conv (q | k | v).
    pub fn conv_channels(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }
}

/// The routed experts of a sparse layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeShape {
    pub experts: usize,
    pub top_k: usize,
    pub intermediate: usize,
    pub norm_topk: bool,
    /// The shared expert's width (Qwen3.5-MoE), gated by sigmoid(x . shared_expert_gate).
    pub shared_intermediate: Option<usize>,
}

impl DecoderConfig {
    /// An HF `config.json`: the language model's config, also when it is nested under
    /// `text_config` (multimodal checkpoints); the checkpoint's `architectures` entry is returned
    /// for the log. `model_type` `qwen3_5_text` / `qwen3_5_moe_text` read as their family.
    pub fn from_hf_json(text: &str) -> Result<(Self, Option<String>), String> {
        let outer: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let arch_name = outer["architectures"].get(0).and_then(|a| a.as_str()).map(str::to_string);
        let mut inner = match outer.get("text_config") {
            Some(t) if t.is_object() => t.clone(),
            _ => outer.clone(),
        };
        // Keys a multimodal config keeps at the top level only.
        for key in ["model_type", "tie_word_embeddings", "eos_token_id", "bos_token_id", "pad_token_id"] {
            if inner.get(key).is_none_or(|v| v.is_null()) {
                if let Some(v) = outer.get(key) {
                    inner[key] = v.clone();
                }
            }
        }
        let theta_given = inner.get("rope_theta").is_some_and(|t| !t.is_null());
        let mut cfg: Self = serde_json::from_value(inner).map_err(|e| e.to_string())?;
        cfg.model_type = cfg.model_type.trim_end_matches("_text").to_string();
        if let Some(theta) = cfg.rope_parameters.as_ref().and_then(|r| r["rope_theta"].as_f64()) {
            cfg.rope_theta = theta;
        } else if !theta_given {
            cfg.rope_theta = hf_default_theta(&cfg.model_type);
            eprintln!(
                "config.json has no rope_theta: transformers' default for {}, {}",
                cfg.model_type, cfg.rope_theta
            );
        }
        Ok((cfg, arch_name))
    }

    /// `path`: a config.json or a folder holding one.
    pub fn read(path: &Path) -> Result<Self, String> {
        let file = match input_files::check_path(path).map_err(|e| e.to_string())? {
            input_files::PathKind::Dir => path.join("config.json"),
            input_files::PathKind::File => path.to_path_buf(),
        };
        let text =
            input_files::read_to_string_capped(&file, input_files::limits::CONFIG_JSON).map_err(|e| e.to_string())?;
        let (cfg, _) = Self::from_hf_json(&text).map_err(|e| format!("{}: {e}", file.display()))?;
        cfg.validate().map_err(|e| format!("{}: {e}", file.display()))?;
        Ok(cfg)
    }

    /// The family; call after [`validate`](Self::validate) (an unknown type reads as Llama).
    pub fn arch(&self) -> Arch {
        match self.model_type.as_str() {
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "qwen3_moe" => Arch::Qwen3Moe,
            "qwen3_5" => Arch::Qwen35,
            "qwen3_5_moe" => Arch::Qwen35Moe,
            _ => Arch::Llama,
        }
    }

    pub fn is_hybrid(&self) -> bool {
        matches!(self.arch(), Arch::Qwen35 | Arch::Qwen35Moe)
    }

    pub fn num_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        if let Some(d) = self.head_dim {
            return d;
        }
        if self.is_hybrid() {
            return 256; // Qwen3_5TextConfig's default
        }
        // 0 heads is refused by `validate`; until then it must not divide by zero.
        self.hidden_size.checked_div(self.num_attention_heads).unwrap_or(0)
    }

    /// Head dims RoPE rotates: all of them, or the first `partial_rotary_factor` share (Qwen3.5:
    /// 0.25, so 64 of 256).
    pub fn rotary_dim(&self) -> usize {
        let factor = self
            .rope_parameters
            .as_ref()
            .and_then(|r| r["partial_rotary_factor"].as_f64())
            .or(self.partial_rotary_factor)
            .unwrap_or(if self.is_hybrid() { 0.25 } else { 1.0 });
        (self.head_dim() as f64 * factor) as usize
    }

    /// The RoPE scaling: `rope_scaling`, or transformers 5's `rope_parameters` less the keys
    /// that are not scaling (theta, partial rotary, Qwen3.5's mrope sections: text positions
    /// are equal in its three sections, so they rotate as plain RoPE). As transformers does,
    /// llama3 and yarn without `original_max_position_embeddings` take `max_position_embeddings`.
    pub fn rope_scaling(&self) -> Result<RopeScaling, String> {
        let (key, mut v) = match (&self.rope_scaling, &self.rope_parameters) {
            (Some(v), _) if !v.is_null() => ("rope_scaling", v.clone()),
            (_, Some(v)) => ("rope_parameters", v.clone()),
            _ => return Ok(RopeScaling::Default),
        };
        if let Some(o) = v.as_object_mut() {
            for k in ["rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"] {
                o.remove(k);
            }
            if o.is_empty() {
                return Ok(RopeScaling::Default);
            }
            let kind = o.get("rope_type").or(o.get("type")).and_then(|t| t.as_str()).unwrap_or("");
            if matches!(kind, "llama3" | "yarn") && !o.contains_key("original_max_position_embeddings") {
                if let Some(m) = self.max_position_embeddings {
                    o.insert("original_max_position_embeddings".into(), m.into());
                }
            }
        }
        let scaling = RopeScaling::from_json_any(&v).map_err(|e| format!("{key}: {e}"))?;
        if scaling.depends_on_length() && self.max_position_embeddings.is_none() {
            return Err(format!("{key}: rope_type `dynamic` needs `max_position_embeddings`"));
        }
        Ok(scaling)
    }

    pub fn qkv_bias(&self) -> bool {
        self.attention_bias.unwrap_or(self.model_type == "qwen2")
    }

    /// Qwen3 and its successors normalise q and k per head before RoPE.
    pub fn qk_norm(&self) -> bool {
        matches!(self.arch(), Arch::Qwen3 | Arch::Qwen3Moe | Arch::Qwen35 | Arch::Qwen35Moe)
    }

    /// Qwen3.5's RMSNorms scale by (1 + weight) (weights stored centred on 0); its attention
    /// projects a sigmoid output gate along with q.
    pub fn centred_norms(&self) -> bool {
        self.is_hybrid()
    }

    /// Layer `i`'s token mixer.
    pub fn mixer(&self, i: usize) -> Mixer {
        if !self.is_hybrid() {
            return Mixer::Attention;
        }
        let interval = self.full_attention_interval.unwrap_or(4).max(1);
        let linear = match &self.layer_types {
            Some(types) => types.get(i).is_some_and(|t| t == "linear_attention"),
            None => (i + 1) % interval != 0,
        };
        if linear {
            Mixer::Linear
        } else {
            Mixer::Attention
        }
    }

    /// Every layer's token mixer (a `num_hidden_layers` long list: for a validated model only).
    pub fn mixers(&self) -> Vec<Mixer> {
        (0..self.num_hidden_layers).map(|i| self.mixer(i)).collect()
    }

    /// The Gated DeltaNet shapes (transformers' Qwen3.5 defaults where the config is silent).
    pub fn linear(&self) -> LinearShape {
        LinearShape {
            key_heads: self.linear_num_key_heads.unwrap_or(16),
            value_heads: self.linear_num_value_heads.unwrap_or(32),
            key_dim: self.linear_key_head_dim.unwrap_or(128),
            value_dim: self.linear_value_head_dim.unwrap_or(128),
            conv_kernel: self.linear_conv_kernel_dim.unwrap_or(4),
        }
    }

    /// The routed experts, for a MoE family.
    pub fn moe(&self) -> Option<MoeShape> {
        match self.arch() {
            Arch::Qwen3Moe => Some(MoeShape {
                experts: self.num_experts.unwrap_or(128),
                top_k: self.num_experts_per_tok.unwrap_or(8),
                intermediate: self.moe_intermediate_size.unwrap_or(768),
                norm_topk: self.norm_topk_prob.unwrap_or(false),
                shared_intermediate: None,
            }),
            Arch::Qwen35Moe => Some(MoeShape {
                experts: self.num_experts.unwrap_or(256),
                top_k: self.num_experts_per_tok.unwrap_or(8),
                intermediate: self.moe_intermediate_size.unwrap_or(512),
                norm_topk: true,
                shared_intermediate: Some(self.shared_expert_intermediate_size.unwrap_or(512)),
            }),
            _ => None,
        }
    }

    /// Whether layer `i`'s MLP is the sparse block (qwen3_moe: every `decoder_sparse_step`-th
    /// layer not in `mlp_only_layers`; Qwen3.5-MoE: all).
    pub fn is_sparse_layer(&self, i: usize) -> bool {
        match self.arch() {
            Arch::Qwen35Moe => true,
            Arch::Qwen3Moe => {
                let step = self.decoder_sparse_step.unwrap_or(1).max(1);
                !self.mlp_only_layers.as_ref().is_some_and(|l| l.contains(&i))
                    && self.num_experts.unwrap_or(128) > 0
                    && (i + 1) % step == 0
            }
            _ => false,
        }
    }

    /// Whether some layer has a dense MLP (without a loop over a count that may be hostile).
    fn has_dense_mlp(&self) -> bool {
        let n = self.num_hidden_layers;
        match self.arch() {
            Arch::Qwen35Moe => false,
            Arch::Qwen3Moe => {
                n > 0
                    && (self.num_experts == Some(0)
                        || self.decoder_sparse_step.unwrap_or(1) > 1
                        || self.mlp_only_layers.as_ref().is_some_and(|l| l.iter().any(|&i| i < n)))
            }
            _ => n > 0,
        }
    }

    /// The FFN width the drafter defaults to (`TargetSpec::intermediate_size`): the dense MLP's, or
    /// for a model without one the active expert width (top-k x expert width).
    pub fn spec_intermediate_size(&self) -> usize {
        match (self.intermediate_size, self.moe()) {
            (0, Some(m)) => m.top_k * m.intermediate,
            (f, _) => f,
        }
    }

    pub fn eos(&self) -> Option<u32> {
        match &self.eos_token_id {
            Some(EosId::One(id)) => Some(*id),
            Some(EosId::Many(ids)) => ids.first().copied(),
            None => None,
        }
    }

    /// What the host and the drafter learn of this model (`TargetSpec`), None without an EOS id.
    /// Where it came from (chat template, source, its SHA-256) is the loader's to fill in.
    pub fn target_spec(&self) -> Option<plugin_api::TargetSpec> {
        Some(plugin_api::TargetSpec {
            architecture: self.model_type.clone().into(),
            num_hidden_layers: self.num_hidden_layers as u32,
            hidden_size: self.hidden_size as u32,
            vocab_size: self.vocab_size as u32,
            num_attention_heads: self.num_attention_heads as u32,
            num_key_value_heads: self.num_kv_heads() as u32,
            head_dim: self.head_dim() as u32,
            intermediate_size: self.spec_intermediate_size() as u32,
            rope_theta: self.rope_theta,
            rms_norm_eps: self.rms_norm_eps,
            bos_token_id: self.bos_token_id.into(),
            eos_token_id: self.eos()?,
            pad_token_id: self.pad_token_id.into(),
            chat_template: Default::default(),
            source: Default::default(),
            source_sha256: Default::default(),
        })
    }

    pub fn validate(&self) -> Result<(), String> {
        if !SUPPORTED.contains(&self.model_type.as_str()) {
            return Err(format!(
                "model_type `{}` is not supported (supported: {})",
                self.model_type,
                SUPPORTED.join(", ")
            ));
        }
        if let Some(act) = self.hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(format!("hidden_act `{act}`: only silu is supported"));
        }
        if self.num_attention_heads == 0 {
            return Err("num_attention_heads 0: must be >= 1".into());
        }
        if self.num_kv_heads() == 0 {
            return Err("num_key_value_heads 0: must be >= 1".into());
        }
        if self.num_attention_heads % self.num_kv_heads() != 0 {
            return Err(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads,
                self.num_kv_heads()
            ));
        }
        if self.head_dim() % 2 != 0 {
            return Err(format!("head_dim {} must be even for RoPE", self.head_dim()));
        }
        let rotary = self.rotary_dim();
        if rotary == 0 || rotary % 2 != 0 {
            return Err(format!(
                "partial_rotary_factor gives {rotary} rotary dims of {}: must be even and >= 2",
                self.head_dim()
            ));
        }
        if self.has_dense_mlp() && self.intermediate_size == 0 {
            return Err("intermediate_size: missing or 0 (the dense MLP's width)".into());
        }
        let scaling = self.rope_scaling()?;
        if let Some(f) = &self.rope_freq_factors {
            if f.len() != rotary / 2 || !f.iter().all(|x| *x > 0.0 && x.is_finite()) {
                return Err(format!("rope_freqs.weight: expected {} positive factors, got {:?}", rotary / 2, f));
            }
            if scaling != RopeScaling::Default {
                return Err("rope_freqs.weight with a rope scaling type besides: one or the other".into());
            }
        }
        if self.is_hybrid() {
            if let Some(types) = &self.layer_types {
                if types.len() != self.num_hidden_layers {
                    return Err(format!(
                        "layer_types has {} entries for {} layers",
                        types.len(),
                        self.num_hidden_layers
                    ));
                }
                if let Some(t) = types.iter().find(|t| *t != "linear_attention" && *t != "full_attention") {
                    return Err(format!("layer_types: `{t}` is neither linear_attention nor full_attention"));
                }
            }
            let s = self.linear();
            if [s.key_heads, s.value_heads, s.key_dim, s.value_dim, s.conv_kernel].contains(&0) {
                return Err("linear_*: head counts, head dims and the conv kernel must be >= 1".into());
            }
            if s.value_heads % s.key_heads != 0 {
                return Err(format!(
                    "linear_num_value_heads {} is not a multiple of linear_num_key_heads {}",
                    s.value_heads, s.key_heads
                ));
            }
        }
        if let Some(m) = self.moe() {
            if m.experts == 0 || m.intermediate == 0 || m.shared_intermediate == Some(0) {
                return Err(
                    "num_experts, moe_intermediate_size and shared_expert_intermediate_size must be >= 1".into()
                );
            }
            if !(1..=m.experts).contains(&m.top_k) {
                return Err(format!("num_experts_per_tok {} must be in 1..={} (num_experts)", m.top_k, m.experts));
            }
        }
        Ok(())
    }

    /// From GGUF metadata. Vocabulary size is the token list's length.
    pub fn from_gguf(g: &GgufFile) -> Result<Self, GgufError> {
        let arch = g.meta_str("general.architecture")?.to_string();
        let key = |k: &str| format!("{arch}.{k}");
        let heads = g.meta_usize(&key("attention.head_count"))?;
        let hidden = g.meta_usize(&key("embedding_length"))?;
        let head_dim = g.meta_usize(&key("attention.key_length")).ok();
        let vocab = g.meta_str_array("tokenizer.ggml.tokens")?.len();
        Ok(Self {
            model_type: arch.clone(),
            hidden_size: hidden,
            intermediate_size: g.meta_usize(&key("feed_forward_length"))?,
            num_hidden_layers: g.meta_usize(&key("block_count"))?,
            num_attention_heads: heads,
            num_key_value_heads: Some(g.meta_usize(&key("attention.head_count_kv")).unwrap_or(heads)),
            // 0 heads (refused by `validate`) leaves it unset rather than dividing by zero.
            head_dim: head_dim.or(hidden.checked_div(heads)),
            vocab_size: vocab,
            rms_norm_eps: g.meta_f32(&key("attention.layer_norm_rms_epsilon")).map(f64::from).unwrap_or(1e-6),
            rope_theta: match g.meta_f32(&key("rope.freq_base")) {
                Ok(theta) => f64::from(theta),
                Err(_) => {
                    let theta = hf_default_theta(&arch);
                    eprintln!("GGUF has no {arch}.rope.freq_base: transformers' default for {arch}, {theta}");
                    theta
                }
            },
            max_position_embeddings: g.meta_usize(&key("context_length")).ok(),
            rope_scaling: gguf_rope_scaling(g, &arch),
            tie_word_embeddings: g.tensor_info("output.weight").is_none(),
            attention_bias: Some(g.tensor_info("blk.0.attn_q.bias").is_some()),
            bos_token_id: g.meta_u32("tokenizer.ggml.bos_token_id").ok(),
            eos_token_id: g.meta_u32("tokenizer.ggml.eos_token_id").ok().map(EosId::One),
            pad_token_id: g.meta_u32("tokenizer.ggml.padding_token_id").ok(),
            ..Default::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_heads_are_refused_not_divided_by() {
        let mut c: DecoderConfig = serde_json::from_str(
            r#"{"model_type": "llama", "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 1,
                "num_attention_heads": 0, "vocab_size": 8}"#,
        )
        .unwrap();
        assert_eq!(c.head_dim(), 0);
        assert_eq!(c.validate().unwrap_err(), "num_attention_heads 0: must be >= 1");
        c.num_attention_heads = 2;
        c.num_key_value_heads = Some(0);
        assert_eq!(c.validate().unwrap_err(), "num_key_value_heads 0: must be >= 1");
        c.num_key_value_heads = Some(2);
        c.validate().unwrap();
        assert_eq!(c.head_dim(), 16);
    }

    #[test]
    fn an_unknown_model_type_is_named_with_the_supported_ones() {
        let (c, _) = DecoderConfig::from_hf_json(
            r#"{"model_type": "mamba2", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 8}"#,
        )
        .unwrap();
        assert_eq!(
            c.validate().unwrap_err(),
            "model_type `mamba2` is not supported (supported: llama, qwen2, qwen3, qwen3_moe, qwen3_5, qwen3_5_moe)"
        );
    }

    /// A multimodal Qwen3.5 config: the text config is read, transformers 5's `rope_parameters`
    /// give theta and the rotary share, and absent keys take Qwen3_5TextConfig's defaults (layer
    /// types from `full_attention_interval`, the linear-attention shapes, head_dim 256).
    #[test]
    fn a_multimodal_qwen3_5_config_reads_its_text_config() {
        let (c, arch) = DecoderConfig::from_hf_json(
            r#"{"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": false,
                "text_config": {"model_type": "qwen3_5_text", "hidden_size": 5120, "intermediate_size": 17408,
                  "num_hidden_layers": 8, "num_attention_heads": 24, "num_key_value_heads": 4, "vocab_size": 248320,
                  "linear_num_value_heads": 48, "eos_token_id": 248044,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                      "mrope_section": [11, 11, 10], "mrope_interleaved": true}},
                "vision_config": {"depth": 27}}"#,
        )
        .unwrap();
        c.validate().unwrap();
        assert_eq!(arch.as_deref(), Some("Qwen3_5ForConditionalGeneration"));
        assert_eq!(
            (c.arch(), c.head_dim(), c.rotary_dim(), c.rope_theta, c.eos()),
            (Arch::Qwen35, 256, 64, 1e7, Some(248044))
        );
        use Mixer::{Attention as A, Linear as L};
        assert_eq!(c.mixers(), vec![L, L, L, A, L, L, L, A]);
        let s = c.linear();
        assert_eq!((s.key_heads, s.value_heads, s.key_dim, s.value_dim, s.conv_kernel), (16, 48, 128, 128, 4));
        assert_eq!(s.conv_channels(), 2 * 16 * 128 + 48 * 128);
        assert!(c.centred_norms() && c.qk_norm() && !c.qkv_bias() && c.moe().is_none());
    }

    #[test]
    fn moe_layouts_follow_transformers() {
        // qwen3_moe as transformers 5 writes it: `num_local_experts`, a dense layer by index.
        let (c, _) = DecoderConfig::from_hf_json(
            r#"{"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
                "num_attention_heads": 4, "vocab_size": 64, "num_local_experts": 8, "num_experts_per_tok": 3,
                "moe_intermediate_size": 16, "norm_topk_prob": false, "decoder_sparse_step": 1, "mlp_only_layers": [1],
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}"#,
        )
        .unwrap();
        c.validate().unwrap();
        let m = c.moe().unwrap();
        assert_eq!((m.experts, m.top_k, m.intermediate, m.norm_topk, m.shared_intermediate), (8, 3, 16, false, None));
        assert_eq!((0..4).map(|i| c.is_sparse_layer(i)).collect::<Vec<_>>(), [true, false, true, true]);
        assert_eq!((c.rope_theta, c.rotary_dim()), (1e6, 8));
        // Qwen3.5-MoE: no dense MLP width; the drafter's default FFN is the active expert width.
        let (c, _) = DecoderConfig::from_hf_json(
            r#"{"model_type": "qwen3_5_moe_text", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                "vocab_size": 64, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                "shared_expert_intermediate_size": 24, "layer_types": ["linear_attention", "full_attention"]}"#,
        )
        .unwrap();
        c.validate().unwrap();
        assert_eq!(
            (c.arch(), c.spec_intermediate_size(), c.moe().unwrap().shared_intermediate),
            (Arch::Qwen35Moe, 32, Some(24))
        );
        let mut bad = c.clone();
        bad.num_experts_per_tok = Some(9);
        assert_eq!(bad.validate().unwrap_err(), "num_experts_per_tok 9 must be in 1..=8 (num_experts)");
        let mut bad = c.clone();
        bad.layer_types = Some(vec!["linear_attention".into()]);
        assert_eq!(bad.validate().unwrap_err(), "layer_types has 1 entries for 2 layers");
        let mut bad = c;
        bad.linear_num_value_heads = Some(6);
        bad.linear_num_key_heads = Some(4);
        assert!(bad.validate().unwrap_err().contains("not a multiple of linear_num_key_heads 4"));
    }

    /// The scaling is read from either key; Qwen3.5's mrope keys are no scaling; llama3 / yarn
    /// without their context take `max_position_embeddings` (as transformers does); what a
    /// target cannot honour is refused naming the key.
    #[test]
    fn rope_scaling_from_either_key() {
        let cfg = |extra: &str| {
            let text = format!(
                r#"{{"model_type": "llama", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "vocab_size": 64{extra}}}"#
            );
            DecoderConfig::from_hf_json(&text).unwrap().0
        };
        let c = cfg(r#", "rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 500000.0"#);
        assert_eq!((c.rope_scaling().unwrap(), c.rope_theta), (RopeScaling::Linear { factor: 2.0 }, 5e5));
        let c = cfg(
            r#", "max_position_embeddings": 4096, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}"#,
        );
        assert!(matches!(
            c.rope_scaling().unwrap(),
            RopeScaling::Yarn { original_max_position_embeddings: 4096.0, .. }
        ));
        assert_eq!(c.rope_theta, 1e6);
        let c = cfg(r#", "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "mrope_section": [2, 1, 1]}"#);
        assert_eq!(c.rope_scaling().unwrap(), RopeScaling::Default);
        // No rope_theta anywhere: transformers' default.
        assert_eq!(cfg("").rope_theta, 10000.0);
        let c = cfg(r#", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}"#);
        assert_eq!(c.validate().unwrap_err(), "rope_scaling: rope_type `dynamic` needs `max_position_embeddings`");
        let c = cfg(r#", "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}"#);
        assert!(c.validate().unwrap_err().starts_with("rope_parameters: rope_type `longrope` is not supported"));
    }

    /// llama.cpp's rope metadata: the context, linear and yarn scaling read as HF's; a GGUF
    /// without `rope.freq_base` takes transformers' default theta.
    #[test]
    fn gguf_rope_metadata() {
        use crate::gguf::tests::{gguf_bytes, W};
        let dir = tempfile::tempdir().unwrap();
        let read = |extra: Vec<(&'static str, W)>| {
            let mut kvs = vec![
                ("general.architecture", W::str("llama")),
                ("llama.attention.head_count", W::U32(4)),
                ("llama.embedding_length", W::U32(32)),
                ("llama.feed_forward_length", W::U32(48)),
                ("llama.block_count", W::U32(2)),
                ("llama.context_length", W::U32(4096)),
                ("tokenizer.ggml.tokens", W::Arr(8, vec![W::str("a"), W::str("b")])),
            ];
            kvs.extend(extra);
            let path = dir.path().join("m.gguf");
            std::fs::write(&path, gguf_bytes(&kvs, &[], 32)).unwrap();
            DecoderConfig::from_gguf(&GgufFile::open(&path).unwrap()).unwrap()
        };
        let c = read(vec![]);
        assert_eq!(
            (c.rope_theta, c.max_position_embeddings, c.rope_scaling().unwrap()),
            (10000.0, Some(4096), RopeScaling::Default)
        );
        let c = read(vec![
            ("llama.rope.freq_base", W::F32(5e5)),
            ("llama.rope.scaling.type", W::str("linear")),
            ("llama.rope.scaling.factor", W::F32(4.0)),
        ]);
        assert_eq!((c.rope_theta, c.rope_scaling().unwrap()), (5e5, RopeScaling::Linear { factor: 4.0 }));
        let c = read(vec![
            ("llama.rope.scaling.type", W::str("yarn")),
            ("llama.rope.scaling.factor", W::F32(4.0)),
            ("llama.rope.scaling.original_context_length", W::U32(1024)),
        ]);
        assert!(matches!(
            c.rope_scaling().unwrap(),
            RopeScaling::Yarn { factor: 4.0, original_max_position_embeddings: 1024.0, .. }
        ));
        let c = read(vec![("llama.rope.scaling.type", W::str("longrope"))]);
        assert!(c.validate().unwrap_err().contains("rope_type `longrope` is not supported"));
        let mut c = read(vec![]);
        c.rope_freq_factors = Some(vec![1.0; 3]);
        assert_eq!(c.validate().unwrap_err(), "rope_freqs.weight: expected 4 positive factors, got [1.0, 1.0, 1.0]");
    }
}
