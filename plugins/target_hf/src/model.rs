//! The decoder in plain tch (candle's llama.rs / qwen3.rs order), one struct for every family:
//! a layer is a token mixer and an MLP, each in a residual branch after an RMSNorm. Weights are
//! looked up by their HF names (`model.layers.{i}.self_attn.q_proj.weight`), whatever file they
//! came from, and taken out of [`Weights`] as they are used, so that fusing projections into one
//! matrix does not hold two copies of the model.
//!
//! The token mixers: softmax attention (`attention.rs`: every family's variant, sliding windows
//! through the mask), Qwen3.5's Gated DeltaNet (`qwen3_5.rs`), LFM2's gated short conv
//! (`short_conv.rs`), multi-head latent attention (`mla.rs`). The MLPs: dense gated (SwiGLU,
//! Gemma's GeGLU) or routed experts (`moe.rs`). What each family changes:
//! - llama (mistral, ministral) / qwen2 / qwen3: attention (sliding layers where the config has
//!   a window, q/k/v biases for qwen2, q/k norms for qwen3), dense MLP;
//! - qwen3_moe: qwen3 attention, routed experts (some layers dense);
//! - qwen3_5 / qwen3_5_moe: 3 Gated DeltaNet layers to 1 attention layer (`layer_types`); the
//!   attention projects a sigmoid output gate with q and rotates only the first quarter of each
//!   head; every RMSNorm scales by (1 + weight); qwen3_5_moe adds experts and a gated shared expert;
//! - gemma2 / gemma3_text: embeddings times sqrt(H); norms (1 + w) before and after each
//!   sublayer; sliding and global layers (Gemma 3: each kind its RoPE base); scores scaled by
//!   1/sqrt(query_pre_attn_scalar) and (Gemma 2) soft-capped, as are the logits; GeGLU;
//! - gpt_oss: sliding and global attention with sinks and biases, routed experts only;
//! - lfm2: short-conv and attention layers (`operator_norm`, `ffn_norm`, `feed_forward.w1/w3/w2`,
//!   the final `embedding_norm`);
//! - deepseek_v3 (kimi_k2) / glm4_moe: MLA / partial-RoPE attention, dense first layers, then
//!   routed experts with a shared expert;
//! - longcat_flash: a layer is two (MLA, dense MLP) sublayers; the MoE reads the first
//!   sublayer's MLP input and its output joins the layer's output (`longcat.rs`).
use crate::{
    cache::{Cache, Slot},
    common::{causal_mask, rms_norm, window_mask, Context},
    config::{Arch, DecoderConfig, LayerKind},
    layer::{Layer, LayerPaths, TokenMixer},
    linear::Compute,
    longcat,
    rope::{rope_cos_sin, Rope},
    short_conv,
    tp::{Shard, TpGroup},
    weights::{Loader, WeightBytes, Weights},
};
use plugin_api::tch::{Device, Kind, Tensor};
use std::collections::HashMap;

/// A decoder layer: a [`Layer`], or LongCat-Flash's pair with its shortcut MoE.
pub(crate) enum Block {
    Plain(Layer),
    Longcat(longcat::LongcatLayer),
}

impl Block {
    fn layers(&self) -> &[Layer] {
        match self {
            Self::Plain(l) => std::slice::from_ref(l),
            Self::Longcat(l) => &l.sublayers,
        }
    }

    fn forward(&self, x: &Tensor, ctx: &Context, slots: Option<&mut [Slot]>) -> Tensor {
        match self {
            Self::Plain(layer) => layer.feed(&layer.mix(x, ctx, slots.map(|s| &mut s[0])), ctx),
            Self::Longcat(l) => l.forward(x, ctx, slots),
        }
    }
}

pub struct Decoder {
    pub cfg: DecoderConfig,
    /// The RoPE of full layers, then (Gemma 3) of sliding ones.
    ropes: Vec<Rope>,
    pub embed_tokens: Tensor,
    /// Gemma: embeddings times sqrt(H).
    embed_scale: Option<f64>,
    pub lm_head: Tensor,
    /// Gemma 2: logits -> cap tanh(logits / cap).
    logit_cap: Option<f64>,
    norm: Tensor,
    blocks: Vec<Block>,
    /// Where each block's cache slots start.
    slot_start: Vec<usize>,
    /// The replica's group when the model is spread over several ranks (`tp.rs`).
    pub tp: Option<TpGroup>,
    /// The weights this rank holds.
    pub held: WeightBytes,
}

impl Decoder {
    /// Build from HF-named weights, converted to `kind` on `device`; the weights are consumed.
    pub fn new(cfg: &DecoderConfig, w: Weights, device: Device, kind: Kind) -> Result<Self, String> {
        Self::new_shard(cfg, w, device, kind, Shard::WHOLE, None)
    }

    /// This rank's part of the model (`shard`, see `tp.rs`), its rows and columns read from the
    /// weights (and nothing else of them), the group joined; the replica's other ranks build
    /// theirs at the same time.
    pub fn new_shard(
        cfg: &DecoderConfig,
        w: Weights,
        device: Device,
        kind: Kind,
        shard: Shard,
        tp: Option<TpGroup>,
    ) -> Result<Self, String> {
        Self::new_shard_with(cfg, w, device, kind, shard, tp, Compute::Bf16)
    }

    /// [`new_shard`](Self::new_shard) with the projections in `compute`'s precision (`linear.rs`).
    pub fn new_shard_with(
        cfg: &DecoderConfig,
        mut w: Weights,
        device: Device,
        kind: Kind,
        shard: Shard,
        tp: Option<TpGroup>,
        compute: Compute,
    ) -> Result<Self, String> {
        Self::build_shard(cfg, &mut Loader { shard, compute, ..Loader::new(&mut w, device, kind) }, tp)
    }

    /// Random weights at `cfg`'s shapes, drawn as each is looked up (`random::draw`), this rank's
    /// part of them (see `new_shard`).
    pub fn random_shard(
        cfg: &DecoderConfig,
        device: Device,
        kind: Kind,
        shard: Shard,
        tp: Option<TpGroup>,
    ) -> Result<Self, String> {
        Self::random_shard_with(cfg, device, kind, shard, tp, Compute::Bf16)
    }

    /// [`random_shard`](Self::random_shard) with the projections in `compute`'s precision.
    pub fn random_shard_with(
        cfg: &DecoderConfig,
        device: Device,
        kind: Kind,
        shard: Shard,
        tp: Option<TpGroup>,
        compute: Compute,
    ) -> Result<Self, String> {
        let mut w = Weights::in_memory(HashMap::new(), "random_init");
        Self::build_shard(cfg, &mut Loader { random: true, shard, compute, ..Loader::new(&mut w, device, kind) }, tp)
    }

    fn build_shard(cfg: &DecoderConfig, ld: &mut Loader, tp: Option<TpGroup>) -> Result<Self, String> {
        let shard = ld.shard;
        crate::tp::check(cfg, shard)?;
        // (The group may come later, at the first forward: `HfTarget::pending_group`.)
        if tp.as_ref().is_some_and(|g| g.size != shard.size) {
            return Err(format!("a model split over {} ranks needs a group of that size", shard.size));
        }
        let mut model = Self::build(cfg, ld)?;
        model.tp = tp;
        if ld.quantised_at_load > 0 && !ld.random {
            eprintln!(
                "target: compute = \"fp8\": {} projection weights were not stored as FP8 in 128x128 blocks \
                 this rank can keep (a bf16/f32 checkpoint, another block size, or a tensor-parallel slice \
                 cutting blocks): quantised at load in 128x128 blocks",
                ld.quantised_at_load
            );
        }
        Ok(model)
    }

    pub(crate) fn build(cfg: &DecoderConfig, ld: &mut Loader) -> Result<Self, String> {
        cfg.validate()?;
        let (h, v) = (cfg.hidden_size as i64, cfg.vocab_size as i64);
        // A checkpoint's own head wins; without one (tied embeddings) the embedding serves.
        let untied = if ld.random { !cfg.tie_word_embeddings } else { ld.w.contains("lm_head.weight") };
        let embed_tokens = ld.get("model.embed_tokens.weight", &[v, h])?;
        let lm_head = if untied { ld.get("lm_head.weight", &[v, h])? } else { embed_tokens.shallow_clone() };
        let mut ropes = vec![Rope::for_kind(cfg, LayerKind::Full)?];
        if cfg.arch() == Arch::Gemma3 {
            ropes.push(Rope::for_kind(cfg, LayerKind::Sliding)?);
        }
        // The count may come from a hostile file: reserve no more than the weights could fill.
        let mut blocks = Vec::with_capacity(cfg.num_hidden_layers.min(ld.w.len()));
        let (mut slot_start, mut slots) = (Vec::with_capacity(blocks.capacity()), 0);
        for i in 0..cfg.num_hidden_layers {
            let block = if cfg.arch() == Arch::LongcatFlash {
                Block::Longcat(longcat::LongcatLayer::load(cfg, ld, i)?)
            } else {
                Block::Plain(Layer::load(cfg, ld, i, &LayerPaths::plain(cfg, i), cfg.is_sparse_layer(i))?)
            };
            slot_start.push(slots);
            slots += block.layers().len();
            blocks.push(block);
        }
        let norm = ld.norm(&format!("{}.weight", cfg.norm_names().last), h, cfg.centred_norms())?;
        let gemma = matches!(cfg.arch(), Arch::Gemma2 | Arch::Gemma3);
        Ok(Self {
            cfg: cfg.clone(),
            ropes,
            embed_tokens,
            embed_scale: gemma.then(|| (cfg.hidden_size as f64).sqrt()),
            lm_head,
            logit_cap: cfg.final_logit_softcapping,
            norm,
            blocks,
            slot_start,
            tp: None,
            held: ld.held,
        })
    }

    pub fn device(&self) -> Device {
        self.embed_tokens.device()
    }

    pub fn kind(&self) -> Kind {
        self.embed_tokens.kind()
    }

    /// Every token mixer in the order the forward runs them (a cache slot each).
    fn mixers(&self) -> impl Iterator<Item = &TokenMixer> {
        self.blocks.iter().flat_map(|b| b.layers().iter().map(|l| &l.mixer))
    }

    /// An empty cache with a slot per token mixer; `rollback` keeps what
    /// [`truncate`](Self::truncate) needs to cut into the last extension (the
    /// speculative-decoding session).
    pub fn new_cache(&self, rollback: bool) -> Cache {
        Cache::new(&self.mixers().map(TokenMixer::kind).collect::<Vec<_>>(), rollback)
    }

    /// A cache whose keys and values sit in buffers of `capacity` positions (`decode_graph.rs`),
    /// or why this model cannot keep one: only softmax attention without a window keeps nothing
    /// but keys and values, and a replica split over ranks talks to its group in a forward.
    pub fn new_static_cache(&self, capacity: i64) -> Result<Cache, String> {
        if self.tp.is_some() {
            return Err("the model is split over ranks".into());
        }
        for layer in self.blocks.iter().flat_map(Block::layers) {
            if !matches!(layer.mixer, TokenMixer::Attention(_)) {
                return Err(format!("its {:?} layers keep more than keys and values", layer.mixer.kind()));
            }
            if layer.window.is_some() {
                return Err("it has sliding-window layers".into());
            }
        }
        let mut cache = self.new_cache(false);
        cache.capacity = Some(capacity);
        Ok(cache)
    }

    /// Run the decoder.
    /// - `ids` [B, L] int64, `positions` [B, L] int64 (RoPE positions);
    /// - `mask` [B, 1, L, T] bool over all keys (cache + new), true = visible; None = causal;
    ///   sliding layers see only their window of it;
    /// - `valid` [B, L] bool: false on left padding, whose rows the recurrent layers (Gated
    ///   DeltaNet, short conv) zero (so a padded row's state starts at its first token); None =
    ///   all valid;
    /// - `cache` extended in place when given;
    /// - `upto`: run only layers `0..upto` (the features needed), skipping the rest;
    /// - returns the outputs of the layers `keep` names concatenated in its order ([B, L, n*H]; each
    ///   id below `upto`) and, if all layers ran, the final-normed hidden states. As in
    ///   transformers' `hidden_states[1..]`, which DFlash's `hidden_states[id + 1]` reads, the last
    ///   layer's output is taken after the final norm (the LM head's input).
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        mask: Option<&Tensor>,
        valid: Option<&Tensor>,
        mut cache: Option<&mut Cache>,
        upto: usize,
        keep: &[u32],
    ) -> (Tensor, Option<Tensor>) {
        let (l, device) = (ids.size()[1], ids.device());
        let past = cache.as_ref().map_or(0, |c| c.len());
        // Causal attention after cached keys needs its mask written out.
        let full = match mask {
            Some(m) => Some(m.shallow_clone()),
            None if past > 0 => Some(causal_mask(l, past + l, device)),
            None => None,
        };
        let mut windows: Vec<i64> =
            self.blocks.iter().take(upto).flat_map(|b| b.layers().iter().filter_map(|l| l.window)).collect();
        windows.sort_unstable();
        windows.dedup();
        let ctx = Context {
            eps: self.cfg.rms_norm_eps,
            tables: self.ropes.iter().map(|r| rope_cos_sin(positions, r, self.kind())).collect(),
            windowed: windows.iter().map(|&w| (w, window_mask(full.as_ref(), past, l, w, device))).collect(),
            full,
            valid,
            rollback: cache.as_ref().is_some_and(|c| c.rollback),
            static_write: cache
                .as_ref()
                .and_then(|c| c.capacity)
                .map(|capacity| crate::cache::StaticWrite { positions: positions.select(0, 0), capacity }),
            tp: self.tp.as_ref(),
        };
        let mut x = Tensor::embedding(&self.embed_tokens, ids, -1, false, false);
        if let Some(scale) = self.embed_scale {
            x = x * Tensor::from(scale).to_kind(self.kind()).to_device(device);
        }
        // Each kept layer's output is copied into its slot as the layer ends, so no other layer's
        // output outlives the next layer (the features' bytes, not every layer's, at the peak).
        let h = x.size()[2];
        let features = Tensor::empty([x.size()[0], l, keep.len() as i64 * h], (x.kind(), device));
        let slots_of =
            |i: usize| keep.iter().enumerate().filter(move |&(_, &k)| k as usize == i).map(|(j, _)| j as i64);
        for (i, block) in self.blocks.iter().take(upto).enumerate() {
            let n = block.layers().len();
            let slots = cache.as_deref_mut().map(|c| &mut c.slots[self.slot_start[i]..self.slot_start[i] + n]);
            x = block.forward(&x, &ctx, slots);
            if i + 1 < self.blocks.len() {
                for j in slots_of(i) {
                    features.narrow(2, j * h, h).copy_(&x);
                }
            }
        }
        if let Some(c) = cache {
            c.extended(l);
        }
        let normed = (upto >= self.blocks.len()).then(|| rms_norm(&x, &self.norm, self.cfg.rms_norm_eps));
        for j in slots_of(self.blocks.len() - 1) {
            features.narrow(2, j * h, h).copy_(normed.as_ref().expect("the last layer ran"));
        }
        (features, normed)
    }

    pub fn logits(&self, normed: &Tensor) -> Tensor {
        let _r = crate::common::range("lm head");
        let logits = normed.matmul(&self.lm_head.tr());
        match self.logit_cap {
            Some(cap) => (logits / cap).tanh() * cap,
            None => logits,
        }
    }

    /// Keep the first `len` cached positions: attention caches are cut; a recurrent state (Gated
    /// DeltaNet, short conv), which cannot be, is recomputed from the state before the last
    /// extension over the positions kept (so `len` must not be before that extension, unless
    /// it is 0).
    pub fn truncate(&self, cache: &mut Cache, len: i64) -> Result<(), String> {
        if len > cache.len() {
            return Err(format!("cache_truncate({len}) beyond the cache ({})", cache.len()));
        }
        if len == cache.len() {
            return Ok(());
        }
        if len == 0 && cache.capacity.is_none() {
            *cache = self.new_cache(cache.rollback);
            return Ok(());
        }
        let recurrent = self.mixers().any(|m| matches!(m, TokenMixer::Linear(_) | TokenMixer::ShortConv(_)));
        let start = cache.last_extension_start();
        if recurrent && !(cache.rollback && len >= start) {
            return Err(format!(
                "cache_truncate({len}): a recurrent state (Gated DeltaNet, short conv) rolls back only within the \
                 last extension (positions {start}..{}), or to 0",
                cache.len()
            ));
        }
        for (mixer, slot) in self.mixers().zip(cache.slots.iter_mut()) {
            match (mixer, slot) {
                // Static buffers keep their length: positions past `len` are rewritten before
                // any query sees them.
                (_, Slot::Kv(_)) if cache.capacity.is_some() => {}
                (_, Slot::Kv(kv)) => {
                    if let Some((k, v)) = kv.as_mut() {
                        *k = k.narrow(2, 0, len);
                        *v = v.narrow(2, 0, len);
                    }
                }
                (TokenMixer::Linear(g), Slot::Linear(Some(state))) => g.rewind(state, len - start),
                (_, Slot::Conv(Some(state))) => short_conv::rewind(state, len - start),
                _ => {}
            }
        }
        cache.set_len(len);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{config::DecoderConfig, generate};

    fn tiny(model_type: &str) -> (DecoderConfig, Weights) {
        let cfg = DecoderConfig {
            model_type: model_type.into(),
            hidden_size: 32,
            intermediate_size: 48,
            num_hidden_layers: 3,
            num_attention_heads: 4,
            num_key_value_heads: Some(2),
            head_dim: Some(8),
            vocab_size: 50,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            tie_word_embeddings: model_type == "llama",
            ..Default::default()
        };
        plugin_api::tch::manual_seed(11);
        let mut t = HashMap::new();
        let mut add = |name: String, shape: &[i64], scale: f64| {
            t.insert(name, Tensor::randn(shape, (Kind::Float, Device::Cpu)) * scale);
        };
        add("model.embed_tokens.weight".into(), &[50, 32], 1.0);
        add("model.norm.weight".into(), &[32], 1.0);
        if model_type != "llama" {
            add("lm_head.weight".into(), &[50, 32], 0.5);
        }
        for i in 0..3 {
            let p = format!("model.layers.{i}");
            for (n, shape) in [
                ("self_attn.q_proj.weight", vec![32, 32]),
                ("self_attn.k_proj.weight", vec![16, 32]),
                ("self_attn.v_proj.weight", vec![16, 32]),
                ("self_attn.o_proj.weight", vec![32, 32]),
                ("mlp.gate_proj.weight", vec![48, 32]),
                ("mlp.up_proj.weight", vec![48, 32]),
                ("mlp.down_proj.weight", vec![32, 48]),
                ("input_layernorm.weight", vec![32]),
                ("post_attention_layernorm.weight", vec![32]),
            ] {
                add(format!("{p}.{n}"), &shape, 0.2);
            }
            if model_type == "qwen2" {
                add(format!("{p}.self_attn.q_proj.bias"), &[32], 0.2);
                add(format!("{p}.self_attn.k_proj.bias"), &[16], 0.2);
                add(format!("{p}.self_attn.v_proj.bias"), &[16], 0.2);
            }
            if model_type == "qwen3" {
                add(format!("{p}.self_attn.q_norm.weight"), &[8], 1.0);
                add(format!("{p}.self_attn.k_norm.weight"), &[8], 1.0);
            }
        }
        (cfg, Weights::in_memory(t, "tiny"))
    }

    #[test]
    fn every_family_decodes_consistently() {
        for family in ["llama", "qwen2", "qwen3"] {
            let (cfg, w) = tiny(family);
            let model = Decoder::new(&cfg, w, Device::Cpu, Kind::Float).unwrap();
            // KV-cache greedy decoding equals recomputing the whole sequence each step.
            let prompt: Vec<u32> = vec![3, 17, 8, 42, 5];
            let cached = generate::greedy(&model, std::slice::from_ref(&prompt), 6, &[], 1).remove(0);
            let mut ids = prompt.clone();
            for _ in 0..6 {
                let x = Tensor::from_slice(&ids.iter().map(|&i| i as i64).collect::<Vec<_>>()).unsqueeze(0);
                let pos = Tensor::arange(ids.len() as i64, (Kind::Int64, Device::Cpu)).unsqueeze(0);
                let (_, normed) = model.run(&x, &pos, None, None, None, 3, &[]);
                let next = model.logits(&normed.unwrap()).select(1, ids.len() as i64 - 1).argmax(-1, false);
                ids.push(next.int64_value(&[0]) as u32);
            }
            assert_eq!(cached, ids[prompt.len()..].to_vec(), "{family}");
        }
    }

    #[test]
    fn missing_and_misshapen_weights_are_named() {
        let (cfg, mut w) = tiny("qwen3");
        w.tensors.remove("model.layers.1.self_attn.k_norm.weight");
        let err = Decoder::new(&cfg, w, Device::Cpu, Kind::Float).err().unwrap();
        assert!(err.contains("missing tensor `model.layers.1.self_attn.k_norm.weight`"), "{err}");
        let (cfg, mut w) = tiny("qwen2");
        w.tensors
            .insert("model.layers.0.mlp.up_proj.weight".into(), Tensor::zeros([47, 32], (Kind::Float, Device::Cpu)));
        let err = Decoder::new(&cfg, w, Device::Cpu, Kind::Float).err().unwrap();
        assert!(err.contains("`model.layers.0.mlp.up_proj.weight` has shape [47, 32], expected [48, 32]"), "{err}");
    }
}
