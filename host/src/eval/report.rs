//! What an evaluation reports: acceptance counted three ways, per position, the speed-up, and
//! each prompt's tokens.

use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct EvalReport {
    pub source: String,
    pub prompts: usize,
    pub block_size: usize,
    /// Draft tokens verified a cycle (`--draft-tokens`; block_size - 1 unless fewer were asked).
    pub draft_tokens: usize,
    /// With `--draft-vocab`: the tokens drafts were chosen among, and the share of the training
    /// split's predicted tokens they cover.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub draft_vocab: Option<DraftVocabReport>,
    /// How both decodings ran (the target alone, then speculatively): greedy (argmax), at most
    /// `max_new_tokens` new tokens a prompt, ending at a stop token (included).
    pub decoding: &'static str,
    pub max_new_tokens: u32,
    pub stop_token_ids: Vec<u32>,
    /// z-lab's benchmark's acceptance length: per response the mean of accepted drafts + 1 over
    /// its cycles (the last one whole), then the mean over responses.
    pub tau: f64,
    pub tau_per_response: Vec<f64>,
    /// SGLang's accept length: the tokens kept (cut at the stop token and the length cap) over
    /// all verify cycles, pooled over responses.
    pub tau_kept: f64,
    /// vLLM's mean acceptance length: all accepted drafts + 1 over all verify cycles, pooled over
    /// responses.
    pub tau_pooled: f64,
    /// Share of cycles whose k-th drafted token was accepted, k = 1..draft_tokens.
    pub acceptance_per_position: Vec<f64>,
    pub cycles: usize,
    pub new_tokens: usize,
    /// Target-only greedy decoding vs speculative decoding, one sequence at a time.
    pub target_tok_per_s: f64,
    pub spec_tok_per_s: f64,
    pub speedup: f64,
    /// Where it ran (`cpu`, `cuda:0`).
    pub device: String,
    /// Milliseconds per cycle in each phase, with `--time-split`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cycle_ms: Option<CycleMs>,
    /// Milliseconds per prompt in the target's prefill (the prompt and its first token), with
    /// `--time-split`: outside the cycles.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_ms: Option<f64>,
    /// Every response equal to the target's own greedy output.
    pub lossless: bool,
    pub mismatches: Vec<usize>,
    /// Where each differing response first differs, and how near a tie the target had there.
    pub divergences: Vec<Divergence>,
    /// Per prompt: its token ids, the target's greedy reply and the speculative one (written
    /// beside the results with `--keep-tokens`).
    #[serde(skip)]
    pub tokens: Vec<PromptTokens>,
}

/// One prompt's token ids and the two decodings' new tokens.
#[derive(Debug, Clone, Serialize)]
pub struct PromptTokens {
    pub prompt: usize,
    pub prompt_ids: Vec<u32>,
    pub target_ids: Vec<u32>,
    pub speculative_ids: Vec<u32>,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct DraftVocabReport {
    pub tokens: usize,
    pub coverage: f64,
}

/// Mean milliseconds per cycle spent drafting, verifying and on the bookkeeping between.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct CycleMs {
    pub draft: f64,
    pub verify: f64,
    pub bookkeeping: f64,
}

/// The first new token where the two responses differ.
#[derive(Debug, Clone, Serialize)]
pub struct Divergence {
    pub prompt: usize,
    /// Its index among the new tokens (0 = the target's first).
    pub token: usize,
    /// The token each chose there; None where that response had already ended.
    pub target_id: Option<u32>,
    pub speculative_id: Option<u32>,
    /// The target's two largest logits there, from one forward over the prompt and the tokens
    /// both responses share (a third rounding: the gap, not which token leads, is the point).
    pub top_logits: [f64; 2],
}
