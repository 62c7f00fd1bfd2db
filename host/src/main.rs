//! `dflash-host`: trains DFlash drafters. The pipeline is fixed here; the target model, drafter,
//! optimizer and data loader are plugins (built in, or `--plugin PATH` shared libraries).


use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use dflash_host::{ab, config::RunConfig, eval, experiment, export, plugins, plugins::Registry, run, say, train};
use std::{
    io::Write,
    path::{Path, PathBuf},
    process::ExitCode,
};

/// The version and the git revision the binary was built from (host/build.rs).
const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (git ", env!("DFLASH_GIT_REVISION"), ")");

#[derive(Parser)]
#[command(name = "dflash-host", version = VERSION, about = "Train DFlash speculative-decoding drafters")]
struct Cli {
    /// Load a plugin shared library (repeatable); it replaces a built-in of the same name.
    #[arg(long = "plugin", global = true, value_name = "PATH")]
    plugins: Vec<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a drafter as the config says, into a fresh experiment directory, or resume one.
    Train {
        /// The run config (TOML).
        #[arg(long, required_unless_present = "resume")]
        config: Option<PathBuf>,
        /// Experiment directory (default: experiments/<name>, or <name>-N if that exists).
        #[arg(long, conflicts_with = "resume")]
        exp_dir: Option<PathBuf>,
        /// Override `train.steps`.
        #[arg(long, conflicts_with = "resume")]
        steps: Option<u64>,
        /// Continue this experiment from its newest good checkpoint, with its own config.
        #[arg(long, value_name = "EXP_DIR", conflicts_with = "config")]
        resume: Option<PathBuf>,
        /// Resume even if a plugin library differs from the one the run started with.
        #[arg(long, requires = "resume")]
        allow_plugin_change: bool,
        /// Resume although this config field (dotted, e.g. `train.steps`; a section name allows
        /// all its fields) or the file it names changed since the run started (repeatable).
        #[arg(long, value_name = "FIELD", requires = "resume")]
        allow_change: Vec<String>,
        /// Stop after this step with a checkpoint, as if interrupted (resume later); must lie
        /// ahead of the step the run is at.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        stop_at: Option<u64>,
        /// Data-parallel: start N local ranks of this command (as `torchrun --nproc-per-node N
        /// --no-python dflash-host train ...` would); each rank's GPUs are the config's offset by
        /// its local rank. N = 1 runs one rank through the same collectives.
        #[arg(long, value_name = "N")]
        nproc: Option<usize>,
    },
    /// Run only the targets over the config's data and write their features (sharded
    /// safetensors + index.json) for `pipeline.capture` to train from.
    Capture {
        #[arg(long)]
        config: PathBuf,
        #[arg(long)]
        out: PathBuf,
        /// Stored precision of the features (default: the run's dtype).
        #[arg(long, value_enum)]
        dtype: Option<dflash_host::pipeline::capture::StoredDtype>,
        /// Micro-batches to capture (default: steps x grad_accum).
        #[arg(long)]
        batches: Option<u64>,
        /// Shard size in MiB.
        #[arg(long, default_value_t = 1024)]
        shard_mb: usize,
    },
    /// Self-distil the config's data (the target answers its prompts, as `train` does first) and
    /// write the records with the target's replies as chat JSONL (OpenAI `messages`).
    Distill {
        #[arg(long)]
        config: PathBuf,
        /// The JSONL file to write.
        #[arg(long)]
        out: PathBuf,
    },
    /// What this machine gives libtorch: its version, the CUDA driver and runtime, cuDNN, NCCL,
    /// the GPUs, and whatever libtorch's CUDA library is missing. Exit 1 when a GPU is here but
    /// libtorch cannot use it.
    Doctor,
    /// Compare experiment directories at equal target tokens: report.md, PNG/SVG plots, a table.
    Compare {
        /// Experiment directories (each one training run).
        #[arg(required = true)]
        dirs: Vec<PathBuf>,
        /// Output folder (default: <first dir's parent>/compare-<UTC time>).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Group runs by this config key (dotted, e.g. `optimizer.lr`; falls back to manifest.json)
        /// instead of the manifest's `arm`, else the config's `name`.
        #[arg(long)]
        group_by: Option<String>,
    },
    /// Run an A/B: arms that differ only in what the A/B config names, each over several seeds,
    /// side by side in experiments/<name>/, then a comparison report.
    Ab {
        /// The A/B config (TOML: name, base, seeds, [arms.<name>]).
        #[arg(long)]
        config: PathBuf,
        /// Seeds 0..N (overrides the file's `seeds`).
        #[arg(long)]
        seeds: Option<u64>,
    },
    /// Speculative-decoding eval of an experiment's drafter: real acceptance length tau,
    /// per-position acceptance, speed-up over the target alone; lossless check. Writes eval.json.
    Eval {
        #[arg(long)]
        exp_dir: PathBuf,
        /// Checkpoint step (default: the newest).
        #[arg(long)]
        checkpoint: Option<u64>,
        /// Evaluate this z-lab format drafter folder instead of a checkpoint.
        #[arg(long)]
        drafter: Option<PathBuf>,
        /// `holdout` (records the config holds out; never trained on), `humaneval`, or a chat JSONL file.
        #[arg(long, default_value = "holdout")]
        prompts: String,
        /// Prompts to evaluate.
        #[arg(long, default_value_t = 32)]
        limit: u32,
        #[arg(long, default_value_t = 64)]
        max_new_tokens: u32,
    },
    /// Export a checkpoint in the z-lab format (config.json + bf16 model.safetensors).
    Export {
        #[arg(long)]
        exp_dir: PathBuf,
        /// Checkpoint step (default: the newest that verifies).
        #[arg(long)]
        checkpoint: Option<u64>,
        /// A new or empty folder outside the experiment.
        #[arg(long)]
        out: PathBuf,
        /// Replace `--out` if it is a non-empty folder.
        #[arg(long)]
        force: bool,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
    /// List or inspect plugins.
    Plugins {
        #[command(subcommand)]
        command: PluginsCommand,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
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
        /// (Chrome traces; scripts/trace_summary.py makes tables of them).
        #[arg(long, value_name = "DIR")]
        trace: Option<PathBuf>,
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
        shape: dflash_host::bench::attention::Shape,
        /// Also write the JSON report to this file.
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum PluginsCommand {
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
    Probe { path: PathBuf },
    /// Run the contract of a plugin's kind against it: pass / FAIL per clause.
    Check(plugins::check::CheckArgs),
    /// Write a plugin crate from a template (build it with `cargo build --release`).
    New(plugins::new::NewArgs),
}





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
            plugins::check_file(&path)?;
            let record = plugins::probe(&path)?;
            print_plugins(std::iter::once(&record));
            Ok(ExitCode::SUCCESS)
        }
        Command::Plugins { command: PluginsCommand::Check(args) } => plugins::check::run(&cli.plugins, args),
        Command::Plugins { command: PluginsCommand::New(args) } => plugins::new::run(args),
        Command::Plugins { command: PluginsCommand::Probe { path } } => {
            let loaded = plugins::load_library(&path, None)?;
            say!("{}", serde_json::to_string(&loaded.record)?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Doctor => {
            let libtorch = std::env::var_os("LIBTORCH").map(PathBuf::from).unwrap_or_else(|| run::cache_dir().join("libtorch"));
            dflash_host::doctor::run(&libtorch)
        }
        Command::Distill { config, out } => {
            let cfg = RunConfig::load(&config)?;
            let registry = Registry::new(&cli.plugins)?;
            let (n, stats) = run::distill(&cfg, &config, &out, &registry)?;
            if let Some(s) = stats {
                say!("distilled    {} replies in {:.1} s ({} from the cache {})", s.replies, s.seconds, s.cached, s.cache_file.display());
            }
            say!("wrote        {n} records -> {}", out.display());
            say!("train on it  [data] path = \"{}\", distill = false", out.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Compare { dirs, out, group_by } => {
            let report = dflash_host::compare::run(&dirs, out.as_deref(), group_by.as_deref())?;
            say!("report: {}", report.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Train { nproc: Some(n), ref config, ref exp_dir, .. } if n >= 1 && std::env::var_os("RANK").is_none() => {
            let mut args = dflash_host::launch::without_nproc(&std::env::args_os().collect::<Vec<_>>());
            // One experiment folder for every rank (each would otherwise pick a fresh name).
            if let (Some(config), None) = (config, exp_dir) {
                if !args.iter().any(|a| a == "--resume") {
                    let cfg = RunConfig::load(config)?;
                    args.extend(["--exp-dir".into(), experiment::fresh_dir(Path::new("experiments"), &cfg.name).into()]);
                }
            }
            Ok(ExitCode::from(dflash_host::launch::launch(n, &args)?))
        }
        Command::Train { resume: Some(dir), allow_plugin_change, allow_change, stop_at, .. } => {
            let opts = run::ResumeOptions { plugin_paths: cli.plugins.clone(), allow_plugin_change, allow_change, stop_at };
            let summary = run::resume(&dir, &opts)?;
            print_summary(&summary);
            Ok(summary.interrupted.map_or(ExitCode::SUCCESS, ExitCode::from))
        }
        Command::Train { config, exp_dir, steps, stop_at, .. } => {
            let config = config.expect("clap requires --config without --resume");
            let mut cfg = RunConfig::load(&config)?;
            if let Some(s) = steps {
                cfg.train.steps = s;
                cfg.validate()?;
            }
            let registry = Registry::new(&cli.plugins)?;
            let dir = exp_dir.unwrap_or_else(|| experiment::fresh_dir(Path::new("experiments"), &cfg.name));
            let summary =
                run::run(run::RunSpec { cfg: &cfg, config_path: &config, exp_dir: &dir, registry: &registry, ab: None, stop_at })?;
            print_summary(&summary);
            Ok(summary.interrupted.map_or(ExitCode::SUCCESS, ExitCode::from))
        }
        Command::Capture { config, out, dtype, batches, shard_mb } => {
            let cfg = RunConfig::load(&config)?;
            let registry = Registry::new(&cli.plugins)?;
            let run_dtype = if cfg.dtype() == "bf16" { dflash_host::pipeline::capture::StoredDtype::Bf16 } else { dflash_host::pipeline::capture::StoredDtype::F32 };
            let opts = dflash_host::pipeline::capture::CaptureOptions {
                dtype: dtype.unwrap_or(run_dtype),
                micro_batches: batches.unwrap_or(cfg.train.steps * cfg.train.grad_accum),
                shard_bytes: shard_mb << 20,
            };
            let index = run::capture(&cfg, &config, &out, &registry, &opts)?;
            say!("captured     {} micro-batches in {} shards ({:?}) -> {}", index.batches.len(), index.shards.len(), index.dtype, out.display());
            say!("train on it  set `[pipeline] capture = \"{}\"` in the config", out.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Eval { exp_dir, checkpoint, drafter, prompts, limit, max_new_tokens } => {
            let opts = eval::EvalOptions { source: prompts, limit, max_new_tokens };
            opts.validate()?;
            if !exp_dir.join(experiment::CONFIG).is_file() {
                anyhow::bail!("{}: not an experiment directory (no config.toml)", exp_dir.display());
            }
            // eval.json is the held-out result `compare` shows; other prompt sets get their own file.
            let written = exp_dir.join(match prompts_name(&opts.source) {
                Some(n) => format!("eval-{n}.json"),
                None => "eval.json".into(),
            });
            // A folder the results cannot be written to fails now, not after the evaluation.
            experiment::check_writable(&written)?;
            let registry = Registry::new(&cli.plugins)?;
            let (_, mut c) = run::load_experiment(&exp_dir, &registry, checkpoint, drafter.as_deref())?;
            let report = eval::evaluate(&mut c, &opts)?;
            let tau_hat = experiment::metrics::last_number(&exp_dir, "tau_hat");
            let mut json = serde_json::to_value(&report)?;
            json["tau_hat"] = tau_hat.into();
            say!("prompts      {} ({})", report.prompts, report.source);
            say!(
                "tau          {:.3}   (z-lab's: accepted + 1 per cycle; tokens kept per cycle {:.3}; tau_hat from training {})",
                report.tau,
                report.tau_kept,
                tau_hat.map_or("-".into(), |t| format!("{t:.3}"))
            );
            let acc: Vec<String> = report.acceptance_per_position.iter().map(|a| format!("{a:.2}")).collect();
            say!("acceptance   {}", acc.join(" "));
            say!("speed-up     {:.2}x  ({:.1} vs {:.1} tok/s target-only)", report.speedup, report.spec_tok_per_s, report.target_tok_per_s);
            say!("lossless     {}", if report.lossless { "yes" } else { "NO" });
            // Written whole once the evaluation is complete (printed above even if this fails).
            experiment::write_json_atomic(&written, &json)?;
            say!("written      {}", written.display());
            if !report.lossless {
                anyhow::bail!("speculative decoding differed from the target's greedy output on prompts {:?}", report.mismatches);
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench { what: BenchCommand::Abi { exp_dir, iters } } => {
            let registry = Registry::new(&cli.plugins)?;
            dflash_host::bench::abi(&registry, exp_dir.as_deref(), iters)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench { what: BenchCommand::Train { config, json, trace } } => {
            let registry = Registry::new(&cli.plugins)?;
            let report = dflash_host::bench::train::train(&registry, &config, trace.as_deref())?;
            dflash_host::bench::train::print(&report);
            let line = serde_json::to_string(&report)?;
            say!("{line}");
            if let Some(path) = json {
                std::fs::write(&path, line + "\n").with_context(|| format!("writing {}", path.display()))?;
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench { what: BenchCommand::Allreduce { config, bucket_mb, iters, json } } => {
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
            let ckpt = export::export_experiment(&exp_dir, checkpoint, &out, force)?;
            say!("exported {} -> {}", ckpt.display(), out.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Ab { config, seeds } => {
            let registry = Registry::new(&cli.plugins)?;
            let runs = ab::plan(&config, seeds, Path::new("experiments"))?;
            let ab_dir = runs[0].dir.parent().expect("arm dirs live in the A/B's folder").to_path_buf();
            tracing::info!("A/B {}: {} runs into {}", ab_dir.display(), runs.len(), ab_dir.display());
            let mut dirs = Vec::new();
            for (i, r) in runs.iter().enumerate() {
                tracing::info!("A/B run {}/{}: arm `{}`, seed {}", i + 1, runs.len(), r.arm, r.seed);
                let summary = match ab::arm_state(r)? {
                    ab::ArmState::Finished => {
                        tracing::info!("{} is complete already; skipping it", r.dir.display());
                        None
                    }
                    ab::ArmState::Unfinished => {
                        tracing::info!("{} is unfinished: resuming it", r.dir.display());
                        Some(run::resume_with(&r.dir, None, &registry, &run::ResumeOptions::default())?)
                    }
                    ab::ArmState::New => {
                        let ab_name = ab_dir.file_name().unwrap_or_default().to_string_lossy().to_string();
                        Some(run::run(run::RunSpec {
                            cfg: &r.config,
                            config_path: &r.base_path,
                            exp_dir: &r.dir,
                            registry: &registry,
                            ab: Some((&ab_name, &r.arm)),
                            stop_at: None,
                        })?)
                    }
                };
                if let Some(summary) = summary {
                    print_summary(&summary);
                    if let Some(code) = summary.interrupted {
                        return Ok(ExitCode::from(code)); // rerunning the A/B resumes this arm
                    }
                }
                dirs.push(r.dir.clone());
            }
            let report = dflash_host::compare::run(&dirs, Some(&ab_dir.join("report")), None)?;
            say!("report: {}", report.display());
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// A file-name-safe name for a non-default prompt set (None for `holdout`).
fn prompts_name(source: &str) -> Option<String> {
    (source != "holdout").then(|| {
        let stem = Path::new(source).file_stem().and_then(|s| s.to_str()).unwrap_or(source);
        stem.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect()
    })
}

fn print_plugins<'a>(records: impl Iterator<Item = &'a plugins::PluginRecord>) {
    say!("{:<10} {:<10} {:<8} {:<6} {:<16} {:<64} origin", "kind", "name", "version", "abi", "sha256", "description");
    for r in records {
        let sha = r.sha256.as_deref().map_or("-".to_string(), |s| s[..16].to_string());
        say!("{:<10} {:<10} {:<8} {:<6} {:<16} {:<64} {}", r.kind, r.name, r.version, r.abi, sha, r.description, r.origin);
    }
}

fn print_summary(s: &train::TrainSummary) {
    say!("experiment   {}", s.experiment);
    say!("steps        {}  ({} target tokens, {:.0} s)", s.steps, s.tokens, s.wall_s);
    if let Some(d) = &s.distill {
        say!("distill      {} replies in {:.0} s ({} from the cache); run {:.0} s in all", d.replies, d.seconds, d.cached, d.seconds + s.wall_s);
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
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
    match run() {
        Ok(code) => code,
        Err(e) => {
            // One line: causes joined by ": " (multi-line causes flattened).
            // A closed stderr must not panic either.
            let _ = writeln!(std::io::stderr(), "error: {}", format!("{e:#}").replace('\n', " "));
            ExitCode::from(2)
        }
    }
}
