//! The roles of an optimizer's per-parameter state (ABI 2.1): what `export_state` names each
//! tensor and `import_state` looks for, so a fork can carry state from one optimizer to another.
//! Every tensor has its parameter's shape and is fp32. An optimizer exports the roles it has and
//! takes the ones that map onto its own state; others are ignored and reported as such.

/// An exponential moving average of the gradient: AdamW's `exp_avg`, Muon's momentum buffer,
/// SGD's momentum.
pub const FIRST_MOMENT: &str = "first_moment";

/// An exponential moving average of the squared gradient: AdamW's `exp_avg_sq` (Muon's AdamW
/// group has one, its matrices do not).
pub const SECOND_MOMENT: &str = "second_moment";

/// The fp32 master copy of a parameter kept in another dtype (bf16).
pub const MASTER_WEIGHTS: &str = "master_weights";

/// Every role this ABI names, in the order reports list them.
pub const ALL: [&str; 3] = [FIRST_MOMENT, SECOND_MOMENT, MASTER_WEIGHTS];
