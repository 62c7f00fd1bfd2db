//! What every clause works with: the plugin's section and the host's context, the registry that
//! creates instances from them, and a clause's outcome (a panic in it is a failure, not a crash).

use crate::config::{PluginSection, RunConfig};
use crate::plugins::{handles::TargetHandle, Registry};
use anyhow::{anyhow, Context, Result};
use plugin_api::{
    abi_stable::std_types::RSome,
    tch::{Device, Kind, Tensor},
    HostContext, PluginInstance, PluginKind,
};

/// One clause's outcome.
pub(super) struct Clause {
    pub(super) name: &'static str,
    pub(super) result: Result<()>,
}

pub(super) struct Kit<'a> {
    pub(super) registry: &'a Registry,
    pub(super) section: PluginSection,
    pub(super) ctx: HostContext,
    pub(super) cfg: RunConfig,
}

impl Kit<'_> {
    pub(super) fn clause(&self, name: &'static str, f: impl FnOnce() -> Result<()>) -> Clause {
        // The host's own code is checked here too: a panic (a tch shape error on a bad output) is a
        // failed clause, not a crash.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
            Err(anyhow!(
                "panicked: {}",
                p.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default()
            ))
        });
        Clause { name, result }
    }
}

pub(super) fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    if a.size() != b.size() {
        return f64::INFINITY;
    }
    (a.to_kind(Kind::Double) - b.to_kind(Kind::Double)).abs().max().double_value(&[])
}

pub(super) const CPU: (Kind, Device) = (Kind::Float, Device::Cpu);

impl Kit<'_> {
    pub(super) fn create(
        &self,
        kind: PluginKind,
        section: &PluginSection,
        ctx: &HostContext,
    ) -> Result<PluginInstance> {
        Ok(self.registry.create(kind, section, ctx)?.0)
    }

    /// A config's target (the data loader's tokenizer, the drafter's spec).
    pub(super) fn target_box(&self) -> Result<TargetHandle> {
        let section = self.cfg.section("target");
        match self.create(PluginKind::Target, &section, &self.ctx).context("creating the config's target")? {
            PluginInstance::Target(t) => Ok(TargetHandle::new(t, &section.plugin)),
            _ => unreachable!(),
        }
    }

    pub(super) fn ctx_with_target(&self) -> Result<HostContext> {
        let mut ctx = self.ctx.clone();
        ctx.target = RSome(self.target_box()?.spec()?);
        Ok(ctx)
    }
}
