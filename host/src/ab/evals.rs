//! `[eval]` in an A/B: after a run, real tau by speculative decoding of its newest checkpoint,
//! in this process, into the files `eval` would write: `eval.json` on the test prompts (the runs
//! compared) and `eval-validation.json` on the validation prompts where `select = "val_tau"`
//! chooses by it (every run then; nothing else reads it). A file already there is kept, so a
//! rerun of the A/B does not redo it.

use crate::{
    eval::{self, EvalOptions, Evaluated, PromptFormat},
    experiment,
    plugins::Registry,
};
use anyhow::{Context, Result};
use serde::Deserialize;
use std::path::Path;

/// `[eval]`: after each run, real tau by speculative decoding of the newest checkpoint on the
/// validation prompts (`eval-validation.json`, when `select = "val_tau"` chooses by it) and, for
/// the runs compared, on the test prompts (`eval.json`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EvalSpec {
    /// Prompts per set.
    #[serde(default = "default_eval_limit")]
    pub limit: u32,
    #[serde(default = "default_eval_tokens")]
    pub max_new_tokens: u32,
}

fn default_eval_limit() -> u32 {
    32
}
fn default_eval_tokens() -> u32 {
    64
}

/// A prompt set an A/B evaluates on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptSet {
    Validation,
    Test,
}

impl PromptSet {
    /// The data plugin's name for it.
    fn source(self) -> &'static str {
        match self {
            PromptSet::Validation => "validation",
            PromptSet::Test => "holdout",
        }
    }

    fn file(self) -> &'static str {
        match self {
            PromptSet::Validation => eval::VALIDATION_FILE,
            PromptSet::Test => "eval.json",
        }
    }
}

/// `[eval]` needs both prompt sets: checked before any run where the data plugin says how many
/// records it holds out (`splits`: validation, holdout).
pub fn check(splits: Option<(u64, u64)>) -> Result<()> {
    if let Some((validation, holdout)) = splits {
        if validation == 0 || holdout == 0 {
            anyhow::bail!(
                "[eval] decodes the validation and the test prompts, but [data] has `validation = {validation}`, `eval_holdout = {holdout}`: hold records out for both"
            );
        }
    }
    Ok(())
}

/// Evaluate `dir`'s newest checkpoint on each of `sets` whose results file is missing (the
/// target and drafter loaded once for all).
pub fn ensure(dir: &Path, registry: &Registry, spec: &EvalSpec, sets: &[PromptSet]) -> Result<()> {
    let missing: Vec<PromptSet> = sets.iter().copied().filter(|s| !dir.join(s.file()).exists()).collect();
    if missing.is_empty() {
        return Ok(());
    }
    let ckpt = crate::experiment::checkpoint::find(dir, None)?;
    let evaluated = Evaluated::checkpoint(&ckpt);
    let (cfg, mut c) = crate::pipeline::assemble::load_experiment(
        dir,
        registry,
        crate::pipeline::assemble::DrafterFrom::Checkpoint(ckpt),
        None,
    )?;
    eval::open_data(&mut c)?;
    for set in missing {
        let opts = EvalOptions {
            source: set.source().into(),
            limit: spec.limit,
            max_new_tokens: spec.max_new_tokens,
            time_split: false,
            draft_tokens: None,
            draft_vocab: None,
        };
        let loads = eval::loadavg();
        let report = eval::evaluate_opened(&mut c, &opts, None)
            .with_context(|| format!("[eval] of {} on its {} prompts", dir.display(), set.source()))?;
        let json =
            eval::results_json(&report, &evaluated, dir, PromptFormat::Chat, cfg.dtype(), (loads, eval::loadavg()))?;
        experiment::write_json_atomic(&dir.join(set.file()), &json)?;
        tracing::info!(
            "{}: tau {:.3} on {} {} prompts (step {}){}",
            dir.join(set.file()).display(),
            report.tau,
            report.prompts,
            set.source(),
            evaluated.checkpoint_step.unwrap_or(0),
            if report.lossless {
                String::new()
            } else {
                format!("; NOT lossless on {} of them ({})", report.mismatches.len(), cfg.dtype())
            }
        );
    }
    Ok(())
}
