//! Benchmarks: `bench abi` (the plugin boundary's cost), `bench train` (training throughput at
//! real shapes), `bench attention` (one layer's block attention, checked and timed) and `bench fp8`
//! (the targets' linear layers as FP8 block-scaled GEMMs beside bf16; with `--accuracy`, how far
//! FP8 compute moves a target's features and logits).

pub mod abi;
pub mod allreduce;
pub mod attention;
pub mod flops;
pub mod fp8;
pub mod fp8_accuracy;
pub mod memory;
pub mod replica;
pub mod train;
mod train_report;
mod train_step;

pub use abi::abi;
