//! A/B experiments: arms that differ only in what the A/B config names (an optimizer, a drafter
//! setting, ...), each over several seeds, run one after another into side-by-side experiment
//! directories, then compared. A seed fixes the drafter's initial weights, the data order and
//! the anchors, so arm `a` seed 1 and arm `b` seed 1 see exactly the same batches.
//!
//! ```toml
//! name = "adamw-vs-muon"
//! base = "smollm2-chitchat.toml"   # relative to this file
//! seeds = [0, 1, 2]
//! [common]                          # shared by every arm, e.g. a shorter schedule
//! train = { steps = 100 }
//! [arms.adamw]
//! optimizer = { plugin = "adamw", lr = 3e-3 }
//! [arms.muon]
//! optimizer = { plugin = "muon", lr = 0.02 }
//! ```

use crate::config::{validate_name, RunConfig};
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AbConfig {
    pub name: String,
    /// The run config every arm starts from (relative to the A/B file).
    pub base: PathBuf,
    #[serde(default = "default_seeds")]
    pub seeds: Vec<u64>,
    /// Changes every arm shares (e.g. a shorter schedule than the base's), applied first.
    #[serde(default)]
    pub common: toml::Table,
    /// Arm name -> what it changes in the base config.
    pub arms: BTreeMap<String, toml::Table>,
}

fn default_seeds() -> Vec<u64> {
    vec![0]
}

/// One run of the plan.
#[derive(Debug)]
pub struct ArmRun {
    pub arm: String,
    pub seed: u64,
    pub config: RunConfig,
    /// The base config file (relative paths in it resolve from its folder).
    pub base_path: PathBuf,
    pub dir: PathBuf,
}

const PLUGIN_SECTIONS: [&str; 4] = ["target", "drafter", "optimizer", "data"];

/// Apply an arm's changes: tables merge key by key, except a plugin section that names another
/// plugin, which replaces the base section whole (the old plugin's keys mean nothing to the new).
pub fn merge(base: &mut toml::Table, arm: &toml::Table) {
    for (k, v) in arm {
        let replaces_plugin = PLUGIN_SECTIONS.contains(&k.as_str())
            && v.get("plugin").is_some()
            && v.get("plugin") != base.get(k).and_then(|b| b.get("plugin"));
        match (base.get_mut(k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(a)) if !replaces_plugin => merge(b, a),
            _ => {
                base.insert(k.clone(), v.clone());
            }
        }
    }
}

/// Read an A/B file and expand it into runs under `root/<name>/<arm>-s<seed>`.
pub fn plan(path: &Path, seeds: Option<u64>, root: &Path) -> Result<Vec<ArmRun>> {
    let text = input_files::read_to_string_capped(path, crate::config::MAX_CONFIG_BYTES).with_context(|| format!("reading {}", path.display()))?;
    let ab: AbConfig =
        toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}", crate::config::toml_error(path, &text, &e)))?;
    validate_name(&ab.name).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    if ab.arms.len() < 2 {
        bail!("{}: an A/B needs at least two arms, found {}", path.display(), ab.arms.len());
    }
    let seeds: Vec<u64> = match seeds {
        Some(n) if n == 0 => bail!("--seeds must be >= 1"),
        Some(n) => (0..n).collect(),
        None => ab.seeds.clone(),
    };
    let base_path = crate::config::config_dir(path).join(&ab.base);
    let base_text = input_files::read_to_string_capped(&base_path, crate::config::MAX_CONFIG_BYTES)
        .with_context(|| format!("reading base config {}", base_path.display()))?;
    let base: toml::Table = toml::from_str(&base_text)
        .map_err(|e| anyhow::anyhow!("{}", crate::config::toml_error(&base_path, &base_text, &e)))?;
    let mut runs = Vec::new();
    for (arm, changes) in &ab.arms {
        validate_name(arm).map_err(|e| anyhow::anyhow!("{}: arm `{arm}`: {e}", path.display()))?;
        for &seed in &seeds {
            let mut t = base.clone();
            merge(&mut t, &ab.common);
            merge(&mut t, changes);
            t.insert("name".into(), toml::Value::String(format!("{}-{arm}-s{seed}", ab.name)));
            t.insert("seed".into(), toml::Value::Integer(seed as i64));
            let config: RunConfig = t
                .try_into()
                .map_err(|e: toml::de::Error| anyhow::anyhow!("{}: arm `{arm}`: {}", path.display(), e.message()))?;
            config.validate().map_err(|e| anyhow::anyhow!("{}: arm `{arm}`: {e}", path.display()))?;
            runs.push(ArmRun {
                arm: arm.clone(),
                seed,
                config,
                base_path: base_path.clone(),
                dir: root.join(&ab.name).join(format!("{arm}-s{seed}")),
            });
        }
    }
    Ok(runs)
}

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
        bail!("{}: exists but is not an experiment (no config.toml); move it away to run arm `{}` seed {}", dir.display(), run.arm, run.seed);
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
        tracing::warn!("{}: its last checkpoint is at the last step, but it has no summary.json; counted as finished", dir.display());
        return Ok(ArmState::Finished);
    }
    Ok(ArmState::Unfinished)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"
name = "base"
[train]
steps = 10
[target]
plugin = "hf"
path = "m.gguf"
[drafter]
plugin = "dflash"
block_size = 8
[optimizer]
plugin = "adamw"
lr = 1e-3
betas = [0.9, 0.95]
[data]
plugin = "chat"
path = "d.json"
"#;

    const AB: &str = r#"
name = "opt"
base = "base.toml"
seeds = [0, 1]
[common]
train = { steps = 7 }
[arms.adamw]
optimizer = { lr = 2e-3 }
[arms.muon]
optimizer = { plugin = "muon", lr = 0.02 }
drafter = { block_size = 4 }
"#;

    #[test]
    fn arms_differ_only_in_what_they_name() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("base.toml"), BASE).unwrap();
        std::fs::write(dir.path().join("ab.toml"), AB).unwrap();
        let runs = plan(&dir.path().join("ab.toml"), None, Path::new("experiments")).unwrap();
        let names: Vec<_> = runs.iter().map(|r| (r.arm.as_str(), r.seed, r.config.name.as_str())).collect();
        assert_eq!(
            names,
            [("adamw", 0, "opt-adamw-s0"), ("adamw", 1, "opt-adamw-s1"), ("muon", 0, "opt-muon-s0"), ("muon", 1, "opt-muon-s1")]
        );
        assert_eq!(runs[2].dir, Path::new("experiments/opt/muon-s0"));
        // Same-plugin change merges (betas kept); another plugin replaces the section.
        let adamw = runs[0].config.section("optimizer");
        assert_eq!((adamw.plugin.as_str(), adamw.config_toml.contains("betas")), ("adamw", true));
        assert!(adamw.config_toml.contains("lr = 0.002"));
        let muon = runs[2].config.section("optimizer");
        assert_eq!(muon.plugin, "muon");
        assert!(!muon.config_toml.contains("betas"), "{}", muon.config_toml);
        assert!(runs[2].config.section("drafter").config_toml.contains("block_size = 4"));
        assert!(runs[0].config.section("drafter").config_toml.contains("block_size = 8"));
        // Everything else is identical.
        assert_eq!((runs[0].config.train.steps, runs[2].config.train.steps), (7, 7));
        assert_eq!(runs[0].config.section("data").config_toml, runs[2].config.section("data").config_toml);
        assert_eq!(runs[1].config.seed, runs[3].config.seed);
        let more = plan(&dir.path().join("ab.toml"), Some(3), Path::new("x")).unwrap();
        assert_eq!(more.len(), 6);
    }

    #[test]
    fn a_rerun_resumes_unfinished_arms_keeps_finished_ones_and_refuses_edited_ones() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("base.toml"), BASE).unwrap();
        std::fs::write(dir.path().join("ab.toml"), AB).unwrap();
        let runs = plan(&dir.path().join("ab.toml"), None, &dir.path().join("experiments")).unwrap();
        let r = &runs[0];
        assert_eq!(arm_state(r).unwrap(), ArmState::New);
        let exp = crate::experiment::Experiment::create(&r.dir, &toml::to_string(&r.config).unwrap(), &serde_json::json!({})).unwrap();
        drop(exp);
        assert_eq!(arm_state(r).unwrap(), ArmState::Unfinished);
        std::fs::write(r.dir.join("summary.json"), "{}").unwrap();
        assert_eq!(arm_state(r).unwrap(), ArmState::Finished);
        std::fs::remove_file(r.dir.join("summary.json")).unwrap();
        // The A/B file was edited since the arm started: refused, naming the field; nothing deleted.
        std::fs::write(dir.path().join("ab.toml"), AB.replace("lr = 2e-3", "lr = 5e-3")).unwrap();
        let edited = plan(&dir.path().join("ab.toml"), None, &dir.path().join("experiments")).unwrap();
        let err = arm_state(&edited[0]).unwrap_err().to_string();
        assert!(err.contains("arm `adamw` seed 0") && err.contains("`optimizer.lr` changed: 0.002 then, 0.005 now"), "{err}");
        assert!(r.dir.join("config.toml").exists());
        std::fs::remove_dir_all(&runs[1].dir).ok();
        std::fs::create_dir_all(&runs[1].dir).unwrap();
        std::fs::write(runs[1].dir.join("stray"), "").unwrap();
        assert!(arm_state(&runs[1]).unwrap_err().to_string().contains("not an experiment"));
    }

    #[test]
    fn bad_ab_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("base.toml"), BASE).unwrap();
        std::fs::write(dir.path().join("ab.toml"), AB.replace("[arms.muon]", "[arms.muon]\nstepz = 3")).unwrap();
        let err = plan(&dir.path().join("ab.toml"), None, Path::new("e")).unwrap_err().to_string();
        assert!(err.contains("arm `muon`") && err.contains("stepz"), "{err}");
        std::fs::write(dir.path().join("one.toml"), "name = \"x\"\nbase = \"base.toml\"\n[arms.a]\n").unwrap();
        let err = plan(&dir.path().join("one.toml"), None, Path::new("e")).unwrap_err().to_string();
        assert!(err.contains("at least two arms"), "{err}");
    }

    #[test]
    fn ab_and_arm_names_that_could_leave_experiments_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("base.toml"), BASE).unwrap();
        let ab = dir.path().join("ab.toml");
        for bad in ["../up", "a/b", ".hidden", ".."] {
            std::fs::write(&ab, AB.replace("name = \"opt\"", &format!("name = {:?}", bad))).unwrap();
            let err = plan(&ab, None, Path::new("e")).unwrap_err().to_string();
            assert!(err.contains("ab.toml") && err.contains("not a valid experiment name"), "{bad}: {err}");
            std::fs::write(&ab, AB.replace("[arms.muon]", &format!("[arms.{:?}]", bad))).unwrap();
            let err = plan(&ab, None, Path::new("e")).unwrap_err().to_string();
            assert!(err.contains(&format!("arm `{bad}`")) && err.contains("not a valid experiment name"), "{bad}: {err}");
        }
    }
}

/// `dflash-host ab`: every arm x seed (finished ones skipped, unfinished ones resumed), then the
/// comparison into `out` (default: the A/B folder's `report/`). Returns the report and, when a
/// run was interrupted, its exit code (rerunning the A/B resumes it).
pub fn run(
    config: &Path,
    seeds: Option<u64>,
    out: Option<&Path>,
    registry: &crate::plugins::Registry,
    print_summary: fn(&crate::train::TrainSummary),
) -> Result<(PathBuf, Option<u8>)> {
    let runs = plan(config, seeds, Path::new("experiments"))?;
    let ab_dir = runs[0].dir.parent().expect("arm dirs live in the A/B's folder").to_path_buf();
    tracing::info!("A/B {}: {} runs into {}", ab_dir.display(), runs.len(), ab_dir.display());
    let mut dirs = Vec::new();
    for (i, r) in runs.iter().enumerate() {
        tracing::info!("A/B run {}/{}: arm `{}`, seed {}", i + 1, runs.len(), r.arm, r.seed);
        let summary = match arm_state(r)? {
            ArmState::Finished => {
                tracing::info!("{} is complete already; skipping it", r.dir.display());
                None
            }
            ArmState::Unfinished => {
                tracing::info!("{} is unfinished: resuming it", r.dir.display());
                Some(crate::run::resume_with(&r.dir, None, registry, &crate::run::ResumeOptions::default())?)
            }
            ArmState::New => {
                let ab_name = ab_dir.file_name().unwrap_or_default().to_string_lossy().to_string();
                Some(crate::run::run(crate::run::RunSpec {
                    cfg: &r.config,
                    config_path: &r.base_path,
                    exp_dir: &r.dir,
                    registry,
                    ab: Some((&ab_name, &r.arm)),
                    stop_at: None,
                })?)
            }
        };
        if let Some(summary) = summary {
            print_summary(&summary);
            if let Some(code) = summary.interrupted {
                return Ok((ab_dir.join("report"), Some(code)));
            }
        }
        dirs.push(r.dir.clone());
    }
    let out = out.map_or_else(|| ab_dir.join("report"), Path::to_path_buf);
    Ok((crate::compare::run(&dirs, Some(&out), None)?, None))
}
