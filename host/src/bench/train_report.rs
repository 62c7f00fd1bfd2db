//! `bench train`'s config file (the shapes, the plugin sections) and its report: the timed
//! phases with their FLOPs and MFU, as a table and as one JSON line.

use serde::{Deserialize, Serialize};

/// The bench config file: the shapes to run and the plugin sections to build.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BenchConfig {
    /// `cpu` or `cuda:N`.
    #[serde(default = "default_device")]
    pub device: String,
    /// `f32` or `bf16`; default bf16 on CUDA, f32 on the CPU.
    #[serde(default)]
    pub dtype: Option<String>,
    #[serde(default)]
    pub seed: u64,
    pub bench: BenchShape,
    pub target: toml::Table,
    pub drafter: toml::Table,
    pub optimizer: toml::Table,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BenchShape {
    pub batch_size: usize,
    pub seq_len: usize,
    pub anchors_per_seq: usize,
    /// Untimed iterations before each timed phase.
    #[serde(default = "default_warmup")]
    pub warmup: usize,
    /// Timed iterations of each phase (the median is reported).
    #[serde(default = "default_iters")]
    pub iters: usize,
    /// Side of the square matmul that measures the ceiling.
    #[serde(default = "default_matmul")]
    pub matmul_size: i64,
    #[serde(default = "default_clip")]
    pub grad_clip: f64,
}

fn default_device() -> String {
    "cuda:0".into()
}
fn default_warmup() -> usize {
    2
}
fn default_iters() -> usize {
    5
}
fn default_matmul() -> i64 {
    8192
}
fn default_clip() -> f64 {
    1.0
}

/// One timed phase.
#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    /// Median seconds per iteration.
    pub step_s: f64,
    /// Tokens per second: target tokens for the target, draft (block) tokens for the drafter.
    pub tok_per_s: f64,
    pub flop: f64,
    pub tflop_per_s: f64,
    /// Achieved FLOP/s over the measured matmul ceiling.
    pub mfu: f64,
    /// Device memory in use after the phase (GiB; None on the CPU).
    pub mem_gib: Option<f64>,
}

#[derive(Debug, Serialize)]
pub struct Report {
    /// The lead's device (rank 0's, where the drafter trains).
    pub device: String,
    /// Ranks the target replica is spread over (`[target] tensor_parallel`; 1: the target whole
    /// on `device`). The target phases' FLOPs are the whole forward's, their MFU over as many
    /// devices' ceilings.
    pub tensor_parallel: usize,
    /// Each rank of the replica, the lead first: its device, memory, and the calls it served.
    pub ranks: Vec<super::replica::RankFigures>,
    pub dtype: String,
    pub batch_size: usize,
    pub seq_len: usize,
    pub anchors_per_seq: usize,
    pub drafter: String,
    /// Whether the drafter FLOPs are counted layer by layer (false: 6 * params * tokens).
    pub drafter_flop_exact: bool,
    pub ceiling_tflop_per_s: f64,
    /// Memory in use once the models are built (target weights, drafter, optimizer state).
    pub built_mem_gib: Option<f64>,
    /// Target forward to the deepest feature layer, as training runs it.
    pub target_features: Phase,
    /// Target forward through every layer and the LM head (what HF `model(ids)` computes).
    pub target_full: Phase,
    /// The full forward's FLOPs by layer part (`attention`, `gdn`, `mlp`, `head`, ...), where the
    /// target's plugin counts them (the hf plugin: by architecture, active experts only).
    pub target_full_flop_split: Option<std::collections::BTreeMap<String, f64>>,
    pub drafter_step: Phase,
    /// Target features + drafter step, sequentially on one device; tok_per_s in draft tokens.
    pub pipeline: Phase,
    /// Target tokens per second of the pipeline.
    pub pipeline_target_tok_per_s: f64,
    /// The pipeline's step time over the sum of its two stages' (1.0 = no loss to sharing).
    pub pipeline_efficiency: f64,
    /// The loss with the run-time compiled kernels against libtorch's ops, on one micro-batch of
    /// random drafter outputs: relative differences of the loss and of its gradient (max |diff| /
    /// max |grad|). None where the kernels do not apply.
    pub fused_loss_error: Option<[f64; 2]>,
    /// The device memory the config needs in training, as estimated before anything loaded
    /// (GiB; None where the target's plugin cannot tell).
    pub memory_estimate_gib: Option<f64>,
    /// The estimate by part beside what the bench measured of each (empty without an estimate).
    pub memory: Vec<super::memory::MemoryRow>,
}

pub(super) fn phase(step_s: f64, tokens: f64, flop: f64, ceiling: f64, mem_gib: Option<f64>) -> Phase {
    let tflop_per_s = flop / step_s / 1e12;
    Phase { step_s, tok_per_s: tokens / step_s, flop, tflop_per_s, mfu: tflop_per_s / ceiling, mem_gib }
}

/// The report as a table.
pub fn print(r: &Report) {
    crate::say!(
        "bench train: {} {}, batch {} x {} tokens, {} anchors a sequence, drafter `{}`",
        r.device,
        r.dtype,
        r.batch_size,
        r.seq_len,
        r.anchors_per_seq,
        r.drafter
    );
    crate::say!(
        "matmul ceiling {:.1} TFLOP/s; memory in use once built {}",
        r.ceiling_tflop_per_s,
        gib(r.built_mem_gib)
    );
    crate::say!(
        "{:<26} {:>9} {:>12} {:>10} {:>10} {:>7} {:>10}",
        "phase",
        "s/step",
        "tok/s",
        "TFLOP",
        "TFLOP/s",
        "MFU",
        "mem GiB"
    );
    let row = |name: &str, p: &Phase| {
        crate::say!(
            "{:<26} {:>9.4} {:>12.0} {:>10.2} {:>10.1} {:>6.1}% {:>10}",
            name,
            p.step_s,
            p.tok_per_s,
            p.flop / 1e12,
            p.tflop_per_s,
            100.0 * p.mfu,
            gib(p.mem_gib)
        )
    };
    row("target forward (features)", &r.target_features);
    row("target forward (full)", &r.target_full);
    if let Some(f) = &r.target_full_flop_split {
        let total: f64 = f.values().sum();
        let pct = |part: &str| 100.0 * f.get(part).copied().unwrap_or(0.0) / total;
        crate::say!(
            "  its FLOPs: Gated DeltaNet layers {:.1}%, attention layers {:.1}%, MLPs {:.1}%, LM head {:.1}%",
            pct("gdn"),
            pct("attention"),
            pct("mlp"),
            pct("head")
        );
    }
    let drafter_name = if r.drafter_flop_exact { "drafter step" } else { "drafter step (est. FLOP)" };
    row(drafter_name, &r.drafter_step);
    row("pipeline (draft tok/s)", &r.pipeline);
    crate::say!(
        "pipeline: {:.0} target tok/s, {:.1}% of the bound its two stages set ({:.4} + {:.4} s)",
        r.pipeline_target_tok_per_s,
        100.0 * r.pipeline_efficiency,
        r.target_features.step_s,
        r.drafter_step.step_s
    );
    if r.tensor_parallel > 1 {
        crate::say!("target replica over {} ranks:", r.tensor_parallel);
        crate::say!("{:<6} {:<10} {:>14} {:>14} {:>14}", "rank", "device", "built GiB", "mem GiB", "calls served");
        for f in &r.ranks {
            crate::say!(
                "{:<6} {:<10} {:>14} {:>14} {:>14}",
                f.rank,
                f.device,
                gib(f.built_mem_gib),
                gib(f.mem_gib),
                f.served_calls
            );
        }
    }
    if let Some(total) = r.memory_estimate_gib {
        crate::say!(
            "device memory: estimated {total:.1} GiB in training (the target's forward beside the drafter's step); by part:"
        );
        crate::say!("{:<34} {:>12} {:>12} {:>9}", "part", "estimate GiB", "measured GiB", "ratio");
        for row in &r.memory {
            crate::say!(
                "{:<34} {:>12.2} {:>12} {:>9}",
                row.part,
                row.estimate_gib,
                row.measured_gib.map_or("-".into(), |m| format!("{m:.2}")),
                row.ratio().map_or("-".into(), |x| format!("{x:.3}"))
            );
        }
    }
    match r.fused_loss_error {
        Some([loss, grad]) => crate::say!(
            "loss with the NVRTC kernels vs libtorch's ops: loss {loss:.1e}, gradient {grad:.1e} (relative)"
        ),
        None if r.device != "cpu" => crate::say!("loss: the NVRTC cross-entropy kernels did not run"),
        None => {}
    }
}

fn gib(m: Option<f64>) -> String {
    m.map_or("-".into(), |g| format!("{g:.1}"))
}
