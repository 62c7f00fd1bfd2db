//! The command line of `dflash-host` (clap derive): every subcommand and its flags. In the
//! library so tests can parse the command lines the README shows.

use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

/// The version and the git revision the binary was built from (host/build.rs).
pub const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (git ", env!("DFLASH_GIT_REVISION"), ")");

#[derive(Parser)]
#[command(name = "dflash-host", version = VERSION, about = "Train DFlash speculative-decoding drafters")]
pub struct Cli {
    /// Load a plugin shared library (repeatable); it replaces a built-in of the same name.
    #[arg(long = "plugin", global = true, value_name = "PATH")]
    pub plugins: Vec<PathBuf>,
    /// Run a config that the device-memory estimate says cannot fit (`train`, `capture`, `eval`
    /// and `bench train` refuse one otherwise, naming what would fit).
    #[arg(long, global = true)]
    pub no_memory_check: bool,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Train a drafter as the config says, into a fresh experiment directory, or resume one.
    Train(TrainArgs),
    /// Start a new experiment from another one's checkpoint at a step, under a changed config
    /// (`--set`); the parent is only read. Its steps continue the parent's count.
    Fork(ForkArgs),
    /// What bounds a run, from its metrics.jsonl: each stage's rate, the bound stage and by how
    /// much, the hidden-state queue, what a faster drafter step or optimizer would save, the ETA
    /// to the configured steps and where the run is in its epochs. With `--plan`: how to split
    /// GPUs between the target and the drafter, from `bench train`'s figures.
    Report(ReportArgs),
    /// Run only the targets over the config's data and write their features (sharded
    /// safetensors + index.json) for `pipeline.capture` to train from.
    Capture(CaptureArgs),
    /// Self-distil the config's data (the target answers its prompts, as `train` does first) and
    /// write the records with the target's replies as chat JSONL (OpenAI `messages`).
    Distill(DistillArgs),
    /// What this machine gives libtorch: its version, the CUDA driver and runtime, cuDNN, NCCL,
    /// the GPUs, and whatever libtorch's CUDA library is missing. Exit 1 when a GPU is here but
    /// libtorch cannot use it.
    Doctor,
    /// Compare experiment directories: each run's final values, its evals, and all of them at
    /// equal target tokens; report.md, PNG/SVG plots, tables.
    Compare(CompareArgs),
    /// Run an A/B: arms that differ only in what the A/B config names, each over several seeds,
    /// side by side in experiments/<name>/, then a comparison report. An arm that sweeps fields
    /// runs each value with the first seed, keeps the best on the validation split
    /// (selection.json), then runs the other seeds at it.
    Ab(AbArgs),
    /// Speculative-decoding eval of an experiment's drafter: real acceptance length tau,
    /// per-position acceptance, speed-up over the target alone; lossless check. Writes eval.json
    /// (the newest checkpoint on the held-out test records), eval-validation.json (the newest
    /// checkpoint on the validation records), else eval-[SET-]step-N.json or
    /// eval-[SET-]drafter-SHA.json.
    Eval(EvalArgs),
    /// Export a checkpoint in the z-lab format (config.json + bf16 model.safetensors).
    Export(ExportArgs),
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
    /// The config reference (docs/CONFIG.md): every field with type, default, range, meaning.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// List or inspect plugins.
    Plugins {
        #[command(subcommand)]
        command: PluginsCommand,
    },
}

#[derive(Args)]
pub struct TrainArgs {
    /// The run config (TOML).
    #[arg(long, required_unless_present = "resume")]
    pub config: Option<PathBuf>,
    /// Experiment directory (default: experiments/<name>, or <name>-N if that exists).
    #[arg(long, conflicts_with = "resume")]
    pub exp_dir: Option<PathBuf>,
    /// Set `train.steps` (= `--set train.steps=N`). With --resume: extend a finished or
    /// interrupted run to N steps (its learning-rate schedule then spans N), recorded in the
    /// manifest's `changes`.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=crate::config::MAX_STEPS))]
    pub steps: Option<u64>,
    /// `--set train.steps=400 --set optimizer.lr=1e-3 --set 'data.template_kwargs={
    /// enable_thinking = false }'`: the experiment's config.toml records the result. With
    /// --resume, a field other than `train.steps` that changes is refused unless
    /// `--allow-change FIELD` is given too.
    #[command(flatten)]
    pub overrides: ConfigOverrides,
    /// Continue this experiment from its newest good checkpoint, with its own config (and
    /// the --steps / --set / --device changes, checked as `--allow-change` says).
    #[arg(long, value_name = "EXP_DIR", conflicts_with = "config")]
    pub resume: Option<PathBuf>,
    /// Resume even if a plugin library differs from the one the run started with.
    #[arg(long, requires = "resume")]
    pub allow_plugin_change: bool,
    /// Resume although this config field (dotted, e.g. `train.steps`; a section name allows
    /// all its fields) or the file it names changed since the run started (repeatable).
    #[arg(long, value_name = "FIELD", requires = "resume")]
    pub allow_change: Vec<String>,
    /// Stop after this step with a checkpoint, as if interrupted (resume later); must lie
    /// ahead of the step the run is at.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub stop_at: Option<u64>,
    /// Data-parallel: start N local ranks of this command (as `torchrun --nproc-per-node N
    /// --no-python dflash-host train ...` would); each rank's GPUs are the config's offset by
    /// its local rank. N = 1 runs one rank through the same collectives.
    #[arg(long, value_name = "N", value_parser = nproc)]
    pub nproc: Option<usize>,
}

#[derive(Args)]
pub struct ForkArgs {
    /// The experiment to fork (it may still be training: it is only read).
    #[arg(value_name = "EXP")]
    pub parent: PathBuf,
    /// The step of the parent's checkpoint to start from (`checkpoints/step-STEP`).
    #[arg(long, value_name = "STEP")]
    pub at: u64,
    /// `--set optimizer.plugin=muon --set train.steps=2000`: changes to the parent's config,
    /// recorded in the fork's config.toml.
    #[command(flatten)]
    pub overrides: ConfigOverrides,
    /// The fork's folder (default: `<EXP>-fork-<STEP>` beside the parent).
    #[arg(long)]
    pub exp_dir: Option<PathBuf>,
    /// `keep` the parent's optimizer state (the default for the same optimizer plugin), start a
    /// `fresh` one (the default when `optimizer.plugin` changes), or `carry` over what maps
    /// between the two optimizers (first moment, second moment where the new one has one, master
    /// weights, step count).
    #[arg(long, value_enum)]
    pub optimizer_state: Option<crate::train::fork::OptimizerStateChoice>,
    /// `continue` the learning-rate schedule at the parent's position, or `restart` a warm-up and
    /// cosine decay over the steps after the fork.
    #[arg(long, value_enum, default_value = "continue")]
    pub schedule: crate::train::fork::ScheduleChoice,
    /// Steps of linear re-warm-up from the fork (default: the run's own warm-up length,
    /// train.warmup_frac x train.steps, after a fresh optimizer state with the schedule
    /// continued; 0 otherwise).
    #[arg(long, value_name = "N")]
    pub rewarm: Option<u64>,
    /// Stop after this step with a checkpoint, as if interrupted (resume with `train --resume`).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub stop_at: Option<u64>,
    /// Start N local ranks of the fork's training, as `train --nproc N` does (a parent trained
    /// over N ranks, data-parallel or a target replica, `[target] tensor_parallel`).
    #[arg(long, value_name = "N", value_parser = nproc)]
    pub nproc: Option<usize>,
}

#[derive(Args)]
pub struct ReportArgs {
    /// The experiment directory.
    #[arg(value_name = "EXP", required_unless_present = "plan")]
    pub exp: Option<PathBuf>,
    /// Instead of a run: split `--gpus` GPUs between the target and the drafter from `bench
    /// train --json`'s file for them, the best split first with the throughput it predicts.
    #[arg(long, value_name = "BENCH_JSON", conflicts_with = "exp", requires = "gpus")]
    pub plan: Option<PathBuf>,
    /// The GPUs the plan splits.
    #[arg(long, value_name = "G", requires = "plan")]
    pub gpus: Option<u64>,
}

#[derive(Args)]
pub struct CaptureArgs {
    #[arg(long)]
    pub config: PathBuf,
    #[command(flatten)]
    pub overrides: ConfigOverrides,
    #[arg(long)]
    pub out: PathBuf,
    /// Stored precision of the features (default: the run's dtype).
    #[arg(long, value_enum)]
    pub dtype: Option<crate::pipeline::capture::StoredDtype>,
    /// Micro-batches to capture (default: steps x grad_accum).
    #[arg(long)]
    pub batches: Option<u64>,
    /// Shard size in MiB.
    #[arg(long, default_value_t = 1024)]
    pub shard_mb: usize,
    /// Start N local ranks (a target replica over N ranks, `[target] tensor_parallel = N`):
    /// rank 0 captures, the others serve its target.
    #[arg(long, value_name = "N", value_parser = nproc)]
    pub nproc: Option<usize>,
}

#[derive(Args)]
pub struct DistillArgs {
    #[arg(long)]
    pub config: PathBuf,
    #[command(flatten)]
    pub overrides: ConfigOverrides,
    /// The JSONL file to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Start N local ranks (a target replica over N ranks, `[target] tensor_parallel = N`):
    /// rank 0 distils, the others serve its target.
    #[arg(long, value_name = "N", value_parser = nproc)]
    pub nproc: Option<usize>,
}

#[derive(Args)]
pub struct CompareArgs {
    /// Experiment directories, or A/B folders (their runs).
    #[arg(required = true)]
    pub dirs: Vec<PathBuf>,
    /// Output folder, reused (default: an A/B folder's report/, else compare/ beside the
    /// first run).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Group runs by this config key (dotted, e.g. `optimizer.lr`; falls back to manifest.json)
    /// instead of the manifest's `arm`, else the config's `name`.
    #[arg(long)]
    pub group_by: Option<String>,
}

#[derive(Args)]
pub struct AbArgs {
    /// The A/B config (TOML: name, base, seeds, select, [common], [eval], [arms.<name>] with
    /// an optional `sweep`).
    #[arg(long)]
    pub config: PathBuf,
    /// Seeds 0..N (overrides the file's `seeds`).
    #[arg(long)]
    pub seeds: Option<u64>,
    /// Every run's device (`cpu`, `cuda`, `cuda:N`), as `train --device` sets it.
    #[arg(long)]
    pub device: Option<String>,
    /// The report's folder (default: experiments/<name>/report).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Train N runs of a phase at once, each its own process on the runs' device (small
    /// drafters leave most of a GPU idle; several at once fill it).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub jobs: u64,
    /// One run of the plan (its folder's name) and its phase's evaluations: what each process
    /// of `--jobs` runs.
    #[arg(long, hide = true, requires = "stage")]
    pub only: Option<String>,
    #[arg(long, hide = true, value_enum)]
    pub stage: Option<crate::ab::Stage>,
}

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
    pub prompt_format: crate::eval::PromptFormat,
    /// Prompts to evaluate.
    #[arg(long, default_value_t = 32)]
    pub limit: u32,
    /// Tokens to decode a prompt, at most 131072.
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: u32,
    /// Also time each cycle's phases (draft, verify, bookkeeping), waiting for the device
    /// after each: slows decoding slightly.
    #[arg(long)]
    pub time_split: bool,
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

#[derive(Args)]
pub struct ExportArgs {
    #[arg(long)]
    pub exp_dir: PathBuf,
    /// Checkpoint step (default: the newest that verifies).
    #[arg(long)]
    pub checkpoint: Option<u64>,
    /// A new or empty folder outside the experiment.
    #[arg(long)]
    pub out: PathBuf,
    /// Replace `--out` if it is a non-empty folder.
    #[arg(long)]
    pub force: bool,
}

#[derive(Subcommand)]
pub enum BenchCommand {
    /// The cost of crossing the plugin boundary (ns per call, per tensor handle), and its share
    /// of a training step of `--exp-dir`'s run. Uses the `adamw` optimizer (built-in, or the
    /// library given with --plugin).
    Abi {
        #[arg(long)]
        exp_dir: Option<PathBuf>,
        #[arg(long, default_value_t = 2_000_000)]
        iters: u64,
    },
    /// Training throughput at real shapes with random weights: matmul ceiling, target forward,
    /// drafter train step, target + drafter pipeline, device memory; FLOP counts and MFU.
    /// Prints a table, then the report as one JSON line.
    Train {
        /// The bench config (TOML), e.g. configs/bench/qwen3-8b.toml.
        #[arg(long)]
        config: PathBuf,
        /// Also write the JSON report to this file.
        #[arg(long)]
        json: Option<PathBuf>,
        /// After the timed phases, profile one drafter step and one target forward with libtorch's
        /// profiler and write DIR/drafter_step.trace.json and DIR/target_forward.trace.json
        /// (Chrome traces; scripts/bench/trace_summary.py makes tables of them).
        #[arg(long, value_name = "DIR")]
        trace: Option<PathBuf>,
        #[command(flatten)]
        overrides: ConfigOverrides,
        /// Start N local ranks: one target replica over N ranks (`[target] tensor_parallel = N`),
        /// rank 0 running the phases and reporting each rank's memory, the others serving its
        /// target.
        #[arg(long, value_name = "N", value_parser = nproc)]
        nproc: Option<usize>,
    },
    /// The data-parallel gradient all-reduce (c10d: Gloo on the CPU, NCCL on a GPU) on the
    /// gradients of the config's drafter, per bucket size. Alone it is a world of 1 (the fixed
    /// cost per call); under a launcher, every rank runs it.
    Allreduce {
        /// The bench config (TOML), e.g. configs/bench/qwen3-8b.toml (its [bench] is not read).
        #[arg(long)]
        config: PathBuf,
        /// Bucket sizes in MiB, comma-separated.
        #[arg(long, value_delimiter = ',', default_values_t = [32, 128, 512])]
        bucket_mb: Vec<usize>,
        #[arg(long, default_value_t = 10)]
        iters: usize,
        /// Also write the JSON report to this file.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// One layer's DFlash block attention, masked SDPA next to split attention: errors against
    /// an fp32 masked-SDPA reference, then bf16 forward and forward + backward times.
    Attention {
        #[command(flatten)]
        shape: crate::bench::attention::Shape,
        /// Also write the JSON report to this file.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// The targets' linear layers as FP8 block-scaled GEMMs (weights e4m3 in 128x128 blocks,
    /// activations quantised per token per 128 channels) beside bf16, at the linear shapes of
    /// Qwen3-8B and Qwen3.6-27B: TFLOP/s, the ratio, the quantiser's cost, the error. Needs a
    /// Hopper GPU.
    Fp8 {
        #[command(flatten)]
        args: crate::bench::fp8::Args,
        /// Also write the JSON report to this file.
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
pub enum ConfigCommand {
    /// Print the fields of every section, or of one (`top`, `train`, `pipeline`, `target`,
    /// `drafter`, `optimizer`, `data`). A plugin section's fields are its plugin's, picked by
    /// its `plugin = "..."`: every built-in plugin's are shown unless --plugin or --config says
    /// which.
    Explain {
        section: Option<String>,
        /// Only this plugin's fields where a section has several plugins (`gdn`, `muon`).
        #[arg(long, conflicts_with = "config")]
        plugin: Option<String>,
        /// Only the plugins this run config picks, saying which and where.
        #[arg(long)]
        config: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
pub enum PluginsCommand {
    /// Built-in and loaded (`--plugin PATH`) plugins: name, kind, version, ABI, origin, SHA-256.
    List,
    /// Check one plugin library and show its metadata (it is loaded in a child process only:
    /// none of its code runs in this one).
    Inspect {
        /// The shared library.
        path: PathBuf,
    },
    /// Load one library in this process and print its record as JSON (what `inspect`, `list` and
    /// `--plugin` run in a child process).
    #[command(hide = true)]
    Probe {
        path: PathBuf,
        /// The SHA-256 the library was checked with: other bytes are refused, not loaded.
        #[arg(long)]
        sha256: Option<String>,
    },
    /// A plugin's config reference: every field of its section with type, default, range and
    /// meaning, as the plugin describes it (a library is checked first, then loaded to ask it).
    Doc {
        /// A plugin library (`.so`), or the name of a built-in plugin.
        plugin: String,
    },
    /// Run the contract of a plugin's kind against it: pass / FAIL per clause.
    Check(crate::plugins::check::CheckArgs),
    /// Write a plugin crate from a template (build it with `cargo build --release`).
    New(crate::plugins::new::NewArgs),
}

/// `--set` and `--device` of the commands that read a config besides `train`.
#[derive(Args)]
pub struct ConfigOverrides {
    /// Set a config field (repeatable), typed as in the file, e.g. `--set data.max_len=512`; a
    /// table sets the fields it lists (`--set 'train={steps=400, log_every=5}'`), a relative path
    /// is against the working folder. `--set optimizer.plugin=adamw` (or `--set
    /// 'optimizer={plugin="adamw", eps=1e-6}'`) switches the section to another plugin: the old
    /// plugin's fields are dropped, `lr` and `weight_decay` kept unless set, and the effective
    /// section is printed.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// The run's device (`cpu`, `cuda`, `cuda:N`).
    #[arg(long)]
    pub device: Option<String>,
}

/// The most local ranks `--nproc` starts: each is a process with the whole pipeline (or a part
/// of the target) and its own device context; a machine has far fewer GPUs.
pub const MAX_NPROC: usize = 1024;

/// `--nproc N`: a number of ranks from 1 to [`MAX_NPROC`].
fn nproc(s: &str) -> Result<usize, String> {
    let n: usize = s.trim().parse().map_err(|e| format!("`{s}`: {e}"))?;
    if !(1..=MAX_NPROC).contains(&n) {
        return Err(format!("{n} ranks: from 1 to {MAX_NPROC}"));
    }
    Ok(n)
}
