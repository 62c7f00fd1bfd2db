//! Optimizer update math shared by the optimizer plugins: hyper-parameter structs and pure update
//! functions, no plugin entry point (a plugin crate's rlib would bring its `declare_plugin!`
//! symbols along into every plugin that links it).
//!
//! - [`adamw`]: `ParamsAdamW` and `adamw_update`, torch.optim.AdamW's order of operations
//!   (`adamw_update_fused`: its fused multi-tensor kernel).
//! - [`muon`]: `zeropower_via_newtonschulz5`, `muon_update`, `adjusted_lr`, torch.optim.Muon's.

pub mod adamw;
pub mod muon;

pub use adamw::{adamw_update, adamw_update_fused, ParamsAdamW};
pub use muon::{adjusted_lr, muon_update, zeropower_via_newtonschulz5, AdjustLr, NS_COEFFICIENTS};
