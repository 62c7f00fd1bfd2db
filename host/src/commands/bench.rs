//! `dflash-host bench`: the plugin boundary, a training step, the all-reduce, attention and FP8 GEMMs, each
//! printed as a table and one JSON line (also written to `--json`).

use crate::{cli::BenchCommand, config::Override, experiment::guard::Input, outputs::OutFile, plugins::Registry, say};
use anyhow::Result;
use serde::Serialize;
use std::{
    path::{Path, PathBuf},
    process::ExitCode,
};

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
