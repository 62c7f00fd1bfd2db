//! A rank's place in a launched run: its devices (the config's, offset by its local rank) and
//! what the ranks compare at the rendezvous to know they run one config and one build. Used by
//! the pipeline's assembly and replicas, and by the trainer's start, which builds on them.

use crate::{config::RunConfig, dist, environment::enable_cuda, plugins::PluginRecord};
use anyhow::{Context, Result};
use std::path::Path;

/// What ranks compare at the rendezvous: the resolved config without its device placement (each
/// rank's own, see `place_rank`), and this binary plus the plugin libraries; the experiment folder
/// names the run when the launcher gives no run token.
pub(crate) fn identity(cfg: &RunConfig, records: &[PluginRecord], exp_dir: &Path) -> Result<dist::Identity> {
    let mut table = toml::Table::try_from(cfg)?;
    table.remove("device");
    if let Some(toml::Value::Table(p)) = table.get_mut("pipeline") {
        p.remove("targets");
        p.remove("drafter");
    }
    Ok(dist::Identity::new(toml::to_string(&table)?, build_id(records)?, exp_dir.display().to_string()))
}

/// This binary's SHA-256 and the plugin libraries' (as `records` name them), shortened: what
/// ranks must share to run one build.
pub(crate) fn build_id(records: &[PluginRecord]) -> Result<String> {
    use sha2::{Digest, Sha256};
    let exe = std::env::current_exe().context("this binary's path")?;
    let mut build = Sha256::new_with_prefix(std::fs::read(&exe).with_context(|| format!("reading {}", exe.display()))?);
    for r in records {
        build.update(format!("{} {} {} {:?}\n", r.kind, r.name, r.origin, r.sha256));
    }
    Ok(build.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect())
}

/// This rank's devices when a launcher put several ranks on one machine: the config's CUDA
/// devices offset by `LOCAL_RANK` x the GPUs one replica uses (`dist::rank_devices`).
pub(crate) fn place_rank(cfg: &RunConfig) -> Result<RunConfig> {
    let mut cfg = cfg.clone();
    let mut all = vec![cfg.device.clone()];
    all.extend(cfg.pipeline.targets.iter().cloned());
    all.extend(cfg.pipeline.drafter.iter().cloned());
    let Some((local_rank, moved)) = rank_devices(&all)? else { return Ok(cfg) };
    let n = cfg.pipeline.targets.len();
    cfg.device = moved[0].clone();
    cfg.pipeline.targets = moved[1..1 + n].to_vec();
    cfg.pipeline.drafter = moved.get(1 + n).cloned();
    tracing::info!("local rank {local_rank}: devices {:?}", &moved);
    Ok(cfg)
}

/// `devices` offset for this rank when a launcher put several ranks on one machine and some of
/// them are CUDA devices (`dist::rank_devices`), with the local rank; None: they stay as given.
pub(crate) fn rank_devices(devices: &[String]) -> Result<Option<(usize, Vec<String>)>> {
    let Some(env) = dist::DistEnv::from_env()? else { return Ok(None) };
    if env.local_rank == 0 || !devices.iter().any(|d| d.starts_with("cuda")) {
        return Ok(None);
    }
    let visible = if enable_cuda() { tch::Cuda::device_count() as usize } else { 0 };
    Ok(Some((env.local_rank, dist::rank_devices(devices, env.local_rank, visible)?)))
}
