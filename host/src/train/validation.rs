//! The validation split scored during training (`train.eval_every`): the data loader's
//! validation batches, their target features computed once before training (the split is small)
//! and kept in CPU memory, and fixed anchors. Every evaluation, and every run whatever its seed,
//! scores the same blocks with the functions the training metrics use (DFlash loss, per-position
//! accuracy, tau-hat), without gradients.

use super::{
    anchors::{AnchorSampler, Anchors},
    loss::{accuracy, tau_hat, Reduction},
    step::DraftLoss,
};
use crate::{pipeline::components::Components, plugins::handles::DrafterHandle};
use anyhow::{bail, Context, Result};
use plugin_api::{
    tch::{self, Device, Kind, Tensor},
    PluginKind, TensorHandle,
};
use std::time::Instant;

/// Anchor draws of the validation batches: a constant, not the run's seed, so runs with
/// different seeds are scored on the same blocks.
const ANCHOR_SEED: u64 = 0x5A11_DA7E;

struct ValidationBatch {
    input_ids: Tensor,
    loss_mask: Tensor,
    /// [B, S, n*H] target features, in CPU memory.
    hidden: Tensor,
    anchors: Anchors,
}

pub struct ValidationSet {
    batches: Vec<ValidationBatch>,
    sequences: usize,
}

/// One evaluation of the drafter on the validation split.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidationScores {
    /// The token-weighted mean of the DFlash loss over every validation label.
    pub loss: f64,
    /// Top-1 accuracy per block position 1..Bk-1.
    pub acc: Vec<f64>,
    pub tau_hat: f64,
    /// Seconds the evaluation took.
    pub seconds: f64,
}

impl ValidationSet {
    /// The data loader's validation batches (after self-distillation) with the target's features
    /// of `layer_ids` and their anchors. `eval_every` names the setting in the error when the
    /// loader has no validation split.
    pub fn prepare(
        c: &mut Components,
        layer_ids: &[u32],
        sampler_like: &AnchorSampler,
        eval_every: u64,
    ) -> Result<Self> {
        let started = Instant::now();
        let got = c.data.validation_batches()?;
        if got.is_empty() {
            bail!(
                "field `train.eval_every` = {eval_every}: the data plugin `{}` gives no validation batches \
                 (data_chat: set `validation` in [data])",
                c.records.iter().find(|r| r.kind == PluginKind::DataLoader.as_str()).map_or("?", |r| r.name.as_str())
            );
        }
        let sampler = AnchorSampler { per_seq: sampler_like.per_seq, seed: ANCHOR_SEED, rule: sampler_like.rule };
        let mut batches = Vec::with_capacity(got.len());
        let mut sequences = 0;
        for (j, b) in got.into_iter().enumerate() {
            let (input_ids, loss_mask) = (b.input_ids.into_tensor(), b.loss_mask.into_tensor());
            let out = c.target.forward(&TensorHandle::new(input_ids.shallow_clone()), layer_ids, false);
            let hidden = out.context("the validation split")?.hidden.into_tensor().to_device(Device::Cpu);
            let anchors = sampler.sample(&loss_mask, j as u64);
            sequences += b.lengths.len();
            batches.push(ValidationBatch { input_ids, loss_mask, hidden, anchors });
        }
        tracing::info!(
            "validation: {sequences} sequences in {} batches, {} anchors, target features in {:.1} s",
            batches.len(),
            batches.iter().map(|b| b.anchors.count).sum::<usize>(),
            started.elapsed().as_secs_f64()
        );
        Ok(Self { batches, sequences })
    }

    pub fn sequences(&self) -> usize {
        self.sequences
    }

    /// The drafter's loss, per-position accuracy and tau-hat over every validation label, without
    /// gradients (one wait for the device, at the end).
    pub fn score(&self, draft: &DraftLoss, drafter: &mut DrafterHandle) -> Result<ValidationScores> {
        let started = Instant::now();
        let _no_grad = tch::no_grad_guard();
        let device = draft.embedding.device();
        let mut loss_sum = Tensor::zeros([], (Kind::Float, device));
        let mut weight_sum = Tensor::zeros([], (Kind::Float, device));
        let mut counts = Tensor::zeros([2, draft.block_size - 1], (Kind::Int64, device));
        for b in &self.batches {
            let d = draft.compute_with(
                drafter,
                &b.input_ids,
                &b.loss_mask,
                &b.hidden,
                b.anchors.shallow_clone(),
                Reduction::Sum,
            )?;
            loss_sum += d.loss.loss.detach();
            weight_sum += &d.loss.weight_sum;
            counts += &d.loss.counts;
        }
        let (loss, weight) = (loss_sum.double_value(&[]), weight_sum.double_value(&[]));
        let counts = counts.to_device(Device::Cpu);
        let row = |i: i64| Vec::<i64>::try_from(counts.get(i)).expect("validation counts");
        let acc = accuracy(&row(0), &row(1));
        // No label at all (a split of prompts only) has no loss: NaN, written as null.
        let loss = if weight > 0.0 { loss / weight } else { f64::NAN };
        Ok(ValidationScores { loss, tau_hat: tau_hat(&acc), acc, seconds: started.elapsed().as_secs_f64() })
    }
}
