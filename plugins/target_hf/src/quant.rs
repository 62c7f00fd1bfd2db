//! Quantised checkpoints as they are published, by their config.json `quantization_config`:
//! - FP8 block-scaled (`quant_method: fp8`; DeepSeek-V3 / Kimi-K2, Qwen*-FP8, GLM-4.5-FP8,
//!   LongCat-Flash-FP8): `<w>` F8_E4M3 [.., out, in] and `<w>_scale_inv` [.., ceil(out / b0),
//!   ceil(in / b1)], the multiplier back to full precision of each `weight_block_size` block;
//! - compressed-tensors FP8 (`format: float-quantized` or `naive-quantized`, as LLM Compressor
//!   writes them): `<w>` F8_E4M3 and `<w>_scale` per tensor, per output channel or per block;
//! - MXFP4 experts (gpt-oss): `<e>_blocks` U8 [E, rows, cols / 32, 16], 32 E2M1 values a block,
//!   two a byte, low nibble first, and `<e>_scales` U8 [E, rows, cols / 32], E8M0 exponents
//!   (2^(s - 127)); the weight is their [E, cols, rows] (transformers' `convert_moe_packed_tensors`).
//!
//! Anything else is refused by name before a weight is read. Weights the checkpoint leaves in
//! full precision (embeddings, norms, routers, the head, `modules_to_not_convert` / `ignore`)
//! have no scale and load as they are. A quantised weight stays as stored ([`Quantised`]: its
//! values and the scales of the blocks they are in, only the rows and columns a tensor-parallel
//! rank keeps) until its layer is built, which dequantises it (value x the scale of its block, in
//! fp32, on the model's device) for bf16 / f32 compute.

use input_files::tensors::{LazyTensor, Selection};
use plugin_api::tch::{Device, Kind, Tensor};
use serde_json::Value;
use std::ops::Range;

/// What dflash loads, for the error that refuses anything else.
pub const SUPPORTED: &str =
    "dflash loads fp8 (block-scaled), compressed-tensors (float-quantized FP8) and mxfp4 checkpoints";

/// A checkpoint's quantisation, as its `quantization_config` gives it.
#[derive(Debug, Clone, PartialEq)]
pub enum QuantConfig {
    /// `quant_method: fp8`: a `_scale_inv` per block of `block` ([out, in] elements).
    Fp8 { block: [i64; 2] },
    /// compressed-tensors FP8: a `_scale` per tensor, output channel or block.
    CompressedFp8 { strategy: Strategy },
    /// `quant_method: mxfp4`: routed experts as `_blocks` and `_scales`.
    Mxfp4,
}

/// How a compressed-tensors weight is scaled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    Tensor,
    Channel,
    Block([i64; 2]),
}

impl QuantConfig {
    /// `config` (config.json's whole object): None without a `quantization_config`; an error
    /// naming what is not supported.
    pub fn read(config: &Value) -> Result<Option<Self>, String> {
        let Some(q) = config.get("quantization_config").filter(|q| !q.is_null()) else {
            return Ok(None);
        };
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("(none)");
        let refuse = |what: String| Err(format!("{what}; {SUPPORTED}"));
        match method {
            "fp8" => {
                if let Some(fmt) = q.get("fmt").and_then(Value::as_str).filter(|f| *f != "e4m3") {
                    return refuse(format!("quant_method \"fp8\" with fmt \"{fmt}\" is not supported (e4m3 is)"));
                }
                let block = match q.get("weight_block_size") {
                    None => [128, 128], // transformers' default
                    Some(Value::Null) => [0, 0],
                    Some(b) => block_size(b).ok_or_else(|| {
                        format!("`weight_block_size` {b}: expected two positive sizes ([out, in]); {SUPPORTED}")
                    })?,
                };
                Ok(Some(Self::Fp8 { block }))
            }
            "compressed-tensors" => compressed_tensors(q).map(|strategy| Some(Self::CompressedFp8 { strategy })),
            "mxfp4" => Ok(Some(Self::Mxfp4)),
            other => refuse(format!("quant_method \"{other}\" is not supported")),
        }
    }

    /// How the note that reports the loading names it.
    pub fn name(&self) -> String {
        match self {
            Self::Fp8 { block } => format!("FP8, blocks of {}x{}", block[0], block[1]),
            Self::CompressedFp8 { strategy } => format!("compressed-tensors FP8 per {strategy:?}").to_lowercase(),
            Self::Mxfp4 => "MXFP4".into(),
        }
    }

    /// The suffix of a quantised weight's scale (`<weight><suffix>`; MXFP4: `<base>_scales`
    /// beside `<base>_blocks`).
    fn scale_suffix(&self) -> &'static str {
        match self {
            Self::Fp8 { .. } => "_scale_inv",
            Self::CompressedFp8 { .. } => "_scale",
            Self::Mxfp4 => "_scales",
        }
    }

    /// Whether `name` is a weight's scale (not an activation's: compressed-tensors'
    /// `input_scale`, the KV cache's `k_scale`).
    fn is_weight_scale(&self, name: &str) -> bool {
        match self {
            Self::CompressedFp8 { .. } => name.ends_with("weight_scale"),
            _ => name.ends_with(self.scale_suffix()),
        }
    }

    /// Pair each quantised weight of `tensors` (named as in the files) with its scales: the
    /// weight's entry becomes [`Stored`], the scales' goes. Shapes are checked here, so a bad
    /// file is named before anything is read. Returns how many weights are quantised.
    pub fn pair(&self, tensors: &mut std::collections::HashMap<String, Stored>) -> Result<usize, String> {
        let suffix = self.scale_suffix();
        let mut scales: Vec<String> = tensors.keys().filter(|n| self.is_weight_scale(n)).cloned().collect();
        scales.sort();
        let mut paired = 0;
        for scale_name in scales {
            let base = scale_name.strip_suffix(suffix).expect("filtered on it");
            let weight_name = match self {
                Self::Mxfp4 => format!("{base}_blocks"),
                _ => base.to_string(),
            };
            let weight = match tensors.remove(&weight_name) {
                Some(Stored::Plain(t)) => t,
                _ => return Err(format!("`{scale_name}` has no weight `{weight_name}` beside it")),
            };
            let Some(Stored::Plain(scales)) = tensors.remove(&scale_name) else { unreachable!("listed above") };
            let stored = match self {
                Self::Mxfp4 => Mxfp4::new(weight, scales, &weight_name)?.into(),
                Self::Fp8 { block } => Fp8::new(weight, scales, *block, &weight_name, &scale_name)?.into(),
                Self::CompressedFp8 { strategy } => {
                    let block = strategy.block(&weight.shape);
                    Fp8::new(weight, scales, block, &weight_name, &scale_name)?.into()
                }
            };
            tensors.insert(base.to_string(), stored);
            paired += 1;
        }
        // What is left must be full precision: an FP8 tensor without its scale cannot be read.
        let mut names: Vec<&String> = tensors.keys().collect();
        names.sort();
        for name in names {
            if let Stored::Plain(t) = &tensors[name] {
                if t.kind == Kind::Float8e4m3fn {
                    return Err(format!("`{name}` is F8_E4M3 without a `{name}{suffix}` beside it"));
                }
                if name.ends_with("_zero_point") {
                    return Err(format!(
                        "`{name}`: asymmetric quantisation (a zero point) is not supported; {SUPPORTED}"
                    ));
                }
            }
        }
        Ok(paired)
    }
}

impl Strategy {
    /// The block one scale covers in a weight of `shape` (the last two dims).
    fn block(&self, shape: &[i64]) -> [i64; 2] {
        let (out, inp) = match shape {
            [.., o, i] => (*o, *i),
            _ => (1, 1),
        };
        match self {
            Self::Tensor => [out.max(1), inp.max(1)],
            Self::Channel => [1, inp.max(1)],
            Self::Block(b) => *b,
        }
    }
}

fn block_size(v: &Value) -> Option<[i64; 2]> {
    let b = v.as_array()?;
    match b.as_slice() {
        [r, c] => Some([r.as_i64().filter(|&r| r > 0)?, c.as_i64().filter(|&c| c > 0)?]),
        _ => None,
    }
}

/// compressed-tensors: FP8 weights (8-bit floats, symmetric) in every config group, the
/// `float-quantized` or `naive-quantized` format; the activations' scheme (static or dynamic
/// FP8, or none) matters only to FP8 compute.
fn compressed_tensors(q: &Value) -> Result<Strategy, String> {
    let format = q.get("format").and_then(Value::as_str).unwrap_or("dense");
    if !matches!(format, "float-quantized" | "naive-quantized") {
        return Err(format!(
            "quant_method \"compressed-tensors\" with format \"{format}\" is not supported (float-quantized and \
             naive-quantized FP8 are); {SUPPORTED}"
        ));
    }
    let groups = q.get("config_groups").and_then(Value::as_object).filter(|g| !g.is_empty());
    let groups = groups.ok_or_else(|| format!("compressed-tensors without `config_groups`; {SUPPORTED}"))?;
    let mut strategy = None;
    let mut names: Vec<&String> = groups.keys().collect();
    names.sort();
    for name in names {
        let w = &groups[name]["weights"];
        let what = |field: &str| w.get(field).cloned().unwrap_or(Value::Null);
        let fp8 = what("num_bits") == 8 && what("type") == "float" && what("symmetric") != false;
        if !fp8 {
            return Err(format!(
                "compressed-tensors group `{name}`: weights {w} are not supported (8-bit symmetric float is); \
                 {SUPPORTED}"
            ));
        }
        let s = match what("strategy").as_str().unwrap_or("tensor") {
            "tensor" => Strategy::Tensor,
            "channel" => Strategy::Channel,
            "block" => Strategy::Block(block_size(&what("block_structure")).ok_or_else(|| {
                format!("compressed-tensors group `{name}`: strategy \"block\" needs a `block_structure` [out, in]")
            })?),
            other => {
                return Err(format!(
                    "compressed-tensors group `{name}`: weight strategy \"{other}\" is not supported (tensor, channel \
                     and block are); {SUPPORTED}"
                ))
            }
        };
        if strategy.is_some_and(|prev| prev != s) {
            return Err(format!(
                "compressed-tensors: config groups with different weight strategies are not supported; {SUPPORTED}"
            ));
        }
        strategy = Some(s);
    }
    Ok(strategy.expect("at least one group"))
}

/// A tensor as the files hold it: plain, or a quantised weight's parts.
pub enum Stored {
    Plain(LazyTensor),
    Fp8(Fp8),
    Mxfp4(Mxfp4),
}

impl From<Fp8> for Stored {
    fn from(w: Fp8) -> Self {
        Self::Fp8(w)
    }
}

impl From<Mxfp4> for Stored {
    fn from(w: Mxfp4) -> Self {
        Self::Mxfp4(w)
    }
}

/// An FP8 weight [.., out, in] and a scale per `block` of its last two dimensions.
pub struct Fp8 {
    values: LazyTensor,
    scales: LazyTensor,
    block: [i64; 2],
}

impl Fp8 {
    fn new(
        values: LazyTensor,
        scales: LazyTensor,
        block: [i64; 2],
        name: &str,
        scale_name: &str,
    ) -> Result<Self, String> {
        if values.kind != Kind::Float8e4m3fn {
            return Err(format!("`{name}` is {:?}, expected F8_E4M3 (it has a scale `{scale_name}`)", values.kind));
        }
        if !matches!(scales.kind, Kind::Float | Kind::BFloat16 | Kind::Half) {
            return Err(format!("`{scale_name}` is {:?}, expected F32, BF16 or F16", scales.kind));
        }
        let shape = &values.shape;
        if shape.len() < 2 {
            return Err(format!("`{name}`: shape {shape:?}, expected a matrix (or a stack of them)"));
        }
        let n = shape.len();
        // Per tensor or per block of a whole matrix: one scale, stored as a scalar or [1].
        let block = if block == [0, 0] { [shape[n - 2], shape[n - 1]] } else { block };
        let mut want: Vec<i64> = shape[..n - 2].to_vec();
        want.extend([(shape[n - 2] + block[0] - 1) / block[0], (shape[n - 1] + block[1] - 1) / block[1]]);
        let one = want.iter().product::<i64>() == 1 && scales.shape.iter().product::<i64>() == 1;
        if scales.shape != want && !one {
            return Err(format!(
                "`{scale_name}` has shape {:?}, expected {want:?} (a scale per {}x{} block of `{name}` {shape:?})",
                scales.shape, block[0], block[1]
            ));
        }
        Ok(Self { values, scales, block })
    }
}

/// MXFP4 experts: `blocks` U8 [E, rows, G, 16] and `scales` U8 [E, rows, G], the weight
/// [E, G * 32, rows].
pub struct Mxfp4 {
    blocks: LazyTensor,
    scales: LazyTensor,
}

impl Mxfp4 {
    fn new(blocks: LazyTensor, scales: LazyTensor, name: &str) -> Result<Self, String> {
        let ok = blocks.kind == Kind::Uint8
            && scales.kind == Kind::Uint8
            && blocks.shape.len() == 4
            && blocks.shape[3] == 16
            && scales.shape == blocks.shape[..3];
        if !ok {
            return Err(format!(
                "`{name}` {:?} {:?} with scales {:?} {:?}: expected U8 [E, rows, G, 16] and U8 [E, rows, G]",
                blocks.kind, blocks.shape, scales.kind, scales.shape
            ));
        }
        Ok(Self { blocks, scales })
    }
}

/// A block-scaled dimension: the kept indices' scale rows (`index`, into the scales read) and
/// the scale rows to read (`read`, merged ranges).
fn blocked(kept: &[Range<i64>], n: i64, block: i64) -> (Vec<Range<i64>>, Vec<i64>) {
    let whole = 0..n;
    let kept = if kept.is_empty() { std::slice::from_ref(&whole) } else { kept };
    let (mut read, mut index): (Vec<Range<i64>>, Vec<i64>) = (Vec::new(), Vec::new());
    let mut count = 0; // scale rows read so far
    for r in kept {
        for i in r.clone() {
            let b = i / block;
            match read.last_mut() {
                Some(last) if last.end > b => {} // (ranges ascend within a dimension)
                Some(last) if last.end == b => {
                    last.end += 1;
                    count += 1;
                }
                _ => {
                    read.push(b..b + 1);
                    count += 1;
                }
            }
            index.push(count - 1);
        }
    }
    (read, index)
}

impl Stored {
    /// The shape of the weight (dequantised).
    pub fn shape(&self) -> Vec<i64> {
        match self {
            Self::Plain(t) => t.shape.clone(),
            Self::Fp8(w) => w.values.shape.clone(),
            Self::Mxfp4(w) => {
                let s = &w.blocks.shape;
                vec![s[0], s[2] * 32, s[1]]
            }
        }
    }

    /// The part `sel` keeps (ranges within [`shape`](Self::shape)): plain, or its quantised parts.
    pub fn read_selected(&self, sel: &Selection) -> Result<Read, String> {
        let err = |e: input_files::InputError| e.to_string();
        let dim = |d: usize| sel.get(d).cloned().unwrap_or_default();
        match self {
            Self::Plain(t) => t.read_selected(sel).map(Read::Plain).map_err(err),
            Self::Fp8(w) => {
                let n = w.values.shape.len();
                let (rows, row_index) = blocked(&dim(n - 2), w.values.shape[n - 2], w.block[0]);
                let (cols, col_index) = blocked(&dim(n - 1), w.values.shape[n - 1], w.block[1]);
                let mut scale_sel: Vec<Vec<Range<i64>>> = (0..n - 2).map(dim).collect();
                scale_sel.extend([rows, cols]);
                let scales = if w.scales.shape.len() == n {
                    w.scales.read_selected(&scale_sel).map_err(err)?
                } else {
                    // One scale for the whole tensor, stored as a scalar or [1].
                    w.scales.read().map_err(err)?.reshape(vec![1; n])
                };
                Ok(Read::Fp8(Fp8Part {
                    values: w.values.read_selected(sel).map_err(err)?,
                    scales: scales.to_kind(Kind::Float),
                    row_index,
                    col_index,
                }))
            }
            Self::Mxfp4(w) => {
                // [E, cols, rows] kept as stored: experts and rows as they are, the 32-wide
                // blocks that hold the kept columns.
                let (groups, col_blocks) = blocked(&dim(1), w.blocks.shape[2] * 32, 32);
                let cols: Vec<i64> = col_blocks
                    .iter()
                    .zip(dim_indices(&dim(1), w.blocks.shape[2] * 32))
                    .map(|(b, c)| b * 32 + c % 32)
                    .collect();
                let part = [dim(0), dim(2), groups];
                Ok(Read::Mxfp4(Mxfp4Part {
                    blocks: w.blocks.read_selected(&part).map_err(err)?,
                    scales: w.scales.read_selected(&part).map_err(err)?,
                    cols,
                }))
            }
        }
    }

    /// Bytes in the files.
    pub fn stored_bytes(&self) -> usize {
        let bytes = |t: &LazyTensor| t.shape.iter().product::<i64>() as usize * t.kind.elt_size_in_bytes();
        match self {
            Self::Plain(t) => bytes(t),
            Self::Fp8(w) => bytes(&w.values) + bytes(&w.scales),
            Self::Mxfp4(w) => bytes(&w.blocks) + bytes(&w.scales),
        }
    }
}

/// Every index `kept` keeps of a dimension of size `n` (all of them when empty), in order.
fn dim_indices(kept: &[Range<i64>], n: i64) -> Vec<i64> {
    if kept.is_empty() {
        (0..n).collect()
    } else {
        kept.iter().flat_map(|r| r.clone()).collect()
    }
}

/// A weight (or the part a rank keeps) as read: plain, or still quantised.
pub enum Read {
    Plain(Tensor),
    Fp8(Fp8Part),
    Mxfp4(Mxfp4Part),
}

/// FP8 values [.., rows, cols] and the scales of the blocks they are in [.., R, C]: row i's
/// scale row is `row_index[i]`, column j's `col_index[j]` (a rank's rows need not start a
/// block). FP8 compute takes these as they are.
pub struct Fp8Part {
    pub values: Tensor,
    pub scales: Tensor,
    pub row_index: Vec<i64>,
    pub col_index: Vec<i64>,
}

/// MXFP4 blocks [E, rows, G, 16] and exponents [E, rows, G]; the weight's columns are
/// `cols` of the G * 32 these hold.
pub struct Mxfp4Part {
    pub blocks: Tensor,
    pub scales: Tensor,
    pub cols: Vec<i64>,
}

/// E2M1's values by code: sign bit, then magnitude {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
const FP4_VALUES: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

impl Read {
    /// Bytes as read (the quantised parts as stored).
    pub fn bytes(&self) -> usize {
        let b = |t: &Tensor| t.numel() * t.kind().elt_size_in_bytes();
        match self {
            Self::Plain(t) => b(t),
            Self::Fp8(p) => b(&p.values) + b(&p.scales),
            Self::Mxfp4(p) => b(&p.blocks) + b(&p.scales),
        }
    }

    /// The weight in full precision on `device`: a plain tensor as it is; a quantised one in
    /// fp32, each value times the scale of its block.
    pub fn dequantise(self, device: Device) -> Tensor {
        match self {
            Self::Plain(t) => t,
            Self::Fp8(p) => {
                let index = |i: &[i64]| Tensor::from_slice(i).to_device(device);
                let n = p.values.dim() as i64;
                let scales = p.scales.to_device(device).to_kind(Kind::Float);
                let scales = scales.index_select(n - 2, &index(&p.row_index)).index_select(n - 1, &index(&p.col_index));
                p.values.to_device(device).to_kind(Kind::Float) * scales
            }
            Self::Mxfp4(p) => {
                let blocks = p.blocks.to_device(device).to_kind(Kind::Int64);
                let lut = Tensor::from_slice(&FP4_VALUES).to_device(device);
                let (lo, hi) = (blocks.bitwise_and(15), blocks.bitwise_right_shift_tensor_scalar(4));
                let values = Tensor::stack(
                    &[lut.index_select(0, &lo.flatten(0, -1)), lut.index_select(0, &hi.flatten(0, -1))],
                    -1,
                );
                let s = blocks.size();
                let values = values.reshape([s[0], s[1], s[2], 32]);
                let scale = (p.scales.to_device(device).to_kind(Kind::Float) - 127.0).exp2().unsqueeze(-1);
                let w = (values * scale).reshape([s[0], s[1], s[2] * 32]);
                let cols = Tensor::from_slice(&p.cols).to_device(device);
                w.index_select(2, &cols).transpose(1, 2).contiguous()
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // selections: one range a dimension
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn configs_are_read_and_the_unsupported_refused_by_name() {
        let read = |q: Value| QuantConfig::read(&json!({ "quantization_config": q }));
        assert_eq!(QuantConfig::read(&json!({})).unwrap(), None);
        let fp8 = json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]});
        assert_eq!(read(fp8).unwrap(), Some(QuantConfig::Fp8 { block: [128, 128] }));
        assert_eq!(read(json!({"quant_method": "mxfp4"})).unwrap(), Some(QuantConfig::Mxfp4));
        let err = read(json!({"quant_method": "gptq", "bits": 4})).unwrap_err();
        assert_eq!(
            err,
            "quant_method \"gptq\" is not supported; dflash loads fp8 (block-scaled), compressed-tensors \
             (float-quantized FP8) and mxfp4 checkpoints"
        );
        let ct = |format: &str, weights: Value| {
            read(json!({"quant_method": "compressed-tensors", "format": format,
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": true}}},
                "ignore": ["lm_head"]}))
        };
        let channel = json!({"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": true});
        assert_eq!(
            ct("float-quantized", channel.clone()).unwrap(),
            Some(QuantConfig::CompressedFp8 { strategy: Strategy::Channel })
        );
        let err = ct("pack-quantized", channel).unwrap_err();
        assert!(
            err.starts_with("quant_method \"compressed-tensors\" with format \"pack-quantized\" is not supported"),
            "{err}"
        );
        let int4 = json!({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128});
        let err = ct("naive-quantized", int4).unwrap_err();
        assert!(err.contains("group `group_0`: weights") && err.ends_with("mxfp4 checkpoints"), "{err}");
    }

    /// The scale rows a selection needs, and where each kept index finds its own.
    #[test]
    fn a_selection_reads_the_blocks_that_cover_it() {
        // Rows 3..5 and 9..12 of 12 in blocks of 4: blocks 0 to 2, read as one run.
        let (read, index) = blocked(&[3..5, 9..12], 12, 4);
        assert_eq!((read, index), (vec![0..3], vec![0, 1, 2, 2, 2]));
        let (read, index) = blocked(&[0..2, 9..10], 12, 4); // a gap: two runs
        assert_eq!((read, index), (vec![0..1, 2..3], vec![0, 0, 1]));
        let (read, index) = blocked(&[5..7], 7, 4); // a partial last block
        assert_eq!((read, index), (vec![1..2], vec![0, 0]));
        let (read, index) = blocked(&[], 5, 2);
        assert_eq!((read, index), (vec![0..3], vec![0, 0, 1, 1, 2]));
    }
    /// A safetensors file of `tensors` (name, dtype, shape, bytes), its tensors mapped.
    fn stored(tensors: &[(&str, &str, &[i64], Vec<u8>)]) -> std::collections::HashMap<String, Stored> {
        let (mut header, mut data) = (serde_json::Map::new(), Vec::new());
        for (name, dtype, shape, bytes) in tensors {
            let at = data.len();
            data.extend_from_slice(bytes);
            header.insert(name.to_string(), json!({"dtype": dtype, "shape": shape, "data_offsets": [at, data.len()]}));
        }
        let header = Value::Object(header).to_string();
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header.as_bytes());
        file.extend_from_slice(&data);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        std::fs::write(&path, file).unwrap();
        let read = input_files::tensors::lazy_safetensors(&path).unwrap();
        read.into_iter().map(|(n, t)| (n, Stored::Plain(t))).collect()
    }

    /// FP8 values [5, 6] in blocks of 2 x 4 (the last row and columns a partial block): each
    /// value times the scale of its block, whole or for a rank's rows and columns.
    #[test]
    fn fp8_values_take_the_scale_of_their_block() {
        let bytes: Vec<u8> = (0..30u8).map(|i| i.wrapping_mul(37) % 0x70).collect(); // finite e4m3 codes
        let scales: Vec<f32> = vec![0.5, 2.0, -1.0, 3.0, 0.25, 8.0];
        let f32_bytes: Vec<u8> = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
        let mut w = stored(&[
            ("w.weight", "F8_E4M3", &[5, 6], bytes.clone()),
            ("w.weight_scale_inv", "F32", &[3, 2], f32_bytes),
        ]);
        assert_eq!(QuantConfig::Fp8 { block: [2, 4] }.pair(&mut w).unwrap(), 1);
        let values = Tensor::from_data_size(&bytes, &[5, 6], Kind::Float8e4m3fn).to_kind(Kind::Float);
        let per_block = Tensor::from_slice(&scales).view([3, 2]);
        let expanded = per_block.repeat_interleave_self_int(2, 0, None).narrow(0, 0, 5);
        let expanded = expanded.repeat_interleave_self_int(4, 1, None).narrow(1, 0, 6);
        let want = &values * expanded;
        let whole = w["w.weight"].read_selected(&[]).ok().unwrap().dequantise(Device::Cpu);
        assert!(whole.equal(&want));
        let sel = [vec![1..2, 3..5], vec![3..6]];
        let part = w["w.weight"].read_selected(&sel).ok().unwrap().dequantise(Device::Cpu);
        let rows = Tensor::cat(&[want.narrow(0, 1, 1), want.narrow(0, 3, 2)], 0);
        assert!(part.equal(&rows.narrow(1, 3, 3)));
        // A scale grid of another shape is named; so is an FP8 weight without its scale.
        let mut bad = stored(&[
            ("w.weight", "F8_E4M3", &[5, 6], bytes.clone()),
            ("w.weight_scale_inv", "F32", &[2, 2], vec![0; 16]),
        ]);
        let err = QuantConfig::Fp8 { block: [2, 4] }.pair(&mut bad).err().unwrap();
        assert_eq!(
            err,
            "`w.weight_scale_inv` has shape [2, 2], expected [3, 2] (a scale per 2x4 block of `w.weight` [5, 6])"
        );
        let mut lone = stored(&[("w.weight", "F8_E4M3", &[5, 6], bytes)]);
        let err = QuantConfig::Fp8 { block: [2, 4] }.pair(&mut lone).err().unwrap();
        assert_eq!(err, "`w.weight` is F8_E4M3 without a `w.weight_scale_inv` beside it");
    }
}
