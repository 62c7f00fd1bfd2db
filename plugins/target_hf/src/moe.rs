//! The sparse MLP (`model.layers.{i}.mlp`): a router picks the top-k experts of each token,
//! each a gated MLP, and their outputs are summed with the router's weights. The families differ
//! in routing (`config::Routing`: Qwen's softmax, gpt-oss's softmax over the top-k logits,
//! DeepSeek-V3 / GLM-4.5's grouped sigmoid with a correction bias and a scale, LongCat-Flash's
//! biased softmax over routed and zero-computation experts), in the experts (gpt-oss: biases,
//! a clamped SwiGLU) and in the always-on experts beside them (Qwen3.5-MoE: a shared expert
//! gated by sigmoid(x . shared_expert_gate); DeepSeek-V3 / GLM-4.5: `shared_experts`, ungated).
//!
//! Dispatch as grouped GEMMs, no loop over experts: the T*k (token, expert) pairs are sorted by
//! expert, their rows gathered once, and each projection is one `_grouped_mm` over the experts'
//! stacked weights with the per-expert row offsets (libtorch 2.11: CUTLASS grouped GEMM for
//! bf16 on sm90; elsewhere its own per-group fallback). The offsets come from a `searchsorted`
//! on the device, so routing never waits for the host. The results go back to (token, slot)
//! order and are summed over the k slots with their router weights. A zero-computation expert
//! returns its input: its pairs go to one extra expert of zero weights (output 0) and the
//! input, weighted, is added beside.
//!
//! Weights: the router `gate.weight` [E, H] (gpt-oss: `router.weight` and `router.bias`;
//! LongCat-Flash: `router.classifier.weight` [E + Z, H]) and the correction bias
//! (`gate.e_score_correction_bias`, `router.e_score_correction_bias`); experts either fused as
//! transformers holds them in memory (`experts.gate_up_proj` [E, 2I, H], gate rows first;
//! `experts.down_proj` [E, H, I]; gpt-oss's [E, H, 2I] with gate and up interleaved, and
//! [E, I, H], with `_bias` [E, 2I] and [E, H]) or per expert as checkpoints store them
//! (`experts.{e}.{gate,up,down}_proj.weight`); the shared experts' `shared_expert(s).*`.

use crate::{
    common::Mlp,
    config::{DecoderConfig, MoeShape, Routing, SharedExpert},
    weights::Loader,
};
use plugin_api::tch::{Kind, Tensor};
use std::ops::Range;

/// gpt-oss's SwiGLU: (clamp(up, -7, 7) + 1) * g sigmoid(1.702 g), g = min(gate, 7).
const GPT_OSS_ALPHA: f64 = 1.702;
const GPT_OSS_LIMIT: f64 = 7.0;

enum Shared {
    Gated(Mlp, Tensor),
    Plain(Mlp),
}

pub struct SparseMoe {
    router: Tensor,
    router_bias: Option<Tensor>,
    /// The score-correction bias [E + Z], fp32 (grouped and biased routing).
    correction: Option<Tensor>,
    routing: Routing,
    /// [E', 2I', H']: gate rows then up rows, per expert (I', H' padded, see `ALIGN`; E' = E + 1
    /// with zero-computation experts, the last all zeros).
    gate_up: Tensor,
    gate_up_bias: Option<Tensor>,
    /// [E', H', I'].
    down: Tensor,
    down_bias: Option<Tensor>,
    /// Experts with weights (the ids past them are zero-computation experts).
    experts: i64,
    /// With expert parallelism, the experts this rank holds (`tp.rs`); None: all of them.
    local: Option<Range<i64>>,
    /// Zero-computation experts follow the experts with weights.
    zero_experts: bool,
    /// Whether this rank adds what the replica adds once (the zero-computation experts' input):
    /// the first rank, or the whole model.
    adds_once: bool,
    top_k: i64,
    clamped: bool,
    /// I' and H'.
    intermediate: i64,
    hidden: i64,
    shared: Option<Shared>,
}

/// `_grouped_mm` wants every row stride a multiple of 16 bytes: expert widths and the hidden size
/// are zero-padded to a multiple of 8 elements at load (silu(0) * 0 = 0 and zero down-projection
/// columns add nothing, so the result is exact). Real models need no padding.
const ALIGN: i64 = 8;

fn pad_to(n: i64) -> i64 {
    (n + ALIGN - 1) / ALIGN * ALIGN
}

/// [.., 2n, ..] along `dim` with gate and up interleaved -> gate rows then up rows.
fn deinterleave(t: &Tensor, dim: i64) -> Tensor {
    let n = t.size()[dim as usize];
    let even = Tensor::arange_start_step(0, n, 2, (Kind::Int64, t.device()));
    Tensor::cat(&[t.index_select(dim, &even), t.index_select(dim, &(&even + 1))], dim)
}

impl SparseMoe {
    pub(crate) fn load(cfg: &DecoderConfig, ld: &mut Loader, p: &str) -> Result<Self, String> {
        let m = cfg.moe().ok_or_else(|| format!("{p}: a sparse layer in a model without experts"))?;
        let (h, e, i) = (cfg.hidden_size as i64, m.experts as i64, m.intermediate as i64);
        let choices = e + m.zero_experts as i64;
        // 1. The router.
        let (router, router_bias, correction) = match m.routing {
            Routing::Softmax { .. } => (ld.get(&format!("{p}.gate.weight"), &[e, h])?, None, None),
            Routing::TopKSoftmax => (
                ld.get(&format!("{p}.router.weight"), &[e, h])?,
                Some(ld.get(&format!("{p}.router.bias"), &[e])?),
                None,
            ),
            Routing::GroupedSigmoid { .. } => (
                ld.get_f32(&format!("{p}.gate.weight"), &[e, h])?,
                None,
                Some(ld.get_f32(&format!("{p}.gate.e_score_correction_bias"), &[e])?),
            ),
            Routing::BiasedSoftmax { .. } => (
                ld.get_f32(&format!("{p}.router.classifier.weight"), &[choices, h])?,
                None,
                Some(ld.get_f32(&format!("{p}.router.e_score_correction_bias"), &[choices])?),
            ),
        };
        // 2. The experts as [E, 2I, H] (gate rows first) and [E, H, I], with their biases.
        // This rank's experts and part of their width (`tp.rs`).
        let mine = ld.shard.experts(e)?;
        let width = ld.shard.expert_width(i)?;
        let (mut gate_up, mut down, mut gate_up_bias, mut down_bias) = Self::load_experts(&m, ld, p, h, &mine, &width)?;
        let local = (mine.end - mine.start < e).then_some(mine);
        let i = width.end - width.start;
        // (With expert parallelism the zero-computation experts' pairs are not this rank's.)
        if m.zero_experts > 0 && local.is_none() {
            let zero = |t: &Tensor| Tensor::cat(&[t, &t.narrow(0, 0, 1).zeros_like()], 0);
            (gate_up, down) = (zero(&gate_up), zero(&down));
            gate_up_bias = gate_up_bias.as_ref().map(zero);
            down_bias = down_bias.as_ref().map(zero);
        }
        // 3. Pad: gate and up each [E, I, H] -> [E, I', H'], down [E, H, I] -> [E, H', I'].
        let (ip, hp) = (pad_to(i), pad_to(h));
        if (ip, hp) != (i, h) {
            let pad =
                |t: Tensor, rows: i64, cols: i64| t.constant_pad_nd([0, cols - t.size()[2], 0, rows - t.size()[1]]);
            let (gate, up) = (gate_up.narrow(1, 0, i), gate_up.narrow(1, i, i));
            gate_up = Tensor::cat(&[pad(gate, ip, hp), pad(up, ip, hp)], 1);
            down = pad(down, hp, ip);
            gate_up_bias = gate_up_bias.map(|b| {
                let padded = |t: Tensor| t.constant_pad_nd([0, ip - i]);
                Tensor::cat(&[padded(b.narrow(1, 0, i)), padded(b.narrow(1, i, i))], 1)
            });
            down_bias = down_bias.map(|b| b.constant_pad_nd([0, hp - h]));
        }
        // 4. The always-on experts.
        let shared = match m.shared {
            Some(SharedExpert::Gated(width)) => Some(Shared::Gated(
                Mlp::load(ld, &format!("{p}.shared_expert"), h, width as i64)?,
                ld.get(&format!("{p}.shared_expert_gate.weight"), &[1, h])?,
            )),
            Some(SharedExpert::Plain(width)) => {
                Some(Shared::Plain(Mlp::load(ld, &format!("{p}.shared_experts"), h, width as i64)?))
            }
            None => None,
        };
        Ok(Self {
            router,
            router_bias,
            correction,
            routing: m.routing,
            gate_up,
            gate_up_bias,
            down,
            down_bias,
            experts: e,
            local,
            zero_experts: m.zero_experts > 0,
            adds_once: ld.shard.rank == 0,
            top_k: m.top_k as i64,
            clamped: m.gpt_oss,
            intermediate: ip,
            hidden: hp,
            shared,
        })
    }

    /// The experts' weights, unpadded: gate_up [E, 2I, H], down [E, H, I], their biases; of the
    /// experts `mine`, the width `width` of each (the whole model: all of them, all of it).
    #[allow(clippy::type_complexity)]
    fn load_experts(
        m: &MoeShape,
        ld: &mut Loader,
        p: &str,
        h: i64,
        mine: &Range<i64>,
        width: &Range<i64>,
    ) -> Result<(Tensor, Tensor, Option<Tensor>, Option<Tensor>), String> {
        let (e, i) = (m.experts as i64, m.intermediate as i64);
        let shift = |r: &Range<i64>, by: i64| r.start + by..r.end + by;
        // gate rows then up rows of each expert, and down's columns.
        let gate_up_rows = vec![width.clone(), shift(width, i)];
        let fused = format!("{p}.experts.gate_up_proj");
        if m.gpt_oss {
            // [E, H, 2I] interleaved and [E, I, H] -> [E, 2I, H] gate rows first and [E, H, I].
            // Interleaved, a width's gate and up columns are one run: 2 start .. 2 end.
            let pairs = 2 * width.start..2 * width.end;
            let pairs = vec![pairs];
            let experts = vec![mine.clone()];
            let gate_up = ld.get_selected(&fused, &[e, h, 2 * i], &[experts.clone(), vec![], pairs.clone()])?;
            let gate_up = deinterleave(&gate_up.transpose(1, 2), 1);
            let bias =
                deinterleave(&ld.get_selected(&format!("{fused}_bias"), &[e, 2 * i], &[experts.clone(), pairs])?, 1);
            let down = ld
                .get_selected(&format!("{p}.experts.down_proj"), &[e, i, h], &[experts.clone(), vec![width.clone()]])?
                .transpose(1, 2);
            // Row-parallel within an expert: its down bias is added by the first part's rank.
            let down_bias = if width.start == 0 {
                Some(ld.get_selected(&format!("{p}.experts.down_proj_bias"), &[e, h], &[experts])?)
            } else {
                None
            };
            return Ok((gate_up.contiguous(), down.contiguous(), Some(bias), down_bias));
        }
        if ld.w.contains(&fused) || ld.random {
            // LongCat-Flash's fused gate_up has a row block for each zero-computation expert too.
            let stored = ld.w.shape(&fused).map_or(e, |s| s[0]);
            let stored = if stored == e + m.zero_experts as i64 { stored } else { e };
            let gate_up = ld.get_selected(&fused, &[stored, 2 * i, h], &[vec![mine.clone()], gate_up_rows])?;
            let down = ld.get_selected(
                &format!("{p}.experts.down_proj"),
                &[e, h, i],
                &[vec![mine.clone()], vec![], vec![width.clone()]],
            )?;
            return Ok((gate_up, down, None, None));
        }
        let n = (mine.end - mine.start) as usize;
        let (mut gate_up, mut down) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for x in mine.clone() {
            let q = format!("{p}.experts.{x}");
            let gate = ld.get_selected(&format!("{q}.gate_proj.weight"), &[i, h], &[vec![width.clone()]])?;
            let up = ld.get_selected(&format!("{q}.up_proj.weight"), &[i, h], &[vec![width.clone()]])?;
            gate_up.push(Tensor::cat(&[gate, up], 0));
            down.push(ld.get_selected(&format!("{q}.down_proj.weight"), &[h, i], &[vec![], vec![width.clone()]])?);
        }
        Ok((Tensor::stack(&gate_up, 0), Tensor::stack(&down, 0), None, None))
    }

    /// Each token's experts [T, k] (int64; zero-computation experts numbered from E) and their
    /// weights [T, k] (fp32), for x [T, H].
    pub fn route(&self, x: &Tensor) -> (Tensor, Tensor) {
        let k = self.top_k;
        match self.routing {
            // Softmax in fp32, top-k, renormalised to sum 1 where the family does.
            Routing::Softmax { norm } => {
                let probs = x.linear::<&Tensor>(&self.router, None).softmax(-1, Kind::Float);
                let (mut w, experts) = probs.topk(k, -1, true, true);
                if norm {
                    w = &w / w.sum_dim_intlist(-1, true, Kind::Float);
                }
                (experts, w)
            }
            // The top-k logits, softmax over them (in the logits' dtype, as transformers).
            Routing::TopKSoftmax => {
                let logits = x.linear(&self.router, self.router_bias.as_ref());
                let (top, experts) = logits.topk(k, -1, true, true);
                (experts, top.softmax(-1, top.kind()).to_kind(Kind::Float))
            }
            Routing::GroupedSigmoid { groups, topk_groups, norm, scale } => {
                let scores = x.to_kind(Kind::Float).linear::<&Tensor>(&self.router, None).sigmoid();
                let choice = &scores + self.correction.as_ref().expect("grouped routing has a correction bias");
                // A group's score: its two best; the experts of the best `topk_groups` groups.
                let (t, e, g) = (x.size()[0], self.experts, groups as i64);
                let group_scores =
                    choice.view([t, g, e / g]).topk(2, -1, true, true).0.sum_dim_intlist(-1, false, None);
                let (_, best) = group_scores.topk(topk_groups as i64, -1, true, true);
                let kept = group_scores.zeros_like().scatter_value(1, &best, 1.0);
                let kept = kept.unsqueeze(-1).expand([t, g, e / g], false).reshape([t, e]).gt(0.5);
                let (_, experts) = choice.masked_fill(&kept.logical_not(), f64::NEG_INFINITY).topk(k, -1, true, true);
                let mut w = scores.gather(1, &experts, false);
                if norm {
                    w = &w / (w.sum_dim_intlist(-1, true, Kind::Float) + 1e-20);
                }
                (experts, w * scale)
            }
            Routing::BiasedSoftmax { scale } => {
                let scores = x.to_kind(Kind::Float).linear::<&Tensor>(&self.router, None).softmax(-1, Kind::Float);
                let choice = &scores + self.correction.as_ref().expect("biased routing has a correction bias");
                let (_, experts) = choice.topk(k, -1, true, true);
                let w = scores.gather(1, &experts, false) * scale;
                (experts, w)
            }
        }
    }

    /// x [B, L, H] -> [B, L, H].
    pub fn forward(&self, x: &Tensor) -> Tensor {
        let size = x.size();
        let h = size[2];
        let x = x.reshape([-1, h]);
        let (t, k) = (x.size()[0], self.top_k);
        // 1. Route; zero-computation experts' pairs go to the zero expert E, their input aside.
        let (mut experts, weights) = self.route(&x);
        let weights = weights.to_kind(x.kind());
        let n_experts = self.gate_up.size()[0];
        let identity = self.zero_experts.then(|| {
            let zero = experts.ge(self.experts);
            experts = experts.clamp_max(self.experts);
            (&weights * zero.to_kind(x.kind())).sum_dim_intlist(-1, true, x.kind()) * &x
        });
        // Over a replica the identity's share is added once.
        let identity = identity.filter(|_| self.adds_once);
        if let Some(mine) = &self.local {
            let mut out = self.forward_local(&x, &experts, &weights, mine);
            if let Some(identity) = identity {
                out = out + identity;
            }
            return out.view(size.as_slice());
        }
        // 2. Sort the T*k pairs by expert; expert e's rows end at offs[e].
        let (sorted, order) = experts.view([-1]).sort_stable(true, 0, false);
        let bounds = Tensor::arange(n_experts, (Kind::Int64, x.device()));
        let offs = bounds.searchsorted::<&Tensor>(&sorted, true, true, "right", None); // int32 [E]
        let rows = x.index_select(0, &order.divide_scalar_mode(k, "floor"));
        // 3. The experts' gated MLP.
        let y = self.experts_mlp(&rows, &sorted, &offs);
        // 4. Back to (token, slot) order, weighted, summed over the slots.
        let slots = Tensor::arange(t * k, (Kind::Int64, x.device()));
        let inverse = order.zeros_like().index_copy(0, &order, &slots);
        let y = y.index_select(0, &inverse).view([t, k, h]);
        let mut out = (y * weights.unsqueeze(-1)).sum_dim_intlist(1, false, x.kind());
        if let Some(identity) = identity {
            out = out + identity;
        }
        // 5. The always-on experts.
        match &self.shared {
            Some(Shared::Gated(mlp, gate)) => out = out + x.linear::<&Tensor>(gate, None).sigmoid() * mlp.forward(&x),
            Some(Shared::Plain(mlp)) => out = out + mlp.forward(&x),
            None => {}
        }
        out.view(size.as_slice())
    }
}

impl SparseMoe {
    /// The experts' gated MLP on `rows` [N, H] sorted by expert (`sorted` [N], this module's
    /// expert ids; expert e's rows end at `offs[e]`) as two grouped GEMMs, biases by each row's
    /// expert -> [N, H].
    fn experts_mlp(&self, rows: &Tensor, sorted: &Tensor, offs: &Tensor) -> Tensor {
        let (h, i) = (rows.size()[1], self.intermediate);
        let rows = if self.hidden != h { rows.constant_pad_nd([0, self.hidden - h]) } else { rows.shallow_clone() };
        let mut gate_up = rows.internal_grouped_mm(&self.gate_up.transpose(1, 2), Some(offs), None, None::<Kind>);
        if let Some(b) = &self.gate_up_bias {
            gate_up = gate_up + b.index_select(0, sorted);
        }
        let (gate, up) = (gate_up.narrow(1, 0, i), gate_up.narrow(1, i, i));
        let act = if self.clamped {
            let gate = gate.clamp_max(GPT_OSS_LIMIT);
            (up.clamp(-GPT_OSS_LIMIT, GPT_OSS_LIMIT) + 1.0) * (&gate * (&gate * GPT_OSS_ALPHA).sigmoid())
        } else {
            gate.silu() * up
        };
        let mut y = act.internal_grouped_mm(&self.down.transpose(1, 2), Some(offs), None, None::<Kind>); // [N, H']
        if let Some(b) = &self.down_bias {
            y = y + b.index_select(0, sorted);
        }
        if self.hidden != h {
            y = y.narrow(1, 0, h);
        }
        y
    }

    /// With expert parallelism: the pairs routed to this rank's experts `mine` only (the rest
    /// contribute nothing here; the ranks holding their experts add them in the all-reduce), and
    /// this rank's part of the shared expert. x [T, H] -> [T, H], a partial sum.
    fn forward_local(&self, x: &Tensor, experts: &Tensor, weights: &Tensor, mine: &Range<i64>) -> Tensor {
        let (t, h) = (x.size()[0], x.size()[1]);
        let (k, n) = (self.top_k, mine.end - mine.start);
        // 1. Local ids; other ranks' pairs sort last (id n) and are cut off.
        let ids = experts.view([-1]) - mine.start;
        let here = ids.ge(0).logical_and(&ids.lt(n));
        let ids = ids.where_self(&here, &ids.full_like(n));
        let (sorted, order) = ids.sort_stable(true, 0, false);
        let bounds = Tensor::arange(n, (Kind::Int64, x.device()));
        let offs = bounds.searchsorted::<&Tensor>(&sorted, true, true, "right", None); // int32 [n]
                                                                                       // The one wait for the host: how many pairs this rank computes.
        let count = offs.int64_value(&[n - 1]);
        let mut pairs = Tensor::zeros([t * k, h], (x.kind(), x.device()));
        if count > 0 {
            let order = order.narrow(0, 0, count);
            let rows = x.index_select(0, &order.divide_scalar_mode(k, "floor"));
            let y = self.experts_mlp(&rows, &sorted.narrow(0, 0, count), &offs);
            let _ = pairs.index_copy_(0, &order, &y);
        }
        let mut out = (pairs.view([t, k, h]) * weights.unsqueeze(-1)).sum_dim_intlist(1, false, x.kind());
        match &self.shared {
            Some(Shared::Gated(mlp, gate)) => out = out + x.linear::<&Tensor>(gate, None).sigmoid() * mlp.forward(x),
            Some(Shared::Plain(mlp)) => out = out + mlp.forward(x),
            None => {}
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::Weights;
    use plugin_api::tch::Device;
    use std::collections::HashMap;

    /// transformers' loop over experts (index_add of each expert's weighted output), written out
    /// over the unpadded weights (`gate_up` [E, 2I, H], `down` [E, H, I], biases [E, 2I], [E, H])
    /// for the routing `m.route` gives; experts from E on return their input.
    fn reference(x: &Tensor, m: &SparseMoe, w: &(Tensor, Tensor, Option<Tensor>, Option<Tensor>)) -> Tensor {
        let (gate_up, down, gu_bias, d_bias) = w;
        let (idx, weights) = m.route(x);
        let out = x.zeros_like();
        let i = down.size()[2];
        for t in 0..x.size()[0] {
            for s in 0..m.top_k {
                let e = idx.int64_value(&[t, s]);
                let y = if e >= m.experts {
                    x.get(t)
                } else {
                    let mut gu = x.get(t).matmul(&gate_up.get(e).tr());
                    if let Some(b) = gu_bias {
                        gu = gu + b.get(e);
                    }
                    let (g, u) = (gu.narrow(0, 0, i), gu.narrow(0, i, i));
                    let act = if m.clamped {
                        let g = g.clamp_max(7.0);
                        (u.clamp(-7.0, 7.0) + 1.0) * (&g * (&g * 1.702).sigmoid())
                    } else {
                        g.silu() * u
                    };
                    let mut y = act.matmul(&down.get(e).tr());
                    if let Some(b) = d_bias {
                        y = y + b.get(e);
                    }
                    y
                };
                let _ = out.get(t).g_add_(&(y * weights.double_value(&[t, s])));
            }
        }
        out
    }

    /// A sparse block of `model_type` with 5 experts of width 6 (padded to 8 inside), stored
    /// fused or per expert, and its unpadded expert weights [E, 2I, H] (gate rows first), [E,
    /// H, I] with biases.
    fn tiny(model_type: &str, fused: bool) -> (SparseMoe, (Tensor, Tensor, Option<Tensor>, Option<Tensor>)) {
        let (e, h, i, z) = (5i64, 8i64, 6i64, 2i64);
        plugin_api::tch::manual_seed(3);
        let mut t = HashMap::new();
        let r = |s: &[i64]| Tensor::randn(s, (Kind::Float, Device::Cpu)) * 0.5;
        let (gate_up, down) = (r(&[e, 2 * i, h]), r(&[e, h, i]));
        let mut biases = (None, None);
        match model_type {
            "gpt_oss" => {
                t.insert("mlp.router.weight".to_string(), r(&[e, h]));
                t.insert("mlp.router.bias".to_string(), r(&[e]));
                // Stored [E, H, 2I] with gate and up interleaved (bias likewise).
                let interleave = |x: &Tensor| {
                    let d = x.dim() as i64 - 1;
                    Tensor::stack(&[x.narrow(d, 0, i), x.narrow(d, i, i)], d + 1).flatten(d, d + 1)
                };
                let gu_bias = r(&[e, 2 * i]) * 8.0; // past the clamp
                t.insert("mlp.experts.gate_up_proj".into(), interleave(&gate_up.transpose(1, 2)));
                t.insert("mlp.experts.gate_up_proj_bias".into(), interleave(&gu_bias));
                t.insert("mlp.experts.down_proj".into(), down.transpose(1, 2).copy());
                let d_bias = r(&[e, h]);
                t.insert("mlp.experts.down_proj_bias".into(), d_bias.copy());
                biases = (Some(gu_bias), Some(d_bias));
            }
            "longcat_flash" => {
                t.insert("mlp.router.classifier.weight".to_string(), r(&[e + z, h]));
                t.insert("mlp.router.e_score_correction_bias".to_string(), r(&[e + z]) * 0.1);
            }
            _ => {
                t.insert("mlp.gate.weight".to_string(), r(&[e, h]));
            }
        }
        if model_type != "gpt_oss" {
            if fused {
                t.insert("mlp.experts.gate_up_proj".into(), gate_up.copy());
                t.insert("mlp.experts.down_proj".into(), down.copy());
            } else {
                for x in 0..e {
                    t.insert(format!("mlp.experts.{x}.gate_proj.weight"), gate_up.get(x).narrow(0, 0, i).copy());
                    t.insert(format!("mlp.experts.{x}.up_proj.weight"), gate_up.get(x).narrow(0, i, i).copy());
                    t.insert(format!("mlp.experts.{x}.down_proj.weight"), down.get(x).copy());
                }
            }
        }
        let cfg: DecoderConfig = serde_json::from_value(serde_json::json!({
            "model_type": model_type, "hidden_size": h, "num_hidden_layers": 1, "intermediate_size": i,
            "num_attention_heads": 1, "vocab_size": 4, "num_experts": e, "num_experts_per_tok": 2,
            "moe_intermediate_size": i, "norm_topk_prob": false, "zero_expert_num": z,
        }))
        .unwrap();
        let mut w = Weights::in_memory(t, "tiny");
        let mut ld = Loader::new(&mut w, Device::Cpu, Kind::Float);
        (SparseMoe::load(&cfg, &mut ld, "mlp").unwrap(), (gate_up, down, biases.0, biases.1))
    }

    /// The grouped dispatch equals transformers' per-expert loop: from per-expert and fused
    /// weights (expert width 6, padded to 8), with and without renormalised weights; gpt-oss's
    /// interleaved, biased, clamped experts; LongCat-Flash's zero-computation experts.
    #[test]
    fn grouped_dispatch_equals_the_loop_over_experts() {
        let x = Tensor::randn([2, 7, 8], (Kind::Float, Device::Cpu));
        let x2 = x.view([-1, 8]);
        type Experts = (Tensor, Tensor, Option<Tensor>, Option<Tensor>);
        let check = |m: &SparseMoe, w: &Experts, what: &str| {
            let err = (m.forward(&x).view([-1, 8]) - reference(&x2, m, w)).abs().max().double_value(&[]);
            assert!(err < 1e-5, "{what}: max |diff| {err:.2e}");
        };
        for fused in [false, true] {
            let (mut m, w) = tiny("qwen3_moe", fused);
            for norm in [false, true] {
                m.routing = Routing::Softmax { norm };
                check(&m, &w, &format!("fused {fused} norm {norm}"));
            }
        }
        // Softmax routing: the top-2 of softmax(x . router).
        let (m, _) = tiny("qwen3_moe", false);
        let (idx, w) = m.route(&x2);
        let (want_w, want_idx) = x2.linear::<&Tensor>(&m.router, None).softmax(-1, Kind::Float).topk(2, -1, true, true);
        assert!(idx.equal(&want_idx) && w.allclose(&want_w, 1e-6, 1e-6, false));
        let (m, w) = tiny("gpt_oss", true);
        check(&m, &w, "gpt-oss");
        let (m, w) = tiny("longcat_flash", true);
        let (idx, _) = m.route(&x2);
        assert!(idx.ge(5).any().int64_value(&[]) == 1, "some token picks a zero-computation expert");
        check(&m, &w, "zero-computation experts");
    }
}
