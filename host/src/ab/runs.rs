//! One run of the plan: where it stands on disk (new, unfinished, finished), then trained from
//! the start, forked, resumed or left as it is.

use super::plan::ArmRun;
use crate::plugins::Registry;
use anyhow::{bail, Context, Result};
use std::path::Path;

/// Where an arm's run stands on disk, so a rerun of the A/B continues instead of redoing work.
#[derive(Debug, PartialEq, Eq)]
pub enum ArmState {
    /// No folder (or an empty one): start it.
    New,
    /// Started with this arm's config and not finished (interrupted, killed): resume it.
    Unfinished,
    /// Finished (summary.json, or its last checkpoint is at the last step): leave it.
    Finished,
}

/// The state of `run`'s folder. An unfinished arm must have been started with the config the
/// plan gives it now (an edited A/B file is refused, naming the fields, rather than mixed in);
/// nothing is ever deleted.
pub fn arm_state(run: &ArmRun) -> Result<ArmState> {
    let dir = &run.dir;
    if !dir.exists() || std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))?.next().is_none() {
        return Ok(ArmState::New);
    }
    if crate::experiment::is_finished(dir) {
        return Ok(ArmState::Finished);
    }
    let cfg_path = dir.join(crate::experiment::CONFIG);
    if !cfg_path.is_file() {
        bail!(
            "{}: exists but is not an experiment (no config.toml); move it away to run arm `{}` seed {}",
            dir.display(),
            run.arm,
            run.seed
        );
    }
    let then = input_files::read_to_string_capped(&cfg_path, crate::config::MAX_CONFIG_BYTES)?;
    let drift = crate::experiment::manifest::config_drift(&then, &toml::to_string(&run.config)?);
    if !drift.is_empty() {
        let fields: Vec<String> = drift.iter().map(|d| d.to_string()).collect();
        bail!(
            "arm `{}` seed {}: {} was started with another config ({}); move it away to run the arm again with this one",
            run.arm,
            run.seed,
            dir.display(),
            fields.join("; ")
        );
    }
    // Killed between its last checkpoint and its summary: nothing is left to train.
    let at = crate::experiment::checkpoint::newest_good(dir).0.map_or(0, |c| c.step);
    if at >= run.config.train.steps {
        tracing::warn!(
            "{}: its last checkpoint is at the last step, but it has no summary.json; counted as finished",
            dir.display()
        );
        return Ok(ArmState::Finished);
    }
    Ok(ArmState::Unfinished)
}

/// Train one run of the plan (new, resumed, or left as it is when finished). Returns the exit
/// code of an interrupted run.
pub(super) fn train_one(
    r: &ArmRun,
    registry: &Registry,
    print_summary: fn(&crate::train::TrainSummary),
) -> Result<Option<u8>> {
    let summary = match arm_state(r)? {
        ArmState::Finished => {
            tracing::info!("{} is complete already; skipping it", r.dir.display());
            None
        }
        ArmState::Unfinished => {
            tracing::info!("{} is unfinished: resuming it", r.dir.display());
            Some(crate::train::start::resume_with(
                &r.dir,
                None,
                registry,
                &crate::train::start::ResumeOptions::default(),
            )?)
        }
        ArmState::New if r.fork.is_some() => {
            let f = r.fork.as_ref().expect("a fork");
            let ab_name = r.dir.parent().and_then(Path::file_name).unwrap_or_default().to_string_lossy().to_string();
            Some(crate::train::fork::fork(crate::train::fork::ForkSpec {
                parent: &f.parent,
                at: f.at,
                overrides: Vec::new(),
                config: Some(r.config.clone()),
                exp_dir: Some(r.dir.clone()),
                optimizer_state: f.choices.optimizer_state,
                schedule: f.choices.schedule,
                rewarm: f.choices.rewarm,
                registry,
                stop_at: None,
                ab: Some((&ab_name, &r.arm)),
            })?)
        }
        ArmState::New => {
            let ab_name = r.dir.parent().and_then(Path::file_name).unwrap_or_default().to_string_lossy().to_string();
            Some(crate::train::start::run(crate::train::start::RunSpec {
                cfg: &r.config,
                config_path: &r.base_path,
                exp_dir: &r.dir,
                registry,
                ab: Some((&ab_name, &r.arm)),
                stop_at: None,
            })?)
        }
    };
    Ok(summary.and_then(|s| {
        print_summary(&s);
        s.interrupted
    }))
}
