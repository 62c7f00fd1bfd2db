//! Sweeps in a comparison: an A/B folder's `selection.json` (written by `ab`) says which value
//! each swept arm was run at and chosen on the validation split; the runs at the other values
//! are shown as the arm's sweep curve and left out of the comparison of the arms.

use super::runs::Run;
use serde::{Deserialize, Serialize};
use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

pub const SELECTION_FILE: &str = "selection.json";

/// `selection.json`: how each swept arm's value was chosen.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Selection {
    /// The validation measure: `val_tau`, `val_tau_hat` or `val_loss`.
    pub select: String,
    pub higher_is_better: bool,
    /// Seed of every swept value's run.
    pub seed: u64,
    pub arms: Vec<ArmSweep>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArmSweep {
    pub arm: String,
    /// The swept fields (dotted paths into the run config).
    pub fields: Vec<String>,
    pub points: Vec<SweepScore>,
    /// The chosen point's label.
    pub chosen: String,
    /// The run folders at the chosen value, one per seed: the arm's runs in the comparison.
    pub chosen_runs: Vec<String>,
}

/// One swept value and its score.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepScore {
    /// `lr=0.003`: the folder-name part.
    pub label: String,
    pub values: BTreeMap<String, serde_json::Value>,
    /// Its first-seed run's folder.
    pub run: String,
    pub score: Option<f64>,
}

/// The selections of the A/B folders the runs live in (each read once), with those folders.
pub fn read_selections(runs: &[Run]) -> (Vec<(PathBuf, Selection)>, Vec<String>) {
    let mut out: Vec<(PathBuf, Selection)> = Vec::new();
    let mut notes = Vec::new();
    let mut seen: Vec<PathBuf> = Vec::new();
    for parent in runs.iter().filter_map(|r| r.dir.parent()) {
        if seen.iter().any(|p| p == parent) {
            continue;
        }
        seen.push(parent.to_path_buf());
        let path = parent.join(SELECTION_FILE);
        if !path.exists() {
            continue;
        }
        match input_files::read_to_string_capped(&path, 64 << 20)
            .map_err(|e| e.to_string())
            .and_then(|t| serde_json::from_str(&t).map_err(|e| e.to_string()))
        {
            Ok(s) => out.push((parent.to_path_buf(), s)),
            Err(e) => notes.push(format!("{}: unreadable, sweeps not shown ({e})", path.display())),
        }
    }
    (out, notes)
}

/// Whether a run belongs to a swept arm but is not one of its runs at the chosen value (shown in
/// the arm's sweep only, never compared).
pub fn is_unchosen(run: &Run, selections: &[(PathBuf, Selection)]) -> bool {
    let (Some(name), Some(arm)) = (run.dir.file_name().map(|n| n.to_string_lossy().into_owned()), run.arm.as_deref())
    else {
        return false;
    };
    selections
        .iter()
        .filter(|(dir, _)| Some(dir.as_path()) == run.dir.parent())
        .flat_map(|(_, s)| &s.arms)
        .any(|a| a.arm == arm && !a.chosen_runs.contains(&name))
}

/// What a report shows of sweeps: the selections found, every run read (compared or not), and
/// what could not be read.
#[derive(Debug, Default)]
pub struct Sweeps {
    pub selections: Vec<(PathBuf, Selection)>,
    pub runs: Vec<Run>,
    pub notes: Vec<String>,
}

impl Sweeps {
    /// Every swept arm: its A/B folder, selection and sweep.
    pub fn arms(&self) -> impl Iterator<Item = (&Path, &Selection, &ArmSweep)> {
        self.selections.iter().flat_map(|(dir, s)| s.arms.iter().map(move |a| (dir.as_path(), s, a)))
    }

    /// A swept value's first-seed run.
    pub fn run_of(&self, ab_dir: &Path, point: &SweepScore) -> Option<&Run> {
        self.runs.iter().find(|r| r.dir == ab_dir.join(&point.run))
    }
}

/// The file stem of an arm's sweep plot.
pub fn sweep_plot_stem(arm: &str) -> String {
    format!("sweep_{arm}")
}
