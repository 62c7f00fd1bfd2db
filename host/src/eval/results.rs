//! The results, printed and as a file: the report with what was evaluated (a checkpoint or a
//! drafter folder, and its weights' hash), named so that no result overwrites another's; the
//! decoded tokens beside it; the machine's load around the timing.

use super::{
    prompts::PromptFormat,
    report::{EvalReport, PromptTokens},
};
use crate::{
    experiment::{self, checkpoint},
    say,
};
use anyhow::Result;
use serde::Serialize;
use std::path::{Path, PathBuf};

/// What a results file holds: the report, the training tau-hat beside it, what was evaluated,
/// and the machine's load before and after the timing.
pub fn results_json(
    report: &EvalReport,
    evaluated: &Evaluated,
    exp_dir: &Path,
    format: PromptFormat,
    dtype: &str,
    (load_before, load_after): (Option<f64>, Option<f64>),
) -> Result<serde_json::Value> {
    let mut json = serde_json::to_value(report)?;
    json["dtype"] = dtype.into();
    json["tau_hat"] = experiment::metrics::last_number(exp_dir, "tau_hat").into();
    json["evaluated"] = serde_json::to_value(evaluated)?;
    json["prompt_format"] = format!("{format:?}").to_lowercase().into();
    json["loadavg_before"] = load_before.into();
    json["loadavg_after"] = load_after.into();
    Ok(json)
}

/// The decoded token ids beside a results file: `eval.json` -> `eval.tokens.jsonl`.
pub fn tokens_file(results: &Path) -> PathBuf {
    let stem = results.file_stem().map_or("eval".into(), |s| s.to_string_lossy().to_string());
    results.with_file_name(format!("{stem}.tokens.jsonl"))
}

/// One JSON line per prompt, written whole (a temporary file renamed over).
pub(super) fn write_tokens(path: &Path, tokens: &[PromptTokens]) -> Result<()> {
    let mut text = String::new();
    for t in tokens {
        text += &serde_json::to_string(t)?;
        text.push('\n');
    }
    crate::atomic_write::write_atomic(path, text.as_bytes())
}

/// The results of the newest checkpoint on the validation prompts.
pub const VALIDATION_FILE: &str = "eval-validation.json";

/// What was evaluated: a checkpoint of the run, or a z-lab drafter folder and its weights' hash.
#[derive(Debug, Clone, Serialize)]
pub struct Evaluated {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint_step: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drafter: Option<String>,
    /// SHA-256 of the drafter's model.safetensors (the checkpoint's or the folder's).
    pub drafter_sha256: String,
}

impl Evaluated {
    /// A checkpoint of the run (opened by [`checkpoint::find`]) and its weights' hash.
    pub fn checkpoint(ckpt: &checkpoint::Opened) -> Self {
        Evaluated { checkpoint_step: Some(ckpt.step), drafter: None, drafter_sha256: ckpt.weights_sha256.clone() }
    }

    /// The results file: `eval.json` for the run's newest checkpoint on its held-out test
    /// records (`eval-validation.json` on its validation records), else named after the prompt
    /// set and the checkpoint or drafter, so no result overwrites another's.
    pub fn file_name(&self, set: Option<&str>, newest_step: Option<u64>) -> String {
        let what = match (self.checkpoint_step, &self.drafter) {
            (Some(s), _) if set.is_none() && Some(s) == newest_step => return "eval.json".into(),
            (Some(s), _) if set == Some("validation") && Some(s) == newest_step => return VALIDATION_FILE.into(),
            (Some(s), _) => format!("step-{s}"),
            (None, _) => format!("drafter-{}", &self.drafter_sha256[..12]),
        };
        match set {
            Some(set) => format!("eval-{set}-{what}.json"),
            None => format!("eval-{what}.json"),
        }
    }
}

/// The 1-minute load average (Linux), to tell whether the machine was as busy after the
/// measurement as before it.
pub fn loadavg() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg").ok()?.split_whitespace().next()?.parse().ok()
}

/// A warning when the load moved by more than 1 or a quarter during the timing.
pub fn load_warning(before: Option<f64>, after: Option<f64>) -> Option<String> {
    let (b, a) = (before?, after?);
    ((a - b).abs() > 1.0_f64.max(0.25 * b.max(a))).then(|| {
        format!("the machine's load moved from {b:.2} to {a:.2} during the measurement: the speed-up is unreliable (measure on an idle machine)")
    })
}

/// The report on the terminal: what was evaluated, tau three ways, acceptance per position, the
/// speed-up and, with `--time-split`, each phase of a cycle.
pub(super) fn print(report: &EvalReport, evaluated: &Evaluated, tau_hat: Option<f64>) {
    match (&evaluated.drafter, evaluated.checkpoint_step) {
        (Some(d), _) => say!("drafter      {d} (model.safetensors SHA-256 {})", &evaluated.drafter_sha256[..16]),
        (None, Some(s)) => {
            say!("checkpoint   step-{s} (model.safetensors SHA-256 {})", &evaluated.drafter_sha256[..16])
        }
        (None, None) => {}
    }
    say!("prompts      {} ({})", report.prompts, report.source);
    say!(
        "tau          {:.3}   per response (z-lab's benchmark: accepted + 1 per cycle, the mean over responses)",
        report.tau
    );
    say!(
        "tau_pooled   {:.3}   accepted + 1 over all {} verify cycles (vLLM's mean acceptance length)",
        report.tau_pooled,
        report.cycles
    );
    say!(
        "tau_kept     {:.3}   tokens kept over all cycles (SGLang's accept length); tau_hat from training {}",
        report.tau_kept,
        tau_hat.map_or("-".into(), |t| format!("{t:.3}"))
    );
    let acc: Vec<String> = report.acceptance_per_position.iter().map(|a| format!("{a:.2}")).collect();
    let verified = if report.draft_tokens + 1 < report.block_size {
        format!("   ({} of the block's {} drafts verified a cycle)", report.draft_tokens, report.block_size - 1)
    } else {
        String::new()
    };
    say!("acceptance   {}{verified}", acc.join(" "));
    if let Some(v) = report.draft_vocab {
        say!(
            "draft vocab  {} tokens ({:.2}% of the training split's predicted tokens; the target verifies against all)",
            v.tokens,
            100.0 * v.coverage
        );
    }
    say!(
        "speed-up     {:.2}x  ({:.1} vs {:.1} tok/s target-only, {})",
        report.speedup,
        report.spec_tok_per_s,
        report.target_tok_per_s,
        report.device
    );
    if let Some(ms) = report.cycle_ms {
        say!("cycle        {:.2} ms draft, {:.2} ms verify, {:.2} ms bookkeeping", ms.draft, ms.verify, ms.bookkeeping);
    }
    if let Some(ms) = report.prefill_ms {
        say!("prefill      {ms:.2} ms a prompt (the target over the prompt, before the first cycle)");
    }
}
