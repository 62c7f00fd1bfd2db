//! `dflash-host eval`: real acceptance length, and the wall-clock speed-up over the target's own
//! greedy decoding, by lossless greedy speculative decoding of held-out or benchmark prompts
//! ([`decode`]); the results file is named after what was evaluated. Acceptance is counted three
//! ways: z-lab's per response (`tau`), vLLM's pooled (`tau_pooled`) and SGLang's pooled
//! (`tau_kept`). Progress (prompts, τ so far, tokens/s, ETA) goes to stderr as it runs.

pub mod args;
mod decode;
mod divergence;
mod draft_vocab;
mod prompts;
mod report;
mod results;

pub use decode::{response_tau, speculative_decode, Cycle, PhaseTimes, Shared};
pub use draft_vocab::DraftVocab;
pub use prompts::{convert_prompts, PromptFormat};
pub use report::{CycleMs, EvalReport, PromptTokens};
pub use results::{load_warning, loadavg, results_json, tokens_file, Evaluated, VALIDATION_FILE};

use crate::{
    experiment::{self, checkpoint},
    pipeline::{components::Components, replicas},
    plugins::Registry,
    progress::{Pace, Progress},
    say,
};
use anyhow::{anyhow, bail, Result};
use decode::DraftHead;
use plugin_api::tch::{Device, Kind, Tensor};
use prompts::{prompts_name, tempfile_dir};
use report::Divergence;
use report::DraftVocabReport;
use results::write_tokens;
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
    /// Draft tokens verified a cycle (`--draft-tokens`); None: all of the block's B-1.
    pub draft_tokens: Option<u32>,
    /// Draft among the training split's K most frequent predicted tokens (`--draft-vocab`).
    pub draft_vocab: Option<u32>,
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
        if self.draft_vocab == Some(0) {
            bail!("--draft-vocab 0: draft among at least one token");
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

/// Open the data (as training does where a draft vocabulary is counted from it), then
/// [`evaluate_opened`].
pub fn evaluate(c: &mut Components, opts: &EvalOptions) -> Result<EvalReport> {
    let vocab = match opts.draft_vocab {
        Some(k) => {
            let v = draft_vocab::most_frequent(c, k as usize, c.target.spec()?.vocab_size as usize)?;
            tracing::info!(
                "draft vocabulary: the {k} tokens most often predicted in the training split ({:.2}% of them)",
                100.0 * v.coverage
            );
            Some(v)
        }
        None => {
            open_data(c)?;
            None
        }
    };
    evaluate_opened(c, opts, vocab.as_ref())
}

/// Open the data plugin with the target's tokenizer (once for any number of prompt sets).
pub fn open_data(c: &mut Components) -> Result<()> {
    let tokenizer = c.target.tokenizer_json()?;
    c.data.open(&tokenizer)?;
    Ok(())
}

/// [`evaluate`] with the data plugin opened already, drafting among `vocab` where given.
pub fn evaluate_opened(c: &mut Components, opts: &EvalOptions, vocab: Option<&DraftVocab>) -> Result<EvalReport> {
    let prompts = c.data.eval_prompts(&opts.source, opts.limit)?;
    if prompts.is_empty() {
        bail!("no evaluation prompts from `{}`", opts.source);
    }
    let shared = shared_inputs(c, opts, vocab)?;
    let device = shared.embedding.device();
    let stop = [c.target.spec()?.eos_token_id];
    let mut tally = Tally::new(shared.draft_tokens);
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
        tally.t_target += t0.elapsed().as_secs_f64();
        tally.n_target += base.len();
        let t1 = Instant::now();
        let (spec, cycles) = speculative_decode(c, prompt, opts.max_new_tokens as usize, &stop, &shared, &mut times)?;
        tally.t_spec += t1.elapsed().as_secs_f64();
        tally.n_spec += spec.len();
        if spec != base {
            progress
                .suspend(|| tracing::debug!("prompt {i}: speculative output differs from the target's greedy output"));
            tally.mismatches.push(i);
        }
        tally.tokens.push(PromptTokens {
            prompt: i,
            prompt_ids: prompt.to_vec(),
            target_ids: base.to_vec(),
            speculative_ids: spec.to_vec(),
        });
        tally.add_cycles(&cycles);
        pace.record(t0.elapsed().as_secs_f64());
        progress.update(i as u64 + 1, &tally.status(), pace.eta((prompts.len() - i - 1) as u64));
    }
    progress.finish();
    // Untimed: where each differing response parts from the target's, and how near a tie.
    let mut divergences = Vec::new();
    for t in tally.tokens.iter().filter(|t| tally.mismatches.contains(&t.prompt)) {
        divergences.extend(Divergence::find(c, t)?);
    }
    let mut report = tally.report(opts, prompts.len(), &shared, vocab, &stop, &times)?;
    report.divergences = divergences;
    Ok(report)
}

/// What every decoding of the evaluation uses: the target's embedding and LM head (its rows of
/// the draft vocabulary where there is one), the drafter's block, mask token and target layers.
fn shared_inputs(c: &mut Components, opts: &EvalOptions, vocab: Option<&DraftVocab>) -> Result<Shared> {
    let (embedding, block_size) = (c.target.embedding()?, c.drafter.block_size()? as usize);
    let device = embedding.device();
    let draft_tokens = opts.draft_tokens.map_or(block_size - 1, |n| n as usize);
    if !(1..block_size).contains(&draft_tokens) {
        bail!(
            "--draft-tokens {draft_tokens}: the drafter proposes {} a block (block_size {block_size})",
            block_size - 1
        );
    }
    Ok(Shared {
        mask_ids: Tensor::full([1, block_size as i64 - 1], c.drafter.mask_token_id()? as i64, (Kind::Int64, device)),
        embedding,
        draft_head: DraftHead::new(c.target.lm_head()?, vocab),
        layer_ids: c.drafter.target_layer_ids()?,
        block_size,
        draft_tokens,
        time_split: opts.time_split,
    })
}

/// What the prompts' two decodings add up to: times and tokens of each, the verify cycles and
/// what they accepted, the responses that differ.
struct Tally {
    t_target: f64,
    t_spec: f64,
    n_target: usize,
    n_spec: usize,
    taus: Vec<f64>,
    mismatches: Vec<usize>,
    tokens: Vec<PromptTokens>,
    accepted_at: Vec<usize>,
    all_cycles: usize,
    all_accepted: usize,
    all_kept: usize,
}

impl Tally {
    /// `draft_tokens`: the drafts verified a cycle, each position's acceptance counted.
    fn new(draft_tokens: usize) -> Self {
        Tally {
            t_target: 0.0,
            t_spec: 0.0,
            n_target: 0,
            n_spec: 0,
            taus: Vec::new(),
            mismatches: Vec::new(),
            tokens: Vec::new(),
            accepted_at: vec![0usize; draft_tokens],
            all_cycles: 0,
            all_accepted: 0,
            all_kept: 0,
        }
    }

    /// One response's verify cycles.
    fn add_cycles(&mut self, cycles: &[Cycle]) {
        // tau per response (z-lab): accepted + 1 per cycle (the prefill's first token is no cycle).
        self.taus.extend(response_tau(cycles));
        self.all_cycles += cycles.len();
        self.all_accepted += cycles.iter().map(|c| c.accepted + 1).sum::<usize>();
        self.all_kept += cycles.iter().map(|c| c.produced).sum::<usize>();
        for cy in cycles {
            for slot in self.accepted_at.iter_mut().take(cy.accepted) {
                *slot += 1;
            }
        }
    }

    /// The progress line: tau so far and both speeds.
    fn status(&self) -> String {
        format!(
            "τ {:.3} pooled over {} cycles  {:.1} tok/s speculative, {:.1} target-only",
            self.all_accepted as f64 / self.all_cycles.max(1) as f64,
            self.all_cycles,
            self.n_spec as f64 / self.t_spec.max(1e-9),
            self.n_target as f64 / self.t_target.max(1e-9),
        )
    }

    fn report(
        self,
        opts: &EvalOptions,
        prompts: usize,
        shared: &Shared,
        vocab: Option<&DraftVocab>,
        stop: &[u32],
        times: &PhaseTimes,
    ) -> Result<EvalReport> {
        let Tally {
            t_target,
            t_spec,
            n_target,
            n_spec,
            taus,
            mismatches,
            tokens,
            accepted_at,
            all_cycles,
            all_accepted,
            all_kept,
        } = self;
        if all_cycles == 0 {
            bail!(
                "no draft was verified: every response ended at the target's first token (a stop token); \
                 no acceptance to measure on these prompts"
            );
        }
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        Ok(EvalReport {
            source: opts.source.clone(),
            prompts,
            block_size: shared.block_size,
            draft_tokens: shared.draft_tokens,
            draft_vocab: vocab.map(|v| DraftVocabReport { tokens: shared.draft_head.rows(), coverage: v.coverage }),
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
            device: match shared.embedding.device() {
                Device::Cuda(i) => format!("cuda:{i}"),
                other => format!("{other:?}").to_lowercase(),
            },
            cycle_ms: opts.time_split.then(|| {
                let per = |t: f64| 1e3 * t / all_cycles.max(1) as f64;
                CycleMs { draft: per(times.draft), verify: per(times.verify), bookkeeping: per(times.bookkeeping) }
            }),
            prefill_ms: opts.time_split.then(|| 1e3 * times.prefill / prompts.max(1) as f64),
            lossless: mismatches.is_empty(),
            mismatches,
            divergences: Vec::new(),
            tokens,
        })
    }
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
        draft_tokens: args.draft_tokens,
        draft_vocab: args.draft_vocab,
    };
    opts.validate()?;
    if args.eager {
        // Read by the plugins when they first decode (their own copies of `kernels` included).
        std::env::set_var("DFLASH_CUDA_GRAPHS", "0");
    }
    if !exp_dir.join(experiment::CONFIG).is_file() {
        bail!("{}: not an experiment directory (no config.toml)", exp_dir.display());
    }
    // Under a launcher, a target replica over several ranks: rank 0 evaluates, the others serve
    // its target.
    if crate::dist::DistEnv::from_env()?.is_some() {
        let (cfg, config_dir) =
            crate::pipeline::assemble::experiment_config(exp_dir, args.drafter.as_deref(), args.dtype.as_deref())?;
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
    let (evaluated, from) = what_is_evaluated(exp_dir, args.drafter.as_deref(), args.checkpoint)?;
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
    let (cfg, c) = crate::pipeline::assemble::load_experiment(exp_dir, &registry, from, args.dtype.as_deref())?;
    let (mut c, held) = replicas::drive(&cfg, c, exp_dir, "eval")?;
    let load_before = loadavg();
    let mut report = evaluate(&mut c, &opts)?;
    let load_after = loadavg();
    // The target's last call, then the heartbeat the replica's other ranks watch.
    drop(c);
    drop(held);
    let _ = std::fs::remove_dir_all(&converted);
    report.source = args.prompts.clone();
    let mut json =
        results_json(&report, &evaluated, exp_dir, args.prompt_format, cfg.dtype(), (load_before, load_after))?;
    json["cuda_graphs"] = (cfg.drafter_device().starts_with("cuda") && kernels::cuda_graph::enabled()).into();
    let tau_hat = json["tau_hat"].as_f64();
    // 4. Print, then write the results whole.
    results::print(&report, &evaluated, tau_hat);
    if let Some(w) = load_warning(load_before, load_after) {
        tracing::warn!("{w}");
        json["warning"] = w.into();
    }
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
    if report.lossless {
        return Ok(());
    }
    mismatch(&report.divergences, cfg.dtype())
}

/// Speculative output that differs from greedy decoding: an error in f32; in 16-bit floats a
/// warning, since the verify forward over a block rounds differently from decoding one token at
/// a time, so a near-tie between two tokens can fall the other way (no fault of the drafter or
/// the cache: both runs are the target's own greedy choices).
fn mismatch(divergences: &[Divergence], dtype: &str) -> Result<()> {
    let which = divergences.iter().map(Divergence::describe).collect::<Vec<_>>().join(", ");
    if dtype == "f32" {
        bail!("speculative decoding differed from the target's greedy output on {which}");
    }
    tracing::warn!(
        "speculative decoding differed from one-token greedy decoding on {which}: in {dtype} the block's verify forward rounds differently, \
         which can flip near-ties; evaluate with --dtype f32 to check exactness"
    );
    Ok(())
}

/// What is evaluated, a drafter folder or a checkpoint of the run, and where the drafter comes from.
fn what_is_evaluated<'a>(
    exp_dir: &Path,
    drafter: Option<&'a Path>,
    checkpoint: Option<u64>,
) -> Result<(Evaluated, crate::pipeline::assemble::DrafterFrom<'a>)> {
    Ok(match drafter {
        Some(d) => {
            // Its config is checked here too, so a FIFO or device there is named before the
            // target loads (the drafter plugin reads both through `input_files` again).
            input_files::open_regular(&d.join("config.json")).map_err(|e| anyhow!("--drafter {}: {e}", d.display()))?;
            let weights = d.join("model.safetensors");
            let sha = crate::plugins::sha256_file(&weights).map_err(|e| anyhow!("--drafter {}: {e:#}", d.display()))?;
            let shown = d.canonicalize().unwrap_or_else(|_| d.to_path_buf());
            let evaluated =
                Evaluated { checkpoint_step: None, drafter: Some(shown.display().to_string()), drafter_sha256: sha };
            (evaluated, crate::pipeline::assemble::DrafterFrom::Folder(d))
        }
        None => {
            let ckpt = checkpoint::find(exp_dir, checkpoint)?;
            (Evaluated::checkpoint(&ckpt), crate::pipeline::assemble::DrafterFrom::Checkpoint(ckpt))
        }
    })
}

/// Prompt sets the data plugin knows by name (anything else is a file).
fn is_named_set(source: &str) -> bool {
    matches!(source, "holdout" | "validation" | "humaneval")
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
            draft_tokens: None,
            draft_vocab: None,
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
        let none = EvalOptions { draft_vocab: Some(0), ..opts("holdout", 32, 64) };
        assert_eq!(none.validate().unwrap_err().to_string(), "--draft-vocab 0: draft among at least one token");
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
