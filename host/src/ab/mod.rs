//! A/B experiments: arms that differ only in what the A/B config names (an optimizer, a drafter
//! setting, ...), each over several seeds, run one after another into side-by-side experiment
//! directories, then compared. A seed fixes the drafter's initial weights, the data order and
//! the anchors, so arm `a` seed 1 and arm `b` seed 1 see exactly the same batches.
//!
//! ```toml
//! name = "adamw-vs-muon"
//! base = "smollm2-chitchat.toml"   # relative to this file
//! seeds = [0, 1, 2]
//! select = "val_tau"                # what picks a swept arm's value (validation only)
//! [common]                          # shared by every arm, e.g. a shorter schedule
//! train = { steps = 100, eval_every = 20 }
//! data = { validation = 32 }
//! [eval]                            # real tau on the validation (if it selects) and test prompts
//! limit = 32
//! [arms.adamw]
//! optimizer = { plugin = "adamw" }
//! sweep = { "optimizer.lr" = [1e-3, 3e-3, 1e-2] }
//! [arms.muon]
//! optimizer = { plugin = "muon", lr = 0.02 }
//! ```
//!
//! An arm that sweeps ([`sweep`]) runs every value with the first seed; its value is then chosen
//! on a validation measure only ([`select`]: never the test prompts, never training metrics),
//! and the other seeds run at that value. Folders: `experiments/<name>/<arm>-s<seed>`, or
//! `<arm>-<field>=<value>-s<seed>` for a swept arm; `selection.json` records the choice; `[eval]`
//! runs `eval` in-process after each run ([`evals`]).
//!
//! Arms may instead continue one run from its checkpoint: with `[fork]`, every arm forks
//! `exp`'s checkpoint at step `at` (the run may still be training; it is only read), its config
//! the parent's with `[common]` and the arm's changes, and each seed varies what comes after the
//! fork (data order and anchors). An arm's `fork = { optimizer_state = "fresh", schedule =
//! "restart", rewarm = 8 }` chooses as `dflash-host fork` does:
//!
//! ```toml
//! name = "adamw-fork-muon"
//! seeds = [0, 1, 2]
//! [fork]
//! exp = "experiments/adamw-parent"
//! at = 80
//! [arms.adamw]
//! [arms.muon-fresh]
//! optimizer = { plugin = "muon", lr = 3e-3 }
//! fork = { optimizer_state = "fresh" }
//! [arms.muon-carry]
//! optimizer = { plugin = "muon", lr = 3e-3 }
//! fork = { optimizer_state = "carry" }
//! ```
//!
//! `compare` draws each fork's curve from its parent's up to the fork.

mod evals;
mod jobs;
mod measure;
mod plan;
mod runs;
mod select;
mod sweep;

pub use evals::EvalSpec;
pub use measure::Select;
pub use plan::{merge, plan, AbConfig, ArmFork, ArmPlan, ArmRun, ForkFrom, ForkRun, How, Plan, PointRuns, Stage};
pub use runs::{arm_state, ArmState};
pub use select::choose;
pub use sweep::SweepPoint;

use crate::plugins::Registry;
use anyhow::{bail, Result};
use runs::train_one;
use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

/// `dflash-host ab`: phase 1 runs every arm's first seed at every value it sweeps, phase 2 every
/// seed at each arm's value (chosen on the validation split between them, `selection.json`),
/// each run followed by `[eval]`; finished runs are skipped, unfinished ones resumed. Then the
/// comparison into `out` (default: the A/B folder's `report/`). Returns the report and, when a
/// run was interrupted, its exit code (rerunning the A/B resumes it).
pub fn run(
    config: &Path,
    how: &How,
    out: Option<&Path>,
    registry: &Registry,
    print_summary: fn(&crate::train::TrainSummary),
) -> Result<(PathBuf, Option<u8>)> {
    if let Some(out) = out {
        // Before hours of training (and again when the report is written).
        let ab_file = crate::experiment::guard::Input::new("the A/B file", config);
        crate::experiment::guard::check_out_folder("--out", out, &[ab_file])?;
    }
    let plan = how.plan(config, registry)?;
    let mut jobs = jobs::Jobs { config, how, forward: None };
    let report = plan.dir.join("report");
    let first: Vec<&ArmRun> = plan.first_seed_runs().collect();
    let swept = plan.arms.iter().filter(|a| !a.fields.is_empty()).count();
    let n_seeds = plan.arms[0].points[0].runs.len();
    tracing::info!(
        "A/B {}: {} arms{}, {n_seeds} seed(s), {} runs",
        plan.dir.display(),
        plan.arms.len(),
        if swept > 0 {
            format!(" ({swept} sweeping, chosen by {})", plan.select.map_or("-", Select::as_str))
        } else {
            String::new()
        },
        first.len() + plan.arms.len() * (n_seeds - 1),
    );
    // 1. Every arm's first seed, at every value it sweeps.
    if how.jobs > 1 {
        if let Some(code) = jobs.run(&first, Stage::First)? {
            return Ok((report, Some(code)));
        }
    } else {
        for (i, r) in first.iter().enumerate() {
            tracing::info!(
                "A/B phase 1, run {}/{}: arm `{}`{}, seed {}",
                i + 1,
                first.len(),
                r.arm,
                point_text(r),
                r.seed
            );
            if let Some(code) = train_one(r, registry, print_summary)? {
                return Ok((report, Some(code)));
            }
            first_evals(&plan, r, registry)?;
        }
    }
    // 2. Each swept arm's value, on the validation split only.
    let selection = choose(&plan)?;
    let mut chosen = BTreeMap::new();
    if !selection.arms.is_empty() {
        select::write(&plan, &selection)?;
        for a in &selection.arms {
            tracing::info!(
                "A/B: arm `{}` runs at {} (best {} on the validation split)",
                a.arm,
                a.chosen,
                selection.select
            );
            chosen.insert(a.arm.clone(), a.chosen.clone());
        }
    }
    // 3. Every seed at those values; the compared runs are evaluated on the test prompts too.
    let compared = plan.compared_runs(&chosen);
    if how.jobs > 1 {
        // The first seed's runs are trained already: they come back for their evaluations only.
        let due: Vec<&ArmRun> =
            compared.iter().copied().filter(|r| r.seed != first[0].seed || plan.eval.is_some()).collect();
        if let Some(code) = jobs.run(&due, Stage::Compared)? {
            return Ok((report, Some(code)));
        }
    } else {
        let later = compared.iter().filter(|r| r.seed != first[0].seed).count();
        let mut k = 0;
        for r in &compared {
            if r.seed != first[0].seed {
                k += 1;
                tracing::info!("A/B phase 2, run {k}/{later}: arm `{}`{}, seed {}", r.arm, point_text(r), r.seed);
                if let Some(code) = train_one(r, registry, print_summary)? {
                    return Ok((report, Some(code)));
                }
            }
            compared_evals(&plan, r, registry)?;
        }
    }
    // 4. The comparison: every run made (the sweep's other values shown as such).
    let mut dirs: Vec<PathBuf> = first.iter().chain(&compared).map(|r| r.dir.clone()).collect();
    dirs.sort();
    dirs.dedup();
    let out = out.map_or(report, Path::to_path_buf);
    Ok((crate::compare::run(&dirs, Some(&out), None)?, None))
}

/// After a phase-1 run: real tau on the validation prompts, only where it chooses (decoding
/// costs more than the training of a small run).
fn first_evals(plan: &Plan, r: &ArmRun, registry: &Registry) -> Result<()> {
    if let (Some(spec), Some(Select::ValTau)) = (&plan.eval, plan.select) {
        evals::ensure(&r.dir, registry, spec, &[evals::PromptSet::Validation])?;
    }
    Ok(())
}

/// After a compared run: the test prompts too.
fn compared_evals(plan: &Plan, r: &ArmRun, registry: &Registry) -> Result<()> {
    if let Some(spec) = &plan.eval {
        let sets: &[evals::PromptSet] = match plan.select {
            Some(Select::ValTau) => &[evals::PromptSet::Validation, evals::PromptSet::Test],
            _ => &[evals::PromptSet::Test],
        };
        evals::ensure(&r.dir, registry, spec, sets)?;
    }
    Ok(())
}

/// `ab --only RUN --stage S`: one run of the plan (its folder's name) and the evaluations its
/// phase asks for, as one of the processes of `ab --jobs`. Returns the code of an interrupted run.
pub fn run_only(
    config: &Path,
    how: &How,
    name: &str,
    stage: Stage,
    registry: &Registry,
    print_summary: fn(&crate::train::TrainSummary),
) -> Result<Option<u8>> {
    let plan = how.plan(config, registry)?;
    let Some(r) = plan.all_runs().find(|r| r.dir.file_name().is_some_and(|n| n == name)) else {
        bail!("{}: the A/B plans no run `{name}`", config.display());
    };
    if let Some(code) = train_one(r, registry, print_summary)? {
        return Ok(Some(code));
    }
    match stage {
        Stage::First => first_evals(&plan, r, registry)?,
        Stage::Compared => compared_evals(&plan, r, registry)?,
    }
    Ok(None)
}

fn point_text(r: &ArmRun) -> String {
    r.point.as_ref().map_or(String::new(), |p| format!(" at {p}"))
}

#[cfg(test)]
mod tests;
