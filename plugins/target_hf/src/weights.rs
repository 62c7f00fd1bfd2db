//! Named weights, wherever they are (in memory, or still in a safetensors or GGUF file), and the
//! [`Loader`] the layers take them through: converted to the model's device and dtype, only the
//! part a tensor-parallel rank keeps, or drawn at random (`random_init`).

use crate::{
    gguf::GgufFile,
    linear::{Compute, Linear},
    quant::{Read, Stored},
    tp::Shard,
};
use input_files::tensors::{selected_shape, Selection};
use plugin_api::tch::{Device, Kind, Tensor};
use std::{collections::HashMap, ops::Range, sync::Arc};

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
    /// A safetensors tensor, or a quantised weight's tensors (`quant.rs`): their bytes copied
    /// out of the map.
    Safetensors(Stored),
    /// A GGUF tensor: dequantised to f32, row by row.
    Gguf(GgufWeight),
}

impl Mapped {
    /// The weight's shape (a quantised one's, dequantised).
    pub fn shape(&self) -> Vec<i64> {
        match self {
            Self::Safetensors(t) => t.shape(),
            Self::Gguf(t) => t.shape.clone(),
        }
    }

    pub fn read(&self) -> Result<Tensor, String> {
        self.read_selected(&[])
    }

    /// The part `sel` keeps (its ranges within the shape); only that part is materialised (a
    /// quantised weight dequantised, in f32).
    pub fn read_selected(&self, sel: &Selection) -> Result<Tensor, String> {
        Ok(self.read_stored(sel)?.dequantise(Device::Cpu))
    }

    /// The part `sel` keeps as stored: a quantised weight still quantised.
    pub fn read_stored(&self, sel: &Selection) -> Result<Read, String> {
        match self {
            Self::Safetensors(t) => t.read_selected(sel),
            Self::Gguf(t) => t.read_selected(sel).map(Read::Plain),
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
        Ok(self.take_stored(name, shape, sel)?.dequantise(Device::Cpu))
    }

    /// [`take_selected`](Self::take_selected) as stored: a quantised weight's values and the
    /// scales of their blocks, for the layer being built to dequantise (or compute with).
    pub fn take_stored(&mut self, name: &str, shape: &[i64], sel: &Selection) -> Result<Read, String> {
        let stored = self.shape(name).ok_or_else(|| format!("{}: missing tensor `{name}`", self.source))?;
        if stored != shape {
            return Err(format!("{}: tensor `{name}` has shape {stored:?}, expected {shape:?}", self.source));
        }
        if let Some(lazy) = self.mapped.remove(name) {
            return lazy.read_stored(sel);
        }
        let t = self.tensors.remove(name).expect("present: its shape was read");
        Ok(Read::Plain(if sel.iter().all(|r| r.is_empty()) { t } else { crate::tp::select(&t, sel) }))
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
        self.tensors.get(name).map(Tensor::size).or_else(|| self.mapped.get(name).map(Mapped::shape))
    }

    pub fn len(&self) -> usize {
        self.tensors.len() + self.mapped.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Weights converted to the model's device and dtype as they are taken. With `random`, a tensor
/// the weights lack is drawn instead ([`draw`]), and also kept in `drawn` when that is Some.
/// `shard`: the part of the model this rank holds (tensor and expert parallelism).
pub(crate) struct Loader<'a> {
    pub w: &'a mut Weights,
    pub device: Device,
    pub kind: Kind,
    pub random: bool,
    pub drawn: Option<HashMap<String, Tensor>>,
    pub shard: Shard,
    pub held: WeightBytes,
    /// The precision of the dense projections ([`linear`](Self::linear)).
    pub compute: Compute,
    /// Projections quantised to FP8 at load (not as stored), with `compute = "fp8"`.
    pub quantised_at_load: usize,
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
        Self {
            w,
            device,
            kind,
            random: false,
            drawn: None,
            shard: Shard::WHOLE,
            held: WeightBytes::default(),
            compute: Compute::Bf16,
            quantised_at_load: 0,
        }
    }

    fn take_or(
        &mut self,
        name: &str,
        shape: &[i64],
        sel: &Selection,
        draw: impl FnOnce(&[i64]) -> Tensor,
    ) -> Result<Tensor, String> {
        // A quantised weight is dequantised here, on the model's device.
        Ok(self.take_read(name, shape, sel, draw)?.dequantise(self.device))
    }

    /// `name` as stored (counted as such), or drawn.
    fn take_read(
        &mut self,
        name: &str,
        shape: &[i64],
        sel: &Selection,
        draw: impl FnOnce(&[i64]) -> Tensor,
    ) -> Result<Read, String> {
        let stored = !self.random || self.w.contains(name);
        let (read, bytes) = if stored {
            let read = self.w.take_stored(name, shape, sel)?;
            let bytes = read.bytes();
            (read, bytes)
        } else {
            let t = draw(&selected_shape(shape, sel));
            let bytes = t.numel() * t.kind().elt_size_in_bytes();
            if let Some(d) = self.drawn.as_mut() {
                d.insert(name.to_string(), t.shallow_clone());
            }
            (Read::Plain(t), bytes)
        };
        if sel.iter().all(|r| r.is_empty()) {
            self.held.whole += bytes;
        } else {
            self.held.part += bytes;
        }
        Ok(read)
    }

    fn take(&mut self, name: &str, shape: &[i64], sel: &Selection) -> Result<Tensor, String> {
        let (device, kind) = (self.device, self.kind);
        self.take_or(name, shape, sel, |s| draw(name, s, device, kind))
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

    /// A projection of `compute`'s precision (`linear.rs`): the weight [sum out_i, in] of several
    /// [out_i, in] parts stacked (one GEMM where the checkpoint has several: q|k|v, a GDN
    /// layer's four input projections), the rows each selection keeps of each part, and the bias [sum out_i] `bias` reads after the
    /// weight (the order random weights are drawn in).
    pub fn linear(
        &mut self,
        parts: &[(String, i64, Vec<Range<i64>>)],
        inp: i64,
        bias: impl FnOnce(&mut Self) -> Result<Option<Tensor>, String>,
    ) -> Result<Linear, String> {
        let (device, kind) = (self.device, self.kind);
        let reads = parts
            .iter()
            .map(|(n, out, rows)| {
                self.take_read(n, &[*out, inp], std::slice::from_ref(rows), |s| draw(n, s, device, kind))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let bias = bias(self)?;
        let (l, quantised) = crate::linear::build(reads, bias, self.compute, device, kind)?;
        self.quantised_at_load += quantised as usize;
        Ok(l)
    }

    /// One projection `name` [`shape`], the part `sel` keeps (rows and columns), of `compute`'s
    /// precision.
    pub fn linear_selected(
        &mut self,
        name: &str,
        shape: &[i64],
        sel: &Selection,
        bias: impl FnOnce(&mut Self) -> Result<Option<Tensor>, String>,
    ) -> Result<Linear, String> {
        let (device, kind) = (self.device, self.kind);
        let read = self.take_read(name, shape, sel, |s| draw(name, s, device, kind))?;
        let bias = bias(self)?;
        let (l, quantised) = crate::linear::build(vec![read], bias, self.compute, device, kind)?;
        self.quantised_at_load += quantised as usize;
        Ok(l)
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

/// llama.cpp's converter permutes llama's Q/K rows per head (for its interleaved RoPE): HF's
/// (heads, 2, rows/heads/2) order became (heads, rows/heads/2, 2) (ASSETS.md). The file's row
/// that HF's row `r` is in, heads of `head_rows` rows (even).
fn permuted_row(r: usize, head_rows: usize) -> usize {
    let (head, within, half) = (r / head_rows, r % head_rows, head_rows / 2);
    head * head_rows + 2 * (within % half) + within / half
}

/// A GGUF tensor under its HF name, dequantised only when taken and only the rows and columns a
/// tensor-parallel rank keeps: a rank never holds more than its part (and one row of the file).
pub struct GgufWeight {
    pub(crate) file: Arc<GgufFile>,
    /// Its name in the file.
    pub(crate) name: String,
    /// Torch order.
    pub shape: Vec<i64>,
    /// llama's Q/K: the heads whose rows llama.cpp permuted, read back in HF's order.
    pub(crate) permuted_heads: Option<usize>,
}

impl GgufWeight {
    pub fn read_selected(&self, sel: &Selection) -> Result<Tensor, String> {
        let head_rows = self.permuted_heads.map(|h| self.shape[0] as usize / h);
        let source = |r: usize| head_rows.map_or(r, |n| permuted_row(r, n));
        let (shape, values) = self.file.dequantize_selected(&self.name, sel, &source).map_err(|e| e.to_string())?;
        let shape: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        Ok(Tensor::from_slice(&values).reshape(&shape))
    }
}

/// One random tensor for the weight `name` of `shape`, by what the name says it is: matrices ~
/// N(0, 0.02) (HF's initializer_range); biases, attention sinks and routers' correction biases
/// 0; plain norm gains 1 (a centred norm's, which the loader asks for itself, 0); a conv
/// (Gated DeltaNet's, LFM2's) ~ U(-1/sqrt(K), 1/sqrt(K)) (torch's Conv1d); A = exp(A_log) ~
/// U(0, 16) and dt_bias 1 (transformers' init for Gated DeltaNet).
pub fn draw(name: &str, shape: &[i64], device: Device, kind: Kind) -> Tensor {
    let last = shape.last().copied().unwrap_or(1);
    if name.ends_with("A_log") {
        return (Tensor::rand(shape, (Kind::Float, device)) * 16.0).clamp_min(1e-4).log();
    }
    if name.ends_with("dt_bias") || name.ends_with("norm.weight") {
        return Tensor::ones(shape, (kind, device));
    }
    if name.ends_with("bias") || name.ends_with("sinks") {
        return Tensor::zeros(shape, (kind, device));
    }
    if name.ends_with("conv1d.weight") || name.ends_with("conv.conv.weight") {
        let bound = (last as f64).powf(-0.5);
        return Tensor::rand(shape, (kind, device)) * (2.0 * bound) - bound;
    }
    Tensor::randn(shape, (kind, device)) * 0.02
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permuted_rows_undo_llama_cpp_permute() {
        // llama.cpp: w.reshape(heads, 2, rows/heads/2, cols).swapaxes(1, 2).reshape(rows, cols)
        let (heads, rows, cols) = (3i64, 12i64, 5i64);
        let w = Tensor::arange(rows * cols, (plugin_api::tch::Kind::Float, plugin_api::tch::Device::Cpu))
            .reshape([rows, cols]);
        let permuted = w.reshape([heads, 2, rows / heads / 2, cols]).transpose(1, 2).reshape([rows, cols]);
        let source: Vec<i64> = (0..rows as usize).map(|r| permuted_row(r, (rows / heads) as usize) as i64).collect();
        assert!(permuted.index_select(0, &Tensor::from_slice(&source)).equal(&w));
    }
}
