//! LFM2's gated short convolution (`model.layers.{i}.conv`, transformers' `Lfm2ShortConv`), the
//! token mixer of most LFM2 / LFM2.5 layers.
//!
//! Weights: `in_proj` [3H, H] (B | C | x), `conv.weight` [H, 1, K] (depthwise, K =
//! `conv_L_cache`), `out_proj` [H, H]; biases on all three where `conv_bias`.
//!
//! Per token: B, C, x = in_proj(h); y = C * causal_conv(B * x); out = out_proj(y). The conv's
//! state is its last K-1 inputs (B * x). Left padding is zeroed before in_proj, as transformers
//! zeroes it, so a padded row's conv starts at its first token.
//!
//! Tensor parallelism splits the channels: each rank holds its B, C and x rows of in_proj, its
//! channels of the conv, and its columns of out_proj (row-parallel).

use crate::{
    cache::{conv_tail, ConvState},
    config::DecoderConfig,
    weights::Loader,
};
use gated_deltanet::depthwise_conv;
use plugin_api::tch::Tensor;
use std::ops::Range;

pub struct ShortConv {
    in_proj: Tensor,
    in_bias: Option<Tensor>,
    /// [H, K].
    conv: Tensor,
    conv_bias: Option<Tensor>,
    out_proj: Tensor,
    out_bias: Option<Tensor>,
    kernel: i64,
}

impl ShortConv {
    pub(crate) fn load(cfg: &DecoderConfig, ld: &mut Loader, p: &str) -> Result<Self, String> {
        let h = cfg.hidden_size as i64;
        let k = cfg.short_conv_kernel() as i64;
        let bias = cfg.conv_bias.unwrap_or(false);
        // This rank's channels (`tp.rs`), of each of B, C and x.
        let mine = ld.shard.split(h, "the short convolution's channels (the hidden size)")?;
        let shift = |by: i64| -> Range<i64> { mine.start + by..mine.end + by };
        let bcx = vec![shift(0), shift(h), shift(2 * h)];
        let mut opt = |name: String, n: i64, keep: Vec<Range<i64>>| {
            if bias {
                ld.get_selected(&name, &[n], &[keep]).map(Some)
            } else {
                Ok(None)
            }
        };
        let (in_bias, conv_bias) =
            (opt(format!("{p}.in_proj.bias"), 3 * h, bcx.clone())?, opt(format!("{p}.conv.bias"), h, vec![shift(0)])?);
        let out_bias = if bias { ld.row_bias(&format!("{p}.out_proj.bias"), h)? } else { None };
        Ok(Self {
            in_proj: ld.get_selected(&format!("{p}.in_proj.weight"), &[3 * h, h], &[bcx])?,
            in_bias,
            conv: ld.get_selected(&format!("{p}.conv.weight"), &[h, 1, k], &[vec![shift(0)]])?.squeeze_dim(1),
            conv_bias,
            out_proj: ld.get_selected(&format!("{p}.out_proj.weight"), &[h, h], &[vec![], vec![shift(0)]])?,
            out_bias,
            kernel: k,
        })
    }

    /// x [B, L, H] (normed) -> [B, L, H]; `valid` [B, L] false on left padding; `state` the
    /// layer's cache slot, continued and updated; `keep_undo`: keep what a rollback needs.
    pub fn forward(
        &self,
        x: &Tensor,
        valid: Option<&Tensor>,
        state: Option<&mut Option<ConvState>>,
        keep_undo: bool,
    ) -> Tensor {
        // The channels this rank holds.
        let (b, h) = (x.size()[0], self.conv.size()[0]);
        let x = match valid {
            Some(v) => x * v.unsqueeze(-1).to_kind(x.kind()),
            None => x.shallow_clone(),
        };
        // 1. B, C, x in one GEMM; the conv's input B * x.
        let bcx = x.linear(&self.in_proj, self.in_bias.as_ref());
        let (gate_in, gate_out, inner) = (bcx.narrow(2, 0, h), bcx.narrow(2, h, h), bcx.narrow(2, 2 * h, h));
        let input = gate_in * inner;
        // 2. The causal conv after the cached rows (zeros at a sequence's start), gated by C.
        let history = match state.as_ref().and_then(|s| s.as_ref()) {
            Some(s) => s.rows.shallow_clone(),
            None => Tensor::zeros([b, self.kernel - 1, h], (x.kind(), x.device())),
        };
        let mut conv = depthwise_conv(&Tensor::cat(&[&history, &input], 1), &self.conv);
        if let Some(bias) = &self.conv_bias {
            conv = conv + bias;
        }
        let out = (gate_out * conv).linear(&self.out_proj, self.out_bias.as_ref());
        // 3. The cache: the last K-1 inputs (and the undo record).
        if let Some(slot) = state {
            let undo = keep_undo.then(|| (history.shallow_clone(), input.shallow_clone()));
            *slot = Some(ConvState { rows: conv_tail(&history, &input), undo });
        }
        out
    }
}

/// The state as it was after the first `keep` positions of the last extension.
pub fn rewind(s: &mut ConvState, keep: i64) {
    let (history, input) = s.undo.as_ref().expect("rewind needs the undo record of a rollback cache");
    s.rows = conv_tail(history, &input.narrow(1, 0, keep));
}
