//! A run's components assembled from its config: everything checkable without the target is
//! checked first (preflight), then the plugins are built on the devices the config names.

use crate::{
    config::RunConfig,
    environment::{cache_dir, enable_cuda},
    experiment::{self, checkpoint, manifest, Manifest},
    memory_estimate::{self, Work},
    pipeline::components::{build_components, Components},
    plugins::{handles::TargetHandle, PluginRecord, Registry},
};
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// Load CUDA when the config asks for it, or say why it cannot run.
pub fn ensure_device(cfg: &RunConfig) -> Result<()> {
    let devices = cfg.target_devices();
    let cuda = devices.iter().map(String::as_str).chain([cfg.drafter_device()]).find(|d| d.starts_with("cuda"));
    if let Some(d) = cuda {
        if !enable_cuda() {
            anyhow::bail!("device `{d}` asked for, but libtorch's CUDA libraries could not be loaded");
        }
    }
    let on_cpu = devices.iter().map(String::as_str).chain([cfg.drafter_device()]).any(|d| d == "cpu");
    if on_cpu && cfg.dtype() == "bf16" && !cpu_has_bf16_units() {
        tracing::warn!(
            "dtype = \"bf16\" on a CPU without bf16 matrix instructions (AVX512-BF16, AMX): libtorch emulates them, \
             slower than f32 here; set dtype = \"f32\" (or --set dtype='\"f32\"')"
        );
    }
    Ok(())
}

/// Whether this CPU multiplies bf16 matrices natively (x86: AVX512-BF16, which every CPU with
/// AMX also has); elsewhere assumed.
fn cpu_has_bf16_units() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::is_x86_feature_detected!("avx512bf16");
    #[cfg(not(target_arch = "x86_64"))]
    true
}

/// The run's components; plugin config errors point at the config line (or `--set` argument)
/// that set the field. Everything that can be checked without the target is, first.
pub fn build(cfg: &RunConfig, config_path: &Path, config_dir: &Path, registry: &Registry) -> Result<Components> {
    build_for(Work::Train, cfg, config_path, config_dir, registry)
}

/// As [`build`], the device memory estimated for `work` (`capture` runs only the target).
pub fn build_for(
    work: Work,
    cfg: &RunConfig,
    config_path: &Path,
    config_dir: &Path,
    registry: &Registry,
) -> Result<Components> {
    checked(work, cfg, config_path, config_dir, registry, build_components)
}

/// The target alone, checked as [`build`] checks the whole run, for a rank that only serves its
/// replica's lead; with the records of every plugin the config names.
pub fn build_target(
    cfg: &RunConfig,
    config_path: &Path,
    config_dir: &Path,
    registry: &Registry,
) -> Result<(TargetHandle, Vec<PluginRecord>)> {
    checked(Work::Target, cfg, config_path, config_dir, registry, crate::pipeline::components::build_target)
}

/// Preflight, the device, its memory, the seed, then `make`'s plugins, its errors located in the
/// config.
fn checked<T>(
    work: Work,
    cfg: &RunConfig,
    config_path: &Path,
    config_dir: &Path,
    registry: &Registry,
    make: impl FnOnce(&RunConfig, &Registry, &Path, &Path) -> Result<T>,
) -> Result<T> {
    let ctx = manifest::plugin_context(cfg, config_dir, &cache_dir());
    crate::config::preflight::check(cfg, config_path, &ctx, registry)?;
    ensure_device(cfg)?;
    memory_estimate::check_run(cfg, registry, &ctx, work)?;
    tch::manual_seed(cfg.seed as i64);
    make(cfg, registry, config_dir, &cache_dir())
        .map_err(|e| crate::config::preflight::locate(cfg, config_path, format!("{e:#}")))
}

/// Where an evaluated drafter's weights come from: a checkpoint already opened (found once, so
/// a training run pruning it meanwhile cannot take it away), or a z-lab folder.
pub enum DrafterFrom<'a> {
    Checkpoint(checkpoint::Opened),
    Folder(&'a Path),
}

/// Rebuild a finished experiment's plugins (eval): its resolved config, in `dtype` where given
/// instead of the run's, with the drafter from a checkpoint (its weights checked against what the
/// drafter declares) or from a z-lab folder.
pub fn load_experiment(
    exp_dir: &Path,
    registry: &Registry,
    drafter: DrafterFrom,
    dtype: Option<&str>,
) -> Result<(RunConfig, Components)> {
    let folder = match &drafter {
        DrafterFrom::Folder(d) => Some(*d),
        DrafterFrom::Checkpoint(_) => None,
    };
    let (mut cfg, config_dir) = experiment_config(exp_dir, folder, None)?;
    // The replies the run trained on (a draft vocabulary is counted over them) are those of the
    // dtype it trained in, whatever the dtype it is decoded in.
    let trained_numerics = crate::pipeline::components::numerics(&cfg);
    if let Some(d) = dtype {
        cfg.dtype = Some(d.into());
    }
    ensure_device(&cfg)?;
    let ctx = manifest::plugin_context(&cfg, &config_dir, &cache_dir());
    memory_estimate::check_run(&cfg, registry, &ctx, Work::Eval)?;
    let mut c = build_components(&cfg, registry, &config_dir, &cache_dir())?;
    c.numerics = trained_numerics;
    if let DrafterFrom::Checkpoint(ckpt) = drafter {
        ckpt.check_weights_for(&c.drafter.parameters()?)?;
        c.drafter.load_weights(ckpt.weights.into())?;
        tracing::info!("drafter weights from {}", ckpt.dir.display());
    }
    Ok((cfg, c))
}

/// A finished experiment's resolved config as eval runs it (the drafter from a z-lab `folder`
/// when given; in `dtype` when given; this rank's devices under a launcher), and the folder its
/// paths resolve from.
pub fn experiment_config(exp_dir: &Path, folder: Option<&Path>, dtype: Option<&str>) -> Result<(RunConfig, PathBuf)> {
    let mut cfg = RunConfig::load(&exp_dir.join(experiment::CONFIG))?;
    if let Some(d) = dtype {
        cfg.dtype = Some(d.into());
    }
    let manifest = Manifest::read(exp_dir)?;
    if let Some(d) = folder {
        let abs = d.canonicalize().with_context(|| format!("{}", d.display()))?;
        let mut t = toml::Table::new();
        t.insert("plugin".into(), "dflash".into());
        t.insert("init_from".into(), abs.display().to_string().into());
        cfg.drafter = t;
    }
    Ok((super::ranks::place_rank(&cfg)?, PathBuf::from(&manifest.config_dir)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config;

    /// `run.toml` in `dir` with a random tiny target (`tiny.json`, no weights to download) unless
    /// `target` says otherwise, and `data` as the dataset.
    fn write_config(dir: &Path, target: &str, data: &str) -> PathBuf {
        let tiny = r#"{"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 2, "vocab_size": 32, "eos_token_id": 1}"#;
        std::fs::write(dir.join("tiny.json"), tiny).unwrap();
        let text = format!(
            "name = \"t\"\n[train]\nsteps = 1\n\n[target]\nplugin = \"hf\"\n{target}\n\n[drafter]\nplugin = \"dflash\"\n\
             num_hidden_layers = 1\nblock_size = 4\nnum_target_features = 1\nmask_token_id = 0\n\n\
             [optimizer]\nplugin = \"adamw\"\nlr = 1e-3\n\n[data]\nplugin = \"chat\"\nformat = \"jsonl\"\n{data}\n"
        );
        let path = dir.join("run.toml");
        std::fs::write(&path, text).unwrap();
        path
    }

    fn build_error(path: &Path) -> String {
        let cfg = RunConfig::load(path).unwrap();
        let registry = Registry::new(&[]).unwrap();
        let dir = config::config_dir(path);
        match build(&cfg, path, &dir, &registry) {
            Ok(_) => panic!("{} built", path.display()),
            Err(e) => format!("{e:#}"),
        }
    }

    #[test]
    fn a_missing_model_or_data_file_names_the_config_line_and_field() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = write_config(dir.path(), "path = \"nope.gguf\"", "path = \"chat.jsonl\"");
        let err = build_error(&cfg);
        let want = format!(
            "run.toml:7: [target] plugin `hf`: field `path`: {}: no such file",
            dir.path().join("nope.gguf").display()
        );
        assert!(err.contains(&want), "{err}\nshould contain\n{want}");

        let cfg = write_config(dir.path(), "path = \"tiny.json\"\nrandom_init = true", "path = \"nope.jsonl\"");
        let err = build_error(&cfg);
        // Found before the target loads (preflight), not by the data plugin after it.
        let want = format!(
            "run.toml:24: [data] plugin `chat`: field `path`: {}: no such file or folder",
            dir.path().join("nope.jsonl").display()
        );
        assert!(err.contains(&want), "{err}\nshould contain\n{want}");
    }

    #[test]
    fn a_device_or_fifo_where_a_file_belongs_is_refused_before_a_plugin_opens_it() {
        let dir = tempfile::tempdir().unwrap();
        // Was "no such file" from the target plugin.
        let cfg = write_config(dir.path(), "path = \"/dev/zero\"", "path = \"chat.jsonl\"");
        let err = build_error(&cfg);
        assert!(
            err.ends_with(
                "run.toml:7: [target] plugin `hf`: field `path`: /dev/zero: not a regular file (a character device)"
            ),
            "{err}"
        );
        // Blocked forever in the data plugin's read.
        let fifo = dir.path().join("chat.fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let cfg = write_config(dir.path(), "path = \"tiny.json\"\nrandom_init = true", "path = \"chat.fifo\"");
        let err = build_error(&cfg);
        let want =
            format!("run.toml:24: [data] plugin `chat`: field `path`: {}: not a regular file (a FIFO)", fifo.display());
        assert!(err.ends_with(&want), "{err}\nshould end with\n{want}");
    }
}
