//! Anchor sampling: where the drafter's blocks start (the DFlash paper, "Anchors").
//!
//! By default (SpecForge's rule) an anchor is a response token whose next token is one too: the
//! blocks drafted at inference start at a verified reply token, never at the last prompt token
//! (the reply's first token comes from the target's prefill). [`AnchorRule::BeforeResponse`]
//! also takes the last prompt token. Either way every block's first label is trained on. Draws
//! are seeded by (seed, draw index), so a resumed run samples the same anchors.

pub use crate::config::AnchorRule;
use plugin_api::tch::{Device, Kind, Tensor};
use rand::{seq::index::sample, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub struct AnchorSampler {
    pub per_seq: usize,
    pub seed: u64,
    pub rule: AnchorRule,
}

impl AnchorRule {
    /// Whether position `p` of a row with response mask `row` may start a block (p + 1 < len).
    fn allows(self, row: &[i64], p: usize) -> bool {
        row[p + 1] != 0 && (self == AnchorRule::BeforeResponse || row[p] != 0)
    }
}

/// Anchors for one batch: positions [B, A] (int64, ascending per row) and validity [B, A].
pub struct Anchors {
    pub positions: Tensor,
    pub valid: Tensor,
    /// Valid anchors in the batch.
    pub count: usize,
}

impl Anchors {
    /// The same anchors, sharing the tensors' storage.
    pub fn shallow_clone(&self) -> Self {
        Self { positions: self.positions.shallow_clone(), valid: self.valid.shallow_clone(), count: self.count }
    }
}

impl AnchorSampler {
    /// `loss_mask` [B, S] (any integer kind, 1 = response). `draw` numbers this batch.
    pub fn sample(&self, loss_mask: &Tensor, draw: u64) -> Anchors {
        let (b, s) = (loss_mask.size()[0] as usize, loss_mask.size()[1] as usize);
        let mask: Vec<i64> =
            Vec::try_from(loss_mask.to_device(Device::Cpu).to_kind(Kind::Int64).flatten(0, -1)).expect("loss mask");
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ draw);
        let rows: Vec<Vec<i64>> = (0..b)
            .map(|r| {
                let row = &mask[r * s..(r + 1) * s];
                let candidates: Vec<i64> =
                    (0..s.saturating_sub(1)).filter(|&p| self.rule.allows(row, p)).map(|p| p as i64).collect();
                let k = candidates.len().min(self.per_seq);
                let mut picked: Vec<i64> =
                    sample(&mut rng, candidates.len(), k).into_iter().map(|i| candidates[i]).collect();
                picked.sort_unstable();
                picked
            })
            .collect();
        let a = rows.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let mut positions = vec![0i64; b * a];
        let mut valid = vec![false; b * a];
        for (r, picked) in rows.iter().enumerate() {
            for (j, &p) in picked.iter().enumerate() {
                positions[r * a + j] = p;
                valid[r * a + j] = true;
            }
        }
        Anchors {
            positions: Tensor::from_slice(&positions).view([b as i64, a as i64]),
            valid: Tensor::from_slice(&valid).view([b as i64, a as i64]),
            count: rows.iter().map(Vec::len).sum(),
        }
    }
}

/// Block token ids [B, A*Bk]: per anchor `[anchor token, mask x (Bk-1)]`.
pub fn block_token_ids(input_ids: &Tensor, anchors: &Tensor, block_size: i64, mask_token_id: i64) -> Tensor {
    let (b, a) = (anchors.size()[0], anchors.size()[1]);
    let first = input_ids.gather(1, anchors, false).unsqueeze(-1); // [B, A, 1]
    let rest = Tensor::full([b, a, block_size - 1], mask_token_id, (Kind::Int64, input_ids.device()));
    Tensor::cat(&[first, rest], 2).view([b, a * block_size])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SpecForge's rule: the anchor and its next token are response tokens; the last prompt
    /// token is no anchor. Several answers in a row each start after their own prompt.
    #[test]
    fn anchors_are_response_tokens_followed_by_one() {
        // Row 0: response at 3..8 then a user turn at 8..10 and a reply at 10..12; row 1: one reply
        // token at 2 (no anchor: nothing after it is a response), padding.
        let mask = Tensor::from_slice(&[0i64, 0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0])
            .view([2, 12]);
        let sampler = AnchorSampler { per_seq: 100, seed: 3, rule: AnchorRule::Response };
        let a = sampler.sample(&mask, 0);
        let pos: Vec<i64> = Vec::try_from(a.positions.flatten(0, -1)).unwrap();
        let valid: Vec<bool> = Vec::try_from(a.valid.flatten(0, -1)).unwrap();
        let width = a.positions.size()[1] as usize;
        let row0: Vec<i64> = pos[..width].iter().zip(&valid[..width]).filter(|(_, &v)| v).map(|(&p, _)| p).collect();
        assert_eq!(row0, [3, 4, 5, 6, 10]);
        assert!(valid[width..].iter().all(|&v| !v), "row 1 has no anchor");
        assert_eq!(a.count, 5);
        // The older rule also takes the last prompt token before each reply (2 and 9) and the
        // prompt token before row 1's reply.
        let before = AnchorSampler { rule: AnchorRule::BeforeResponse, ..sampler };
        let b = before.sample(&mask, 0);
        assert_eq!(b.count, 5 + 2 + 1);
    }

    #[test]
    fn anchors_precede_response_tokens_and_are_reproducible() {
        // Row 0: response at 3..7; row 1: response at 2..3, then padding.
        let mask = Tensor::from_slice(&[0i64, 0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0]).view([2, 8]);
        let sampler = AnchorSampler { per_seq: 3, seed: 7, rule: AnchorRule::BeforeResponse };
        let a = sampler.sample(&mask, 0);
        let pos: Vec<i64> = Vec::try_from(a.positions.flatten(0, -1)).unwrap();
        let valid: Vec<bool> = Vec::try_from(a.valid.flatten(0, -1)).unwrap();
        assert_eq!(a.positions.size(), vec![2, 3]);
        assert_eq!(a.count, 5);
        assert_eq!(&valid, &[true, true, true, true, true, false]);
        for &p in &pos[..3] {
            assert!((2..=6).contains(&p), "row 0 anchor {p} not followed by a response token");
        }
        let mut row1 = pos[3..5].to_vec();
        row1.sort();
        assert_eq!(row1, vec![1, 2]); // both candidates taken
        let again = sampler.sample(&mask, 0);
        assert!(again.positions.equal(&a.positions));
        // Other draws differ somewhere (row 0 has C(5,3) = 10 choices).
        let differs = (1..20).any(|d| !sampler.sample(&mask, d).positions.equal(&a.positions));
        assert!(differs);
    }

    #[test]
    fn blocks_start_with_the_anchor_token_then_masks() {
        let ids = Tensor::from_slice(&[10i64, 11, 12, 13, 14, 15]).view([1, 6]);
        let anchors = Tensor::from_slice(&[1i64, 4]).view([1, 2]);
        let blocks = block_token_ids(&ids, &anchors, 3, 99);
        assert_eq!(Vec::<i64>::try_from(blocks.flatten(0, -1)).unwrap(), vec![11, 99, 99, 14, 99, 99]);
    }
}
