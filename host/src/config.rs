//! The run config: one TOML file. Host settings are typed here (`deny_unknown_fields`); each
//! plugin section names its plugin (`plugin = "adamw"`) and the rest of the section is that
//! plugin's own config, which the plugin parses and validates.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// Experiment name: the folder under `experiments/`.
    pub name: String,
    /// Seed of the drafter's initial weights, the data order and the anchor draws.
    #[serde(default)]
    pub seed: u64,
    /// `cpu`, `cuda` (= `cuda:0`) or `cuda:N`.
    #[serde(default = "default_device")]
    pub device: String,
    /// `f32` or `bf16`; default f32 on CPU, bf16 on CUDA.
    #[serde(default)]
    pub dtype: Option<String>,
    pub train: TrainConfig,
    /// Where the stages run and how they connect (default: everything on `device`).
    #[serde(default)]
    pub pipeline: PipelineConfig,
    pub target: toml::Table,
    pub drafter: toml::Table,
    pub optimizer: toml::Table,
    pub data: toml::Table,
    /// The `--set` / `--device` arguments applied, by dotted key (errors about a field one of
    /// them set name the argument instead of the file's line).
    #[serde(skip)]
    pub overrides: Vec<Override>,
}

/// One command-line change to the config: `--set train.steps=400` or `--device cuda:1`.
#[derive(Debug, Clone, PartialEq)]
pub struct Override {
    /// The argument as typed, for errors.
    pub arg: String,
    /// Dotted key, e.g. `optimizer.lr`.
    pub key: String,
    pub value: toml::Value,
}

impl Override {
    /// `KEY=VALUE`: VALUE is read as a TOML value (`400`, `1e-3`, `true`, `["cuda:0", "cuda:1"]`,
    /// `"text"`); anything that is not one is a string, so `--set name=run-2` needs no quotes.
    pub fn parse_set(arg: &str) -> Result<Self> {
        let shown = format!("--set {arg}");
        let Some((key, raw)) = arg.split_once('=') else { bail!("{shown}: expected KEY=VALUE, e.g. train.steps=400") };
        let key = key.trim();
        if key.is_empty() || key.split('.').any(|p| p.trim().is_empty()) {
            bail!("{shown}: `{key}` is not a dotted field name (e.g. optimizer.lr)");
        }
        let raw = raw.trim();
        let value = match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
            Ok(mut t) => t.remove("v").expect("parsed `v`"),
            Err(_) => toml::Value::String(raw.to_string()),
        };
        Ok(Self { arg: shown, key: key.split('.').map(str::trim).collect::<Vec<_>>().join("."), value })
    }

    /// The command line's `--set KEY=VALUE` arguments, then `--device`, in the order applied.
    pub fn from_args(set: &[String], device: Option<&str>) -> Result<Vec<Self>> {
        let mut all = set.iter().map(|s| Self::parse_set(s)).collect::<Result<Vec<_>>>()?;
        all.extend(device.map(Self::device));
        Ok(all)
    }

    /// `--device DEVICE`: the run's `device`.
    pub fn device(device: &str) -> Self {
        Self { arg: format!("--device {device}"), key: "device".into(), value: toml::Value::String(device.into()) }
    }

    /// Set the value in the config's TOML table, creating the tables on the way.
    fn apply(&self, table: &mut toml::Table) -> Result<()> {
        let parts: Vec<&str> = self.key.split('.').collect();
        let mut t = table;
        for (i, p) in parts[..parts.len() - 1].iter().enumerate() {
            let entry = t.entry(p.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
            t = match entry {
                toml::Value::Table(inner) => inner,
                _ => bail!("{}: field `{}` is not a section", self.arg, parts[..=i].join(".")),
            };
        }
        t.insert(parts[parts.len() - 1].to_string(), self.value.clone());
        Ok(())
    }

    /// This override set the field an error message names (`field `lr``, `unknown field `lr``
    /// in `[optimizer]`, or `field `train.steps``).
    pub fn names_field_of(&self, message: &str) -> bool {
        let section = message.strip_prefix('[').and_then(|r| r.split(']').next());
        ["unknown field `", "field `"].iter().any(|p| {
            message.match_indices(p).any(|(at, _)| {
                let field = message[at + p.len()..].split('`').next().unwrap_or("");
                field == self.key || section.is_some_and(|s| format!("{s}.{field}") == self.key)
            })
        })
    }
}

fn default_device() -> String {
    "cpu".into()
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// Optimizer steps.
    pub steps: u64,
    /// Micro-batches per optimizer step (gradient accumulation K).
    #[serde(default = "one")]
    pub grad_accum: u64,
    /// Anchors (blocks) sampled per sequence.
    #[serde(default = "default_anchors")]
    pub anchors_per_seq: usize,
    /// Loss decay gamma, or "none" for no decay (SpecForge's default); default by block size
    /// (7 for 16, 5 for 10, 4 for 8: the DFlash paper's).
    #[serde(default)]
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
    pub warmup_frac: f64,
    /// Cosine decay floor as a share of the peak learning rate.
    #[serde(default)]
    pub min_lr_frac: f64,
    /// Global gradient-norm clip (0 = off).
    #[serde(default = "one_f")]
    pub grad_clip: f64,
    /// Log a metrics line every N steps.
    #[serde(default = "default_log_every")]
    pub log_every: u64,
    /// Write a checkpoint every N steps (and at the end); 0 = only at the end.
    #[serde(default)]
    pub checkpoint_every: u64,
    /// Checkpoints kept (the newest).
    #[serde(default = "default_keep")]
    pub keep_checkpoints: usize,
    /// Steps with a non-finite loss or gradient are skipped; this many in a row stop the run.
    #[serde(default = "default_max_nonfinite")]
    pub max_nonfinite_steps: u64,
    /// CPU memory (MiB) for target features kept across epochs (0 = recompute every epoch).
    #[serde(default = "default_cache_mb")]
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LossNormalization {
    #[default]
    Global,
    PerMicroBatch,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AnchorRule {
    #[default]
    Response,
    BeforeResponse,
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
#[derive(Debug, Clone, Deserialize, Serialize, Default)]
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

/// A plugin section: which plugin, and its own config as TOML text.
#[derive(Debug, Clone)]
pub struct PluginSection {
    pub kind: &'static str,
    pub plugin: String,
    pub config_toml: String,
}

impl RunConfig {
    pub fn load(path: &Path) -> Result<Self> {
        Self::load_with(path, &[])
    }

    /// The config file with command-line overrides applied before it is typed and validated.
    pub fn load_with(path: &Path, overrides: &[Override]) -> Result<Self> {
        let text = input_files::read_to_string_capped(path, MAX_CONFIG_BYTES).context("reading config")?;
        Self::from_toml_with(path, &text, overrides)
    }

    /// Parse and validate config text; `path` only names the file in errors (`file:line:col`).
    pub fn from_toml(path: &Path, text: &str) -> Result<Self> {
        Self::from_toml_with(path, text, &[])
    }

    /// As [`RunConfig::from_toml`], with `overrides` set in the TOML first: they are type-checked
    /// exactly as the file's own values, and an error caused by one names that argument.
    pub fn from_toml_with(path: &Path, text: &str, overrides: &[Override]) -> Result<Self> {
        let file_error = |e: toml::de::Error| anyhow::anyhow!("{}", toml_error(path, text, &e));
        let mut cfg: RunConfig = if overrides.is_empty() {
            toml::from_str(text).map_err(file_error)?
        } else {
            let base: toml::Table = toml::from_str(text).map_err(file_error)?;
            let mut table = base.clone();
            for o in overrides {
                o.apply(&mut table)?;
            }
            match toml::Value::Table(table).try_into::<RunConfig>() {
                Ok(cfg) => cfg,
                Err(e) => {
                    // The file's own error keeps its line; else the first override that breaks it.
                    toml::from_str::<RunConfig>(text).map_err(file_error)?;
                    let mut table = base;
                    for o in overrides {
                        o.apply(&mut table)?;
                        if let Err(e) = toml::Value::Table(table.clone()).try_into::<RunConfig>() {
                            bail!("{}: field `{}`: {}", o.arg, o.key, e.message().trim());
                        }
                    }
                    bail!("{}: {}", path.display(), e.message().trim())
                }
            }
        };
        cfg.overrides = overrides.to_vec();
        // `cuda` is the first GPU, as in torch.
        for d in std::iter::once(&mut cfg.device).chain(cfg.pipeline.targets.iter_mut()).chain(cfg.pipeline.drafter.iter_mut()) {
            if d == "cuda" {
                *d = "cuda:0".into();
            }
        }
        cfg.validate().map_err(|e| anyhow::anyhow!("{}: {e}", cfg.blame(path, &e.to_string())))?;
        Ok(cfg)
    }

    /// What an error about the config names as its source: the `--set` / `--device` argument
    /// that set the field it names, else the file.
    pub fn blame(&self, path: &Path, message: &str) -> String {
        match self.overrides.iter().rev().find(|o| o.names_field_of(message)) {
            Some(o) => o.arg.clone(),
            None => path.display().to_string(),
        }
    }

    pub fn validate(&self) -> Result<()> {
        validate_name(&self.name)?;
        validate_device("device", &self.device)?;
        for (i, d) in self.pipeline.targets.iter().enumerate() {
            validate_device(&format!("pipeline.targets[{i}]"), d)?;
        }
        if let Some(d) = &self.pipeline.drafter {
            validate_device("pipeline.drafter", d)?;
        }
        if let Some(mb) = self.pipeline.buffer_mb {
            if !(1..=MAX_MB).contains(&mb) {
                bail!("field `pipeline.buffer_mb`: out of range: {mb} (must be in 1..={MAX_MB})");
            }
        }
        if let Some(d) = &self.dtype {
            if d != "f32" && d != "bf16" {
                bail!("field `dtype`: expected `f32` or `bf16`, got `{d}`");
            }
        }
        let t = &self.train;
        let range = |field: &str, ok: bool, v: String| -> Result<()> {
            if ok {
                Ok(())
            } else {
                bail!("field `train.{field}`: out of range: {v}")
            }
        };
        range("steps", t.steps >= 1, format!("{} (must be >= 1)", t.steps))?;
        range("grad_accum", t.grad_accum >= 1, format!("{} (must be >= 1)", t.grad_accum))?;
        range("steps", t.steps <= MAX_STEPS, format!("{} (must be <= {MAX_STEPS})", t.steps))?;
        let micro = t.steps.checked_mul(t.grad_accum).filter(|&m| m <= MAX_STEPS);
        range("grad_accum", micro.is_some(), format!("{} (steps x grad_accum must be <= {MAX_STEPS})", t.grad_accum))?;
        range("anchors_per_seq", t.anchors_per_seq >= 1, format!("{} (must be >= 1)", t.anchors_per_seq))?;
        range("warmup_frac", (0.0..=1.0).contains(&t.warmup_frac), format!("{} (must be in [0, 1])", t.warmup_frac))?;
        range("min_lr_frac", (0.0..=1.0).contains(&t.min_lr_frac), format!("{} (must be in [0, 1])", t.min_lr_frac))?;
        range("grad_clip", t.grad_clip >= 0.0, format!("{} (must be >= 0)", t.grad_clip))?;
        range("log_every", t.log_every >= 1, format!("{} (must be >= 1)", t.log_every))?;
        range("keep_checkpoints", t.keep_checkpoints >= 1, format!("{} (must be >= 1)", t.keep_checkpoints))?;
        range("max_nonfinite_steps", t.max_nonfinite_steps >= 1, format!("{} (must be >= 1)", t.max_nonfinite_steps))?;
        range("hidden_cache_mb", t.hidden_cache_mb <= MAX_MB, format!("{} (must be <= {MAX_MB})", t.hidden_cache_mb))?;
        if let Some(LossGamma::Decay(g)) = t.loss_gamma {
            range("loss_gamma", g > 0.0 && g.is_finite(), format!("{g} (must be > 0, or \"none\")"))?;
        }
        for (kind, table) in self.sections() {
            match table.get("plugin") {
                Some(toml::Value::String(_)) => {}
                Some(_) => bail!("field `{kind}.plugin`: expected a string (the plugin's name)"),
                None => bail!("section [{kind}]: missing field `plugin` (the plugin's name, e.g. plugin = \"{}\")", default_plugin(kind)),
            }
        }
        Ok(())
    }

    /// The devices the target workers run on.
    pub fn target_devices(&self) -> Vec<String> {
        if self.pipeline.targets.is_empty() {
            vec![self.device.clone()]
        } else {
            self.pipeline.targets.clone()
        }
    }

    pub fn drafter_device(&self) -> &str {
        self.pipeline.drafter.as_deref().unwrap_or(&self.device)
    }

    pub fn dtype(&self) -> &str {
        match &self.dtype {
            Some(d) => d,
            None if self.drafter_device() == "cpu" => "f32",
            None => "bf16",
        }
    }

    /// The plugin sections by kind: `target`, `drafter`, `optimizer`, `data`.
    pub fn plugin_sections(&self) -> [(&'static str, &toml::Table); 4] {
        self.sections()
    }

    fn sections(&self) -> [(&'static str, &toml::Table); 4] {
        [("target", &self.target), ("drafter", &self.drafter), ("optimizer", &self.optimizer), ("data", &self.data)]
    }

    /// The plugin section of `kind`: its plugin name and the rest as TOML text.
    pub fn section(&self, kind: &str) -> PluginSection {
        let (kind, table) = self.sections().into_iter().find(|(k, _)| *k == kind).expect("known section");
        let mut rest = table.clone();
        let plugin = match rest.remove("plugin") {
            Some(toml::Value::String(s)) => s,
            _ => unreachable!("validated"),
        };
        PluginSection { kind, plugin, config_toml: toml::to_string(&rest).expect("table serializes") }
    }
}

/// `cpu`, `cuda` (= `cuda:0`) or `cuda:N` as a tch device.
pub fn parse_device(d: &str) -> Result<plugin_api::tch::Device> {
    match d {
        "cpu" => Ok(plugin_api::tch::Device::Cpu),
        "cuda" => Ok(plugin_api::tch::Device::Cuda(0)),
        _ => match d.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
            Some(n) => Ok(plugin_api::tch::Device::Cuda(n)),
            None => bail!("device `{d}`: expected `cpu` or `cuda:N`"),
        },
    }
}

fn validate_device(field: &str, d: &str) -> Result<()> {
    if d != "cpu" && !d.strip_prefix("cuda:").is_some_and(|n| n.parse::<u32>().is_ok()) {
        bail!("field `{field}`: expected `cpu`, `cuda` or `cuda:N`, got `{d}`");
    }
    Ok(())
}

/// A config is a few KB; a larger file is not one (and is refused before it is read).
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Most optimizer steps (and micro-batches: steps x grad_accum) a run may ask for: counters and
/// micro-batch numbers must never wrap (2^40, beyond any real schedule).
pub const MAX_STEPS: u64 = 1 << 40;

/// Largest MiB setting (16 TiB): sizes are turned into bytes with `<< 20`, which must not wrap.
const MAX_MB: usize = 1 << 24;

fn default_plugin(kind: &str) -> &'static str {
    match kind {
        "target" => "hf",
        "drafter" => "dflash",
        "optimizer" => "adamw",
        _ => "chat",
    }
}

/// Experiment names become folder names: refuse anything that could escape `experiments/`.
pub fn validate_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name != "."
        && name != ".."
        && name.len() <= 128
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        && !name.starts_with('.');
    if !ok {
        bail!("field `name`: `{name}` is not a valid experiment name (use letters, digits, `-`, `_`, `.`; no path separators or leading dot)");
    }
    Ok(())
}

/// A TOML parse error as `file:line:col: message`.
pub fn toml_error(path: &Path, text: &str, e: &toml::de::Error) -> String {
    match e.span() {
        Some(span) => {
            let (line, col) = line_col(text, span.start);
            format!("{}:{line}:{col}: {}", path.display(), e.message())
        }
        None => format!("{}: {}", path.display(), e.message()),
    }
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
    (line, col)
}

/// Where `key` is set inside `[section]` of the config text (1-based line), to point plugin
/// errors at the file.
pub fn locate_key(text: &str, section: &str, key: &str) -> Option<usize> {
    let mut current = String::new();
    for (i, line) in text.lines().enumerate() {
        let l = line.trim();
        if let Some(name) = l.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
            current = name.trim().to_string();
        } else if current == section {
            if let Some((k, _)) = l.split_once('=') {
                if k.trim() == key {
                    return Some(i + 1);
                }
            }
        }
    }
    None
}

/// For a plugin error like "[optimizer] plugin `adamw`: unknown field `lrr`, ...", the config
/// line that set the field, if any.
pub fn locate_plugin_error(text: &str, message: &str) -> Option<usize> {
    let section = message.strip_prefix('[')?.split(']').next()?;
    let field = ["unknown field `", "field `"].iter().find_map(|p| {
        let rest = &message[message.find(p)? + p.len()..];
        rest.split('`').next()
    })?;
    locate_key(text, section, field).or_else(|| {
        // A missing field has no line: point at the section header instead.
        text.lines().position(|l| l.trim() == format!("[{section}]")).map(|i| i + 1)
    })
}

/// `config_dir` for relative paths in plugin sections.
pub fn config_dir(path: &Path) -> PathBuf {
    path.parent().map(Path::to_path_buf).filter(|p| !p.as_os_str().is_empty()).unwrap_or_else(|| PathBuf::from("."))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
name = "t"
[train]
steps = 3
[target]
plugin = "hf"
path = "x.gguf"
[drafter]
plugin = "dflash"
[optimizer]
plugin = "adamw"
lr = 1e-3
[data]
plugin = "chat"
"#;

    fn parse(text: &str) -> Result<RunConfig> {
        let p = Path::new("cfg.toml");
        let cfg: RunConfig = toml::from_str(text).map_err(|e| anyhow::anyhow!("{}", toml_error(p, text, &e)))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// gamma is a number or "none"; the loss's normalisation and the anchor rule are named
    /// choices; all three survive the resolved config.toml a run writes and resumes from.
    #[test]
    fn loss_settings_parse_and_round_trip() {
        let cfg = parse(GOOD).unwrap();
        let t = &cfg.train;
        assert_eq!((t.loss_gamma, t.loss_normalization, t.anchors), (None, LossNormalization::Global, AnchorRule::Response));
        let set = |lines: &str| GOOD.replace("steps = 3", &format!("steps = 3\n{lines}"));
        let cfg = parse(&set("loss_gamma = \"none\"\nloss_normalization = \"per_micro_batch\"\nanchors = \"before_response\"")).unwrap();
        let again = parse(&toml::to_string(&cfg).unwrap()).unwrap();
        for t in [&cfg.train, &again.train] {
            assert_eq!((t.loss_gamma, t.loss_normalization, t.anchors), (Some(LossGamma::None), LossNormalization::PerMicroBatch, AnchorRule::BeforeResponse));
        }
        assert_eq!(parse(&set("loss_gamma = 7")).unwrap().train.loss_gamma, Some(LossGamma::Decay(7.0)));
        for (line, want) in [
            ("loss_gamma = \"off\"", "expected a number > 0 or \"none\""),
            ("loss_gamma = 0.0", "field `train.loss_gamma`"),
            ("loss_normalization = \"mean\"", "unknown variant `mean`"),
            ("anchors = \"all\"", "unknown variant `all`"),
        ] {
            let e = parse(&set(line)).unwrap_err().to_string();
            assert!(e.contains(want), "{line}: {e}");
        }
    }

    #[test]
    fn overrides_are_typed_like_the_file_and_errors_name_them() {
        let with = |args: &[&str]| {
            let o: Vec<Override> = args.iter().map(|a| Override::parse_set(a).unwrap()).collect();
            RunConfig::from_toml_with(Path::new("cfg.toml"), GOOD, &o)
        };
        let cfg = with(&["train.steps=400", "optimizer.lr=1e-3", "name=run-2", "pipeline.targets=[\"cpu\", \"cpu\"]", "data.fields.role=who"]).unwrap();
        assert_eq!((cfg.train.steps, cfg.name.as_str(), cfg.target_devices().len()), (400, "run-2", 2));
        assert_eq!(cfg.section("optimizer").config_toml.trim(), "lr = 0.001");
        assert_eq!(cfg.data["fields"]["role"].as_str(), Some("who"));
        // The resolved config (what the experiment records) holds the overrides.
        assert!(toml::to_string(&cfg).unwrap().contains("steps = 400"));
        for (args, want) in [
            (&["train.steps=many"][..], "--set train.steps=many: field `train.steps`: invalid type"),
            (&["train.stepz=1"][..], "--set train.stepz=1: field `train.stepz`: unknown field `stepz`"),
            (&["train.steps=0"][..], "--set train.steps=0: field `train.steps`: out of range"),
            (&["optimizer.lr=1", "train.steps.x=1"][..], "--set train.steps.x=1: field `train.steps` is not a section"),
        ] {
            let e = with(args).unwrap_err().to_string();
            assert!(e.starts_with(want), "{args:?}: {e}");
        }
        let e = RunConfig::from_toml_with(Path::new("cfg.toml"), GOOD, &[Override::device("cuda:x")]).unwrap_err().to_string();
        assert!(e.starts_with("--device cuda:x: field `device`"), "{e}");
        assert_eq!(RunConfig::from_toml_with(Path::new("cfg.toml"), GOOD, &[Override::device("cuda")]).unwrap().device, "cuda:0");
        assert!(Override::parse_set("steps").is_err() && Override::parse_set("a..b=1").is_err());
        // The file's own mistake keeps its line though an override is given.
        let e = RunConfig::from_toml_with(Path::new("cfg.toml"), &GOOD.replace("steps = 3", "steps = \"x\""), &[Override::device("cpu")]);
        assert!(e.unwrap_err().to_string().starts_with("cfg.toml:4:"));
    }

    #[test]
    fn good_config_parses_and_splits_sections() {
        let cfg = parse(GOOD).unwrap();
        let opt = cfg.section("optimizer");
        assert_eq!(opt.plugin, "adamw");
        assert_eq!(opt.config_toml.trim(), "lr = 0.001");
        assert_eq!(cfg.dtype(), "f32");
    }

    #[test]
    fn cuda_means_the_first_gpu() {
        let text = GOOD.replacen("name = ", "device = \"cuda\"\nname = ", 1);
        let cfg = RunConfig::from_toml(Path::new("cfg.toml"), &text).unwrap();
        assert_eq!((cfg.device.as_str(), cfg.target_devices(), cfg.drafter_device()), ("cuda:0", vec!["cuda:0".to_string()], "cuda:0"));
        assert_eq!(parse_device("cuda").unwrap(), plugin_api::tch::Device::Cuda(0));
        let err = RunConfig::from_toml(Path::new("cfg.toml"), &text.replace("\"cuda\"", "\"gpu\"")).unwrap_err().to_string();
        assert!(err.contains("expected `cpu`, `cuda` or `cuda:N`, got `gpu`"), "{err}");
    }

    #[test]
    fn unknown_field_is_named_with_its_line() {
        let text = GOOD.replace("steps = 3", "steps = 3\nstepz = 4");
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.contains("cfg.toml:5:") && err.contains("unknown field `stepz`"), "{err}");
    }

    #[test]
    fn wrong_type_and_out_of_range_are_named() {
        let err = parse(&GOOD.replace("steps = 3", "steps = \"many\"")).unwrap_err().to_string();
        assert!(err.contains("cfg.toml:4:") && err.contains("invalid type"), "{err}");
        let err = parse(&GOOD.replace("steps = 3", "steps = 3\nwarmup_frac = 1.5")).unwrap_err().to_string();
        assert!(err.contains("train.warmup_frac") && err.contains("1.5"), "{err}");
    }

    #[test]
    fn missing_plugin_name_and_bad_experiment_names_are_refused() {
        let err = parse(&GOOD.replace("plugin = \"adamw\"\n", "")).unwrap_err().to_string();
        assert!(err.contains("[optimizer]") && err.contains("plugin"), "{err}");
        for bad in ["../x", "a/b", "..", ".hidden", ""] {
            assert!(validate_name(bad).is_err(), "{bad}");
        }
        validate_name("smollm2-chitchat_v1.2").unwrap();
    }

    #[test]
    fn a_missing_or_non_utf8_config_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.toml");
        let err = format!("{:#}", RunConfig::load(&missing).unwrap_err());
        assert!(err.contains("nope.toml: no such file"), "{err}");
        let bad = dir.path().join("latin1.toml");
        std::fs::write(&bad, b"name = \"caf\xe9\"\n").unwrap();
        let err = format!("{:#}", RunConfig::load(&bad).unwrap_err());
        assert!(err.contains("latin1.toml") && err.contains("UTF-8"), "{err}");
    }

    #[test]
    fn wrong_types_in_nested_sections_name_the_line() {
        let text = GOOD.replace("steps = 3", "steps = 3\n[pipeline]\ntargets = \"cuda:0\"");
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.contains("cfg.toml:6:") && err.contains("invalid type"), "{err}");
        let err = parse(&GOOD.replace("name = \"t\"", "name = 5")).unwrap_err().to_string();
        assert!(err.contains("cfg.toml:2:") && err.contains("invalid type"), "{err}");
        let err = parse(&GOOD.replace("name = \"t\"\n", "")).unwrap_err().to_string();
        assert!(err.contains("missing field `name`"), "{err}");
    }

    #[test]
    fn mib_sizes_that_would_wrap_are_out_of_range() {
        // 2^44 MiB << 20 is 2^64: the byte count would wrap to 0.
        let text = GOOD.replace("steps = 3", "steps = 3\n[pipeline]\nbuffer_mb = 17592186044416");
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.contains("pipeline.buffer_mb") && err.contains("17592186044416"), "{err}");
        let text = GOOD.replace("steps = 3", "steps = 3\nhidden_cache_mb = 17592186044416");
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.contains("train.hidden_cache_mb"), "{err}");
        parse(&GOOD.replace("steps = 3", "steps = 3\nhidden_cache_mb = 0")).unwrap();
    }

    #[test]
    fn step_counts_that_would_wrap_are_out_of_range() {
        // 2^63 steps x 2 micro-batches wrapped to 0 micro-batches: "pipeline ended before step 1".
        let text = GOOD.replace("steps = 3", "steps = 9223372036854775807\ngrad_accum = 2");
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.contains("train.steps") && err.contains("9223372036854775807"), "{err}");
        let text = GOOD.replace("steps = 3", "steps = 1099511627776\ngrad_accum = 2");
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.contains("train.grad_accum") && err.contains("steps x grad_accum"), "{err}");
        parse(&GOOD.replace("steps = 3", "steps = 549755813888\ngrad_accum = 2")).unwrap();
    }

    #[test]
    fn a_fifo_or_device_as_config_is_refused_without_blocking() {
        let err = format!("{:#}", RunConfig::load(Path::new("/dev/zero")).unwrap_err());
        assert!(err.contains("/dev/zero: not a regular file (a character device)"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("big.toml");
        std::fs::write(&big, vec![b'#'; (MAX_CONFIG_BYTES + 1) as usize]).unwrap();
        let err = format!("{:#}", RunConfig::load(&big).unwrap_err());
        assert!(err.contains("big.toml") && err.contains("more than the 1048576 bytes allowed"), "{err}");
    }

    #[test]
    fn experiment_names_that_could_leave_experiments_are_refused() {
        for bad in ["a/b", "/abs", "a\\b", "..", "../up", "x/../y", ".", ".hidden", "a b", "nul\0", "é", ""] {
            let text = GOOD.replace("name = \"t\"", &format!("name = {}", toml::Value::from(bad)));
            let err = parse(&text).unwrap_err().to_string();
            assert!(err.contains("field `name`") && err.contains("not a valid experiment name"), "{bad:?}: {err}");
        }
        let long = "x".repeat(129);
        assert!(validate_name(&long).is_err());
        for ok in ["t", "run-1", "a.b_c", "x".repeat(128).as_str()] {
            validate_name(ok).unwrap();
        }
    }

    #[test]
    fn keys_are_located_in_their_section() {
        assert_eq!(locate_key(GOOD, "optimizer", "lr"), Some(12));
        assert_eq!(locate_key(GOOD, "target", "lr"), None);
        let msg = "[optimizer] plugin `adamw`: field `lr`: must be > 0, got -1";
        assert_eq!(locate_plugin_error(GOOD, msg), Some(12));
        let msg = "[data] plugin `chat`: unknown field `pth`, expected one of `path`";
        assert_eq!(locate_plugin_error(GOOD, msg), Some(13));
    }

    /// Fuzzing `RunConfig::from_toml` (and each plugin's parse of its section): mutated
    /// configs must give `Ok` or an error naming the file, never a panic.
    mod fuzz {
        use super::*;
        use proptest::prelude::*;
        use proptest::test_runner::{Config, TestRunner};

        /// Every host field and a few plugin fields set, so mutations reach each of them.
        const FULL: &str = r#"name = "fuzz"
seed = 7
device = "cpu"
dtype = "f32"

[train]
steps = 10
grad_accum = 2
anchors_per_seq = 8
loss_gamma = 4.0
loss_normalization = "per_micro_batch"
anchors = "before_response"
warmup_frac = 0.1
min_lr_frac = 0.1
grad_clip = 1.0
log_every = 1
checkpoint_every = 5
keep_checkpoints = 2
max_nonfinite_steps = 3
hidden_cache_mb = 16

[pipeline]
targets = ["cpu", "cuda:1"]
drafter = "cpu"
buffer_mb = 64
deterministic = true
capture = "cap"

[target]
plugin = "hf"
path = "model.gguf"
generate_batch_size = 4

[drafter]
plugin = "dflash"
num_hidden_layers = 1
block_size = 4
target_layer_ids = [1, 2]
mask_token_id = 0

[optimizer]
plugin = "adamw"
lr = 1e-3
weight_decay = 0.0

[data]
plugin = "chat"
path = "chat.jsonl"
format = "jsonl"
batch_size = 2
max_len = 64
on_error = "skip"
"#;

        const KEYS: &[&str] = &[
            "name", "seed", "device", "dtype", "steps", "grad_accum", "anchors_per_seq", "loss_gamma", "loss_normalization", "anchors",
            "warmup_frac", "min_lr_frac", "grad_clip", "log_every", "checkpoint_every", "keep_checkpoints",
            "max_nonfinite_steps", "hidden_cache_mb", "targets", "drafter", "buffer_mb", "deterministic",
            "capture", "plugin", "path", "generate_batch_size", "num_hidden_layers", "block_size",
            "target_layer_ids", "mask_token_id", "lr", "weight_decay", "format", "batch_size", "max_len",
            "on_error",
        ];

        #[derive(Debug, Clone)]
        enum Mutation {
            /// XOR one byte (position as a share of the length).
            Flip(f64, u8),
            Truncate(f64),
            /// Insert a line before line `i % lines`.
            InsertLine(usize, String),
            DeleteLine(usize),
            DuplicateLine(usize),
            /// Every `KEYS[k] = ...` line gets this value instead.
            SetKey(usize, String),
        }

        /// TOML values, well-formed or not, of every type and none.
        fn value() -> impl Strategy<Value = String> {
            prop_oneof![
                any::<i64>().prop_map(|v| v.to_string()),
                any::<u64>().prop_map(|v| v.to_string()),
                any::<f64>().prop_map(|v| format!("{v:?}")),
                prop::sample::select(vec!["nan", "inf", "-inf", "-0", "1e999", "0", "0.0", "-1.0", "1.5"]).prop_map(str::to_string),
                "[ -~]{0,12}".prop_map(|s| toml::Value::from(s).to_string()),
                prop::sample::select(vec!["\"../x\"", "\"a/b\"", "\"cuda:\"", "\"cuda:99999999999\"", "\"bf16\"", "\"\""])
                    .prop_map(str::to_string),
                any::<bool>().prop_map(|v| v.to_string()),
                prop::collection::vec(any::<i32>(), 0..4).prop_map(|v| format!("{v:?}")),
                Just("[\"cpu\", 1, [2]]".to_string()),
                Just("{ a = 1, b = { c = \"d\" } }".to_string()),
                Just("1979-05-27T07:32:00Z".to_string()),
                "[^\n]{0,16}",
            ]
        }

        fn junk_line() -> impl Strategy<Value = String> {
            prop_oneof![
                prop::sample::select(vec![
                    "[train]", "[[train]]", "[pipeline.x]", "[data.extra]", "[]", "[", "= 1", "x =", "\"k\" = 1",
                    "name = \"dup\"", "a.b.c = 1", "[target]", "plugin = 3", "plugin = \"nope\"", "'''", "\"\"\"",
                    "# comment", "\u{feff}", "\t", "steps = 1\r",
                ])
                .prop_map(str::to_string),
                (prop::sample::select(KEYS.to_vec()), value()).prop_map(|(k, v)| format!("{k} = {v}")),
                "[^\n]{0,24}",
            ]
        }

        fn mutation() -> impl Strategy<Value = Mutation> {
            prop_oneof![
                (0.0..1.0f64, 1..=255u8).prop_map(|(at, x)| Mutation::Flip(at, x)),
                (0.0..1.0f64).prop_map(Mutation::Truncate),
                (any::<usize>(), junk_line()).prop_map(|(i, l)| Mutation::InsertLine(i, l)),
                any::<usize>().prop_map(Mutation::DeleteLine),
                any::<usize>().prop_map(Mutation::DuplicateLine),
                (0..KEYS.len(), value()).prop_map(|(k, v)| Mutation::SetKey(k, v)),
                (0..KEYS.len(), value()).prop_map(|(k, v)| Mutation::SetKey(k, v)),
            ]
        }

        fn apply(text: &str, mutations: &[Mutation]) -> Vec<u8> {
            let mut bytes = text.as_bytes().to_vec();
            let at = |share: f64, len: usize| ((share * len as f64) as usize).min(len.saturating_sub(1));
            for m in mutations {
                match m {
                    Mutation::Flip(share, x) => {
                        if !bytes.is_empty() {
                            let i = at(*share, bytes.len());
                            bytes[i] ^= x;
                        }
                        continue;
                    }
                    Mutation::Truncate(share) => {
                        bytes.truncate(at(*share, bytes.len()));
                        continue;
                    }
                    _ => {}
                }
                let mut lines: Vec<Vec<u8>> = bytes.split(|&b| b == b'\n').map(<[u8]>::to_vec).collect();
                let n = lines.len();
                match m {
                    Mutation::InsertLine(i, l) => lines.insert(i % (n + 1), l.clone().into_bytes()),
                    Mutation::DeleteLine(i) => {
                        lines.remove(i % n);
                    }
                    Mutation::DuplicateLine(i) => {
                        let l = lines[i % n].clone();
                        lines.insert(i % n, l);
                    }
                    Mutation::SetKey(k, v) => {
                        let prefix = format!("{} =", KEYS[*k]);
                        for l in lines.iter_mut().filter(|l| l.starts_with(prefix.as_bytes())) {
                            *l = format!("{prefix} {v}").into_bytes();
                        }
                    }
                    Mutation::Flip(..) | Mutation::Truncate(_) => unreachable!("handled above"),
                }
                bytes = lines.join(&b'\n');
            }
            bytes
        }

        /// The number of cases: `DFLASH_FUZZ_CASES` or `default`.
        fn cases(default: u32) -> u32 {
            std::env::var("DFLASH_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
        }

        #[test]
        fn mutated_configs_parse_or_fail_naming_the_file_never_panic() {
            let path = Path::new("fuzz.toml");
            // The unmutated config is valid: mutations start from a config that parses.
            let cfg = RunConfig::from_toml(path, FULL).unwrap();
            assert_eq!((cfg.train.steps, cfg.target_devices().len(), cfg.dtype()), (10, 2, "f32"));
            let n = cases(10_000);
            let mut runner = TestRunner::new(Config { cases: n, failure_persistence: None, ..Config::default() });
            let counts = std::cell::Cell::new((0u32, 0u32));
            let strategy = prop::collection::vec(mutation(), 1..5);
            runner
                .run(&strategy, |mutations| {
                    let bytes = apply(FULL, &mutations);
                    let text = String::from_utf8_lossy(&bytes);
                    let (ok, err) = counts.get();
                    match RunConfig::from_toml(path, &text) {
                        Ok(cfg) => {
                            counts.set((ok + 1, err));
                            let _ = (cfg.dtype(), cfg.target_devices(), cfg.drafter_device(), cfg.pipeline.buffer_bytes());
                            toml::to_string(&cfg).unwrap();
                            // Each plugin parses its own section; its errors are located in the text.
                            for kind in ["target", "drafter", "optimizer", "data"] {
                                let sec = cfg.section(kind);
                                let res = match kind {
                                    "target" => plugin_api::parse_section::<target_hf::TargetSection>(&sec.config_toml).map(drop),
                                    "drafter" => plugin_api::parse_section::<drafter_dflash::DrafterSection>(&sec.config_toml).map(drop),
                                    "optimizer" => optim_adamw::ParamsAdamW::from_toml(&sec.config_toml).map(drop),
                                    _ => plugin_api::parse_section::<data_chat::ChatSection>(&sec.config_toml).map(drop),
                                };
                                if let Err(e) = res {
                                    let msg = format!("[{kind}] plugin `{}`: {e}", sec.plugin);
                                    let _ = locate_plugin_error(&text, &msg);
                                }
                            }
                        }
                        Err(e) => {
                            counts.set((ok, err + 1));
                            let msg = e.to_string();
                            prop_assert!(msg.starts_with("fuzz.toml"), "error does not name the file: {msg}");
                        }
                    }
                    Ok(())
                })
                .unwrap();
            let (ok, err) = counts.get();
            eprintln!("config fuzz: {} inputs ran, no panic ({ok} parsed, {err} refused with an error naming the file)", ok + err);
            assert_eq!(ok + err, n);
        }
    }
}
