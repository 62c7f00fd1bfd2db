//! Benchmarks: `bench abi` (the plugin boundary's cost) and `bench train` (training throughput
//! at real shapes; issue 8).

pub mod abi;
pub mod flops;
pub mod memory;
pub mod train;

pub use abi::abi;
