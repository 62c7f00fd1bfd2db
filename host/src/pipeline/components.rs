//! The four components of a run, built from the config's sections (for `train`, `capture`,
//! `eval` and `bench` alike), and plugin names for the errors of their calls.

use crate::{
    config::RunConfig,
    plugins::{Instance, PluginRecord, Poison, Registry},
};
use anyhow::{anyhow, Result};
use plugin_api::{
    abi_stable::std_types::{RNone, RSome},
    DataLoaderBox, DrafterBox, HostContext, OptimizerBox, PluginInstance, PluginKind, TargetBox,
};
use std::path::Path;

/// The four components of a run, created from the config's sections.
pub struct Components {
    pub target: TargetBox,
    /// More target workers (`pipeline.targets` beyond the first), each on its own device.
    pub extra_targets: Vec<TargetBox>,
    pub drafter: DrafterBox,
    pub optimizer: OptimizerBox,
    pub data: DataLoaderBox,
    pub records: Vec<PluginRecord>,
    /// Plugin names for error messages (from `records`).
    pub names: PluginNames,
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
        targets.push(t);
    }
    let target = targets.remove(0);
    let mut ctx = ctx_on(cfg.drafter_device());
    let spec = target.spec();
    if spec.architecture.is_empty() {
        // A spec() that panicked: plugin-api's placeholder carries the panic in `source`.
        return Err(anyhow!("target plugin `{}`: spec: {}", cfg.section("target").plugin, spec.source));
    }
    ctx.target = RSome(spec);
    let PluginInstance::Drafter(drafter) = create(PluginKind::Drafter, &ctx)? else {
        return Err(wrong(PluginKind::Drafter));
    };
    let PluginInstance::Optimizer(optimizer) = create(PluginKind::Optimizer, &ctx)? else {
        return Err(wrong(PluginKind::Optimizer));
    };
    let PluginInstance::DataLoader(data) = create(PluginKind::DataLoader, &ctx)? else {
        return Err(wrong(PluginKind::DataLoader));
    };
    let names = PluginNames::new(&records, registry);
    Ok(Components {
        target,
        extra_targets: targets,
        drafter,
        optimizer,
        data,
        records,
        names,
        dtype: cfg.dtype().to_string(),
    })
}

/// Plugin names for error messages, and how to ask each plugin about panics, usable while the
/// components are borrowed by the stages.
#[derive(Clone)]
pub struct PluginNames(Vec<(String, String, Poison)>);

impl PluginNames {
    pub fn new(records: &[PluginRecord], registry: &Registry) -> Self {
        let poison = |r: &PluginRecord| {
            let kind = [PluginKind::Target, PluginKind::Drafter, PluginKind::Optimizer, PluginKind::DataLoader]
                .into_iter()
                .find(|k| k.as_str() == r.kind);
            kind.map_or(Poison::Library(None), |k| registry.poison(k, &r.name))
        };
        Self(records.iter().map(|r| (r.kind.clone(), r.name.clone(), poison(r))).collect())
    }

    fn name(&self, kind: PluginKind) -> &str {
        self.0.iter().find(|(k, ..)| k == kind.as_str()).map_or("?", |(_, n, _)| n.as_str())
    }

    /// An error from a plugin call, naming the plugin and the call.
    pub fn err(&self, kind: PluginKind, call: &str) -> impl Fn(plugin_api::PluginError) -> anyhow::Error + '_ {
        let call = call.to_string();
        move |e| anyhow!("{kind} plugin `{}`: {call}: {e}", self.name(kind))
    }

    /// An error when a value-returning method of `instance` (of the `kind` plugin) panicked: what
    /// it returned was a placeholder, so the run stops before using it.
    pub fn check(&self, kind: PluginKind, instance: &impl Instance) -> Result<()> {
        let Some((_, name, poison)) = self.0.iter().find(|(k, ..)| k == kind.as_str()) else { return Ok(()) };
        match poison.take(instance) {
            Some(why) => Err(anyhow!("{kind} plugin `{name}`: {why}")),
            None => Ok(()),
        }
    }
}

impl Components {
    /// An error from a plugin call, naming the plugin and the call.
    pub fn err(&self, kind: PluginKind, call: &str) -> impl Fn(plugin_api::PluginError) -> anyhow::Error + '_ {
        self.names.err(kind, call)
    }

    /// [`PluginNames::check`] for every component.
    pub fn check_poisoned(&self) -> Result<()> {
        for t in std::iter::once(&self.target).chain(&self.extra_targets) {
            self.names.check(PluginKind::Target, t)?;
        }
        self.names.check(PluginKind::Drafter, &self.drafter)?;
        self.names.check(PluginKind::Optimizer, &self.optimizer)?;
        self.names.check(PluginKind::DataLoader, &self.data)
    }
}
