//! The validation measure a swept arm's value is chosen on (the A/B file's `select`): what a
//! swept run's config must have to produce it, and a run's score read from its folder.

use crate::config::RunConfig;
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The validation measure a sweep is decided on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Select {
    /// Real tau (z-lab's, per response) on the validation prompts: `eval-validation.json`.
    ValTau,
    /// tau-hat on the validation split at the run's last step (`train.eval_every`).
    ValTauHat,
    /// The DFlash loss on the validation split at the run's last step (lower is better).
    ValLoss,
}

impl Select {
    pub fn as_str(self) -> &'static str {
        match self {
            Select::ValTau => "val_tau",
            Select::ValTauHat => "val_tau_hat",
            Select::ValLoss => "val_loss",
        }
    }

    pub fn higher_is_better(self) -> bool {
        self != Select::ValLoss
    }

    /// A swept run's config must produce the measure: `[eval]` for real tau, `train.eval_every`
    /// for the others, and (with the built-in data plugin) a validation split.
    pub fn check(self, cfg: &RunConfig, splits: Option<(u64, u64)>, has_eval: bool) -> Result<()> {
        match self {
            Select::ValTau if !has_eval => {
                bail!("chosen by val_tau (real tau on the validation prompts), but the A/B has no [eval] table")
            }
            Select::ValTauHat | Select::ValLoss if cfg.train.eval_every == 0 => {
                bail!("chosen by {}, but `train.eval_every` is 0: set it (in [common], say)", self.as_str())
            }
            _ => {}
        }
        if splits.is_some_and(|(validation, _)| validation == 0) {
            bail!(
                "chosen by {} on the validation split, but [data] has `validation = 0`: hold some records out",
                self.as_str()
            );
        }
        Ok(())
    }

    /// The run's score, from its folder (None: not measured, or not a number).
    pub fn score(self, dir: &Path) -> Option<f64> {
        let v = match self {
            Select::ValTau => {
                let text =
                    input_files::read_to_string_capped(&dir.join(crate::eval::VALIDATION_FILE), 64 << 20).ok()?;
                serde_json::from_str::<serde_json::Value>(&text).ok()?.get("tau")?.as_f64()
            }
            Select::ValTauHat => crate::experiment::metrics::last_number(dir, "val_tau_hat"),
            Select::ValLoss => crate::experiment::metrics::last_number(dir, "val_loss"),
        };
        v.filter(|x| x.is_finite())
    }
}
