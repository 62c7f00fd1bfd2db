//! `dflash-host eval`: real acceptance length, and the wall-clock speed-up over the target's own
//! greedy decoding, by lossless greedy speculative decoding of held-out or benchmark prompts
//! ([`decode`]); the results file is named after what was evaluated. Acceptance is counted three
//! ways: z-lab's per response (`tau`), vLLM's pooled (`tau_pooled`) and SGLang's pooled
//! (`tau_kept`). Progress (prompts, τ so far, tokens/s, ETA) goes to stderr as it runs.

pub mod args;
mod decode;
mod prompts;

pub use decode::{response_tau, speculative_decode, Cycle, PhaseTimes, Shared};
pub use prompts::{convert_prompts, PromptFormat};

use crate::{
    experiment::{self, checkpoint},
    pipeline::{components::Components, replicas},
    plugins::Registry,
    progress::{Pace, Progress},
    say,
};
use anyhow::{anyhow, bail, Result};
use plugin_api::tch::{Device, Kind, Tensor};
use prompts::{prompts_name, tempfile_dir};
use serde::Serialize;
use std::{
    path::{Path, PathBuf},
    time::Instant,
};

pub struct EvalOptions {
    /// `holdout`, `validation`, `humaneval` or a chat JSONL file, through the data plugin.
    pub source: String,
    pub limit: u32,
    pub max_new_tokens: u32,
    /// Wait for the device after each phase of a cycle to time the phases apart (the waits
    /// slow decoding a little, so the speed-up is best read without them).
    pub time_split: bool,
}

/// The most `--max-new-tokens` a prompt: the longest context of the targets in use (128K).
pub const MAX_NEW_TOKENS: u32 = 131_072;

impl EvalOptions {
    /// Refuse what could only give an empty or misleading report, before anything is loaded: no
    /// prompts, no tokens, a prompts "file" that is a FIFO or device.
    pub fn validate(&self) -> Result<()> {
        if self.limit == 0 {
            bail!("--limit 0: evaluate at least one prompt");
        }
        if self.max_new_tokens < 2 {
            bail!(
                "--max-new-tokens {}: the target's own first token would end every response, with no draft verified \
                 (no acceptance to measure); give at least 2",
                self.max_new_tokens
            );
        }
        if self.max_new_tokens > MAX_NEW_TOKENS {
            bail!(
                "--max-new-tokens {}: at most {MAX_NEW_TOKENS} (a reply that long is beyond any target's context)",
                self.max_new_tokens
            );
        }
        if !is_named_set(&self.source) {
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
    /// Share of cycles whose k-th drafted token was accepted, k = 1..B-1.
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
    /// Every response equal to the target's own greedy output.
    pub lossless: bool,
    pub mismatches: Vec<usize>,
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

/// Mean milliseconds per cycle spent drafting, verifying and on the bookkeeping between.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct CycleMs {
    pub draft: f64,
    pub verify: f64,
    pub bookkeeping: f64,
}

pub fn evaluate(c: &mut Components, opts: &EvalOptions) -> Result<EvalReport> {
    open_data(c)?;
    evaluate_opened(c, opts)
}

/// Open the data plugin with the target's tokenizer (once for any number of prompt sets).
pub fn open_data(c: &mut Components) -> Result<()> {
    let tokenizer = c.target.tokenizer_json()?;
    c.data.open(&tokenizer)?;
    Ok(())
}

/// [`evaluate`] with the data plugin opened already.
pub fn evaluate_opened(c: &mut Components, opts: &EvalOptions) -> Result<EvalReport> {
    let prompts = c.data.eval_prompts(&opts.source, opts.limit)?;
    if prompts.is_empty() {
        bail!("no evaluation prompts from `{}`", opts.source);
    }
    let (embedding, block_size) = (c.target.embedding()?, c.drafter.block_size()? as usize);
    let device = embedding.device();
    let shared = Shared {
        mask_ids: Tensor::full([1, block_size as i64 - 1], c.drafter.mask_token_id()? as i64, (Kind::Int64, device)),
        embedding,
        lm_head: c.target.lm_head()?,
        layer_ids: c.drafter.target_layer_ids()?,
        block_size,
        time_split: opts.time_split,
    };
    let stop = [c.target.spec()?.eos_token_id];
    let (mut t_target, mut t_spec, mut n_target, mut n_spec) = (0.0, 0.0, 0usize, 0usize);
    let mut taus = Vec::new();
    let mut mismatches = Vec::new();
    let mut tokens = Vec::new();
    let mut accepted_at = vec![0usize; shared.block_size - 1];
    let (mut all_cycles, mut all_accepted, mut all_kept) = (0usize, 0usize, 0usize);
    let mut times = PhaseTimes::default();
    // Decoding gives attention a new key length every call: no per-shape cuDNN plans.
    let _no_cudnn = kernels::CudnnAttentionOff::new();
    tracing::info!(
        "eval: {} prompts, at most {} new tokens each, decoded by the target alone, then speculatively",
        prompts.len(),
        opts.max_new_tokens
    );
    // Warm-up, untimed: the first calls on a GPU pay for kernel loading and allocator growth.
    if device.is_cuda() {
        let warm = opts.max_new_tokens.min(16);
        c.target.generate(vec![prompts[0].clone()], warm, &stop)?;
        speculative_decode(c, &prompts[0], warm as usize, &stop, &shared, &mut PhaseTimes::default())?;
    }
    let mut progress = Progress::new("eval", "prompts", prompts.len() as u64);
    // Prompts differ in length: the ETA goes by the mean over all of them.
    let mut pace = Pace::new(0, prompts.len());
    for (i, prompt) in prompts.iter().enumerate() {
        let t0 = Instant::now();
        let base = c.target.generate(vec![prompt.clone()], opts.max_new_tokens, &stop)?.remove(0);
        t_target += t0.elapsed().as_secs_f64();
        n_target += base.len();
        let t1 = Instant::now();
        let (spec, cycles) = speculative_decode(c, prompt, opts.max_new_tokens as usize, &stop, &shared, &mut times)?;
        t_spec += t1.elapsed().as_secs_f64();
        n_spec += spec.len();
        if spec != base {
            progress
                .suspend(|| tracing::debug!("prompt {i}: speculative output differs from the target's greedy output"));
            mismatches.push(i);
        }
        tokens.push(PromptTokens {
            prompt: i,
            prompt_ids: prompt.to_vec(),
            target_ids: base.to_vec(),
            speculative_ids: spec.to_vec(),
        });
        // tau per response (z-lab): accepted + 1 per cycle (the prefill's first token is no cycle).
        taus.extend(response_tau(&cycles));
        all_cycles += cycles.len();
        all_accepted += cycles.iter().map(|c| c.accepted + 1).sum::<usize>();
        all_kept += cycles.iter().map(|c| c.produced).sum::<usize>();
        for cy in &cycles {
            for slot in accepted_at.iter_mut().take(cy.accepted) {
                *slot += 1;
            }
        }
        pace.record(t0.elapsed().as_secs_f64());
        let status = format!(
            "τ {:.3} pooled over {all_cycles} cycles  {:.1} tok/s speculative, {:.1} target-only",
            all_accepted as f64 / all_cycles.max(1) as f64,
            n_spec as f64 / t_spec.max(1e-9),
            n_target as f64 / t_target.max(1e-9),
        );
        progress.update(i as u64 + 1, &status, pace.eta((prompts.len() - i - 1) as u64));
    }
    progress.finish();
    if all_cycles == 0 {
        bail!(
            "no draft was verified: every response ended at the target's first token (a stop token); \
             no acceptance to measure on these prompts"
        );
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    Ok(EvalReport {
        source: opts.source.clone(),
        prompts: prompts.len(),
        block_size: shared.block_size,
        decoding: "greedy",
        max_new_tokens: opts.max_new_tokens,
        stop_token_ids: stop.to_vec(),
        tau: mean(&taus),
        tau_kept: all_kept as f64 / all_cycles as f64,
        tau_pooled: all_accepted as f64 / all_cycles as f64,
        tau_per_response: taus,
        acceptance_per_position: accepted_at.iter().map(|&n| n as f64 / all_cycles as f64).collect(),
        cycles: all_cycles,
        new_tokens: n_spec,
        target_tok_per_s: n_target as f64 / t_target,
        spec_tok_per_s: n_spec as f64 / t_spec,
        speedup: t_target / t_spec * (n_spec as f64 / n_target.max(1) as f64),
        device: match device {
            Device::Cuda(i) => format!("cuda:{i}"),
            other => format!("{other:?}").to_lowercase(),
        },
        cycle_ms: opts.time_split.then(|| {
            let per = |t: f64| 1e3 * t / all_cycles.max(1) as f64;
            CycleMs { draft: per(times.draft), verify: per(times.verify), bookkeeping: per(times.bookkeeping) }
        }),
        lossless: mismatches.is_empty(),
        mismatches,
        tokens,
    })
}

/// `dflash-host eval`: check the arguments, load the experiment with the checkpoint or drafter,
/// evaluate, print, and write the results file named after what was evaluated.
pub fn command(args: &args::EvalArgs, plugin_paths: &[PathBuf]) -> Result<()> {
    let exp_dir = &args.exp_dir;
    let mut opts = EvalOptions {
        source: args.prompts.clone(),
        limit: args.limit,
        max_new_tokens: args.max_new_tokens,
        time_split: args.time_split,
    };
    opts.validate()?;
    if !exp_dir.join(experiment::CONFIG).is_file() {
        bail!("{}: not an experiment directory (no config.toml)", exp_dir.display());
    }
    // Under a launcher, a target replica over several ranks: rank 0 evaluates, the others serve
    // its target.
    if crate::dist::DistEnv::from_env()?.is_some() {
        let (cfg, config_dir) = crate::pipeline::assemble::experiment_config(exp_dir, args.drafter.as_deref())?;
        if let Some(follower) = replicas::one_replica(&cfg.target, "eval")?.filter(|(_, l)| !l.is_lead()) {
            let registry = Registry::new(plugin_paths)?;
            let config_path = exp_dir.join(experiment::CONFIG);
            replicas::serve(&cfg, &config_path, &config_dir, &registry, exp_dir, follower)?;
            return Ok(());
        }
    }
    // 1. What is evaluated, and so where its results go; refused now if they cannot be written.
    if args.drafter.is_none() && args.checkpoint.is_none() && prompts_name(&opts.source).is_none() {
        crate::atomic_write::check_writable(&exp_dir.join("eval.json"))?;
    }
    // The checkpoint is opened once, here: its files are read from those handles, so a training
    // run pruning it meanwhile cannot take it away.
    let (evaluated, from) = match &args.drafter {
        Some(d) => {
            // Its config is checked here too, so a FIFO or device there is named before the
            // target loads (the drafter plugin reads both through `input_files` again).
            input_files::open_regular(&d.join("config.json")).map_err(|e| anyhow!("--drafter {}: {e}", d.display()))?;
            let weights = d.join("model.safetensors");
            let sha = crate::plugins::sha256_file(&weights).map_err(|e| anyhow!("--drafter {}: {e:#}", d.display()))?;
            let shown = d.canonicalize().unwrap_or_else(|_| d.clone());
            let evaluated =
                Evaluated { checkpoint_step: None, drafter: Some(shown.display().to_string()), drafter_sha256: sha };
            (evaluated, crate::pipeline::assemble::DrafterFrom::Folder(d))
        }
        None => {
            let ckpt = checkpoint::find(exp_dir, args.checkpoint)?;
            (Evaluated::checkpoint(&ckpt), crate::pipeline::assemble::DrafterFrom::Checkpoint(ckpt))
        }
    };
    let newest = checkpoint::newest_good(exp_dir).0.map(|c| c.step);
    let written = exp_dir.join(evaluated.file_name(prompts_name(&opts.source).as_deref(), newest));
    crate::atomic_write::check_writable(&written)?;
    // 2. Benchmark files become chat prompts for the data plugin.
    let converted = tempfile_dir()?;
    if args.prompt_format != PromptFormat::Chat {
        if is_named_set(&opts.source) {
            bail!("--prompt-format {:?} reads a file: give it with --prompts FILE", args.prompt_format);
        }
        let file = converted.join("prompts.jsonl");
        let n = convert_prompts(Path::new(&opts.source), args.prompt_format, &file)?;
        tracing::info!("{n} prompts ({}) from {}", args.prompt_format, opts.source);
        opts.source = file.display().to_string();
    }
    // 3. Evaluate, with the machine's load before and after the timing.
    let registry = Registry::new(plugin_paths)?;
    let (cfg, c) = crate::pipeline::assemble::load_experiment(exp_dir, &registry, from)?;
    let (mut c, held) = replicas::drive(&cfg, c, exp_dir, "eval")?;
    let load_before = loadavg();
    let mut report = evaluate(&mut c, &opts)?;
    let load_after = loadavg();
    // The target's last call, then the heartbeat the replica's other ranks watch.
    drop(c);
    drop(held);
    let _ = std::fs::remove_dir_all(&converted);
    report.source = args.prompts.clone();
    let mut json = results_json(&report, &evaluated, exp_dir, args.prompt_format, (load_before, load_after))?;
    let tau_hat = json["tau_hat"].as_f64();
    // 4. Print, then write the results whole.
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
    say!("acceptance   {}", acc.join(" "));
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
    if let Some(w) = load_warning(load_before, load_after) {
        tracing::warn!("{w}");
        json["warning"] = w.into();
    }
    // In 16-bit floats the verify forward over a block rounds differently from decoding one
    // token at a time, so a near-tie between two tokens can fall the other way: a difference
    // there is no fault of the drafter or the cache (both runs are the target's own greedy
    // choices), and only an f32 run checks exactness.
    let exact = cfg.dtype() == "f32";
    say!(
        "lossless     {}",
        if report.lossless {
            "yes".to_string()
        } else {
            format!("NO ({} of {} responses)", report.mismatches.len(), report.prompts)
        }
    );
    if args.keep_tokens {
        let file = tokens_file(&written);
        json["tokens_file"] = file.file_name().map(|n| n.to_string_lossy().to_string()).into();
        write_tokens(&file, &report.tokens)?;
        say!("tokens       {} (per prompt: its ids, the target's reply, the speculative one)", file.display());
    }
    experiment::write_json_atomic(&written, &json)?;
    say!("written      {}", written.display());
    if !report.lossless {
        let which = format!("prompts {:?}", report.mismatches);
        if exact {
            bail!("speculative decoding differed from the target's greedy output on {which}");
        }
        tracing::warn!(
            "speculative decoding differed from one-token greedy decoding on {which}: in {} the block's verify forward rounds differently, \
             which can flip near-ties; evaluate with dtype = \"f32\" to check exactness",
            cfg.dtype()
        );
    }
    Ok(())
}

/// What a results file holds: the report, the training tau-hat beside it, what was evaluated,
/// and the machine's load before and after the timing.
pub fn results_json(
    report: &EvalReport,
    evaluated: &Evaluated,
    exp_dir: &Path,
    format: PromptFormat,
    (load_before, load_after): (Option<f64>, Option<f64>),
) -> Result<serde_json::Value> {
    let mut json = serde_json::to_value(report)?;
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
fn write_tokens(path: &Path, tokens: &[PromptTokens]) -> Result<()> {
    let mut text = String::new();
    for t in tokens {
        text += &serde_json::to_string(t)?;
        text.push('\n');
    }
    crate::atomic_write::write_atomic(path, text.as_bytes())
}

/// The results of the newest checkpoint on the validation prompts.
pub const VALIDATION_FILE: &str = "eval-validation.json";

/// Prompt sets the data plugin knows by name (anything else is a file).
fn is_named_set(source: &str) -> bool {
    matches!(source, "holdout" | "validation" | "humaneval")
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_that_give_no_evaluation_are_refused() {
        let opts = |source: &str, limit, max_new_tokens| EvalOptions {
            source: source.into(),
            limit,
            max_new_tokens,
            time_split: false,
        };
        opts("holdout", 32, 64).validate().unwrap();
        opts("validation", 32, 64).validate().unwrap();
        let err = opts("holdout", 0, 64).validate().unwrap_err().to_string();
        assert!(err.starts_with("--limit 0"), "{err}");
        let err = opts("holdout", 32, 0).validate().unwrap_err().to_string();
        assert!(err.starts_with("--max-new-tokens 0"), "{err}");
        // One token is the prefill's: the engines verify no draft for it.
        let err = opts("holdout", 32, 1).validate().unwrap_err().to_string();
        assert!(
            err.starts_with("--max-new-tokens 1: the target's own first token") && err.ends_with("give at least 2")
        );
        let err = opts("/dev/zero", 32, 64).validate().unwrap_err().to_string();
        assert_eq!(err, "--prompts /dev/zero: not a regular file (a character device)");
        let err = opts("nope.jsonl", 32, 64).validate().unwrap_err().to_string();
        assert_eq!(err, "--prompts nope.jsonl: no such file");
    }

    #[test]
    fn load_moves_are_flagged_and_results_files_named_after_what_was_evaluated() {
        assert!(load_warning(Some(0.5), Some(2.5)).is_some());
        assert!(load_warning(Some(8.0), Some(8.9)).is_none());
        assert!(load_warning(None, Some(9.0)).is_none());
        let e = |step, drafter: Option<&str>| Evaluated {
            checkpoint_step: step,
            drafter: drafter.map(Into::into),
            drafter_sha256: "0123456789abcdef".into(),
        };
        assert_eq!(e(Some(8), None).file_name(None, Some(8)), "eval.json");
        assert_eq!(e(Some(4), None).file_name(None, Some(8)), "eval-step-4.json");
        assert_eq!(e(None, Some("/z")).file_name(None, Some(8)), "eval-drafter-0123456789ab.json");
        assert_eq!(e(Some(8), None).file_name(Some("mt_bench"), Some(8)), "eval-mt_bench-step-8.json");
        assert_eq!(e(Some(8), None).file_name(Some("validation"), Some(8)), "eval-validation.json");
        assert_eq!(e(Some(4), None).file_name(Some("validation"), Some(8)), "eval-validation-step-4.json");
    }
}
