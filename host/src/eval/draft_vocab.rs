//! A reduced draft vocabulary for `eval --draft-vocab K`: the K tokens the drafter is trained to
//! predict most often (the training split's loss-masked tokens, self-distilled replies where the
//! config distils), as EAGLE-3 picks its draft vocabulary. Drafting over those rows of the LM head
//! makes the drafter's head cost K / V of the whole one, which on a CPU is most of a draft; the
//! target still verifies against its whole vocabulary, so the output is unchanged, and a token
//! outside the K is only never drafted. The exported drafter is not affected.

use crate::{environment, pipeline::components::Components, pipeline::distill};
use anyhow::{bail, Result};
use plugin_api::tch::{Device, Kind, Tensor};

/// The draft vocabulary: token ids [K] (int64, most frequent first) and the share of the training
/// split's predicted tokens they cover.
pub struct DraftVocab {
    pub ids: Tensor,
    pub coverage: f64,
}

/// The `k` most frequent predicted tokens of one epoch of the training split, of a vocabulary of
/// `vocab`. Opens the data as training does (replies from the self-distillation cache).
pub fn most_frequent(c: &mut Components, k: usize, vocab: usize) -> Result<DraftVocab> {
    if k > vocab {
        bail!("--draft-vocab {k}: more than the target's vocabulary ({vocab} tokens)");
    }
    distill::prepare_data(c, &environment::cache_dir())?;
    let counts = predicted_token_counts(c, vocab)?;
    let total = counts.sum(Kind::Int64).int64_value(&[]);
    if total == 0 {
        bail!("--draft-vocab {k}: the training split has no predicted tokens to count");
    }
    let (top, ids) = counts.topk(k as i64, 0, true, true);
    let coverage = top.sum(Kind::Int64).int64_value(&[]) as f64 / total as f64;
    Ok(DraftVocab { ids, coverage })
}

/// How often each token id is a predicted (loss-masked) token over one epoch of training batches.
fn predicted_token_counts(c: &mut Components, vocab: usize) -> Result<Tensor> {
    let epoch = c.data.position()?.epoch;
    let mut counts = Tensor::zeros([vocab as i64], (Kind::Int64, Device::Cpu));
    while let Some(b) = c.data.next_batch()? {
        let (ids, mask) = (b.input_ids.into_tensor(), b.loss_mask.into_tensor());
        // An id past the LM head (none from the target's own tokenizer) could never be drafted.
        let predicted = ids.masked_select(&mask.ne(0));
        counts += predicted.bincount(None::<Tensor>, vocab as i64).narrow(0, 0, vocab as i64);
        if c.data.position()?.epoch != epoch {
            break;
        }
    }
    Ok(counts)
}
