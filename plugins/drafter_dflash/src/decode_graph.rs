//! Drafting with the context's keys and values in static buffers, each draft recorded once as a
//! CUDA graph and replayed (the target's decoding does the same): one drafter layer's block is a
//! few dozen kernels of a few microseconds each, which the host launches slower than the GPU
//! runs them.
//!
//! A draft's inputs are the new context rows (the features of the tokens accepted since the last
//! draft: 1 to a block's worth in a cycle, the prompt's at the first), the position they start at
//! and the block. The graph of a draft is recorded per number of new rows, at its first call
//! (which runs as usual), and replayed after with the inputs copied in; the position is a tensor
//! on the device, so one graph serves every position. Drafts with more new rows than
//! [`MAX_RECORDED`] (a prompt) run op by op on the same buffers. Full buffers double, and their
//! drafts are recorded again.

use crate::model::DFlashDrafter;
use kernels::cuda_graph::Replays;
use plugin_api::tch::{Kind, Tensor};

/// The most new context rows a recorded draft takes.
pub const MAX_RECORDED: i64 = 16;
/// The buffers' first length, in positions.
const FIRST_CAPACITY: i64 = 1024;

pub struct StaticDrafting {
    /// A (keys, values) pair a layer, [1, Hkv, capacity, D]; made at the first draft.
    buffers: Vec<(Tensor, Tensor)>,
    capacity: i64,
    first_capacity: i64,
    /// Context positions held.
    len: i64,
    /// The drafts recorded, by new rows and block length.
    replays: Replays<(i64, i64)>,
}

impl StaticDrafting {
    /// Buffers for `drafter`, its drafts recorded as CUDA graphs on a CUDA device, or why the
    /// drafter cannot keep them.
    pub fn new(drafter: &DFlashDrafter) -> Result<Self, String> {
        Self::with_capacity(drafter, FIRST_CAPACITY)
    }

    fn with_capacity(drafter: &DFlashDrafter, first_capacity: i64) -> Result<Self, String> {
        drafter.static_support()?;
        let replays = Replays::new("the drafter's block");
        Ok(Self { buffers: Vec::new(), capacity: 0, first_capacity, len: 0, replays })
    }

    /// The block's hidden states [1, Bk, H] after `new_context` [1, n, F] at positions
    /// `start`.. (0: a new sequence).
    pub fn draft(
        &mut self,
        drafter: &DFlashDrafter,
        new_context: &Tensor,
        start: i64,
        block_embeds: &Tensor,
    ) -> Result<Tensor, String> {
        if start == 0 {
            self.len = 0;
        }
        if start != self.len {
            return Err(format!(
                "context_start is {start}, but the drafter holds {} positions of this sequence",
                self.len
            ));
        }
        let (n, bk) = (new_context.size()[1], block_embeds.size()[1]);
        self.reserve(drafter, start + n, block_embeds);
        let start_at = Tensor::full([1], start, (Kind::Int64, block_embeds.device()));
        let buffers = &mut self.buffers;
        let mut call =
            |inputs: &[Tensor]| vec![drafter.decode_block_static(buffers, &inputs[0], &inputs[1], &inputs[2])];
        let mut out = if n <= MAX_RECORDED {
            self.replays.run((n, bk), &[new_context, &start_at, block_embeds], call)?
        } else {
            call(&[new_context.shallow_clone(), start_at, block_embeds.shallow_clone()])
        };
        self.len = start + n;
        Ok(out.pop().expect("one output"))
    }

    /// Buffers for at least `needed` context positions: made, or doubled with the kept keys
    /// copied and the drafts recorded on the old ones dropped.
    fn reserve(&mut self, drafter: &DFlashDrafter, needed: i64, block: &Tensor) {
        if needed <= self.capacity {
            return;
        }
        let grown = (2 * self.capacity).max(self.first_capacity).max((needed + 255) / 256 * 256);
        let mut buffers = drafter.static_buffers(grown, block.kind(), block.device());
        for ((k, v), (k_new, v_new)) in self.buffers.iter().zip(buffers.iter_mut()) {
            k_new.narrow(2, 0, self.capacity).copy_(k);
            v_new.narrow(2, 0, self.capacity).copy_(v);
        }
        self.replays.clear();
        self.buffers = buffers;
        self.capacity = grown;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{model::DecodeCache, DrafterSection};
    use plugin_api::tch::Device;
    use plugin_api::TargetSpec;
    use test_support::TinySpec;

    fn drafter(device: Device, kind: Kind) -> DFlashDrafter {
        let s: DrafterSection = plugin_api::parse_section(
            "num_hidden_layers = 2\nblock_size = 4\nnum_target_features = 2\nmask_token_id = 63\n\
             num_attention_heads = 4\nnum_key_value_heads = 2\nhead_dim = 8",
        )
        .unwrap();
        plugin_api::tch::manual_seed(3);
        crate::model::build(&s.resolve(&TargetSpec::tiny()).unwrap(), device, kind).1
    }

    /// The largest difference between drafting on static buffers (first `capacity` positions)
    /// and on the drafter's own cache, over the drafts of speculative decoding: a prompt's
    /// context, then cycles adding 1 to 4 rows (lengths repeat: replays where graphs record),
    /// then a new sequence.
    fn largest_gap(d: &DFlashDrafter, device: Device, kind: Kind, capacity: i64) -> f64 {
        let _guard = plugin_api::tch::no_grad_guard();
        let mut graphed = StaticDrafting::with_capacity(d, capacity).unwrap();
        let mut plain = DecodeCache::default();
        let width = 2 * d.cfg.hidden_size as i64;
        let h = d.cfg.hidden_size as i64;
        let mut gap = 0f64;
        let mut start = 0;
        for n in [37, 1, 3, 4, 2, 1, 4, 4, 3, 20, 2] {
            if n == 20 {
                start = 0;
            }
            let context = Tensor::randn([1, n, width], (kind, device));
            let block = Tensor::randn([1, 4, h], (kind, device));
            let got = graphed.draft(d, &context, start, &block).unwrap();
            let want = d.decode_block(&mut plain, &context, start, &block).unwrap();
            gap = gap.max((got.to_kind(Kind::Float) - want.to_kind(Kind::Float)).abs().max().double_value(&[]));
            start += n;
        }
        gap
    }

    /// Static buffers draft what the drafter's own cache drafts, through a buffer that grows
    /// (40 positions at first) and a new sequence.
    #[test]
    fn static_buffers_draft_as_the_growing_cache() {
        let d = drafter(Device::Cpu, Kind::Float);
        let gap = largest_gap(&d, Device::Cpu, Kind::Float, 40);
        assert!(gap < 1e-5, "{gap:.2e}");
    }

    /// On a GPU, recorded drafts replay what the drafter's own cache drafts: f32 to rounding,
    /// bf16 within its precision.
    #[test]
    #[ignore = "needs a CUDA device: make gpu-test"]
    fn cuda_recorded_drafts_draft_as_the_growing_cache() {
        let device = kernels::cuda_test_device();
        for (kind, tol) in [(Kind::Float, 1e-4), (Kind::BFloat16, 0.1)] {
            let d = drafter(device, kind);
            let gap = largest_gap(&d, device, kind, 40);
            assert!(gap < tol, "{kind:?}: {gap:.2e}");
        }
    }
}
