//! Optimizer update math shared by the optimizer plugins: hyper-parameter structs and pure update
//! functions, no plugin entry point (a plugin crate's rlib would bring its `declare_plugin!`
//! symbols along into every plugin that links it).
//!
//! - [`adamw`]: `ParamsAdamW` and `adamw_update`, torch.optim.AdamW's order of operations
//!   (`adamw_update_fused`: its fused multi-tensor kernel).
//! - [`carry`]: reading another optimizer's state by role back into AdamW's moments.
//! - [`muon`]: `zeropower_via_newtonschulz5`, `muon_update`, `adjusted_lr`, torch.optim.Muon's;
//!   `shard_by_cost`, distributed Muon's split of the Newton-Schulz work across ranks.

pub mod adamw;
pub mod carry;
pub mod memory;
pub mod muon;

pub use adamw::{adamw_update, adamw_update_fused, adamw_update_master, ParamsAdamW};
pub use muon::{
    adjusted_lr, muon_momentum, muon_update, newton_schulz_cost, shard_by_cost, zeropower_via_newtonschulz5, AdjustLr,
    NS_COEFFICIENTS,
};
