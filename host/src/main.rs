//! `dflash-host`: trains DFlash drafters. The pipeline is fixed here; the target model, drafter,
//! optimizer and data loader are plugins (built in, or `--plugin PATH` shared libraries).

use anyhow::{Context, Result};
use clap::Parser;
use dflash_host::cli::{BenchCommand, Cli, Command, ConfigCommand, ConfigOverrides, PluginsCommand};
use dflash_host::{
    ab,
    config::{Override, RunConfig},
    eval, experiment, export, plugins,
    plugins::Registry,
    run, say, train,
};
use std::{
    path::{Path, PathBuf},
    process::ExitCode,
};

fn run() -> Result<ExitCode> {
    let cli = Cli::parse();
    match cli.command {
        Command::Plugins { command: PluginsCommand::List } => {
            let registry = Registry::new(&cli.plugins)?;
            print_plugins(registry.plugins.iter().map(|p| &p.record));
            Ok(ExitCode::SUCCESS)
        }
        Command::Plugins { command: PluginsCommand::Inspect { path } } => {
            let path = plugins::find_library(&path)?;
            let (_, sha256) = plugins::check_file(&path)?;
            let record = plugins::probe(&path, &sha256)?;
            print_plugins(std::iter::once(&record));
            Ok(ExitCode::SUCCESS)
        }
        Command::Plugins { command: PluginsCommand::Check(args) } => plugins::check::run(&cli.plugins, args),
        Command::Plugins { command: PluginsCommand::New(args) } => plugins::new::run(args),
        Command::Plugins { command: PluginsCommand::Probe { path, sha256 } } => {
            let loaded = plugins::load_library(&path, sha256.as_deref())?;
            say!("{}", serde_json::to_string(&loaded.record)?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Config { command: ConfigCommand::Explain { section, plugin, config } } => {
            let picks = match (plugin, config) {
                (Some(name), _) => dflash_host::config_doc::Picks::plugin(&name)?,
                (None, Some(file)) => dflash_host::config_doc::Picks::config(&file)?,
                (None, None) => dflash_host::config_doc::Picks::default(),
            };
            say!("{}", dflash_host::config_doc::markdown_for(section.as_deref(), &picks)?.trim_end());
            Ok(ExitCode::SUCCESS)
        }
        Command::Doctor => {
            let libtorch =
                std::env::var_os("LIBTORCH").map(PathBuf::from).unwrap_or_else(|| run::cache_dir().join("libtorch"));
            dflash_host::doctor::run(&libtorch)
        }
        Command::Distill { config, out, overrides } => {
            let cfg =
                RunConfig::load_with(&config, &Override::from_args(&overrides.set, overrides.device.as_deref())?)?;
            let registry = Registry::new(&cli.plugins)?;
            let (written, stats) = run::distill(&cfg, &config, &out, &registry)?;
            for line in dflash_host::pipeline::distill::export_summary(&stats, &written, &out) {
                say!("{line}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Compare { dirs, out, group_by } => {
            let report = dflash_host::compare::run(&dirs, out.as_deref(), group_by.as_deref())?;
            say!("report: {}", report.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Train { nproc: Some(n), ref config, ref exp_dir, ref overrides, steps, .. }
            if n >= 1 && std::env::var_os("RANK").is_none() =>
        {
            let mut args = dflash_host::launch::without_nproc(&std::env::args_os().collect::<Vec<_>>());
            // One experiment folder for every rank (each would otherwise pick a fresh name).
            if let (Some(config), None) = (config, exp_dir) {
                if !args.iter().any(|a| a == "--resume") {
                    let cfg = RunConfig::load_with(config, &train_overrides(overrides, steps)?)?;
                    args.extend([
                        "--exp-dir".into(),
                        experiment::fresh_dir(Path::new("experiments"), &cfg.name).into(),
                    ]);
                }
            }
            Ok(ExitCode::from(dflash_host::launch::launch(n, &args)?))
        }
        Command::Train { resume: Some(dir), allow_plugin_change, allow_change, stop_at, steps, overrides, .. } => {
            let opts = run::ResumeOptions {
                plugin_paths: cli.plugins.clone(),
                allow_plugin_change,
                allow_change,
                stop_at,
                overrides: train_overrides(&overrides, steps)?,
            };
            let summary = run::resume(&dir, &opts)?;
            print_summary(&summary);
            Ok(summary.interrupted.map_or(ExitCode::SUCCESS, ExitCode::from))
        }
        Command::Train { config, exp_dir, steps, overrides, stop_at, .. } => {
            let config = config.expect("clap requires --config without --resume");
            let cfg = RunConfig::load_with(&config, &train_overrides(&overrides, steps)?)?;
            let registry = Registry::new(&cli.plugins)?;
            let dir = exp_dir.unwrap_or_else(|| experiment::fresh_dir(Path::new("experiments"), &cfg.name));
            let summary = run::run(run::RunSpec {
                cfg: &cfg,
                config_path: &config,
                exp_dir: &dir,
                registry: &registry,
                ab: None,
                stop_at,
            })?;
            print_summary(&summary);
            Ok(summary.interrupted.map_or(ExitCode::SUCCESS, ExitCode::from))
        }
        Command::Capture { config, out, dtype, batches, shard_mb, overrides } => {
            let cfg =
                RunConfig::load_with(&config, &Override::from_args(&overrides.set, overrides.device.as_deref())?)?;
            let registry = Registry::new(&cli.plugins)?;
            let run_dtype = if cfg.dtype() == "bf16" {
                dflash_host::pipeline::capture::StoredDtype::Bf16
            } else {
                dflash_host::pipeline::capture::StoredDtype::F32
            };
            let opts = dflash_host::pipeline::capture::CaptureOptions {
                dtype: dtype.unwrap_or(run_dtype),
                micro_batches: batches.unwrap_or(cfg.train.steps * cfg.train.grad_accum),
                shard_bytes: shard_mb << 20,
            };
            let index = run::capture(&cfg, &config, &out, &registry, &opts)?;
            say!(
                "captured     {} micro-batches in {} shards ({:?}) -> {}",
                index.batches.len(),
                index.shards.len(),
                index.dtype,
                out.display()
            );
            say!("train on it  set `[pipeline] capture = \"{}\"` in the config", out.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Eval { exp_dir, checkpoint, drafter, prompts, prompt_format, limit, max_new_tokens, time_split } => {
            let args = eval::EvalCommand {
                exp_dir,
                checkpoint,
                drafter,
                prompts,
                prompt_format,
                limit,
                max_new_tokens,
                time_split,
            };
            eval::command(&args, &cli.plugins)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench { what: BenchCommand::Abi { exp_dir, iters } } => {
            let registry = Registry::new(&cli.plugins)?;
            dflash_host::bench::abi(&registry, exp_dir.as_deref(), iters)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench { what: BenchCommand::Train { config, json, trace, overrides } } => {
            guard_bench_outputs(json.as_deref(), trace.as_deref())?;
            let registry = Registry::new(&cli.plugins)?;
            let overrides = Override::from_args(&overrides.set, overrides.device.as_deref())?;
            let report = dflash_host::bench::train::train(&registry, &config, &overrides, trace.as_deref())?;
            dflash_host::bench::train::print(&report);
            let line = serde_json::to_string(&report)?;
            say!("{line}");
            if let Some(path) = json {
                std::fs::write(&path, line + "\n").with_context(|| format!("writing {}", path.display()))?;
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench { what: BenchCommand::Allreduce { config, bucket_mb, iters, json } } => {
            guard_bench_outputs(json.as_deref(), None)?;
            let registry = Registry::new(&cli.plugins)?;
            let report = dflash_host::bench::allreduce::allreduce(&registry, &config, &bucket_mb, iters)?;
            dflash_host::bench::allreduce::print(&report);
            let line = serde_json::to_string(&report)?;
            say!("{line}");
            if let Some(path) = json {
                std::fs::write(&path, line + "\n").with_context(|| format!("writing {}", path.display()))?;
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench { what: BenchCommand::Attention { shape, json } } => {
            guard_bench_outputs(json.as_deref(), None)?;
            let report = dflash_host::bench::attention::attention(&shape)?;
            dflash_host::bench::attention::print(&report);
            let line = serde_json::to_string(&report)?;
            say!("{line}");
            if let Some(path) = json {
                std::fs::write(&path, line + "\n").with_context(|| format!("writing {}", path.display()))?;
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Export { exp_dir, checkpoint, out, force } => {
            let done = export::export_experiment(&exp_dir, checkpoint, &out, force)?;
            say!("exported {} -> {}", done.checkpoint.display(), done.out.display());
            say!("serve it with (see {}):\n\n{}", done.out.join("README.md").display(), done.serving);
            Ok(ExitCode::SUCCESS)
        }
        Command::Ab { config, seeds, device, out } => {
            let registry = Registry::new(&cli.plugins)?;
            let (report, interrupted) =
                ab::run(&config, seeds, device.as_deref(), out.as_deref(), &registry, print_summary)?;
            if let Some(code) = interrupted {
                return Ok(ExitCode::from(code)); // rerunning the A/B resumes this arm
            }
            say!("report: {}", report.display());
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// A bench command's `--json` file and `--trace` folder, through the output guard (never into an
/// experiment) before the benchmark runs.
fn guard_bench_outputs(json: Option<&Path>, trace: Option<&Path>) -> Result<()> {
    if let Some(file) = json {
        experiment::guard::check_out_file("--json", file)?;
    }
    if let Some(dir) = trace {
        experiment::guard::check_out_folder("--trace", dir)?;
    }
    Ok(())
}

/// `--set`, `--device` and `--steps` (= `--set train.steps=N`) as config overrides.
fn train_overrides(o: &ConfigOverrides, steps: Option<u64>) -> Result<Vec<Override>> {
    let mut all = Override::from_args(&o.set, o.device.as_deref())?;
    all.extend(steps.map(|n| Override {
        arg: format!("--steps {n}"),
        key: "train.steps".into(),
        value: toml::Value::Integer(i64::try_from(n).expect("clap bounds --steps by MAX_STEPS")),
    }));
    Ok(all)
}

fn print_plugins<'a>(records: impl Iterator<Item = &'a plugins::PluginRecord>) {
    say!("{:<10} {:<10} {:<8} {:<6} {:<16} {:<64} origin", "kind", "name", "version", "abi", "sha256", "description");
    for r in records {
        let sha = r.sha256.as_deref().map_or("-".to_string(), |s| s[..16].to_string());
        say!(
            "{:<10} {:<10} {:<8} {:<6} {:<16} {:<64} {}",
            r.kind,
            r.name,
            r.version,
            r.abi,
            sha,
            r.description,
            r.origin
        );
    }
}

fn print_summary(s: &train::TrainSummary) {
    if !dflash_host::out::is_lead() {
        return; // rank 0 speaks for a data-parallel run
    }
    say!("experiment   {}", s.experiment);
    say!("steps        {}  ({} target tokens, {:.0} s)", s.steps, s.tokens, s.wall_s);
    if let Some(d) = &s.distill {
        say!(
            "distill      {} replies in {:.0} s ({} from the cache); run {:.0} s in all",
            d.replies,
            d.seconds,
            d.cached,
            d.seconds + s.wall_s
        );
    }
    if let (Some(f), Some(l)) = (&s.first, &s.last) {
        say!("loss         {:.4} -> {:.4}", f.loss, l.loss);
        say!("tau_hat      {:.3} -> {:.3}", f.tau_hat, l.tau_hat);
        say!("acc@1        {:.3} -> {:.3}", f.acc.first().unwrap_or(&0.0), l.acc.first().unwrap_or(&0.0));
    }
    if let Some(c) = &s.last_checkpoint {
        say!("checkpoint   {c}");
    }
}

fn main() -> ExitCode {
    dflash_host::dist::set_nccl_defaults(); // before any thread starts
    dflash_host::experiment::checkpoint::ignore_sigxfsz(); // `ulimit -f`: a write fails with EFBIG
    dflash_host::out::init_logging();
    match run() {
        Ok(code) => code,
        Err(e) => {
            // One line: causes joined by ": " (multi-line causes flattened), tagged with the rank;
            // a closed stderr is no panic either.
            dflash_host::out::error_line(&format!("{e:#}"));
            ExitCode::from(2)
        }
    }
}
