//! The experiment directory: resolved config, manifest, metrics (JSON lines), checkpoints
//! (safetensors), summary. One run, one folder.

use anyhow::{Context, Result};
use plugin_api::{tch::Tensor, NamedTensor};
use serde::Serialize;
use std::{
    fs::{self, File},
    io::{BufWriter, Write},
    path::{Path, PathBuf},
};

pub struct Experiment {
    pub dir: PathBuf,
    /// None for a data-parallel rank other than 0: it trains but writes nothing.
    metrics: Option<BufWriter<File>>,
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

impl Experiment {
    /// A new experiment folder with its config, manifest and an empty metrics file. Built under a
    /// temporary name and renamed, so a folder that exists always has its config and manifest
    /// (a run killed while starting leaves only a `.tmp` folder behind).
    pub fn create(dir: &Path, config_toml: &str, manifest: &impl Serialize) -> Result<Self> {
        if dir.exists() && fs::read_dir(dir)?.next().is_some() {
            anyhow::bail!("experiment directory {} already exists and is not empty (resume it with `train --resume {}`)", dir.display(), dir.display());
        }
        let name = dir.file_name().with_context(|| format!("{}: not a folder name", dir.display()))?;
        let tmp = dir.with_file_name(format!(".{}.tmp", name.to_string_lossy()));
        let _ = fs::remove_dir_all(&tmp);
        fs::create_dir_all(tmp.join("checkpoints")).with_context(|| format!("creating {}", tmp.display()))?;
        write_synced(&tmp.join("config.toml"), config_toml.as_bytes())?;
        write_json(&tmp.join("manifest.json"), manifest)?;
        write_synced(&tmp.join("metrics.jsonl"), b"")?;
        if dir.exists() {
            fs::remove_dir(dir)?; // empty, checked above
        }
        fs::rename(&tmp, dir).with_context(|| format!("renaming {} to {}", tmp.display(), dir.display()))?;
        sync_dir(dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")))?;
        Self::open(dir)
    }

    /// An existing experiment, to resume: metrics lines after `keep_through_step` (written after
    /// the checkpoint being resumed, or cut short by a crash) are dropped, so the resumed run's
    /// lines continue the file as if it had never stopped.
    pub fn reopen(dir: &Path, keep_through_step: u64) -> Result<Self> {
        let path = dir.join("metrics.jsonl");
        let text = fs::read_to_string(&path).unwrap_or_default();
        let kept: String = text
            .lines()
            .filter(|l| {
                serde_json::from_str::<serde_json::Value>(l)
                    .ok()
                    .and_then(|v| v["step"].as_u64())
                    .is_some_and(|s| s <= keep_through_step)
            })
            .map(|l| format!("{l}\n"))
            .collect();
        write_synced(&path, kept.as_bytes())?;
        Self::open(dir)
    }

    fn open(dir: &Path) -> Result<Self> {
        let metrics = fs::OpenOptions::new()
            .append(true)
            .open(dir.join("metrics.jsonl"))
            .with_context(|| format!("opening {}/metrics.jsonl", dir.display()))?;
        Ok(Self { dir: dir.to_path_buf(), metrics: Some(BufWriter::new(metrics)) })
    }

    /// Rank 1.. of a data-parallel run: rank 0 owns the folder.
    pub fn detached(dir: &Path) -> Self {
        Self { dir: dir.to_path_buf(), metrics: None }
    }

    /// Append one metrics record and flush it (a crash loses at most the line being written).
    pub fn log(&mut self, record: &impl Serialize) -> Result<()> {
        let Some(metrics) = self.metrics.as_mut() else { return Ok(()) };
        serde_json::to_writer(&mut *metrics, record)?;
        metrics.write_all(b"\n")?;
        metrics.flush()?;
        Ok(())
    }

    /// `checkpoints/step-N/`: drafter weights + config, optimizer state, trainer state, and
    /// `checksums.json` (CRC-32C of each file, written last). Written to a temporary folder,
    /// fsynced and renamed, so a checkpoint folder is whole or absent even across a power cut.
    pub fn save_checkpoint(
        &self,
        step: u64,
        weights: &[NamedTensor],
        drafter_config_json: &str,
        optimizer_state: &[NamedTensor],
        trainer_state: &impl Serialize,
        keep: usize,
    ) -> Result<PathBuf> {
        let root = self.dir.join("checkpoints");
        let final_dir = root.join(format!("step-{step}"));
        let tmp = root.join(format!(".step-{step}.tmp"));
        let _ = fs::remove_dir_all(&tmp);
        fs::create_dir_all(&tmp)?;
        write_safetensors(&tmp.join("model.safetensors"), weights)?;
        write_synced(&tmp.join("config.json"), drafter_config_json.as_bytes())?;
        write_safetensors(&tmp.join("optimizer.safetensors"), optimizer_state)?;
        write_json(&tmp.join("trainer_state.json"), trainer_state)?;
        let mut sums = serde_json::Map::new();
        for file in CHECKPOINT_FILES {
            sums.insert(file.into(), format!("{:08x}", file_crc(&tmp.join(file))?).into());
        }
        write_json(&tmp.join(CHECKSUMS), &sums)?;
        sync_dir(&tmp)?;
        let _ = fs::remove_dir_all(&final_dir);
        fs::rename(&tmp, &final_dir)?;
        sync_dir(&root)?;
        prune(&root, keep)?;
        Ok(final_dir)
    }

    pub fn write_summary(&self, summary: &impl Serialize) -> Result<()> {
        write_json(&self.dir.join("summary.json"), summary)
    }
}

/// The files of a checkpoint, each with a checksum in `checksums.json`.
pub const CHECKPOINT_FILES: [&str; 4] = ["model.safetensors", "config.json", "optimizer.safetensors", "trainer_state.json"];
const CHECKSUMS: &str = "checksums.json";

fn write_json(path: &Path, value: &impl Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(value)? + "\n";
    write_synced(path, text.as_bytes())
}

/// Write and fsync, so the bytes are on disk before a rename publishes them.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).with_context(|| format!("writing {}", path.display()))?;
    f.write_all(bytes).with_context(|| format!("writing {}", path.display()))?;
    f.sync_all().with_context(|| format!("syncing {}", path.display()))
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).with_context(|| format!("syncing {}", dir.display()))
}

fn file_crc(path: &Path) -> Result<u32> {
    let bytes = fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(crc32c::crc32c(&bytes))
}

fn write_safetensors(path: &Path, tensors: &[NamedTensor]) -> Result<()> {
    let owned: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|nt| (nt.name.to_string(), nt.tensor.tensor().detach().to_device(plugin_api::tch::Device::Cpu).contiguous()))
        .collect();
    Tensor::write_safetensors(&owned, path).with_context(|| format!("writing {}", path.display()))?;
    File::open(path).and_then(|f| f.sync_all()).with_context(|| format!("syncing {}", path.display()))
}

/// Check a checkpoint folder against its `checksums.json`: every file present, none changed.
pub fn verify_checkpoint(dir: &Path) -> Result<()> {
    let sums_path = dir.join(CHECKSUMS);
    let text = fs::read_to_string(&sums_path).with_context(|| format!("{}: missing", sums_path.display()))?;
    let sums: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", sums_path.display()))?;
    for file in CHECKPOINT_FILES {
        let want = sums.get(file).and_then(|v| v.as_str()).with_context(|| format!("{}: no checksum for {file}", sums_path.display()))?;
        let got = format!("{:08x}", file_crc(&dir.join(file))?);
        if got != want {
            anyhow::bail!("{}: checksum mismatch (CRC-32C {got}, recorded {want}): the file is truncated or corrupt", dir.join(file).display());
        }
    }
    Ok(())
}

/// Checkpoint folders `step-N` under `exp_dir/checkpoints`, newest first.
pub fn checkpoints_newest_first(exp_dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut steps: Vec<(u64, PathBuf)> = fs::read_dir(exp_dir.join("checkpoints"))
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter_map(|e| Some((e.file_name().to_str()?.strip_prefix("step-")?.parse().ok()?, e.path())))
        .collect();
    steps.sort_by(|a, b| b.0.cmp(&a.0));
    steps
}

/// The newest checkpoint that verifies; corrupt ones are reported and passed over.
pub fn newest_good_checkpoint(exp_dir: &Path) -> Option<(u64, PathBuf)> {
    for (step, dir) in checkpoints_newest_first(exp_dir) {
        match verify_checkpoint(&dir) {
            Ok(()) => return Some((step, dir)),
            Err(e) => tracing::warn!("skipping checkpoint step-{step}: {e:#}"),
        }
    }
    None
}

/// Keep the newest `keep` checkpoints (the one just written is the newest, and whole); drop
/// leftovers of writes a crash interrupted.
fn prune(root: &Path, keep: usize) -> Result<()> {
    for (_, path) in checkpoints_newest_first(root.parent().unwrap_or(root)).iter().skip(keep) {
        fs::remove_dir_all(path)?;
    }
    for e in fs::read_dir(root)?.filter_map(|e| e.ok()) {
        if e.file_name().to_str().is_some_and(|n| n.starts_with('.') && n.ends_with(".tmp")) {
            let _ = fs::remove_dir_all(e.path());
        }
    }
    Ok(())
}

/// Read a checkpoint's safetensors file back as named tensors.
pub fn read_safetensors(path: &Path) -> Result<Vec<NamedTensor>> {
    let tensors = Tensor::read_safetensors(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(tensors.into_iter().map(|(n, t)| NamedTensor::new(n, t)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

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
            NamedTensor::new("fc.weight", Tensor::ones([64, 32], (plugin_api::tch::Kind::Float, plugin_api::tch::Device::Cpu))),
            NamedTensor::new("fc.bias", Tensor::zeros([64], (plugin_api::tch::Kind::Float, plugin_api::tch::Device::Cpu))),
        ];
        let ckpt = exp.save_checkpoint(1, &w, "{}", &[], &serde_json::json!({"step": 1}), 1).unwrap();
        let model = ckpt.join("model.safetensors");
        let bytes = fs::read(&model).unwrap();
        // Cut in the data, in the JSON header, and inside the 8-byte header length.
        for cut in [bytes.len() / 2, 20, 5] {
            fs::write(&model, &bytes[..cut]).unwrap();
            let err = format!("{:#}", read_safetensors(&model).err().expect("a truncated file read"));
            assert!(err.contains(&model.display().to_string()), "cut at {cut}: {err}");
            let err = format!("{:#}", crate::export::export(&ckpt, &root.path().join("out")).unwrap_err());
            assert!(err.contains(&model.display().to_string()), "export, cut at {cut}: {err}");
            let err = format!("{:#}", verify_checkpoint(&ckpt).unwrap_err());
            assert!(err.contains("model.safetensors") && err.contains("checksum mismatch"), "{err}");
        }
    }
}
