//! The four components of a run, built from the config's sections (for `train`, `capture`,
//! `eval` and `bench` alike), each behind a handle whose errors name the plugin and the call.

use crate::{
    config::{PluginSection, RunConfig},
    pipeline::mask_token,
    plugins::{
        handles::{DataHandle, DrafterHandle, OptimizerHandle, TargetHandle},
        PluginRecord, Registry,
    },
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
    /// What the target's replies depend on besides its weights ([`numerics`]).
    pub numerics: String,
    /// The drafter's mask token, where the host picked it (no `mask_token_id` in the config and
    /// no pad token in the target).
    pub mask_token: Option<crate::pipeline::mask_token::MaskToken>,
}

/// The dtype the target runs in (`f32`, `bf16`, ..) and, where its projections run otherwise
/// (`[target] compute = "fp8"`), that too: its replies depend on both, so self-distilled replies
/// are cached by them.
pub fn numerics(cfg: &RunConfig) -> String {
    match cfg.target.get("compute").and_then(|v| v.as_str()) {
        Some(compute) if compute != "bf16" => format!("{} compute={compute}", cfg.dtype()),
        _ => cfg.dtype().to_string(),
    }
}

/// The config's target plugin, one instance a target device (`pipeline.targets`), each told its
/// place in a replica spread over several ranks; the plugin's record.
fn create_targets(
    cfg: &RunConfig,
    registry: &Registry,
    config_dir: &Path,
    cache_dir: &Path,
) -> Result<(Vec<TargetHandle>, PluginRecord)> {
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
    let section = cfg.section(PluginKind::Target.as_str());
    let mut targets = Vec::new();
    let mut record = None;
    for d in &devices {
        let ctx = HostContext {
            replica: replica.clone(),
            ..crate::plugins::host_context(d, cfg.dtype(), cfg.seed, config_dir, cache_dir)
        };
        tracing::info!("creating {} plugin `{}` on {}", PluginKind::Target, section.plugin, ctx.device);
        let (instance, r) = registry.create(PluginKind::Target, &section, &ctx)?;
        let PluginInstance::Target(t) = instance else {
            return Err(anyhow!("plugin for [target] did not create a target"));
        };
        targets.push(TargetHandle::new(t, &section.plugin));
        record = Some(r);
    }
    Ok((targets, record.ok_or_else(|| anyhow!("[pipeline] targets: no target device"))?))
}

/// The target alone, for a rank that only serves its replica's lead (`tensor_parallel`), with
/// the records of every plugin the config names (the same the lead's components hold, so the
/// ranks agree on the build they run).
pub fn build_target(
    cfg: &RunConfig,
    registry: &Registry,
    config_dir: &Path,
    cache_dir: &Path,
) -> Result<(TargetHandle, Vec<PluginRecord>)> {
    let (mut targets, target_record) = create_targets(cfg, registry, config_dir, cache_dir)?;
    let mut records = vec![target_record];
    for kind in [PluginKind::Drafter, PluginKind::Optimizer, PluginKind::DataLoader] {
        let plugin = registry.find(kind, &cfg.section(kind.as_str()).plugin).map_err(|e| anyhow!("[{kind}] {e}"))?;
        if !records.iter().any(|r: &PluginRecord| r.kind == plugin.record.kind) {
            records.push(plugin.record.clone());
        }
    }
    Ok((targets.remove(0), records))
}

pub fn build_components(
    cfg: &RunConfig,
    registry: &Registry,
    config_dir: &Path,
    cache_dir: &Path,
) -> Result<Components> {
    let ctx_on = |device: &str| crate::plugins::host_context(device, cfg.dtype(), cfg.seed, config_dir, cache_dir);
    let (mut targets, target_record) = create_targets(cfg, registry, config_dir, cache_dir)?;
    let mut records = vec![target_record];
    let mut create = |kind: PluginKind, section: &PluginSection, ctx: &HostContext| -> Result<PluginInstance> {
        tracing::info!("creating {kind} plugin `{}` on {}", section.plugin, ctx.device);
        let (instance, record) = registry.create(kind, section, ctx)?;
        if !records.iter().any(|r: &PluginRecord| r.kind == record.kind) {
            records.push(record);
        }
        Ok(instance)
    };
    let wrong = |kind: PluginKind| anyhow!("plugin for [{kind}] did not create a {kind}");
    let target = targets.remove(0);
    let spec = target.spec()?;
    let mut ctx = ctx_on(cfg.drafter_device());
    ctx.target = RSome(spec.clone());
    // A target without a pad token: the drafter's mask token picked from its vocabulary.
    let mut drafter_section = cfg.section("drafter");
    let describes = registry.find(PluginKind::Drafter, &drafter_section.plugin)?.describe()?.is_some_and(|d| {
        d.tables.iter().any(|t| t.path.is_empty() && t.fields.iter().any(|f| f.name == "mask_token_id"))
    });
    let mask_token = if describes && spec.pad_token_id.into_option().is_none_or(|p| p == spec.eos_token_id) {
        let templates = mask_token::templates(&spec, &cfg.data, config_dir);
        mask_token::fill(&mut drafter_section, describes, &spec, &target.tokenizer_json()?, &templates)?
    } else {
        None
    };
    let PluginInstance::Drafter(drafter) = create(PluginKind::Drafter, &drafter_section, &ctx)? else {
        return Err(wrong(PluginKind::Drafter));
    };
    let PluginInstance::Optimizer(optimizer) = create(PluginKind::Optimizer, &cfg.section("optimizer"), &ctx)? else {
        return Err(wrong(PluginKind::Optimizer));
    };
    let PluginInstance::DataLoader(data) = create(PluginKind::DataLoader, &cfg.section("data"), &ctx)? else {
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
        numerics: numerics(cfg),
        mask_token,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Replies distilled by an FP8 target are cached apart from a bf16 one's; `compute = "bf16"`
    /// (the default) keys them as a config without `compute` does, so caches made before stay
    /// valid.
    #[test]
    fn replies_are_keyed_by_the_targets_compute_where_it_is_not_bf16() {
        let cfg = |target_extra: &str| {
            let text = format!(
                "name = \"t\"\ndtype = \"bf16\"\n[train]\nsteps = 1\n[target]\nplugin = \"hf\"\npath = \"x.gguf\"\n\
                 {target_extra}\n[drafter]\nplugin = \"dflash\"\n[optimizer]\nplugin = \"adamw\"\n[data]\nplugin = \"chat\"\n"
            );
            numerics(&RunConfig::from_toml(Path::new("cfg.toml"), &text).unwrap())
        };
        assert_eq!(cfg(""), "bf16");
        assert_eq!(cfg("compute = \"bf16\""), "bf16");
        assert_eq!(cfg("compute = \"fp8\""), "bf16 compute=fp8");
    }
}
