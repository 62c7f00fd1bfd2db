//! `drafter_dflash`: the dense DFlash drafter (z-lab architecture) as a plugin.
//!
//! Its config section picks the shape of the drafter; everything the target decides (hidden
//! size, heads, vocabulary, RoPE, context length, special tokens) comes from the target (its
//! spec, and its own config for what the spec does not carry), so a drafter always fits its
//! target and its exported `config.json` says what SpecForge's would.

pub mod config;
pub mod decode_graph;
pub mod memory;
pub mod model;

use config::DFlashConfig;
pub use drafter_layers::shell::DrafterShell;
use drafter_layers::{
    dflash::{FULL_ATTENTION, SLIDING_ATTENTION},
    rope::RopeScaling,
    shell,
};
use plugin_api::{
    tch::{nn, Device, Kind, Tensor},
    DrafterInput, DrafterPlugin, HostContext, NamedTensor, PluginError, PluginInfo, PluginInstance, PluginKind,
    TargetSpec,
};
use serde::Deserialize;

drafter_layers::drafter_section! {
    /// The `[drafter]` config section (and the fields every drafter has, from `drafter_section!`).
    #[derive(Debug, Clone, Deserialize, plugin_api::Describe)]
    #[serde(deny_unknown_fields)]
    pub struct DrafterSection {
        /// Draft decoder layers (z-lab's Qwen3-8B drafter: 5).
        #[describe(range = "in 1..=64")]
        #[serde(default = "drafter_layers::section::default_num_hidden_layers")]
        pub num_hidden_layers: usize,
        /// Attention shape of the draft layers (default: the target's). The published drafters of
        /// the Qwen3.5 / Qwen3.6 hybrids use 32 heads, 8 KV heads of 128 where the target's gated
        /// attention has 24 / 4 of 256.
        #[serde(default)]
        pub num_attention_heads: Option<usize>,
        /// Key/value heads of the draft layers (default: the target's).
        #[serde(default)]
        pub num_key_value_heads: Option<usize>,
        /// Head dimension of the draft layers (default: the target's).
        #[serde(default)]
        pub head_dim: Option<usize>,
        /// Keep only each layer's input in training and recompute the layer in backward: activation
        /// memory of one layer instead of all, for one more forward pass of the layers.
        #[serde(default)]
        pub checkpoint_layers: bool,
        /// Block attention in training: "split" (default: the context in runs of blocks that each
        /// score only the keys before their last anchor, the keys all of a run's blocks see through
        /// libtorch's fused kernel, the staircase past them through kernels of our own on CUDA or
        /// that kernel with a bias; each block's own keys apart; merged exactly) or "masked" (one
        /// SDPA over [context; all blocks] with a mask; S + A*Bk keys a query).
        #[serde(default)]
        pub attention: AttentionKind,
        /// HF's `layer_types`: `full_attention` (default) or `sliding_attention` per layer. A
        /// sliding layer's query at position p sees the context positions p-W+1 and on, and its
        /// block's keys up to its own (causal within the block), as SpecForge trains it and, for
        /// W >= `block_size`, as SGLang and vLLM serve it.
        #[serde(default)]
        pub layer_types: Option<Vec<String>>,
        /// W of the sliding layers, at least 1. Below `block_size` the block's later queries see
        /// no context (SpecForge's mask); SGLang and vLLM then also cut the block's own keys
        /// older than W, so such a drafter is served with less than it was trained with.
        #[serde(default)]
        pub sliding_window: Option<usize>,
        /// Default: the target's (its config.json or GGUF metadata), else 32768.
        #[serde(default)]
        pub max_position_embeddings: Option<usize>,
        /// RoPE base of the draft layers (default: the target's). LongCat-Flash's published drafter
        /// uses 1e6 under a target of 1e7.
        #[serde(default)]
        pub rope_theta: Option<f64>,
        /// Epsilon of the drafter's RMS norms (default: the target's).
        #[serde(default)]
        pub rms_norm_eps: Option<f64>,
        /// HF's `rope_scaling` table (default, linear, llama3, yarn). Default: the target's.
        #[describe(ty = "table")]
        #[serde(default)]
        pub rope_scaling: Option<serde_json::Value>,
        /// Std of the random initialisation (HF's `initializer_range`, default 0.02).
        #[serde(default)]
        pub initializer_range: Option<f64>,
        /// Metadata in the exported config (the drafter borrows the target's embedding either way).
        #[serde(default)]
        pub tie_word_embeddings: bool,
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize, plugin_api::Describe)]
#[serde(rename_all = "lowercase")]
pub enum AttentionKind {
    #[default]
    Split,
    Masked,
}

impl DrafterSection {
    /// What can be checked without the target (ranges, the attention shape where the section
    /// gives it, `rope_scaling`), so a bad section is refused before the target loads.
    pub fn check(&self) -> Result<(), PluginError> {
        let bad = |field: &str, why: String| PluginError::new(format!("field `{field}`: {why}"));
        if self.num_hidden_layers == 0 || self.num_hidden_layers > 64 {
            let n = self.num_hidden_layers;
            return Err(bad("num_hidden_layers", format!("must be in 1..=64, got {n}")));
        }
        drafter_layers::dflash::check(self.block_size, self.num_target_features, self.target_layer_ids.as_deref())?;
        if let (Some(heads), Some(kv_heads)) = (self.num_attention_heads, self.num_key_value_heads) {
            check_heads(heads, kv_heads)?;
        }
        if let Some(head_dim) = self.head_dim {
            check_head_dim(head_dim)?;
        }
        if self.intermediate_size == Some(0) {
            return Err(bad("intermediate_size", "0: must be >= 1".into()));
        }
        if let Some(v) = &self.rope_scaling {
            RopeScaling::from_json(v).map_err(|e| bad("rope_scaling", e))?;
        }
        Ok(())
    }

    /// The full drafter config for `target`, validated.
    pub fn resolve(&self, target: &TargetSpec) -> Result<DFlashConfig, PluginError> {
        let bad = |field: &str, why: String| PluginError::new(format!("field `{field}`: {why}"));
        self.check()?;
        let heads = self.num_attention_heads.unwrap_or(target.num_attention_heads as usize);
        let kv_heads = self.num_key_value_heads.unwrap_or(target.num_key_value_heads as usize);
        let head_dim = self.head_dim.unwrap_or(target.head_dim as usize);
        check_heads(heads, kv_heads)?;
        check_head_dim(head_dim)?;
        let dflash_config = drafter_layers::dflash::resolve(
            self.block_size,
            self.num_target_features,
            self.target_layer_ids.as_deref(),
            self.mask_token_id,
            target,
        )?;
        let facts = drafter_layers::target_facts::read(target)?;
        let rope_scaling = match (&self.rope_scaling, facts.rope_scaling) {
            (Some(v), _) => RopeScaling::from_json(v).map_err(|e| bad("rope_scaling", e))?,
            (None, Some(v)) => RopeScaling::from_json(&v).map_err(|e| {
                bad(
                    "rope_scaling",
                    format!("the target's ({}): {e}; set it in [drafter] to train another", target.source),
                )
            })?,
            (None, None) => RopeScaling::Default,
        };
        let layer_types =
            self.layer_types.clone().unwrap_or_else(|| vec![FULL_ATTENTION.into(); self.num_hidden_layers]);
        let mut cfg = DFlashConfig {
            architectures: vec!["DFlashDraftModel".into()],
            auto_map: config::default_auto_map(),
            model_type: "qwen3".into(),
            hidden_size: target.hidden_size as usize,
            intermediate_size: self.intermediate_size.unwrap_or(target.intermediate_size as usize),
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            vocab_size: target.vocab_size as usize,
            rms_norm_eps: self.rms_norm_eps.unwrap_or(target.rms_norm_eps),
            rope_theta: self.rope_theta.unwrap_or(target.rope_theta),
            rope_scaling,
            max_position_embeddings: self
                .max_position_embeddings
                .or(facts.max_position_embeddings)
                .unwrap_or_else(config::default_max_pos),
            attention_bias: false,
            attention_dropout: 0.0,
            hidden_act: "silu".into(),
            initializer_range: self.initializer_range.unwrap_or(drafter_layers::layers::INITIALIZER_RANGE),
            tie_word_embeddings: self.tie_word_embeddings,
            bos_token_id: target.bos_token_id.into_option(),
            eos_token_id: target.eos_token_id.into(),
            pad_token_id: target.pad_token_id.into_option(),
            block_size: self.block_size,
            num_target_layers: target.num_hidden_layers as usize,
            dflash_config,
            use_sliding_window: layer_types.iter().any(|t| t == SLIDING_ATTENTION),
            layer_types,
            sliding_window: self.sliding_window,
            max_window_layers: Some(self.num_hidden_layers),
            use_cache: true,
            dtype: "bfloat16".into(),
            transformers_version: None,
        };
        // The section's fields are the config's own names, so the check's message names them.
        cfg.check().map_err(PluginError::new)?;
        if self.sliding_window.is_some() && cfg.window().is_none() {
            return Err(bad("sliding_window", "set, but no layer in `layer_types` is `sliding_attention`".into()));
        }
        Ok(cfg)
    }
}

fn check_heads(heads: usize, kv_heads: usize) -> Result<(), PluginError> {
    if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 {
        return Err(PluginError::new(format!(
            "fields `num_attention_heads` / `num_key_value_heads`: {heads} heads do not split into groups of {kv_heads} KV heads"
        )));
    }
    Ok(())
}

fn check_head_dim(head_dim: usize) -> Result<(), PluginError> {
    if head_dim == 0 || head_dim % 2 != 0 {
        return Err(PluginError::new(format!("field `head_dim`: must be even and >= 2 (RoPE), got {head_dim}")));
    }
    Ok(())
}

pub struct DFlashPlugin {
    vs: nn::VarStore,
    model: model::DFlashDrafter,
    mode: model::TrainMode,
    /// The last training forward's tape, for its backward.
    pending: Option<model::Tape>,
    /// The next forward's anchors on the CPU (`anchors_on_host`), used by that forward only.
    host_anchors: Option<plugin_api::tch::Tensor>,
    /// The sequence being decoded (`decode_block`).
    decoding: model::DecodeCache,
    /// Drafting on static buffers with CUDA graphs (`decode_graph.rs`), made at the first draft
    /// on a CUDA device; `Err`: why not (said once).
    graphed: Option<Result<decode_graph::StaticDrafting, String>>,
}

impl DFlashPlugin {
    pub fn new(cfg: &DFlashConfig, device: Device, kind: Kind) -> Self {
        let (vs, model) = model::build(cfg, device, kind);
        Self {
            vs,
            model,
            mode: model::TrainMode::default(),
            pending: None,
            host_anchors: None,
            decoding: Default::default(),
            graphed: None,
        }
    }

    pub fn with_mode(mut self, mode: model::TrainMode) -> Self {
        self.mode = mode;
        self
    }
}

impl DrafterShell for DFlashPlugin {
    type Section = DrafterSection;
    type Config = DFlashConfig;
    const NAME: &'static str = "dflash";

    fn vs(&self) -> &nn::VarStore {
        &self.vs
    }
    fn config(&self) -> &DFlashConfig {
        &self.model.cfg
    }
    fn init_from(section: &DrafterSection) -> Option<&str> {
        section.init_from.as_deref()
    }
    fn resolve(section: &DrafterSection, target: &TargetSpec) -> Result<DFlashConfig, PluginError> {
        section.resolve(target)
    }
    fn read_folder(
        dir: &std::path::Path,
        target: &TargetSpec,
    ) -> Result<(DFlashConfig, Vec<NamedTensor>), PluginError> {
        read_zlab(dir, target)
    }
    fn build(cfg: &DFlashConfig, device: Device, kind: Kind) -> Self {
        Self::new(cfg, device, kind)
    }
}

impl DrafterPlugin for DFlashPlugin {
    drafter_layers::drafter_shell_methods!();

    fn forward(&mut self, input: &DrafterInput) -> Result<Tensor, PluginError> {
        let (th, emb, anchors) = (&input.target_hidden, &input.block_embeds, &input.anchors);
        self.pending = None;
        let host_anchors = self.host_anchors.take();
        if self.mode.own_backward() && grad_enabled() {
            let (out, tape) = self.model.forward_train(th, emb, anchors, host_anchors.as_ref(), self.mode);
            self.pending = Some(tape);
            return Ok(out);
        }
        Ok(self.model.forward(th, emb, anchors))
    }

    fn anchors_on_host(&mut self, anchors: &Tensor) -> Result<(), PluginError> {
        self.host_anchors = Some(anchors.shallow_clone());
        Ok(())
    }

    fn decode_block(
        &mut self,
        new_context: &Tensor,
        context_start: u32,
        block_embeds: &Tensor,
    ) -> Result<Option<Tensor>, PluginError> {
        let _guard = plugin_api::tch::no_grad_guard();
        if self.graphed.is_none() && block_embeds.device().is_cuda() && kernels::cuda_graph::enabled() {
            let made = decode_graph::StaticDrafting::new(&self.model);
            if let Err(why) = &made {
                eprintln!("drafter: drafting runs op by op, without CUDA graphs: {why}");
            }
            self.graphed = Some(made);
        }
        let out = match &mut self.graphed {
            Some(Ok(g)) => g.draft(&self.model, new_context, context_start as i64, block_embeds),
            _ => self.model.decode_block(&mut self.decoding, new_context, context_start as i64, block_embeds),
        };
        out.map(Some).map_err(PluginError::new)
    }

    fn backward(&mut self, grad: &Tensor) -> Result<(), PluginError> {
        let tape =
            self.pending.take().ok_or_else(|| PluginError::new("backward without a training forward before it"))?;
        self.model.backward(tape, grad);
        Ok(())
    }
}

/// Whether autograd records (training) or not (`no_grad`, drafting): tch does not expose it.
fn grad_enabled() -> bool {
    let leaf = plugin_api::tch::Tensor::zeros([1], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    (leaf * 2.0).requires_grad()
}

fn info() -> PluginInfo {
    PluginInfo::new(
        "dflash",
        PluginKind::Drafter,
        env!("CARGO_PKG_VERSION"),
        "DFlash block-diffusion drafter, dense Qwen3 layers (z-lab format)",
    )
}

/// Read a z-lab format drafter folder: its config (every field one the drafter honours, else the
/// first other is named), checked against the target, and weights.
pub fn read_zlab(dir: &std::path::Path, target: &TargetSpec) -> Result<(DFlashConfig, Vec<NamedTensor>), PluginError> {
    let mut cfg: DFlashConfig = drafter_layers::dflash::read_config(dir)?;
    cfg.check().map_err(|e| PluginError::new(format!("{}: {e}", dir.join("config.json").display())))?;
    drafter_layers::dflash::check_fits(dir, cfg.hidden_size, cfg.vocab_size, &cfg.dflash_config, target)?;
    Ok((cfg, drafter_layers::dflash::read_weights(dir)?))
}

fn create(config: &str, ctx: &HostContext) -> Result<PluginInstance, PluginError> {
    let (drafter, section) = shell::create::<DFlashPlugin>(config, ctx)?;
    let drafter = drafter.with_mode(model::TrainMode {
        split_attention: section.attention == AttentionKind::Split,
        checkpoint_layers: section.checkpoint_layers,
    });
    Ok(PluginInstance::drafter(drafter))
}

impl plugin_api::Section for DrafterSection {
    /// The fields as far as they go without the target, and the saved drafter `init_from` names.
    fn check(&self, ctx: &HostContext) -> Result<plugin_api::describe::SectionCheck, PluginError> {
        DrafterSection::check(self)?;
        shell::section_inputs(self.init_from.as_deref(), ctx)
    }

    /// A saved config of this drafter (`architectures` = `DFlashDraftModel`), checked, and the shapes it
    /// implies.
    fn saved_shapes(config_json: &str) -> Result<Option<plugin_api::describe::Shapes>, PluginError> {
        let Some(mut cfg) = shell::saved_config::<DFlashConfig>(config_json, "DFlashDraftModel")? else {
            return Ok(None);
        };
        cfg.check().map_err(PluginError::new)?;
        Ok(Some(cfg.parameter_shapes()))
    }

    /// Its weights, gradients and training activations at the query (`memory.rs`), for the
    /// target the host passes (`ctx.target`, from the target's own answer); unknown without one.
    fn memory(
        &self,
        ctx: &HostContext,
        q: plugin_api::describe::MemoryQuery,
    ) -> Result<Option<plugin_api::describe::SectionMemory>, PluginError> {
        let Some(target) = ctx.target.as_ref().into_option() else { return Ok(None) };
        let cfg = self.resolve(target)?;
        let elem = if ctx.tch_kind()? == Kind::Float { 4.0 } else { 2.0 };
        Ok(Some(memory::estimate(&cfg, q, elem, self.checkpoint_layers)))
    }
}

plugin_api::declare_plugin!(drafter_dflash, info, create, section = DrafterSection);

#[cfg(test)]
mod tests {
    use super::*;
    use test_support::TinySpec;

    /// What `parameter_shapes` says a config builds is what the drafter builds, sliding layers
    /// and a GQA shape included (export checks checkpoints against it).
    #[test]
    fn parameter_shapes_are_the_built_drafters() {
        let s: DrafterSection = plugin_api::parse_section(
            "num_hidden_layers = 2\nblock_size = 4\nnum_target_features = 3\nmask_token_id = 63\nnum_attention_heads = 4\n\
             num_key_value_heads = 2\nhead_dim = 8\nlayer_types = [\"sliding_attention\", \"full_attention\"]\nsliding_window = 5",
        )
        .unwrap();
        let cfg = s.resolve(&TargetSpec::tiny()).unwrap();
        let d = DFlashPlugin::new(&cfg, Device::Cpu, Kind::Float);
        let mut built: Vec<(String, Vec<i64>)> =
            d.parameters().into_iter().map(|(n, t)| (n, t.size())).collect::<Vec<_>>();
        let mut said = cfg.parameter_shapes();
        built.sort();
        said.sort();
        assert_eq!(said, built);
    }

    /// The published Qwen3.6-27B drafter's attention shape, not its target's; the target's when
    /// the section says nothing; a shape that does not group is refused naming the fields.
    #[test]
    fn the_attention_shape_can_differ_from_the_targets() {
        let t = TargetSpec::qwen3_6_27b();
        let s: DrafterSection = plugin_api::parse_section(
            "target_layer_ids = [1, 16, 31, 46, 61]\nmask_token_id = 248070\nnum_attention_heads = 32\nnum_key_value_heads = 8\nhead_dim = 128",
        )
        .unwrap();
        let c = s.resolve(&t).unwrap();
        assert_eq!(
            (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size),
            (32, 8, 128, 17408)
        );
        let s: DrafterSection = plugin_api::parse_section("mask_token_id = 248070").unwrap();
        let c = s.resolve(&t).unwrap();
        assert_eq!((c.num_attention_heads, c.num_key_value_heads, c.head_dim), (24, 4, 256));
        let s: DrafterSection = plugin_api::parse_section("mask_token_id = 248070\nnum_key_value_heads = 5").unwrap();
        let err = s.resolve(&t).err().unwrap().to_string();
        assert!(err.contains("`num_key_value_heads`") && err.contains("24 heads"), "{err}");
    }
}
