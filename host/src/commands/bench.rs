//! `dflash-host bench`: the plugin boundary, a training step, the all-reduce, attention and FP8 GEMMs, each
//! printed as a table and one JSON line (also written to `--json`).

use crate::{
    config::{ConfigOverrides, Override},
    dist::launch::nproc,
    experiment::guard::Input,
    outputs::OutFile,
    plugins::Registry,
    say,
};
use anyhow::Result;
use clap::Subcommand;
use serde::Serialize;
use std::{
    path::{Path, PathBuf},
    process::ExitCode,
};

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

pub fn run(what: BenchCommand, plugin_paths: &[PathBuf]) -> Result<ExitCode> {
    match what {
        BenchCommand::Abi { exp_dir, iters } => {
            let registry = Registry::new(plugin_paths)?;
            crate::bench::abi(&registry, exp_dir.as_deref(), iters)?;
        }
        BenchCommand::Train { config, json, trace, overrides, nproc } => {
            if let Some(code) = crate::dist::launch::relaunch(nproc, Vec::new)? {
                return Ok(code);
            }
            let json = guard_outputs(json.as_deref(), trace.as_deref(), Some(&config))?;
            let registry = Registry::new(plugin_paths)?;
            let overrides = Override::from_args(&overrides.set, overrides.device.as_deref())?;
            let Some(report) = crate::bench::train::train(&registry, &config, &overrides, trace.as_deref())? else {
                return Ok(ExitCode::SUCCESS); // a rank that served the replica's target
            };
            crate::bench::train::print(&report);
            json_line(&report, json.as_ref())?;
        }
        BenchCommand::Allreduce { config, bucket_mb, iters, json } => {
            let json = guard_outputs(json.as_deref(), None, Some(&config))?;
            let registry = Registry::new(plugin_paths)?;
            let report = crate::bench::allreduce::allreduce(&registry, &config, &bucket_mb, iters)?;
            crate::bench::allreduce::print(&report);
            json_line(&report, json.as_ref())?;
        }
        BenchCommand::Attention { shape, json } => {
            let json = guard_outputs(json.as_deref(), None, None)?;
            let report = crate::bench::attention::attention(&shape)?;
            crate::bench::attention::print(&report);
            json_line(&report, json.as_ref())?;
        }
        BenchCommand::Fp8 { args, json } if args.accuracy => {
            let json = guard_outputs(json.as_deref(), None, args.config.as_deref())?;
            let report = crate::bench::fp8_accuracy::accuracy(&Registry::new(plugin_paths)?, &args)?;
            crate::bench::fp8_accuracy::print(&report);
            json_line(&report, json.as_ref())?;
        }
        BenchCommand::Fp8 { args, json } => {
            let json = guard_outputs(json.as_deref(), None, None)?;
            let report = crate::bench::fp8::fp8(&args)?;
            crate::bench::fp8::print(&report);
            json_line(&report, json.as_ref())?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A bench command's `--json` file and `--trace` folder, through the output guard (never into an
/// experiment, never the config) before the benchmark runs; the file opened for writing.
fn guard_outputs(json: Option<&Path>, trace: Option<&Path>, config: Option<&Path>) -> Result<Option<OutFile>> {
    let inputs: Vec<Input> = config.map(|c| Input::new("the config file", c)).into_iter().collect();
    if let Some(dir) = trace {
        crate::experiment::guard::check_out_folder("--trace", dir, &inputs)?;
    }
    json.map(|file| OutFile::create("--json", file, inputs)).transpose()
}

/// The report as one JSON line on stdout, and in `--json` when given.
fn json_line(report: &impl Serialize, file: Option<&OutFile>) -> Result<()> {
    let line = serde_json::to_string(report)?;
    say!("{line}");
    if let Some(file) = file {
        file.write((line + "\n").as_bytes())?;
    }
    Ok(())
}
