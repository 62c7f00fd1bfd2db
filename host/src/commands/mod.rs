//! One module per subcommand of `dflash-host`, each a `run(args, plugin paths) -> Result<ExitCode>`
//! that reads its arguments, calls the library and prints what the user reads.

pub mod ab;
pub mod bench;
pub mod capture;
pub mod compare;
pub mod config;
pub mod distill;
pub mod doctor;
pub mod eval;
pub mod export;
pub mod fork;
pub mod plugins;
pub mod report;
pub mod train;
