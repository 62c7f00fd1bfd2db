//! Rotary position embeddings: a decoder's RoPE, its (cos, sin) tables and their application.

use crate::config::{DecoderConfig, LayerKind};
use plugin_api::tch::{Kind, Tensor};
use rope_scaling::RopeScaling;

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

#[cfg(test)]
mod tests {
    use super::*;
    use plugin_api::tch::Device;

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
