//! The host: the fixed training pipeline around the four plugin kinds. `main.rs` is the CLI;
//! the modules are a library so integration tests (`tests/`) can drive them directly.

pub mod ab;
pub mod bench;
pub mod builtins;
pub mod cli;
pub mod compare;
pub mod config;
pub mod config_doc;
pub mod dist;
pub mod doctor;
pub mod eval;
pub mod experiment;
pub mod export;
pub mod launch;
pub mod out;
pub mod pipeline;
pub mod plugins;
pub mod preflight;
pub mod progress;
pub mod run;
pub mod sysinfo;
pub mod tensorboard;
pub mod train;
