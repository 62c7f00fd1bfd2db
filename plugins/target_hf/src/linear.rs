//! The target's dense projections ([`Linear`]) and the precision they run in (`[target] compute`).
//!
//! With `compute = "bf16"` a projection is the model's dtype's `x.linear(w, b)`, as always. With
//! `compute = "fp8"` (a CUDA device of compute capability 9.x) the projections of attention
//! (q|k|v and o; latent attention's q, kv_a, kv_b and o), of the gated MLPs (dense layers and shared experts) and of the Gated DeltaNet
//! layers run as FP8 block-scaled GEMMs ([`kernels::fp8`]): weights e4m3 with a scale per 128x128
//! block, activations quantised per token per 128 channels, as SGLang and vLLM serve FP8
//! checkpoints. An FP8 block-scaled checkpoint's weights stay as stored (values and block scales)
//! where they map onto 128x128 blocks of the layer's weight (the fused q|k|v included, and a
//! tensor-parallel rank's slice where it keeps whole blocks); any other weight (bf16/f32
//! checkpoints, random weights, other block sizes, slices cutting blocks) is quantised at load in
//! 128x128 blocks (SGLang's `--quantization fp8`), and the load says how many were. Embeddings,
//! the LM head, norms, routers, the routed experts (grouped GEMMs) and LFM2's short
//! convolutions stay in the model's dtype.

use crate::quant::{Fp8Part, Read};
use kernels::fp8::Fp8Linear;
use plugin_api::tch::{Device, Kind, Tensor};
use serde::Deserialize;

/// `[target] compute`: the precision of the target's dense projections.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Deserialize, plugin_api::Describe)]
#[serde(rename_all = "snake_case")]
pub enum Compute {
    /// The model's dtype (`[run] dtype`), a quantised checkpoint dequantised on load.
    #[default]
    Bf16,
    /// FP8 block-scaled GEMMs on Hopper (sm_90).
    Fp8,
}

/// A projection: y = x W^T + b.
pub enum Linear {
    /// W [out, in] and b [out] in the model's dtype.
    Dense { weight: Tensor, bias: Option<Tensor> },
    /// The FP8 block-scaled GEMM; its output in the activations' dtype.
    Fp8(Fp8Linear),
}

impl Linear {
    pub fn dense(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self::Dense { weight, bias }
    }

    /// x [..., in] -> [..., out].
    pub fn forward(&self, x: &Tensor) -> Tensor {
        match self {
            Self::Dense { weight, bias } => x.linear(weight, bias.as_ref()),
            Self::Fp8(l) => {
                let y = l.forward(x).unwrap_or_else(|e| panic!("FP8 linear layer: {e}"));
                if y.kind() == x.kind() {
                    y
                } else {
                    y.to_kind(x.kind())
                }
            }
        }
    }

    /// The weight the layer multiplies by, [out, in] as `kind` (an FP8 one dequantised).
    pub fn weight(&self, kind: Kind) -> Tensor {
        match self {
            Self::Dense { weight, .. } => weight.to_kind(kind),
            Self::Fp8(l) => l.dequantized(kind).expect("an FP8 weight dequantises"),
        }
    }

    pub fn is_fp8(&self) -> bool {
        matches!(self, Self::Fp8(_))
    }
}

/// FP8 parts (stacked by rows, as a fused projection's) as one block-scaled weight with
/// 128x128 blocks, when every 128 rows and 128 columns of the stacked weight share one stored
/// scale: (values [sum rows, cols] e4m3, `weight_scale_inv` [ceil(rows/128), ceil(cols/128)]) on
/// `device`. None when some block of the result would span several stored scales (another
/// block size, parts or a rank's slice cutting 128-row blocks).
pub(crate) fn stored_fp8(parts: &[&Fp8Part], device: Device) -> Option<(Tensor, Tensor)> {
    const B: usize = kernels::fp8::BLOCK as usize;
    let cols = parts.first()?.values.size().last().copied()? as usize;
    if parts.iter().any(|p| p.values.dim() != 2 || p.values.size()[1] as usize != cols || p.col_index.len() != cols) {
        return None;
    }
    // Each row's (part, stored scale row); each 128 rows must share one.
    let rows: Vec<(usize, i64)> =
        parts.iter().enumerate().flat_map(|(i, p)| p.row_index.iter().map(move |&r| (i, r))).collect();
    let row_blocks: Vec<(usize, i64)> = rows.chunks(B).map(|c| c[0]).collect();
    if rows.chunks(B).any(|c| c.iter().any(|r| *r != c[0])) {
        return None;
    }
    // Each part's 128 columns must share one stored scale column.
    let mut col_blocks: Vec<Vec<i64>> = Vec::with_capacity(parts.len());
    for p in parts {
        if p.col_index.chunks(B).any(|c| c.iter().any(|x| *x != c[0])) {
            return None;
        }
        col_blocks.push(p.col_index.chunks(B).map(|c| c[0]).collect());
    }
    let scales: Vec<Vec<f32>> = parts
        .iter()
        .map(|p| {
            let s = p.scales.to_kind(Kind::Float).to_device(Device::Cpu).contiguous();
            Vec::<f32>::try_from(s.view([-1])).expect("f32 scales")
        })
        .collect();
    let mut out = Vec::with_capacity(row_blocks.len() * col_blocks[0].len());
    for (part, srow) in &row_blocks {
        let width = parts[*part].scales.size()[1];
        for scol in &col_blocks[*part] {
            out.push(scales[*part][(srow * width + scol) as usize]);
        }
    }
    let scale_inv = Tensor::from_slice(&out).view([row_blocks.len() as i64, col_blocks[0].len() as i64]);
    let bytes: Vec<Tensor> = parts.iter().map(|p| p.values.view_dtype(Kind::Uint8)).collect();
    let values = if bytes.len() == 1 { bytes[0].shallow_clone() } else { Tensor::cat(&bytes, 0) };
    let values = values.to_device(device).contiguous().view_dtype(Kind::Float8e4m3fn);
    Some((values, scale_inv.to_device(device)))
}

/// The parts of a projection read for `compute` (see [`Loader::linear`](crate::weights::Loader)):
/// dense in `kind` (the model's dtype; bit for bit what `Loader::fused` gives), or FP8.
/// Returns the layer and whether its weight was quantised at load (not as stored).
pub(crate) fn build(
    reads: Vec<Read>,
    bias: Option<Tensor>,
    compute: Compute,
    device: Device,
    kind: Kind,
) -> Result<(Linear, bool), String> {
    let dense = |reads: Vec<Read>| {
        let ts: Vec<Tensor> = reads.into_iter().map(|r| r.dequantise(device).to_device(device).to_kind(kind)).collect();
        if ts.len() == 1 {
            ts.into_iter().next().expect("one part")
        } else {
            Tensor::cat(&ts, 0)
        }
    };
    if compute == Compute::Bf16 {
        return Ok((Linear::dense(dense(reads), bias), false));
    }
    let fp8: Vec<&Fp8Part> = reads
        .iter()
        .filter_map(|r| match r {
            Read::Fp8(p) => Some(p),
            _ => None,
        })
        .collect();
    if fp8.len() == reads.len() {
        if let Some((values, scale_inv)) = stored_fp8(&fp8, device) {
            let l = Fp8Linear::new(&values, &scale_inv, bias.as_ref()).map_err(|e| e.to_string())?;
            return Ok((Linear::Fp8(l), false));
        }
    }
    let w = dense(reads);
    let l = Fp8Linear::quantize(&w, bias.as_ref()).map_err(|e| e.to_string())?;
    Ok((Linear::Fp8(l), true))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dense Linear is `x.linear(w, b)` bit for bit; an FP8 one is close to it.
    #[test]
    fn a_dense_linear_is_todays_product_and_fp8_is_close() {
        plugin_api::tch::manual_seed(3);
        let w = Tensor::randn([200, 300], (Kind::Float, Device::Cpu)) * 0.05;
        let b = Tensor::randn([200], (Kind::Float, Device::Cpu));
        let x = Tensor::randn([2, 5, 300], (Kind::Float, Device::Cpu));
        let want = x.linear(&w, Some(&b));
        let (dense, q) = build(
            vec![Read::Plain(w.shallow_clone())],
            Some(b.shallow_clone()),
            Compute::Bf16,
            Device::Cpu,
            Kind::Float,
        )
        .unwrap();
        assert!(!q && !dense.is_fp8());
        assert!(dense.forward(&x).equal(&want));
        let (fp8, q) =
            build(vec![Read::Plain(w.shallow_clone())], Some(b), Compute::Fp8, Device::Cpu, Kind::Float).unwrap();
        assert!(q && fp8.is_fp8());
        let got = fp8.forward(&x);
        assert_eq!(got.size(), want.size());
        assert_eq!(got.kind(), Kind::Float);
        let rel = (&got - &want).norm().double_value(&[]) / want.norm().double_value(&[]);
        eprintln!("one FP8 GEMM: relative error {rel:.2e}");
        assert!(rel < 0.05, "{rel}");
    }

    /// Stored FP8 parts stack into 128x128 blocks when they keep whole blocks, and not otherwise.
    #[test]
    fn stored_fp8_parts_keep_whole_blocks_only() {
        plugin_api::tch::manual_seed(4);
        let part = |rows: i64, cols: i64| {
            let w = Tensor::randn([rows, cols], (Kind::Float, Device::Cpu));
            let (values, scales) = kernels::fp8::quantize_weight_block(&w).unwrap();
            Fp8Part {
                values,
                scales,
                row_index: (0..rows).map(|r| r / 128).collect(),
                col_index: (0..cols).map(|c| c / 128).collect(),
            }
        };
        let (a, b) = (part(256, 300), part(100, 300));
        let (values, scale_inv) = stored_fp8(&[&a, &b], Device::Cpu).unwrap();
        assert_eq!(values.size(), [356, 300]);
        assert_eq!(scale_inv.size(), [3, 3]);
        let want = Read::Fp8(part_clone(&a)).dequantise(Device::Cpu);
        let got = kernels::fp8::dequantize_weight_block(&values, &scale_inv, Kind::Float).unwrap().narrow(0, 0, 256);
        assert!(got.equal(&want));
        // 100 rows, then more: a 128-row block would span two parts.
        assert!(stored_fp8(&[&b, &a], Device::Cpu).is_none());
        // A slice starting mid-block.
        let mut c = part_clone(&a);
        c.row_index = (64..320).map(|r| r / 128).collect();
        assert!(stored_fp8(&[&c], Device::Cpu).is_none());
    }

    fn part_clone(p: &Fp8Part) -> Fp8Part {
        Fp8Part {
            values: p.values.copy(),
            scales: p.scales.copy(),
            row_index: p.row_index.clone(),
            col_index: p.col_index.clone(),
        }
    }
}
