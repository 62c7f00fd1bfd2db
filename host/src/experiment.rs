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
    metrics: BufWriter<File>,
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
    pub fn create(dir: &Path, config_toml: &str, manifest: &impl Serialize) -> Result<Self> {
        if dir.exists() && fs::read_dir(dir)?.next().is_some() {
            anyhow::bail!("experiment directory {} already exists and is not empty", dir.display());
        }
        fs::create_dir_all(dir.join("checkpoints")).with_context(|| format!("creating {}", dir.display()))?;
        fs::write(dir.join("config.toml"), config_toml)?;
        write_json(&dir.join("manifest.json"), manifest)?;
        let metrics = File::create(dir.join("metrics.jsonl"))?;
        Ok(Self { dir: dir.to_path_buf(), metrics: BufWriter::new(metrics) })
    }

    /// Append one metrics record and flush it (a crash loses at most the line being written).
    pub fn log(&mut self, record: &impl Serialize) -> Result<()> {
        serde_json::to_writer(&mut self.metrics, record)?;
        self.metrics.write_all(b"\n")?;
        self.metrics.flush()?;
        Ok(())
    }

    /// `checkpoints/step-N/`: drafter weights + config, optimizer state, trainer state. Written
    /// to a temporary folder and renamed, so a checkpoint folder is whole or absent.
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
        fs::write(tmp.join("config.json"), drafter_config_json)?;
        write_safetensors(&tmp.join("optimizer.safetensors"), optimizer_state)?;
        write_json(&tmp.join("trainer_state.json"), trainer_state)?;
        let _ = fs::remove_dir_all(&final_dir);
        fs::rename(&tmp, &final_dir)?;
        prune(&root, keep)?;
        Ok(final_dir)
    }

    pub fn write_summary(&self, summary: &impl Serialize) -> Result<()> {
        write_json(&self.dir.join("summary.json"), summary)
    }
}

fn write_json(path: &Path, value: &impl Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))
}

fn write_safetensors(path: &Path, tensors: &[NamedTensor]) -> Result<()> {
    let owned: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|nt| (nt.name.to_string(), nt.tensor.tensor().detach().to_device(plugin_api::tch::Device::Cpu).contiguous()))
        .collect();
    Tensor::write_safetensors(&owned, path).with_context(|| format!("writing {}", path.display()))
}

/// Keep the newest `keep` checkpoints.
fn prune(root: &Path, keep: usize) -> Result<()> {
    let mut steps: Vec<(u64, PathBuf)> = fs::read_dir(root)?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            Some((name.strip_prefix("step-")?.parse().ok()?, e.path()))
        })
        .collect();
    steps.sort();
    for (_, path) in steps.iter().rev().skip(keep) {
        fs::remove_dir_all(path)?;
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
}
