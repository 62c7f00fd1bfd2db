//! The device memory a config needs, estimated before anything loads, and the refusal of one
//! that cannot fit, naming its largest parts and what would fit.
//!
//! Each plugin answers for its own section through the ABI's `memory` (its config, no weights):
//! the data loader its micro-batch, the target its weights on one rank and its forward's working
//! set, the drafter its weights, gradients and activations at the batch, sequence length and
//! anchors, the optimizer its state for the drafter's parameters. The host adds the CUDA context
//! and the libraries' workspaces. A part scales as its plugin says ([`MemoryScale`]), which is
//! what the advice scales: the largest batch, the anchors, `checkpoint_layers`, tensor
//! parallelism, an FP8 target (half the target's weights).
//!
//! `DFLASH_DEVICE_MEMORY_BYTES` stands in for the device's size (tests, and what-if planning: it
//! also checks a CPU run as if on such a device); `--no-memory-check` runs a refused config anyway.
//! A CUDA out-of-memory error at run time is reported with the same advice ([`oom_paragraph`]).

use crate::{config::PluginSection, plugins::Registry};
use anyhow::{bail, Result};
use plugin_api::{
    describe::{MemoryQuery, MemoryScale, SectionMemory},
    HostContext, PluginKind,
};
use std::sync::{
    atomic::{AtomicBool, Ordering},
    Mutex,
};

/// The CUDA context, cuBLAS / cuDNN workspaces and the run-time compiled kernels: in use before the
/// first tensor (about 0.5 GiB for the context on an H100, the rest the libraries').
pub const CUDA_OVERHEAD: u64 = 3 << 28;

/// The environment variable that stands in for the device's memory, in bytes (or `24GiB`).
pub const DEVICE_MEMORY_VAR: &str = "DFLASH_DEVICE_MEMORY_BYTES";

static SKIP: AtomicBool = AtomicBool::new(false);

/// The advice of the last estimate, for an out-of-memory error at run time.
static ADVICE: Mutex<Option<String>> = Mutex::new(None);

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
    /// Sections whose plugin could not tell (`[drafter] plugin `gdn``): left out.
    pub unknown: Vec<String>,
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
    Ok(Some(Estimate { parts, shape, tensor_parallel, checkpointed, unknown }))
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

impl Estimate {
    pub fn total(&self) -> u64 {
        self.parts.iter().map(|p| p.bytes).sum()
    }

    fn sum(&self, keep: impl Fn(&Part) -> bool) -> u64 {
        self.parts.iter().filter(|p| keep(p)).map(|p| p.bytes).sum()
    }

    fn scaled(&self, scale: MemoryScale) -> u64 {
        self.sum(|p| p.scale == scale)
    }

    /// The parts as one line, largest first: `target weights 15.3 GiB, ...`.
    pub fn largest(&self, n: usize) -> String {
        let mut parts: Vec<&Part> = self.parts.iter().collect();
        parts.sort_by_key(|p| std::cmp::Reverse(p.bytes));
        let mut out: Vec<String> =
            parts.iter().take(n).map(|p| format!("{} {:.1} GiB", p.name, gib(p.bytes))).collect();
        let rest: u64 = parts.iter().skip(n).map(|p| p.bytes).sum();
        if rest > 0 {
            out.push(format!("{:.1} GiB in {} smaller parts", gib(rest), parts.len() - n));
        }
        out.join(", ")
    }

    /// The largest batch whose estimate fits in `device` bytes (None: not even one sequence).
    pub fn largest_batch(&self, device: u64) -> Option<u32> {
        let fixed = self.scaled(MemoryScale::TargetWeights) + self.scaled(MemoryScale::Fixed);
        let per_seq = (self.scaled(MemoryScale::Batch) + self.scaled(MemoryScale::BatchAnchors)) as f64
            / self.shape.batch.max(1) as f64;
        let b = (device.checked_sub(fixed)? as f64 / per_seq.max(1.0)).floor() as u32;
        (b >= 1).then_some(b)
    }

    /// The most anchors a sequence whose estimate fits at this batch (None: not even one).
    pub fn largest_anchors(&self, device: u64) -> Option<u32> {
        let blocks = self.scaled(MemoryScale::BatchAnchors);
        let rest = self.total() - blocks;
        let per_anchor = blocks as f64 / self.shape.anchors_per_seq.max(1) as f64;
        let a = (device.checked_sub(rest)? as f64 / per_anchor.max(1.0)).floor() as u32;
        (a >= 1 && blocks > 0).then_some(a)
    }

    /// The total with the drafter's `checkpoint_layers` on (None: no such switch, or it is on).
    pub fn with_checkpointing(&self) -> Option<u64> {
        let drafter_batch =
            self.sum(|p| p.drafter && matches!(p.scale, MemoryScale::Batch | MemoryScale::BatchAnchors));
        self.checkpointed.map(|c| self.total() - drafter_batch + c)
    }

    /// The total with the target's weights split over `n` ranks instead of `tensor_parallel`
    /// (the drafter stays on the first).
    pub fn with_tensor_parallel(&self, n: usize) -> u64 {
        let w = self.scaled(MemoryScale::TargetWeights);
        self.total() - w + (w as f64 * self.tensor_parallel as f64 / n as f64) as u64
    }

    /// The total with an FP8 target checkpoint (one byte a weight: half of bf16's).
    pub fn with_fp8_target(&self) -> u64 {
        self.total() - self.scaled(MemoryScale::TargetWeights) / 2
    }

    /// What would fit in `device` bytes, each as a clause (`a micro-batch of 2 sequences`).
    pub fn what_fits(&self, device: u64) -> Vec<String> {
        let mut fits = Vec::new();
        if let Some(b) = self.largest_batch(device).filter(|&b| b < self.shape.batch) {
            fits.push(format!(
                "a micro-batch of {b} sequence{} (now {})",
                if b == 1 { "" } else { "s" },
                self.shape.batch
            ));
        }
        if let Some(a) = self.largest_anchors(device).filter(|&a| a < self.shape.anchors_per_seq) {
            fits.push(format!("{a} anchors a sequence (`anchors_per_seq`, now {})", self.shape.anchors_per_seq));
        }
        if let Some(c) = self.with_checkpointing().filter(|&c| c <= device) {
            fits.push(format!("`checkpoint_layers = true` in [drafter] ({:.1} GiB)", gib(c)));
        }
        if self.scaled(MemoryScale::TargetWeights) > 0 {
            if let Some(n) = [2, 4, 8]
                .into_iter()
                .filter(|&n| n > self.tensor_parallel)
                .find(|&n| self.with_tensor_parallel(n) <= device)
            {
                fits.push(format!(
                    "`tensor_parallel = {n}` in [target] over {n} GPUs ({:.1} GiB on the first)",
                    gib(self.with_tensor_parallel(n))
                ));
            }
            if self.with_fp8_target() <= device {
                fits.push(format!("an FP8 target, half the target's weights ({:.1} GiB)", gib(self.with_fp8_target())));
            }
        }
        fits
    }

    /// The refusal: one paragraph naming the largest parts and what would fit.
    pub fn refusal(&self, device_name: &str, device: u64) -> String {
        let fits = self.what_fits(device);
        let advice = match fits.is_empty() {
            true => "Nothing of the batch, anchors, `checkpoint_layers`, `tensor_parallel` or an FP8 target alone fits it; a larger device or several of those together would.".to_string(),
            false => format!("What would fit: {}.", fits.join("; or ")),
        };
        format!(
            "not enough device memory: this config needs about {:.1} GiB on {device_name}, which has {:.1} GiB \
             (batch {} x {} tokens, {} anchors a sequence): {}. {advice}{} To run it anyway: --no-memory-check.",
            gib(self.total()),
            gib(device),
            self.shape.batch,
            self.shape.seq_len,
            self.shape.anchors_per_seq,
            self.largest(4),
            self.unknown_note(),
        )
    }

    fn unknown_note(&self) -> String {
        match self.unknown.is_empty() {
            true => String::new(),
            false => format!(" (Not counted, as their plugins cannot tell: {}.)", self.unknown.join(", ")),
        }
    }
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

/// Whether an error message is a CUDA out-of-memory (libtorch's `CUDA out of memory`, the CUDA
/// runtime's `out of memory`).
pub fn is_oom(message: &str) -> bool {
    message.contains("CUDA out of memory") || message.contains("CUDA error: out of memory")
}

/// Whether an error (any of its causes) is an out-of-memory paragraph of [`oom_paragraph`].
pub fn is_oom_error(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.to_string().starts_with(OOM_LEAD))
}

const OOM_LEAD: &str = "out of device memory in ";

/// A CUDA out-of-memory error as one paragraph: where it happened, libtorch's own first sentences
/// (what it tried to allocate, what the device had), and what would fit (the estimate's advice
/// where one was made).
pub fn oom_paragraph(place: &str, message: &str) -> String {
    // libtorch's message up to its advice on the allocator (PYTORCH_CUDA_ALLOC_CONF), one line.
    let start = message.find("CUDA out of memory").or_else(|| message.find("CUDA error")).unwrap_or(0);
    let what = message[start..].lines().next().unwrap_or("");
    let what = what.split(" Of the allocated memory").next().unwrap_or(what);
    let what = what.split(" If reserved but unallocated").next().unwrap_or(what).trim();
    let advice = ADVICE.lock().unwrap_or_else(|p| p.into_inner()).clone().unwrap_or_default();
    format!(
        "{OOM_LEAD}{place}: {what} {advice}{}Lower the micro-batch or `anchors_per_seq`, set \
         `checkpoint_layers = true` in [drafter], spread the target with `tensor_parallel = N` in [target], or \
         use an FP8 target; `dflash-host bench train` shows each part's estimate beside what it measures.",
        if advice.is_empty() { "" } else { " " }
    )
}

thread_local! {
    /// Set while [`catch_host_panic`] runs: its out-of-memory panics become errors, printed once.
    static CATCHING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

/// A CUDA out-of-memory panic prints its paragraph instead of libtorch's C++ frames (and nothing
/// where [`catch_host_panic`] makes it an error); every other panic as before.
pub fn install_oom_hook() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = panic_message(info.payload());
        match is_oom(&msg) {
            true if CATCHING.with(|c| c.get()) => {}
            true => eprintln!("error: {}", oom_paragraph("the host", &msg)),
            false => previous(info),
        }
    }));
}

/// A CUDA out-of-memory panic of host code (its tch calls) as an error ([`oom_paragraph`]), so a
/// failed step ends the run as other step errors do; any other panic goes on unwinding.
pub fn catch_host_panic<T>(place: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let outer = CATCHING.with(|c| c.replace(true));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    CATCHING.with(|c| c.set(outer));
    match result {
        Ok(r) => r,
        Err(payload) if is_oom(&panic_message(payload.as_ref())) => {
            bail!("{}", oom_paragraph(place, &panic_message(payload.as_ref())))
        }
        Err(payload) => std::panic::resume_unwind(payload),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::train::{bench_estimate, BenchConfig};
    use std::path::Path;

    /// The estimate of a bench config, on the CPU in `dtype`: each part by name.
    fn bench(name: &str, dtype: &str) -> (Estimate, std::collections::BTreeMap<String, u64>) {
        let registry = Registry::new(&[]).unwrap();
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/bench");
        let cfg: BenchConfig = toml::from_str(&std::fs::read_to_string(dir.join(name)).unwrap()).unwrap();
        let ctx = crate::plugins::host_context("cpu", dtype, 0, &dir, Path::new("/nonexistent"));
        let e = bench_estimate(&registry, &cfg, &ctx).unwrap().unwrap();
        let parts = e.parts.iter().map(|p| (p.name.clone(), p.bytes)).collect();
        (e, parts)
    }

    /// configs/bench/tiny.toml by hand, in f32: a qwen3 target of 4 layers (hidden 64, MLP 128,
    /// 4 / 2 heads of 16, vocabulary 100, untied), 2 x 64 tokens, a 2-layer drafter of block 4 on
    /// target layers [0, 2], 8 anchors a sequence, AdamW.
    #[test]
    fn the_tiny_bench_estimate_is_its_parts_counted_by_hand() {
        let (e, parts) = bench("tiny.toml", "f32");
        let target_layer = 64 * (64 + 2 * 32 + 64) + 3 * 64 * 128;
        let target = 4 * target_layer + 2 * 100 * 64;
        assert_eq!(target, 160_256);
        assert_eq!(parts["target weights"], target * 4);
        // One layer's input, normed copy and residual (3 x 64) and its MLP's 3 x 128, 128 tokens;
        // the logits (the bench's full forward).
        assert_eq!(parts["target forward (working set)"], 128 * (3 * 64 + 3 * 128) * 4 + 128 * 100 * 4);
        let drafter_layer = 64 * 64 + 2 * (32 * 64) + 64 * 64 + 2 * 16 + 3 * 64 * 128 + 2 * 64;
        let drafter = 64 * 128 + 2 * 64 + 2 * drafter_layer;
        assert_eq!(drafter, 82_368);
        assert_eq!((parts["drafter weights"], parts["drafter gradients"]), (drafter * 4, drafter * 4));
        // The features of 2 layers and the context made of them (fc, hidden_norm), 128 tokens of
        // 64; each layer's context keys and values (2 x 2 x 16).
        assert_eq!(parts["target features and drafter context"], 128 * 4 * 64 * 4 + 2 * 128 * 64 * 4);
        // 2 x 8 anchors x 4 block tokens, each layer's 5 x 64 + 3 x 64 + 4 x 32 + 3 x 128 values kept.
        assert_eq!(parts["drafter activations (blocks)"], 64 * (5 * 64 + 3 * 64 + 4 * 32 + 3 * 128) * 2 * 4);
        assert_eq!(parts["AdamW moments (fp32)"], drafter * 8);
        assert!(!parts.contains_key("fp32 master weights"), "f32 parameters need no master copy");
        assert_eq!(parts["CUDA context and workspaces"], CUDA_OVERHEAD);
        assert_eq!(e.total(), parts.values().sum::<u64>());
        assert_eq!(e.shape, Shape { batch: 2, seq_len: 64, anchors_per_seq: 8 });
    }

    /// configs/bench/qwen3-8b.toml in bf16: Qwen3-8B (8.19B parameters) and its published 5-layer
    /// drafter (1.05B trained: fc 4096 x 5 x 4096 and five Qwen3 layers), 4 x 3072 tokens, 512
    /// anchors of 16, AdamW with fp32 moments and masters.
    #[test]
    fn the_qwen3_8b_bench_estimate_is_its_parts_counted_by_hand() {
        let (e, parts) = bench("qwen3-8b.toml", "bf16");
        let target: u64 = 36 * (4096 * (4096 + 2048 + 4096) + 3 * 4096 * 12288) + 2 * 151_936 * 4096;
        assert_eq!(target / 10_000_000, 819, "Qwen3-8B's 8.19B parameters");
        assert_eq!(parts["target weights"], 2 * target);
        let tokens = 4 * 3072;
        assert_eq!(parts["target forward (working set)"], tokens * (3 * 4096 + 3 * 12288) * 2 + tokens * 151_936 * 2);
        let layer = 4096 * 4096 + 2 * 1024 * 4096 + 4096 * 4096 + 2 * 128 + 3 * 4096 * 12288 + 2 * 4096;
        let drafter: u64 = 4096 * 5 * 4096 + 2 * 4096 + 5 * layer;
        assert_eq!(drafter, 1_048_626_432, "the drafter's 1.05B parameters");
        assert_eq!(parts["drafter weights"], 2 * drafter);
        assert_eq!(parts["target features and drafter context"], tokens * 7 * 4096 * 2 + 5 * tokens * 2048 * 2);
        let block_tokens = 4 * 512 * 16;
        let kept = 5 * 4096 + 3 * 4096 + 4 * 1024 + 3 * 12288;
        assert_eq!(parts["drafter activations (blocks)"], block_tokens * kept * 5 * 2);
        assert_eq!(parts["AdamW moments (fp32)"], 8 * drafter);
        assert_eq!(parts["fp32 master weights"], 4 * drafter);
        assert_eq!(parts["fp32 gradients in the step"], 4 * drafter);
        // With checkpoint_layers: one layer's blocks and context, and every layer's input.
        let checkpointed = tokens * 7 * 4096 * 2 + tokens * 2048 * 2 + block_tokens * (kept + 5 * 4096) * 2;
        assert_eq!(e.checkpointed, Some(checkpointed));
    }

    /// The Qwen3.6-27B hybrid's text model: 24.35B in its 64 layers (48 Gated DeltaNet, 16 gated
    /// attention) + 2 x 1.27B embedding and head = 26.9B (the config's own note).
    #[test]
    fn the_qwen3_6_27b_target_has_its_published_parameter_count() {
        let (_, parts) = bench("qwen3.6-27b.toml", "bf16");
        let params = parts["target weights"] as f64 / 2.0;
        assert!((params / 1e9 - 26.9).abs() < 0.05, "{params}");
    }

    fn part(name: &str, gib: f64, scale: MemoryScale, drafter: bool) -> Part {
        Part { name: name.into(), bytes: (gib * (1u64 << 30) as f64) as u64, scale, drafter }
    }

    /// A 27B-shaped run at batch 4 x 3072 and 512 anchors on 80 GiB: what fits, part by part.
    #[test]
    fn the_refusal_names_the_largest_parts_and_what_would_fit() {
        let e = Estimate {
            parts: vec![
                part("target weights", 50.0, MemoryScale::TargetWeights, false),
                part("target forward (working set)", 4.0, MemoryScale::Batch, false),
                part("drafter weights", 2.0, MemoryScale::Fixed, true),
                part("AdamW moments (fp32)", 8.0, MemoryScale::Fixed, false),
                part("target features and drafter context", 4.0, MemoryScale::Batch, true),
                part("drafter activations (blocks)", 32.0, MemoryScale::BatchAnchors, true),
            ],
            shape: Shape { batch: 4, seq_len: 3072, anchors_per_seq: 512 },
            tensor_parallel: 1,
            checkpointed: Some((12u64 << 30) / 2),
            unknown: vec![],
        };
        let device = 80u64 << 30;
        assert_eq!(gib(e.total()), 100.0);
        // 60 GiB fixed, 10 GiB a sequence: 2 sequences; 100 - 32 = 68 GiB without the blocks, at
        // 1/16 GiB an anchor: 192 anchors.
        assert_eq!(e.largest_batch(device), Some(2));
        assert_eq!(e.largest_anchors(device), Some(192));
        assert_eq!(e.with_checkpointing().map(gib), Some(70.0));
        assert_eq!(gib(e.with_tensor_parallel(2)), 75.0);
        assert_eq!(gib(e.with_fp8_target()), 75.0);
        let text = e.refusal("cuda:0", device);
        let want = "not enough device memory: this config needs about 100.0 GiB on cuda:0, which has 80.0 GiB \
            (batch 4 x 3072 tokens, 512 anchors a sequence): target weights 50.0 GiB, drafter activations (blocks) \
            32.0 GiB, AdamW moments (fp32) 8.0 GiB, target forward (working set) 4.0 GiB, 6.0 GiB in 2 smaller parts. \
            What would fit: a micro-batch of 2 sequences (now 4); or 192 anchors a sequence (`anchors_per_seq`, now \
            512); or `checkpoint_layers = true` in [drafter] (70.0 GiB); or `tensor_parallel = 2` in [target] over 2 \
            GPUs (75.0 GiB on the first); or an FP8 target, half the target's weights (75.0 GiB). To run it anyway: \
            --no-memory-check.";
        assert_eq!(text, want);
        assert!(!text.contains('\n'), "one paragraph");
        // Where nothing alone fits, it says so.
        let tight = e.refusal("cuda:0", 50u64 << 30);
        assert!(tight.contains("Nothing of the batch, anchors"), "{tight}");
    }

    #[test]
    fn device_sizes_read_as_bytes_or_gib() {
        assert_eq!(parse_bytes("25769803776"), Some(24 << 30));
        assert_eq!(parse_bytes("24GiB"), Some(24 << 30));
        assert_eq!(parse_bytes("0.5 GiB"), Some(1 << 29));
        assert_eq!(parse_bytes("512MiB"), Some(512 << 20));
        assert_eq!((parse_bytes("24 parsecs"), parse_bytes("-1"), parse_bytes("")), (None, None, None));
    }

    /// libtorch's out-of-memory error, as a plugin's panic carries it (frames and all), through the
    /// boundary: one paragraph, libtorch's first sentences and the advice, no allocator notes.
    #[test]
    fn a_libtorch_oom_is_one_paragraph_with_the_advice() {
        let libtorch = "called `Result::unwrap()` on an `Err` value: Torch(\"CUDA out of memory. Tried to allocate \
            2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.05 GiB is free. Including non-PyTorch memory, \
            this process has 78.13 GiB memory in use. Of the allocated memory 75.20 GiB is allocated by PyTorch, and \
            1.40 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting \
            PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.\\nframe #0: c10::Error::Error(\
            c10::SourceLocation, std::string) + 0x9d (0x7f in libc10.so)\\nframe #1: ...\")";
        let err = plugin_api::catch_plugin_panic::<()>(|| panic!("{libtorch}")).unwrap_err();
        assert!(is_oom(&err.message));
        let text = oom_paragraph("drafter plugin `dflash`: forward", &err.message);
        assert!(
            text.starts_with(
                "out of device memory in drafter plugin `dflash`: forward: CUDA out of memory. Tried to allocate 2.00 \
                 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.05 GiB is free. Including non-PyTorch memory, \
                 this process has 78.13 GiB memory in use. "
            ),
            "{text}"
        );
        for advice in ["`anchors_per_seq`", "`checkpoint_layers = true`", "`tensor_parallel = N`", "FP8 target"] {
            assert!(text.contains(advice), "{advice} not in {text}");
        }
        for noise in ["frame #", "PYTORCH_CUDA_ALLOC_CONF", "\n"] {
            assert!(!text.contains(noise), "{noise:?} in {text}");
        }
        assert!(is_oom_error(&anyhow::anyhow!("{text}").context("step 3")));
        // A panic of the host's own tch calls, caught where the step runs.
        let host = catch_host_panic::<()>("the drafter's step", || panic!("{libtorch}")).unwrap_err();
        assert!(format!("{host:#}").starts_with("out of device memory in the drafter's step: CUDA out of memory."));
    }
}
