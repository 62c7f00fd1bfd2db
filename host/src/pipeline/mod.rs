//! Everything before the drafter: the components built from the config, batches, target
//! workers, the hidden-state cache and buffer (the scheduler), offline capture and
//! self-distillation. The trainer consumes what this module produces and is never imported
//! back.

pub mod assemble;
pub mod capture;
pub mod components;
pub mod distill;
pub mod hidden_cache;
pub mod mask_token;
pub mod ranks;
pub mod replicas;
pub mod scheduler;
pub mod stages;

pub use scheduler::*;
