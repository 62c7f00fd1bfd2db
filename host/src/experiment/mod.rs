//! The experiment directory, one run one folder: the resolved `config.toml`, `manifest.json`
//! ([`manifest`]), `metrics.jsonl` ([`metrics`]), TensorBoard events, `checkpoints/`
//! ([`checkpoint`]: written whole, verified before use), `summary.json` (present = finished),
//! `eval.json`. A process that changes the folder holds its [`lock`]; a command writing an
//! output folder or file goes through the [`guard`] (never into or over an experiment).

pub mod checkpoint;
mod files;
pub mod guard;
pub mod lock;
pub mod manifest;
pub mod metrics;
pub mod tensors;

pub use checkpoint::{read_safetensors, verify as verify_checkpoint, Checkpoint, CHECKPOINT_FILES};
use files::write_json;
pub use files::{read_json, write_json_atomic, CONFIG};
pub use lock::ExperimentLock;
pub use manifest::Manifest;

use crate::atomic_write::{sync_dir, write_synced};
use anyhow::{Context, Result};
use plugin_api::NamedTensor;
use serde::Serialize;
use std::{
    fs::{self, File},
    io::Write,
    path::{Path, PathBuf},
};

pub const SUMMARY: &str = "summary.json";

pub struct Experiment {
    pub dir: PathBuf,
    metrics: MetricsLog,
    /// Held for the life of the run (None on ranks other than 0).
    _lock: Option<ExperimentLock>,
}

/// `experiments/<name>`, or `<name>-2`, `-3`, ... if taken, so an earlier run is never
/// overwritten.
pub fn fresh_dir(root: &Path, name: &str) -> PathBuf {
    let first = root.join(name);
    if !first.exists() {
        return first;
    }
    (2..).map(|i| root.join(format!("{name}-{i}"))).find(|p| !p.exists()).expect("a free name")
}

/// Whether the run in `dir` ran to its end.
pub fn is_finished(dir: &Path) -> bool {
    dir.join(SUMMARY).is_file()
}

/// `metrics.jsonl`, one record a line. Logs nothing for a data-parallel rank other than 0: it
/// trains but writes nothing.
pub struct MetricsLog {
    path: PathBuf,
    file: Option<File>,
}

impl MetricsLog {
    fn detached(dir: &Path) -> Self {
        MetricsLog { path: dir.join(metrics::METRICS), file: None }
    }

    /// Append one metrics record and flush it (a crash loses at most the line being written).
    pub fn log(&mut self, record: &impl Serialize) -> Result<()> {
        let Some(file) = self.file.as_mut() else { return Ok(()) };
        let path = || format!("writing {}", self.path.display());
        let mut line = serde_json::to_vec(record).with_context(path)?;
        line.push(b'\n');
        let before = file.metadata().map(|m| m.len());
        if let Err(e) = file.write_all(&line) {
            // A write cut short (a full disk, the file-size limit) leaves no part of its record.
            if let Ok(len) = before {
                let _ = file.set_len(len);
            }
            return Err(anyhow::Error::new(e).context(path()));
        }
        Ok(())
    }
}

impl Experiment {
    /// A new experiment folder with its config, manifest and an empty metrics file. Built under a
    /// temporary name (this process's, locked) and renamed, so a folder that exists always has
    /// its config and manifest (a run killed while starting leaves only a `.NAME.tmp-PID`
    /// folder, removed by the next start).
    pub fn create(dir: &Path, config_toml: &str, manifest: &impl Serialize) -> Result<Self> {
        Self::create_with(dir, config_toml, manifest, |_| Ok(()))
    }

    /// [`create`](Self::create), with `fill` writing more into the folder (under its temporary
    /// name) before it appears: a fork's first checkpoint is there from the start.
    pub fn create_with(
        dir: &Path,
        config_toml: &str,
        manifest: &impl Serialize,
        fill: impl FnOnce(&Path) -> Result<()>,
    ) -> Result<Self> {
        let taken = || {
            anyhow::anyhow!(
                "experiment directory {} already exists and is not empty (resume it with `train --resume {}`)",
                dir.display(),
                dir.display()
            )
        };
        if dir.exists() && fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))?.next().is_some() {
            return Err(taken());
        }
        let name = folder_name(dir)?;
        let parent = parent_of(dir);
        let (tmp, lock) = Self::build(&parent, &name, config_toml, manifest, fill)?;
        if dir.exists() {
            // Empty, checked above; a folder something else filled meanwhile stays.
            fs::remove_dir(dir).with_context(|| format!("{}: not empty any more", dir.display()))?;
        }
        match publish_new(&tmp, dir) {
            Ok(true) => {}
            Ok(false) => {
                let _ = fs::remove_dir_all(&tmp);
                return Err(taken());
            }
            Err(e) => {
                let _ = fs::remove_dir_all(&tmp);
                return Err(e);
            }
        }
        sync_dir(&parent)?;
        Self::open(dir, lock)
    }

    /// A new experiment `root/NAME`, or `NAME-2`, `NAME-3`, ... where taken, claimed atomically:
    /// the folder is built under a temporary name and renamed to the first free name without
    /// replacing anything, so runs started at once with one default name each get their own.
    pub fn create_numbered(
        root: &Path,
        name: &str,
        config_toml: &str,
        manifest: &impl Serialize,
        fill: impl FnOnce(&Path) -> Result<()>,
    ) -> Result<Self> {
        let (tmp, lock) = Self::build(root, name, config_toml, manifest, fill)?;
        for i in 1u64.. {
            let dir = if i == 1 { root.join(name) } else { root.join(format!("{name}-{i}")) };
            match publish_new(&tmp, &dir) {
                Ok(true) => {
                    sync_dir(root)?;
                    return Self::open(&dir, lock);
                }
                Ok(false) => continue,
                Err(e) => {
                    let _ = fs::remove_dir_all(&tmp);
                    return Err(e);
                }
            }
        }
        unreachable!("a free name")
    }

    /// The folder's contents under `.NAME.tmp-PID` in `parent`, locked.
    fn build(
        parent: &Path,
        name: &str,
        config_toml: &str,
        manifest: &impl Serialize,
        fill: impl FnOnce(&Path) -> Result<()>,
    ) -> Result<(PathBuf, ExperimentLock)> {
        fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
        remove_abandoned_starts(parent, name);
        let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
        let _ = fs::remove_dir_all(&tmp);
        // Locked before it takes the name other starts clean up (only unlocked ones).
        let unnamed = parent.join(format!(".{name}.new-{}", std::process::id()));
        let _ = fs::remove_dir_all(&unnamed);
        let built = (|| {
            fs::create_dir_all(unnamed.join("checkpoints")).with_context(|| format!("creating {}", tmp.display()))?;
            let lock = ExperimentLock::acquire(&unnamed)?; // the lock file moves with the folder
            fs::rename(&unnamed, &tmp).with_context(|| format!("creating {}", tmp.display()))?;
            write_synced(&tmp.join(CONFIG), config_toml.as_bytes())?;
            write_json(&tmp.join(manifest::MANIFEST), manifest)?;
            write_synced(&tmp.join(metrics::METRICS), b"")?;
            fill(&tmp)?;
            Ok(lock)
        })();
        match built {
            Ok(lock) => Ok((tmp, lock)),
            Err(e) => {
                let _ = fs::remove_dir_all(&unnamed);
                let _ = fs::remove_dir_all(&tmp);
                Err(e)
            }
        }
    }

    /// An existing experiment, to resume from the checkpoint at `keep_through_step` (0: none):
    /// metrics lines and TensorBoard events after it (written after that checkpoint, or cut
    /// short by a crash) are dropped, so the resumed run's continue the files as if it had never
    /// stopped; `summary.json` goes (the run is not finished while it trains).
    pub fn reopen(dir: &Path, lock: ExperimentLock, keep_through_step: u64) -> Result<Self> {
        metrics::truncate_after(dir, keep_through_step)?;
        crate::tensorboard::truncate_after(dir, keep_through_step)?;
        let summary = dir.join(SUMMARY);
        if summary.exists() {
            fs::remove_file(&summary).with_context(|| format!("removing {}", summary.display()))?;
        }
        Self::open(dir, lock)
    }

    fn open(dir: &Path, lock: ExperimentLock) -> Result<Self> {
        let path = dir.join(metrics::METRICS);
        let metrics =
            fs::OpenOptions::new().append(true).open(&path).with_context(|| format!("opening {}", path.display()))?;
        Ok(Self { dir: dir.to_path_buf(), metrics: MetricsLog { path, file: Some(metrics) }, _lock: Some(lock) })
    }

    /// Rank 1.. of a data-parallel run: rank 0 owns the folder.
    pub fn detached(dir: &Path) -> Self {
        Self { dir: dir.to_path_buf(), metrics: MetricsLog::detached(dir), _lock: None }
    }

    /// Append one metrics record ([`MetricsLog::log`]).
    pub fn log(&mut self, record: &impl Serialize) -> Result<()> {
        self.metrics.log(record)
    }

    /// `metrics.jsonl` for the trainer to append to; this value logs nothing after.
    pub fn take_metrics_log(&mut self) -> MetricsLog {
        let detached = MetricsLog::detached(&self.dir);
        std::mem::replace(&mut self.metrics, detached)
    }

    /// `checkpoints/step-N/` (see [`checkpoint::write`]): whole or absent even across a power
    /// cut; then the newest `keep` are kept, the one just written always among them.
    pub fn save_checkpoint(
        &self,
        step: u64,
        weights: &[NamedTensor],
        drafter_config_json: &str,
        optimizer_state: &[NamedTensor],
        trainer_state: &impl Serialize,
        keep: usize,
    ) -> Result<PathBuf> {
        let config = with_weights_dtype(drafter_config_json, weights);
        let data = checkpoint::CheckpointData { weights, drafter_config_json: &config, optimizer_state, trainer_state };
        checkpoint::write(&self.dir, step, &data, keep)
    }

    pub fn write_summary(&self, summary: &impl Serialize) -> Result<()> {
        write_json_atomic(&self.dir.join(SUMMARY), summary)
    }
}

/// The drafter's config.json with `dtype` set to the dtype its saved weights have (a drafter
/// training in f32 states bfloat16, the dtype it is served in; the checkpoint holds f32). Text
/// that is not a JSON object is kept as it is.
pub fn with_weights_dtype(config_json: &str, weights: &[NamedTensor]) -> String {
    let Ok(serde_json::Value::Object(mut cfg)) = serde_json::from_str::<serde_json::Value>(config_json) else {
        return config_json.to_string();
    };
    use plugin_api::tch::Kind;
    let float = |k: Kind| match k {
        Kind::Float => Some("float32"),
        Kind::BFloat16 => Some("bfloat16"),
        Kind::Half => Some("float16"),
        Kind::Double => Some("float64"),
        _ => None,
    };
    let Some(name) = weights.iter().find_map(|w| float(w.tensor.tensor().kind())) else {
        return config_json.to_string();
    };
    cfg.remove("torch_dtype");
    cfg.insert("dtype".into(), name.into());
    serde_json::to_string_pretty(&serde_json::Value::Object(cfg)).expect("a JSON value serialises")
}

fn folder_name(dir: &Path) -> Result<String> {
    Ok(dir.file_name().with_context(|| format!("{}: not a folder name", dir.display()))?.to_string_lossy().to_string())
}

fn parent_of(dir: &Path) -> PathBuf {
    dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")).to_path_buf()
}

/// Rename `tmp` to `dir` unless `dir` exists (`renameat2(RENAME_NOREPLACE)`; where the file
/// system lacks it, a check then a rename). False when `dir` is taken.
fn publish_new(tmp: &Path, dir: &Path) -> Result<bool> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).context("a NUL byte in the path");
    let renamed = crate::outputs::rename_at(libc::AT_FDCWD, &c(tmp)?, libc::AT_FDCWD, &c(dir)?, libc::RENAME_NOREPLACE);
    match renamed {
        Ok(()) => Ok(true),
        Err(e) if matches!(e.raw_os_error(), Some(libc::EEXIST) | Some(libc::ENOTEMPTY)) => Ok(false),
        Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL) | Some(libc::ENOSYS)) => {
            if dir.symlink_metadata().is_ok() {
                return Ok(false);
            }
            fs::rename(tmp, dir).with_context(|| format!("renaming {} to {}", tmp.display(), dir.display()))?;
            Ok(true)
        }
        Err(e) => Err(anyhow::Error::new(e).context(format!("renaming {} to {}", tmp.display(), dir.display()))),
    }
}

/// Temporary folders of starts that were killed (their lock is free); a start under way keeps
/// its own.
fn remove_abandoned_starts(parent: &Path, name: &str) {
    let prefix = format!(".{name}.tmp-");
    // A start killed before it locked its folder leaves `.NAME.new-PID` (PID no longer alive).
    let unnamed = format!(".{name}.new-");
    let dead = |pid: &str| {
        // SAFETY: kill(pid, 0) only asks whether the process exists.
        pid.parse::<i32>().is_ok_and(|p| p > 0 && unsafe { libc::kill(p, 0) } != 0)
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
    };
    for e in fs::read_dir(parent).into_iter().flatten().filter_map(|e| e.ok()) {
        let file = e.file_name();
        let Some(n) = file.to_str() else { continue };
        let abandoned = match (n.strip_prefix(&prefix), n.strip_prefix(&unnamed)) {
            (Some(_), _) => ExperimentLock::acquire(&e.path()).is_ok(),
            (None, Some(pid)) => dead(pid),
            _ => false,
        };
        if abandoned {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use plugin_api::tch::Tensor;

    /// A metrics record written past the file-size limit (`ulimit -f`) fails with an error naming
    /// metrics.jsonl and leaves no part of itself in the file. In a forked child, whose limit is
    /// its own; the kernel writes the record's first bytes up to the limit, then refuses the rest.
    #[test]
    fn a_metrics_record_cut_by_the_file_size_limit_leaves_no_part_of_itself() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("exp");
        let mut exp = Experiment::create(&dir, "", &serde_json::json!({})).unwrap();
        exp.log(&serde_json::json!({"step": 1, "loss": 1.5})).unwrap();
        let path = dir.join(metrics::METRICS);
        let before = fs::read(&path).unwrap();
        let big = serde_json::json!({"step": 2, "note": "x".repeat(4096)});
        // SAFETY: the child sets its own limit, writes and leaves through _exit.
        match unsafe { libc::fork() } {
            0 => unsafe {
                libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
                let limit = before.len() as libc::rlim_t + 100;
                libc::setrlimit(libc::RLIMIT_FSIZE, &libc::rlimit { rlim_cur: limit, rlim_max: limit });
                let code = match exp.log(&big) {
                    Err(e) if format!("{e:#}").contains("metrics.jsonl") => 0,
                    Err(_) => 2,
                    Ok(()) => 3,
                };
                libc::_exit(code)
            },
            pid => {
                let mut status = 0;
                assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
                assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "child status {status}");
            }
        }
        assert_eq!(fs::read(&path).unwrap(), before);
        exp.log(&serde_json::json!({"step": 2, "loss": 1.25})).unwrap();
        let lines = fs::read_to_string(&path).unwrap();
        assert_eq!(lines.lines().count(), 2, "{lines}");
    }

    #[test]
    fn an_abandoned_start_is_cleaned_up_and_a_live_one_kept() {
        let root = tempfile::tempdir().unwrap();
        let dead = root.path().join(".exp.tmp-999999");
        fs::create_dir(&dead).unwrap();
        let live = root.path().join(".exp.tmp-1");
        fs::create_dir(&live).unwrap();
        let _held = ExperimentLock::acquire(&live).unwrap();
        Experiment::create(&root.path().join("exp"), "", &serde_json::json!({})).unwrap();
        assert!(!dead.exists() && live.exists());
        let err = Experiment::create(&root.path().join("exp"), "", &serde_json::json!({})).err().unwrap().to_string();
        assert!(err.contains("already exists and is not empty"), "{err}");
    }

    #[test]
    fn fresh_dir_never_reuses_a_taken_name() {
        let root = tempfile::tempdir().unwrap();
        let a = fresh_dir(root.path(), "run");
        assert_eq!(a, root.path().join("run"));
        fs::create_dir_all(&a).unwrap();
        let b = fresh_dir(root.path(), "run");
        assert_eq!(b, root.path().join("run-2"));
    }

    #[test]
    fn checkpoints_round_trip_and_old_ones_are_pruned() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("exp");
        let exp = Experiment::create(&dir, "name = \"x\"\n", &serde_json::json!({"seed": 1})).unwrap();
        let w = vec![NamedTensor::new("fc.weight", Tensor::from_slice(&[1.0f32, 2.0, 3.0]).view([3, 1]))];
        for step in [10, 20, 30] {
            exp.save_checkpoint(step, &w, "{}", &[], &serde_json::json!({"step": step}), 2).unwrap();
        }
        let names: Vec<_> = fs::read_dir(dir.join("checkpoints")).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 2, "{names:?}");
        let back = read_safetensors(&dir.join("checkpoints/step-30/model.safetensors")).unwrap();
        assert_eq!(back[0].name.as_str(), "fc.weight");
        assert!(back[0].tensor.tensor().equal(&w[0].tensor.tensor()));
    }

    #[test]
    fn a_truncated_checkpoint_is_an_error_naming_the_file() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("exp");
        let exp = Experiment::create(&dir, "name = \"x\"\n", &serde_json::json!({"seed": 1})).unwrap();
        let w = vec![
            NamedTensor::new(
                "fc.weight",
                Tensor::ones([64, 32], (plugin_api::tch::Kind::Float, plugin_api::tch::Device::Cpu)),
            ),
            NamedTensor::new(
                "fc.bias",
                Tensor::zeros([64], (plugin_api::tch::Kind::Float, plugin_api::tch::Device::Cpu)),
            ),
        ];
        let ckpt = exp.save_checkpoint(1, &w, "{}", &[], &serde_json::json!({"step": 1}), 1).unwrap();
        let model = ckpt.join("model.safetensors");
        let bytes = fs::read(&model).unwrap();
        // Cut in the data, in the JSON header, and inside the 8-byte header length.
        for cut in [bytes.len() / 2, 20, 5] {
            fs::write(&model, &bytes[..cut]).unwrap();
            let err = format!("{:#}", read_safetensors(&model).expect_err("a truncated file read"));
            assert!(err.contains(&model.display().to_string()), "cut at {cut}: {err}");
            let err = format!(
                "{:#}",
                crate::export::export(
                    &ckpt,
                    &root.path().join("out"),
                    false,
                    &crate::plugins::Registry::new(&[]).unwrap()
                )
                .unwrap_err()
            );
            assert!(err.contains(&model.display().to_string()), "export, cut at {cut}: {err}");
            let err = format!("{:#}", verify_checkpoint(&ckpt).unwrap_err());
            assert!(err.contains("model.safetensors") && err.contains("checksum mismatch"), "{err}");
        }
    }
}
