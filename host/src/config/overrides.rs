//! `--set KEY=VALUE` and `--device`: command-line changes to the config, applied to its text
//! before it is typed, so they are checked like the file.

use anyhow::{bail, Result};

/// Set `key` (dotted, e.g. `optimizer.adamw.lr`) in a config's TOML table, creating the tables
/// on the way; Err names the part of the key that holds a value, not a table.
pub fn set_dotted(table: &mut toml::Table, key: &str, value: toml::Value) -> std::result::Result<(), String> {
    let parts: Vec<&str> = key.split('.').collect();
    let mut t = table;
    for (i, p) in parts[..parts.len() - 1].iter().enumerate() {
        let entry = t.entry(p.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        t = match entry {
            toml::Value::Table(inner) => inner,
            _ => return Err(parts[..=i].join(".")),
        };
    }
    t.insert(parts[parts.len() - 1].to_string(), value);
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
    pub(crate) fn apply(&self, table: &mut toml::Table) -> Result<()> {
        set_dotted(table, &self.key, self.value.clone())
            .map_err(|not_a_section| anyhow::anyhow!("{}: field `{not_a_section}` is not a section", self.arg))
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
