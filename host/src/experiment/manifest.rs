//! `manifest.json`: what produced an experiment, and what a resume must find unchanged: the
//! resolved config (its text and SHA-256), every input file a config value names (SHA-256), the
//! target's weights, the plugin libraries. [`drift`] lists what differs, each by its field.

use super::files::{read_json, write_json_atomic};
use crate::{
    config::RunConfig,
    plugins::{PluginRecord, Registry},
};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::{
    fmt,
    path::{Path, PathBuf},
};

pub const MANIFEST: &str = "manifest.json";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    pub host_version: String,
    pub git_revision: String,
    pub command_line: Vec<String>,
    pub started_at_unix: u64,
    pub seed: u64,
    pub device: String,
    pub dtype: String,
    pub build_id: String,
    pub plugins: Vec<PluginRecord>,
    pub target_source: String,
    pub target_sha256: String,
    /// The hub model a target `path` such as `Qwen/Qwen3-8B` named: the name, the revision
    /// asked for and the commit whose snapshot `target_source` is (absent for a local target).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_hub: Option<HubRecord>,
    /// The config file's folder: relative paths in config.toml resolve from it.
    pub config_dir: String,
    /// The loss's decay gamma the run trains with (the paper's default for the block size when
    /// the config leaves it out), or "none"; null in manifests written before it was recorded.
    #[serde(default)]
    pub loss_gamma: serde_json::Value,
    /// SHA-256 of the resolved config as the run started, and the text itself (so a resume can
    /// name the fields that changed). Absent in manifests written before they were recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_sha256: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_toml: Option<String>,
    /// Every file or folder a config value names, hashed.
    #[serde(default)]
    pub inputs: Vec<InputRecord>,
    /// Changes a resume was allowed to make (`--allow-change`, `--allow-plugin-change`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub changes: Vec<ChangeRecord>,
    /// The A/B this run is an arm of, and which arm (absent for plain runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ab: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arm: Option<String>,
    /// The run this one was forked from (`fork`): absent for a run started from a config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<ParentRecord>,
    /// The drafter's mask token where the host picked it (the config sets no `mask_token_id` and
    /// the target has no pad token): its id, its text and why it is free.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mask_token: Option<crate::pipeline::mask_token::MaskToken>,
}

/// Where a fork started: the parent experiment, the checkpoint's step and its weights' SHA-256,
/// and what the fork did with the optimizer state and the schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParentRecord {
    pub path: String,
    pub step: u64,
    /// SHA-256 of the checkpoint's `model.safetensors`.
    pub checkpoint_sha256: String,
    /// The parent's optimizer plugin and the fork's.
    pub optimizer_then: String,
    pub optimizer_now: String,
    /// `keep` (the parent's state loaded), `fresh` (a new state) or `carry` (what maps taken over).
    pub optimizer_state: String,
    /// `continue` or `restart`.
    pub schedule: String,
    /// Steps of re-warm-up after the fork.
    pub rewarm: u64,
    /// With `optimizer_state = "carry"`: what the fork's optimizer took over from the parent's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub carried: Option<CarryRecord>,
}

/// What a fork's optimizer took over from its parent's (`carry`), by role (`first_moment`,
/// `second_moment`, `master_weights`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CarryRecord {
    /// Parameters whose state the parent's optimizer exported.
    pub exported_params: u64,
    /// Role -> parameters it was taken over for.
    pub used: std::collections::BTreeMap<String, u64>,
    /// Role -> parameters it was exported for but not taken (nothing of the fork's optimizer
    /// maps onto it).
    pub ignored: std::collections::BTreeMap<String, u64>,
    /// Whether the step count was taken over.
    pub step: bool,
    /// What the fork's optimizer made up where nothing mapped.
    pub notes: Vec<String>,
}

/// An input: the config field naming it, where it resolved to, its SHA-256 (a folder: of its
/// files' names and hashes; the target's source: the target plugin's own hash).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InputRecord {
    pub field: String,
    pub path: String,
    pub sha256: String,
}

/// A hub model as a run found it in the HF cache.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HubRecord {
    pub repo: String,
    pub revision: String,
    pub commit: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChangeRecord {
    /// The step the resumed run continued from.
    pub at_step: u64,
    pub field: String,
    pub then: String,
    pub now: String,
}

impl Manifest {
    pub fn read(exp_dir: &Path) -> Result<Self> {
        read_json(&exp_dir.join(MANIFEST))
    }

    /// Replace the manifest (temporary file, fsync, rename).
    pub fn write(&self, exp_dir: &Path) -> Result<()> {
        write_json_atomic(&exp_dir.join(MANIFEST), self)
    }
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    format!("{:x}", Sha256::digest(bytes))
}

fn short(sha: &str) -> &str {
    &sha[..16.min(sha.len())]
}

/// One thing that differs between the run as it started and as it would resume.
#[derive(Debug, Clone, PartialEq)]
pub struct Drift {
    /// A dotted config field (`optimizer.lr`), also how `--allow-change` names it.
    pub field: String,
    pub then: String,
    pub now: String,
    pub what: DriftKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DriftKind {
    Config,
    /// The file or folder a field names has other contents (SHA-256).
    Input,
}

impl fmt::Display for Drift {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self.what {
            DriftKind::Config => {
                write!(f, "config field `{}` changed: {} then, {} now", self.field, self.then, self.now)
            }
            DriftKind::Input => {
                write!(f, "the file `{}` names changed: {} then, {} now", self.field, self.then, self.now)
            }
        }
    }
}

/// The config fields that differ between two resolved configs. Both are parsed and written
/// again by this host first, so a field this host added (with its default) is no change.
pub fn config_drift(then: &str, now: &str) -> Vec<Drift> {
    let normal = |text: &str| -> Option<toml::Table> {
        let cfg: RunConfig = toml::from_str(text).ok()?;
        toml::from_str(&toml::to_string(&cfg).ok()?).ok()
    };
    let (Some(a), Some(b)) =
        (normal(then).or_else(|| toml::from_str(then).ok()), normal(now).or_else(|| toml::from_str(now).ok()))
    else {
        return vec![Drift {
            field: "config".into(),
            then: "(unreadable)".into(),
            now: "(another)".into(),
            what: DriftKind::Config,
        }];
    };
    let mut out = Vec::new();
    diff_tables("", &a, &b, &mut out);
    out
}

fn diff_tables(prefix: &str, a: &toml::Table, b: &toml::Table, out: &mut Vec<Drift>) {
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    let show = |v: Option<&toml::Value>| v.map_or_else(|| "(not set)".to_string(), |v| v.to_string());
    for k in keys {
        let field = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
        match (a.get(k), b.get(k)) {
            (Some(toml::Value::Table(x)), Some(toml::Value::Table(y))) => diff_tables(&field, x, y, out),
            (x, y) if x != y => out.push(Drift { field, then: show(x), now: show(y), what: DriftKind::Config }),
            _ => {}
        }
    }
}

/// Inputs whose hash differs (or that are gone); `now` holds the current hashes of the fields
/// `then` recorded (fields only one side has are config changes, named by [`config_drift`]).
pub fn input_drift(then: &[InputRecord], now: &[InputRecord]) -> Vec<Drift> {
    then.iter()
        .filter_map(|t| {
            let n = now.iter().find(|n| n.field == t.field)?;
            (n.sha256 != t.sha256).then(|| Drift {
                field: t.field.clone(),
                then: format!("{} (SHA-256 {})", t.path, short(&t.sha256)),
                now: format!("{} (SHA-256 {})", n.path, short(&n.sha256)),
                what: DriftKind::Input,
            })
        })
        .collect()
}

/// Whether `--allow-change` lets `field` differ: its own name or a section above it.
pub fn allowed(field: &str, allow: &[String]) -> bool {
    allow.iter().any(|a| field == a || field.strip_prefix(a.as_str()).is_some_and(|rest| rest.starts_with('.')))
}

/// Refuse `drifts` (one line naming every field) unless each is allowed; the allowed ones are
/// logged and returned, to be recorded in the manifest.
pub fn refuse_drift(exp_dir: &Path, drifts: Vec<Drift>, allow: &[String]) -> Result<Vec<Drift>> {
    let refused: Vec<&Drift> = drifts.iter().filter(|d| !allowed(&d.field, allow)).collect();
    if let Some(first) = refused.first() {
        let more = match refused.len() {
            1 => String::new(),
            n => format!(
                " (and {} more: {})",
                n - 1,
                refused[1..].iter().map(|d| format!("`{}`", d.field)).collect::<Vec<_>>().join(", ")
            ),
        };
        let fields: Vec<&str> = refused.iter().map(|d| d.field.as_str()).collect();
        let flags: Vec<String> = fields.iter().map(|f| format!("--allow-change {f}")).collect();
        bail!("cannot resume {}: {first}{more}; pass {} to resume anyway", exp_dir.display(), flags.join(" "));
    }
    for d in &drifts {
        tracing::warn!("resuming although the {d} (--allow-change)");
    }
    Ok(drifts)
}

/// Largest folder an input hash walks (files directly inside it).
const MAX_DIR_FILES: usize = 4096;

/// Hash every file or folder a config value names: each string in the plugin sections that
/// resolves (as the plugins resolve it: `$DFLASH_CACHE/...`, absolute, or against the config's
/// folder) to an existing path, and `pipeline.capture` (its `index.json`, which holds each
/// shard's checksum). A value naming a FIFO, device or socket is an error naming the field.
/// `known(path)` gives a hash already computed (the target's source, hashed by the target
/// plugin) or None; `skip(path)` leaves a path out.
pub fn hash_inputs(
    cfg: &RunConfig,
    registry: &Registry,
    config_dir: &Path,
    cache_dir: &Path,
    known: &dyn Fn(&Path) -> Option<String>,
    skip: &dyn Fn(&Path) -> bool,
) -> Result<Vec<InputRecord>> {
    let mut out = Vec::new();
    for (path, field) in input_paths(cfg, registry, config_dir, cache_dir)? {
        if skip(&path) {
            continue;
        }
        let sha = match known(&path) {
            Some(sha) => sha,
            None => hash_path(&path, &field)?,
        };
        out.push(InputRecord { field, path: path.display().to_string(), sha256: sha });
    }
    Ok(out)
}

/// The paths config values name, each with its field; nothing is read but file types.
pub fn input_paths(
    cfg: &RunConfig,
    registry: &Registry,
    config_dir: &Path,
    cache_dir: &Path,
) -> Result<Vec<(PathBuf, String)>> {
    let ctx = plugin_context(cfg, config_dir, cache_dir);
    let mut out = Vec::new();
    for (kind, table) in cfg.plugin_sections() {
        let inputs = plugin_check(cfg, registry, kind, &ctx).map(|c| c.inputs.into_vec()).unwrap_or_default();
        let paths = section_paths(kind, table, &ctx, &inputs)
            .map_err(|(key, e)| anyhow::anyhow!("field `{kind}.{key}`: {e}"))?;
        out.extend(paths);
    }
    if let Some(dir) = &cfg.pipeline.capture {
        // Read as the trainer reads it (pipeline/capture.rs): the index lists every shard's CRC.
        // A missing index is the trainer's to report (it says what a capture folder needs).
        let index = Path::new(dir).join("index.json");
        if index.exists() {
            out.push((index, "pipeline.capture".to_string()));
        }
    }
    Ok(out)
}

/// The context plugins resolve their paths with.
pub fn plugin_context(cfg: &RunConfig, config_dir: &Path, cache_dir: &Path) -> plugin_api::HostContext {
    crate::plugins::host_context(&cfg.device, cfg.dtype(), cfg.seed, config_dir, cache_dir)
}

/// What the plugin of `kind` says of its section ([`Plugin::check`]); None when it refuses it
/// (preflight reports why) or is not there.
///
/// [`Plugin::check`]: crate::plugins::Plugin::check
pub fn plugin_check(
    cfg: &RunConfig,
    registry: &Registry,
    kind: &str,
    ctx: &plugin_api::HostContext,
) -> Option<plugin_api::describe::SectionCheck> {
    let section = cfg.section(kind);
    let plugin = registry.find(crate::plugins::kind_of_section(kind), &section.plugin).ok()?;
    plugin.check(&section, ctx).ok()
}

/// The existing paths one plugin section names, as `(path, "kind.key")`: its plugin's `inputs`
/// (a hub model's snapshot among them), and any other string value that names an existing path
/// (what a plugin that names no inputs reads); a FIFO, device or socket is an error `(key, why)`.
pub fn section_paths(
    kind: &str,
    table: &toml::Table,
    ctx: &plugin_api::HostContext,
    inputs: &[plugin_api::describe::InputFile],
) -> Result<Vec<(PathBuf, String)>, (String, input_files::InputError)> {
    let mut values = Vec::new();
    strings("", &toml::Value::Table(table.clone()), &mut values);
    let named = |key: &str| inputs.iter().find(|i| i.field.as_str() == key);
    let mut out: Vec<(PathBuf, String)> = Vec::new();
    for (key, s) in values {
        if key == "plugin" || s.is_empty() || s == "." || s == ".." || s.len() > 4096 || s.contains('\n') {
            continue;
        }
        let path = match named(&key) {
            Some(input) => PathBuf::from(input.path.as_str()),
            None => ctx.resolve_path(&s),
        };
        if std::fs::symlink_metadata(&path).is_err() {
            continue; // not a path (or a missing one, which its plugin reports)
        }
        input_files::check_path(&path).map_err(|e| (key.clone(), e))?;
        out.push((path, format!("{kind}.{key}")));
    }
    Ok(out)
}

/// The hub model the config's `[target] path` names, as the target plugin finds it in the local
/// cache now (after it downloaded it, if it had to); None for a local target.
pub fn target_hub(cfg: &RunConfig, registry: &Registry, config_dir: &Path, cache_dir: &Path) -> Option<HubRecord> {
    let ctx = plugin_context(cfg, config_dir, cache_dir);
    let hub = plugin_check(cfg, registry, "target", &ctx)?.hub.into_option()?;
    Some(HubRecord { repo: hub.repo.into(), revision: hub.revision.into(), commit: hub.commit.into() })
}

fn strings(field: &str, v: &toml::Value, out: &mut Vec<(String, String)>) {
    match v {
        toml::Value::String(s) => out.push((field.to_string(), s.clone())),
        toml::Value::Array(items) => items.iter().for_each(|i| strings(field, i, out)),
        toml::Value::Table(t) => t
            .iter()
            .for_each(|(k, i)| strings(&if field.is_empty() { k.clone() } else { format!("{field}.{k}") }, i, out)),
        _ => {}
    }
}

/// A file's SHA-256, or a folder's: over the names and hashes of the regular files in it.
fn hash_path(path: &Path, field: &str) -> Result<String> {
    let kind = input_files::check_path(path).with_context(|| format!("field `{field}`"))?;
    if kind == input_files::PathKind::File {
        return crate::plugins::sha256_file(path).with_context(|| format!("field `{field}`"));
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(path)
        .with_context(|| format!("field `{field}`: reading {}", path.display()))?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_file()) // symlinks followed: an HF cache snapshot links its blobs
        .map(|e| e.path())
        .collect();
    if files.len() > MAX_DIR_FILES {
        bail!(
            "field `{field}`: {} holds {} files, more than the {MAX_DIR_FILES} an input folder may",
            path.display(),
            files.len()
        );
    }
    files.sort();
    let mut h = Sha256::new();
    for f in files {
        h.update(f.file_name().unwrap_or_default().as_encoded_bytes());
        h.update([0]);
        h.update(crate::plugins::sha256_file(&f).with_context(|| format!("field `{field}`"))?.as_bytes());
    }
    Ok(format!("{:x}", h.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CFG: &str = r#"name = "t"
[train]
steps = 4
[target]
plugin = "hf"
path = "model.gguf"
[drafter]
plugin = "dflash"
block_size = 4
[optimizer]
plugin = "adamw"
lr = 1e-3
[data]
plugin = "chat"
path = "data.jsonl"
format = "jsonl"
"#;

    fn resolved(text: &str) -> String {
        toml::to_string(&RunConfig::from_toml(Path::new("c.toml"), text).unwrap()).unwrap()
    }

    #[test]
    fn config_changes_are_named_by_field_and_host_defaults_are_none() {
        let a = resolved(CFG);
        assert!(config_drift(&a, &a).is_empty());
        let b = resolved(&CFG.replace("lr = 1e-3", "lr = 2e-3").replace("block_size = 4", "block_size = 8"));
        let fields: Vec<String> = config_drift(&a, &b).iter().map(|d| d.to_string()).collect();
        assert_eq!(
            fields,
            [
                "config field `drafter.block_size` changed: 4 then, 8 now",
                "config field `optimizer.lr` changed: 0.001 then, 0.002 now"
            ]
        );
        // The manifest's text lacks a field this host writes with its default: not a change.
        let old = a.lines().filter(|l| !l.starts_with("max_nonfinite_steps")).collect::<Vec<_>>().join("\n");
        assert_ne!(old, a);
        assert!(config_drift(&old, &a).is_empty(), "{:?}", config_drift(&old, &a));
        let c = resolved(&CFG.replace("path = \"data.jsonl\"", "path = \"other.jsonl\"\nmax_records = 3"));
        let fields: Vec<String> = config_drift(&a, &c).into_iter().map(|d| d.field).collect();
        assert_eq!(fields, ["data.max_records", "data.path"]);
    }

    #[test]
    fn allow_change_names_a_field_or_a_section_above_it() {
        let allow = vec!["optimizer".to_string(), "train.steps".to_string()];
        assert!(allowed("optimizer.lr", &allow) && allowed("train.steps", &allow));
        assert!(
            !allowed("train.steps_x", &allow) && !allowed("optimizers.lr", &allow) && !allowed("data.path", &allow)
        );
        let d = |f: &str| Drift { field: f.into(), then: "1".into(), now: "2".into(), what: DriftKind::Config };
        let err = refuse_drift(Path::new("e"), vec![d("optimizer.lr"), d("data.path"), d("seed")], &allow)
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "cannot resume e: config field `data.path` changed: 1 then, 2 now (and 1 more: `seed`); \
             pass --allow-change data.path --allow-change seed to resume anyway"
        );
        assert_eq!(refuse_drift(Path::new("e"), vec![d("optimizer.lr")], &allow).unwrap().len(), 1);
    }

    fn builtins() -> Registry {
        Registry::new(&[]).unwrap()
    }

    #[test]
    fn inputs_are_hashed_by_field_and_special_files_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("data.jsonl"), "{}\n").unwrap();
        std::fs::write(dir.path().join("model.gguf"), "weights").unwrap();
        let cfg = RunConfig::from_toml(Path::new("c.toml"), CFG).unwrap();
        let none = |_: &Path| None;
        let no_skip = |_: &Path| false;
        let got = hash_inputs(&cfg, &builtins(), dir.path(), dir.path(), &none, &no_skip).unwrap();
        let fields: Vec<&str> = got.iter().map(|r| r.field.as_str()).collect();
        assert_eq!(fields, ["target.path", "data.path"], "`jsonl` and `hf` name no file here");
        assert_eq!(got[1].sha256, sha256_hex(b"{}\n"));
        // The target's hash comes from the target plugin, not hashed again.
        let model = dir.path().join("model.gguf");
        let known = |p: &Path| (p == model).then(|| "from-the-target".to_string());
        assert_eq!(
            hash_inputs(&cfg, &builtins(), dir.path(), dir.path(), &known, &no_skip).unwrap()[0].sha256,
            "from-the-target"
        );
        std::fs::write(dir.path().join("data.jsonl"), "{}\n{}\n").unwrap();
        let now = hash_inputs(&cfg, &builtins(), dir.path(), dir.path(), &none, &no_skip).unwrap();
        let drift = input_drift(&got, &now);
        assert_eq!(drift.len(), 1);
        assert!(drift[0].to_string().starts_with("the file `data.path` names changed: "), "{}", drift[0]);
        // A device or FIFO where a file belongs: refused naming the field, never read.
        let dev = RunConfig::from_toml(Path::new("c.toml"), &CFG.replace("model.gguf", "/dev/zero")).unwrap();
        let err = format!("{:#}", hash_inputs(&dev, &builtins(), dir.path(), dir.path(), &none, &no_skip).unwrap_err());
        assert_eq!(err, "field `target.path`: /dev/zero: not a regular file (a character device)");
    }

    /// `[target] path = "Org/Tiny"`, no such local path: the HF cache snapshot `refs/main`
    /// names is the input, hashed through the symlinks into `blobs/` that the cache keeps.
    #[test]
    fn a_hub_model_is_recorded_as_its_cached_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let repo = dir.path().join("hub/models--Org--Tiny");
        let snapshot = repo.join("snapshots").join("c".repeat(40));
        std::fs::create_dir_all(&snapshot).unwrap();
        std::fs::create_dir_all(repo.join("blobs")).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), "c".repeat(40)).unwrap();
        for (name, text) in [("config.json", "{}"), ("model.safetensors", "weights")] {
            std::fs::write(repo.join("blobs").join(name), text).unwrap();
            std::os::unix::fs::symlink(repo.join("blobs").join(name), snapshot.join(name)).unwrap();
        }
        // The only test that reads the variable; set before any lookup.
        std::env::set_var("HF_HUB_CACHE", dir.path().join("hub"));
        let cfg = RunConfig::from_toml(Path::new("c.toml"), &CFG.replace("model.gguf", "Org/Tiny")).unwrap();
        let got = hash_inputs(&cfg, &builtins(), dir.path(), dir.path(), &|_| None, &|_| false).unwrap();
        assert_eq!((got[0].field.as_str(), got[0].path.as_str()), ("target.path", snapshot.to_str().unwrap()));
        assert_eq!(got[0].sha256, hash_path(&snapshot, "x").unwrap());
        std::fs::write(repo.join("blobs/model.safetensors"), "other weights").unwrap();
        assert_ne!(
            hash_inputs(&cfg, &builtins(), dir.path(), dir.path(), &|_| None, &|_| false).unwrap()[0].sha256,
            got[0].sha256,
            "the blobs are hashed"
        );
        // A revision the cache does not have: nothing recorded yet (the plugin downloads it).
        let v2 = RunConfig::from_toml(
            Path::new("c.toml"),
            &CFG.replace("\"model.gguf\"", "\"Org/Tiny\"\nrevision = \"v2\""),
        )
        .unwrap();
        let got = hash_inputs(&v2, &builtins(), dir.path(), dir.path(), &|_| None, &|_| false).unwrap();
        assert!(got.iter().all(|r| r.field != "target.path"), "{got:?}");
    }
}
