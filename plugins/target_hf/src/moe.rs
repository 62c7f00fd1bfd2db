//! The sparse MLP of qwen3_moe and qwen3_5_moe (`model.layers.{i}.mlp`): a router picks the
//! top-k experts of each token, each a SwiGLU MLP; Qwen3.5-MoE adds a shared expert whose output
//! is scaled by sigmoid(x . shared_expert_gate).
//!
//! Dispatch as grouped GEMMs, no loop over experts: the T*k (token, expert) pairs are sorted by
//! expert, their rows gathered once, and each projection is one `_grouped_mm` over the experts'
//! stacked weights with the per-expert row offsets (libtorch 2.11: CUTLASS grouped GEMM for
//! bf16 on sm90; elsewhere its own per-group fallback). The offsets come from a `searchsorted`
//! on the device, so routing never waits for the host. The results go back to (token, slot)
//! order and are summed over the k slots with their router weights.
//!
//! Weights: `gate.weight` [E, H] (router); experts either fused as transformers holds them in
//! memory (`experts.gate_up_proj` [E, 2I, H], gate rows first; `experts.down_proj` [E, H, I]) or
//! per expert as checkpoints store them (`experts.{e}.{gate,up,down}_proj.weight`);
//! `shared_expert.{gate,up,down}_proj.weight`, `shared_expert_gate.weight` [1, H].

use crate::{
    config::DecoderConfig,
    model::{Loader, Mlp},
};
use plugin_api::tch::{Kind, Tensor};

pub struct SparseMoe {
    router: Tensor,
    /// [E, 2I', H']: gate rows then up rows, per expert (I', H' padded, see `ALIGN`).
    gate_up: Tensor,
    /// [E, H', I'].
    down: Tensor,
    top_k: i64,
    norm_topk: bool,
    /// I' and H'.
    intermediate: i64,
    hidden: i64,
    shared: Option<(Mlp, Tensor)>,
}

/// `_grouped_mm` wants every row stride a multiple of 16 bytes: expert widths and the hidden size
/// are zero-padded to a multiple of 8 elements at load (silu(0) * 0 = 0 and zero down-projection
/// columns add nothing, so the result is exact). Real models need no padding.
const ALIGN: i64 = 8;

fn pad_to(n: i64) -> i64 {
    (n + ALIGN - 1) / ALIGN * ALIGN
}

impl SparseMoe {
    pub(crate) fn load(cfg: &DecoderConfig, ld: &mut Loader, p: &str) -> Result<Self, String> {
        let m = cfg.moe().ok_or_else(|| format!("{p}: a sparse layer in a model without experts"))?;
        let (h, e, i) = (cfg.hidden_size as i64, m.experts as i64, m.intermediate as i64);
        let router = ld.get(&format!("{p}.gate.weight"), &[e, h])?;
        let fused = format!("{p}.experts.gate_up_proj");
        let (gate_up, down) = if ld.w.contains(&fused) {
            (ld.get(&fused, &[e, 2 * i, h])?, ld.get(&format!("{p}.experts.down_proj"), &[e, h, i])?)
        } else {
            let (mut gate_up, mut down) = (Vec::with_capacity(e as usize), Vec::with_capacity(e as usize));
            for x in 0..e {
                let q = format!("{p}.experts.{x}");
                let gate = ld.get(&format!("{q}.gate_proj.weight"), &[i, h])?;
                let up = ld.get(&format!("{q}.up_proj.weight"), &[i, h])?;
                gate_up.push(Tensor::cat(&[gate, up], 0));
                down.push(ld.get(&format!("{q}.down_proj.weight"), &[h, i])?);
            }
            (Tensor::stack(&gate_up, 0), Tensor::stack(&down, 0))
        };
        // Pad: gate and up each [E, I, H] -> [E, I', H'], down [E, H, I] -> [E, H', I'].
        let (ip, hp) = (pad_to(i), pad_to(h));
        let (gate_up, down) = if (ip, hp) == (i, h) {
            (gate_up, down)
        } else {
            let pad =
                |t: Tensor, rows: i64, cols: i64| t.constant_pad_nd([0, cols - t.size()[2], 0, rows - t.size()[1]]);
            let (gate, up) = (gate_up.narrow(1, 0, i), gate_up.narrow(1, i, i));
            (Tensor::cat(&[pad(gate, ip, hp), pad(up, ip, hp)], 1), pad(down, hp, ip))
        };
        let shared = match m.shared_intermediate {
            Some(width) => Some((
                Mlp::load(ld, &format!("{p}.shared_expert"), h, width as i64)?,
                ld.get(&format!("{p}.shared_expert_gate.weight"), &[1, h])?,
            )),
            None => None,
        };
        Ok(Self {
            router,
            gate_up,
            down,
            top_k: m.top_k as i64,
            norm_topk: m.norm_topk,
            intermediate: ip,
            hidden: hp,
            shared,
        })
    }

    /// x [B, L, H] -> [B, L, H].
    pub fn forward(&self, x: &Tensor) -> Tensor {
        let size = x.size();
        let h = size[2];
        let x = x.reshape([-1, h]);
        let (t, k, i) = (x.size()[0], self.top_k, self.intermediate);
        // 1. Route (transformers): softmax over the experts in fp32, top-k, renormalised to sum 1
        //    where the family does, then in the model's dtype.
        let probs = x.linear::<&Tensor>(&self.router, None).softmax(-1, Kind::Float);
        let (mut weights, experts) = probs.topk(k, -1, true, true); // [T, k]
        if self.norm_topk {
            weights = &weights / weights.sum_dim_intlist(-1, true, Kind::Float);
        }
        let weights = weights.to_kind(x.kind());
        // 2. Sort the T*k pairs by expert; expert e's rows end at offs[e].
        let (sorted, order) = experts.view([-1]).sort_stable(true, 0, false);
        let n_experts = self.gate_up.size()[0];
        let bounds = Tensor::arange(n_experts, (Kind::Int64, x.device()));
        let offs = bounds.searchsorted::<&Tensor>(&sorted, true, true, "right", None); // int32 [E]
        let mut rows = x.index_select(0, &order.divide_scalar_mode(k, "floor"));
        if self.hidden != h {
            rows = rows.constant_pad_nd([0, self.hidden - h]);
        }
        // 3. The experts' SwiGLU as two grouped GEMMs.
        let gate_up = rows.internal_grouped_mm(&self.gate_up.transpose(1, 2), Some(&offs), None, None::<Kind>);
        let act = gate_up.narrow(1, 0, i).silu() * gate_up.narrow(1, i, i);
        let mut y = act.internal_grouped_mm(&self.down.transpose(1, 2), Some(&offs), None, None::<Kind>); // [T*k, H']
        if self.hidden != h {
            y = y.narrow(1, 0, h);
        }
        // 4. Back to (token, slot) order, weighted, summed over the slots.
        let slots = Tensor::arange(t * k, (Kind::Int64, x.device()));
        let inverse = order.zeros_like().index_copy(0, &order, &slots);
        let y = y.index_select(0, &inverse).view([t, k, h]);
        let mut out = (y * weights.unsqueeze(-1)).sum_dim_intlist(1, false, x.kind());
        // 5. The shared expert, gated.
        if let Some((mlp, gate)) = &self.shared {
            out = out + x.linear::<&Tensor>(gate, None).sigmoid() * mlp.forward(&x);
        }
        out.view(size.as_slice())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Weights;
    use plugin_api::tch::Device;
    use std::collections::HashMap;

    /// transformers' loop over experts (index_add of each expert's weighted output), written out
    /// over the unpadded weights: `gate_up` [E, 2I, H], `down` [E, H, I].
    fn reference(x: &Tensor, m: &SparseMoe, gate_up: &Tensor, down: &Tensor) -> Tensor {
        let probs = x.linear::<&Tensor>(&m.router, None).softmax(-1, Kind::Float);
        let (mut w, idx) = probs.topk(m.top_k, -1, true, true);
        if m.norm_topk {
            w = &w / w.sum_dim_intlist(-1, true, Kind::Float);
        }
        let out = x.zeros_like();
        let i = down.size()[2];
        for t in 0..x.size()[0] {
            for s in 0..m.top_k {
                let e = idx.int64_value(&[t, s]);
                let gu = x.get(t).matmul(&gate_up.get(e).tr());
                let y = (gu.narrow(0, 0, i).silu() * gu.narrow(0, i, i)).matmul(&down.get(e).tr());
                let _ = out.get(t).g_add_(&(y * w.double_value(&[t, s])));
            }
        }
        out
    }

    /// A sparse block with expert width 6 (padded to 8 inside) and its unpadded expert weights.
    fn tiny(fused: bool, shared: bool) -> (SparseMoe, Tensor, Tensor) {
        let (e, h, i) = (5i64, 8i64, 6i64);
        plugin_api::tch::manual_seed(3);
        let mut t = HashMap::new();
        let r = |s: &[i64]| Tensor::randn(s, (Kind::Float, Device::Cpu)) * 0.5;
        t.insert("mlp.gate.weight".to_string(), r(&[e, h]));
        let (gate_up, down) = (r(&[e, 2 * i, h]), r(&[e, h, i]));
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
        if shared {
            for (n, s) in [("gate_proj", [4, h]), ("up_proj", [4, h]), ("down_proj", [h, 4])] {
                t.insert(format!("mlp.shared_expert.{n}.weight"), r(&s));
            }
            t.insert("mlp.shared_expert_gate.weight".into(), r(&[1, h]));
        }
        let cfg: DecoderConfig = serde_json::from_value(serde_json::json!({
            "model_type": if shared { "qwen3_5_moe" } else { "qwen3_moe" }, "hidden_size": h, "num_hidden_layers": 1,
            "num_attention_heads": 1, "vocab_size": 4, "num_experts": e, "num_experts_per_tok": 2,
            "moe_intermediate_size": i, "shared_expert_intermediate_size": 4, "norm_topk_prob": false,
        }))
        .unwrap();
        let mut w = Weights { tensors: t, source: "tiny".into() };
        let mut ld = Loader { w: &mut w, device: Device::Cpu, kind: Kind::Float };
        (SparseMoe::load(&cfg, &mut ld, "mlp").unwrap(), gate_up, down)
    }

    /// The grouped dispatch equals transformers' per-expert loop, with and without
    /// renormalised weights, from per-expert and fused weights (expert width 6, padded to 8).
    #[test]
    fn grouped_dispatch_equals_the_loop_over_experts() {
        let x = Tensor::randn([2, 7, 8], (Kind::Float, Device::Cpu));
        let x2 = x.view([-1, 8]);
        for fused in [false, true] {
            let (mut m, gate_up, down) = tiny(fused, false);
            for norm in [false, true] {
                m.norm_topk = norm;
                let want = reference(&x2, &m, &gate_up, &down).view([2, 7, 8]);
                let got = m.forward(&x);
                let err = (&got - &want).abs().max().double_value(&[]);
                assert!(err < 1e-5, "fused {fused} norm {norm}: max |diff| {err:.2e}");
            }
        }
        // The shared expert adds sigmoid(x . gate) * mlp(x) on top.
        let (m, gate_up, down) = tiny(false, true);
        let (mlp, gate) = m.shared.as_ref().unwrap();
        let want = reference(&x2, &m, &gate_up, &down) + x2.linear::<&Tensor>(gate, None).sigmoid() * mlp.forward(&x2);
        let err = (m.forward(&x).view([-1, 8]) - want).abs().max().double_value(&[]);
        assert!(err < 1e-5, "shared: max |diff| {err:.2e}");
    }
}
