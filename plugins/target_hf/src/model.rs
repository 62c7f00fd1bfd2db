//! Llama / Qwen2 / Qwen3 decoders in plain tch (candle's llama.rs / qwen3.rs order). Weights are
//! looked up by their HF names (`model.layers.{i}.self_attn.q_proj.weight`), whatever file they
//! came from.

use crate::config::DecoderConfig;
use plugin_api::tch::{Device, Kind, Tensor};
use std::collections::HashMap;

/// Named weights with checked look-ups: a missing tensor or a wrong shape names the tensor.
pub struct Weights {
    pub tensors: HashMap<String, Tensor>,
    pub source: String,
}

impl Weights {
    pub fn get(&self, name: &str, shape: &[i64]) -> Result<Tensor, String> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| format!("{}: missing tensor `{name}`", self.source))?;
        if t.size() != shape {
            return Err(format!("{}: tensor `{name}` has shape {:?}, expected {:?}", self.source, t.size(), shape));
        }
        Ok(t.shallow_clone())
    }

    fn opt(&self, name: &str, shape: &[i64]) -> Result<Option<Tensor>, String> {
        if self.tensors.contains_key(name) {
            self.get(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }
}

/// HF's RMSNorm (fp32 statistics); libtorch's `rms_norm` is one fused kernel on CUDA.
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    x.rms_norm(w.size(), Some(w), eps)
}

/// Rotary tables for positions [B, L] -> (cos, signed sin) [B, 1, L, D]; the sine's first half
/// is negated so that [`apply_rope`] needs no negation pass.
pub fn rope_cos_sin(positions: &Tensor, head_dim: usize, theta: f64, kind: Kind) -> (Tensor, Tensor) {
    let d = head_dim as i64;
    let inv_freq =
        (Tensor::arange_start_step(0, d, 2, (Kind::Float, positions.device())) / d as f64 * -theta.ln()).exp();
    let freqs = positions.to_kind(Kind::Float).unsqueeze(-1) * inv_freq;
    let cos = Tensor::cat(&[&freqs, &freqs], -1).cos().unsqueeze(1);
    let sin = freqs.sin();
    let signed_sin = Tensor::cat(&[&(-&sin), &sin], -1).unsqueeze(1);
    (cos.to_kind(kind), signed_sin.to_kind(kind))
}

/// x * cos + rotate_half(x) * sin with rotate_half([a, b]) = [-b, a], as x * cos + [b, a] *
/// signed_sin: three passes (swap, scale, fused multiply-add) where the textbook form takes five.
fn apply_rope(x: &Tensor, cos: &Tensor, signed_sin: &Tensor) -> Tensor {
    let half = x.size()[3] / 2;
    let swapped = Tensor::cat(&[x.narrow(3, half, half), x.narrow(3, 0, half)], 3);
    (x * cos).addcmul(&swapped, signed_sin)
}

struct Attention {
    q_proj: (Tensor, Option<Tensor>),
    k_proj: (Tensor, Option<Tensor>),
    v_proj: (Tensor, Option<Tensor>),
    o_proj: Tensor,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    num_heads: i64,
    num_kv_heads: i64,
    head_dim: i64,
}

struct Layer {
    attn: Attention,
    gate_proj: Tensor,
    up_proj: Tensor,
    down_proj: Tensor,
    input_layernorm: Tensor,
    post_attention_layernorm: Tensor,
}

/// Per-layer key/value cache for incremental decoding: [B, n_kv, T, D] each.
#[derive(Default)]
pub struct KvCache {
    pub layers: Vec<Option<(Tensor, Tensor)>>,
}

impl KvCache {
    pub fn new(num_layers: usize) -> Self {
        Self { layers: (0..num_layers).map(|_| None).collect() }
    }

    pub fn len(&self) -> i64 {
        self.layers.first().and_then(|l| l.as_ref()).map_or(0, |(k, _)| k.size()[2])
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keep the first `len` positions.
    pub fn truncate(&mut self, len: i64) {
        for (k, v) in self.layers.iter_mut().flatten() {
            *k = k.narrow(2, 0, len.min(k.size()[2]));
            *v = v.narrow(2, 0, len.min(v.size()[2]));
        }
    }
}

pub struct Decoder {
    pub cfg: DecoderConfig,
    pub embed_tokens: Tensor,
    pub lm_head: Tensor,
    norm: Tensor,
    layers: Vec<Layer>,
}

impl Decoder {
    /// Build from HF-named weights, converted to `kind` on `device`.
    pub fn new(cfg: &DecoderConfig, w: &Weights, device: Device, kind: Kind) -> Result<Self, String> {
        cfg.validate()?;
        let (h, f, v) = (cfg.hidden_size as i64, cfg.intermediate_size as i64, cfg.vocab_size as i64);
        let (nh, nkv, d) = (cfg.num_attention_heads as i64, cfg.num_kv_heads() as i64, cfg.head_dim() as i64);
        let to = |t: Tensor| t.to_device(device).to_kind(kind);
        let get = |name: &str, shape: &[i64]| w.get(name, shape).map(to);
        let linear = |name: &str, out: i64, inp: i64, bias: bool| -> Result<(Tensor, Option<Tensor>), String> {
            let weight = get(&format!("{name}.weight"), &[out, inp])?;
            let b = if bias { Some(get(&format!("{name}.bias"), &[out])?) } else { None };
            Ok((weight, b))
        };
        let embed_tokens = get("model.embed_tokens.weight", &[v, h])?;
        let lm_head = match w.opt("lm_head.weight", &[v, h])? {
            Some(t) => to(t),
            None if cfg.tie_word_embeddings || !w.tensors.contains_key("lm_head.weight") => embed_tokens.shallow_clone(),
            None => unreachable!(),
        };
        // The count may come from a hostile file: reserve no more than the weights could fill.
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers.min(w.tensors.len()));
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let bias = cfg.qkv_bias();
            let (q_norm, k_norm) = if cfg.qk_norm() {
                (
                    Some(get(&format!("{p}.self_attn.q_norm.weight"), &[d])?),
                    Some(get(&format!("{p}.self_attn.k_norm.weight"), &[d])?),
                )
            } else {
                (None, None)
            };
            layers.push(Layer {
                attn: Attention {
                    q_proj: linear(&format!("{p}.self_attn.q_proj"), nh * d, h, bias)?,
                    k_proj: linear(&format!("{p}.self_attn.k_proj"), nkv * d, h, bias)?,
                    v_proj: linear(&format!("{p}.self_attn.v_proj"), nkv * d, h, bias)?,
                    o_proj: get(&format!("{p}.self_attn.o_proj.weight"), &[h, nh * d])?,
                    q_norm,
                    k_norm,
                    num_heads: nh,
                    num_kv_heads: nkv,
                    head_dim: d,
                },
                gate_proj: get(&format!("{p}.mlp.gate_proj.weight"), &[f, h])?,
                up_proj: get(&format!("{p}.mlp.up_proj.weight"), &[f, h])?,
                down_proj: get(&format!("{p}.mlp.down_proj.weight"), &[h, f])?,
                input_layernorm: get(&format!("{p}.input_layernorm.weight"), &[h])?,
                post_attention_layernorm: get(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
            });
        }
        let norm = get("model.norm.weight", &[h])?;
        Ok(Self { cfg: cfg.clone(), embed_tokens, lm_head, norm, layers })
    }

    pub fn device(&self) -> Device {
        self.embed_tokens.device()
    }

    pub fn kind(&self) -> Kind {
        self.embed_tokens.kind()
    }

    /// Run the decoder.
    /// - `ids` [B, L] int64, `positions` [B, L] int64 (RoPE positions);
    /// - `mask` [B, 1, L, T] bool over all keys (cache + new), true = visible; None = causal;
    /// - `cache` extended in place when given;
    /// - `upto`: run only layers `0..upto` (the features needed), skipping the rest;
    /// - returns the output of each layer run ([B, L, H] each) and, if all layers ran, the
    ///   final-normed hidden states.
    pub fn run(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        mask: Option<&Tensor>,
        mut cache: Option<&mut KvCache>,
        upto: usize,
    ) -> (Vec<Tensor>, Option<Tensor>) {
        let (cos, sin) = rope_cos_sin(positions, self.cfg.head_dim(), self.cfg.rope_theta, self.kind());
        let mut x = self.embed_tokens.embedding_for(ids);
        let mut outs = Vec::with_capacity(upto);
        for (i, layer) in self.layers.iter().take(upto).enumerate() {
            let slot = cache.as_deref_mut().map(|c| &mut c.layers[i]);
            x = layer.forward(&x, &cos, &sin, mask, slot, self.cfg.rms_norm_eps);
            outs.push(x.shallow_clone());
        }
        let normed = (upto >= self.layers.len()).then(|| rms_norm(&x, &self.norm, self.cfg.rms_norm_eps));
        (outs, normed)
    }

    pub fn logits(&self, normed: &Tensor) -> Tensor {
        normed.matmul(&self.lm_head.tr())
    }
}

trait EmbeddingFor {
    fn embedding_for(&self, ids: &Tensor) -> Tensor;
}

impl EmbeddingFor for Tensor {
    fn embedding_for(&self, ids: &Tensor) -> Tensor {
        Tensor::embedding(self, ids, -1, false, false)
    }
}

impl Layer {
    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
        cache: Option<&mut Option<(Tensor, Tensor)>>,
        eps: f64,
    ) -> Tensor {
        let h = rms_norm(x, &self.input_layernorm, eps);
        let x = x + self.attn.forward(&h, cos, sin, mask, cache, eps);
        let h = rms_norm(&x, &self.post_attention_layernorm, eps);
        let mlp = (h.linear::<&Tensor>(&self.gate_proj, None).silu() * h.linear::<&Tensor>(&self.up_proj, None))
            .linear::<&Tensor>(&self.down_proj, None);
        x + mlp
    }
}

impl Attention {
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
        let proj = |w: &(Tensor, Option<Tensor>), heads: i64| {
            x.linear(&w.0, w.1.as_ref()).view([b, l, heads, self.head_dim])
        };
        // 1. Project, (Qwen3) normalise per head, (B, L, H, D) -> (B, H, L, D).
        let mut q = proj(&self.q_proj, self.num_heads);
        let mut k = proj(&self.k_proj, self.num_kv_heads);
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            q = rms_norm(&q, qn, eps);
            k = rms_norm(&k, kn, eps);
        }
        let q = apply_rope(&q.transpose(1, 2), cos, sin);
        let mut k = apply_rope(&k.transpose(1, 2), cos, sin);
        let mut v = proj(&self.v_proj, self.num_kv_heads).transpose(1, 2);
        // 2. Append to the cache.
        if let Some(slot) = cache {
            if let Some((pk, pv)) = slot.as_ref() {
                k = Tensor::cat(&[pk, &k], 2);
                v = Tensor::cat(&[pv, &v], 2);
            }
            *slot = Some((k.shallow_clone(), v.shallow_clone()));
        }
        // 3. Attention (GQA by head groups), (B, H, L, D) -> (B, L, H*D) -> o_proj.
        let o = Tensor::scaled_dot_product_attention(
            &q,
            &k,
            &v,
            mask,
            0.0,
            mask.is_none() && l > 1,
            None::<f64>,
            true,
        );
        o.transpose(1, 2).reshape([b, l, self.num_heads * self.head_dim]).linear::<&Tensor>(&self.o_proj, None)
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
            attention_bias: None,
            bos_token_id: None,
            eos_token_id: None,
            pad_token_id: None,
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
            let model = Decoder::new(&cfg, &w, Device::Cpu, Kind::Float).unwrap();
            // KV-cache greedy decoding equals recomputing the whole sequence each step.
            let prompt: Vec<u32> = vec![3, 17, 8, 42, 5];
            let cached = generate::greedy(&model, std::slice::from_ref(&prompt), 6, &[], 1).remove(0);
            let mut ids = prompt.clone();
            for _ in 0..6 {
                let x = Tensor::from_slice(&ids.iter().map(|&i| i as i64).collect::<Vec<_>>()).unsqueeze(0);
                let pos = Tensor::arange(ids.len() as i64, (Kind::Int64, Device::Cpu)).unsqueeze(0);
                let (_, normed) = model.run(&x, &pos, None, None, 3);
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
        let err = Decoder::new(&cfg, &w, Device::Cpu, Kind::Float).err().unwrap();
        assert!(err.contains("missing tensor `model.layers.1.self_attn.k_norm.weight`"), "{err}");
        let (cfg, mut w) = tiny("qwen2");
        w.tensors.insert("model.layers.0.mlp.up_proj.weight".into(), Tensor::zeros([47, 32], (Kind::Float, Device::Cpu)));
        let err = Decoder::new(&cfg, &w, Device::Cpu, Kind::Float).err().unwrap();
        assert!(err.contains("`model.layers.0.mlp.up_proj.weight` has shape [47, 32], expected [48, 32]"), "{err}");
    }
}
