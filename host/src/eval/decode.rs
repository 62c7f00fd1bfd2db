//! Lossless greedy speculative decoding of one prompt (the DFlash paper's acceptance length). Per
//! cycle the drafter proposes a whole block from the target's features of every accepted token,
//! the target verifies it in one forward with its KV cache, and the longest matching prefix plus
//! the target's own next token (the bonus) are kept; the cache is cropped to what was kept. The
//! output must equal the target's own greedy output token for token.
//!
//! The cycles stop where the serving engines stop a request (vLLM's `check_stop`, SGLang's
//! `check_finished`): once the output holds a stop token or `max_new_tokens` tokens, no further
//! verify runs, so a response that ends exactly at the cap, or whose prefill token is a stop
//! token, costs no extra cycle. (z-lab's `dflash_generate` runs one more cycle in those cases.)
//! Every cycle drafts a full block. A cycle counts as the engines count it: its accepted drafts
//! whole (vLLM; `tau`, `tau_pooled`), or its tokens kept, cut at the stop token and the cap
//! (SGLang; `tau_kept`). The eval's report (`mod.rs`) says which figure is whose.
//!
//! On a GPU a cycle waits for the device once, to read the drafts and the target's verdict
//! together; the drafter keeps its context's keys and values between cycles (`decode_block`)
//! where it can, so a cycle costs the new positions and the block, not the whole context.

use crate::pipeline::components::Components;
use anyhow::{anyhow, Result};
use plugin_api::{
    tch::{self, Device, Kind, Tensor},
    DecodeInput, DraftInput, TensorHandle,
};
use std::time::Instant;

/// Frozen tensors and drafter facts every cycle needs.
pub struct Shared {
    pub embedding: Tensor,
    pub draft_head: DraftHead,
    pub layer_ids: Vec<u32>,
    pub block_size: usize,
    /// Drafts verified a cycle: the first of the block's B-1 proposals.
    pub draft_tokens: usize,
    /// The block's masked positions' token ids [1, B-1], on the device.
    pub mask_ids: Tensor,
    /// Wait for the device at the end of each phase, to time them apart (`--time-split`).
    pub time_split: bool,
}

/// The LM head drafts are read from: the target's whole one, or its rows of a draft vocabulary.
pub struct DraftHead {
    /// [V or K, H].
    weight: Tensor,
    /// The token id of each row [K], with a draft vocabulary.
    ids: Option<Tensor>,
}

impl DraftHead {
    pub fn new(lm_head: Tensor, vocab: Option<&super::draft_vocab::DraftVocab>) -> Self {
        match vocab {
            Some(v) => {
                let ids = v.ids.to_device(lm_head.device());
                Self { weight: lm_head.index_select(0, &ids), ids: Some(ids) }
            }
            None => Self { weight: lm_head, ids: None },
        }
    }

    /// The greedy token ids [1, k] of block hidden states [1, k, H].
    fn argmax(&self, hidden: &Tensor) -> Tensor {
        let best = hidden.matmul(&self.weight.tr()).argmax(-1, false);
        match &self.ids {
            Some(ids) => ids.index_select(0, &best.view([-1])).view_as(&best),
            None => best,
        }
    }

    /// Rows in the head: the draft vocabulary's size.
    pub fn rows(&self) -> usize {
        self.weight.size()[0] as usize
    }
}

/// One draft-verify cycle.
#[derive(Debug, Clone, Copy)]
pub struct Cycle {
    /// Drafted tokens the target agreed with (of B - 1).
    pub accepted: usize,
    /// Tokens kept in the output: accepted + the bonus, fewer where a stop token or the length
    /// cap ended it (at least 1: no cycle runs once the output is complete).
    pub produced: usize,
}

/// Seconds spent per phase (measured only with `Shared::time_split`): the prompts' prefills, and
/// over the cycles each cycle's phases.
#[derive(Debug, Clone, Copy, Default)]
pub struct PhaseTimes {
    /// The target's forward over the prompt and its first token, once a prompt.
    pub prefill: f64,
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
    c.target.cache_reset()?;
    // 1. Prefill: the prompt's features, and the target's first token (kept on the device).
    let (mut context, logits) = extend(c, ids_tensor(prompt), layers)?;
    // The target's first token [1, 1]; `context`: the features the drafter has not been given yet
    // (all of them while it keeps none).
    let mut anchor = logits.narrow(1, prompt.len() as i64 - 1, 1).argmax(-1, false).to_device(device);
    times.prefill += clock.lap();
    let mut keeps_context = true;
    let mut held = 0usize;
    let mut anchor_pos = prompt.len();
    // Every token the cycles produce; the output is its first `max_new`, up to a stop token.
    let mut all = to_ids(&anchor);
    let mut cycles = Vec::new();
    // As the engines stop a request: not once max_new tokens are out or a stop token is.
    while !finished(&all, max_new, stop) {
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
            match c.drafter.decode_block(&input)? {
                Some(h) => {
                    held += context.size()[1] as usize;
                    hidden = Some(h);
                }
                None => keeps_context = false,
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
                c.drafter.forward(&input)?
            }
        };
        let k = shared.draft_tokens;
        let drafts = shared.draft_head.argmax(&hidden.narrow(1, 1, k as i64)); // [1, k]
        times.draft += clock.lap();
        // 3. Verify [anchor, drafts] in one target forward.
        let (block_hidden, logits) = extend(c, Tensor::cat(&[&anchor, &drafts], 1), layers)?;
        let posterior = logits.argmax(-1, false).to_device(device); // [1, k + 1]
        times.verify += clock.lap();
        // 4. One wait for the device: the drafts and the verdict together. Keep the accepted
        //    drafts and the bonus token; crop the cache; the next context is their features.
        let both = to_ids(&Tensor::cat(&[&drafts, &posterior], 1));
        let (drafts, verdict) = both.split_at(k);
        let accepted = drafts.iter().zip(verdict).take_while(|(d, p)| d == p).count();
        let kept = (anchor_pos + accepted + 1) as u32;
        c.target.cache_truncate(kept)?;
        let verified = block_hidden.narrow(1, 0, accepted as i64 + 1);
        context = if keeps_context { verified } else { Tensor::cat(&[context, verified], 1) };
        let before = kept_len(&all, max_new, stop);
        all.extend_from_slice(&drafts[..accepted]);
        all.push(verdict[accepted]);
        cycles.push(Cycle { accepted, produced: kept_len(&all, max_new, stop) - before });
        anchor_pos += accepted + 1;
        anchor = posterior.narrow(1, accepted as i64, 1);
        times.bookkeeping += clock.lap();
    }
    all.truncate(kept_len(&all, max_new, stop));
    Ok((all, cycles))
}

/// The target's cache extended by `ids` [1, L]: their features of `layers` and logits.
fn extend(c: &mut Components, ids: Tensor, layers: &[u32]) -> Result<(Tensor, Tensor)> {
    let out = c.target.cache_extend(&TensorHandle::new(ids), layers)?;
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

/// Whether a response is complete, as vLLM's `check_stop` and SGLang's `check_finished` decide
/// after each token: `max_new` tokens out, or a stop token among them.
pub fn finished(tokens: &[u32], max_new: usize, stop: &[u32]) -> bool {
    tokens.len() >= max_new || tokens.iter().any(|t| stop.contains(t))
}

/// How many of `tokens` the output keeps: at most `max_new`, through the first stop token.
pub fn kept_len(tokens: &[u32], max_new: usize, stop: &[u32]) -> usize {
    let end = tokens.iter().position(|t| stop.contains(t)).map_or(tokens.len(), |i| i + 1);
    end.min(max_new)
}

/// One response's z-lab tau: the mean of accepted + 1 over its cycles; None without cycles.
pub fn response_tau(cycles: &[Cycle]) -> Option<f64> {
    (!cycles.is_empty()).then(|| cycles.iter().map(|c| (c.accepted + 1) as f64).sum::<f64>() / cycles.len() as f64)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::{config::RunConfig, pipeline::components::build_components, plugins::Registry};

    /// A random two-layer target (vocabulary 32) and a random drafter with blocks of 4.
    pub(in crate::eval) fn tiny_components(dir: &std::path::Path) -> Components {
        let tiny = r#"{"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 2, "vocab_size": 32, "eos_token_id": 1}"#;
        std::fs::write(dir.join("tiny.json"), tiny).unwrap();
        std::fs::write(dir.join("chat.jsonl"), "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n")
            .unwrap();
        let toml =
            "name = \"t\"\ndtype = \"f32\"\n[train]\nsteps = 1\n[target]\nplugin = \"hf\"\npath = \"tiny.json\"\n\
                    random_init = true\n[drafter]\nplugin = \"dflash\"\nnum_hidden_layers = 1\nblock_size = 4\n\
                    num_target_features = 1\nmask_token_id = 0\n[optimizer]\nplugin = \"adamw\"\n[data]\n\
                    plugin = \"chat\"\npath = \"chat.jsonl\"\n";
        std::fs::write(dir.join("run.toml"), toml).unwrap();
        let cfg = RunConfig::load(&dir.join("run.toml")).unwrap();
        tch::manual_seed(7);
        build_components(&cfg, &Registry::new(&[]).unwrap(), dir, dir).unwrap()
    }

    fn shared(c: &Components) -> Shared {
        Shared {
            embedding: c.target.embedding().unwrap(),
            draft_head: DraftHead::new(c.target.lm_head().unwrap(), None),
            layer_ids: c.drafter.target_layer_ids().unwrap(),
            block_size: 4,
            draft_tokens: 3,
            mask_ids: Tensor::zeros([1, 3], (Kind::Int64, Device::Cpu)),
            time_split: false,
        }
    }

    /// Drafts from a draft vocabulary are the best of its rows, named by their token ids, where
    /// a token outside it scores higher.
    #[test]
    fn a_draft_vocabulary_drafts_its_best_token_by_id() {
        // Six tokens of dimension 2; token 5 scores highest for both hidden states.
        let lm_head = Tensor::from_slice(&[1f32, 0., 0., 1., -1., 0., 0., -1., 0.6, 0.6, 2., 1.]).view([6, 2]);
        let hidden = Tensor::from_slice(&[1f32, 1., 1., -0.2]).view([1, 2, 2]);
        let whole = DraftHead::new(lm_head.shallow_clone(), None);
        assert_eq!(Vec::<i64>::try_from(whole.argmax(&hidden).view([-1])).unwrap(), [5, 5]);
        // Among tokens 4, 1 and 0: 4 scores 1.2 for the first (1 for the others), 0 scores 1 for
        // the second (4: 0.48, 1: -0.2).
        let vocab = super::super::draft_vocab::DraftVocab { ids: Tensor::from_slice(&[4i64, 1, 0]), coverage: 0.9 };
        let reduced = DraftHead::new(lm_head, Some(&vocab));
        assert_eq!(reduced.rows(), 3);
        assert_eq!(Vec::<i64>::try_from(reduced.argmax(&hidden).view([-1])).unwrap(), [4, 0]);
    }

    /// A response that reaches max_new_tokens exactly at the end of a cycle runs no further
    /// cycle (vLLM and SGLang stop the request there), nor does one whose prefill token is a
    /// stop token. (A random target repeats one token and a random drafter seldom guesses it:
    /// the cycles here keep one token each; `finished` is checked on its own below.)
    #[test]
    fn decoding_stops_where_the_engines_stop() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = tiny_components(dir.path());
        let sh = shared(&c);
        let prompt = [5u32, 9, 3, 7, 2];
        let decode = |c: &mut Components, max_new, stop: &[u32]| {
            speculative_decode(c, &prompt, max_new, stop, &sh, &mut PhaseTimes::default()).unwrap()
        };
        let (long, cycles) = decode(&mut c, 24, &[]);
        assert_eq!(long.len(), 24);
        // Where each cycle left the output: 1 (the prefill's token) + accepted + 1 per cycle.
        let ends: Vec<usize> = cycles
            .iter()
            .scan(1, |n, cy| {
                *n += cy.accepted + 1;
                Some(*n)
            })
            .collect();
        assert!(ends.len() >= 3 && ends[0] < 24, "{cycles:?}");
        for (k, &end) in ends.iter().enumerate().take_while(|(_, &e)| e < 24) {
            // Exactly at the cap after cycle k + 1: k + 1 cycles, the last one kept whole.
            let (out, cy) = decode(&mut c, end, &[]);
            assert_eq!((out.as_slice(), cy.len()), (&long[..end], k + 1), "max_new {end}");
            assert_eq!(cy.last().unwrap().produced, cycles[k].accepted + 1);
            assert!(cy.iter().all(|c| c.produced > 0));
        }
        // One token past a cycle's end: the next cycle runs, and keeps only that token when it
        // accepted more.
        let (out, cy) = decode(&mut c, ends[0] + 1, &[]);
        assert_eq!((out.as_slice(), cy.len()), (&long[..ends[0] + 1], 2));
        assert_eq!(cy[1].produced, 1);
        // The prefill's token is a stop token: no cycle at all.
        let (out, cy) = decode(&mut c, 24, &[long[0]]);
        assert_eq!((out, cy.len()), (vec![long[0]], 0));
    }

    /// z-lab's tau counts every cycle whole; a response is complete at the cap or a stop token.
    #[test]
    fn taus_count_cycles_whole_and_responses_end_at_the_cap_or_a_stop_token() {
        let cycles = [Cycle { accepted: 3, produced: 4 }, Cycle { accepted: 15, produced: 3 }];
        assert_eq!(response_tau(&cycles), Some((4.0 + 16.0) / 2.0));
        assert_eq!(response_tau(&[]), None);
        assert_eq!(kept_len(&[5, 6, 7, 8], 8, &[7]), 3, "through the stop token");
        assert_eq!(kept_len(&[5, 6, 7, 8], 2, &[7]), 2, "the cap first");
        assert_eq!(kept_len(&[5, 6], 8, &[7]), 2);
        assert!(finished(&[5, 6, 8], 3, &[7]), "exactly at the cap: no further cycle");
        assert!(!finished(&[5, 6], 3, &[7]));
        assert!(finished(&[7], 3, &[7]), "a stop token from the prefill");
        assert!(finished(&[5, 7, 6, 6], 8, &[7]));
    }
}
