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
    attention::{causal_mask, Attention},
    cache::{self, Cache, Slot},
    config::{Activation, Arch, DecoderConfig, LayerKind, Mixer},
    longcat,
    mla::Mla,
    moe::SparseMoe,
    qwen3_5::GatedDeltaNet,
    short_conv::{self, ShortConv},
    tp::{Shard, TpGroup},
};
use input_files::tensors::{selected_shape, LazyTensor, Selection};
use plugin_api::tch::{Device, Kind, Tensor};
use rope_scaling::RopeScaling;
use std::{collections::HashMap, ops::Range};

/// Named weights with checked look-ups: a missing tensor or a wrong shape names the tensor.
/// `tensors` are in memory (tests', random draws); `mapped` are read from their file only when
/// taken, whole or only the part a tensor-parallel rank holds.
pub struct Weights {
    pub tensors: HashMap<String, Tensor>,
    pub mapped: HashMap<String, Mapped>,
    pub source: String,
}

/// A weight still in its file, read when taken: whole, or only the part a rank keeps.
pub enum Mapped {
    /// A safetensors tensor: its bytes copied out of the map.
    Safetensors(LazyTensor),
    /// A GGUF tensor: dequantised to f32, row by row.
    Gguf(crate::load::GgufWeight),
}

impl Mapped {
    pub fn shape(&self) -> &[i64] {
        match self {
            Self::Safetensors(t) => &t.shape,
            Self::Gguf(t) => &t.shape,
        }
    }

    pub fn read(&self) -> Result<Tensor, String> {
        self.read_selected(&[])
    }

    /// The part `sel` keeps (its ranges within the shape); only that part is materialised.
    pub fn read_selected(&self, sel: &Selection) -> Result<Tensor, String> {
        match self {
            Self::Safetensors(t) => t.read_selected(sel).map_err(|e| e.to_string()),
            Self::Gguf(t) => t.read_selected(sel),
        }
    }
}

impl Weights {
    pub fn in_memory(tensors: HashMap<String, Tensor>, source: &str) -> Self {
        Self { tensors, mapped: HashMap::new(), source: source.into() }
    }

    /// Take `name` out, checking its shape.
    pub fn take(&mut self, name: &str, shape: &[i64]) -> Result<Tensor, String> {
        self.take_selected(name, shape, &[])
    }

    /// Take the part `sel` keeps of `name` (whose whole shape must be `shape`) out.
    pub fn take_selected(&mut self, name: &str, shape: &[i64], sel: &Selection) -> Result<Tensor, String> {
        let stored = self.shape(name).ok_or_else(|| format!("{}: missing tensor `{name}`", self.source))?;
        if stored != shape {
            return Err(format!("{}: tensor `{name}` has shape {stored:?}, expected {shape:?}", self.source));
        }
        if let Some(lazy) = self.mapped.remove(name) {
            return lazy.read_selected(sel);
        }
        let t = self.tensors.remove(name).expect("present: its shape was read");
        Ok(if sel.iter().all(|r| r.is_empty()) { t } else { crate::tp::select(&t, sel) })
    }

    pub fn take_opt(&mut self, name: &str, shape: &[i64]) -> Result<Option<Tensor>, String> {
        if self.contains(name) {
            self.take(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name) || self.mapped.contains_key(name)
    }

    /// The stored shape of `name`.
    pub fn shape(&self, name: &str) -> Option<Vec<i64>> {
        self.tensors.get(name).map(Tensor::size).or_else(|| self.mapped.get(name).map(|l| l.shape().to_vec()))
    }

    pub fn len(&self) -> usize {
        self.tensors.len() + self.mapped.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Weights converted to the model's device and dtype as they are taken. With `random`, a tensor
/// the weights lack is drawn instead (`random::draw`), and also kept in `drawn` when that is Some.
/// `shard`: the part of the model this rank holds (tensor and expert parallelism).
pub(crate) struct Loader<'a> {
    pub w: &'a mut Weights,
    pub device: Device,
    pub kind: Kind,
    pub random: bool,
    pub drawn: Option<HashMap<String, Tensor>>,
    pub shard: Shard,
    pub held: WeightBytes,
}

/// Bytes of the weights a model holds (as stored): those read whole (embeddings, norms,
/// routers: replicated on every rank of a replica) and those read in part (a rank's shard).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WeightBytes {
    pub whole: usize,
    pub part: usize,
}

impl WeightBytes {
    pub fn total(&self) -> usize {
        self.whole + self.part
    }
}

impl<'a> Loader<'a> {
    pub fn new(w: &'a mut Weights, device: Device, kind: Kind) -> Self {
        Self { w, device, kind, random: false, drawn: None, shard: Shard::WHOLE, held: WeightBytes::default() }
    }

    fn take_or(
        &mut self,
        name: &str,
        shape: &[i64],
        sel: &Selection,
        draw: impl FnOnce(&[i64]) -> Tensor,
    ) -> Result<Tensor, String> {
        let stored = !self.random || self.w.contains(name);
        let t = if stored { self.w.take_selected(name, shape, sel)? } else { draw(&selected_shape(shape, sel)) };
        let bytes = t.numel() * t.kind().elt_size_in_bytes();
        if sel.iter().all(|r| r.is_empty()) {
            self.held.whole += bytes;
        } else {
            self.held.part += bytes;
        }
        if stored {
            return Ok(t);
        }
        if let Some(d) = self.drawn.as_mut() {
            d.insert(name.to_string(), t.shallow_clone());
        }
        Ok(t)
    }

    fn take(&mut self, name: &str, shape: &[i64], sel: &Selection) -> Result<Tensor, String> {
        let (device, kind) = (self.device, self.kind);
        self.take_or(name, shape, sel, |s| crate::random::draw(name, s, device, kind))
    }

    pub fn get(&mut self, name: &str, shape: &[i64]) -> Result<Tensor, String> {
        self.get_selected(name, shape, &[])
    }

    /// The part `sel` keeps of `name` [`shape`] (this rank's shard).
    pub fn get_selected(&mut self, name: &str, shape: &[i64], sel: &Selection) -> Result<Tensor, String> {
        Ok(self.take(name, shape, sel)?.to_device(self.device).to_kind(self.kind))
    }

    /// A row-parallel projection's bias `name` [n], added once over the replica: the first
    /// rank's (held as its part), None on the others.
    pub fn row_bias(&mut self, name: &str, n: i64) -> Result<Option<Tensor>, String> {
        match self.shard.rank {
            _ if self.shard.is_whole() => self.get(name, &[n]).map(Some),
            0 => {
                let all = 0..n;
                self.get_selected(name, &[n], &[vec![all]]).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// In fp32 whatever the model's dtype (gates, decay rates, norm gains, routers).
    pub fn get_f32(&mut self, name: &str, shape: &[i64]) -> Result<Tensor, String> {
        self.get_f32_selected(name, shape, &[])
    }

    pub fn get_f32_selected(&mut self, name: &str, shape: &[i64], sel: &Selection) -> Result<Tensor, String> {
        Ok(self.take(name, shape, sel)?.to_device(self.device).to_kind(Kind::Float))
    }

    /// Several [out_i, in] matrices stacked into one [sum out_i, in]: one GEMM where the
    /// checkpoint has several (q|k|v, a GDN layer's four input projections); of each, the rows
    /// its selection keeps.
    pub fn fused(&mut self, parts: &[(String, i64, Vec<Range<i64>>)], inp: i64) -> Result<Tensor, String> {
        let ts = parts
            .iter()
            .map(|(n, out, rows)| self.get_selected(n, &[*out, inp], std::slice::from_ref(rows)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(if ts.len() == 1 { ts.into_iter().next().expect("one part") } else { Tensor::cat(&ts, 0) })
    }

    /// An RMSNorm's effective gain: `w`, or `1 + w` for centred norms (Qwen3.5's, Gemma's; in
    /// fp32, then the model's dtype, as transformers computes `(1.0 + weight.float())`).
    pub fn norm(&mut self, name: &str, dim: i64, centred: bool) -> Result<Tensor, String> {
        let device = self.device;
        let gain = move |_: &[i64]| {
            if centred {
                Tensor::zeros([dim], (Kind::Float, device))
            } else {
                Tensor::ones([dim], (Kind::Float, device))
            }
        };
        let w = self.take_or(name, &[dim], &[], gain)?.to_device(self.device).to_kind(Kind::Float);
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
        Self::for_kind(cfg, LayerKind::Full)
    }

    /// The RoPE of the layers of `kind` (Gemma 3's sliding layers have their own).
    pub fn for_kind(cfg: &DecoderConfig, kind: LayerKind) -> Result<Self, String> {
        let (theta, scaling) = cfg.rope_for(kind)?;
        Ok(Self {
            rotary_dim: cfg.rotary_dim(),
            theta,
            scaling,
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
/// through: partial rotary), with rotate_half([a, b]) = [-b, a] as x * cos + [b, a] *
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

/// A gated MLP: down(act(gate(x)) * up(x)), act SiLU (SwiGLU) or Gemma's tanh GELU.
pub struct Mlp {
    gate_proj: Tensor,
    up_proj: Tensor,
    down_proj: Tensor,
    act: Activation,
}

impl Mlp {
    /// HF's `gate_proj` / `up_proj` / `down_proj`, SiLU.
    pub(crate) fn load(ld: &mut Loader, p: &str, hidden: i64, width: i64) -> Result<Self, String> {
        Self::load_named(ld, p, ["gate_proj", "up_proj", "down_proj"], hidden, width, Activation::Silu)
    }

    /// `names`: the gate, up and down projections' (LFM2: `w1`, `w3`, `w2`).
    pub(crate) fn load_named(
        ld: &mut Loader,
        p: &str,
        names: [&str; 3],
        hidden: i64,
        width: i64,
        act: Activation,
    ) -> Result<Self, String> {
        // gate/up column-parallel, down row-parallel (`tp.rs`).
        let part = ld.shard.split(width, "the MLP's intermediate size")?;
        Ok(Self {
            gate_proj: ld.get_selected(&format!("{p}.{}.weight", names[0]), &[width, hidden], &[vec![part.clone()]])?,
            up_proj: ld.get_selected(&format!("{p}.{}.weight", names[1]), &[width, hidden], &[vec![part.clone()]])?,
            down_proj: ld.get_selected(&format!("{p}.{}.weight", names[2]), &[hidden, width], &[vec![], vec![part]])?,
            act,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        let gate = x.linear::<&Tensor>(&self.gate_proj, None);
        let gate = match self.act {
            Activation::Silu => gate.silu(),
            Activation::GeluTanh => gate.gelu("tanh"),
        };
        (gate * x.linear::<&Tensor>(&self.up_proj, None)).linear::<&Tensor>(&self.down_proj, None)
    }
}

pub(crate) enum TokenMixer {
    Attention(Attention),
    Linear(GatedDeltaNet),
    ShortConv(ShortConv),
    Mla(Mla),
}

impl TokenMixer {
    fn kind(&self) -> Mixer {
        match self {
            Self::Attention(_) => Mixer::Attention,
            Self::Linear(_) => Mixer::Linear,
            Self::ShortConv(_) => Mixer::ShortConv,
            Self::Mla(_) => Mixer::Mla,
        }
    }
}

pub(crate) enum Ffn {
    Dense(Mlp),
    Sparse(SparseMoe),
}

impl Ffn {
    fn forward(&self, h: &Tensor) -> Tensor {
        match self {
            Self::Dense(m) => {
                let _r = crate::range("mlp");
                m.forward(h)
            }
            Self::Sparse(m) => {
                let _r = crate::range("moe");
                m.forward(h)
            }
        }
    }
}

/// What every layer of one forward shares: the RoPE tables, the masks by window, padding.
pub(crate) struct Context<'a> {
    eps: f64,
    /// (cos, signed sin) of each of the decoder's RoPEs.
    tables: Vec<(Tensor, Tensor)>,
    /// The mask of full attention (None: causal) and of each window the layers use.
    full: Option<Tensor>,
    windowed: Vec<(i64, Option<Tensor>)>,
    valid: Option<&'a Tensor>,
    rollback: bool,
    /// The replica's group (tensor parallelism): row-parallel outputs are summed over it.
    tp: Option<&'a TpGroup>,
}

impl Context<'_> {
    /// A row-parallel output summed over the replica's ranks (as is without one).
    pub(crate) fn reduce(&self, t: Tensor, what: &str) -> Tensor {
        let Some(g) = self.tp else { return t };
        let t = t.contiguous();
        g.all_reduce(&t, what);
        t
    }

    fn mask(&self, window: Option<i64>) -> Option<&Tensor> {
        match window {
            None => self.full.as_ref(),
            Some(w) => self.windowed.iter().find(|(x, _)| *x == w).and_then(|(_, m)| m.as_ref()),
        }
    }
}

/// The mask of a `window`-wide sliding layer: `full` (None: causal) and keys within the window
/// (transformers': key j visible to query i when j > i - window, in cache positions); `full`
/// again when every key is within it.
fn window_mask(full: Option<&Tensor>, past: i64, l: i64, window: i64, device: Device) -> Option<Tensor> {
    let t = past + l;
    if t <= window {
        return full.map(Tensor::shallow_clone);
    }
    let q = Tensor::arange_start(past, t, (Kind::Int64, device)).unsqueeze(1);
    let k = Tensor::arange(t, (Kind::Int64, device)).unsqueeze(0);
    let band = k.gt_tensor(&(q - window)).view([1, 1, l, t]);
    Some(match full {
        Some(m) => m.logical_and(&band),
        None => causal_mask(l, t, device).logical_and(&band),
    })
}

/// A token mixer and an MLP, each in a residual branch: x + out_norm(mixer(norm(x))) (the
/// output norm Gemma's only), then the same with the MLP.
pub(crate) struct Layer {
    pub(crate) mixer: TokenMixer,
    /// Which of the decoder's RoPEs its attention rotates with.
    rope: usize,
    window: Option<i64>,
    ffn: Ffn,
    mixer_norm: Tensor,
    ffn_norm: Tensor,
    mixer_out_norm: Option<Tensor>,
    ffn_out_norm: Option<Tensor>,
}

/// Where a layer's parts are (LongCat-Flash's sublayers have their own).
pub(crate) struct LayerPaths {
    pub mixer: String,
    pub ffn: String,
    pub norms: [String; 2],
    pub out_norms: Option<[String; 2]>,
}

impl LayerPaths {
    /// Layer `i` of a one-mixer family.
    fn plain(cfg: &DecoderConfig, i: usize) -> Self {
        let p = format!("model.layers.{i}");
        let names = cfg.norm_names();
        let mixer = match cfg.mixer(i) {
            Mixer::Attention | Mixer::Mla => "self_attn",
            Mixer::Linear => "linear_attn",
            Mixer::ShortConv => "conv",
        };
        let ffn = if cfg.arch() == Arch::Lfm2 { "feed_forward" } else { "mlp" };
        Self {
            mixer: format!("{p}.{mixer}"),
            ffn: format!("{p}.{ffn}"),
            norms: [format!("{p}.{}.weight", names.mixer), format!("{p}.{}.weight", names.ffn)],
            out_norms: names
                .mixer_out
                .zip(names.ffn_out)
                .map(|(a, f)| [format!("{p}.{a}.weight"), format!("{p}.{f}.weight")]),
        }
    }
}

impl Layer {
    /// Layer `i`'s parts at `paths`; `ffn`: the MLP (a sparse one, or None for the dense MLP
    /// the config gives).
    pub(crate) fn load(
        cfg: &DecoderConfig,
        ld: &mut Loader,
        i: usize,
        paths: &LayerPaths,
        sparse: bool,
    ) -> Result<Self, String> {
        let h = cfg.hidden_size as i64;
        let mixer = match cfg.mixer(i) {
            Mixer::Attention => TokenMixer::Attention(Attention::load(cfg, ld, &paths.mixer)?),
            Mixer::Mla => TokenMixer::Mla(Mla::load(cfg, ld, &paths.mixer)?),
            Mixer::Linear => TokenMixer::Linear(GatedDeltaNet::load(cfg, ld, &paths.mixer)?),
            Mixer::ShortConv => TokenMixer::ShortConv(ShortConv::load(cfg, ld, &paths.mixer)?),
        };
        let ffn = if sparse {
            Ffn::Sparse(SparseMoe::load(cfg, ld, &paths.ffn)?)
        } else {
            let names =
                if cfg.arch() == Arch::Lfm2 { ["w1", "w3", "w2"] } else { ["gate_proj", "up_proj", "down_proj"] };
            let width = cfg.dense_width().unwrap_or(cfg.intermediate_size) as i64;
            Ffn::Dense(Mlp::load_named(ld, &paths.ffn, names, h, width, cfg.activation())?)
        };
        let centred = cfg.centred_norms();
        let out_norms = match &paths.out_norms {
            Some([a, f]) => Some((ld.norm(a, h, centred)?, ld.norm(f, h, centred)?)),
            None => None,
        };
        let (mixer_out_norm, ffn_out_norm) = out_norms.unzip();
        Ok(Self {
            mixer,
            rope: usize::from(cfg.arch() == Arch::Gemma3 && cfg.layer_kind(i) == LayerKind::Sliding),
            window: cfg.window(i).map(|w| w as i64),
            ffn,
            mixer_norm: ld.norm(&paths.norms[0], h, centred)?,
            ffn_norm: ld.norm(&paths.norms[1], h, centred)?,
            mixer_out_norm,
            ffn_out_norm,
        })
    }

    /// x + the token mixer's branch.
    pub(crate) fn mix(&self, x: &Tensor, ctx: &Context, slot: Option<&mut Slot>) -> Tensor {
        let h = rms_norm(x, &self.mixer_norm, ctx.eps);
        let (cos, sin) = &ctx.tables[self.rope];
        let mask = ctx.mask(self.window);
        let out = match &self.mixer {
            TokenMixer::Attention(a) => {
                let _r = crate::range("attention");
                a.forward(&h, cos, sin, mask, slot.map(cache::kv), ctx.eps)
            }
            TokenMixer::Mla(m) => {
                let _r = crate::range("attention");
                m.forward(&h, cos, sin, mask, slot.map(cache::kv))
            }
            TokenMixer::Linear(g) => {
                let _r = crate::range("gdn");
                let state = slot.map(|s| match s {
                    Slot::Linear(st) => st,
                    _ => unreachable!("a cache slot follows its layer's kind"),
                });
                g.forward(&h, ctx.valid, state, ctx.rollback)
            }
            TokenMixer::ShortConv(c) => {
                let _r = crate::range("conv");
                let state = slot.map(|s| match s {
                    Slot::Conv(st) => st,
                    _ => unreachable!("a cache slot follows its layer's kind"),
                });
                c.forward(&h, ctx.valid, state, ctx.rollback)
            }
        };
        let out = ctx.reduce(out, "a token mixer's output");
        match &self.mixer_out_norm {
            Some(n) => x + rms_norm(&out, n, ctx.eps),
            None => x + out,
        }
    }

    /// The MLP's input (normed).
    pub(crate) fn ffn_input(&self, x: &Tensor, ctx: &Context) -> Tensor {
        rms_norm(x, &self.ffn_norm, ctx.eps)
    }

    /// The MLP's branch for its input `h`.
    pub(crate) fn ffn_output(&self, h: &Tensor, ctx: &Context) -> Tensor {
        let y = ctx.reduce(self.ffn.forward(h), "an MLP's output");
        match &self.ffn_out_norm {
            Some(n) => rms_norm(&y, n, ctx.eps),
            None => y,
        }
    }

    /// x + the MLP's branch.
    fn feed(&self, x: &Tensor, ctx: &Context) -> Tensor {
        x + self.ffn_output(&self.ffn_input(x, ctx), ctx)
    }
}

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
        mut w: Weights,
        device: Device,
        kind: Kind,
        shard: Shard,
        tp: Option<TpGroup>,
    ) -> Result<Self, String> {
        Self::build_shard(cfg, &mut Loader { shard, ..Loader::new(&mut w, device, kind) }, tp)
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
        let mut w = Weights::in_memory(HashMap::new(), "random_init");
        Self::build_shard(cfg, &mut Loader { random: true, shard, ..Loader::new(&mut w, device, kind) }, tp)
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

    /// Run the decoder.
    /// - `ids` [B, L] int64, `positions` [B, L] int64 (RoPE positions);
    /// - `mask` [B, 1, L, T] bool over all keys (cache + new), true = visible; None = causal;
    ///   sliding layers see only their window of it;
    /// - `valid` [B, L] bool: false on left padding, whose rows the recurrent layers (Gated
    ///   DeltaNet, short conv) zero (so a padded row's state starts at its first token); None =
    ///   all valid;
    /// - `cache` extended in place when given;
    /// - `upto`: run only layers `0..upto` (the features needed), skipping the rest;
    /// - returns the output of each layer run ([B, L, H] each) and, if all layers ran, the
    ///   final-normed hidden states. As in transformers' `hidden_states[1..]`, which DFlash's
    ///   `hidden_states[id + 1]` reads, the last layer's output is taken after the final norm
    ///   (the LM head's input).
    pub fn run(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        mask: Option<&Tensor>,
        valid: Option<&Tensor>,
        mut cache: Option<&mut Cache>,
        upto: usize,
    ) -> (Vec<Tensor>, Option<Tensor>) {
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
            tp: self.tp.as_ref(),
        };
        let mut x = Tensor::embedding(&self.embed_tokens, ids, -1, false, false);
        if let Some(scale) = self.embed_scale {
            x = x * Tensor::from(scale).to_kind(self.kind()).to_device(device);
        }
        let mut outs = Vec::with_capacity(upto);
        for (i, block) in self.blocks.iter().take(upto).enumerate() {
            let n = block.layers().len();
            let slots = cache.as_deref_mut().map(|c| &mut c.slots[self.slot_start[i]..self.slot_start[i] + n]);
            x = block.forward(&x, &ctx, slots);
            outs.push(x.shallow_clone());
        }
        if let Some(c) = cache {
            c.extended(l);
        }
        let normed = (upto >= self.blocks.len()).then(|| rms_norm(&x, &self.norm, self.cfg.rms_norm_eps));
        if let (Some(n), Some(last)) = (&normed, outs.last_mut()) {
            *last = n.shallow_clone();
        }
        (outs, normed)
    }

    pub fn logits(&self, normed: &Tensor) -> Tensor {
        let _r = crate::range("lm head");
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
        if len == 0 {
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
