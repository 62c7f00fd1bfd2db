//! `dflash-host eval`: real acceptance length by lossless greedy speculative decoding (DFLASH.md,
//! "Metrics"). Per cycle the drafter proposes a whole block from the target's features of every
//! accepted token, the target verifies it in one forward with its KV cache, and the longest
//! matching prefix plus the target's own next token (the bonus) are kept; the cache is cropped to
//! what was kept. The output must equal the target's own greedy output token for token.
//!
//! The cycles run as z-lab's `dflash_generate` runs them (full blocks; a cycle while fewer than
//! max_new_tokens + 1 tokens are out; stop after the cycle that produced a stop token), and
//! `tau` is z-lab's benchmark's: accepted + 1 for every cycle, averaged per response, then over
//! responses, so it compares with published numbers. `tau_kept` counts only the tokens kept
//! (up to the stop token and the length cap) per cycle that kept any.

use crate::pipeline::components::Components;
use anyhow::{anyhow, bail, Result};
use plugin_api::{
    tch::{self, Device, Kind, Tensor},
    DraftInput, PluginKind, TensorHandle,
};
use serde::Serialize;
use std::time::Instant;

pub struct EvalOptions {
    /// `holdout` or a chat JSONL file, through the data plugin.
    pub source: String,
    pub limit: u32,
    pub max_new_tokens: u32,
}

impl EvalOptions {
    /// Refuse what could only give an empty or misleading report, before anything is loaded: no
    /// prompts, no tokens, a prompts "file" that is a FIFO or device.
    pub fn validate(&self) -> Result<()> {
        if self.limit == 0 {
            bail!("--limit 0: evaluate at least one prompt");
        }
        if self.max_new_tokens == 0 {
            bail!("--max-new-tokens 0: nothing would be decoded (no acceptance to measure); give at least 1");
        }
        if !matches!(self.source.as_str(), "holdout" | "humaneval") {
            input_files::open_regular(std::path::Path::new(&self.source)).map_err(|e| anyhow!("--prompts {e}"))?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct EvalReport {
    pub source: String,
    pub prompts: usize,
    pub block_size: usize,
    /// z-lab's acceptance length: mean over responses of (accepted drafts + 1) per cycle, every
    /// cycle counted (the last one whole).
    pub tau: f64,
    pub tau_per_response: Vec<f64>,
    /// Tokens kept per cycle (the output's tokens, up to its stop token and the length cap, over
    /// the cycles that kept any), mean over responses.
    pub tau_kept: f64,
    /// What serving engines report: all accepted + 1 over all cycles, pooled over responses.
    pub tau_pooled: f64,
    /// Share of cycles whose k-th drafted token was accepted, k = 1..B-1.
    pub acceptance_per_position: Vec<f64>,
    pub cycles: usize,
    pub new_tokens: usize,
    /// Target-only greedy decoding vs speculative decoding, one sequence at a time.
    pub target_tok_per_s: f64,
    pub spec_tok_per_s: f64,
    pub speedup: f64,
    /// Every response equal to the target's own greedy output.
    pub lossless: bool,
    pub mismatches: Vec<usize>,
}

fn ids_tensor(ids: &[u32]) -> Tensor {
    Tensor::from_slice(&ids.iter().map(|&t| t as i64).collect::<Vec<_>>()).unsqueeze(0)
}

fn argmax_vec(logits: &Tensor) -> Vec<u32> {
    Vec::<i64>::try_from(logits.argmax(-1, false).to_device(Device::Cpu).flatten(0, -1))
        .expect("token ids")
        .into_iter()
        .map(|t| t as u32)
        .collect()
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

/// Greedy speculative decoding of one prompt: the new tokens (up to `max_new`, and the first stop
/// token) and its draft-verify cycles, run as z-lab's `dflash_generate` runs them.
pub fn speculative_decode(
    c: &mut Components,
    prompt: &[u32],
    max_new: usize,
    stop: &[u32],
    shared: &Shared,
) -> Result<(Vec<u32>, Vec<Cycle>)> {
    let _guard = tch::no_grad_guard();
    let layers = shared.layer_ids.as_slice();
    c.target.cache_reset();
    // 1. Prefill: the prompt's features, and the target's first token.
    let out = c.target.cache_extend(&TensorHandle::new(ids_tensor(prompt)), layers.into()).into_result();
    let out = out.map_err(c.err(PluginKind::Target, "cache_extend"))?;
    let mut ctx = out.hidden.into_tensor();
    let logits = out.logits.into_option().ok_or_else(|| anyhow!("target gave no logits"))?.into_tensor();
    let mut anchor_tok = *argmax_vec(&logits.select(1, prompt.len() as i64 - 1)).first().expect("one token");
    let mut anchor_pos = prompt.len();
    // Every token the cycles produce; the output is its first `max_new`, up to a stop token.
    let mut all = vec![anchor_tok];
    let mut cycles = Vec::new();
    // z-lab: `while start < max_length`, i.e. while at most max_new tokens are out; the stop
    // tokens are looked for after each cycle (so the first cycle runs whatever the prefill gave).
    while all.len() <= max_new {
        let v = shared.block_size;
        // 2. Draft: [anchor, MASK x (B-1)] over the context strictly before the anchor.
        let anchors = Tensor::from_slice(&[anchor_pos as i64]).view([1, 1]).to_device(shared.embedding.device());
        let mut block = vec![anchor_tok as i64];
        block.resize(shared.block_size, shared.mask_token_id);
        let block = Tensor::from_slice(&block).view([1, -1]).to_device(anchors.device());
        let embeds = Tensor::embedding(&shared.embedding, &block, -1, false, false);
        let input = DraftInput {
            target_hidden: TensorHandle::new(ctx.shallow_clone()),
            block_embeds: TensorHandle::new(embeds),
            anchors: TensorHandle::new(anchors),
            anchor_valid: TensorHandle::new(Tensor::ones([1, 1], (Kind::Bool, shared.embedding.device()))),
        };
        let h = c.drafter.forward(&input).into_result().map_err(c.err(PluginKind::Drafter, "forward"))?.into_tensor();
        let drafts = argmax_vec(&h.narrow(1, 1, v as i64 - 1).matmul(&shared.lm_head.tr()));
        // 3. Verify [anchor, drafts] in one target forward.
        let mut block_ids = vec![anchor_tok];
        block_ids.extend_from_slice(&drafts);
        let out = c.target.cache_extend(&TensorHandle::new(ids_tensor(&block_ids)), layers.into()).into_result();
        let out = out.map_err(c.err(PluginKind::Target, "cache_extend"))?;
        let posterior = argmax_vec(&out.logits.into_option().ok_or_else(|| anyhow!("target gave no logits"))?.into_tensor());
        let accepted = drafts.iter().zip(&posterior).take_while(|(d, p)| d == p).count();
        // 4. Keep the accepted drafts and the bonus token; crop the cache and extend the context.
        let kept = (anchor_pos + accepted + 1) as u32;
        c.target.cache_truncate(kept).into_result().map_err(c.err(PluginKind::Target, "cache_truncate"))?;
        ctx = Tensor::cat(&[ctx, out.hidden.into_tensor().narrow(1, 0, accepted as i64 + 1)], 1);
        let before = kept_len(&all, max_new, stop);
        all.extend_from_slice(&drafts[..accepted]);
        all.push(posterior[accepted]);
        cycles.push(Cycle { accepted, produced: kept_len(&all, max_new, stop) - before });
        if all.iter().any(|t| stop.contains(t)) {
            break;
        }
        anchor_pos += accepted + 1;
        anchor_tok = *all.last().expect("nonempty");
    }
    all.truncate(kept_len(&all, max_new, stop));
    Ok((all, cycles))
}

/// How many of `tokens` the output keeps: at most `max_new`, through the first stop token.
fn kept_len(tokens: &[u32], max_new: usize, stop: &[u32]) -> usize {
    let end = tokens.iter().position(|t| stop.contains(t)).map_or(tokens.len(), |i| i + 1);
    end.min(max_new)
}

/// One response's z-lab tau (mean accepted + 1 over its cycles) and tokens kept per cycle that
/// kept any; None without cycles.
pub fn response_taus(cycles: &[Cycle]) -> (Option<f64>, Option<f64>) {
    let tau = (!cycles.is_empty()).then(|| cycles.iter().map(|c| (c.accepted + 1) as f64).sum::<f64>() / cycles.len() as f64);
    let kept: Vec<usize> = cycles.iter().map(|c| c.produced).filter(|&p| p > 0).collect();
    let tau_kept = (!kept.is_empty()).then(|| kept.iter().sum::<usize>() as f64 / kept.len() as f64);
    (tau, tau_kept)
}

/// Frozen tensors and drafter facts every cycle needs.
pub struct Shared {
    pub embedding: Tensor,
    pub lm_head: Tensor,
    pub layer_ids: Vec<u32>,
    pub block_size: usize,
    pub mask_token_id: i64,
}

pub fn evaluate(c: &mut Components, opts: &EvalOptions) -> Result<EvalReport> {
    let tokenizer = c.target.tokenizer_json();
    c.data.open(tokenizer.as_rstr()).into_result().map_err(c.err(PluginKind::DataLoader, "open"))?;
    let prompts = c.data.eval_prompts(opts.source.as_str().into(), opts.limit).into_result();
    let prompts = prompts.map_err(c.err(PluginKind::DataLoader, "eval_prompts"))?;
    if prompts.is_empty() {
        bail!("no evaluation prompts from `{}`", opts.source);
    }
    let shared = Shared {
        embedding: c.target.embedding().into_tensor(),
        lm_head: c.target.lm_head().into_tensor(),
        layer_ids: c.drafter.target_layer_ids().into_vec(),
        block_size: c.drafter.block_size() as usize,
        mask_token_id: c.drafter.mask_token_id() as i64,
    };
    let stop = [c.target.spec().eos_token_id];
    let bar = indicatif::ProgressBar::new(prompts.len() as u64);
    let (mut t_target, mut t_spec, mut n_target, mut n_spec) = (0.0, 0.0, 0usize, 0usize);
    let (mut taus, mut taus_kept) = (Vec::new(), Vec::new());
    let mut mismatches = Vec::new();
    let mut accepted_at = vec![0usize; shared.block_size - 1];
    let (mut all_cycles, mut all_accepted) = (0usize, 0usize);
    for (i, prompt) in prompts.iter().enumerate() {
        let t0 = Instant::now();
        let base = c.target.generate(vec![prompt.clone()].into(), opts.max_new_tokens, stop.as_slice().into()).into_result();
        let base = base.map_err(c.err(PluginKind::Target, "generate"))?.remove(0).into_vec();
        t_target += t0.elapsed().as_secs_f64();
        n_target += base.len();
        let t1 = Instant::now();
        let (spec, cycles) = speculative_decode(c, prompt, opts.max_new_tokens as usize, &stop, &shared)?;
        t_spec += t1.elapsed().as_secs_f64();
        n_spec += spec.len();
        if spec != base {
            tracing::error!("prompt {i}: speculative output differs from the target's greedy output");
            mismatches.push(i);
        }
        // tau per response (z-lab): accepted + 1 per cycle; kept: tokens kept per cycle that
        // kept any (the prefill's first token is no cycle).
        let (t, k) = response_taus(&cycles);
        taus.extend(t);
        taus_kept.extend(k);
        all_cycles += cycles.len();
        all_accepted += cycles.iter().map(|c| c.accepted + 1).sum::<usize>();
        for cy in &cycles {
            for slot in accepted_at.iter_mut().take(cy.accepted) {
                *slot += 1;
            }
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    Ok(EvalReport {
        source: opts.source.clone(),
        prompts: prompts.len(),
        block_size: shared.block_size,
        tau: mean(&taus),
        tau_kept: mean(&taus_kept),
        tau_pooled: all_accepted as f64 / all_cycles.max(1) as f64,
        tau_per_response: taus,
        acceptance_per_position: accepted_at.iter().map(|&n| n as f64 / all_cycles.max(1) as f64).collect(),
        cycles: all_cycles,
        new_tokens: n_spec,
        target_tok_per_s: n_target as f64 / t_target,
        spec_tok_per_s: n_spec as f64 / t_spec,
        speedup: t_target / t_spec * (n_spec as f64 / n_target.max(1) as f64),
        lossless: mismatches.is_empty(),
        mismatches,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// z-lab's tau counts every cycle whole; the kept count stops at the stop token and the cap.
    #[test]
    fn taus_count_cycles_as_zlab_and_as_kept() {
        // max_new 8: 1 (prefill) + 4 kept + 3 of the 16 the second cycle gave, then a cycle past
        // the cap that keeps nothing.
        let cycles = [Cycle { accepted: 3, produced: 4 }, Cycle { accepted: 15, produced: 3 }, Cycle { accepted: 5, produced: 0 }];
        let (tau, kept) = response_taus(&cycles);
        assert_eq!(tau, Some((4.0 + 16.0 + 6.0) / 3.0));
        assert_eq!(kept, Some(3.5));
        assert_eq!(response_taus(&[]), (None, None));
        assert_eq!(kept_len(&[5, 6, 7, 8], 8, &[7]), 3, "through the stop token");
        assert_eq!(kept_len(&[5, 6, 7, 8], 2, &[7]), 2, "the cap first");
        assert_eq!(kept_len(&[5, 6], 8, &[7]), 2);
    }

    #[test]
    fn arguments_that_give_no_evaluation_are_refused() {
        let opts = |source: &str, limit, max_new_tokens| EvalOptions { source: source.into(), limit, max_new_tokens };
        opts("holdout", 32, 64).validate().unwrap();
        let err = opts("holdout", 0, 64).validate().unwrap_err().to_string();
        assert!(err.starts_with("--limit 0"), "{err}");
        let err = opts("holdout", 32, 0).validate().unwrap_err().to_string();
        assert!(err.starts_with("--max-new-tokens 0"), "{err}");
        let err = opts("/dev/zero", 32, 64).validate().unwrap_err().to_string();
        assert_eq!(err, "--prompts /dev/zero: not a regular file (a character device)");
        let err = opts("nope.jsonl", 32, 64).validate().unwrap_err().to_string();
        assert_eq!(err, "--prompts nope.jsonl: no such file");
    }
}
