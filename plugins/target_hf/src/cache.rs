//! The incremental-decoding cache: a slot per token mixer (LongCat-Flash's layers have two),
//! keys and values for an attention layer (latent attention's too), the conv rows and the
//! recurrent state for a Gated DeltaNet layer, the conv rows for an LFM2 short-conv layer.
//! Sliding-window layers keep every key: the window is the mask's, so a cut cache stays exact.
//!
//! Speculative decoding extends the cache by a drafted block and then drops the rejected tail
//! (`cache_truncate`). Keys and values are cut; a recurrent state cannot be, so with `rollback`
//! each Gated DeltaNet slot also keeps, for the last extension only, the state and conv rows it
//! started from and that extension's inputs to the recurrence (pre-conv rows, decay and write
//! gates): the state after any prefix of it is then recomputed exactly
//! (`GatedDeltaNet::rewind`). A short conv keeps the rows it started from and the extension's
//! conv inputs, from which any prefix's last rows are read. Cost: those inputs for one
//! extension, dropped at the next.

use crate::config::Mixer;
use plugin_api::tch::Tensor;

/// Where a static cache's buffers take the new keys and values: every row's positions [L] (int64,
/// on the device), and the buffers' length (the keys attention then sees, masked by position).
pub struct StaticWrite {
    pub positions: Tensor,
    pub capacity: i64,
}

/// A Gated DeltaNet layer's decoding state.
pub struct LinearState {
    /// The last K-1 pre-conv rows (the conv's history): [B, K-1, C], the model's dtype.
    pub conv: Tensor,
    /// The recurrent state [B, nv, dk, dv], fp32.
    pub state: Tensor,
    /// What the last extension started from and consumed (rollback caches only).
    pub undo: Option<Undo>,
}

pub struct Undo {
    pub conv: Tensor,
    /// None when the extension started from a zero state (the sequence's start).
    pub state: Option<Tensor>,
    /// The extension's pre-conv q|k|v rows [B, L, C].
    pub mixed: Tensor,
    /// Its log decays and write strengths [B, nv, L], fp32.
    pub g: Tensor,
    pub beta: Tensor,
}

/// A short-conv layer's decoding state.
pub struct ConvState {
    /// The last K-1 conv inputs [B, K-1, C].
    pub rows: Tensor,
    /// The rows the last extension started from and its inputs [B, L, C] (rollback caches only).
    pub undo: Option<(Tensor, Tensor)>,
}

pub enum Slot {
    Kv(Option<(Tensor, Tensor)>),
    Linear(Option<LinearState>),
    Conv(Option<ConvState>),
}

pub struct Cache {
    pub slots: Vec<Slot>,
    /// Keep what a rollback into the last extension needs.
    pub rollback: bool,
    /// A static cache's buffer length: keys and values sit in buffers of this many positions,
    /// written in place (`attention::append`), so a rollback only moves `len` (`decode_graph.rs`).
    pub capacity: Option<i64>,
    len: i64,
    last_start: i64,
}

impl Cache {
    /// A slot per token mixer, in the order the decoder runs them.
    pub fn new(mixers: &[Mixer], rollback: bool) -> Self {
        let slots = mixers
            .iter()
            .map(|m| match m {
                Mixer::Attention | Mixer::Mla => Slot::Kv(None),
                Mixer::Linear => Slot::Linear(None),
                Mixer::ShortConv => Slot::Conv(None),
            })
            .collect();
        Self { slots, rollback, capacity: None, len: 0, last_start: 0 }
    }

    /// Positions cached (the padded length for a batch).
    pub fn len(&self) -> i64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where the last extension began.
    pub fn last_extension_start(&self) -> i64 {
        self.last_start
    }

    /// Called by the decoder after running `l` new positions through every layer.
    pub(crate) fn extended(&mut self, l: i64) {
        self.last_start = self.len;
        self.len += l;
    }

    pub(crate) fn set_len(&mut self, len: i64) {
        self.len = len;
    }
}

/// The last K-1 rows of `history` [B, K-1, C] followed by `x` [B, L, C]: a causal conv's state
/// after `x`.
pub fn conv_tail(history: &Tensor, x: &Tensor) -> Tensor {
    let (l, k1) = (x.size()[1], history.size()[1]);
    let rows = Tensor::cat(&[history, &x.narrow(1, (l - k1).max(0), l.min(k1))], 1);
    rows.narrow(1, rows.size()[1] - k1, k1).contiguous()
}

/// Slots as `(k, v)` pairs, for code that matches on a slot its layer owns.
pub(crate) fn kv(slot: &mut Slot) -> &mut Option<(Tensor, Tensor)> {
    match slot {
        Slot::Kv(kv) => kv,
        _ => unreachable!("a cache slot follows its layer's kind"),
    }
}
