//! One micro-batch through the drafter (anchors -> blocks -> drafter -> loss -> backward) and
//! what the step does once its micro-batches are in (the gradients normalised, all-reduce of
//! what it counted, clipping).
//!
//! Normalisation ([`LossNormalization`]): "global" (SpecForge's) backpropagates each
//! micro-batch's weighted cross-entropy *sum* and, once the step's K micro-batches on all W
//! ranks are in, divides the gradients by the weight sum of them all: the gradient of one
//! token-weighted mean per step. "per_micro_batch" backpropagates each micro-batch's own mean
//! scaled by 1/K and averages over ranks.

pub use super::loss::Reduction;
use super::{
    anchors::{block_token_ids, AnchorSampler, Anchors},
    loss::{dflash_loss, LossInput, LossOut},
};
pub use crate::config::LossNormalization;
use crate::{
    dist::Communicator,
    plugins::handles::{DrafterHandle, TargetHandle},
};
use anyhow::Result;
use kernels::autograd::to_device_async;
use plugin_api::{
    abi_stable::std_types::RVec,
    tch::{self, Kind, Tensor},
    DraftInput, NamedTensor, TensorHandle,
};

/// The drafter's trainable parameters: the named list the optimizer is initialised with, and
/// handles sharing their storage for the step's gradient work.
pub fn trainable_parameters(drafter: &DrafterHandle) -> Result<(RVec<NamedTensor>, Vec<Tensor>)> {
    let named = drafter.parameters()?;
    let params = named.iter().map(|nt| nt.tensor.tensor()).collect();
    Ok((named, params))
}

/// The drafter's side of one micro-batch (shared by training and `bench train`): anchors drawn,
/// blocks `[anchor, MASK x (Bk-1)]` embedded with the target's embedding, the drafter forward and
/// the DFlash loss through the target's LM head. The caller runs [`Drafted::backward`].
pub struct DraftLoss {
    /// The target's frozen embedding and LM head, on the drafter's device.
    pub embedding: Tensor,
    pub lm_head: Tensor,
    pub sampler: AnchorSampler,
    pub block_size: i64,
    pub mask_token_id: i64,
    /// The loss's decay (None: none).
    pub gamma: Option<f64>,
    pub normalization: LossNormalization,
}

impl DraftLoss {
    /// The loss for `drafter`'s blocks (its block size and mask token) through `target`'s frozen
    /// LM head and embedding, moved to the drafter's `device`.
    pub fn for_drafter(
        drafter: &DrafterHandle,
        target: &TargetHandle,
        device: tch::Device,
        sampler: AnchorSampler,
        gamma: Option<f64>,
        normalization: LossNormalization,
    ) -> Result<Self> {
        Ok(DraftLoss {
            lm_head: target.lm_head()?.to_device(device),
            embedding: target.embedding()?.to_device(device),
            sampler,
            block_size: drafter.block_size()? as i64,
            mask_token_id: drafter.mask_token_id()? as i64,
            gamma,
            normalization,
        })
    }

    /// `hidden` [B, S, n*H] target features of `input_ids`; `draw` numbers the anchor draw.
    pub fn compute(
        &self,
        drafter: &mut DrafterHandle,
        input_ids: &Tensor,
        loss_mask: &Tensor,
        hidden: &Tensor,
        draw: u64,
    ) -> Result<Drafted> {
        let anchors = self.sampler.sample(loss_mask, draw);
        self.compute_with(drafter, input_ids, loss_mask, hidden, anchors, self.reduction())
    }

    /// [`compute`](Self::compute) at given anchors, the loss reduced as `reduction` says (the
    /// validation split: fixed anchors, sums over the whole split).
    pub fn compute_with(
        &self,
        drafter: &mut DrafterHandle,
        input_ids: &Tensor,
        loss_mask: &Tensor,
        hidden: &Tensor,
        anchors: Anchors,
        reduction: Reduction,
    ) -> Result<Drafted> {
        let device = self.embedding.device();
        let anchor_pos = to_device_async(&anchors.positions, device);
        let block_ids =
            block_token_ids(&to_device_async(input_ids, device), &anchor_pos, self.block_size, self.mask_token_id);
        let block_embeds = tch::no_grad(|| Tensor::embedding(&self.embedding, &block_ids, -1, false, false));
        let input = DraftInput {
            target_hidden: TensorHandle::new(to_device_async(hidden, device).to_kind(self.embedding.kind())),
            block_embeds: TensorHandle::new(block_embeds),
            anchors: TensorHandle::new(anchor_pos.shallow_clone()),
            anchor_valid: TensorHandle::new(to_device_async(&anchors.valid, device)),
        };
        drafter.anchors_on_host(&TensorHandle::new(anchors.positions.shallow_clone()))?;
        let block_hidden = drafter.forward(&input)?;
        // The loss's labels and masks from the host's copies: no wait for the GPU (loss.rs).
        let loss = dflash_loss(&LossInput {
            block_hidden: &block_hidden,
            lm_head: &self.lm_head,
            input_ids,
            loss_mask,
            anchors: &anchors.positions,
            anchor_valid: &anchors.valid,
            block_size: self.block_size,
            gamma: self.gamma,
            reduction,
        });
        Ok(Drafted { loss, anchors, output: block_hidden })
    }

    /// What each micro-batch's loss is: a sum (global normalisation) or its own mean.
    pub fn reduction(&self) -> Reduction {
        match self.normalization {
            LossNormalization::Global => Reduction::Sum,
            LossNormalization::PerMicroBatch => Reduction::Mean,
        }
    }

    /// The factor each micro-batch's loss is backpropagated with, K micro-batches a step.
    pub fn backward_scale(&self, grad_accum: u64) -> f64 {
        match self.normalization {
            LossNormalization::Global => 1.0,
            LossNormalization::PerMicroBatch => 1.0 / grad_accum as f64,
        }
    }
}

/// The smallest weight sum a step divides by: a step without labels has zero gradients and loss.
const MIN_WEIGHT_SUM: f64 = 1e-12;

/// The step's gradients made those of its loss, once its micro-batches are in (`weight_sum`: the
/// local micro-batches' weight sum, a scalar on the device). Global: divided by the weight sum
/// over all micro-batches and ranks (on one rank without waiting for the GPU; with ranks, the
/// mean [`crate::dist::average_gradients`] takes times W over it). Per micro-batch: averaged
/// over ranks. Returns the global weight sum where it was fetched.
pub fn normalize_gradients(
    comm: Option<&mut Box<dyn Communicator>>,
    params: &[Tensor],
    normalization: LossNormalization,
    weight_sum: &Tensor,
) -> Result<Option<f64>> {
    match (normalization, comm.map(|c| &mut **c)) {
        (LossNormalization::PerMicroBatch, None) => Ok(None),
        (LossNormalization::PerMicroBatch, Some(comm)) => crate::dist::average_gradients(comm, params).map(|_| None),
        (LossNormalization::Global, None) => {
            scale_gradients(params, &(1.0 / weight_sum.clamp_min(MIN_WEIGHT_SUM)));
            Ok(None)
        }
        (LossNormalization::Global, Some(comm)) => {
            let mut total = [weight_sum.double_value(&[])];
            comm.all_reduce_sum(&mut total)?;
            crate::dist::average_gradients(comm, params)?;
            let world = comm.world() as f64;
            scale_gradients(
                params,
                &Tensor::scalar_tensor(world / total[0].max(MIN_WEIGHT_SUM), (Kind::Float, tch::Device::Cpu)),
            );
            Ok(Some(total[0]))
        }
    }
}

/// Every gradient times `factor`, an fp32 scalar (in place, no graph; a 16-bit gradient is
/// multiplied in fp32 and rounded once, the factor itself not rounded to 16 bits).
fn scale_gradients(params: &[Tensor], factor: &Tensor) {
    let _guard = tch::no_grad_guard();
    let Some(first) = params.first() else { return };
    // Moved once (the parameters share the drafter's device), not one copy per gradient.
    let factor = factor.to_device(first.device());
    for p in params {
        let mut g = p.grad();
        if g.defined() {
            let _ = g.g_mul_(&factor);
        }
    }
}

/// One micro-batch drafted: its loss and anchors, and the drafter output backward starts from.
pub struct Drafted {
    pub loss: LossOut,
    pub anchors: Anchors,
    output: Tensor,
}

impl Drafted {
    /// Gradients of `scale * loss` into the drafter's parameters: through the output's graph, or,
    /// when the drafter returned a leaf, by handing it the output's gradient (`Drafter::backward`).
    pub fn backward(&self, drafter: &mut DrafterHandle, scale: f64) -> Result<()> {
        (&self.loss.loss * scale).backward();
        if self.output.is_leaf() && self.output.requires_grad() {
            drafter.backward(&TensorHandle::new(self.output.grad()))?;
        }
        Ok(())
    }
}

/// Global gradient norm (a scalar on the gradients' device), clipped to `max_norm` as
/// torch.nn.utils.clip_grad_norm_ does it: the norm of the per-tensor norms, each gradient read
/// once with fp32 accumulation, then every gradient times min(1, max_norm / (norm + 1e-6)) (that
/// factor in the gradient's own dtype, as this crate always did; torch keeps it in fp32). Nothing
/// waits for the GPU.
pub(crate) fn clip_grad_norm(params: &[Tensor], max_norm: f64) -> Tensor {
    let _guard = tch::no_grad_guard();
    let grads: Vec<Tensor> = params.iter().map(|p| p.grad()).filter(|g| g.defined()).collect();
    if grads.is_empty() {
        return Tensor::zeros([], (Kind::Float, tch::Device::Cpu));
    }
    let norms: Vec<Tensor> = grads.iter().map(|g| g.norm_scalaropt_dtype(2.0, Kind::Float)).collect();
    let total = Tensor::stack(&norms, 0).norm();
    if max_norm > 0.0 {
        let coef = (max_norm / (&total + 1e-6)).clamp_max(1.0);
        kernels::optim::scale_all_(&grads, &coef);
    }
    total
}

/// What one step adds up, summed across ranks before it is logged or acted on.
pub struct StepSums {
    /// Micro-batch losses summed: weighted cross-entropy sums (global) or means (per micro-batch).
    pub loss: f64,
    /// The labels' weight sum.
    pub weight: f64,
    pub tokens: u64,
    pub correct: Vec<i64>,
    pub count: Vec<i64>,
    /// Any rank asked to stop (a signal): all stop after this step, together.
    pub stop: bool,
}

impl StepSums {
    pub fn all_reduce(&mut self, comm: &mut dyn Communicator) -> Result<()> {
        let mut v: Vec<f64> =
            [self.loss, self.weight, self.tokens as f64, self.stop as u8 as f64].into_iter().collect();
        v.extend(self.correct.iter().chain(&self.count).map(|&c| c as f64));
        comm.all_reduce_sum(&mut v)?;
        let n = self.correct.len();
        self.loss = v[0];
        self.weight = v[1];
        self.tokens = v[2] as u64;
        self.stop = v[3] > 0.0;
        self.correct = v[4..4 + n].iter().map(|&c| c as i64).collect();
        self.count = v[4 + n..].iter().map(|&c| c as i64).collect();
        Ok(())
    }

    /// The step's loss: the token-weighted mean over all its labels (global), or the mean of its
    /// `micro` micro-batches' means.
    pub fn step_loss(&self, normalization: LossNormalization, micro: u64) -> f64 {
        match normalization {
            LossNormalization::Global => self.loss / self.weight.max(MIN_WEIGHT_SUM),
            LossNormalization::PerMicroBatch => self.loss / micro.max(1) as f64,
        }
    }
}
