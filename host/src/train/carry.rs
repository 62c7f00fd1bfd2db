//! A fork's `optimizer_state = "carry"`: the parent's optimizer, rebuilt from the parent's config
//! and checkpoint, exports its state by role (plugin ABI 2.1, `plugin_api::roles`); a new instance
//! of the fork's optimizer imports what maps onto its own state; that instance's checkpoint state
//! is the fork's. The checkpoint formats stay each optimizer's own.

use crate::{
    config::{PluginSection, RunConfig},
    experiment::manifest::CarryRecord,
    plugins::{handles::OptimizerHandle, host_context, Plugin, Registry},
};
use anyhow::{anyhow, bail, Result};
use plugin_api::{abi_stable::std_types::RVec, HostContext, NamedTensor, PluginInstance, PluginKind};
use std::{collections::BTreeMap, path::Path};

/// Where the parent's optimizer is rebuilt: its config section and its checkpoint's state.
pub struct CarryFrom<'a> {
    pub section: PluginSection,
    pub state: Vec<NamedTensor>,
    /// The checkpoint's weights: the optimizers are initialised on copies of the trainable ones.
    pub weights: &'a [NamedTensor],
}

/// What carry hands the fork: its optimizer's state to checkpoint, and the record of what was
/// taken over.
pub struct Carried {
    pub state: Vec<NamedTensor>,
    pub record: CarryRecord,
}

/// Carry `from` into the fork's optimizer (`to`, its section of `cfg`), on the CPU. `trainable`:
/// the names of the drafter's trainable parameters, in the order the run gives them to its
/// optimizer. Each optimizer plugin is found once, its ABI checked, then made from it.
pub fn carry(
    from: CarryFrom,
    to: &PluginSection,
    cfg: &RunConfig,
    trainable: &[String],
    registry: &Registry,
    config_dir: &Path,
    cache_dir: &Path,
) -> Result<Carried> {
    let mut plugins = Vec::with_capacity(2);
    for section in [&from.section, to] {
        let plugin = registry.find(PluginKind::Optimizer, &section.plugin)?;
        let record = &plugin.record;
        if crate::plugins::abi_minor(&record.abi) < 1 {
            bail!(
                "field `fork.optimizer_state` (--optimizer-state) is carry, but optimizer plugin `{}` was built against \
                 plugin ABI {}, which has no state by role to carry (2.1 has): rebuild it against plugin-api {}, or \
                 give `fresh`",
                section.plugin,
                record.abi,
                plugin_api::ABI_VERSION
            );
        }
        plugins.push(plugin);
    }
    let ctx = host_context("cpu", cfg.dtype(), cfg.seed, config_dir, cache_dir);
    let params = || -> Result<RVec<NamedTensor>> {
        let by_name: BTreeMap<&str, &NamedTensor> = from.weights.iter().map(|w| (w.name.as_str(), w)).collect();
        trainable
            .iter()
            .map(|n| {
                let w = by_name.get(n.as_str()).ok_or_else(|| anyhow!("the checkpoint has no weights `{n}`"))?;
                Ok(NamedTensor::new(n.as_str(), w.tensor.tensor().detach().copy()))
            })
            .collect()
    };
    let mut parent = optimizer(plugins[0], &from.section, &ctx)?;
    parent.init(params()?)?;
    parent.load_state(from.state.into())?;
    let exported = parent.export_state()?.ok_or_else(|| cannot(&from.section.plugin, "export"))?;
    let exported_params = exported.params.len() as u64;
    let mut fork = optimizer(plugins[1], to, &ctx)?;
    fork.init(params()?)?;
    let report = fork.import_state(exported)?.ok_or_else(|| cannot(&to.plugin, "import"))?;
    // Owned copies: the instance that holds them goes when this returns.
    let state = fork.state()?.iter().map(|nt| NamedTensor::new(nt.name.as_str(), nt.tensor.tensor().copy())).collect();
    let counts = |v: &RVec<plugin_api::RoleCount>| v.iter().map(|c| (c.role.to_string(), c.params)).collect();
    let record = CarryRecord {
        exported_params,
        used: counts(&report.used),
        ignored: counts(&report.ignored),
        step: report.step,
        notes: report.notes.iter().map(|n| n.to_string()).collect(),
    };
    Ok(Carried { state, record })
}

fn optimizer(plugin: &Plugin, section: &PluginSection, ctx: &HostContext) -> Result<OptimizerHandle> {
    match plugin.create(PluginKind::Optimizer, section, ctx)? {
        PluginInstance::Optimizer(o) => Ok(OptimizerHandle::new(o, &section.plugin)),
        _ => unreachable!("Registry::create checks the kind"),
    }
}

fn cannot(plugin: &str, what: &str) -> anyhow::Error {
    anyhow!(
        "field `fork.optimizer_state` (--optimizer-state) is carry, but optimizer plugin `{plugin}` does not {what} its \
         state by role: give `fresh`"
    )
}

impl CarryRecord {
    /// One line: what was taken over, what was not, what was made up.
    pub fn summary(&self) -> String {
        let list = |m: &BTreeMap<String, u64>| {
            m.iter().map(|(role, n)| format!("{role} of {n}")).collect::<Vec<_>>().join(", ")
        };
        let mut out = format!("took {} of the {} parameters exported", list(&self.used), self.exported_params);
        if self.used.is_empty() {
            out = format!("took nothing of the {} parameters exported", self.exported_params);
        }
        out += if self.step { ", and the step count" } else { ", not the step count" };
        if !self.ignored.is_empty() {
            out += &format!("; left {}", list(&self.ignored));
        }
        for note in &self.notes {
            out += &format!("; {note}");
        }
        out
    }
}
