//! What every family's layers share: HF's RMSNorm, the gated MLP, and the [`Context`] of one
//! forward (RoPE tables, masks, padding, the tensor-parallel group).

use crate::{config::Activation, linear::Linear, tp::TpGroup, weights::Loader};

/// No bias (`Loader::linear`'s).
pub(crate) fn none(_: &mut Loader) -> Result<Option<Tensor>, String> {
    Ok(None)
}
use plugin_api::tch::{Device, Kind, Tensor};

/// HF's RMSNorm (fp32 statistics); libtorch's `rms_norm` is one fused kernel on CUDA.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    x.rms_norm(w.size(), Some(w), eps)
}

/// A gated MLP: down(act(gate(x)) * up(x)), act SiLU (SwiGLU) or Gemma's tanh GELU.
pub struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
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
            gate_proj: ld.linear_selected(
                &format!("{p}.{}.weight", names[0]),
                &[width, hidden],
                &[vec![part.clone()]],
                none,
            )?,
            up_proj: ld.linear_selected(
                &format!("{p}.{}.weight", names[1]),
                &[width, hidden],
                &[vec![part.clone()]],
                none,
            )?,
            down_proj: ld.linear_selected(
                &format!("{p}.{}.weight", names[2]),
                &[hidden, width],
                &[vec![], vec![part]],
                none,
            )?,
            act,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        let gate = self.gate_proj.forward(x);
        let gate = match self.act {
            Activation::Silu => gate.silu(),
            Activation::GeluTanh => gate.gelu("tanh"),
        };
        self.down_proj.forward(&(gate * self.up_proj.forward(x)))
    }
}

/// What every layer of one forward shares: the RoPE tables, the masks by window, padding.
pub(crate) struct Context<'a> {
    pub(crate) eps: f64,
    /// (cos, signed sin) of each of the decoder's RoPEs.
    pub(crate) tables: Vec<(Tensor, Tensor)>,
    /// The mask of full attention (None: causal) and of each window the layers use.
    pub(crate) full: Option<Tensor>,
    pub(crate) windowed: Vec<(i64, Option<Tensor>)>,
    pub(crate) valid: Option<&'a Tensor>,
    pub(crate) rollback: bool,
    /// Where a static cache takes the new keys and values (`decode_graph.rs`).
    pub(crate) static_write: Option<crate::cache::StaticWrite>,
    /// The replica's group (tensor parallelism): row-parallel outputs are summed over it.
    pub(crate) tp: Option<&'a TpGroup>,
}

impl Context<'_> {
    /// A row-parallel output summed over the replica's ranks (as is without one).
    pub(crate) fn reduce(&self, t: Tensor, what: &str) -> Tensor {
        let Some(g) = self.tp else { return t };
        let t = t.contiguous();
        g.all_reduce(&t, what);
        t
    }

    pub(crate) fn mask(&self, window: Option<i64>) -> Option<&Tensor> {
        match window {
            None => self.full.as_ref(),
            Some(w) => self.windowed.iter().find(|(x, _)| *x == w).and_then(|(_, m)| m.as_ref()),
        }
    }
}

/// [1, 1, L, T] bool: query i (the last L of T positions) sees keys up to itself.
pub fn causal_mask(l: i64, t: i64, device: Device) -> Tensor {
    let q = Tensor::arange_start(t - l, t, (Kind::Int64, device)).unsqueeze(1);
    let k = Tensor::arange(t, (Kind::Int64, device)).unsqueeze(0);
    k.le_tensor(&q).view([1, 1, l, t])
}

/// The mask of a `window`-wide sliding layer: `full` (None: causal) and keys within the window
/// (transformers': key j visible to query i when j > i - window, in cache positions); `full`
/// again when every key is within it.
pub(crate) fn window_mask(full: Option<&Tensor>, past: i64, l: i64, window: i64, device: Device) -> Option<Tensor> {
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

/// A named range in a profiler trace (`dflash-host bench train --trace`): where the target's
/// time goes by layer part.
pub(crate) fn range(name: &str) -> kernels::profiler::Range {
    kernels::profiler::range(name)
}
