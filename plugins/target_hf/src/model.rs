//! The decoder in plain tch (candle's llama.rs / qwen3.rs order), one struct for every family:
//! a layer is a token mixer (softmax attention, or Qwen3.5's Gated DeltaNet in `qwen3_5.rs`)
//! and an MLP (dense SwiGLU, or routed experts in `moe.rs`) between RMSNorms. Weights are looked
//! up by their HF names (`model.layers.{i}.self_attn.q_proj.weight`), whatever file they came
//! from, and taken out of [`Weights`] as they are used, so that fusing projections into one
//! matrix does not hold two copies of the model.
//!
//! What each family changes:
//! - llama / qwen2 / qwen3: attention (q/k/v biases for qwen2, q/k norms for qwen3), dense MLP;
//! - qwen3_moe: qwen3 attention, routed experts (some layers dense);
//! - qwen3_5 / qwen3_5_moe: 3 Gated DeltaNet layers to 1 attention layer (`layer_types`); the
//!   attention projects a sigmoid output gate with q and rotates only the first quarter of each
//!   head; every RMSNorm scales by (1 + weight); qwen3_5_moe adds experts and a gated shared expert.

use crate::{
    cache::{Cache, Slot},
    config::{DecoderConfig, Mixer},
    moe::SparseMoe,
    qwen3_5::GatedDeltaNet,
};
use plugin_api::tch::{Device, Kind, Tensor};
use rope_scaling::RopeScaling;
use std::collections::HashMap;

/// Named weights with checked look-ups: a missing tensor or a wrong shape names the tensor.
pub struct Weights {
    pub tensors: HashMap<String, Tensor>,
    pub source: String,
}

impl Weights {
    /// Take `name` out, checking its shape.
    pub fn take(&mut self, name: &str, shape: &[i64]) -> Result<Tensor, String> {
        let t = self.tensors.remove(name).ok_or_else(|| format!("{}: missing tensor `{name}`", self.source))?;
        if t.size() != shape {
            return Err(format!("{}: tensor `{name}` has shape {:?}, expected {:?}", self.source, t.size(), shape));
        }
        Ok(t)
    }

    pub fn take_opt(&mut self, name: &str, shape: &[i64]) -> Result<Option<Tensor>, String> {
        if self.tensors.contains_key(name) {
            self.take(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}

/// Weights converted to the model's device and dtype as they are taken.
pub(crate) struct Loader<'a> {
    pub w: &'a mut Weights,
    pub device: Device,
    pub kind: Kind,
}

impl Loader<'_> {
    pub fn get(&mut self, name: &str, shape: &[i64]) -> Result<Tensor, String> {
        Ok(self.w.take(name, shape)?.to_device(self.device).to_kind(self.kind))
    }

    /// In fp32 whatever the model's dtype (gates, decay rates, norm gains).
    pub fn get_f32(&mut self, name: &str, shape: &[i64]) -> Result<Tensor, String> {
        Ok(self.w.take(name, shape)?.to_device(self.device).to_kind(Kind::Float))
    }

    /// Several [out_i, in] matrices stacked into one [sum out_i, in]: one GEMM where the
    /// checkpoint has several (q|k|v, a GDN layer's four input projections).
    pub fn fused(&mut self, parts: &[(String, i64)], inp: i64) -> Result<Tensor, String> {
        let ts = parts.iter().map(|(n, out)| self.get(n, &[*out, inp])).collect::<Result<Vec<_>, _>>()?;
        Ok(if ts.len() == 1 { ts.into_iter().next().expect("one part") } else { Tensor::cat(&ts, 0) })
    }

    /// An RMSNorm's effective gain: `w`, or `1 + w` for Qwen3.5's centred norms (in fp32, then
    /// the model's dtype, as transformers computes `(1.0 + weight.float())`).
    pub fn norm(&mut self, name: &str, dim: i64, centred: bool) -> Result<Tensor, String> {
        let w = self.w.take(name, &[dim])?.to_device(self.device).to_kind(Kind::Float);
        Ok(if centred { w + 1.0 } else { w }.to_kind(self.kind))
    }
}

/// HF's RMSNorm (fp32 statistics); libtorch's `rms_norm` is one fused kernel on CUDA.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    x.rms_norm(w.size(), Some(w), eps)
}

/// A decoder's RoPE: the dims it rotates, its base and scaling (frequencies from the
/// `rope_scaling` crate, which the drafters share).
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    pub rotary_dim: usize,
    pub theta: f64,
    pub scaling: RopeScaling,
    /// Where dynamic NTK scaling starts (unused by the other kinds).
    pub max_position_embeddings: usize,
    /// A GGUF's per-frequency divisors (Llama 3's scaling as llama.cpp stores it).
    pub freq_factors: Option<Vec<f64>>,
}

impl Rope {
    pub fn new(cfg: &DecoderConfig) -> Result<Self, String> {
        Ok(Self {
            rotary_dim: cfg.rotary_dim(),
            theta: cfg.rope_theta,
            scaling: cfg.rope_scaling()?,
            max_position_embeddings: cfg.max_position_embeddings.unwrap_or(0),
            freq_factors: cfg.rope_freq_factors.clone(),
        })
    }

    /// Unscaled RoPE over `rotary_dim` dims.
    pub fn plain(rotary_dim: usize, theta: f64) -> Self {
        Self { rotary_dim, theta, scaling: RopeScaling::Default, max_position_embeddings: 0, freq_factors: None }
    }
}

/// Rotary tables for positions [B, L] over the first `rope.rotary_dim` dims of a head -> (cos,
/// signed sin) [B, 1, L, rotary_dim]; the sine's first half is negated so that [`apply_rope`]
/// needs no negation pass. A scaling changes the frequencies and may scale cos and sin (YaRN's
/// attention factor); dynamic NTK takes the sequence length from the largest position of this
/// call (transformers keeps the largest length seen until a sequence fits the context again:
/// the same for one forward or a growing decode).
pub fn rope_cos_sin(positions: &Tensor, rope: &Rope, kind: Kind) -> (Tensor, Tensor) {
    let d = rope.rotary_dim as i64;
    let device = positions.device();
    let (inv_freq, attention) = match (&rope.scaling, &rope.freq_factors) {
        (_, Some(factors)) => {
            let (base, _) = RopeScaling::Default.inv_freq(rope.rotary_dim, rope.theta);
            let freqs: Vec<f64> = base.iter().zip(factors).map(|(f, k)| f / k).collect();
            (Tensor::from_slice(&freqs).to_kind(Kind::Float).to_device(device), 1.0)
        }
        (RopeScaling::Default, None) => {
            ((Tensor::arange_start_step(0, d, 2, (Kind::Float, device)) / d as f64 * -rope.theta.ln()).exp(), 1.0)
        }
        (scaled, None) => {
            // The only device sync, and only for dynamic NTK.
            let seq_len = if scaled.depends_on_length() { positions.max().int64_value(&[]) as usize + 1 } else { 0 };
            let (freqs, attention) =
                scaled.inv_freq_at(rope.rotary_dim, rope.theta, seq_len, rope.max_position_embeddings);
            (Tensor::from_slice(&freqs).to_kind(Kind::Float).to_device(device), attention)
        }
    };
    let freqs = positions.to_kind(Kind::Float).unsqueeze(-1) * inv_freq; // [B, L, D/2]
    let mut cos = Tensor::cat(&[&freqs, &freqs], -1).cos().unsqueeze(1);
    let mut sin = freqs.sin();
    if attention != 1.0 {
        cos = cos * attention;
        sin = sin * attention;
    }
    let signed_sin = Tensor::cat(&[&(-&sin), &sin], -1).unsqueeze(1);
    (cos.to_kind(kind), signed_sin.to_kind(kind))
}

/// x * cos + rotate_half(x) * sin on the first `cos.size(-1)` dims of each head (the rest pass
/// through: Qwen3.5's partial rotary), with rotate_half([a, b]) = [-b, a] as x * cos + [b, a] *
/// signed_sin: three passes (swap, scale, fused multiply-add) where the textbook form takes five.
pub fn apply_rope(x: &Tensor, cos: &Tensor, signed_sin: &Tensor) -> Tensor {
    let (d, r) = (x.size()[3], cos.size()[3]);
    let rot = if r == d { x.shallow_clone() } else { x.narrow(3, 0, r) };
    let half = r / 2;
    let swapped = Tensor::cat(&[rot.narrow(3, half, half), rot.narrow(3, 0, half)], 3);
    let rotated = (&rot * cos).addcmul(&swapped, signed_sin);
    if r == d {
        rotated
    } else {
        Tensor::cat(&[rotated, x.narrow(3, r, d - r)], 3)
    }
}

/// Softmax attention with grouped-query heads: q|k|v in one GEMM (Qwen3.5: q and its output
/// gate interleaved per head, [q_h | gate_h]), optional q/k norms per head, RoPE over the first
/// `rotary_dim` dims of a head.
pub struct Attention {
    qkv: Tensor,
    qkv_bias: Option<Tensor>,
    o_proj: Tensor,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    gated: bool,
    num_heads: i64,
    num_kv_heads: i64,
    head_dim: i64,
}

impl Attention {
    fn load(cfg: &DecoderConfig, ld: &mut Loader, p: &str) -> Result<Self, String> {
        let h = cfg.hidden_size as i64;
        let (nh, nkv, d) = (cfg.num_attention_heads as i64, cfg.num_kv_heads() as i64, cfg.head_dim() as i64);
        let gated = cfg.is_hybrid();
        let q_rows = if gated { 2 * nh * d } else { nh * d };
        let names = [("q_proj", q_rows), ("k_proj", nkv * d), ("v_proj", nkv * d)];
        let qkv = ld.fused(&names.map(|(n, r)| (format!("{p}.self_attn.{n}.weight"), r)), h)?;
        let qkv_bias = if cfg.qkv_bias() {
            let b = names
                .iter()
                .map(|(n, r)| ld.get(&format!("{p}.self_attn.{n}.bias"), &[*r]))
                .collect::<Result<Vec<_>, _>>()?;
            Some(Tensor::cat(&b, 0))
        } else {
            None
        };
        let (q_norm, k_norm) = if cfg.qk_norm() {
            let centred = cfg.centred_norms();
            (
                Some(ld.norm(&format!("{p}.self_attn.q_norm.weight"), d, centred)?),
                Some(ld.norm(&format!("{p}.self_attn.k_norm.weight"), d, centred)?),
            )
        } else {
            (None, None)
        };
        let o_proj = ld.get(&format!("{p}.self_attn.o_proj.weight"), &[h, nh * d])?;
        Ok(Self { qkv, qkv_bias, o_proj, q_norm, k_norm, gated, num_heads: nh, num_kv_heads: nkv, head_dim: d })
    }

    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
        cache: Option<&mut Option<(Tensor, Tensor)>>,
        eps: f64,
    ) -> Tensor {
        let (b, l) = (x.size()[0], x.size()[1]);
        let (nh, nkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        // 1. Project, split, (Qwen3.5) split q from its gate, normalise per head,
        //    (B, L, H, D) -> (B, H, L, D), rotate.
        let qkv = x.linear(&self.qkv, self.qkv_bias.as_ref());
        let q_rows = if self.gated { 2 * nh * d } else { nh * d };
        let (mut q, gate) = if self.gated {
            let qg = qkv.narrow(2, 0, q_rows).view([b, l, nh, 2 * d]);
            (qg.narrow(3, 0, d), Some(qg.narrow(3, d, d)))
        } else {
            (qkv.narrow(2, 0, q_rows).view([b, l, nh, d]), None)
        };
        let mut k = qkv.narrow(2, q_rows, nkv * d).view([b, l, nkv, d]);
        let v = qkv.narrow(2, q_rows + nkv * d, nkv * d).view([b, l, nkv, d]);
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            q = rms_norm(&q, qn, eps);
            k = rms_norm(&k, kn, eps);
        }
        let q = apply_rope(&q.transpose(1, 2), cos, sin);
        let mut k = apply_rope(&k.transpose(1, 2), cos, sin);
        let mut v = v.transpose(1, 2);
        // 2. Append to the cache.
        if let Some(slot) = cache {
            if let Some((pk, pv)) = slot.as_ref() {
                k = Tensor::cat(&[pk, &k], 2);
                v = Tensor::cat(&[pv, &v], 2);
            }
            *slot = Some((k.shallow_clone(), v.shallow_clone()));
        }
        // 3. Attention (GQA by head groups), (B, H, L, D) -> (B, L, H*D), (Qwen3.5) times
        //    sigmoid(gate), o_proj.
        let o = Tensor::scaled_dot_product_attention(&q, &k, &v, mask, 0.0, mask.is_none() && l > 1, None::<f64>, true);
        let o = o.transpose(1, 2);
        let o = match gate {
            Some(g) => o * g.sigmoid(),
            None => o,
        };
        o.reshape([b, l, nh * d]).linear::<&Tensor>(&self.o_proj, None)
    }
}

/// SwiGLU: down(silu(gate(x)) * up(x)).
pub struct Mlp {
    gate_proj: Tensor,
    up_proj: Tensor,
    down_proj: Tensor,
}

impl Mlp {
    pub(crate) fn load(ld: &mut Loader, p: &str, hidden: i64, width: i64) -> Result<Self, String> {
        Ok(Self {
            gate_proj: ld.get(&format!("{p}.gate_proj.weight"), &[width, hidden])?,
            up_proj: ld.get(&format!("{p}.up_proj.weight"), &[width, hidden])?,
            down_proj: ld.get(&format!("{p}.down_proj.weight"), &[hidden, width])?,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        (x.linear::<&Tensor>(&self.gate_proj, None).silu() * x.linear::<&Tensor>(&self.up_proj, None))
            .linear::<&Tensor>(&self.down_proj, None)
    }
}

enum TokenMixer {
    Attention(Attention),
    Linear(GatedDeltaNet),
}

enum Ffn {
    Dense(Mlp),
    Sparse(SparseMoe),
}

struct Layer {
    mixer: TokenMixer,
    ffn: Ffn,
    input_layernorm: Tensor,
    post_attention_layernorm: Tensor,
}

pub struct Decoder {
    pub cfg: DecoderConfig,
    rope: Rope,
    pub embed_tokens: Tensor,
    pub lm_head: Tensor,
    norm: Tensor,
    layers: Vec<Layer>,
}

impl Decoder {
    /// Build from HF-named weights, converted to `kind` on `device`; the weights are consumed.
    pub fn new(cfg: &DecoderConfig, mut w: Weights, device: Device, kind: Kind) -> Result<Self, String> {
        cfg.validate()?;
        let (h, v) = (cfg.hidden_size as i64, cfg.vocab_size as i64);
        // A checkpoint's own head wins; without one (tied embeddings) the embedding serves.
        let untied = w.contains("lm_head.weight");
        let mut ld = Loader { w: &mut w, device, kind };
        let embed_tokens = ld.get("model.embed_tokens.weight", &[v, h])?;
        let lm_head = if untied { ld.get("lm_head.weight", &[v, h])? } else { embed_tokens.shallow_clone() };
        let centred = cfg.centred_norms();
        // The count may come from a hostile file: reserve no more than the weights could fill.
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers.min(ld.w.tensors.len()));
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let mixer = match cfg.mixer(i) {
                Mixer::Attention => TokenMixer::Attention(Attention::load(cfg, &mut ld, &p)?),
                Mixer::Linear => TokenMixer::Linear(GatedDeltaNet::load(cfg, &mut ld, &format!("{p}.linear_attn"))?),
            };
            let ffn = if cfg.is_sparse_layer(i) {
                Ffn::Sparse(SparseMoe::load(cfg, &mut ld, &format!("{p}.mlp"))?)
            } else {
                Ffn::Dense(Mlp::load(&mut ld, &format!("{p}.mlp"), h, cfg.intermediate_size as i64)?)
            };
            layers.push(Layer {
                mixer,
                ffn,
                input_layernorm: ld.norm(&format!("{p}.input_layernorm.weight"), h, centred)?,
                post_attention_layernorm: ld.norm(&format!("{p}.post_attention_layernorm.weight"), h, centred)?,
            });
        }
        let norm = ld.norm("model.norm.weight", h, centred)?;
        Ok(Self { cfg: cfg.clone(), rope: Rope::new(cfg)?, embed_tokens, lm_head, norm, layers })
    }

    pub fn device(&self) -> Device {
        self.embed_tokens.device()
    }

    pub fn kind(&self) -> Kind {
        self.embed_tokens.kind()
    }

    /// An empty cache with a slot per layer; `rollback` keeps what [`truncate`](Self::truncate)
    /// needs to cut into the last extension (the speculative-decoding session).
    pub fn new_cache(&self, rollback: bool) -> Cache {
        Cache::new(&self.cfg.mixers(), rollback)
    }

    /// Run the decoder.
    /// - `ids` [B, L] int64, `positions` [B, L] int64 (RoPE positions);
    /// - `mask` [B, 1, L, T] bool over all keys (cache + new), true = visible; None = causal;
    /// - `valid` [B, L] bool: false on left padding, whose rows the Gated DeltaNet layers zero
    ///   (so a padded row's recurrence starts at its first token); None = all valid;
    /// - `cache` extended in place when given;
    /// - `upto`: run only layers `0..upto` (the features needed), skipping the rest;
    /// - returns the output of each layer run ([B, L, H] each) and, if all layers ran, the
    ///   final-normed hidden states.
    pub fn run(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        mask: Option<&Tensor>,
        valid: Option<&Tensor>,
        mut cache: Option<&mut Cache>,
        upto: usize,
    ) -> (Vec<Tensor>, Option<Tensor>) {
        let eps = self.cfg.rms_norm_eps;
        let (cos, sin) = rope_cos_sin(positions, &self.rope, self.kind());
        let mut x = Tensor::embedding(&self.embed_tokens, ids, -1, false, false);
        let mut outs = Vec::with_capacity(upto);
        let rollback = cache.as_ref().is_some_and(|c| c.rollback);
        for (i, layer) in self.layers.iter().take(upto).enumerate() {
            let slot = cache.as_deref_mut().map(|c| &mut c.slots[i]);
            let h = rms_norm(&x, &layer.input_layernorm, eps);
            let mixed = match (&layer.mixer, slot) {
                (TokenMixer::Attention(a), slot) => {
                    let _r = crate::range("attention");
                    let kv = slot.map(|s| match s {
                        Slot::Kv(kv) => kv,
                        Slot::Linear(_) => unreachable!("a cache slot follows its layer's kind"),
                    });
                    a.forward(&h, &cos, &sin, mask, kv, eps)
                }
                (TokenMixer::Linear(g), slot) => {
                    let _r = crate::range("gdn");
                    let state = slot.map(|s| match s {
                        Slot::Linear(st) => st,
                        Slot::Kv(_) => unreachable!("a cache slot follows its layer's kind"),
                    });
                    g.forward(&h, valid, state, rollback)
                }
            };
            x = x + mixed;
            let h = rms_norm(&x, &layer.post_attention_layernorm, eps);
            let ffn = match &layer.ffn {
                Ffn::Dense(m) => {
                    let _r = crate::range("mlp");
                    m.forward(&h)
                }
                Ffn::Sparse(m) => {
                    let _r = crate::range("moe");
                    m.forward(&h)
                }
            };
            x = x + ffn;
            outs.push(x.shallow_clone());
        }
        if let Some(c) = cache {
            c.extended(ids.size()[1]);
        }
        let normed = (upto >= self.layers.len()).then(|| rms_norm(&x, &self.norm, eps));
        (outs, normed)
    }

    pub fn logits(&self, normed: &Tensor) -> Tensor {
        let _r = crate::range("lm head");
        normed.matmul(&self.lm_head.tr())
    }

    /// Keep the first `len` cached positions: attention caches are cut; a Gated DeltaNet state,
    /// which cannot be cut, is recomputed from the state before the last extension over the
    /// positions kept (so `len` must not be before that extension, unless it is 0).
    pub fn truncate(&self, cache: &mut Cache, len: i64) -> Result<(), String> {
        if len > cache.len() {
            return Err(format!("cache_truncate({len}) beyond the cache ({})", cache.len()));
        }
        if len == cache.len() {
            return Ok(());
        }
        if len == 0 {
            *cache = self.new_cache(cache.rollback);
            return Ok(());
        }
        let has_linear = self.layers.iter().any(|l| matches!(l.mixer, TokenMixer::Linear(_)));
        let start = cache.last_extension_start();
        if has_linear && !(cache.rollback && len >= start) {
            return Err(format!(
                "cache_truncate({len}): a Gated DeltaNet state rolls back only within the last extension \
                 (positions {start}..{}), or to 0",
                cache.len()
            ));
        }
        for (layer, slot) in self.layers.iter().zip(cache.slots.iter_mut()) {
            match (&layer.mixer, slot) {
                (_, Slot::Kv(kv)) => {
                    if let Some((k, v)) = kv.as_mut() {
                        *k = k.narrow(2, 0, len);
                        *v = v.narrow(2, 0, len);
                    }
                }
                (TokenMixer::Linear(g), Slot::Linear(Some(state))) => g.rewind(state, len - start),
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
        (cfg, Weights { tensors: t, source: "tiny".into() })
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
                let (_, normed) = model.run(&x, &pos, None, None, None, 3);
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

    /// Partial rotary leaves the tail of each head alone and rotates the rest as full RoPE would.
    #[test]
    fn partial_rope_rotates_only_the_first_dims() {
        let x = Tensor::randn([1, 2, 5, 16], (Kind::Float, Device::Cpu));
        let pos = Tensor::arange(5, (Kind::Int64, Device::Cpu)).unsqueeze(0);
        let (cos, sin) = rope_cos_sin(&pos, &Rope::plain(4, 10000.0), Kind::Float);
        let y = apply_rope(&x, &cos, &sin);
        assert!(y.narrow(3, 4, 12).equal(&x.narrow(3, 4, 12)));
        let full = apply_rope(&x.narrow(3, 0, 4), &cos, &sin);
        assert!(y.narrow(3, 0, 4).allclose(&full, 1e-6, 1e-6, false));
        assert!(!full.allclose(&x.narrow(3, 0, 4), 1e-3, 1e-3, false), "positions 1.. rotate");
    }

    /// Llama 3's scaling as a GGUF stores it (llama.cpp's converter: each frequency's divisor in
    /// `rope_freqs.weight`) rotates as the `llama3` rope type does.
    #[test]
    fn gguf_frequency_factors_are_llama3() {
        let (factor, low, high, old) = (8.0, 1.0, 4.0, 64.0);
        let llama3 = RopeScaling::Llama3 {
            factor,
            low_freq_factor: low,
            high_freq_factor: high,
            original_max_position_embeddings: old,
        };
        let (base, _) = RopeScaling::Default.inv_freq(16, 500000.0);
        let factors: Vec<f64> = base
            .iter()
            .map(|f| {
                let wavelen = 2.0 * std::f64::consts::PI / f;
                if wavelen < old / high {
                    1.0
                } else if wavelen > old / low {
                    factor
                } else {
                    let smooth = (old / wavelen - low) / (high - low);
                    1.0 / ((1.0 - smooth) / factor + smooth)
                }
            })
            .collect();
        assert!(factors.iter().any(|&f| f > 1.0 && f < factor), "a factor on the ramp");
        let pos = Tensor::arange(200, (Kind::Int64, Device::Cpu)).unsqueeze(0);
        let with = |scaling, freq_factors| Rope {
            rotary_dim: 16,
            theta: 500000.0,
            scaling,
            max_position_embeddings: 0,
            freq_factors,
        };
        let (c1, s1) = rope_cos_sin(&pos, &with(llama3, None), Kind::Float);
        let (c2, s2) = rope_cos_sin(&pos, &with(RopeScaling::Default, Some(factors)), Kind::Float);
        assert!(c1.allclose(&c2, 1e-5, 1e-5, false) && s1.allclose(&s2, 1e-5, 1e-5, false));
        let (c0, _) = rope_cos_sin(&pos, &Rope::plain(16, 500000.0), Kind::Float);
        assert!(!c0.allclose(&c1, 1e-2, 1e-2, false));
    }
}
