//! `dflash-host`: trains DFlash drafters. The pipeline is fixed here; the target model, drafter,
//! optimizer and data loader are plugins (built in, or `--plugin PATH` shared libraries).

use anyhow::Result;
use clap::Parser;
use dflash_host::{
    cli::{Cli, Command},
    commands,
};
use std::process::ExitCode;

fn run() -> Result<ExitCode> {
    let Cli { plugins, command, no_memory_check } = Cli::parse();
    dflash_host::memory_estimate::skip_refusal(no_memory_check);
    match command {
        Command::Train(args) => commands::train::run(args, &plugins),
        Command::Fork(args) => commands::fork::run(args, &plugins),
        Command::Report(args) => commands::report::run(args),
        Command::Capture(args) => commands::capture::run(args, &plugins),
        Command::Distill(args) => commands::distill::run(args, &plugins),
        Command::Eval(args) => commands::eval::run(args, &plugins),
        Command::Export(args) => commands::export::run(args, &plugins),
        Command::Compare(args) => commands::compare::run(args, &plugins),
        Command::Ab(args) => commands::ab::run(args, &plugins),
        Command::Bench { what } => commands::bench::run(what, &plugins),
        Command::Config { command } => commands::config::run(command, &plugins),
        Command::Plugins { command } => commands::plugins::run(command, &plugins),
        Command::Doctor => commands::doctor::run(&plugins),
    }
}

fn main() -> ExitCode {
    dflash_host::dist::set_nccl_defaults(); // before any thread starts
    dflash_host::experiment::checkpoint::ignore_sigxfsz(); // `ulimit -f`: a write fails with EFBIG
    dflash_host::out::init_logging();
    dflash_host::memory_estimate::install_oom_hook();
    match run() {
        // A rank that served its replica's target until its lead stopped for a signal exits
        // with the signal's code, as the lead does.
        Ok(code) => dflash_host::signals::exit_code(code),
        Err(e) => {
            // One line: causes joined by ": " (multi-line causes flattened), tagged with the rank;
            // a closed stderr is no panic either.
            dflash_host::out::error_line(&format!("{e:#}"));
            ExitCode::from(2)
        }
    }
}
