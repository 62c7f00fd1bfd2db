//! One optimizer step, shared by training and `bench train`: micro-batches through the drafter
//! (anchors, forward, DFlash loss, backward), the step's reductions (gradients normalised and
//! clipped, the step's one synchronisation, the replicas' sums), the non-finite guard and the
//! optimizer. Each phase is a named profiler range.

use super::step::{clip_grad_norm, normalize_gradients, DraftLoss, Drafted, StepSums};
use crate::{
    dist::Communicator,
    pipeline::stages::Micro,
    plugins::handles::{DrafterHandle, OptimizerHandle},
};
use anyhow::{anyhow, bail, Result};
use kernels::profiler;
use plugin_api::{
    tch::{Device, Kind, Tensor},
    DataPosition,
};

pub struct StepRunner<'a> {
    pub drafter: &'a mut DrafterHandle,
    pub optimizer: &'a mut OptimizerHandle,
    /// The drafter's trainable parameters (handles sharing its storage).
    pub params: Vec<Tensor>,
    pub draft: DraftLoss,
    /// Micro-batches a step (on each replica).
    pub grad_accum: u64,
    pub grad_clip: f64,
    /// Data-parallel replicas (None: this process alone).
    pub comm: Option<Box<dyn Communicator>>,
    pub guard: NonFiniteGuard,
}

/// One step's micro-batches as they accumulate: loss, weight sum and accuracy counts stay on the
/// device.
pub struct StepAccum {
    loss_sum: Tensor,
    weight_sum: Tensor,
    counts: Tensor,
    tokens: u64,
    /// The data loader's position after the step's last micro-batch.
    pub last_position: Option<DataPosition>,
}

/// The step's reductions, on the host and summed over replicas.
pub struct Reduced {
    pub sums: StepSums,
    pub grad_norm: f64,
    /// The step's loss ([`StepSums::step_loss`]).
    pub loss: f64,
    /// Micro-batches in the step, over all replicas.
    pub micro: u64,
}

impl StepRunner<'_> {
    /// Replicas in the run.
    pub fn world(&self) -> u64 {
        self.comm.as_ref().map_or(1, |c| c.world() as u64)
    }

    fn device(&self) -> Device {
        self.draft.embedding.device()
    }

    /// An empty step.
    pub fn begin(&self) -> StepAccum {
        let device = self.device();
        StepAccum {
            loss_sum: Tensor::zeros([], (Kind::Float, device)),
            weight_sum: Tensor::zeros([], (Kind::Float, device)),
            counts: Tensor::zeros([2, self.draft.block_size - 1], (Kind::Int64, device)),
            tokens: 0,
            last_position: None,
        }
    }

    /// One micro-batch: anchors, drafter forward, loss, backward (its sum, or with per-micro-batch
    /// normalisation its mean / K); the loss, weight sum and counts are added on the device,
    /// nothing waits for the GPU. Returns what was drafted (its anchors, its loss's counts).
    pub fn micro_step(&mut self, m: &Micro, acc: &mut StepAccum) -> Result<Drafted> {
        let forward = profiler::range("forward + loss");
        let d = self.draft.compute(self.drafter, &m.input_ids, &m.loss_mask, &m.hidden, m.index)?;
        drop(forward);
        let _backward = profiler::range("backward");
        let scale = self.draft.backward_scale(self.grad_accum);
        d.backward(self.drafter, scale)?;
        acc.loss_sum += d.loss.loss.detach();
        acc.weight_sum += &d.loss.weight_sum;
        acc.counts += &d.loss.counts;
        acc.tokens += m.lengths.iter().map(|&l| l as u64).sum::<u64>();
        acc.last_position = Some(m.position);
        Ok(d)
    }

    /// The step's reductions once its micro-batches are in: gradients normalised (over the weight
    /// sum of every micro-batch on every rank, or averaged over replicas), clipped, the step's one
    /// synchronisation (loss, weight sum, gradient norm and counts in one copy), and what the step
    /// counted summed over replicas, with whether any of them asked to stop (`stop`: this one).
    pub fn reduce(&mut self, acc: &StepAccum, stop: bool) -> Result<Reduced> {
        let _range = profiler::range("reduce");
        let normalization = self.draft.normalization;
        normalize_gradients(self.comm.as_mut(), &self.params, normalization, &acc.weight_sum)?;
        let grad_norm = clip_grad_norm(&self.params, self.grad_clip);
        let host = Vec::<f64>::try_from(
            Tensor::cat(
                &[
                    acc.loss_sum.view([1]).to_kind(Kind::Double),
                    acc.weight_sum.view([1]).to_kind(Kind::Double),
                    grad_norm.to_device(self.device()).view([1]).to_kind(Kind::Double),
                    acc.counts.flatten(0, -1).to_kind(Kind::Double),
                ],
                0,
            )
            .to_device(Device::Cpu),
        )?;
        let n = self.draft.block_size as usize - 1;
        let mut sums = StepSums {
            loss: host[0],
            weight: host[1],
            tokens: acc.tokens,
            correct: host[3..3 + n].iter().map(|&c| c as i64).collect(),
            count: host[3 + n..].iter().map(|&c| c as i64).collect(),
            stop,
        };
        if let Some(comm) = self.comm.as_deref_mut() {
            sums.all_reduce(comm)?;
        }
        let micro = self.grad_accum * self.world();
        let loss = sums.step_loss(normalization, micro);
        Ok(Reduced { sums, grad_norm: host[2], loss, micro })
    }

    /// The guard, then the optimizer at `lr_scale` times its base rate where the step is finite;
    /// the gradients dropped either way. Ok(false): the step was skipped. `last_good` names the
    /// checkpoint a run the guard stops resumes from.
    pub fn apply(&mut self, step: u64, r: &Reduced, lr_scale: f64, last_good: Option<&str>) -> Result<bool> {
        let applied = self.guard.check(step, r.loss, r.grad_norm).map_err(|e| match last_good {
            Some(ckpt) => anyhow!("{e:#}; stopped, the last good checkpoint is {ckpt}"),
            None => e,
        })?;
        if applied {
            let _range = profiler::range("optimizer");
            self.optimizer.step(lr_scale)?;
        }
        // Gradients dropped, not zeroed (PyTorch's default): until the next backward they take
        // no memory, so the forward's activations never sit beside last step's gradients.
        for p in &self.params {
            kernels::autograd::clear_grad(p);
        }
        Ok(applied)
    }
}

/// Skips steps whose loss or gradient is not finite, and stops the run after `max` in a row
/// (a diverged run does not recover by itself; its last good checkpoint is kept).
pub struct NonFiniteGuard {
    pub max: u64,
    pub consecutive: u64,
}

impl NonFiniteGuard {
    /// Ok(true): apply the step; Ok(false): skip it; Err: stop the run.
    pub fn check(&mut self, step: u64, loss: f64, grad_norm: f64) -> Result<bool> {
        if loss.is_finite() && grad_norm.is_finite() {
            self.consecutive = 0;
            return Ok(true);
        }
        self.consecutive += 1;
        tracing::warn!(
            "step {step}: loss {loss}, gradient norm {grad_norm}: step skipped ({} in a row)",
            self.consecutive
        );
        if self.consecutive >= self.max {
            bail!("{} consecutive steps with a non-finite loss or gradient (up to step {step})", self.consecutive);
        }
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guard_skips_then_stops_after_max_in_a_row() {
        let mut g = NonFiniteGuard { max: 3, consecutive: 0 };
        assert!(g.check(1, 2.0, 1.0).unwrap());
        assert!(!g.check(2, f64::NAN, 1.0).unwrap());
        assert!(!g.check(3, 2.0, f64::INFINITY).unwrap());
        assert!(g.check(4, 2.0, 1.0).unwrap(), "a good step resets the count");
        assert!(!g.check(5, f64::NAN, 1.0).unwrap());
        assert!(!g.check(6, f64::NAN, 1.0).unwrap());
        let err = g.check(7, f64::NAN, f64::NAN).unwrap_err().to_string();
        assert!(err.contains("3 consecutive steps") && err.contains("step 7"), "{err}");
    }
}
