//! The command line of `dflash-host` (clap derive): the global flags and the subcommands; each
//! command's flags live with its command (`commands/<name>.rs`, `eval/args.rs`). In the library
//! so tests can parse the command lines the README shows.

use crate::{
    commands::{
        ab::AbArgs, bench::BenchCommand, capture::CaptureArgs, compare::CompareArgs, config::ConfigCommand,
        distill::DistillArgs, export::ExportArgs, fork::ForkArgs, plugins::PluginsCommand, report::ReportArgs,
        train::TrainArgs,
    },
    eval::args::EvalArgs,
};
use clap::{Parser, Subcommand};
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
