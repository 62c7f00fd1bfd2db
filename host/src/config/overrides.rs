//! `--set KEY=VALUE` and `--device`: command-line changes to the config, applied to its text
//! before it is typed, so they are checked like the file.
//!
//! Four rules beyond "set this field": a table given for a key that holds one (`--set
//! 'train={steps=1}'`) sets the fields it lists and keeps the others; a plugin section's `plugin`
//! set to another plugin switches the section (the old plugin's fields dropped, `lr` and
//! `weight_decay` kept unless set, the new plugin's defaults for the rest); an integer TOML
//! cannot hold is refused as out of range, not read as a string; and a relative path given on
//! the command line is relative to the working folder, as with every command-line tool (a path
//! in the config file stays relative to the file's folder): it is made absolute, so the
//! experiment records where it pointed.

use super::switch::{switch_plugin, PluginSwitch, PLUGIN_SECTIONS};
use anyhow::{bail, Result};
use clap::Args;
use plugin_api::describe::SectionDoc;
use std::path::Path;

/// Why a dotted key could not be set.
#[derive(Debug, PartialEq)]
pub enum SetError {
    /// This part of the key holds a value, not a table.
    NotASection(String),
    /// The key holds a table and the value is one too: replacing it would drop the fields the
    /// value does not list, merging would not be what TOML means, so neither is done.
    TableOverTable(String),
}

impl SetError {
    /// The error as `what`'s message (`--set ...` or `sweep`).
    pub fn message(&self, what: &str) -> String {
        match self {
            SetError::NotASection(key) => format!("{what}: field `{key}` is not a section"),
            SetError::TableOverTable(key) => format!(
                "{what}: `{key}` is a section; set its fields one by one (e.g. `--set {key}.FIELD=VALUE`), \
                 a table would replace the fields it does not list"
            ),
        }
    }
}

/// Set `key` (dotted, e.g. `optimizer.adamw.lr`) in a config's TOML table, creating the tables
/// on the way. Refused: a part of the key that holds a value, not a table, and a table for a
/// key that already holds one.
pub fn set_dotted(table: &mut toml::Table, key: &str, value: toml::Value) -> std::result::Result<(), SetError> {
    let parts: Vec<&str> = key.split('.').collect();
    let mut t = table;
    for (i, part) in parts[..parts.len() - 1].iter().enumerate() {
        let entry = t.entry(part.to_string()).or_insert_with(|| toml::Value::Table(Default::default()));
        t = match entry {
            toml::Value::Table(inner) => inner,
            _ => return Err(SetError::NotASection(parts[..=i].join("."))),
        };
    }
    let last = parts[parts.len() - 1];
    if value.is_table() && t.get(last).is_some_and(toml::Value::is_table) {
        return Err(SetError::TableOverTable(key.to_string()));
    }
    t.insert(last.to_string(), value);
    Ok(())
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

/// Fields of the built-in plugins that name a file or folder (a hub name or `chatml` aside):
/// relative on the command line, they are made absolute against the working folder even when
/// nothing is there, so the error names the path the user meant.
const PATH_FIELDS: &[&str] =
    &["target.path", "drafter.init_from", "data.path", "data.chat_template", "pipeline.capture"];

/// The sections whose string values may name files.
const PATH_SECTIONS: &[&str] = &["target", "drafter", "optimizer", "data"];

impl Override {
    /// `KEY=VALUE`: VALUE is read as a TOML value (`400`, `1e-3`, `true`, `["cuda:0", "cuda:1"]`,
    /// `"text"`, `{ a = 1 }`); anything that is not one is a string, so `--set name=run-2` needs
    /// no quotes. An integer beyond TOML's (a 64-bit signed one) is refused as out of range.
    pub fn parse_set(arg: &str) -> Result<Self> {
        let shown = format!("--set {arg}");
        let Some((key, raw)) = arg.split_once('=') else { bail!("{shown}: expected KEY=VALUE, e.g. train.steps=400") };
        let key = key.trim();
        if key.is_empty() || key.split('.').any(|p| p.trim().is_empty()) {
            bail!("{shown}: `{key}` is not a dotted field name (e.g. optimizer.lr)");
        }
        let key = key.split('.').map(str::trim).collect::<Vec<_>>().join(".");
        let raw = raw.trim();
        let value = match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
            Ok(mut t) => t.remove("v").expect("parsed `v`"),
            Err(_) if is_integer_literal(raw) => {
                let (bound, side) = if raw.starts_with('-') { (i64::MIN, "least") } else { (i64::MAX, "most") };
                bail!("{shown}: field `{key}`: out of range: {raw} (a config integer is at {side} {bound})")
            }
            Err(_) => toml::Value::String(raw.to_string()),
        };
        Ok(Self { arg: shown, key, value })
    }

    /// The command line's `--set KEY=VALUE` arguments, then `--device`, in the order applied;
    /// relative paths among them made absolute against the working folder.
    pub fn from_args(set: &[String], device: Option<&str>) -> Result<Vec<Self>> {
        let cwd = std::env::current_dir().map_err(|e| anyhow::anyhow!("the working folder: {e}"))?;
        let mut all = set
            .iter()
            .map(|s| {
                let mut o = Self::parse_set(s)?;
                o.resolve_paths(&cwd);
                Ok(o)
            })
            .collect::<Result<Vec<_>>>()?;
        all.extend(device.map(Self::device));
        Ok(all)
    }

    /// `--device DEVICE`: the run's `device`.
    pub fn device(device: &str) -> Self {
        Self { arg: format!("--device {device}"), key: "device".into(), value: toml::Value::String(device.into()) }
    }

    /// Set the value in the config's TOML table, creating the tables on the way: a table over a
    /// table sets the fields it lists; `SECTION.plugin` (or a table's `plugin`) naming another
    /// plugin first switches the section ([`switch_plugin`]).
    pub(crate) fn apply(&self, table: &mut toml::Table) -> Result<()> {
        let section = self.key.split('.').next().unwrap_or("");
        if PLUGIN_SECTIONS.contains(&section) {
            let plugin = match (&self.value, self.key == section) {
                (toml::Value::Table(t), true) => t.get("plugin"),
                (value, false) if self.key == format!("{section}.plugin") => Some(value),
                _ => None,
            };
            if let Some(toml::Value::String(plugin)) = plugin {
                switch_plugin(table, section, plugin);
            }
        }
        let mut result = Ok(());
        leaves(&self.key, &self.value, &mut |key, value| {
            if result.is_ok() {
                result = set_dotted(table, key, value.clone());
            }
        });
        if self.value.as_table().is_some_and(toml::Table::is_empty) {
            result = set_dotted(table, &self.key, self.value.clone()).or_else(|e| match e {
                SetError::TableOverTable(_) => Ok(()), // `{}` over a section: nothing to set
                e => Err(e),
            });
        }
        result.map_err(|e| anyhow::anyhow!(e.message(&self.arg)))
    }

    /// The dotted fields this override sets: its key, or for a table each field within.
    pub fn fields(&self) -> Vec<String> {
        let mut out = Vec::new();
        leaves(&self.key, &self.value, &mut |key, _| out.push(key.to_string()));
        out
    }

    /// This override set the field an error message names (`field `lr``, `unknown field `lr``
    /// in `[optimizer]`, or `field `train.steps``).
    pub fn names_field_of(&self, message: &str) -> bool {
        let section = message.strip_prefix('[').and_then(|r| r.split(']').next());
        let fields = self.fields();
        ["unknown field `", "field `"].iter().any(|p| {
            message.match_indices(p).any(|(at, _)| {
                let field = message[at + p.len()..].split('`').next().unwrap_or("");
                let dotted = section.map(|s| format!("{s}.{field}"));
                field == self.key
                    || fields.iter().any(|f| f == field || dotted.as_deref() == Some(f.as_str()))
                    || dotted.as_deref() == Some(self.key.as_str())
            })
        })
    }

    /// Relative paths in the value made absolute against `cwd`: a string in a plugin section or
    /// `pipeline.capture` that names something there, or one of [`PATH_FIELDS`] (not a hub name
    /// for `target.path`, not `chatml`). Absolute paths and `$DFLASH_CACHE/...` stay.
    pub fn resolve_paths(&mut self, cwd: &Path) {
        let key = self.key.clone();
        leaves_mut(&key, &mut self.value, &mut |field, value| {
            let toml::Value::String(s) = value else { return };
            let section = field.split('.').next().unwrap_or("");
            if !(PATH_SECTIONS.contains(&section) || field == "pipeline.capture") {
                return;
            }
            if s.is_empty() || Path::new(s.as_str()).is_absolute() || s.starts_with("$DFLASH_CACHE") {
                return;
            }
            let here = cwd.join(s.as_str());
            let named = PATH_FIELDS.contains(&field)
                && !(field == "target.path" && input_files::is_hub_repo_id(s))
                && !(field == "data.chat_template" && s == "chatml");
            if named || std::fs::symlink_metadata(&here).is_ok() {
                *s = std::path::absolute(&here).unwrap_or(here).display().to_string();
            }
        });
    }
}

/// `f(dotted key, value)` for each non-table value under `key`.
fn leaves(key: &str, value: &toml::Value, f: &mut dyn FnMut(&str, &toml::Value)) {
    match value {
        toml::Value::Table(t) => t.iter().for_each(|(k, v)| leaves(&format!("{key}.{k}"), v, f)),
        v => f(key, v),
    }
}

fn leaves_mut(key: &str, value: &mut toml::Value, f: &mut dyn FnMut(&str, &mut toml::Value)) {
    match value {
        toml::Value::Table(t) => t.iter_mut().for_each(|(k, v)| leaves_mut(&format!("{key}.{k}"), v, f)),
        v => f(key, v),
    }
}

/// `123`, `-4_000`, `+7`, `0x1F`: an integer as TOML writes one (whatever its size).
fn is_integer_literal(raw: &str) -> bool {
    let digits = raw.strip_prefix(['+', '-']).unwrap_or(raw);
    let (digits, radix) = match digits.get(..2) {
        Some("0x") => (&digits[2..], 16),
        Some("0o") => (&digits[2..], 8),
        Some("0b") => (&digits[2..], 2),
        _ => (digits, 10),
    };
    !digits.is_empty()
        && digits.chars().next().is_some_and(|c| c.is_digit(radix))
        && digits.chars().all(|c| c == '_' || c.is_digit(radix))
}

/// `--set` and `--device` of the commands that read a config besides `train`.
#[derive(Args)]
pub struct ConfigOverrides {
    /// Set a config field (repeatable), typed as in the file, e.g. `--set data.max_len=512`; a
    /// table sets the fields it lists (`--set 'train={steps=400, log_every=5}'`), a relative path
    /// is against the working folder. `--set optimizer.plugin=adamw` (or `--set
    /// 'optimizer={plugin="adamw", eps=1e-6}'`) switches the section to another plugin: the old
    /// plugin's fields are dropped, `lr` and `weight_decay` kept unless set, and the effective
    /// section is printed.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// The run's device (`cpu`, `cuda`, `cuda:N`).
    #[arg(long)]
    pub device: Option<String>,
}

/// The effective section after a switch, one field a line with where its value came from:
/// `set by --set ...`, `kept from <old plugin>` or `default`. Tables within the section
/// (`adamw.lr`) are listed by their dotted names; arrays of tables by their field's default.
pub fn effective_section(
    switch: &PluginSwitch,
    doc: &SectionDoc,
    table: &toml::Table,
    overrides: &[Override],
) -> String {
    let section = &switch.section;
    let mut rows = vec![(format!("plugin = {:?}", switch.to), set_by(overrides, &format!("{section}.plugin")))];
    for t in doc.tables.iter().filter(|t| !t.array) {
        for f in t.fields.iter().filter(|f| f.ty.as_str() != "table") {
            let name = if t.path.is_empty() { f.name.to_string() } else { format!("{}.{}", t.path, f.name) };
            let row = match lookup(table, &name) {
                Some(v) => {
                    let from = set_by(overrides, &format!("{section}.{name}"))
                        .unwrap_or_else(|| format!("kept from `{}`", switch.from));
                    (format!("{name} = {v}"), Some(from))
                }
                _ if t.path.is_empty() && doc.tables.iter().any(|s| s.path == f.name) => continue,
                _ => (format!("{name} = {}", f.default), Some("default".into())),
            };
            rows.push(row);
        }
    }
    let width = rows.iter().map(|(r, _)| r.len()).max().unwrap_or(0);
    let mut out = format!("[{section}] switched from `{}` to `{}`; the effective section:", switch.from, switch.to);
    for (row, from) in rows {
        out.push_str(&format!("\n  {row:<width$}  # {}", from.unwrap_or_else(|| "the file".into())));
    }
    out
}

/// The `--set` argument that set `dotted`, as `set by --set ...`.
fn set_by(overrides: &[Override], dotted: &str) -> Option<String> {
    overrides.iter().rev().find(|o| o.fields().iter().any(|f| f == dotted)).map(|o| format!("set by {}", o.arg))
}

/// The value at `dotted` in `table`, as TOML writes it.
fn lookup(table: &toml::Table, dotted: &str) -> Option<String> {
    let mut parts = dotted.split('.').peekable();
    let mut t = table;
    while let Some(k) = parts.next() {
        let v = t.get(k)?;
        if parts.peek().is_none() {
            return Some(v.to_string());
        }
        t = v.as_table()?;
    }
    None
}
