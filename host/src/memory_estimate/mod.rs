//! The device memory a config needs, estimated before anything loads, and the refusal of one
//! that cannot fit, naming its largest parts and what would fit (advice.rs).
//!
//! Each plugin answers for its own section through the ABI's `memory` (its config, no weights):
//! the data loader its micro-batch, the target its weights on one rank and its forward's working
//! set, the drafter its weights, gradients and activations at the batch, sequence length and
//! anchors, the optimizer its state for the drafter's parameters. The host adds the CUDA context
//! and the libraries' workspaces. A part scales as its plugin says ([`MemoryScale`]), which is
//! what the advice scales: the largest batch, the anchors, `checkpoint_layers`, tensor
//! parallelism, an FP8 target (the target's weights as its plugin counts them with
//! `compute = "fp8"`).
//!
//! The parts are not all held at once ([`Phase`]): a training step's activations are freed by
//! its backward, which makes the gradients, and the optimizer's step reads the gradients once
//! the activations are gone; the gradients are dropped after it, so they sit beside the next
//! micro-batch's activations only when a step has several.
//!
//! `DFLASH_DEVICE_MEMORY_BYTES` stands in for the device's size (tests, and what-if planning: it
//! also checks a CPU run as if on such a device); `--no-memory-check` runs a refused config anyway.
//! A CUDA out-of-memory error at run time is reported with the same advice ([`oom_paragraph`]).

mod advice;
mod oom;
#[cfg(test)]
mod tests;

pub use oom::{catch_host_panic, install_oom_hook, is_oom, is_oom_error, oom_paragraph};

use crate::{config::PluginSection, plugins::Registry};
use anyhow::{bail, Result};
use oom::ADVICE;
use plugin_api::{
    describe::{MemoryQuery, MemoryScale, SectionMemory},
    HostContext, PluginKind,
};
use std::sync::atomic::{AtomicBool, Ordering};

/// The CUDA context, cuBLAS / cuDNN workspaces and the run-time compiled kernels: in use before the
/// first tensor (about 0.5 GiB for the context on an H100, the rest the libraries').
pub const CUDA_OVERHEAD: u64 = 3 << 28;

/// The environment variable that stands in for the device's memory, in bytes (or `24GiB`).
pub const DEVICE_MEMORY_VAR: &str = "DFLASH_DEVICE_MEMORY_BYTES";

static SKIP: AtomicBool = AtomicBool::new(false);

/// `--no-memory-check`: a config that cannot fit is run anyway (the estimate is still logged).
pub fn skip_refusal(skip: bool) {
    SKIP.store(skip, Ordering::Relaxed);
}

/// What a command runs on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// The target's forward and the drafter's training step.
    Train,
    /// The target's forward alone (`capture`, a rank serving its replica's target).
    Target,
    /// The target with logits and the drafter's weights, without training (`eval`).
    Eval,
}

/// The shapes the estimate is at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub batch: u32,
    pub seq_len: u32,
    pub anchors_per_seq: u32,
}

/// One part of the estimate.
#[derive(Debug, Clone, PartialEq)]
pub struct Part {
    pub name: String,
    pub bytes: u64,
    pub scale: MemoryScale,
    /// A drafter's part (what `checkpoint_layers` changes).
    pub drafter: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Estimate {
    pub parts: Vec<Part>,
    pub shape: Shape,
    /// The target's `tensor_parallel` (its weights part is one rank's of that many).
    pub tensor_parallel: usize,
    /// The drafter's parts that scale with the batch, were `checkpoint_layers` on.
    pub checkpointed: Option<u64>,
    /// Micro-batches a training step (`train.grad_accum`): with several, the drafter's gradients
    /// are held beside the next micro-batch's activations.
    pub grad_accum: u32,
    /// The target's weights on one rank with `[target] compute = "fp8"`, as its plugin counts
    /// them (None: it runs FP8 already, or its plugin cannot tell).
    pub fp8_target_weights: Option<u64>,
    /// Sections whose plugin could not tell (`[drafter] plugin `gdn``): left out.
    pub unknown: Vec<String>,
}

/// When a part is held during a training step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// All along (weights, optimizer state, the target's forward beside the drafter's step).
    Always,
    /// From the drafter's forward through its backward: its input and activations.
    Activations,
    /// From the backward through the optimizer's step (the drafter's gradients).
    Gradients,
    /// In the optimizer's step only (its fp32 copies of the gradients).
    OptimizerStep,
}

impl Part {
    pub fn phase(&self) -> Phase {
        match () {
            _ if self.name.contains("gradients in the step") => Phase::OptimizerStep,
            _ if self.name.contains("gradients") => Phase::Gradients,
            _ if self.drafter && matches!(self.scale, MemoryScale::Batch | MemoryScale::BatchAnchors) => {
                Phase::Activations
            }
            _ => Phase::Always,
        }
    }
}

/// The sections of a run, as the estimate needs them.
pub struct Sections<'a> {
    pub target: &'a PluginSection,
    pub drafter: Option<&'a PluginSection>,
    pub optimizer: Option<&'a PluginSection>,
    pub data: Option<&'a PluginSection>,
}

fn ask(
    registry: &Registry,
    section: &PluginSection,
    kind: PluginKind,
    ctx: &HostContext,
    q: MemoryQuery,
) -> Result<Option<SectionMemory>> {
    registry.find(kind, &section.plugin)?.memory(section, ctx, q)
}

fn shown(section: &PluginSection) -> String {
    format!("[{}] plugin `{}`", section.kind, section.plugin)
}

/// The estimate for `work` over `sections`; `shape`: the bench's own (else the data loader's
/// micro-batch, with `anchors_per_seq`). None when the target's plugin cannot tell (the weights,
/// the largest part, unknown: no estimate is better than a wrong one), or the data loader's its
/// micro-batch.
pub fn estimate(
    registry: &Registry,
    sections: &Sections,
    ctx: &HostContext,
    work: Work,
    shape: Shape,
    logits: bool,
) -> Result<Option<Estimate>> {
    let mut shape = shape;
    let mut unknown = Vec::new();
    let mut q = MemoryQuery {
        batch: shape.batch,
        seq_len: shape.seq_len,
        anchors_per_seq: shape.anchors_per_seq,
        layers: u32::MAX,
        logits,
        trained_parameters: 0,
    };
    if let Some(data) = sections.data {
        // Without the micro-batch's shape nothing that scales with it can be told.
        let Some([b, s]) =
            ask(registry, data, PluginKind::DataLoader, ctx, q)?.and_then(|m| m.batch_shape.into_option())
        else {
            return Ok(None);
        };
        (shape.batch, shape.seq_len) = (b, s);
        (q.batch, q.seq_len) = (shape.batch, shape.seq_len);
    }
    if work == Work::Eval {
        // `eval` decodes one prompt at a time.
        (shape.batch, q.batch) = (1, 1);
    }
    let Some(target) = ask(registry, sections.target, PluginKind::Target, ctx, q)? else { return Ok(None) };
    let fp8_target_weights = fp8_weights(registry, sections.target, ctx, q)?;
    let mut parts: Vec<Part> = Vec::new();
    let mut add = |m: &SectionMemory, drafter: bool, keep: &dyn Fn(&str) -> bool| {
        for p in m.parts.iter().filter(|p| keep(p.name.as_str())) {
            parts.push(Part { name: p.name.to_string(), bytes: p.bytes, scale: p.scale, drafter });
        }
    };
    add(&target, false, &|_| true);
    let mut checkpointed = None;
    if let (Some(drafter), true) = (sections.drafter, work != Work::Target) {
        let mut ctx = ctx.clone();
        ctx.target = target.target.clone();
        match ask(registry, drafter, PluginKind::Drafter, &ctx, q)? {
            Some(d) if work == Work::Eval => add(&d, true, &|name| name.ends_with("weights")),
            Some(d) => {
                add(&d, true, &|_| true);
                checkpointed = d.checkpointed_bytes.into_option();
                q.trained_parameters = d.trained_parameters;
                if let Some(o) = sections.optimizer {
                    match ask(registry, o, PluginKind::Optimizer, &ctx, q)? {
                        Some(m) => add(&m, false, &|_| true),
                        None => unknown.push(shown(o)),
                    }
                }
            }
            None => unknown.push(shown(drafter)),
        }
    }
    parts.push(Part {
        name: "CUDA context and workspaces".into(),
        bytes: CUDA_OVERHEAD,
        scale: MemoryScale::Fixed,
        drafter: false,
    });
    let tensor_parallel = target_tensor_parallel(sections.target);
    Ok(Some(Estimate { parts, shape, tensor_parallel, checkpointed, grad_accum: 1, fp8_target_weights, unknown }))
}

/// The target's weights were it run with `compute = "fp8"`: its plugin asked again with that set
/// (None where it is set already, or the plugin has no such field or cannot tell).
fn fp8_weights(registry: &Registry, target: &PluginSection, ctx: &HostContext, q: MemoryQuery) -> Result<Option<u64>> {
    let Ok(mut table) = toml::from_str::<toml::Table>(&target.config_toml) else { return Ok(None) };
    if table.get("compute").and_then(toml::Value::as_str) == Some("fp8") {
        return Ok(None);
    }
    table.insert("compute".into(), "fp8".into());
    let fp8 = PluginSection { config_toml: toml::to_string(&table)?, ..target.clone() };
    let asked = registry.find(PluginKind::Target, &target.plugin)?.memory(&fp8, ctx, q);
    Ok(asked.ok().flatten().and_then(|m| {
        m.parts.iter().filter(|p| p.scale == MemoryScale::TargetWeights).map(|p| p.bytes).reduce(|a, b| a + b)
    }))
}

/// `[target] tensor_parallel` (1 when unset).
fn target_tensor_parallel(target: &PluginSection) -> usize {
    toml::from_str::<toml::Table>(&target.config_toml)
        .ok()
        .and_then(|t| t.get("tensor_parallel").and_then(toml::Value::as_integer))
        .map_or(1, |n| n.max(1) as usize)
}

pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Estimate a run's device memory before anything loads and refuse it where it cannot fit
/// ([`check`]); the drafter's device holds the drafter's parts and, where the target runs there
/// too (the default), the target's. Nothing is checked where the target's plugin cannot tell.
pub fn check_run(cfg: &crate::config::RunConfig, registry: &Registry, ctx: &HostContext, work: Work) -> Result<()> {
    let devices = cfg.target_devices();
    let drafter_device = cfg.drafter_device().to_string();
    let together = devices.iter().all(|d| *d == drafter_device);
    let device = if together || work == Work::Target { devices[0].clone() } else { drafter_device };
    if device_memory(&device)?.is_none() {
        return Ok(());
    }
    let (target, drafter, optimizer, data) =
        (cfg.section("target"), cfg.section("drafter"), cfg.section("optimizer"), cfg.section("data"));
    let sections = Sections {
        target: &target,
        drafter: Some(&drafter),
        optimizer: (work == Work::Train).then_some(&optimizer),
        data: Some(&data),
    };
    let shape = Shape { batch: 1, seq_len: 1, anchors_per_seq: cfg.train.anchors_per_seq as u32 };
    let Some(mut e) = estimate(registry, &sections, ctx, work, shape, work == Work::Eval)? else {
        tracing::info!("device memory: not estimated ([target] plugin `{}` cannot tell)", target.plugin);
        return Ok(());
    };
    if !together && work == Work::Train {
        // The target's parts are on their own devices: the drafter's device holds the rest.
        e.parts.retain(|p| p.drafter || p.scale != MemoryScale::TargetWeights && !p.name.starts_with("target"));
    }
    if together && work == Work::Train {
        // Features wait in the buffer where they were made: on this device, up to its cap.
        let bytes = cfg.pipeline.buffer_bytes() as u64;
        e.parts.push(Part { name: "hidden-state buffer".into(), bytes, scale: MemoryScale::Fixed, drafter: false });
    }
    e.grad_accum = cfg.train.grad_accum.clamp(1, u32::MAX as u64) as u32;
    check(&e, &device)
}

/// The device's memory in bytes: `DFLASH_DEVICE_MEMORY_BYTES` where set, else a CUDA device's
/// (None on the CPU, or without a CUDA runtime).
pub fn device_memory(device: &str) -> Result<Option<u64>> {
    if let Ok(v) = std::env::var(DEVICE_MEMORY_VAR) {
        return parse_bytes(&v).map(Some).ok_or_else(|| {
            anyhow::anyhow!("{DEVICE_MEMORY_VAR}=`{v}`: expected bytes (`25769803776`) or GiB (`24GiB`)")
        });
    }
    let Some(index) = device.strip_prefix("cuda:").and_then(|i| i.parse::<usize>().ok()) else {
        return Ok(None);
    };
    Ok(kernels::ffi::cuda_mem_info(index).map(|(_, total)| total))
}

fn parse_bytes(v: &str) -> Option<u64> {
    let v = v.trim();
    let (num, unit) = match v.find(|c: char| c.is_ascii_alphabetic()) {
        Some(i) => (&v[..i], &v[i..]),
        None => (v, ""),
    };
    let scale: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "gib" | "g" | "gb" => 1 << 30,
        "mib" | "m" | "mb" => 1 << 20,
        _ => return None,
    };
    let n: f64 = num.trim().parse().ok()?;
    (n > 0.0).then_some((n * scale as f64) as u64)
}

/// Log the estimate and refuse it where it cannot fit on `device` (unless `--no-memory-check`);
/// its advice is kept for an out-of-memory error later.
pub fn check(e: &Estimate, device_name: &str) -> Result<()> {
    let Some(device) = device_memory(device_name)? else { return Ok(()) };
    tracing::info!(
        "device memory: about {:.1} GiB of {device_name}'s {:.1} GiB ({}){}",
        gib(e.total()),
        gib(device),
        e.largest(4),
        e.unknown_note()
    );
    let fits = e.what_fits(device);
    *ADVICE.lock().unwrap_or_else(|p| p.into_inner()) = Some(format!(
        "The estimate before the run was {:.1} GiB of {:.1} GiB ({}).{}",
        gib(e.total()),
        gib(device),
        e.largest(3),
        if fits.is_empty() { String::new() } else { format!(" What would fit: {}.", fits.join("; or ")) }
    ));
    if e.total() > device {
        if SKIP.load(Ordering::Relaxed) {
            tracing::warn!("{} (--no-memory-check: running it anyway)", e.refusal(device_name, device));
        } else {
            bail!("{}", e.refusal(device_name, device));
        }
    }
    Ok(())
}
