//! Checkpoints: `checkpoints/step-N/` holds the drafter weights + config, the optimizer state,
//! the trainer state and `checksums.json` (CRC-32C of each, written last). Written whole or not
//! at all; found only through [`find`] / [`newest_usable`], which open every file once, check it
//! against its checksum and read it from that handle (a training run pruning the folder meanwhile
//! cannot take it away), with every tensor checked ([`tensors`](super::tensors): names once, known
//! dtypes, sizes that fit, finite values) and the weights floating-point; before use the weights
//! are checked against what the drafter declares ([`check_declared`]). Pruned without ever
//! touching the one just written; corrupt ones or ones past a resume point are moved aside to
//! `checkpoints/corrupt/`, never used and never silently deleted.

mod checksums;
mod declared;

pub use declared::{check_declared, declared_by};

use checksums::{checksum_mismatch, crc_of, file_crc, recorded};

use super::{
    files::{read_json, write_json, MAX_JSON_BYTES},
    tensors,
};
use crate::atomic_write::{sync_dir, write_synced};
use anyhow::{bail, Context, Result};
use plugin_api::{tch::Tensor, NamedTensor};
use serde::Serialize;
use std::{
    fs::{self, File},
    io::{Read, Seek, SeekFrom},
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

/// Let a write past the file-size limit (`ulimit -f`) fail with EFBIG, like one on a full disk,
/// instead of the kernel killing the process with SIGXFSZ (no message, a partial folder left):
/// the write path then removes its temporary folder and names the file. Process-wide and
/// idempotent; `main` calls it first thing, [`write`] again for library callers.
pub fn ignore_sigxfsz() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    // SAFETY: setting a signal's disposition to SIG_IGN installs no handler code.
    ONCE.call_once(|| unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    });
}

/// Write `checkpoints/step-N/` through a temporary folder (fsynced, then renamed), then prune to
/// `keep`. A failed write (a full disk, the file-size limit) removes its temporary folder and
/// names the file.
pub fn write<S: Serialize>(exp_dir: &Path, step: u64, data: &CheckpointData<S>, keep: usize) -> Result<PathBuf> {
    ignore_sigxfsz();
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

/// Check a checkpoint folder against its `checksums.json`: every file present, none changed.
pub fn verify(dir: &Path) -> Result<()> {
    let sums_path = dir.join(CHECKSUMS);
    let sums: serde_json::Map<String, serde_json::Value> = read_json(&sums_path)?;
    for file in CHECKPOINT_FILES {
        let want = recorded(&sums, &sums_path, file)?;
        let got = file_crc(&dir.join(file))?;
        if format!("{got:08x}") != want {
            return Err(checksum_mismatch(&dir.join(file), got, want));
        }
    }
    Ok(())
}

/// A checkpoint read for use: every file was opened once, matched its checksum and was read from
/// that handle; the weights (and, when asked, the optimizer state) passed the strict read of
/// [`tensors::read`] and are floating-point. Check them against the drafter with
/// [`check_declared`] before loading them.
pub struct Opened {
    pub step: u64,
    pub dir: PathBuf,
    /// `model.safetensors`' tensors, and the file's SHA-256.
    pub weights: Vec<NamedTensor>,
    pub weights_sha256: String,
    /// The drafter's `config.json` as written (a JSON object).
    pub config_json: String,
    pub trainer_state: serde_json::Value,
    /// `optimizer.safetensors`' tensors, when opened for a resume.
    pub optimizer_state: Option<Vec<NamedTensor>>,
}

impl std::fmt::Debug for Opened {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opened")
            .field("step", &self.step)
            .field("dir", &self.dir)
            .field("weights", &self.weights.len())
            .finish()
    }
}

impl Opened {
    pub fn weights_file(&self) -> PathBuf {
        self.dir.join("model.safetensors")
    }

    /// The weights checked against what a drafter with these `parameters` declares
    /// ([`check_declared`]).
    pub fn check_weights_for(&self, parameters: &[NamedTensor]) -> Result<()> {
        check_declared(&self.weights_file(), &self.weights, &declared_by(parameters))
    }
}

/// Why a checkpoint was not opened.
enum OpenError {
    /// Its folder went away while it was being opened: pruned or set aside by a training run.
    Gone,
    Bad(anyhow::Error),
}

/// Whether `dir` is gone (or going: a prune removes its files first, then the folder).
fn gone(dir: &Path) -> bool {
    if !dir.is_dir() {
        return true;
    }
    std::thread::sleep(std::time::Duration::from_millis(100));
    !dir.is_dir()
}

/// The whole of an open JSON file, capped, from its start.
fn read_open_json<T: serde::de::DeserializeOwned>(f: &mut File, path: &Path) -> Result<(String, T)> {
    f.seek(SeekFrom::Start(0)).with_context(|| format!("reading {}", path.display()))?;
    let mut text = String::new();
    f.take(MAX_JSON_BYTES + 1).read_to_string(&mut text).with_context(|| format!("reading {}", path.display()))?;
    if text.len() as u64 > MAX_JSON_BYTES {
        bail!("{}: more than the {MAX_JSON_BYTES} bytes allowed", path.display());
    }
    let value = serde_json::from_str(&text).with_context(|| format!("{}: not valid", path.display()))?;
    Ok((text, value))
}

/// Open checkpoint `c` for use (see [`Opened`]). Every file is opened before any is read, so a
/// prune after that point changes nothing; a file missing before then because the folder is
/// gone is [`OpenError::Gone`], anything else wrong [`OpenError::Bad`].
fn open(c: &Checkpoint, with_optimizer: bool) -> Result<Opened, OpenError> {
    let names = [CHECKSUMS, "model.safetensors", "config.json", "optimizer.safetensors", "trainer_state.json"];
    let mut files = Vec::with_capacity(names.len());
    for name in names {
        match input_files::open_regular(&c.dir.join(name)) {
            Ok(f) => files.push(f),
            Err(input_files::InputError::NotFound { .. }) if gone(&c.dir) => return Err(OpenError::Gone),
            Err(e) => return Err(OpenError::Bad(e.into())),
        }
    }
    let [mut sums_f, mut model, mut config, mut optimizer, mut state]: [File; 5] =
        files.try_into().expect("one handle a name");
    let mut read = || -> Result<Opened> {
        let path = |name: &str| c.dir.join(name);
        let (_, sums): (_, serde_json::Map<String, serde_json::Value>) = read_open_json(&mut sums_f, &path(CHECKSUMS))?;
        let mut sha = None;
        for (file, f) in [
            ("model.safetensors", &mut model),
            ("config.json", &mut config),
            ("optimizer.safetensors", &mut optimizer),
            ("trainer_state.json", &mut state),
        ] {
            let want = recorded(&sums, &path(CHECKSUMS), file)?;
            let (got, digest) = crc_of(f, &path(file), file == "model.safetensors")?;
            if format!("{got:08x}") != want {
                return Err(checksum_mismatch(&path(file), got, want));
            }
            sha = sha.or(digest);
        }
        let (config_json, cfg): (String, serde_json::Value) = read_open_json(&mut config, &path("config.json"))?;
        if !cfg.is_object() {
            bail!("{}: not a JSON object", path("config.json").display());
        }
        let (_, trainer_state) = read_open_json(&mut state, &path("trainer_state.json"))?;
        check_step(&c.dir, &trainer_state, &path("trainer_state.json"))?;
        let weights = tensors::read(&mut model, &path("model.safetensors"))?;
        if let Some(w) = weights.iter().find(|w| !tensors::is_float(w.tensor.tensor().kind())) {
            bail!(
                "{}: tensor `{}` is {}; a drafter's weights are floating-point (F32, BF16, F16)",
                path("model.safetensors").display(),
                w.name,
                tensors::dtype_name(w.tensor.tensor().kind())
            );
        }
        let optimizer_state =
            with_optimizer.then(|| tensors::read(&mut optimizer, &path("optimizer.safetensors"))).transpose()?;
        Ok(Opened {
            step: c.step,
            dir: c.dir.clone(),
            weights,
            weights_sha256: sha.expect("the weights' digest"),
            config_json,
            trainer_state,
            optimizer_state,
        })
    };
    read().map_err(OpenError::Bad)
}

/// The step `trainer_state.json` (at `file`, read as `state`) claims, checked: a whole number, the
/// one its folder `step-N` is named after, and not beyond the run's `train.steps` (which a fork
/// and an extended resume raise before they train past it). A resume counts on it and every
/// reader reports it, so a claim of step 2^64-1 in the checkpoint of step 2 is refused here.
fn check_step(dir: &Path, state: &serde_json::Value, file: &Path) -> Result<()> {
    let Some(claimed) = state.get("step") else { return Ok(()) };
    let Some(step) = claimed.as_u64() else {
        bail!("{}: `step` is {claimed}, not a step number", file.display());
    };
    let named = dir.file_name().and_then(|n| n.to_str()?.strip_prefix("step-")?.parse::<u64>().ok());
    if let Some(n) = named.filter(|&n| n != step) {
        bail!("{}: step {step}, but the checkpoint is step-{n}", file.display());
    }
    if let Some(last) = named.and_then(|_| configured_steps(dir)).filter(|&last| step > last) {
        bail!("{}: step {step} is beyond the run's train.steps ({last})", file.display());
    }
    Ok(())
}

/// `train.steps` of the experiment that holds the checkpoint folder `dir`
/// (`EXP/checkpoints/step-N`), from `EXP/config.toml`; None where there is no such config or it
/// does not say.
fn configured_steps(dir: &Path) -> Option<u64> {
    let exp = dir.parent()?.parent()?;
    let f = input_files::open_regular(&exp.join(super::files::CONFIG)).ok()?;
    let mut text = String::new();
    f.take(MAX_JSON_BYTES).read_to_string(&mut text).ok()?;
    let table: toml::Table = toml::from_str(&text).ok()?;
    u64::try_from(table.get("train")?.get("steps")?.as_integer()?).ok()
}

/// The checkpoint folder `dir` opened for use (a folder named `step-N`, or any other: step 0).
pub fn open_dir(dir: &Path) -> Result<Opened> {
    let step = dir.file_name().and_then(|n| n.to_str()?.strip_prefix("step-")?.parse().ok()).unwrap_or(0);
    match open(&Checkpoint { step, dir: dir.to_path_buf() }, false) {
        Ok(o) => Ok(o),
        Err(OpenError::Gone) => bail!("{}: no such checkpoint folder", dir.display()),
        Err(OpenError::Bad(e)) => Err(e),
    }
}

/// Checkpoint folders `step-N` directly under `exp_dir/checkpoints`, newest first (unverified:
/// use [`find`] or [`newest_usable`] to pick one).
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
    all.sort_by_key(|c| std::cmp::Reverse(c.step));
    all
}

/// The newest checkpoint that verifies (checksums only: for naming results, not for reading
/// weights); the corrupt ones passed over on the way are reported and returned.
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

/// How often the checkpoints are listed again when the one chosen goes away while it is opened.
const MAX_RELISTS: usize = 16;

/// The newest checkpoint that opens (see [`Opened`]; with the optimizer state when
/// `with_optimizer`); the corrupt ones passed over on the way are reported and returned (all
/// newer than the one found). One removed while it is being opened (a training run pruning its
/// old checkpoints) is not corrupt: the folder is listed again and its newest taken, saying so.
pub fn newest_usable(exp_dir: &Path, with_optimizer: bool) -> (Option<Opened>, Vec<Checkpoint>) {
    let mut corrupt: Vec<Checkpoint> = Vec::new();
    for _ in 0..MAX_RELISTS {
        let mut relist = false;
        let fresh: Vec<Checkpoint> = list(exp_dir).into_iter().filter(|c| !corrupt.contains(c)).collect();
        for c in fresh {
            match open(&c, with_optimizer) {
                Ok(o) => return (Some(o), corrupt),
                Err(OpenError::Gone) => {
                    tracing::info!(
                        "checkpoint step-{} was removed while it was opened (a training run prunes its old checkpoints); \
                         taking the newest again",
                        c.step
                    );
                    relist = true;
                    break;
                }
                Err(OpenError::Bad(e)) => {
                    tracing::warn!("skipping checkpoint step-{}: {e:#}", c.step);
                    corrupt.push(c);
                }
            }
        }
        if !relist {
            break;
        }
    }
    (None, corrupt)
}

/// The checkpoint every reader uses (resume, eval, export): step `step`, which must open (see
/// [`Opened`]), or else the newest that opens.
pub fn find(exp_dir: &Path, step: Option<u64>) -> Result<Opened> {
    if !exp_dir.join("config.toml").is_file() {
        bail!("{}: not an experiment directory (no config.toml)", exp_dir.display());
    }
    match step {
        Some(n) => open_step(exp_dir, n, false),
        None => match newest_usable(exp_dir, false) {
            (Some(o), _) => Ok(o),
            (None, corrupt) if corrupt.is_empty() && list(exp_dir).is_empty() => {
                bail!("{}: no checkpoints yet", exp_dir.display())
            }
            (None, corrupt) => bail!("{}: no checkpoint verifies ({} corrupt)", exp_dir.display(), corrupt.len()),
        },
    }
}

/// Checkpoint `step-N` of an experiment opened for use (with the optimizer state when asked).
pub fn open_step(exp_dir: &Path, n: u64, with_optimizer: bool) -> Result<Opened> {
    let have = || {
        let have: Vec<String> = list(exp_dir).iter().map(|c| c.step.to_string()).collect();
        if have.is_empty() {
            "none".into()
        } else {
            have.join(", ")
        }
    };
    let c = Checkpoint { step: n, dir: root(exp_dir).join(format!("step-{n}")) };
    if !c.dir.is_dir() {
        bail!("{}: no checkpoint step-{n} (have: {})", exp_dir.display(), have());
    }
    match open(&c, with_optimizer) {
        Ok(o) => Ok(o),
        Err(OpenError::Gone) => bail!(
            "{}: checkpoint step-{n} was removed while it was opened (a training run prunes its old \
             checkpoints; have: {})",
            exp_dir.display(),
            have()
        ),
        Err(OpenError::Bad(e)) => Err(e.context(format!("checkpoint step-{n} is not usable"))),
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

/// A safetensors file read strictly ([`tensors::read`]).
pub fn read_safetensors(path: &Path) -> Result<Vec<NamedTensor>> {
    tensors::read(&mut input_files::open_regular(path)?, path)
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
