//! What the training loop is assembled from, in the order it is built: where the features come
//! from (data through the target, or a capture), the drafter's side (its loss, parameters,
//! optimizer and validation split), the state a resume starts from, and the pipeline's producer.

use crate::{
    config::RunConfig,
    dist::Communicator,
    pipeline::{
        capture::CaptureReader,
        components::Components,
        distill,
        hidden_cache::HiddenStateCache,
        stages::{next_batch, HostBatch},
        Job,
    },
    plugins::handles::DataHandle,
    train::{
        anchors::AnchorSampler,
        loss::resolve_gamma,
        state::{DistillSummary, ResumeFrom, TrainerState},
        step::{trainable_parameters, DraftLoss},
        validation::ValidationSet,
    },
};
use anyhow::{bail, Result};
use plugin_api::{tch::Tensor, DataPosition};
use std::{path::Path, sync::Arc};

/// Where the target features come from: the data loader through the target workers (after
/// self-distillation where the data asks for it), or a capture's files.
pub(super) struct FeatureSource {
    pub capture: Option<CaptureReader>,
    pub distilled: Option<DistillSummary>,
}

impl FeatureSource {
    pub fn open(cfg: &RunConfig, c: &mut Components, cache_dir: &Path) -> Result<Self> {
        if let Some(dir) = &cfg.pipeline.capture {
            return Ok(Self {
                capture: Some(CaptureReader::open(Path::new(dir), &c.target.spec()?)?),
                distilled: None,
            });
        }
        let distilled = distill::prepare_data(c, cache_dir)?.map(|d| DistillSummary {
            replies: d.replies,
            cached: d.cached,
            seconds: d.seconds,
        });
        Ok(Self { capture: None, distilled })
    }
}

/// The drafter's side, before the loop: its loss (the target's frozen LM head and embedding on
/// the drafter's device), trainable parameters (every replica starting from rank 0's), the
/// optimizer initialised on them, and the validation split's features.
pub(super) struct DrafterSide {
    pub draft: DraftLoss,
    pub params: Vec<Tensor>,
    pub layer_ids: Vec<u32>,
    pub validation: Option<ValidationSet>,
}

impl DrafterSide {
    pub fn assemble(
        cfg: &RunConfig,
        c: &mut Components,
        comm: &mut Option<Box<dyn Communicator>>,
        capture: Option<&CaptureReader>,
    ) -> Result<Self> {
        let t = &cfg.train;
        let drafter_device = crate::config::parse_device(cfg.drafter_device())?;
        let layer_ids: Vec<u32> = c.drafter.target_layer_ids()?;
        if let Some(cap) = capture {
            cap.check_layers(&layer_ids)?;
        }
        let draft = DraftLoss::for_drafter(
            &c.drafter,
            &c.target,
            drafter_device,
            AnchorSampler { per_seq: t.anchors_per_seq, seed: cfg.seed, rule: t.anchors },
            resolve_gamma(t.loss_gamma, c.drafter.block_size()? as usize),
            t.loss_normalization,
        )?;
        let (named, params) = trainable_parameters(&c.drafter)?;
        let n_params: i64 = params.iter().map(|p| p.numel() as i64).sum();
        tracing::info!(
            "drafter: {:.1}M trainable parameters, block {}, target layers {layer_ids:?}, mask token {}, gamma {}, \
             loss_normalization {}, anchors {}",
            n_params as f64 / 1e6,
            draft.block_size,
            draft.mask_token_id,
            draft.gamma.map_or("none".to_string(), |g| g.to_string()),
            t.loss_normalization,
            t.anchors,
        );
        // Replicas: every rank starts from rank 0's weights; the optimizer may split its work.
        if let Some(comm) = comm.as_deref_mut() {
            comm.broadcast(&params, 0)?;
            c.optimizer.set_collectives(comm.collectives())?;
        }
        c.optimizer.init(named)?;
        // The validation split's target features, once, before the target moves to its worker.
        // Every rank scores it alike (same weights, same batches); rank 0 writes the scores.
        let validation = match t.eval_every {
            0 => None,
            n => Some(ValidationSet::prepare(c, &layer_ids, &draft.sampler, n)?),
        };
        Ok(Self { draft, params, layer_ids, validation })
    }
}

/// The state the loop starts from: a checkpoint's weights, optimizer state (none: a fork that
/// starts its optimizer afresh), counters and data position, or step 0. Returns it with the
/// checkpoint it came from.
pub(super) fn resume(
    cfg: &RunConfig,
    c: &mut Components,
    from: Option<ResumeFrom>,
    from_capture: bool,
    block_size: i64,
) -> Result<(TrainerState, Option<String>)> {
    let (state, checkpoint) = match from {
        None => (TrainerState::new(cfg.seed, block_size), None),
        Some(r) => {
            c.drafter.load_weights(r.weights.into())?;
            if !r.optimizer_state.is_empty() {
                c.optimizer.load_state(r.optimizer_state.into())?;
            }
            if !from_capture {
                let pos = DataPosition { epoch: r.state.data_epoch, index: r.state.data_index };
                c.data.seek(pos)?;
            }
            tracing::info!("resuming from {} (step {}, {} target tokens)", r.checkpoint, r.state.step, r.state.tokens);
            (r.state, Some(r.checkpoint))
        }
    };
    if state.step >= cfg.train.steps {
        bail!("nothing to do: the run is at step {} of {}", state.step, cfg.train.steps);
    }
    Ok((state, checkpoint))
}

/// Which micro-batches the producer hands out: `total` from draw `first`, this replica's share
/// (`rank` of `world`).
pub(super) struct Draws {
    pub first: u64,
    pub total: u64,
    pub rank: u64,
    pub world: u64,
}

/// The pipeline's producer: the data loader's batches (each planned with the hidden-state cache),
/// or the capture's, numbered in data order. With R replicas, each reads every batch and keeps
/// its share: batch `rank` of each group of R, tagged with the position after the whole group
/// (where every rank resumes).
pub(super) fn producer<'a>(
    data: &'a mut DataHandle,
    capture: Option<&'a CaptureReader>,
    cache: Arc<HiddenStateCache>,
    feature_bytes_per_token: usize,
    d: Draws,
) -> impl FnMut() -> Result<Option<Job<HostBatch>>> + Send + 'a {
    let mut produced = 0u64;
    move || {
        if produced == d.total {
            return Ok(None);
        }
        let index = d.first + produced * d.world + d.rank;
        let mut b = match capture {
            Some(cap) => cap.batch(index)?,
            None => {
                let mut mine = None;
                for r in 0..d.world {
                    let b = next_batch(data)?;
                    if r == d.rank {
                        mine = Some(b);
                    } else if let Some(m) = mine.as_mut() {
                        m.position = b.position;
                    }
                }
                mine.expect("rank < world")
            }
        };
        b.index = index;
        if capture.is_none() {
            b.cache_ticket = Some(cache.plan(&b.sequence_ids, &b.lengths));
        }
        produced += 1;
        let bytes = b.input_ids.numel() * feature_bytes_per_token;
        Ok(Some(Job { payload: b, bytes }))
    }
}
