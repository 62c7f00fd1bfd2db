//! The four components of a run, built from the config's sections (for `train`, `capture`,
//! `eval` and `bench` alike), each behind a handle whose errors name the plugin and the call.

use crate::{
    config::RunConfig,
    plugins::{DataHandle, DrafterHandle, OptimizerHandle, PluginRecord, Registry, TargetHandle},
};
use anyhow::{anyhow, Result};
use plugin_api::{
    abi_stable::std_types::{RNone, RSome},
    HostContext, PluginInstance, PluginKind,
};
use std::path::Path;

/// The four components of a run, created from the config's sections.
pub struct Components {
    pub target: TargetHandle,
    /// More target workers (`pipeline.targets` beyond the first), each on its own device.
    pub extra_targets: Vec<TargetHandle>,
    pub drafter: DrafterHandle,
    pub optimizer: OptimizerHandle,
    pub data: DataHandle,
    pub records: Vec<PluginRecord>,
    /// The dtype they run in (`f32`, `bf16`, ..): the target's replies depend on it.
    pub dtype: String,
}

pub fn build_components(
    cfg: &RunConfig,
    registry: &Registry,
    config_dir: &Path,
    cache_dir: &Path,
) -> Result<Components> {
    let ctx_on = |device: &str| crate::plugins::host_context(device, cfg.dtype(), cfg.seed, config_dir, cache_dir);
    let mut records = Vec::new();
    let mut create = |kind: PluginKind, ctx: &HostContext| -> Result<PluginInstance> {
        let section = cfg.section(kind.as_str());
        tracing::info!("creating {kind} plugin `{}` on {}", section.plugin, ctx.device);
        let (instance, record) = registry.create(kind, &section, ctx)?;
        if !records.iter().any(|r: &PluginRecord| r.kind == record.kind) {
            records.push(record);
        }
        Ok(instance)
    };
    let wrong = |kind: PluginKind| anyhow!("plugin for [{kind}] did not create a {kind}");
    let devices = cfg.target_devices();
    // A replica spread over several ranks: this rank's place in it, for the target.
    let env = crate::dist::DistEnv::from_env()?;
    let replica = match crate::dist::replica::Layout::of(&cfg.target, env.as_ref())? {
        Some(layout) if devices.len() > 1 => anyhow::bail!(
            "[pipeline] targets: one target device a rank when the target is spread over {} ranks (`tensor_parallel`)",
            layout.size
        ),
        Some(layout) => RSome(layout.group(env.as_ref().expect("a layout comes with a launcher"))),
        None => RNone,
    };
    let mut targets = Vec::new();
    for d in &devices {
        let ctx = HostContext { replica: replica.clone(), ..ctx_on(d) };
        let PluginInstance::Target(t) = create(PluginKind::Target, &ctx)? else {
            return Err(wrong(PluginKind::Target));
        };
        targets.push(TargetHandle::new(t, &cfg.section("target").plugin));
    }
    let target = targets.remove(0);
    let mut ctx = ctx_on(cfg.drafter_device());
    ctx.target = RSome(target.spec()?);
    let PluginInstance::Drafter(drafter) = create(PluginKind::Drafter, &ctx)? else {
        return Err(wrong(PluginKind::Drafter));
    };
    let PluginInstance::Optimizer(optimizer) = create(PluginKind::Optimizer, &ctx)? else {
        return Err(wrong(PluginKind::Optimizer));
    };
    let PluginInstance::DataLoader(data) = create(PluginKind::DataLoader, &ctx)? else {
        return Err(wrong(PluginKind::DataLoader));
    };
    let name = |kind: &str| cfg.section(kind).plugin;
    Ok(Components {
        target,
        extra_targets: targets,
        drafter: DrafterHandle::new(drafter, &name("drafter")),
        optimizer: OptimizerHandle::new(optimizer, &name("optimizer")),
        data: DataHandle::new(data, &name("data")),
        records,
        dtype: cfg.dtype().to_string(),
    })
}
