//! `dflash-host bench abi`: what crossing the plugin boundary costs, per call and as a share of
//! a training step, for built-in plugins and for plugins loaded from shared libraries.

use crate::plugins::Registry;
use anyhow::{anyhow, Result};
use plugin_api::{
    tch::{Kind, Tensor},
    HostContext, PluginInstance, PluginKind, TensorHandle,
};
use std::{hint::black_box, path::Path, time::Instant};

/// Plugin calls and tensor handles the trainer makes per micro-batch (train.rs): data.next_batch,
/// target.forward, drafter.forward, + 2 calls per step (optimizer.step, data.position); handles:
/// 2 batch tensors, 1 target output, 4 draft inputs, 1 draft output.
const CALLS_PER_MICRO_BATCH: f64 = 3.0;
const CALLS_PER_STEP: f64 = 2.0;
const HANDLES_PER_MICRO_BATCH: f64 = 8.0;

fn ns_per(iters: u64, f: impl Fn()) -> f64 {
    for _ in 0..iters / 10 {
        f();
    }
    let t = Instant::now();
    for _ in 0..iters {
        f();
    }
    t.elapsed().as_nanos() as f64 / iters as f64
}

pub fn abi(registry: &Registry, exp_dir: Option<&Path>, iters: u64) -> Result<()> {
    let ctx = HostContext::cpu();
    let plugin = registry.find(PluginKind::Optimizer, "adamw")?;
    let PluginInstance::Optimizer(opt) =
        (plugin.module()?.create())("lr = 1e-3".into(), &ctx).into_result().map_err(|e| anyhow!("{e}"))?
    else {
        return Err(anyhow!("adamw did not create an optimizer"));
    };
    // 1. A method call through the abi_stable vtable (for a --plugin library: into the .so).
    let call = ns_per(iters, || {
        let _ = black_box(opt.base_lr());
    });
    // 2. A tensor across: wrap, borrow a new reference, drop (refcount traffic only).
    let t = Tensor::zeros([4, 4], (Kind::Float, plugin_api::tch::Device::Cpu));
    let handle = ns_per(iters, || {
        let h = TensorHandle::new(t.shallow_clone());
        let _ = black_box(h.tensor());
    });
    // 3. A direct Rust call for scale.
    let direct = ns_per(iters, || {
        black_box(black_box(1e-3f64) * 1.0);
    });
    crate::say!("plugin        {} ({})", plugin.record.name, plugin.record.origin);
    crate::say!("vtable call   {call:.1} ns   (direct call {direct:.1} ns)");
    crate::say!("tensor handle {handle:.1} ns   (wrap + new reference + drop)");
    if let Some(dir) = exp_dir {
        let text = std::fs::read_to_string(dir.join("metrics.jsonl"))?;
        let last: serde_json::Value =
            serde_json::from_str(text.lines().last().ok_or_else(|| anyhow!("empty metrics"))?)?;
        let cfg: toml::Table = toml::from_str(&std::fs::read_to_string(dir.join("config.toml"))?)?;
        let k = cfg["train"].get("grad_accum").and_then(|v| v.as_integer()).unwrap_or(1) as f64;
        let step_s = ["target_s", "drafter_s", "optim_s"].iter().map(|f| last[f].as_f64().unwrap_or(0.0)).sum::<f64>();
        let per_step_ns = k * (CALLS_PER_MICRO_BATCH * call + HANDLES_PER_MICRO_BATCH * handle) + CALLS_PER_STEP * call;
        crate::say!(
            "per step      {per_step_ns:.0} ns of boundary crossings vs {:.3} s a step ({}) = {:.2e} of the step",
            step_s,
            dir.display(),
            per_step_ns * 1e-9 / step_s
        );
    }
    Ok(())
}
