//! Benchmarks: `bench abi` (the plugin boundary's cost), `bench train` (training throughput at
//! real shapes) and `bench attention` (one layer's block attention, checked and timed).

pub mod abi;
pub mod allreduce;
pub mod attention;
pub mod flops;
pub mod memory;
pub mod replica;
pub mod train;
mod train_report;

pub use abi::abi;
