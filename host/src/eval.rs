//! `dflash-host eval`: real acceptance length by lossless greedy speculative decoding (the DFlash
//! paper's acceptance length). Per cycle the drafter proposes a whole block from the target's features of every
//! accepted token, the target verifies it in one forward with its KV cache, and the longest
//! matching prefix plus the target's own next token (the bonus) are kept; the cache is cropped to
//! what was kept. The output must equal the target's own greedy output token for token.
//!
//! The cycles run as z-lab's `dflash_generate` runs them (full blocks; a cycle while fewer than
//! max_new_tokens + 1 tokens are out; stop after the cycle that produced a stop token), and
//! `tau` is z-lab's benchmark's: accepted + 1 for every cycle, averaged per response, then over
//! responses, so it compares with published numbers. `tau_kept` counts only the tokens kept
//! (up to the stop token and the length cap) per cycle that kept any.

use crate::{
    experiment::{self, checkpoint},
    pipeline::components::Components,
    plugins::Registry,
    say,
};
use anyhow::{anyhow, bail, Result};
use std::path::{Path, PathBuf};
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
    c.names.check(PluginKind::Target, &c.target)?;
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
    c.check_poisoned()?;
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

/// `dflash-host eval`'s arguments.
pub struct EvalCommand {
    pub exp_dir: PathBuf,
    pub checkpoint: Option<u64>,
    pub drafter: Option<PathBuf>,
    pub prompts: String,
    pub prompt_format: PromptFormat,
    pub limit: u32,
    pub max_new_tokens: u32,
}

/// `dflash-host eval`: check the arguments, load the experiment with the checkpoint or drafter,
/// evaluate, print, and write the results file named after what was evaluated.
pub fn command(args: &EvalCommand, plugin_paths: &[PathBuf]) -> Result<()> {
    let exp_dir = &args.exp_dir;
    let mut opts = EvalOptions { source: args.prompts.clone(), limit: args.limit, max_new_tokens: args.max_new_tokens };
    opts.validate()?;
    if !exp_dir.join(experiment::CONFIG).is_file() {
        bail!("{}: not an experiment directory (no config.toml)", exp_dir.display());
    }
    // 1. What is evaluated, and so where its results go; refused now if they cannot be written.
    if args.drafter.is_none() && args.checkpoint.is_none() && prompts_name(&opts.source).is_none() {
        experiment::check_writable(&exp_dir.join("eval.json"))?;
    }
    let evaluated = match &args.drafter {
        Some(d) => {
            let weights = d.join("model.safetensors");
            let sha = crate::plugins::sha256_file(&weights).map_err(|e| anyhow!("--drafter {}: {e:#}", d.display()))?;
            let shown = d.canonicalize().unwrap_or_else(|_| d.clone());
            Evaluated { checkpoint_step: None, drafter: Some(shown.display().to_string()), drafter_sha256: sha }
        }
        None => {
            let ckpt = checkpoint::find(exp_dir, args.checkpoint)?;
            let sha = crate::plugins::sha256_file(&ckpt.dir.join("model.safetensors"))?;
            Evaluated { checkpoint_step: Some(ckpt.step), drafter: None, drafter_sha256: sha }
        }
    };
    let newest = checkpoint::newest_good(exp_dir).0.map(|c| c.step);
    let written = exp_dir.join(evaluated.file_name(prompts_name(&opts.source).as_deref(), newest));
    experiment::check_writable(&written)?;
    // 2. Benchmark files become chat prompts for the data plugin.
    let converted = tempfile_dir()?;
    if args.prompt_format != PromptFormat::Chat {
        if matches!(opts.source.as_str(), "holdout" | "humaneval") {
            bail!("--prompt-format {:?} reads a file: give it with --prompts FILE", args.prompt_format);
        }
        let file = converted.join("prompts.jsonl");
        let n = convert_prompts(Path::new(&opts.source), args.prompt_format, &file)?;
        tracing::info!("{n} {:?} prompts from {}", args.prompt_format, opts.source);
        opts.source = file.display().to_string();
    }
    // 3. Evaluate, with the machine's load before and after the timing.
    let registry = Registry::new(plugin_paths)?;
    let (_, mut c) = crate::run::load_experiment(exp_dir, &registry, evaluated.checkpoint_step, args.drafter.as_deref())?;
    let load_before = loadavg();
    let mut report = evaluate(&mut c, &opts)?;
    let load_after = loadavg();
    let _ = std::fs::remove_dir_all(&converted);
    report.source = args.prompts.clone();
    let tau_hat = experiment::metrics::last_number(exp_dir, "tau_hat");
    let mut json = serde_json::to_value(&report)?;
    json["tau_hat"] = tau_hat.into();
    json["evaluated"] = serde_json::to_value(&evaluated)?;
    json["prompt_format"] = format!("{:?}", args.prompt_format).to_lowercase().into();
    json["loadavg_before"] = load_before.into();
    json["loadavg_after"] = load_after.into();
    // 4. Print, then write the results whole.
    match (&evaluated.drafter, evaluated.checkpoint_step) {
        (Some(d), _) => say!("drafter      {d} (model.safetensors SHA-256 {})", &evaluated.drafter_sha256[..16]),
        (None, Some(s)) => say!("checkpoint   step-{s} (model.safetensors SHA-256 {})", &evaluated.drafter_sha256[..16]),
        (None, None) => {}
    }
    say!("prompts      {} ({})", report.prompts, report.source);
    say!("tau          {:.3}   per response (z-lab's benchmark: accepted + 1 per cycle, the mean over responses)", report.tau);
    say!("tau_pooled   {:.3}   over all {} verify cycles (as SGLang and vLLM report it)", report.tau_pooled, report.cycles);
    say!(
        "tau_kept     {:.3}   tokens kept per cycle; tau_hat from training {}",
        report.tau_kept,
        tau_hat.map_or("-".into(), |t| format!("{t:.3}"))
    );
    let acc: Vec<String> = report.acceptance_per_position.iter().map(|a| format!("{a:.2}")).collect();
    say!("acceptance   {}", acc.join(" "));
    say!("speed-up     {:.2}x  ({:.1} vs {:.1} tok/s target-only)", report.speedup, report.spec_tok_per_s, report.target_tok_per_s);
    if let Some(w) = load_warning(load_before, load_after) {
        tracing::warn!("{w}");
        json["warning"] = w.into();
    }
    say!("lossless     {}", if report.lossless { "yes" } else { "NO" });
    experiment::write_json_atomic(&written, &json)?;
    say!("written      {}", written.display());
    if !report.lossless {
        bail!("speculative decoding differed from the target's greedy output on prompts {:?}", report.mismatches);
    }
    Ok(())
}

/// A private folder for converted prompts.
fn tempfile_dir() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("dflash-eval-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| anyhow!("{}: {e}", dir.display()))?;
    Ok(dir)
}

/// A file-name-safe name for a non-default prompt set (None for `holdout`).
fn prompts_name(source: &str) -> Option<String> {
    (source != "holdout").then(|| {
        let stem = Path::new(source).file_stem().and_then(|s| s.to_str()).unwrap_or(source);
        stem.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect()
    })
}

/// Prompt files of public benchmarks, read by the host into chat prompts (one user turn each).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PromptFormat {
    /// Chat records as `[data]` reads them (a record ending with a user turn is a prompt).
    Chat,
    /// MT-Bench's question.jsonl: `{"turns": ["...", "..."]}` (the first turn).
    MtBench,
    /// GSM8K: `{"question": "...", "answer": "..."}`.
    Gsm8k,
    /// Alpaca: `{"instruction": "...", "input": "..."}` (input appended after a blank line).
    Alpaca,
}

/// One benchmark record's prompt text.
fn benchmark_prompt(format: PromptFormat, v: &serde_json::Value) -> Result<String> {
    let text = |key: &str| v.get(key).and_then(|t| t.as_str()).map(str::to_string);
    match format {
        PromptFormat::MtBench => v
            .get("turns")
            .and_then(|t| t.as_array())
            .and_then(|t| t.first())
            .and_then(|t| t.as_str())
            .map(str::to_string)
            .ok_or_else(|| anyhow!("no `turns` list of strings")),
        PromptFormat::Gsm8k => text("question").ok_or_else(|| anyhow!("no `question` string")),
        PromptFormat::Alpaca => {
            let instruction = text("instruction").ok_or_else(|| anyhow!("no `instruction` string"))?;
            Ok(match text("input").filter(|i| !i.trim().is_empty()) {
                Some(input) => format!("{instruction}\n\n{input}"),
                None => instruction,
            })
        }
        PromptFormat::Chat => unreachable!("chat files go to the data plugin as they are"),
    }
}

/// A benchmark file (JSONL, or a JSON array) as chat JSONL prompts in `out`; errors name the
/// file and line.
pub fn convert_prompts(path: &std::path::Path, format: PromptFormat, out: &std::path::Path) -> Result<usize> {
    let text = input_files::read_to_string_capped(path, 1 << 30)?;
    let records: Vec<(usize, serde_json::Value)> = if text.trim_start().starts_with('[') {
        let all: Vec<serde_json::Value> = serde_json::from_str(&text).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        all.into_iter().enumerate().map(|(i, v)| (i + 1, v)).collect()
    } else {
        let mut v = Vec::new();
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            v.push((i + 1, serde_json::from_str(line).map_err(|e| anyhow!("{}:{}: {e}", path.display(), i + 1))?));
        }
        v
    };
    let mut lines = String::new();
    for (at, v) in &records {
        let prompt = benchmark_prompt(format, v).map_err(|e| anyhow!("{}:{at}: {e} ({format:?} format)", path.display()))?;
        lines.push_str(&serde_json::json!({"messages": [{"role": "user", "content": prompt}]}).to_string());
        lines.push('\n');
    }
    std::fs::write(out, lines).map_err(|e| anyhow!("{}: {e}", out.display()))?;
    Ok(records.len())
}

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
    /// The results file: `eval.json` for the run's newest checkpoint on its held-out records,
    /// else named after the prompt set and the checkpoint or drafter, so no result overwrites
    /// another's.
    pub fn file_name(&self, set: Option<&str>, newest_step: Option<u64>) -> String {
        let what = match (self.checkpoint_step, &self.drafter) {
            (Some(s), _) if set.is_none() && Some(s) == newest_step => return "eval.json".into(),
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

#[cfg(test)]
mod prompt_tests {
    use super::*;

    #[test]
    fn benchmark_files_become_prompts_and_load_moves_are_flagged() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("p.jsonl");
        for (format, text, want) in [
            (PromptFormat::MtBench, "{\"question_id\": 81, \"turns\": [\"Write a poem.\", \"Now shorter.\"]}\n", "Write a poem."),
            (PromptFormat::Gsm8k, "{\"question\": \"2+2?\", \"answer\": \"4\"}\n", "2+2?"),
            (PromptFormat::Alpaca, "[{\"instruction\": \"Sum\", \"input\": \"1 2\", \"output\": \"3\"}]", "Sum\n\n1 2"),
        ] {
            let file = dir.path().join("in.json");
            std::fs::write(&file, text).unwrap();
            assert_eq!(convert_prompts(&file, format, &out).unwrap(), 1);
            let line: serde_json::Value = serde_json::from_str(std::fs::read_to_string(&out).unwrap().trim()).unwrap();
            assert_eq!(line["messages"][0]["content"], want);
            assert_eq!(line["messages"].as_array().unwrap().len(), 1, "a prompt-only record");
        }
        let file = dir.path().join("bad.jsonl");
        std::fs::write(&file, "{\"question\": \"a\"}\n{\"q\": 1}\n").unwrap();
        let e = convert_prompts(&file, PromptFormat::Gsm8k, &out).unwrap_err().to_string();
        assert!(e.contains("bad.jsonl:2: no `question` string"), "{e}");
        assert!(load_warning(Some(0.5), Some(2.5)).is_some());
        assert!(load_warning(Some(8.0), Some(8.9)).is_none());
        assert!(load_warning(None, Some(9.0)).is_none());
        let e = |step, drafter: Option<&str>| Evaluated { checkpoint_step: step, drafter: drafter.map(Into::into), drafter_sha256: "0123456789abcdef".into() };
        assert_eq!(e(Some(8), None).file_name(None, Some(8)), "eval.json");
        assert_eq!(e(Some(4), None).file_name(None, Some(8)), "eval-step-4.json");
        assert_eq!(e(None, Some("/z")).file_name(None, Some(8)), "eval-drafter-0123456789ab.json");
        assert_eq!(e(Some(8), None).file_name(Some("mt_bench"), Some(8)), "eval-mt_bench-step-8.json");
    }
}
