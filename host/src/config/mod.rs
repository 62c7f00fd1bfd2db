//! The run config: one TOML file. Host settings are typed here (`deny_unknown_fields`); each
//! plugin section names its plugin (`plugin = "adamw"`) and the rest of the section is that
//! plugin's own config, which the plugin parses and validates.
//!
//! Files: the top level and plugin sections here; the host's own sections (`[train]`,
//! `[pipeline]`) in `sections.rs`; `--set` / `--device` overrides in `overrides.rs`, a plugin
//! section switched to another plugin by one in `switch.rs`; where in the file an error points in
//! `locate.rs`.

pub mod explain;
mod locate;
mod overrides;
pub mod preflight;
mod sections;
mod switch;

pub use locate::{locate_key, locate_plugin_error, toml_error};
pub use overrides::{effective_section, set_dotted, ConfigOverrides, Override};
pub use sections::{AnchorRule, LossGamma, LossNormalization, PipelineConfig, TrainConfig};
pub use switch::PluginSwitch;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Deserialize, Serialize, plugin_api::Describe)]
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
    /// `f32` or `bf16`; default f32 on CPU, bf16 on CUDA. A CPU with bf16 matrix units (AMX) trains
    /// about twice as fast in bf16; `eval --dtype f32` then checks exactness.
    #[serde(default)]
    pub dtype: Option<String>,
    /// Steps, batch shape, loss, schedule and checkpoints.
    pub train: TrainConfig,
    /// Where the stages run and how they connect (default: everything on `device`).
    #[serde(default)]
    pub pipeline: PipelineConfig,
    /// The target model: its plugin (`plugin = "hf"`) and that plugin's fields.
    pub target: toml::Table,
    /// The drafter architecture: its plugin and that plugin's fields.
    pub drafter: toml::Table,
    /// The optimizer: its plugin and that plugin's fields.
    pub optimizer: toml::Table,
    /// The data loader: its plugin and that plugin's fields.
    pub data: toml::Table,
    /// The `--set` / `--device` arguments applied, by dotted key (errors about a field one of
    /// them set name the argument instead of the file's line).
    #[serde(skip)]
    pub overrides: Vec<Override>,
    /// The plugin sections the overrides switched to another plugin.
    #[serde(skip)]
    pub switches: Vec<PluginSwitch>,
}

fn default_device() -> String {
    "cpu".into()
}

/// A key of the host's own sections (the top level, `[train]`, `[pipeline]`) that their types do
/// not describe, in the file or set by an override: `file:line: field `train.stesp`: unknown
/// field `stesp`, did you mean `steps`?` (the override's argument instead of the file's line).
fn unknown_host_field(path: &Path, text: &str, overrides: &[Override]) -> Result<()> {
    let Ok(mut table) = toml::from_str::<toml::Table>(text) else { return Ok(()) }; // typing reports it
    let doc = plugin_api::describe::SectionDoc {
        described: true,
        tables: plugin_api::describe::tables_of::<RunConfig>("").into(),
        notes: Default::default(),
    };
    let first_unknown = |table: &toml::Table| -> Option<(String, String, String)> {
        for (key, value) in table {
            if let Some(e) = doc.unknown_field(key) {
                return Some((String::new(), key.clone(), e));
            }
            if let (Some(inner), true) = (value.as_table(), ["train", "pipeline"].contains(&key.as_str())) {
                if let Some(e) = inner.keys().find_map(|k| doc.unknown_field(&format!("{key}.{k}")).map(|e| (k, e))) {
                    return Some((key.clone(), e.0.clone(), e.1));
                }
            }
        }
        None
    };
    if let Some((section, key, e)) = first_unknown(&table) {
        let dotted = if section.is_empty() { key.clone() } else { format!("{section}.{key}") };
        let at = locate_key(text, &section, &key).map_or(String::new(), |l| format!(":{l}"));
        bail!("{}{at}: field `{dotted}`: {e}", path.display());
    }
    for o in overrides {
        o.apply(&mut table)?;
        if let Some((section, key, e)) = first_unknown(&table) {
            let dotted = if section.is_empty() { key } else { format!("{section}.{key}") };
            bail!("{}: field `{dotted}`: {e}", o.arg);
        }
    }
    Ok(())
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
        unknown_host_field(path, text, overrides)?;
        let mut switches = Vec::new();
        let mut cfg: RunConfig = if overrides.is_empty() {
            toml::from_str(text).map_err(file_error)?
        } else {
            let base: toml::Table = toml::from_str(text).map_err(file_error)?;
            let mut table = base.clone();
            for o in overrides {
                o.apply(&mut table)?;
            }
            let now = switch::PLUGIN_SECTIONS.map(|s| (s, table.get(s).and_then(toml::Value::as_table)));
            let now: Vec<_> = now.iter().filter_map(|(s, t)| Some((*s, (*t)?))).collect();
            switches = switch::switches(&base, &now);
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
        cfg.switches = switches;
        // `cuda` is the first GPU, as in torch.
        for d in std::iter::once(&mut cfg.device)
            .chain(cfg.pipeline.targets.iter_mut())
            .chain(cfg.pipeline.drafter.iter_mut())
        {
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
        if t.eval_every > 0 && self.pipeline.capture.is_some() {
            bail!("field `train.eval_every`: needs the target online (a capture holds the training batches' features only); set it to 0 to train from `pipeline.capture`");
        }
        if let Some(LossGamma::Decay(g)) = t.loss_gamma {
            range("loss_gamma", g > 0.0 && g.is_finite(), format!("{g} (must be > 0, or \"none\")"))?;
        }
        for (kind, table) in self.sections() {
            match table.get("plugin") {
                Some(toml::Value::String(_)) => {}
                Some(_) => bail!("field `{kind}.plugin`: expected a string (the plugin's name)"),
                None => bail!(
                    "section [{kind}]: missing field `plugin` (the plugin's name, e.g. plugin = \"{}\")",
                    default_plugin(kind)
                ),
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
    if d != "cpu" && d.strip_prefix("cuda:").is_none_or(|n| n.parse::<u32>().is_err()) {
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

/// `config_dir` for relative paths in plugin sections.
pub fn config_dir(path: &Path) -> PathBuf {
    path.parent().map(Path::to_path_buf).filter(|p| !p.as_os_str().is_empty()).unwrap_or_else(|| PathBuf::from("."))
}

#[cfg(test)]
mod tests;
