//! The host's own sections: `[train]` (steps, batch shape, loss, schedule, checkpoints) and
//! `[pipeline]` (where the stages run, the hidden-state buffer, capture).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Deserialize, Serialize, plugin_api::Describe)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// Optimizer steps.
    #[describe(range = ">= 1")]
    pub steps: u64,
    /// Micro-batches per optimizer step (gradient accumulation K).
    #[serde(default = "one")]
    #[describe(range = ">= 1")]
    pub grad_accum: u64,
    /// Anchors (blocks) sampled per sequence.
    #[serde(default = "default_anchors")]
    #[describe(range = ">= 1")]
    pub anchors_per_seq: usize,
    /// Loss decay gamma, or "none" for no decay (SpecForge's default); default by block size
    /// (7 for 16, 5 for 10, 4 for 8: the DFlash paper's).
    #[serde(default)]
    #[describe(ty = "float or \"none\"", range = "> 0, or 'none'")]
    pub loss_gamma: Option<LossGamma>,
    /// "global" (default, SpecForge's): one token-weighted mean per optimizer step, the weighted
    /// cross-entropy of every micro-batch on every rank over the weight sum of them all;
    /// "per_micro_batch": each micro-batch's own weighted mean, averaged over micro-batches and
    /// ranks (micro-batches with few labels weigh more).
    #[serde(default)]
    pub loss_normalization: LossNormalization,
    /// Where blocks may start: "response" (default, SpecForge's: the anchor and the next token
    /// are response tokens; a block at the last prompt token is never drafted at inference) or
    /// "before_response" (the next token is a response token, the last prompt token included).
    #[serde(default)]
    pub anchors: AnchorRule,
    /// Share of steps spent warming the learning rate up linearly.
    #[serde(default = "default_warmup")]
    #[describe(range = "in [0, 1]")]
    pub warmup_frac: f64,
    /// Cosine decay floor as a share of the peak learning rate.
    #[serde(default)]
    #[describe(range = "in [0, 1]")]
    pub min_lr_frac: f64,
    /// Global gradient-norm clip (0 = off).
    #[serde(default = "one_f")]
    #[describe(range = ">= 0")]
    pub grad_clip: f64,
    /// Log a metrics line every N steps.
    #[serde(default = "default_log_every")]
    #[describe(range = ">= 1")]
    pub log_every: u64,
    /// Also write each N-th step's own loss, learning rate and gradient norm to TensorBoard
    /// (`train_step/*` tags; 0 = off). The metrics lines (every `log_every`) go there either way.
    #[serde(default)]
    pub tensorboard_every: u64,
    /// Score the drafter on the data's validation split (`validation` in [data]) every N steps
    /// and at the last step, without gradients: `val_loss`, `val_acc`, `val_tau_hat` in that
    /// step's metrics line (and TensorBoard's `validation/`). The same anchors every time and in
    /// every run, whatever its seed. 0 = off.
    #[serde(default)]
    pub eval_every: u64,
    /// Write a checkpoint every N steps (and at the end); 0 = only at the end.
    #[serde(default)]
    pub checkpoint_every: u64,
    /// Checkpoints kept (the newest).
    #[serde(default = "default_keep")]
    #[describe(range = ">= 1")]
    pub keep_checkpoints: usize,
    /// Steps with a non-finite loss or gradient are skipped; this many in a row stop the run.
    #[serde(default = "default_max_nonfinite")]
    #[describe(range = ">= 1")]
    pub max_nonfinite_steps: u64,
    /// CPU memory (MiB) for target features kept across epochs (0 = recompute every epoch).
    #[serde(default = "default_cache_mb")]
    #[describe(range = "<= 1 << 24")]
    pub hidden_cache_mb: usize,
}

/// The loss's decay over block positions: w_k = exp(-(k-1)/gamma), or none (every label 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LossGamma {
    Decay(f64),
    None,
}

impl LossGamma {
    /// The gamma the loss takes (None: no decay).
    pub fn value(self) -> Option<f64> {
        match self {
            Self::Decay(g) => Some(g),
            Self::None => None,
        }
    }
}

impl Serialize for LossGamma {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Decay(g) => s.serialize_f64(*g),
            Self::None => s.serialize_str("none"),
        }
    }
}

impl<'de> Deserialize<'de> for LossGamma {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = LossGamma;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a number > 0 or \"none\"")
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<LossGamma, E> {
                Ok(LossGamma::Decay(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<LossGamma, E> {
                Ok(LossGamma::Decay(v as f64))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<LossGamma, E> {
                Ok(LossGamma::Decay(v as f64))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<LossGamma, E> {
                match v {
                    "none" => Ok(LossGamma::None),
                    _ => Err(E::invalid_value(serde::de::Unexpected::Str(v), &self)),
                }
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize, plugin_api::Describe)]
#[serde(rename_all = "snake_case")]
pub enum LossNormalization {
    #[default]
    Global,
    PerMicroBatch,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize, plugin_api::Describe)]
#[serde(rename_all = "snake_case")]
pub enum AnchorRule {
    #[default]
    Response,
    BeforeResponse,
}

/// As the config writes it (`global`, `before_response`), for logs.
impl std::fmt::Display for LossNormalization {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LossNormalization::Global => "global",
            LossNormalization::PerMicroBatch => "per_micro_batch",
        })
    }
}

impl std::fmt::Display for AnchorRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AnchorRule::Response => "response",
            AnchorRule::BeforeResponse => "before_response",
        })
    }
}

fn one() -> u64 {
    1
}
fn one_f() -> f64 {
    1.0
}
fn default_anchors() -> usize {
    512
}
fn default_warmup() -> f64 {
    0.04
}
fn default_log_every() -> u64 {
    10
}
fn default_keep() -> usize {
    2
}
fn default_max_nonfinite() -> u64 {
    10
}
fn default_cache_mb() -> usize {
    2048
}

/// The pipeline: target workers (one thread per entry), the drafter's device, the hidden-state
/// buffer between them, or a capture to read features from instead of running the target.
#[derive(Debug, Clone, Deserialize, Serialize, Default, plugin_api::Describe)]
#[serde(deny_unknown_fields)]
pub struct PipelineConfig {
    /// Devices of the target workers, e.g. `["cuda:0", "cuda:1", "cuda:2"]` (default: [device]).
    #[serde(default)]
    pub targets: Vec<String>,
    /// The drafter's device (default: `device`).
    #[serde(default)]
    pub drafter: Option<String>,
    /// Hidden-state buffer cap in MiB (CPU memory; backpressure on the targets when full).
    #[serde(default)]
    pub buffer_mb: Option<usize>,
    /// Batches reach the drafter in data order whatever the workers' timing (exact resume, A/B).
    /// Default true; false lets a fast worker's batch overtake a slow one's.
    #[serde(default)]
    pub deterministic: Option<bool>,
    /// Read target features from a `dflash-host capture` folder instead of running the target.
    #[serde(default)]
    pub capture: Option<String>,
}

impl PipelineConfig {
    pub const DEFAULT_BUFFER_MB: usize = 1024;

    pub fn buffer_bytes(&self) -> usize {
        self.buffer_mb.unwrap_or(Self::DEFAULT_BUFFER_MB) << 20
    }

    pub fn deterministic(&self) -> bool {
        self.deterministic.unwrap_or(true)
    }
}
