//! HF's `rope_scaling` kinds: the frequency math lives in the `rope_scaling` crate, which the
//! target shares; a drafter reads its config through [`RopeScaling::from_json`] (fixed
//! frequencies only).

pub use rope_scaling::RopeScaling;
