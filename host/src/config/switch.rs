//! A plugin section switched to another plugin on the command line (`--set optimizer.plugin=adamw`
//! on a Muon run, or `--set 'optimizer={plugin="muon", momentum=0.9}'`): the old plugin's fields
//! mean nothing to the new one and are dropped, the learning rate and weight decay are kept
//! unless set, the new plugin's defaults fill the rest, and the effective section is printed.

use super::Override;
use plugin_api::describe::SectionDoc;

/// The sections a plugin reads, each naming it in `plugin`.
pub const PLUGIN_SECTIONS: [&str; 4] = ["target", "drafter", "optimizer", "data"];

/// The fields a switch to another plugin keeps, by section: the optimizer's peak learning rate
/// (the schedule in `[train]` multiplies it, whichever optimizer runs) and its decoupled weight
/// decay (`p *= 1 - lr * weight_decay` in AdamW and Muon alike).
const KEPT_ON_SWITCH: &[(&str, &[&str])] = &[("optimizer", &["lr", "weight_decay"])];

fn kept_fields(section: &str) -> &'static [&'static str] {
    KEPT_ON_SWITCH.iter().find(|(s, _)| *s == section).map_or(&[][..], |(_, k)| *k)
}

/// `[section]` switched to `plugin` if it names another one: the old plugin's fields dropped,
/// those of [`KEPT_ON_SWITCH`] kept; the new plugin's defaults fill the rest when its section
/// is read.
pub fn switch_plugin(table: &mut toml::Table, section: &str, plugin: &str) {
    let Some(toml::Value::Table(old)) = table.get(section) else { return };
    if old.get("plugin").and_then(toml::Value::as_str) == Some(plugin) {
        return;
    }
    let mut new = toml::Table::new();
    new.insert("plugin".into(), plugin.into());
    for key in kept_fields(section) {
        if let Some(v) = old.get(*key) {
            new.insert(key.to_string(), v.clone());
        }
    }
    table.insert(section.into(), toml::Value::Table(new));
}

/// A section whose plugin the command line changed.
#[derive(Debug, Clone, PartialEq)]
pub struct PluginSwitch {
    pub section: String,
    pub from: String,
    pub to: String,
}

/// The sections of `base` (the file) whose plugin differs in `now` (after the overrides).
pub fn switches(base: &toml::Table, now: &[(&str, &toml::Table)]) -> Vec<PluginSwitch> {
    let plugin = |t: Option<&toml::Table>| t?.get("plugin")?.as_str().map(str::to_string);
    now.iter()
        .filter_map(|(section, table)| {
            let from = plugin(base.get(*section).and_then(toml::Value::as_table))?;
            let to = plugin(Some(table))?;
            (from != to).then(|| PluginSwitch { section: section.to_string(), from, to })
        })
        .collect()
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
