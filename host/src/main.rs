//! `dflash-host`: trains DFlash drafters. The pipeline is fixed here; the target model, drafter,
//! optimizer and data loader are plugins (built in, or `--plugin PATH` shared libraries).


use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use dflash_host::{config, config::RunConfig, experiment, plugins, plugins::Registry, train};
use serde::Serialize;
use std::{
    path::{Path, PathBuf},
    process::ExitCode,
};

#[derive(Parser)]
#[command(name = "dflash-host", version, about = "Train DFlash speculative-decoding drafters")]
struct Cli {
    /// Load a plugin shared library (repeatable); it replaces a built-in of the same name.
    #[arg(long = "plugin", global = true, value_name = "PATH")]
    plugins: Vec<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a drafter as the config says, into a fresh experiment directory.
    Train {
        /// The run config (TOML).
        #[arg(long)]
        config: PathBuf,
        /// Experiment directory (default: experiments/<name>, or <name>-N if that exists).
        #[arg(long)]
        exp_dir: Option<PathBuf>,
        /// Override `train.steps`.
        #[arg(long)]
        steps: Option<u64>,
    },
    /// List or inspect plugins.
    Plugins {
        #[command(subcommand)]
        command: PluginsCommand,
    },
}

#[derive(Subcommand)]
enum PluginsCommand {
    /// Built-in and loaded plugins.
    List,
}

/// `manifest.json`: what produced an experiment.
#[derive(Serialize)]
struct Manifest {
    host_version: &'static str,
    git_revision: String,
    command_line: Vec<String>,
    started_at_unix: u64,
    seed: u64,
    device: String,
    dtype: String,
    build_id: String,
    plugins: Vec<plugins::PluginRecord>,
    target_source: String,
    target_sha256: String,
}

fn cache_dir() -> PathBuf {
    std::env::var_os("DFLASH_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/dflash"))
}

fn git_revision() -> String {
    std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

/// libtorch_cuda.so is dropped by `--as-needed`; load it before the first CUDA op (STACK.md).
fn enable_cuda() -> bool {
    // SAFETY: loading libtorch's own CUDA library; it is never unloaded.
    let lib = unsafe {
        libloading::os::unix::Library::open(
            Some("libtorch_cuda.so"),
            libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
        )
    };
    match lib {
        Ok(lib) => {
            std::mem::forget(lib);
            true
        }
        Err(e) => {
            tracing::warn!("CUDA unavailable: {e}");
            false
        }
    }
}

fn run() -> Result<ExitCode> {
    let cli = Cli::parse();
    match cli.command {
        Command::Plugins { command: PluginsCommand::List } => {
            let registry = Registry::new(&cli.plugins)?;
            println!("{:<10} {:<10} {:<8} {:<10} description", "kind", "name", "version", "origin");
            for p in &registry.plugins {
                let r = &p.record;
                println!("{:<10} {:<10} {:<8} {:<10} {}", r.kind, r.name, r.version, r.origin, r.description);
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Train { config, exp_dir, steps } => {
            let mut cfg = RunConfig::load(&config)?;
            if let Some(s) = steps {
                cfg.train.steps = s;
                cfg.validate()?;
            }
            if cfg.device.starts_with("cuda") && !enable_cuda() {
                anyhow::bail!("device `{}` asked for, but libtorch's CUDA libraries could not be loaded", cfg.device);
            }
            tch::manual_seed(cfg.seed as i64);
            let registry = Registry::new(&cli.plugins)?;
            let cache = cache_dir();
            let config_dir = config::config_dir(&config).canonicalize().context("config folder")?;
            let components = train::build_components(&cfg, &registry, &config_dir, &cache).map_err(|e| {
                let msg = format!("{e:#}");
                let text = std::fs::read_to_string(&config).unwrap_or_default();
                match config::locate_plugin_error(&text, &msg) {
                    Some(line) => anyhow::anyhow!("{}:{line}: {msg}", config.display()),
                    None => anyhow::anyhow!("{}: {msg}", config.display()),
                }
            })?;
            let spec = components.target.spec();
            let manifest = Manifest {
                host_version: env!("CARGO_PKG_VERSION"),
                git_revision: git_revision(),
                command_line: std::env::args().collect(),
                started_at_unix: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs(),
                seed: cfg.seed,
                device: cfg.device.clone(),
                dtype: cfg.dtype().into(),
                build_id: plugin_api::build_id(),
                plugins: components.records.clone(),
                target_source: spec.source.to_string(),
                target_sha256: spec.source_sha256.to_string(),
            };
            let dir = exp_dir.unwrap_or_else(|| experiment::fresh_dir(Path::new("experiments"), &cfg.name));
            let resolved = toml::to_string(&cfg)?;
            let mut exp = experiment::Experiment::create(&dir, &resolved, &manifest)?;
            tracing::info!("experiment: {}", dir.display());
            let summary = train::train(&cfg, components, &mut exp, &cache)?;
            print_summary(&summary);
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn print_summary(s: &train::TrainSummary) {
    println!("experiment   {}", s.experiment);
    println!("steps        {}  ({} target tokens, {:.0} s)", s.steps, s.tokens, s.wall_s);
    if let (Some(f), Some(l)) = (&s.first, &s.last) {
        println!("loss         {:.4} -> {:.4}", f.loss, l.loss);
        println!("tau_hat      {:.3} -> {:.3}", f.tau_hat, l.tau_hat);
        println!("acc@1        {:.3} -> {:.3}", f.acc.first().unwrap_or(&0.0), l.acc.first().unwrap_or(&0.0));
    }
    if let Some(c) = &s.last_checkpoint {
        println!("checkpoint   {c}");
    }
}

fn main() -> ExitCode {
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
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
