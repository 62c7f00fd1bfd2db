//! `bench train`'s drafter step: one micro-batch through the trainer's [`StepRunner`] on
//! synthetic target features, what it counted (for its FLOPs), the fused loss checked against
//! libtorch's, and the drafter's layer shape where its config says it.

use super::{
    flops::{self, DrafterWork, Shape},
    train_report::BenchShape,
};
use crate::{
    pipeline::stages::Micro,
    plugins::handles::DrafterHandle,
    train::{
        loss::{dflash_loss, LossInput, Reduction},
        DraftLoss, StepRunner,
    },
};
use anyhow::Result;
use plugin_api::{
    tch::{self, Device, Kind, Tensor},
    DataPosition, TargetSpec,
};

/// One training step on one micro-batch as training runs it: the trainer's [`StepRunner`] (forward,
/// DFlash loss, backward, the step's reductions and synchronisation, clip, the non-finite guard,
/// the optimizer at its base rate).
pub(super) struct DrafterStep<'a> {
    pub(super) runner: StepRunner<'a>,
    pub(super) draws: u64,
}

/// What one step's loss counted, for the FLOP count.
pub(super) struct StepCounts {
    pub(super) anchors: usize,
    pub(super) anchor_pos_sum: f64,
    pub(super) counted: usize,
}

impl DrafterStep<'_> {
    pub(super) fn run(&mut self, input_ids: &Tensor, loss_mask: &Tensor, target_hidden: Tensor) -> Result<StepCounts> {
        let (b, s) = (input_ids.size()[0], input_ids.size()[1]);
        let micro = Micro {
            input_ids: input_ids.shallow_clone(),
            loss_mask: loss_mask.shallow_clone(),
            lengths: vec![s as u32; b as usize],
            sequence_ids: Vec::new(),
            hidden: target_hidden,
            position: DataPosition::default(),
            index: self.draws,
        };
        self.draws += 1;
        let mut acc = self.runner.begin();
        let d = self.runner.micro_step(&micro, &mut acc)?;
        let anchors = &d.anchors;
        let anchor_pos_sum =
            f64::try_from(anchors.positions.to_kind(Kind::Double).masked_select(&anchors.valid).sum(Kind::Double))?;
        let anchors = anchors.count;
        drop(d);
        let r = self.runner.reduce(&acc, false)?;
        self.runner.apply(self.draws, &r, 1.0, None)?;
        // Counted positions: what the loss saw, from the step's reductions.
        let counted = r.sums.count.iter().sum::<i64>() as usize;
        Ok(StepCounts { anchors, anchor_pos_sum, counted })
    }
}

/// The loss and its gradient w.r.t. random drafter outputs, with the run-time compiled kernels
/// and with libtorch's ops, compared (None on the CPU, where only the latter run).
pub(super) fn fused_loss_error(
    draft: &DraftLoss,
    spec: &TargetSpec,
    sh: &BenchShape,
    device: Device,
    kind: Kind,
) -> Result<Option<[f64; 2]>> {
    // Nothing to compare where the kernels do not run (the CPU, a failed build).
    if device == Device::Cpu {
        return Ok(None);
    }
    let z = Tensor::randn([4, spec.vocab_size as i64], (Kind::Float, device));
    let labels = Tensor::zeros([4], (Kind::Int64, device));
    if !kernels::nvrtc::with_enabled(true, || kernels::cross_entropy::rows(z, &labels, None).is_ok()) {
        return Ok(None);
    }
    let (ids, loss_mask) = synthetic_batch(spec, sh.batch_size, sh.seq_len);
    let anchors = draft.sampler.sample(&loss_mask, u64::MAX);
    let a = anchors.positions.size()[1];
    // A seed of its own: the random target's weights came from the run's seed, and drawn from
    // the same stream, each hidden row would repeat an LM-head row's draw (its logit then
    // 0.02 * H = 82, and the loss 81.9 instead of 12.75).
    tch::manual_seed((draft.sampler.seed ^ 0x1055) as i64);
    let hidden = Tensor::randn([sh.batch_size as i64, a * draft.block_size, spec.hidden_size as i64], (kind, device));
    let (ids, loss_mask) = (ids.to_device(device), loss_mask.to_device(device));
    let (positions, valid) = (anchors.positions.to_device(device), anchors.valid.to_device(device));
    // The loss with the kernels on or off; DFLASH_NVRTC=0 still holds for the timed phases after.
    let run = |fused: bool| {
        kernels::nvrtc::with_enabled(fused, || {
            let h = hidden.detach().set_requires_grad(true);
            let out = dflash_loss(&LossInput {
                block_hidden: &h,
                lm_head: &draft.lm_head,
                input_ids: &ids,
                loss_mask: &loss_mask,
                anchors: &positions,
                anchor_valid: &valid,
                block_size: draft.block_size,
                gamma: draft.gamma,
                reduction: Reduction::Mean,
            });
            out.loss.backward();
            (out.loss.double_value(&[]), h.grad().to_kind(Kind::Float))
        })
    };
    let (fused, plain) = (run(true), run(false));
    let grad_err = (&fused.1 - &plain.1).abs().max().double_value(&[]) / plain.1.abs().max().double_value(&[]);
    // Random inputs give Gaussian logits of std sigma = std(h) std(W) sqrt(H), and a loss of about
    // ln V + sigma^2 / 2: a check on the logits' GEMM.
    let (std_h, std_w) = (hidden.std(true).double_value(&[]), draft.lm_head.std(true).double_value(&[]));
    let sigma = std_h * std_w * (spec.hidden_size as f64).sqrt();
    eprintln!(
        "loss check: {:.6} with the kernels, {:.6} without, about {:.2} expected (hidden std {std_h:.3}, head std {std_w:.4})",
        fused.0,
        plain.0,
        (spec.vocab_size as f64).ln() + sigma * sigma / 2.0
    );
    Ok(Some([(fused.0 - plain.0).abs() / plain.0.abs(), grad_err]))
}

/// Random token ids [B, S] and a response mask that counts every position but the first, on the
/// host as a data loader gives them.
pub(super) fn synthetic_batch(spec: &TargetSpec, b: usize, s: usize) -> (Tensor, Tensor) {
    let (b, s) = (b as i64, s as i64);
    let ids = Tensor::randint(spec.vocab_size as i64, [b, s], (Kind::Int64, Device::Cpu));
    let mask = Tensor::ones([b, s], (Kind::Int64, Device::Cpu));
    let _ = mask.narrow(1, 0, 1).fill_(0);
    (ids, mask)
}

/// Trained parameters and, where the drafter's config is DFlash's (z-lab format), its layer shape.
pub(super) fn drafter_layout(drafter: &DrafterHandle, spec: &TargetSpec) -> Option<(Shape, usize)> {
    let cfg: serde_json::Value = serde_json::from_str(&drafter.config_json().ok()?).ok()?;
    let dflash = cfg["architectures"].as_array()?.iter().any(|a| a == "DFlashDraftModel");
    let f = |k: &str| cfg[k].as_f64();
    let shape = Shape {
        hidden: f("hidden_size")?,
        heads: f("num_attention_heads")?,
        kv_heads: f("num_key_value_heads")?,
        head_dim: f("head_dim")?,
        ffn: f("intermediate_size")?,
        vocab: spec.vocab_size as f64,
    };
    dflash.then_some((shape, cfg["num_hidden_layers"].as_u64()? as usize))
}

/// The drafter step's FLOPs: exact where the drafter's layout is known (z-lab DFlash), else
/// estimated from its parameter count; and which.
pub(super) fn drafter_flop(
    layout: Option<(Shape, usize)>,
    layer_ids: &[u32],
    block_size: i64,
    n_params: f64,
    c: &StepCounts,
    spec: &TargetSpec,
    sh: &BenchShape,
) -> (f64, bool) {
    match layout {
        Some((shape, layers)) => {
            let work = DrafterWork {
                shape,
                layers,
                features: layer_ids.len(),
                batch: sh.batch_size,
                seq: sh.seq_len,
                block_size: block_size as usize,
                anchors: c.anchors,
                anchor_pos_sum: c.anchor_pos_sum,
                counted: c.counted,
            };
            (work.step(), true)
        }
        None => {
            let draft = (c.anchors as i64 * block_size) as f64;
            (flops::drafter_step_estimate(n_params, draft, c.counted as f64, &Shape::of_target(spec)), false)
        }
    }
}
