//! The decoder's config, read from an HF `config.json` (field names are HF's) or from GGUF
//! metadata (`{arch}.block_count`, ...).
//!
//! One struct serves every family (`families.rs`); the fields a family lacks are `None`, and
//! where a config is silent transformers 5.8.1's class defaults apply (the Qwen3.5
//! linear-attention shapes, head_dim 256 for Qwen3.5 and Gemma, `partial_rotary_factor` 0.25
//! for Qwen3.5 and 0.5 for GLM-4.5, the MLA ranks and head dims, the routing constants). A
//! multimodal checkpoint's config nests the language model's under `text_config`:
//! [`DecoderConfig::from_hf_json`] reads that one. Some families name a field their own way
//! (LFM2's `norm_eps`, `block_ff_dim`; LongCat-Flash's `ffn_hidden_size`, `moe_topk`,
//! `expert_ffn_hidden_size`, `num_layers`; DeepSeek's `n_routed_experts`): they read into the
//! common field ([`SPELLINGS`]); a config giving both spellings is read when they agree and
//! refused, naming both, when they differ.

pub use crate::families::Arch;
use crate::families::{self, Family};
use crate::gguf::{GgufError, GgufFile};
use rope_scaling::RopeScaling;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// What `layer_types` (or the family's default pattern) says a layer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Attention over the whole context.
    Full,
    /// Attention over the last `sliding_window` positions.
    Sliding,
    /// Gated DeltaNet (Qwen3.5).
    Linear,
    /// Gated short convolution (LFM2).
    Conv,
}

/// What a layer mixes tokens with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mixer {
    /// Softmax attention (full or sliding; Qwen3.5's with an output gate and partial RoPE).
    Attention,
    /// Gated DeltaNet (`linear_attention` in `layer_types`).
    Linear,
    /// LFM2's gated short convolution (`conv`).
    ShortConv,
    /// Multi-head latent attention (DeepSeek-V3, LongCat-Flash).
    Mla,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DecoderConfig {
    /// One of `families::supported()`.
    pub model_type: String,
    pub hidden_size: usize,
    /// The dense MLP's width (absent in Qwen3.5-MoE configs: every layer is sparse; gpt-oss's is
    /// its experts' width).
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
    /// Gemma's name for the MLP's activation (`gelu_pytorch_tanh`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_activation: Option<String>,
    /// transformers 5's RoPE settings (`rope_theta`, `rope_type`, `partial_rotary_factor`); older
    /// configs have `rope_theta` at the top level. Gemma 3's, one object per layer kind, is read
    /// into `rope_theta`, this (the global layers') and `rope_local_base_freq`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partial_rotary_factor: Option<f64>,
    /// Gemma 3's sliding layers' RoPE base (default 10000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_local_base_freq: Option<f64>,
    /// A GGUF's `rope_freqs.weight`: each frequency divided by its factor (how llama.cpp stores
    /// Llama 3's scaling); not an HF key.
    #[serde(skip)]
    pub rope_freq_factors: Option<Vec<f64>>,

    // Which layers do what: Qwen3.5's Gated DeltaNet, LFM2's convs, sliding-window attention.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_types: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub full_attention_interval: Option<usize>,
    /// The window of `sliding_attention` layers (Mistral's, where set: every layer's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<usize>,
    /// Gemma 3's default layer pattern: every n-th layer global (6).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window_pattern: Option<usize>,
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

    // Gemma: the query scale, soft caps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query_pre_attn_scalar: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attn_logit_softcapping: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_logit_softcapping: Option<f64>,

    // LFM2: the conv's kernel and bias, how the MLP width is derived from `intermediate_size`,
    // the attention layers when `layer_types` is absent.
    #[serde(default, rename = "conv_L_cache", skip_serializing_if = "Option::is_none")]
    pub conv_l_cache: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conv_bias: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_auto_adjust_ff_dim: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_ffn_dim_multiplier: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_multiple_of: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub full_attn_idxs: Option<Vec<usize>>,

    // Multi-head latent attention (DeepSeek-V3, LongCat-Flash). No `q_lora_rank`: q from one
    // projection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub q_lora_rank: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_lora_rank: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qk_nope_head_dim: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qk_rope_head_dim: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub v_head_dim: Option<usize>,
    /// The checkpoint stores the rotary dims as interleaved pairs (DeepSeek-V3's default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_interleave: Option<bool>,
    /// LongCat-Flash's layer count (each layer two sublayers; `num_hidden_layers` is twice it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_layers: Option<usize>,

    // Mixture of experts. transformers 5 writes qwen3_moe's count as `num_local_experts`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
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
    /// DeepSeek-V3 / GLM-4.5: routing within the best `topk_group` of `n_group` expert groups,
    /// weights scaled by `routed_scaling_factor`, `n_shared_experts` always on, the first
    /// `first_k_dense_replace` layers dense.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_group: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topk_group: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routed_scaling_factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_shared_experts: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_k_dense_replace: Option<usize>,
    /// GLM-4.5's q/k norms (off in its released configs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_qk_norm: Option<bool>,
    /// LongCat-Flash's zero-computation (identity) experts, routed beside the others.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zero_expert_num: Option<usize>,
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

/// transformers 5.8.1's `default_theta` for a model type (the config class's, else the mixin's
/// 10000); Gemma 3's global layers' (its sliding layers' is 10000).
pub fn hf_default_theta(model_type: &str) -> f64 {
    match model_type {
        "lfm2" | "gemma3_text" => 1e6,
        "gpt_oss" => 150000.0,
        "longcat_flash" => 1e7,
        _ => 10000.0,
    }
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

/// The shapes of multi-head latent attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaShape {
    /// q through a rank-r bottleneck (None: one projection).
    pub q_lora_rank: Option<usize>,
    /// The latent k/v are projected from.
    pub kv_lora_rank: usize,
    /// Per head: q/k dims without RoPE, with RoPE (shared by the heads' keys), v dims.
    pub nope_dim: usize,
    pub rope_dim: usize,
    pub v_dim: usize,
    pub interleaved: bool,
}

impl MlaShape {
    pub fn qk_dim(&self) -> usize {
        self.nope_dim + self.rope_dim
    }
}

/// How a router turns its logits into each token's experts and weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Routing {
    /// Softmax over all experts, the top k, renormalised to sum 1 where `norm` (Qwen).
    Softmax { norm: bool },
    /// The top k of the logits (a router with a bias), softmax over those k (gpt-oss).
    TopKSoftmax,
    /// Sigmoid scores; experts chosen by score + a learnt correction bias among the best
    /// `topk_groups` of `groups` equal groups (a group scored by its two best); weights the
    /// chosen scores, renormalised where `norm`, times `scale` (DeepSeek-V3, GLM-4.5).
    GroupedSigmoid { groups: usize, topk_groups: usize, norm: bool, scale: f64 },
    /// Softmax over the routed and the zero-computation experts; chosen by score + correction
    /// bias; weights the scores times `scale` (LongCat-Flash).
    BiasedSoftmax { scale: f64 },
}

/// An always-on expert beside the routed ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharedExpert {
    /// Scaled by sigmoid(x . shared_expert_gate) (Qwen3.5-MoE's `shared_expert`).
    Gated(usize),
    /// Added as it is (DeepSeek-V3's and GLM-4.5's `shared_experts`).
    Plain(usize),
}

/// The routed experts of a sparse layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeShape {
    /// Experts with weights.
    pub experts: usize,
    /// Experts that return their input (LongCat-Flash), numbered after the others.
    pub zero_experts: usize,
    pub top_k: usize,
    pub intermediate: usize,
    pub routing: Routing,
    pub shared: Option<SharedExpert>,
    /// gpt-oss's experts: biases, a clamped SwiGLU, weights stored [E, in, out] with gate and up
    /// interleaved.
    pub gpt_oss: bool,
}

/// The MLP's activation between gate and up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// GELU, tanh approximation (Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
}

/// The HF names of a layer's norms and of the final one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NormNames {
    /// Before the token mixer and before the MLP.
    pub mixer: &'static str,
    pub ffn: &'static str,
    /// On the mixer's and the MLP's outputs (Gemma's sandwich norms).
    pub mixer_out: Option<&'static str>,
    pub ffn_out: Option<&'static str>,
    /// After the last layer.
    pub last: &'static str,
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
        one_spelling(&mut inner)?;
        family_keys(&mut inner)?;
        let theta_given = inner.get("rope_theta").is_some_and(|t| !t.is_null());
        let mut cfg: Self = serde_json::from_value(inner).map_err(|e| e.to_string())?;
        if cfg.model_type.starts_with("qwen3_5") {
            cfg.model_type = cfg.model_type.trim_end_matches("_text").to_string();
        }
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

    pub fn family(&self) -> Option<&'static Family> {
        families::family(&self.model_type)
    }

    /// The family; call after [`validate`](Self::validate) (an unknown type reads as Llama).
    pub fn arch(&self) -> Arch {
        self.family().map_or(Arch::Llama, |f| f.arch)
    }

    pub fn is_hybrid(&self) -> bool {
        matches!(self.arch(), Arch::Qwen35 | Arch::Qwen35Moe)
    }

    fn is_gemma(&self) -> bool {
        matches!(self.arch(), Arch::Gemma2 | Arch::Gemma3)
    }

    pub fn num_kv_heads(&self) -> usize {
        if self.mla().is_some() {
            return self.num_attention_heads; // a key and a value per head
        }
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// The attention head dim (MLA: the value heads' dim, what a drafter's heads default to).
    pub fn head_dim(&self) -> usize {
        if let Some(m) = self.mla() {
            return m.v_dim;
        }
        if let Some(d) = self.head_dim {
            return d;
        }
        if self.is_hybrid() || self.is_gemma() {
            return 256; // Qwen3_5TextConfig's and Gemma's default
        }
        // 0 heads is refused by `validate`; until then it must not divide by zero.
        self.hidden_size.checked_div(self.num_attention_heads).unwrap_or(0)
    }

    /// Head dims RoPE rotates: all of them, or the first `partial_rotary_factor` share (Qwen3.5:
    /// 0.25, so 64 of 256; GLM-4.5: 0.5); MLA: `qk_rope_head_dim`.
    pub fn rotary_dim(&self) -> usize {
        if let Some(m) = self.mla() {
            return m.rope_dim;
        }
        let default = match self.arch() {
            Arch::Qwen35 | Arch::Qwen35Moe => 0.25,
            Arch::Glm4Moe => 0.5,
            _ => 1.0,
        };
        let factor = self
            .rope_parameters
            .as_ref()
            .and_then(|r| r["partial_rotary_factor"].as_f64())
            .or(self.partial_rotary_factor)
            .unwrap_or(default);
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

    /// The RoPE base and scaling of a layer of `kind`: the config's, except Gemma 3's sliding
    /// layers, which rotate unscaled with their own base.
    pub fn rope_for(&self, kind: LayerKind) -> Result<(f64, RopeScaling), String> {
        if self.arch() == Arch::Gemma3 && kind == LayerKind::Sliding {
            return Ok((self.rope_local_base_freq.unwrap_or(10000.0), RopeScaling::Default));
        }
        Ok((self.rope_theta, self.rope_scaling()?))
    }

    /// Attention scores' scale: 1/sqrt(head_dim); Gemma's 1/sqrt(query_pre_attn_scalar); MLA's
    /// 1/sqrt(qk head dim), times mscale^2 under YaRN with `mscale_all_dim` (DeepSeek's
    /// `yarn_get_mscale`: 0.1 mscale_all_dim ln(factor) + 1).
    pub fn attention_scale(&self) -> f64 {
        if self.is_gemma() {
            return self.query_pre_attn_scalar.unwrap_or(256.0).powf(-0.5);
        }
        let Some(m) = self.mla() else {
            return (self.head_dim() as f64).powf(-0.5);
        };
        let base = (m.qk_dim() as f64).powf(-0.5);
        match self.rope_scaling() {
            Ok(RopeScaling::Yarn { factor, mscale_all_dim: Some(all), .. }) if all != 0.0 && factor > 1.0 => {
                let mscale = 0.1 * all * factor.ln() + 1.0;
                base * mscale * mscale
            }
            _ => base,
        }
    }

    /// What layer `i` is: `layer_types`, or the family's default pattern (Qwen3.5: every
    /// `full_attention_interval`-th layer attention; LFM2: the `full_attn_idxs` attention;
    /// Gemma 2 and gpt-oss: every other layer sliding; Gemma 3: every
    /// `sliding_window_pattern`-th global; Mistral: all sliding when `sliding_window` is set).
    pub fn layer_kind(&self, i: usize) -> LayerKind {
        let named = |t: &str| self.layer_types.as_ref().and_then(|l| l.get(i)).map(|x| x == t);
        match self.arch() {
            Arch::Qwen35 | Arch::Qwen35Moe => {
                let interval = self.full_attention_interval.unwrap_or(4).max(1);
                let linear = named("linear_attention").unwrap_or((i + 1) % interval != 0);
                if linear {
                    LayerKind::Linear
                } else {
                    LayerKind::Full
                }
            }
            Arch::Lfm2 => {
                let attention = named("full_attention")
                    .unwrap_or_else(|| self.full_attn_idxs.as_ref().is_none_or(|idx| idx.contains(&i)));
                if attention {
                    LayerKind::Full
                } else {
                    LayerKind::Conv
                }
            }
            Arch::Llama | Arch::Gemma2 | Arch::Gemma3 | Arch::GptOss if self.sliding_window.is_some() => {
                let pattern = match self.arch() {
                    Arch::Gemma3 => self.sliding_window_pattern.unwrap_or(6).max(1),
                    Arch::Llama => 1, // Mistral: every layer (Ministral names its layers)
                    _ => 2,
                };
                let sliding = named("sliding_attention").unwrap_or(pattern == 1 || (i + 1) % pattern != 0);
                if sliding {
                    LayerKind::Sliding
                } else {
                    LayerKind::Full
                }
            }
            _ => LayerKind::Full,
        }
    }

    /// Layer `i`'s attention window (sliding layers only).
    pub fn window(&self, i: usize) -> Option<usize> {
        (self.layer_kind(i) == LayerKind::Sliding).then_some(self.sliding_window).flatten()
    }

    /// Layer `i`'s token mixer.
    pub fn mixer(&self, i: usize) -> Mixer {
        match self.layer_kind(i) {
            LayerKind::Linear => Mixer::Linear,
            LayerKind::Conv => Mixer::ShortConv,
            _ if self.mla().is_some() => Mixer::Mla,
            _ => Mixer::Attention,
        }
    }

    /// Every layer's token mixer (a `num_hidden_layers` long list: for a validated model only).
    pub fn mixers(&self) -> Vec<Mixer> {
        (0..self.num_hidden_layers).map(|i| self.mixer(i)).collect()
    }

    /// Token mixers a layer runs in turn (LongCat-Flash: two).
    pub fn mixers_per_layer(&self) -> usize {
        if self.arch() == Arch::LongcatFlash {
            2
        } else {
            1
        }
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

    /// LFM2's conv kernel (`conv_L_cache`, 3).
    pub fn short_conv_kernel(&self) -> usize {
        self.conv_l_cache.unwrap_or(3)
    }

    /// The latent attention's shapes, for an MLA family (transformers' DeepSeek-V3 defaults).
    pub fn mla(&self) -> Option<MlaShape> {
        let longcat = match self.arch() {
            Arch::DeepseekV3 => false,
            Arch::LongcatFlash => true,
            _ => return None,
        };
        Some(MlaShape {
            q_lora_rank: self.q_lora_rank,
            kv_lora_rank: self.kv_lora_rank.unwrap_or(512),
            nope_dim: self.qk_nope_head_dim.unwrap_or(128),
            rope_dim: self.qk_rope_head_dim.unwrap_or(64),
            v_dim: self.v_head_dim.unwrap_or(128),
            interleaved: longcat || self.rope_interleave.unwrap_or(true),
        })
    }

    pub fn qkv_bias(&self) -> bool {
        self.attention_bias.unwrap_or(matches!(self.arch(), Arch::Qwen2 | Arch::GptOss))
    }

    /// A bias on the output projection: where transformers gives o_proj `attention_bias` (not
    /// Qwen2's, Qwen3.5's, GLM-4.5's, LFM2's).
    pub fn o_bias(&self) -> bool {
        match self.arch() {
            Arch::Llama | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma2 | Arch::Gemma3 | Arch::GptOss => self.qkv_bias(),
            _ => false,
        }
    }

    /// q and k normalised per head before RoPE (Qwen3 and its successors, Gemma 3, LFM2; GLM-4.5
    /// where `use_qk_norm`).
    pub fn qk_norm(&self) -> bool {
        match self.arch() {
            Arch::Qwen3 | Arch::Qwen3Moe | Arch::Qwen35 | Arch::Qwen35Moe | Arch::Gemma3 | Arch::Lfm2 => true,
            Arch::Glm4Moe => self.use_qk_norm.unwrap_or(false),
            _ => false,
        }
    }

    /// Qwen3.5's and Gemma's RMSNorms scale by (1 + weight) (weights stored centred on 0).
    pub fn centred_norms(&self) -> bool {
        self.is_hybrid() || self.is_gemma()
    }

    /// The layer norms' HF names (LFM2's `operator_norm` / `ffn_norm` / `embedding_norm`;
    /// Gemma's four a layer).
    pub fn norm_names(&self) -> NormNames {
        match self.arch() {
            Arch::Lfm2 => NormNames {
                mixer: "operator_norm",
                ffn: "ffn_norm",
                mixer_out: None,
                ffn_out: None,
                last: "model.embedding_norm",
            },
            Arch::Gemma2 | Arch::Gemma3 => NormNames {
                mixer: "input_layernorm",
                ffn: "pre_feedforward_layernorm",
                mixer_out: Some("post_attention_layernorm"),
                ffn_out: Some("post_feedforward_layernorm"),
                last: "model.norm",
            },
            _ => NormNames {
                mixer: "input_layernorm",
                ffn: "post_attention_layernorm",
                mixer_out: None,
                ffn_out: None,
                last: "model.norm",
            },
        }
    }

    /// The MLP's activation (Gemma: GELU with the tanh approximation; otherwise SiLU).
    pub fn activation(&self) -> Activation {
        if self.is_gemma() {
            Activation::GeluTanh
        } else {
            Activation::Silu
        }
    }

    /// The dense MLP's width: `intermediate_size`, LFM2's adjusted as its config says
    /// (int(2/3 x), times `block_ffn_dim_multiplier`, up to a multiple of `block_multiple_of`);
    /// None for a family without dense MLPs (gpt-oss, whose `intermediate_size` is its experts').
    pub fn dense_width(&self) -> Option<usize> {
        match self.arch() {
            Arch::GptOss | Arch::Qwen35Moe => None,
            Arch::Lfm2 if self.block_auto_adjust_ff_dim.unwrap_or(true) => {
                let mut width = 2 * self.intermediate_size / 3;
                if let Some(m) = self.block_ffn_dim_multiplier {
                    let multiple = self.block_multiple_of.unwrap_or(256).max(1);
                    width = (m * width as f64) as usize;
                    width = width.div_ceil(multiple) * multiple;
                }
                Some(width)
            }
            _ => Some(self.intermediate_size),
        }
    }

    /// The routed experts, for a MoE family.
    pub fn moe(&self) -> Option<MoeShape> {
        let experts = |default| self.num_experts.unwrap_or(default);
        let top_k = |default| self.num_experts_per_tok.unwrap_or(default);
        let width = |default| self.moe_intermediate_size.unwrap_or(default);
        let shape = |experts, top_k, intermediate, routing, shared| MoeShape {
            experts,
            zero_experts: 0,
            top_k,
            intermediate,
            routing,
            shared,
            gpt_oss: false,
        };
        let grouped = |groups, topk_groups, scale| Routing::GroupedSigmoid {
            groups: self.n_group.unwrap_or(groups),
            topk_groups: self.topk_group.unwrap_or(topk_groups),
            norm: self.norm_topk_prob.unwrap_or(true),
            scale: self.routed_scaling_factor.unwrap_or(scale),
        };
        let plain_shared = |width: usize| Some(SharedExpert::Plain(width * self.n_shared_experts.unwrap_or(1)));
        Some(match self.arch() {
            Arch::Qwen3Moe => shape(
                experts(128),
                top_k(8),
                width(768),
                Routing::Softmax { norm: self.norm_topk_prob.unwrap_or(false) },
                None,
            ),
            Arch::Qwen35Moe => shape(
                experts(256),
                top_k(8),
                width(512),
                Routing::Softmax { norm: true },
                Some(SharedExpert::Gated(self.shared_expert_intermediate_size.unwrap_or(512))),
            ),
            Arch::GptOss => MoeShape {
                gpt_oss: true,
                ..shape(experts(128), top_k(4), self.intermediate_size, Routing::TopKSoftmax, None)
            },
            Arch::DeepseekV3 => {
                shape(experts(256), top_k(8), width(2048), grouped(8, 4, 2.5), plain_shared(width(2048)))
            }
            Arch::Glm4Moe => shape(experts(128), top_k(8), width(1408), grouped(1, 1, 1.0), plain_shared(width(1408))),
            Arch::LongcatFlash => MoeShape {
                zero_experts: self.zero_expert_num.unwrap_or(0),
                ..shape(
                    experts(512),
                    top_k(12),
                    width(2048),
                    Routing::BiasedSoftmax { scale: self.routed_scaling_factor.unwrap_or(6.0) },
                    None,
                )
            },
            _ => return None,
        })
    }

    /// Whether layer `i`'s MLP is the sparse block (qwen3_moe: every `decoder_sparse_step`-th
    /// layer not in `mlp_only_layers`; DeepSeek-V3 / GLM-4.5: from `first_k_dense_replace` on;
    /// Qwen3.5-MoE, gpt-oss: all). LongCat-Flash's MoE is beside its dense MLPs, not instead.
    pub fn is_sparse_layer(&self, i: usize) -> bool {
        match self.arch() {
            Arch::Qwen35Moe | Arch::GptOss => true,
            Arch::Qwen3Moe => {
                let step = self.decoder_sparse_step.unwrap_or(1).max(1);
                !self.mlp_only_layers.as_ref().is_some_and(|l| l.contains(&i))
                    && self.num_experts.unwrap_or(128) > 0
                    && (i + 1) % step == 0
            }
            Arch::DeepseekV3 | Arch::Glm4Moe => i >= self.first_dense_layers(),
            _ => false,
        }
    }

    fn first_dense_layers(&self) -> usize {
        let default = if self.arch() == Arch::DeepseekV3 { 3 } else { 1 };
        self.first_k_dense_replace.unwrap_or(default)
    }

    /// Whether some layer has a dense MLP (without a loop over a count that may be hostile).
    fn has_dense_mlp(&self) -> bool {
        let n = self.num_hidden_layers;
        match self.arch() {
            Arch::Qwen35Moe | Arch::GptOss => false,
            Arch::Qwen3Moe => {
                n > 0
                    && (self.num_experts == Some(0)
                        || self.decoder_sparse_step.unwrap_or(1) > 1
                        || self.mlp_only_layers.as_ref().is_some_and(|l| l.iter().any(|&i| i < n)))
            }
            Arch::DeepseekV3 | Arch::Glm4Moe => n > 0 && self.first_dense_layers() > 0,
            _ => n > 0,
        }
    }

    /// The FFN width the drafter defaults to (`TargetSpec::intermediate_size`): the dense MLP's, or
    /// for a model without one the active expert width (top-k x expert width).
    pub fn spec_intermediate_size(&self) -> usize {
        match (self.dense_width(), self.moe()) {
            (Some(f), _) if f > 0 => f,
            (_, Some(m)) => m.top_k * m.intermediate,
            (f, None) => f.unwrap_or(0),
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
        if self.family().is_none() {
            return Err(format!(
                "model_type `{}` is not supported (supported: {})",
                self.model_type,
                families::supported().join(", ")
            ));
        }
        self.validate_activation()?;
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
        if self.mla().is_none() && self.head_dim() % 2 != 0 {
            return Err(format!("head_dim {} must be even for RoPE", self.head_dim()));
        }
        let rotary = self.rotary_dim();
        if rotary == 0 || rotary % 2 != 0 {
            return Err(format!(
                "partial_rotary_factor gives {rotary} rotary dims of {}: must be even and >= 2",
                self.head_dim()
            ));
        }
        if self.has_dense_mlp() && self.dense_width() == Some(0) {
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
        self.validate_layer_types()?;
        if self.is_hybrid() {
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
        if self.arch() == Arch::Lfm2 && self.short_conv_kernel() == 0 {
            return Err("conv_L_cache 0: the conv kernel must be >= 1".into());
        }
        if let Some(m) = self.mla() {
            if [m.kv_lora_rank, m.nope_dim, m.v_dim].contains(&0) || m.q_lora_rank == Some(0) {
                return Err("q_lora_rank, kv_lora_rank, qk_nope_head_dim, v_head_dim must be >= 1".into());
            }
        }
        if let Some(m) = self.moe() {
            self.validate_moe(&m)?;
        }
        Ok(())
    }

    /// SiLU, or for Gemma GELU with the tanh approximation.
    fn validate_activation(&self) -> Result<(), String> {
        if self.is_gemma() {
            let act = self.hidden_activation.as_deref().or(self.hidden_act.as_deref()).unwrap_or("gelu_pytorch_tanh");
            if act != "gelu_pytorch_tanh" {
                return Err(format!("hidden_activation `{act}`: only gelu_pytorch_tanh is supported for Gemma"));
            }
        } else if let Some(act) = self.hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(format!("hidden_act `{act}`: only silu is supported"));
        }
        Ok(())
    }

    /// `layer_types`: one a layer, each a kind this family has.
    fn validate_layer_types(&self) -> Result<(), String> {
        let allowed: &[&str] = match self.arch() {
            Arch::Qwen35 | Arch::Qwen35Moe => &["linear_attention", "full_attention"],
            Arch::Lfm2 => &["conv", "full_attention"],
            Arch::Llama | Arch::Gemma2 | Arch::Gemma3 | Arch::GptOss if self.sliding_window.is_some() => {
                &["sliding_attention", "full_attention"]
            }
            _ => return Ok(()),
        };
        if self.sliding_window == Some(0) {
            return Err("sliding_window 0: must be >= 1".into());
        }
        let Some(types) = &self.layer_types else { return Ok(()) };
        if types.len() != self.num_hidden_layers {
            return Err(format!("layer_types has {} entries for {} layers", types.len(), self.num_hidden_layers));
        }
        if let Some(t) = types.iter().find(|t| !allowed.contains(&t.as_str())) {
            return Err(format!("layer_types: `{t}` is none of {}", allowed.join(", ")));
        }
        Ok(())
    }

    fn validate_moe(&self, m: &MoeShape) -> Result<(), String> {
        if m.experts == 0
            || m.intermediate == 0
            || matches!(m.shared, Some(SharedExpert::Gated(0) | SharedExpert::Plain(0)))
        {
            return Err("the experts' count and width and the shared expert's width must be >= 1".into());
        }
        let choices = m.experts + m.zero_experts;
        if !(1..=choices).contains(&m.top_k) {
            return Err(format!("num_experts_per_tok {} must be in 1..={choices} (num_experts)", m.top_k));
        }
        if let Routing::GroupedSigmoid { groups, topk_groups, .. } = m.routing {
            if groups == 0 || m.experts % groups != 0 || m.experts / groups < 2 {
                return Err(format!("n_group {groups} must split the {} experts into groups of 2 or more", m.experts));
            }
            if !(1..=groups).contains(&topk_groups) || m.top_k > topk_groups * (m.experts / groups) {
                return Err(format!(
                    "topk_group {topk_groups}: must be in 1..={groups} and leave num_experts_per_tok {} experts to choose from",
                    m.top_k
                ));
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

/// A family's own spellings and defaults, in the config's JSON before it is read: the sliding
/// window transformers' config class gives where the key is absent; LFM2's `block_ff_dim`
/// (wins over `intermediate_size`, as transformers has it) and `tie_embedding`; LongCat-Flash's
/// layer count (`num_layers`; transformers' `num_hidden_layers` counts sublayers); Gemma 3's
/// RoPE settings per layer kind (the global layers' become `rope_theta` and `rope_parameters`,
/// the sliding layers' base `rope_local_base_freq`).
/// Fields a config.json may spell more than one way, with the families that do (`*`: any): the
/// field read, then its other spellings.
const SPELLINGS: &[(&str, &str, &[&str])] = &[
    ("*", "intermediate_size", &["ffn_hidden_size"]),
    ("lfm2", "intermediate_size", &["block_ff_dim"]),
    ("*", "rms_norm_eps", &["norm_eps"]),
    ("*", "num_experts", &["num_local_experts", "n_routed_experts"]),
    ("*", "num_experts_per_tok", &["moe_topk"]),
    ("*", "moe_intermediate_size", &["expert_ffn_hidden_size"]),
    ("lfm2", "tie_word_embeddings", &["tie_embedding"]),
];

/// Each field of [`SPELLINGS`] under its one name: another spelling is moved there, or dropped
/// when both are given and agree (numbers by value: `1e-5` is `0.00001`); when they differ the
/// config is refused naming both keys and values (null counts as absent).
fn one_spelling(c: &mut serde_json::Value) -> Result<(), String> {
    let Some(o) = c.as_object_mut() else { return Ok(()) };
    let model_type = o.get("model_type").and_then(|t| t.as_str()).unwrap_or("").to_string();
    let same = |a: &serde_json::Value, b: &serde_json::Value| match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    };
    for (family, name, others) in SPELLINGS {
        if *family != "*" && *family != model_type {
            continue;
        }
        for other in *others {
            let Some(v) = o.remove(*other).filter(|v| !v.is_null()) else { continue };
            match o.get(*name).filter(|w| !w.is_null()) {
                None => {
                    o.insert(name.to_string(), v);
                }
                Some(w) if same(w, &v) => {}
                Some(w) => {
                    return Err(format!("`{name}` is {w} but `{other}` is {v}: two spellings of one field must agree"))
                }
            }
        }
    }
    Ok(())
}

fn family_keys(c: &mut serde_json::Value) -> Result<(), String> {
    let Some(o) = c.as_object_mut() else { return Ok(()) };
    let model_type = o.get("model_type").and_then(|t| t.as_str()).unwrap_or("").to_string();
    // The config classes' windows where the key is absent (null: no window).
    let window = match model_type.as_str() {
        "mistral" | "ministral" | "gemma2" | "gemma3_text" => Some(4096),
        "gpt_oss" => Some(128),
        _ => None,
    };
    if let Some(w) = window {
        o.entry("sliding_window").or_insert(w.into());
    }
    match model_type.as_str() {
        "longcat_flash" => {
            if let Some(n) = o.get("num_layers").cloned() {
                o.insert("num_hidden_layers".into(), n);
            }
        }
        "gemma3_text" => {
            let nested = o.get("rope_parameters").and_then(|r| r.as_object()).filter(|r| {
                r.get("full_attention").is_some_and(|v| v.is_object())
                    || r.get("sliding_attention").is_some_and(|v| v.is_object())
            });
            if let Some(per_kind) = nested.cloned() {
                if let Some(local) = per_kind.get("sliding_attention") {
                    let kind = local.get("rope_type").and_then(|t| t.as_str()).unwrap_or("default");
                    if kind != "default" {
                        return Err(format!(
                            "rope_parameters.sliding_attention: rope_type `{kind}` is not supported (the sliding layers \
                             rotate with plain RoPE)"
                        ));
                    }
                    if let Some(theta) = local.get("rope_theta") {
                        o.insert("rope_local_base_freq".into(), theta.clone());
                    }
                }
                let global = per_kind.get("full_attention").cloned().unwrap_or_else(|| serde_json::json!({}));
                let theta = global.get("rope_theta").cloned().unwrap_or(hf_default_theta("gemma3_text").into());
                o.insert("rope_theta".into(), theta);
                o.insert("rope_parameters".into(), global);
            }
        }
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field spelled two ways (LongCat-Flash's, LFM2's, DeepSeek's and transformers 5's
    /// names beside HF's usual ones): both given and equal reads as one; different, the config
    /// is refused naming both keys and values.
    #[test]
    fn both_spellings_of_a_field_are_read_when_they_agree() {
        let base = r#""hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 8"#;
        for (model_type, name, other, value, differing) in [
            ("llama", "intermediate_size", "ffn_hidden_size", "48", "64"),
            ("lfm2", "intermediate_size", "block_ff_dim", "48", "64"),
            ("llama", "rms_norm_eps", "norm_eps", "1e-5", "1e-6"),
            ("qwen3_moe", "num_experts", "num_local_experts", "8", "16"),
            ("deepseek_v3", "num_experts", "n_routed_experts", "8", "16"),
            ("qwen3_moe", "num_experts_per_tok", "moe_topk", "2", "3"),
            ("qwen3_moe", "moe_intermediate_size", "expert_ffn_hidden_size", "8", "16"),
            ("lfm2", "tie_word_embeddings", "tie_embedding", "true", "false"),
        ] {
            let json = |a: &str, b: &str| {
                format!(r#"{{"model_type": "{model_type}", {base}, "{name}": {a}, "{other}": {b}}}"#)
            };
            let alone = format!(r#"{{"model_type": "{model_type}", {base}, "{other}": {value}}}"#);
            let (want, _) = DecoderConfig::from_hf_json(&alone).unwrap_or_else(|e| panic!("{other}: {e}"));
            let (both, _) = DecoderConfig::from_hf_json(&json(value, value)).unwrap_or_else(|e| panic!("{other}: {e}"));
            assert_eq!(both, want, "{name} and {other} agreeing");
            let e = DecoderConfig::from_hf_json(&json(value, differing)).unwrap_err();
            assert!(
                e.contains(&format!("`{name}` is")) && e.contains(&format!("`{other}` is {differing}")),
                "{name} / {other}: {e}"
            );
        }
        // Numbers agree by value, whatever their spelling in the file.
        let (c, _) = DecoderConfig::from_hf_json(&format!(
            r#"{{"model_type": "llama", {base}, "rms_norm_eps": 0.00001, "norm_eps": 1e-5, "intermediate_size": 48,
                "ffn_hidden_size": 48.0}}"#
        ))
        .unwrap();
        assert_eq!((c.rms_norm_eps, c.intermediate_size), (1e-5, 48));
        // Three spellings of the expert count: each pair must agree.
        let e = DecoderConfig::from_hf_json(&format!(
            r#"{{"model_type": "qwen3_moe", {base}, "num_experts": 8, "num_local_experts": 8, "n_routed_experts": 4}}"#
        ))
        .unwrap_err();
        assert!(e.contains("`num_experts` is 8 but `n_routed_experts` is 4"), "{e}");
    }

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
            "model_type `mamba2` is not supported (supported: llama, mistral, ministral, qwen2, qwen3, qwen3_moe, \
             qwen3_5, qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text, gemma2, gemma3_text, gpt_oss, lfm2, deepseek_v3, \
             kimi_k2, glm4_moe, longcat_flash)"
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
        assert_eq!(
            (m.experts, m.top_k, m.intermediate, m.routing, m.shared),
            (8, 3, 16, Routing::Softmax { norm: false }, None)
        );
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
            (c.arch(), c.spec_intermediate_size(), c.moe().unwrap().shared),
            (Arch::Qwen35Moe, 32, Some(SharedExpert::Gated(24)))
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
