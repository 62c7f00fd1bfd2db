//! The incremental-decoding cache: a slot per layer, keys and values for an attention layer, the
//! conv rows and the recurrent state for a Gated DeltaNet layer.
//!
//! Speculative decoding extends the cache by a drafted block and then drops the rejected tail
//! (`cache_truncate`). Keys and values are cut; a recurrent state cannot be, so with `rollback`
//! each Gated DeltaNet slot also keeps, for the last extension only, the state and conv rows it
//! started from and that extension's inputs to the recurrence (pre-conv rows, decay and write
//! gates): the state after any prefix of it is then recomputed exactly
//! (`GatedDeltaNet::rewind`). Cost: those inputs for one extension, dropped at the next.

use crate::config::Mixer;
use plugin_api::tch::Tensor;

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

pub enum Slot {
    Kv(Option<(Tensor, Tensor)>),
    Linear(Option<LinearState>),
}

pub struct Cache {
    pub slots: Vec<Slot>,
    /// Keep what a rollback into the last extension needs.
    pub rollback: bool,
    len: i64,
    last_start: i64,
}

impl Cache {
    pub fn new(mixers: &[Mixer], rollback: bool) -> Self {
        let slots = mixers
            .iter()
            .map(|m| match m {
                Mixer::Attention => Slot::Kv(None),
                Mixer::Linear => Slot::Linear(None),
            })
            .collect();
        Self { slots, rollback, len: 0, last_start: 0 }
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
