//! The config field reference (docs/CONFIG.md and `dflash-host config explain`), generated from
//! the config types themselves: field names, types and doc comments are read from the structs'
//! source (compiled into the binary), defaults from the types' own deserialisation of a minimal
//! section, ranges from the checks that enforce them.

use anyhow::{bail, Result};

/// One config section and the type that reads it.
struct Section {
    /// `[data]`, `[optimizer.adamw]`, or "" for the top level.
    table: &'static str,
    /// The plugin the section is for (None: the host's own).
    plugin: Option<&'static str>,
    /// Source of the type (repository path, text).
    path: &'static str,
    source: &'static str,
    type_name: &'static str,
    /// The type's `Debug` after reading a section holding only its required fields.
    defaults: fn() -> String,
    /// Fields with no default (placeholders in `defaults`).
    required: &'static [&'static str],
}

/// The host's sections are typed in config/sections.rs and checked in config/mod.rs.
const HOST: &str = concat!(include_str!("mod.rs"), include_str!("sections.rs"));
const TARGET_HF: &str = include_str!("../../../plugins/target_hf/src/lib.rs");
/// The drafters' sources, each with the DFlash fields' checks (their ranges) after it.
const DFLASH: &str = concat!(
    include_str!("../../../plugins/drafter_dflash/src/lib.rs"),
    include_str!("../../../crates/drafter_layers/src/dflash.rs")
);
const GDN: &str = concat!(
    include_str!("../../../plugins/drafter_gdn/src/config.rs"),
    include_str!("../../../crates/drafter_layers/src/dflash.rs")
);
/// The `[drafter]` fields `drafter_section!` adds to each drafter's own.
const DRAFTER_SECTION: &str = include_str!("../../../crates/drafter_layers/src/section.rs");
const ADAMW: &str = include_str!("../../../crates/optim_math/src/adamw.rs");
const MUON: &str = include_str!("../../../plugins/optim_muon/src/config.rs");
const MUON_MATH: &str = include_str!("../../../crates/optim_math/src/muon.rs");
const CHAT: &str = include_str!("../../../plugins/data_chat/src/lib.rs");
const RECORDS: &str = include_str!("../../../plugins/data_chat/src/records.rs");

/// Every source enums are looked up in.
const ALL: &[&str] = &[HOST, TARGET_HF, DFLASH, GDN, ADAMW, MUON, MUON_MATH, CHAT, RECORDS];

fn debug_of<T: serde::de::DeserializeOwned + std::fmt::Debug>(text: &str) -> String {
    format!("{:?}", plugin_api::parse_section::<T>(text).expect("a minimal section parses"))
}

fn sections() -> Vec<Section> {
    vec![
        Section {
            table: "",
            plugin: None,
            path: "host/src/config/mod.rs",
            source: HOST,
            type_name: "RunConfig",
            defaults: || {
                debug_of::<crate::config::RunConfig>(
                    "name = \"x\"\n[train]\nsteps = 1\n[target]\n[drafter]\n[optimizer]\n[data]\n",
                )
            },
            required: &["name"],
        },
        Section {
            table: "[train]",
            plugin: None,
            path: "host/src/config/sections.rs",
            source: HOST,
            type_name: "TrainConfig",
            defaults: || debug_of::<crate::config::TrainConfig>("steps = 1"),
            required: &["steps"],
        },
        Section {
            table: "[pipeline]",
            plugin: None,
            path: "host/src/config/sections.rs",
            source: HOST,
            type_name: "PipelineConfig",
            defaults: || debug_of::<crate::config::PipelineConfig>(""),
            required: &[],
        },
        Section {
            table: "[target]",
            plugin: Some("hf"),
            path: "plugins/target_hf/src/lib.rs",
            source: TARGET_HF,
            type_name: "TargetSection",
            defaults: || debug_of::<target_hf::TargetSection>("path = \"x\""),
            required: &["path"],
        },
        Section {
            table: "[drafter]",
            plugin: Some("dflash"),
            path: "plugins/drafter_dflash/src/lib.rs",
            source: DFLASH,
            type_name: "DrafterSection",
            defaults: || debug_of::<drafter_dflash::DrafterSection>(""),
            required: &[],
        },
        Section {
            table: "[drafter]",
            plugin: Some("gdn"),
            path: "plugins/drafter_gdn/src/config.rs",
            source: GDN,
            type_name: "DrafterSection",
            defaults: || debug_of::<drafter_gdn::DrafterSection>(""),
            required: &[],
        },
        Section {
            table: "[optimizer]",
            plugin: Some("adamw"),
            path: "crates/optim_math/src/adamw.rs",
            source: ADAMW,
            type_name: "ParamsAdamW",
            defaults: || debug_of::<optim_adamw::ParamsAdamW>(""),
            required: &[],
        },
        Section {
            table: "[optimizer]",
            plugin: Some("muon"),
            path: "plugins/optim_muon/src/config.rs",
            source: MUON,
            type_name: "MuonConfig",
            defaults: || debug_of::<optim_muon::MuonConfig>(""),
            required: &[],
        },
        Section {
            table: "[optimizer.adamw]",
            plugin: Some("muon"),
            path: "crates/optim_math/src/adamw.rs",
            source: ADAMW,
            type_name: "ParamsAdamW",
            defaults: || debug_of::<optim_muon::MuonConfig>("").split("adamw: ").nth(1).unwrap_or("").to_string(),
            required: &[],
        },
        Section {
            table: "[[optimizer.split]]",
            plugin: Some("muon"),
            path: "plugins/optim_muon/src/config.rs",
            source: MUON,
            type_name: "SplitRule",
            defaults: || debug_of::<optim_muon::SplitRule>("pattern = \"x\"\nparts = [1]"),
            required: &["pattern", "parts"],
        },
        Section {
            table: "[data]",
            plugin: Some("chat"),
            path: "plugins/data_chat/src/lib.rs",
            source: CHAT,
            type_name: "ChatSection",
            defaults: || debug_of::<data_chat::ChatSection>("path = \"x\""),
            required: &["path"],
        },
        Section {
            table: "[data.fields]",
            plugin: Some("chat"),
            path: "plugins/data_chat/src/records.rs",
            source: RECORDS,
            type_name: "Fields",
            defaults: || {
                debug_of::<data_chat::ChatSection>("path = \"x\"").split("fields: ").nth(1).unwrap_or("").to_string()
            },
            required: &[],
        },
    ]
}

/// One documented field.
#[derive(Debug, PartialEq)]
pub struct Field {
    pub name: String,
    pub ty: String,
    pub default: String,
    pub range: String,
    pub doc: String,
}

/// The fields of `pub struct NAME { ... }` in `source`: name, Rust type, doc comment.
fn struct_fields(source: &str, name: &str) -> Vec<(String, String, String)> {
    let start = format!("pub struct {name} {{");
    let Some(at) = source.find(&start) else { return Vec::new() };
    let mut out = Vec::new();
    let mut doc = Vec::new();
    for line in source[at + start.len()..].lines() {
        let l = line.trim();
        if line.starts_with('}') {
            break;
        }
        if let Some(d) = l.strip_prefix("///") {
            doc.push(d.trim().to_string());
        } else if let Some(rest) = l.strip_prefix("pub ") {
            if let Some((field, ty)) = rest.split_once(':') {
                out.push((field.trim().to_string(), ty.trim().trim_end_matches(',').to_string(), doc.join(" ")));
            }
            doc.clear();
        } else if l.starts_with("#[serde(skip)]") {
            doc.push("\u{0}skip".into());
        }
    }
    out.retain(|(_, _, d)| !d.contains("\u{0}skip"));
    out
}

/// A section's fields: its struct's own, then for a drafter declared with `drafter_section!` the
/// fields the macro adds.
fn section_fields(s: &Section) -> Vec<(String, String, String)> {
    let mut fields = struct_fields(s.source, s.type_name);
    if s.source.contains("drafter_layers::drafter_section!") {
        fields.extend(struct_fields(DRAFTER_SECTION, "$name"));
    }
    fields
}

/// The variants of `pub enum NAME` as the config spells them (snake_case), if it is one.
fn enum_variants(name: &str) -> Option<Vec<String>> {
    let start = format!("pub enum {name} {{");
    let source = ALL.iter().find(|s| s.contains(&start))?;
    let body = &source[source.find(&start)? + start.len()..];
    let mut out = Vec::new();
    for line in body.lines() {
        if line.starts_with('}') {
            break;
        }
        let l = line.trim();
        if l.starts_with("//") || l.starts_with("#[") || l.is_empty() {
            continue;
        }
        let v: String = l.chars().take_while(|c| c.is_alphanumeric()).collect();
        if !v.is_empty() && l.chars().nth(v.len()).is_some_and(|c| c == ',' || c == '(') {
            out.push(snake(&v));
        }
    }
    Some(out)
}

fn snake(camel: &str) -> String {
    let mut s = String::new();
    for (i, c) in camel.chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            s.push('_');
        }
        s.extend(c.to_lowercase());
    }
    s
}

/// A Rust field type as the config writes it.
fn toml_type(ty: &str) -> String {
    let ty = ty.trim();
    if let Some(inner) = ty.strip_prefix("Option<").and_then(|t| t.strip_suffix('>')) {
        return toml_type(inner);
    }
    if let Some(inner) = ty.strip_prefix("Vec<").and_then(|t| t.strip_suffix('>')) {
        return format!("list of {}", toml_type(inner));
    }
    if ty.starts_with("BTreeMap<") || ty.starts_with("HashMap<") || ty == "toml::Table" {
        return "table".into();
    }
    if let Some(inner) = ty.strip_prefix('[').and_then(|t| t.strip_suffix(']')) {
        let (t, n) = inner.split_once(';').unwrap_or((inner, "?"));
        return format!("list of {} {}", n.trim(), toml_type(t));
    }
    match ty {
        "String" => "string".into(),
        "bool" => "bool".into(),
        "f32" | "f64" => "float".into(),
        "usize" | "u64" | "u32" | "i64" | "i32" => "integer".into(),
        "LossGamma" => "float or \"none\"".into(),
        "Distill" => "false, \"last\" or \"all\"".into(),
        "serde_json::Value" => "table".into(),
        other => match enum_variants(other) {
            Some(v) if !v.is_empty() => v.iter().map(|v| format!("\"{v}\"")).collect::<Vec<_>>().join(" | "),
            _ => "table".into(),
        },
    }
}

/// `Name { a: 1, b: Some("x"), c: Inner { .. } }` -> [("a", "1"), ...] (top level only).
fn debug_fields(debug: &str) -> Vec<(String, String)> {
    let Some(open) = debug.find('{') else { return Vec::new() };
    let body = &debug[open + 1..];
    let mut out = Vec::new();
    let (mut depth, mut in_str, mut escaped, mut start) = (0i32, false, false, 0usize);
    let mut push = |part: &str| {
        if let Some((k, v)) = part.split_once(": ") {
            out.push((k.trim().to_string(), v.trim().to_string()));
        }
    };
    for (i, c) in body.char_indices() {
        if in_str {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_str = true,
            '{' | '[' | '(' => depth += 1,
            '}' | ']' | ')' if depth == 0 => {
                push(&body[start..i]);
                break;
            }
            '}' | ']' | ')' => depth -= 1,
            ',' if depth == 0 => {
                push(&body[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out
}

/// A `Debug` value as the config would write it.
fn toml_value(debug: &str) -> String {
    let v = debug.trim();
    if v == "None" {
        return "-".into();
    }
    if let Some(inner) = v.strip_prefix("Some(").and_then(|t| t.strip_suffix(')')) {
        return toml_value(inner);
    }
    if v.contains('{') {
        return "see below".into();
    }
    if v.chars().next().is_some_and(char::is_uppercase) && v.chars().all(char::is_alphanumeric) {
        return format!("\"{}\"", snake(v));
    }
    v.to_string()
}

/// What the checks enforce on `field` in `source`: the "must be ..." of the line that names it.
fn range(source: &str, field: &str) -> String {
    let quoted = format!("\"{field}\"");
    let lines: Vec<&str> = source.lines().collect();
    for (i, l) in lines.iter().enumerate() {
        if !l.contains(&quoted) {
            continue;
        }
        // The check's message is on this line or the next.
        for l in [l, lines.get(i + 1).unwrap_or(&"")] {
            let l = l.replace("\\\"", "'");
            if let Some(at) = l.find("must be") {
                let rest = &l[at..];
                let end = rest.find([')', '"']).unwrap_or(rest.len());
                let end = rest[..end].find(", got").unwrap_or(end);
                let mut r = rest[..end].to_string();
                // Cut at the `)` that closes `[0, 1)` or `(max_len - 8)`.
                let open_paren = r.matches('(').count() > r.matches(')').count();
                if r.matches('[').count() > r.matches(']').count() || open_paren {
                    r.push(')');
                }
                // A value formatted into the message (`{MAX_MB}`) is the constant's definition.
                if let Some(open) = r.find('{') {
                    let name: String = r[open + 1..].chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                    let def = format!("const {name}: ");
                    match source
                        .find(&def)
                        .and_then(|at| source[at..].split_once('='))
                        .map(|(_, v)| v.split(';').next().unwrap_or("").trim())
                    {
                        Some(v) if !v.is_empty() && r[open..].starts_with(&format!("{{{name}}}")) => {
                            r = r.replace(&format!("{{{name}}}"), v)
                        }
                        _ => r.truncate(r[..open].trim_end_matches([' ', '(']).len()),
                    }
                }
                return r.replace("must be ", "");
            }
        }
    }
    String::new()
}

/// The fields of one section with their defaults and ranges.
fn fields(s: &Section) -> Result<Vec<Field>> {
    let debug = (s.defaults)();
    let defaults = debug_fields(&debug);
    let mut out: Vec<Field> = Vec::new();
    for (name, ty, doc) in section_fields(s) {
        // Fields that share the comment above them (`num_key_value_heads` after `num_attention_heads`).
        let doc = match out.last() {
            Some(prev) if doc.is_empty() && prev.doc.starts_with("As `") => prev.doc.clone(),
            Some(prev) if doc.is_empty() => format!("As `{}`.", prev.name),
            _ => doc,
        };
        let default = if s.required.contains(&name.as_str()) {
            "required".to_string()
        } else if ty == "toml::Table" || ty == "TrainConfig" || ty == "PipelineConfig" {
            continue; // sections of their own
        } else {
            match defaults.iter().find(|(k, _)| *k == name) {
                Some((_, v)) => toml_value(v),
                None => {
                    bail!("{}: field `{name}` of {} has no default in its Debug output {debug}", s.path, s.type_name)
                }
            }
        };
        out.push(Field { ty: toml_type(&ty), range: range(s.source, &name), name, default, doc });
    }
    Ok(out)
}

fn title(s: &Section) -> String {
    match (s.table, s.plugin) {
        ("", _) => "Top level".into(),
        (t, Some(p)) => format!("`{t}` plugin = \"{p}\""),
        (t, None) => format!("`{t}`"),
    }
}

/// Which plugin each plugin section is shown for (`drafter` -> `gdn`), and why.
#[derive(Default)]
pub struct Picks {
    /// (kind, plugin) pairs; a kind not here shows every built-in plugin's fields.
    chosen: Vec<(String, String)>,
    /// Where the choice came from, printed above the sections.
    why: String,
}

/// The plugin kind of a section's table (`[[optimizer.split]]` -> `optimizer`).
fn kind_of(table: &str) -> &str {
    table.trim_matches(['[', ']']).split('.').next().unwrap_or("")
}

impl Picks {
    /// `--plugin NAME`: the sections of each kind that has a built-in plugin of that name.
    pub fn plugin(name: &str) -> Result<Self> {
        let all = sections();
        let kinds: Vec<&str> = all.iter().filter(|s| s.plugin == Some(name)).map(|s| kind_of(s.table)).collect();
        if kinds.is_empty() {
            let mut known: Vec<&str> = all.iter().filter_map(|s| s.plugin).collect();
            known.dedup();
            bail!("--plugin {name}: no built-in plugin of that name (built-in: {})", known.join(", "));
        }
        let chosen: Vec<(String, String)> = kinds.iter().map(|k| (k.to_string(), name.to_string())).collect();
        let why = format!("Plugin `{name}`, as `--plugin {name}` asks.\n");
        Ok(Self { chosen, why })
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
                None => why.push_str(&format!("- `[{kind}]`: no `plugin` field, so every built-in plugin's fields\n")),
            }
        }
        Ok(Self { chosen, why })
    }

    /// Whether a section is shown: the host's own, or its plugin is the one picked for its kind.
    fn shows(&self, s: &Section) -> bool {
        let Some(plugin) = s.plugin else { return true };
        let kind = kind_of(s.table);
        self.chosen.iter().find(|(k, _)| k == kind).is_none_or(|(_, p)| p == plugin)
    }
}

/// The reference as Markdown; `only` keeps the sections whose table starts with it (`data`,
/// `optimizer`, `train`; `top` for the top level).
pub fn markdown(only: Option<&str>) -> Result<String> {
    markdown_for(only, &Picks::default())
}

/// [`markdown`] with each plugin section shown for the plugin `picks` says (every plugin's
/// where it says none), after a line saying why.
pub fn markdown_for(only: Option<&str>, picks: &Picks) -> Result<String> {
    let mut md = String::new();
    if !picks.why.is_empty() {
        md.push_str(&picks.why);
    }
    if only.is_none() && picks.why.is_empty() {
        md.push_str(
            "# Config reference\n\nEvery field of a run config (TOML; unknown fields are refused): its type, default, range \
             and meaning. `dflash-host config explain [SECTION]` prints the same, and `--config FILE` only the sections \
             of the plugins FILE picks. A field may also be set on the command line: `dflash-host train --config FILE --set \
             optimizer.lr=1e-3 --device cuda:1`. Relative paths in plugin sections are against the config's folder; \
             `$DFLASH_CACHE/...` points into the cache; a relative path given with `--set` is against the working \
             folder.\n",
        );
    }
    let mut shown = 0;
    for s in sections() {
        let key = if s.table.is_empty() { "top".to_string() } else { s.table.trim_matches(['[', ']']).to_string() };
        if only.is_some_and(|o| !(key == o || key.starts_with(&format!("{o}.")))) || !picks.shows(&s) {
            continue;
        }
        shown += 1;
        md.push_str(&format!("\n## {}\n\nFrom `{}` in `{}`.\n\n", title(&s), s.type_name, s.path));
        md.push_str("| field | type | default | range | meaning |\n| --- | --- | --- | --- | --- |\n");
        for f in fields(&s)? {
            let cell = |t: &str| if t.is_empty() { "".to_string() } else { t.replace('|', "\\|") };
            md.push_str(&format!(
                "| `{}` | {} | {} | {} | {} |\n",
                f.name,
                cell(&f.ty),
                cell(&f.default),
                cell(&f.range),
                cell(&f.doc)
            ));
        }
        if s.table == "[target]" {
            md.push_str("\nThe families it loads, by the `model_type` of the checkpoint's config.json:\n\n");
            md.push_str(&target_hf::families::markdown());
        }
    }
    if shown == 0 {
        let known: Vec<String> = sections()
            .iter()
            .map(|s| if s.table.is_empty() { "top".into() } else { s.table.trim_matches(['[', ']']).to_string() })
            .collect();
        bail!("no config section `{}` (known: {})", only.unwrap_or(""), known.join(", "));
    }
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field a section's type has (its `Debug` names them all) is documented, with a type
    /// and a line of meaning.
    #[test]
    fn every_field_of_every_section_is_documented() {
        for s in sections() {
            let documented: Vec<String> = section_fields(&s).into_iter().map(|(n, _, _)| n).collect();
            let debug = (s.defaults)();
            for (name, _) in debug_fields(&debug) {
                if name != "overrides" {
                    assert!(
                        documented.contains(&name),
                        "{}: {name} of {} not found in its source",
                        s.path,
                        s.type_name
                    );
                }
            }
            for f in fields(&s).unwrap() {
                assert!(!f.ty.is_empty(), "{}.{}", s.table, f.name);
                // A meaning of its own or one shared with a documented field above it.
                assert!(!f.doc.is_empty(), "{}.{}: no meaning", s.table, f.name);
                // A range cut where a formatted value was (`in 1..=`) says nothing.
                assert!(!f.range.ends_with(['=', '.', '(', ' ']), "{}.{}: range `{}`", s.table, f.name, f.range);
            }
        }
        let md = markdown(None).unwrap();
        for want in [
            "| `steps` | integer | required | >= 1 |",
            "| `lr` | float | 0.001 | > 0 |",
            "| `distill` |",
            "`[data.fields]`",
            "| `distill_max_new_tokens` | integer | 64 | in 1..=(max_len - 8) |",
            "| `pattern` | string | required |  | The parameters the rule applies to",
        ] {
            assert!(md.contains(want), "{want}");
        }
        assert!(markdown(Some("nope")).is_err());
        assert!(markdown(Some("data")).unwrap().contains("[data.fields]"));
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
