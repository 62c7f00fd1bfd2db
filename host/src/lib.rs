//! The host: the fixed training pipeline around the four plugin kinds. `main.rs` is the CLI;
//! the modules are a library so integration tests (`tests/`) can drive them directly.

pub mod ab;
pub mod atomic_write;
pub mod bench;
pub mod cli;
pub mod commands;
pub mod compare;
pub mod config;
pub mod dist;
pub mod environment;
pub mod eval;
pub mod experiment;
pub mod export;
pub mod memory_estimate;
pub mod out;
pub mod outputs;
pub mod pipeline;
pub mod plan;
pub mod plugins;
pub mod progress;
pub mod report;
pub mod signals;
pub mod sysinfo;
pub mod tensorboard;
pub mod train;
