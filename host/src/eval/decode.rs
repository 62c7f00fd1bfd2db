//! Lossless greedy speculative decoding of one prompt (the DFlash paper's acceptance length). Per
//! cycle the drafter proposes a whole block from the target's features of every accepted token,
//! the target verifies it in one forward with its KV cache, and the longest matching prefix plus
//! the target's own next token (the bonus) are kept; the cache is cropped to what was kept. The
//! output must equal the target's own greedy output token for token.
//!
//! The cycles run as z-lab's `dflash_generate` runs them (full blocks; a cycle while fewer than
//! max_new_tokens + 1 tokens are out; stop after the cycle that produced a stop token), and
//! `tau` is z-lab's benchmark's: accepted + 1 for every cycle, averaged per response, then over
//! responses, so it compares with published numbers. `tau_kept` counts only the tokens kept
//! (up to the stop token and the length cap) per cycle that kept any.
//!
//! On a GPU a cycle waits for the device once, to read the drafts and the target's verdict
//! together; the drafter keeps its context's keys and values between cycles (`decode_block`)
//! where it can, so a cycle costs the new positions and the block, not the whole context.

use crate::pipeline::components::Components;
use anyhow::{anyhow, Result};
use plugin_api::{
    abi_stable::std_types::ROption,
    tch::{self, Device, Kind, Tensor},
    DecodeInput, DraftInput, PluginKind, TensorHandle,
};
use std::time::Instant;

/// Frozen tensors and drafter facts every cycle needs.
pub struct Shared {
    pub embedding: Tensor,
    pub lm_head: Tensor,
    pub layer_ids: Vec<u32>,
    pub block_size: usize,
    /// The block's masked positions' token ids [1, B-1], on the device.
    pub mask_ids: Tensor,
    /// Wait for the device at the end of each phase, to time them apart (`--time-split`).
    pub time_split: bool,
}

/// One draft-verify cycle.
#[derive(Debug, Clone, Copy)]
pub struct Cycle {
    /// Drafted tokens the target agreed with (of B - 1).
    pub accepted: usize,
    /// Tokens kept in the output: accepted + the bonus, fewer where a stop token or the length
    /// cap ended it (0 for a cycle past the cap).
    pub produced: usize,
}

/// Seconds spent per phase over the cycles (measured only with `Shared::time_split`).
#[derive(Debug, Clone, Copy, Default)]
pub struct PhaseTimes {
    pub draft: f64,
    pub verify: f64,
    /// Reading the verdict, cropping the cache, keeping the accepted features.
    pub bookkeeping: f64,
}

/// Token ids [1, L] (int64) on the CPU.
fn ids_tensor(ids: &[u32]) -> Tensor {
    Tensor::from_slice(&ids.iter().map(|&t| t as i64).collect::<Vec<_>>()).unsqueeze(0)
}

fn to_ids(t: &Tensor) -> Vec<u32> {
    Vec::<i64>::try_from(t.to_device(Device::Cpu).flatten(0, -1))
        .expect("token ids")
        .into_iter()
        .map(|t| t as u32)
        .collect()
}

/// Greedy speculative decoding of one prompt: the new tokens (up to `max_new`, and the first stop
/// token) and its draft-verify cycles.
pub fn speculative_decode(
    c: &mut Components,
    prompt: &[u32],
    max_new: usize,
    stop: &[u32],
    shared: &Shared,
    times: &mut PhaseTimes,
) -> Result<(Vec<u32>, Vec<Cycle>)> {
    let _guard = tch::no_grad_guard();
    let layers = shared.layer_ids.as_slice();
    let device = shared.embedding.device();
    let mut clock = PhaseClock::new(device, shared.time_split);
    c.target.cache_reset();
    // 1. Prefill: the prompt's features, and the target's first token (kept on the device).
    let (mut context, logits) = extend(c, ids_tensor(prompt), layers)?;
    let mut anchor = logits.narrow(1, prompt.len() as i64 - 1, 1).argmax(-1, false).to_device(device); // [1, 1]
                                                                                                       // `context`: the features the drafter has not been given yet (all of them while it keeps none).
    let mut keeps_context = true;
    let mut held = 0usize;
    let mut anchor_pos = prompt.len();
    // Every token the cycles produce; the output is its first `max_new`, up to a stop token.
    let mut all = to_ids(&anchor);
    let mut cycles = Vec::new();
    // z-lab: `while start < max_length`, i.e. while at most max_new tokens are out; the stop
    // tokens are looked for after each cycle (so the first cycle runs whatever the prefill gave).
    while all.len() <= max_new {
        let b = shared.block_size as i64;
        // 2. Draft: [anchor, MASK x (B-1)] over the context strictly before the anchor.
        let block = Tensor::cat(&[&anchor, &shared.mask_ids], 1);
        let embeds = Tensor::embedding(&shared.embedding, &block, -1, false, false);
        let mut hidden = None;
        if keeps_context {
            let input = DecodeInput {
                new_context: TensorHandle::new(context.shallow_clone()),
                context_start: held as u32,
                block_embeds: TensorHandle::new(embeds.shallow_clone()),
            };
            match c.drafter.decode_block(&input).into_result().map_err(c.err(PluginKind::Drafter, "decode_block"))? {
                ROption::RSome(h) => {
                    held += context.size()[1] as usize;
                    hidden = Some(h.into_tensor());
                }
                ROption::RNone => keeps_context = false,
            }
        }
        let hidden = match hidden {
            Some(h) => h,
            None => {
                let input = DraftInput {
                    target_hidden: TensorHandle::new(context.shallow_clone()),
                    block_embeds: TensorHandle::new(embeds),
                    anchors: TensorHandle::new(Tensor::from_slice(&[anchor_pos as i64]).view([1, 1]).to_device(device)),
                    anchor_valid: TensorHandle::new(Tensor::ones([1, 1], (Kind::Bool, device))),
                };
                c.drafter.forward(&input).into_result().map_err(c.err(PluginKind::Drafter, "forward"))?.into_tensor()
            }
        };
        let drafts = hidden.narrow(1, 1, b - 1).matmul(&shared.lm_head.tr()).argmax(-1, false); // [1, B-1]
        times.draft += clock.lap();
        // 3. Verify [anchor, drafts] in one target forward.
        let (block_hidden, logits) = extend(c, Tensor::cat(&[&anchor, &drafts], 1), layers)?;
        let posterior = logits.argmax(-1, false).to_device(device); // [1, B]
        times.verify += clock.lap();
        // 4. One wait for the device: the drafts and the verdict together. Keep the accepted
        //    drafts and the bonus token; crop the cache; the next context is their features.
        let both = to_ids(&Tensor::cat(&[&drafts, &posterior], 1));
        let (drafts, verdict) = both.split_at(b as usize - 1);
        let accepted = drafts.iter().zip(verdict).take_while(|(d, p)| d == p).count();
        let kept = (anchor_pos + accepted + 1) as u32;
        c.target.cache_truncate(kept).into_result().map_err(c.err(PluginKind::Target, "cache_truncate"))?;
        let verified = block_hidden.narrow(1, 0, accepted as i64 + 1);
        context = if keeps_context { verified } else { Tensor::cat(&[context, verified], 1) };
        let before = kept_len(&all, max_new, stop);
        all.extend_from_slice(&drafts[..accepted]);
        all.push(verdict[accepted]);
        cycles.push(Cycle { accepted, produced: kept_len(&all, max_new, stop) - before });
        anchor_pos += accepted + 1;
        anchor = posterior.narrow(1, accepted as i64, 1);
        times.bookkeeping += clock.lap();
        if all.iter().any(|t| stop.contains(t)) {
            break;
        }
    }
    all.truncate(kept_len(&all, max_new, stop));
    Ok((all, cycles))
}

/// The target's cache extended by `ids` [1, L]: their features of `layers` and logits.
fn extend(c: &mut Components, ids: Tensor, layers: &[u32]) -> Result<(Tensor, Tensor)> {
    let out = c.target.cache_extend(&TensorHandle::new(ids), layers.into()).into_result();
    let out = out.map_err(c.err(PluginKind::Target, "cache_extend"))?;
    let logits = out.logits.into_option().ok_or_else(|| anyhow!("target gave no logits"))?;
    Ok((out.hidden.into_tensor(), logits.into_tensor()))
}

/// Wall time between laps, waiting for the device at each lap only when asked (the waits
/// themselves cost time, so the timed speed-up is measured without them).
struct PhaseClock {
    device: Device,
    wait: bool,
    last: Instant,
}

impl PhaseClock {
    fn new(device: Device, wait: bool) -> Self {
        Self { device, wait, last: Instant::now() }
    }

    fn lap(&mut self) -> f64 {
        if !self.wait {
            return 0.0;
        }
        if let Device::Cuda(i) = self.device {
            tch::Cuda::synchronize(i as i64);
        }
        let now = Instant::now();
        let dt = (now - self.last).as_secs_f64();
        self.last = now;
        dt
    }
}

/// How many of `tokens` the output keeps: at most `max_new`, through the first stop token.
pub fn kept_len(tokens: &[u32], max_new: usize, stop: &[u32]) -> usize {
    let end = tokens.iter().position(|t| stop.contains(t)).map_or(tokens.len(), |i| i + 1);
    end.min(max_new)
}

/// One response's z-lab tau (mean accepted + 1 over its cycles) and tokens kept per cycle that
/// kept any; None without cycles.
pub fn response_taus(cycles: &[Cycle]) -> (Option<f64>, Option<f64>) {
    let tau =
        (!cycles.is_empty()).then(|| cycles.iter().map(|c| (c.accepted + 1) as f64).sum::<f64>() / cycles.len() as f64);
    let kept: Vec<usize> = cycles.iter().map(|c| c.produced).filter(|&p| p > 0).collect();
    let tau_kept = (!kept.is_empty()).then(|| kept.iter().sum::<usize>() as f64 / kept.len() as f64);
    (tau, tau_kept)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// z-lab's tau counts every cycle whole; the kept count stops at the stop token and the cap.
    #[test]
    fn taus_count_cycles_as_zlab_and_as_kept() {
        // max_new 8: 1 (prefill) + 4 kept + 3 of the 16 the second cycle gave, then a cycle past
        // the cap that keeps nothing.
        let cycles = [
            Cycle { accepted: 3, produced: 4 },
            Cycle { accepted: 15, produced: 3 },
            Cycle { accepted: 5, produced: 0 },
        ];
        let (tau, kept) = response_taus(&cycles);
        assert_eq!(tau, Some((4.0 + 16.0 + 6.0) / 3.0));
        assert_eq!(kept, Some(3.5));
        assert_eq!(response_taus(&[]), (None, None));
        assert_eq!(kept_len(&[5, 6, 7, 8], 8, &[7]), 3, "through the stop token");
        assert_eq!(kept_len(&[5, 6, 7, 8], 2, &[7]), 2, "the cap first");
        assert_eq!(kept_len(&[5, 6], 8, &[7]), 2);
    }
}
