//! Checkpoints: `checkpoints/step-N/` holds the drafter weights + config, the optimizer state,
//! the trainer state and `checksums.json` (CRC-32C of each, written last). Written whole or not
//! at all; found only through [`find`] / [`newest_good`], which verify them; pruned without ever
//! touching the one just written; corrupt ones or ones past a resume point are moved aside to
//! `checkpoints/corrupt/`, never used and never silently deleted.

use super::{read_json, write_json};
use crate::atomic_write::{sync_dir, write_synced};
use anyhow::{bail, Context, Result};
use plugin_api::{tch::Tensor, NamedTensor};
use serde::Serialize;
use std::{
    fs::{self, File},
    io::Read,
    path::{Path, PathBuf},
};

/// The files of a checkpoint, each with a checksum in `checksums.json`.
pub const CHECKPOINT_FILES: [&str; 4] =
    ["model.safetensors", "config.json", "optimizer.safetensors", "trainer_state.json"];
pub const CHECKSUMS: &str = "checksums.json";
/// Where corrupt checkpoints and ones past a resume point go (kept for a post-mortem).
pub const SET_ASIDE: &str = "corrupt";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    pub step: u64,
    pub dir: PathBuf,
}

fn root(exp_dir: &Path) -> PathBuf {
    exp_dir.join("checkpoints")
}

/// What a checkpoint holds besides its step.
pub struct CheckpointData<'a, S: Serialize> {
    pub weights: &'a [NamedTensor],
    pub drafter_config_json: &'a str,
    pub optimizer_state: &'a [NamedTensor],
    pub trainer_state: &'a S,
}

/// Write `checkpoints/step-N/` through a temporary folder (fsynced, then renamed), then prune to
/// `keep`. A failed write (a full disk) removes its temporary folder and names the file.
pub fn write<S: Serialize>(exp_dir: &Path, step: u64, data: &CheckpointData<S>, keep: usize) -> Result<PathBuf> {
    let root = root(exp_dir);
    let final_dir = root.join(format!("step-{step}"));
    let tmp = root.join(format!(".step-{step}.tmp"));
    let _ = fs::remove_dir_all(&tmp);
    if let Err(e) = write_files(&tmp, data) {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e.context(format!(
            "checkpoint step-{step} not written (its partial folder {} was removed)",
            tmp.display()
        )));
    }
    if final_dir.exists() {
        // Only a run that resumed before this step can meet its own old folder here, and resume
        // moves those aside first; never delete one anyway.
        set_aside_one(&root, &final_dir, "a checkpoint of the same step was already there")?;
    }
    fs::rename(&tmp, &final_dir).with_context(|| format!("renaming {} to {}", tmp.display(), final_dir.display()))?;
    sync_dir(&root)?;
    prune(exp_dir, keep, step)?;
    Ok(final_dir)
}

fn write_files<S: Serialize>(tmp: &Path, data: &CheckpointData<S>) -> Result<()> {
    fs::create_dir_all(tmp).with_context(|| format!("creating {}", tmp.display()))?;
    write_safetensors(&tmp.join("model.safetensors"), data.weights)?;
    write_synced(&tmp.join("config.json"), data.drafter_config_json.as_bytes())?;
    write_safetensors(&tmp.join("optimizer.safetensors"), data.optimizer_state)?;
    write_json(&tmp.join("trainer_state.json"), data.trainer_state)?;
    let mut sums = serde_json::Map::new();
    for file in CHECKPOINT_FILES {
        sums.insert(file.into(), format!("{:08x}", file_crc(&tmp.join(file))?).into());
    }
    write_json(&tmp.join(CHECKSUMS), &sums)?;
    sync_dir(tmp)
}

fn write_safetensors(path: &Path, tensors: &[NamedTensor]) -> Result<()> {
    let owned: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|nt| {
            (nt.name.to_string(), nt.tensor.tensor().detach().to_device(plugin_api::tch::Device::Cpu).contiguous())
        })
        .collect();
    Tensor::write_safetensors(&owned, path).with_context(|| format!("writing {}", path.display()))?;
    File::open(path).and_then(|f| f.sync_all()).with_context(|| format!("syncing {}", path.display()))
}

/// CRC-32C of a file, streamed (a checkpoint of a large drafter is not read into memory twice).
fn file_crc(path: &Path) -> Result<u32> {
    let mut f = input_files::open_regular(path)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut crc = 0u32;
    loop {
        let n = f.read(&mut buf).with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            return Ok(crc);
        }
        crc = crc32c::crc32c_append(crc, &buf[..n]);
    }
}

/// Check a checkpoint folder against its `checksums.json`: every file present, none changed.
pub fn verify(dir: &Path) -> Result<()> {
    let sums_path = dir.join(CHECKSUMS);
    let sums: serde_json::Map<String, serde_json::Value> = read_json(&sums_path)?;
    for file in CHECKPOINT_FILES {
        let want = sums
            .get(file)
            .and_then(|v| v.as_str())
            .with_context(|| format!("{}: no checksum for {file}", sums_path.display()))?;
        let got = format!("{:08x}", file_crc(&dir.join(file))?);
        if got != want {
            bail!(
                "{}: checksum mismatch (CRC-32C {got}, recorded {want}): the file is truncated or corrupt",
                dir.join(file).display()
            );
        }
    }
    Ok(())
}

/// Checkpoint folders `step-N` directly under `exp_dir/checkpoints`, newest first (unverified:
/// use [`find`] or [`newest_good`] to pick one).
pub fn list(exp_dir: &Path) -> Vec<Checkpoint> {
    let mut all: Vec<Checkpoint> = fs::read_dir(root(exp_dir))
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| {
            Some(Checkpoint { step: e.file_name().to_str()?.strip_prefix("step-")?.parse().ok()?, dir: e.path() })
        })
        .collect();
    all.sort_by(|a, b| b.step.cmp(&a.step));
    all
}

/// The newest checkpoint that verifies; the corrupt ones passed over on the way are reported
/// and returned (all newer than the one found).
pub fn newest_good(exp_dir: &Path) -> (Option<Checkpoint>, Vec<Checkpoint>) {
    let mut corrupt = Vec::new();
    for c in list(exp_dir) {
        match verify(&c.dir) {
            Ok(()) => return (Some(c), corrupt),
            Err(e) => {
                tracing::warn!("skipping checkpoint step-{}: {e:#}", c.step);
                corrupt.push(c);
            }
        }
    }
    (None, corrupt)
}

/// The checkpoint every reader uses (resume, eval, export): step `step`, which must verify, or
/// else the newest that verifies.
pub fn find(exp_dir: &Path, step: Option<u64>) -> Result<Checkpoint> {
    if !exp_dir.join("config.toml").is_file() {
        bail!("{}: not an experiment directory (no config.toml)", exp_dir.display());
    }
    match step {
        Some(n) => {
            let dir = root(exp_dir).join(format!("step-{n}"));
            if !dir.is_dir() {
                let have: Vec<String> = list(exp_dir).iter().map(|c| c.step.to_string()).collect();
                bail!(
                    "{}: no checkpoint step-{n} (have: {})",
                    exp_dir.display(),
                    if have.is_empty() { "none".into() } else { have.join(", ") }
                );
            }
            verify(&dir).with_context(|| format!("checkpoint step-{n} is not usable"))?;
            Ok(Checkpoint { step: n, dir })
        }
        None => match newest_good(exp_dir) {
            (Some(c), _) => Ok(c),
            (None, corrupt) if corrupt.is_empty() => bail!("{}: no checkpoints yet", exp_dir.display()),
            (None, corrupt) => bail!("{}: no checkpoint verifies ({} corrupt)", exp_dir.display(), corrupt.len()),
        },
    }
}

/// Move every checkpoint after `step` (corrupt ones a resume passed over, or ones a run wrote
/// after the checkpoint it resumes from) to `checkpoints/corrupt/`, saying so: pruning counts
/// only what the resumed run writes, and nothing is deleted that someone may want to look at.
pub fn set_aside_after(exp_dir: &Path, step: u64) -> Result<Vec<PathBuf>> {
    let root = root(exp_dir);
    let mut moved = Vec::new();
    for c in list(exp_dir).into_iter().filter(|c| c.step > step) {
        moved.push(set_aside_one(&root, &c.dir, &format!("it is past step {step}, where the run resumes"))?);
    }
    Ok(moved)
}

fn set_aside_one(root: &Path, dir: &Path, why: &str) -> Result<PathBuf> {
    let aside = root.join(SET_ASIDE);
    fs::create_dir_all(&aside).with_context(|| format!("creating {}", aside.display()))?;
    let name = dir.file_name().expect("a checkpoint folder").to_string_lossy().to_string();
    let dest = std::iter::once(aside.join(&name))
        .chain((1..).map(|i| aside.join(format!("{name}.{i}"))))
        .find(|p| !p.exists())
        .expect("a free name");
    fs::rename(dir, &dest).with_context(|| format!("moving {} to {}", dir.display(), dest.display()))?;
    tracing::warn!("moved checkpoint {name} aside to {} ({why})", dest.display());
    Ok(dest)
}

/// Keep the checkpoint just written and the newest `keep - 1` older ones; drop leftovers of
/// writes a crash interrupted. Nothing newer than `written` exists here after a resume (those
/// were set aside); one that somehow does is set aside too, never deleted.
fn prune(exp_dir: &Path, keep: usize, written: u64) -> Result<()> {
    let root = root(exp_dir);
    let mut older = 0;
    for c in list(exp_dir) {
        if c.step > written {
            set_aside_one(&root, &c.dir, &format!("it is newer than step {written}, just written"))?;
        } else if c.step < written {
            older += 1;
            if older >= keep {
                fs::remove_dir_all(&c.dir).with_context(|| format!("removing old checkpoint {}", c.dir.display()))?;
            }
        }
    }
    for e in fs::read_dir(&root).with_context(|| format!("reading {}", root.display()))?.filter_map(|e| e.ok()) {
        if e.file_name().to_str().is_some_and(|n| n.starts_with('.') && n.ends_with(".tmp")) {
            let _ = fs::remove_dir_all(e.path());
        }
    }
    Ok(())
}

/// Read a checkpoint's safetensors file back as named tensors.
pub fn read_safetensors(path: &Path) -> Result<Vec<NamedTensor>> {
    input_files::open_regular(path)?;
    let tensors = Tensor::read_safetensors(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(tensors.into_iter().map(|(n, t)| NamedTensor::new(n, t)).collect())
}

#[cfg(test)]
mod tests {
    use super::super::Experiment;
    use super::*;
    use plugin_api::tch::{Device, Kind};

    fn names(dir: &Path) -> Vec<String> {
        let mut n: Vec<String> =
            fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        n.sort();
        n
    }

    fn experiment(root: &Path, steps: &[u64], keep: usize) -> (Experiment, Vec<NamedTensor>) {
        let exp = Experiment::create(&root.join("exp"), "name = \"x\"\n", &serde_json::json!({"seed": 1})).unwrap();
        let w = vec![NamedTensor::new("fc.weight", Tensor::ones([8, 4], (Kind::Float, Device::Cpu)))];
        for &step in steps {
            exp.save_checkpoint(step, &w, "{}", &[], &serde_json::json!({ "step": step }), keep).unwrap();
        }
        (exp, w)
    }

    fn corrupt(dir: &Path) {
        let model = dir.join("model.safetensors");
        let bytes = fs::read(&model).unwrap();
        fs::write(&model, &bytes[..bytes.len() / 2]).unwrap();
    }

    #[test]
    fn the_checkpoint_just_written_survives_pruning_and_newer_ones_are_set_aside() {
        let root = tempfile::tempdir().unwrap();
        let (exp, w) = experiment(root.path(), &[1, 2, 3, 4, 5], 5);
        let ckpts = exp.dir.join("checkpoints");
        corrupt(&ckpts.join("step-4"));
        corrupt(&ckpts.join("step-5"));
        // A resume finds step 3 past the two corrupt ones...
        let (good, passed) = newest_good(&exp.dir);
        assert_eq!(good.unwrap().step, 3);
        assert_eq!(passed.iter().map(|c| c.step).collect::<Vec<_>>(), [5, 4]);
        // ...and even if nothing set them aside, writing step 3 again with keep = 1 keeps step 3:
        // the higher-numbered ones are moved aside, not counted as the newest.
        exp.save_checkpoint(3, &w, "{}", &[], &serde_json::json!({"step": 3}), 1).unwrap();
        assert_eq!(names(&ckpts), ["corrupt", "step-3"]);
        assert_eq!(names(&ckpts.join(SET_ASIDE)), ["step-3", "step-4", "step-5"]);
        verify(&ckpts.join("step-3")).unwrap();
        assert_eq!(find(&exp.dir, None).unwrap().step, 3, "set-aside folders are never found");
    }

    #[test]
    fn set_aside_moves_everything_after_the_resume_point() {
        let root = tempfile::tempdir().unwrap();
        let (exp, _) = experiment(root.path(), &[1, 2, 3], 3);
        let moved = set_aside_after(&exp.dir, 1).unwrap();
        assert_eq!(moved.len(), 2);
        let ckpts = exp.dir.join("checkpoints");
        assert_eq!(names(&ckpts), ["corrupt", "step-1"]);
        // A second set-aside of the same name gets a suffix, never overwrites.
        exp.save_checkpoint(2, &[], "{}", &[], &serde_json::json!({}), 3).unwrap();
        set_aside_after(&exp.dir, 1).unwrap();
        assert_eq!(names(&ckpts.join(SET_ASIDE)), ["step-2", "step-2.1", "step-3"]);
    }

    #[test]
    fn find_verifies_what_it_returns_and_names_what_is_wrong() {
        let root = tempfile::tempdir().unwrap();
        let (exp, _) = experiment(root.path(), &[1, 2], 2);
        fs::write(exp.dir.join("config.toml"), "").unwrap();
        corrupt(&exp.dir.join("checkpoints/step-2"));
        assert_eq!(find(&exp.dir, None).unwrap().step, 1);
        let err = format!("{:#}", find(&exp.dir, Some(2)).unwrap_err());
        assert!(
            err.contains("checkpoint step-2 is not usable")
                && err.contains("step-2/model.safetensors: checksum mismatch"),
            "{err}"
        );
        let err = format!("{:#}", find(&exp.dir, Some(7)).unwrap_err());
        assert!(err.ends_with("no checkpoint step-7 (have: 2, 1)"), "{err}");
        corrupt(&exp.dir.join("checkpoints/step-1"));
        let err = format!("{:#}", find(&exp.dir, None).unwrap_err());
        assert!(err.ends_with("no checkpoint verifies (2 corrupt)"), "{err}");
    }
}
