//! `dflash-host eval`'s arguments, read by [`super::command`].

use crate::dist::launch::nproc;
use clap::Args;
use std::path::PathBuf;

#[derive(Args)]
pub struct EvalArgs {
    #[arg(long)]
    pub exp_dir: PathBuf,
    /// Checkpoint step (default: the newest).
    #[arg(long)]
    pub checkpoint: Option<u64>,
    /// Evaluate this z-lab format drafter folder instead of a checkpoint.
    #[arg(long)]
    pub drafter: Option<PathBuf>,
    /// `holdout` (the test records the config holds out; never trained on), `validation`
    /// (its validation records, `validation` in [data]), `humaneval`, or a file (chat
    /// records, or a benchmark's: see --prompt-format).
    #[arg(long, default_value = "holdout")]
    pub prompts: String,
    /// How the --prompts file is laid out: chat records as [data] reads them, MT-Bench
    /// (`turns`), GSM8K (`question`) or Alpaca (`instruction` / `input`).
    #[arg(long, value_enum, default_value = "chat")]
    pub prompt_format: super::prompts::PromptFormat,
    /// Prompts to evaluate.
    #[arg(long, default_value_t = 32)]
    pub limit: u32,
    /// Tokens to decode a prompt, at most 131072.
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: u32,
    /// Also time each prompt's prefill and each cycle's phases (draft, verify, bookkeeping),
    /// waiting for the device after each: slows decoding slightly.
    #[arg(long)]
    pub time_split: bool,
    /// Draft tokens verified a cycle: the first N of the block's B-1 proposals (default: all).
    /// Fewer make the verify forward and the drafter's head cheaper where the target's cost grows
    /// with the tokens it verifies, as on a CPU; serving engines take the same number (vLLM's and
    /// SGLang's speculative tokens), with the drafter unchanged.
    #[arg(long, value_name = "N")]
    pub draft_tokens: Option<u32>,
    /// Draft only among the K tokens the drafter was trained to predict most often (from one
    /// pass over the training split): its LM head cut to those rows, a cheaper draft where the
    /// head is much of it, as on a CPU. The target verifies against its whole vocabulary, so the
    /// output is unchanged; the exported drafter is not affected.
    #[arg(long, value_name = "K")]
    pub draft_vocab: Option<u32>,
    /// Decode in this precision instead of the run's `dtype`: `f32` checks exactness (in bf16 the
    /// verify forward over a block rounds differently from one token at a time, so near-ties can
    /// flip), e.g. for a drafter trained in bf16 on a CPU with bf16 matrix units.
    #[arg(long, value_parser = ["f32", "bf16"])]
    pub dtype: Option<String>,
    /// Run every decoding forward op by op. By default decoding on a CUDA device keeps keys and
    /// values in static buffers and replays each forward shape as a CUDA graph, as serving
    /// engines do (the target alone and speculatively alike; families of softmax attention
    /// without sliding windows, on one rank). The same as `DFLASH_CUDA_GRAPHS=0`.
    #[arg(long)]
    pub eager: bool,
    /// Keep the decoded token ids: per prompt its ids, the target's greedy reply and the
    /// speculative one, as JSON lines beside the results (`eval.json` -> `eval.tokens.jsonl`),
    /// to compare with a serving engine's output without decoding again.
    #[arg(long)]
    pub keep_tokens: bool,
    /// Start N local ranks (a target replica over N ranks, `[target] tensor_parallel = N`):
    /// rank 0 evaluates, the others serve its target.
    #[arg(long, value_name = "N", value_parser = nproc)]
    pub nproc: Option<usize>,
}
