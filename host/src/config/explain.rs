//! The config field reference (docs/CONFIG.md, `dflash-host config explain`, `plugins doc`),
//! generated from the types the sections are read into: the host's own sections through their
//! `#[derive(Describe)]`, each plugin's through its `describe` ABI method, built-in or loaded
//! with `--plugin` alike.

use crate::plugins::{Plugin, Registry};
use anyhow::{bail, Result};
use plugin_api::describe::{tables_of, FieldDoc, TableDoc};

/// The host's top-level fields that are sections of their own.
const HOST_SECTIONS: [&str; 6] = ["train", "pipeline", "target", "drafter", "optimizer", "data"];

/// One table of the reference.
struct Shown {
    /// `[train]`, `[optimizer.adamw]`, `[[optimizer.split]]`, or "" for the top level.
    table: String,
    /// The plugin (None: the host's own) and where it comes from.
    plugin: Option<(String, String)>,
    type_name: String,
    fields: Vec<FieldDoc>,
    /// Markdown after the table (a plugin's notes, after its last table).
    notes: String,
}

impl Shown {
    /// The section's key for `config explain SECTION` (`top`, `train`, `optimizer.adamw`).
    fn key(&self) -> String {
        if self.table.is_empty() {
            "top".into()
        } else {
            self.table.trim_matches(['[', ']']).to_string()
        }
    }

    fn kind(&self) -> String {
        self.key().split('.').next().unwrap_or("").to_string()
    }

    fn title(&self) -> String {
        match (self.table.as_str(), &self.plugin) {
            ("", _) => "Top level".into(),
            (t, Some((p, _))) => format!("`{t}` plugin = \"{p}\""),
            (t, None) => format!("`{t}`"),
        }
    }
}

/// `[kind]`, `[kind.path]` or `[[kind.path]]` for a plugin's table.
fn table_name(kind: &str, t: &TableDoc) -> String {
    match (t.path.is_empty(), t.array) {
        (true, _) => format!("[{kind}]"),
        (false, false) => format!("[{kind}.{}]", t.path),
        (false, true) => format!("[[{kind}.{}]]", t.path),
    }
}

/// The host's own sections: the top level (without the fields that are sections), `[train]`,
/// `[pipeline]`.
fn host_tables() -> Vec<Shown> {
    tables_of::<crate::config::RunConfig>("")
        .into_iter()
        .map(|t| {
            let top = t.path.is_empty();
            let fields = t.fields.into_iter().filter(|f| !(top && HOST_SECTIONS.contains(&f.name.as_str()))).collect();
            let table = if top { String::new() } else { format!("[{}]", t.path) };
            Shown { table, plugin: None, type_name: t.type_name.into(), fields, notes: String::new() }
        })
        .collect()
}

/// Where a plugin comes from, as the reference says it.
fn origin(p: &Plugin) -> String {
    if p.record.origin == "builtin" {
        "built in".into()
    } else {
        p.record.origin.clone()
    }
}

/// A plugin's tables (none when it does not describe its section).
fn plugin_tables(p: &Plugin) -> Result<Vec<Shown>> {
    let Some(doc) = p.describe()? else { return Ok(Vec::new()) };
    let kind = &p.record.kind;
    let last = doc.tables.len().saturating_sub(1);
    Ok(doc
        .tables
        .iter()
        .enumerate()
        .map(|(i, t)| Shown {
            table: table_name(kind, t),
            plugin: Some((p.record.name.clone(), origin(p))),
            type_name: t.type_name.to_string(),
            fields: t.fields.to_vec(),
            notes: if i == last { doc.notes.to_string() } else { String::new() },
        })
        .collect())
}

/// The host's sections, then each plugin's: by kind in the order data flows through a run
/// (target, drafter, optimizer, data), by name within one.
fn all_tables(registry: &Registry) -> Result<Vec<Shown>> {
    let mut out = host_tables();
    for p in in_run_order(registry) {
        out.extend(plugin_tables(p)?);
    }
    Ok(out)
}

/// The registry's plugins by kind in the order data flows through a run, by name within one.
fn in_run_order(registry: &Registry) -> Vec<&Plugin> {
    let rank = |kind: &str| HOST_SECTIONS[2..].iter().position(|k| *k == kind).unwrap_or(HOST_SECTIONS.len());
    let mut plugins: Vec<&Plugin> = registry.plugins.iter().collect();
    plugins.sort_by(|a, b| (rank(&a.record.kind), &a.record.name).cmp(&(rank(&b.record.kind), &b.record.name)));
    plugins
}

/// Which plugin each plugin section is shown for (`drafter` -> `gdn`), and why.
#[derive(Default)]
pub struct Picks {
    /// (kind, plugin) pairs; a kind not here shows every plugin's fields.
    chosen: Vec<(String, String)>,
    /// Where the choice came from, printed above the sections.
    why: String,
    /// Only the plugins' sections, not the host's (`plugins doc`).
    plugins_only: bool,
}

impl Picks {
    /// `--plugin NAME`: the sections of each kind that has a plugin of that name.
    pub fn plugin(name: &str, registry: &Registry) -> Result<Self> {
        let kinds: Vec<String> =
            registry.plugins.iter().filter(|p| p.record.name == name).map(|p| p.record.kind.clone()).collect();
        if kinds.is_empty() {
            let mut known: Vec<&str> = in_run_order(registry).iter().map(|p| p.record.name.as_str()).collect();
            known.dedup();
            bail!(
                "--plugin {name}: no plugin of that name (known: {}; load others with --plugin PATH)",
                known.join(", ")
            );
        }
        let chosen = kinds.into_iter().map(|k| (k, name.to_string())).collect();
        let why = format!("Plugin `{name}`, as `--plugin {name}` asks.\n");
        Ok(Self { chosen, why, plugins_only: false })
    }

    /// `--config FILE`: each plugin section's `plugin` in FILE.
    pub fn config(path: &std::path::Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let table: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| anyhow::anyhow!("{}", crate::config::toml_error(path, &text, &e)))?;
        let mut chosen = Vec::new();
        let mut why = format!("The plugins {} picks, each by its section's `plugin` field:\n\n", path.display());
        for kind in ["target", "drafter", "optimizer", "data"] {
            let plugin = table.get(kind).and_then(|t| t.get("plugin"));
            match plugin.and_then(toml::Value::as_str) {
                Some(p) => {
                    let line = crate::config::locate_key(&text, kind, "plugin")
                        .map_or(String::new(), |l| format!(" (line {l})"));
                    why.push_str(&format!("- `[{kind}]` plugin = \"{p}\"{line}\n"));
                    chosen.push((kind.to_string(), p.to_string()));
                }
                None => why.push_str(&format!("- `[{kind}]`: no `plugin` field, so every plugin's fields\n")),
            }
        }
        Ok(Self { chosen, why, plugins_only: false })
    }

    /// One plugin's sections and nothing else.
    fn only(p: &Plugin) -> Self {
        let why = format!(
            "# {} plugin `{}` {}\n\n{}\n\nSource: {}. Its fields go in the config's `[{}]` section, with `plugin = \"{}\"`.\n",
            p.record.kind,
            p.record.name,
            p.record.version,
            p.record.description,
            origin(p),
            p.record.kind,
            p.record.name
        );
        Self { chosen: vec![(p.record.kind.clone(), p.record.name.clone())], why, plugins_only: true }
    }

    /// Whether a table is shown: the host's own, or its plugin is the one picked for its kind.
    fn shows(&self, s: &Shown) -> bool {
        let Some((plugin, _)) = &s.plugin else { return !self.plugins_only };
        let kind = s.kind();
        match self.chosen.iter().find(|(k, _)| *k == kind) {
            Some((_, p)) => p == plugin,
            None => !self.plugins_only,
        }
    }
}

/// The reference of the built-in plugins as Markdown; `only` keeps the sections whose table
/// starts with it (`data`, `optimizer`, `train`; `top` for the top level).
pub fn markdown(only: Option<&str>) -> Result<String> {
    markdown_for(only, &Picks::default(), &Registry::new(&[])?)
}

/// [`markdown`] over `registry`'s plugins, each plugin section shown for the plugin `picks` says
/// (every plugin's where it says none), after a line saying why.
pub fn markdown_for(only: Option<&str>, picks: &Picks, registry: &Registry) -> Result<String> {
    let mut md = String::new();
    if !picks.why.is_empty() {
        md.push_str(&picks.why);
    }
    if only.is_none() && picks.why.is_empty() {
        md.push_str(
            "# Config reference\n\nEvery field of a run config (TOML; unknown fields are refused): its type, default, range \
             and meaning. `dflash-host config explain [SECTION]` prints the same, and `--config FILE` only the sections \
             of the plugins FILE picks; `dflash-host plugins doc PLUGIN.so` prints a plugin library's. A field may also \
             be set on the command line: `dflash-host train --config FILE --set optimizer.lr=1e-3 --device cuda:1`. \
             Relative paths in plugin sections are against the config's folder; `$DFLASH_CACHE/...` points into the \
             cache; a relative path given with `--set` is against the working folder.\n",
        );
    }
    let tables = all_tables(registry)?;
    let mut shown = 0;
    for s in &tables {
        let key = s.key();
        if only.is_some_and(|o| !(key == o || key.starts_with(&format!("{o}.")))) || !picks.shows(s) {
            continue;
        }
        shown += 1;
        let from = match &s.plugin {
            Some((name, origin)) => format!("From `{}` of plugin `{name}` ({origin}).", s.type_name),
            None => format!("From `{}`.", s.type_name),
        };
        md.push_str(&format!("\n## {}\n\n{from}\n\n", s.title()));
        md.push_str("| field | type | default | range | meaning |\n| --- | --- | --- | --- | --- |\n");
        let cell = |t: &str| t.replace('|', "\\|");
        for f in &s.fields {
            md.push_str(&format!(
                "| `{}` | {} | {} | {} | {} |\n",
                f.name,
                cell(&f.ty),
                cell(&f.default),
                cell(&f.range),
                cell(&f.doc)
            ));
        }
        if !s.notes.is_empty() {
            md.push_str(&format!("\n{}\n", s.notes.trim_end()));
        }
    }
    if shown == 0 {
        let mut known: Vec<String> = tables.iter().map(Shown::key).collect();
        known.dedup();
        bail!("no config section `{}` (known: {})", only.unwrap_or(""), known.join(", "));
    }
    Ok(md)
}

/// One plugin's reference (`plugins doc`): what it is, then its sections; a plugin that does not
/// describe its section says so.
pub fn plugin_markdown(p: &Plugin, registry: &Registry) -> Result<String> {
    let picks = Picks::only(p);
    if p.describe()?.is_none() {
        return Ok(format!(
            "{}\nIt does not describe its section (declared without `section = TYPE`): the fields are its own to check when it is created.\n",
            picks.why
        ));
    }
    markdown_for(None, &picks, registry)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field of every section has a type and a line of meaning, and the reference reads
    /// what the types say (defaults, ranges, choices, nested tables).
    #[test]
    fn every_field_of_every_section_is_documented() {
        let registry = Registry::new(&[]).unwrap();
        let tables = all_tables(&registry).unwrap();
        for want in
            ["", "[train]", "[pipeline]", "[target]", "[optimizer.adamw]", "[[optimizer.split]]", "[data.fields]"]
        {
            assert!(tables.iter().any(|t| t.table == want), "{want}");
        }
        for s in &tables {
            for f in &s.fields {
                assert!(!f.ty.is_empty(), "{}.{}", s.table, f.name);
                assert!(!f.doc.is_empty(), "{}.{}: no meaning", s.table, f.name);
                assert!(!f.default.is_empty(), "{}.{}: no default", s.table, f.name);
            }
        }
        let top = tables.iter().find(|t| t.table.is_empty()).unwrap();
        assert!(top.fields.iter().all(|f| !HOST_SECTIONS.contains(&f.name.as_str())), "sections are not fields");
        let md = markdown(None).unwrap();
        for want in [
            "| `steps` | integer | required | >= 1 |",
            "| `lr` | float | 0.001 | > 0 |",
            "| `betas` | list of 2 float | [0.9, 0.999] | in [0, 1) |",
            "| `distill` |",
            "`[data.fields]`",
            "| `distill_max_new_tokens` | integer | 64 | in 1..=(max_len - 8) |",
            "| `pattern` | string | required |  | The parameters the rule applies to",
            "| `attention` | \"split\" \\| \"masked\" | \"split\" |",
            "| `adjust_lr` | \"original\" \\| \"match_rms_adamw\" | \"match_rms_adamw\" |",
            "The families it loads",
        ] {
            assert!(md.contains(want), "{want}\n{md}");
        }
        assert!(markdown(Some("nope")).is_err());
        assert!(markdown(Some("data")).unwrap().contains("[data.fields]"));
        assert!(!markdown(Some("data")).unwrap().contains("[train]"));
    }

    #[test]
    fn picks_show_one_plugin_of_a_kind() {
        let registry = Registry::new(&[]).unwrap();
        let md = markdown_for(Some("drafter"), &Picks::plugin("gdn", &registry).unwrap(), &registry).unwrap();
        assert!(md.contains("plugin = \"gdn\"") && !md.contains("plugin = \"dflash\""), "{md}");
        let Err(e) = Picks::plugin("nope", &registry) else { panic!("no plugin `nope`") };
        assert!(e.to_string().contains("no plugin of that name"), "{e}");
        let adamw = registry.find(plugin_api::PluginKind::Optimizer, "adamw").unwrap();
        let doc = plugin_markdown(adamw, &registry).unwrap();
        assert!(doc.starts_with("# optimizer plugin `adamw`"), "{doc}");
        assert!(doc.contains("`[optimizer]` plugin = \"adamw\"") && !doc.contains("[train]"), "{doc}");
        assert!(!doc.contains("[target]") && !doc.contains("plugin = \"muon\""), "one plugin's sections only: {doc}");
    }

    /// docs/CONFIG.md is what the types say now.
    #[test]
    fn config_md_is_current() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/CONFIG.md");
        let now = markdown(None).unwrap();
        if std::env::var_os("DFLASH_BLESS").is_some() {
            std::fs::write(&path, &now).unwrap();
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == now,
            "docs/CONFIG.md is stale: regenerate it with `DFLASH_BLESS=1 cargo test --release -p dflash-host --lib config::explain`"
        );
    }
}
