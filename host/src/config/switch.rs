//! A plugin section switched to another plugin on the command line (`--set optimizer.plugin=adamw`
//! on a Muon run, or `--set 'optimizer={plugin="muon", momentum=0.9}'`): the old plugin's fields
//! mean nothing to the new one and are dropped, the learning rate and weight decay are kept
//! unless set, the new plugin's defaults fill the rest, and the effective section is printed.

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
