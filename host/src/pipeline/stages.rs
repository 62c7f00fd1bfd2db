//! The stages before the drafter: batches from the data loader, target workers (one thread per
//! device, or features from the hidden-state cache), and the hand-off into the buffer.

use super::{
    hidden_cache::{CacheTicket, HiddenStateCache},
    scheduler::Worker,
};
use crate::{
    config::RunConfig,
    plugins::handles::{DataHandle, TargetHandle},
};
use anyhow::{bail, Context, Result};
use plugin_api::{
    tch::{Device, Tensor},
    DataPosition, TensorHandle,
};
use std::sync::Arc;

/// A micro-batch with its target features, as the drafter receives it.
pub struct Micro {
    pub input_ids: Tensor,
    pub loss_mask: Tensor,
    pub lengths: Vec<u32>,
    pub sequence_ids: Vec<u64>,
    /// [B, S, n*H] features of the drafter's target layers.
    pub hidden: Tensor,
    /// The data loader's position after this batch: where a resume continues.
    pub position: DataPosition,
    /// The micro-batch's number in data order, across all ranks (numbers its anchor draw).
    pub index: u64,
}

/// A batch from the data loader, before the target has seen it.
pub struct HostBatch {
    pub input_ids: Tensor,
    pub loss_mask: Tensor,
    pub lengths: Vec<u32>,
    pub sequence_ids: Vec<u64>,
    pub position: DataPosition,
    /// The micro-batch's number in data order (set by the producer).
    pub index: u64,
    /// Its plan with the hidden-state cache (set by the producer).
    pub cache_ticket: Option<CacheTicket>,
}

impl HostBatch {
    /// The batch with its target features, for the drafter.
    pub fn with_features(self, hidden: Tensor) -> Micro {
        let Self { input_ids, loss_mask, lengths, sequence_ids, position, index, .. } = self;
        Micro { input_ids, loss_mask, lengths, sequence_ids, hidden, position, index }
    }
}

/// The next batch, across an epoch boundary if need be.
pub fn next_batch(data: &mut DataHandle) -> Result<HostBatch> {
    for _ in 0..2 {
        if let Some(b) = data.next_batch()? {
            let position = data.position()?;
            return Ok(HostBatch {
                input_ids: b.input_ids.into_tensor(),
                loss_mask: b.loss_mask.into_tensor(),
                lengths: b.lengths.into_vec(),
                sequence_ids: b.sequence_ids.into_vec(),
                position,
                index: 0,
                cache_ticket: None,
            });
        }
        // End of epoch: the next call starts the next one.
    }
    bail!("the data loader yields no batches (is the dataset empty after filtering?)")
}

/// Features into the buffer: kept where they are when the drafter shares the device, else copied
/// to CPU memory (pinned when they come from a GPU, so the copy to the drafter's GPU is async).
fn to_buffer(hidden: Tensor, drafter: Device) -> Tensor {
    let from = hidden.device();
    if from == drafter || from == Device::Cpu {
        return hidden;
    }
    let mut host = kernels::autograd::empty_pinned_like(&hidden)
        .unwrap_or_else(|_| Tensor::empty(hidden.size(), (hidden.kind(), Device::Cpu)));
    host.copy_(&hidden);
    host
}

/// One worker per target device: the first target and the extra ones, in `devices` order.
pub fn target_workers<'a>(
    target: &'a mut TargetHandle,
    extra: &'a mut [TargetHandle],
    devices: &[String],
    layer_ids: &[u32],
    cache: &Arc<HiddenStateCache>,
    drafter_device: Device,
) -> Vec<Worker<'a, HostBatch, Micro>> {
    std::iter::once(target)
        .chain(extra.iter_mut())
        .zip(devices)
        .enumerate()
        .map(|(i, (t, d))| target_worker(i, d.clone(), t, layer_ids.to_vec(), Arc::clone(cache), drafter_device))
        .collect()
}

/// Bytes of target features per token: `layers` features of `hidden_size` in the run's dtype.
pub fn feature_bytes_per_token(cfg: &RunConfig, layers: usize, hidden_size: u32) -> usize {
    let elt = if cfg.dtype() == "bf16" { 2 } else { 4 };
    layers * hidden_size as usize * elt
}

/// A target worker: runs its target (or takes cached features) for each batch.
fn target_worker<'a>(
    index: usize,
    device: String,
    target: &'a mut TargetHandle,
    layer_ids: Vec<u32>,
    cache: Arc<HiddenStateCache>,
    drafter_device: Device,
) -> Worker<'a, HostBatch, Micro> {
    Worker {
        name: device.to_string(),
        work: Box::new(move |mut b: HostBatch| {
            let seq_len = b.input_ids.size()[1];
            // Dropped at the end of this job, done or failed: releases what it did not store.
            let ticket = b.cache_ticket.take();
            let cached = ticket.as_ref().and_then(|t| cache.fetch(t, &b.sequence_ids, seq_len, Device::Cpu));
            let hidden = match cached {
                Some(h) => h,
                None => {
                    let ids = TensorHandle::new(b.input_ids.shallow_clone());
                    let out =
                        target.forward(&ids, &layer_ids, false).with_context(|| format!("target worker {index}"))?;
                    let h = out.hidden.into_tensor();
                    if let Some(t) = &ticket {
                        cache.store(t, &b.sequence_ids, &b.lengths, &h);
                    }
                    h
                }
            };
            Ok(b.with_features(to_buffer(hidden, drafter_device)))
        }),
    }
}
