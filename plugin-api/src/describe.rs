//! What a plugin says about its config section before anything heavy loads (ABI 2.0): the
//! section's field reference, generated from the struct it parses (`#[derive(Describe)]`), and
//! its checks ([`Section::check`]), which return the files the run reads and what the host needs
//! to know of the plugin without creating it.

use crate::{HostContext, PluginError};
use abi_stable::{
    std_types::{ROption, RString, RVec},
    StableAbi,
};
use serde::de::DeserializeOwned;
use std::{
    collections::{BTreeMap, HashMap},
    fmt::Debug,
};

pub use plugin_api_derive::Describe;

/// One field of a config table.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct FieldDoc {
    /// As the config writes it.
    pub name: RString,
    /// `integer`, `float`, `string`, `bool`, `list of string`, `table`, `"a" | "b"`.
    pub ty: RString,
    /// As TOML writes it; `required` when the field must be given, `-` when it is unset.
    pub default: RString,
    /// What the section's checks allow (`>= 1`, `in [0, 1)`), or empty.
    pub range: RString,
    /// One paragraph: what the field means.
    pub doc: RString,
}

impl FieldDoc {
    pub fn new(name: &str, ty: String, default: String, range: &str, doc: &str) -> Self {
        Self { name: name.into(), ty: ty.into(), default: default.into(), range: range.into(), doc: doc.into() }
    }
}

/// One table of a section: the section itself (`path` empty) or a table within it
/// (`fields`, `adamw`, `split`).
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct TableDoc {
    /// Dotted, below the section: `` for the section, `adamw`, `split`.
    pub path: RString,
    /// An array of tables (`[[optimizer.split]]`).
    pub array: bool,
    /// The Rust type that reads it.
    pub type_name: RString,
    pub fields: RVec<FieldDoc>,
}

/// A plugin's config section, described (`describe` in the root module).
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Default)]
pub struct SectionDoc {
    /// False for a plugin that does not describe its section (declared without `section =`).
    pub described: bool,
    /// The section first, then the tables within it.
    pub tables: RVec<TableDoc>,
    /// Markdown shown after the tables (what a target loads, ...), or empty.
    pub notes: RString,
}

/// A file or folder a section names, which the run reads: the manifest hashes it.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct InputFile {
    /// The field that names it (`path`, `init_from`).
    pub field: RString,
    /// Resolved (absolute, or against the working folder).
    pub path: RString,
}

impl InputFile {
    /// The file or folder a field names, resolved as the plugin will read it
    /// ([`HostContext::resolve_path`]); an error naming the field when nothing is there.
    pub fn existing(field: &str, value: &str, ctx: &HostContext) -> Result<Self, PluginError> {
        let path = ctx.resolve_path(value);
        if !path.exists() {
            return Err(PluginError::new(format!("field `{field}`: {}: no such file or folder", path.display())));
        }
        Ok(Self { field: field.into(), path: path.display().to_string().into() })
    }
}

/// A model a target's path named on a model hub, as found in the local cache now.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct HubModel {
    /// `owner/name`.
    pub repo: RString,
    /// The branch, tag or commit asked for.
    pub revision: RString,
    /// The commit it resolved to.
    pub commit: RString,
    /// The snapshot folder.
    pub path: RString,
}

/// Records a data loader holds out of training, by split.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct DataSplit {
    /// `validation` (scored during training, what A/B sweeps choose on) or `holdout` (the test
    /// prompts of `eval`).
    pub name: RString,
    pub records: u64,
}

/// What a section's check found (`check` in the root module). Every part may be empty: a plugin
/// that does not implement [`Section::check`] only has its section parsed.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Default)]
pub struct SectionCheck {
    /// The files and folders the section names that the run reads (each is there).
    pub inputs: RVec<InputFile>,
    /// A target: the hub model its path named, when it is in the local cache.
    pub hub: ROption<HubModel>,
    /// A data loader: the records it holds out, by split.
    pub splits: RVec<DataSplit>,
    /// A target: what its config says of the model, read without its weights (None: unknown
    /// until it loads, e.g. a model still to download).
    pub target: ROption<TargetFacts>,
}

/// What a target's config says of the model (for model cards and benchmarks).
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Default)]
pub struct TargetFacts {
    /// HF `model_type` (`llama`, `qwen3_moe`), or a GGUF file's `general.architecture`.
    pub model_type: RString,
    pub num_hidden_layers: u32,
    /// Routed experts in its MLPs.
    pub mixture_of_experts: bool,
    /// Linear-attention (Gated DeltaNet) layers besides attention.
    pub hybrid: bool,
    /// Weights in a GGUF file.
    pub gguf: bool,
    /// A GGUF file's quantised tensor types (`Q4_K`, ...), sorted; empty when none.
    pub quantised: RVec<RString>,
}

/// The shape a target's FLOPs are asked for.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq)]
pub struct FlopsQuery {
    /// Layers run (the deepest feature layer + 1, or all).
    pub layers: u32,
    pub batch: u32,
    pub seq_len: u32,
    /// With the output head.
    pub logits: bool,
}

/// A target's forward FLOPs for a [`FlopsQuery`], by part of the model.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct FlopsPart {
    /// `attention`, `mlp`, `head`, ...
    pub name: RString,
    pub flop: f64,
}

/// A parameter's name and shape, as a saved drafter's config implies them.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct ParamShape {
    pub name: RString,
    pub shape: RVec<i64>,
}

/// The shapes a run's device memory is estimated at (ABI 2.2, [`Section::memory`]).
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq)]
pub struct MemoryQuery {
    /// Sequences a micro-batch.
    pub batch: u32,
    pub seq_len: u32,
    /// A drafter: anchors (blocks) drawn a sequence.
    pub anchors_per_seq: u32,
    /// A target: layers run (the deepest feature layer + 1), and whether the logits are asked for.
    pub layers: u32,
    pub logits: bool,
    /// An optimizer: the parameters it trains (what the drafter's answer gave).
    pub trained_parameters: u64,
}

/// How a part of a run's device memory grows with the run's shapes: what the host's advice
/// (the largest batch, the anchors, tensor parallelism, an FP8 target) scales.
#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryScale {
    /// A target's weights on this rank: split by tensor parallelism, halved by FP8.
    TargetWeights,
    /// Independent of the batch (a drafter's weights, gradients, optimizer state).
    Fixed,
    /// In proportion to the batch (the target's working set, the drafter's context).
    Batch,
    /// In proportion to batch x anchors (the drafter's blocks).
    BatchAnchors,
}

/// One part of a section's device memory, in bytes on one rank.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct MemoryPart {
    /// `target weights`, `drafter activations (blocks)`, `AdamW moments`, ...
    pub name: RString,
    pub bytes: u64,
    pub scale: MemoryScale,
}

impl MemoryPart {
    pub fn new(name: &str, bytes: f64, scale: MemoryScale) -> Self {
        Self { name: name.into(), bytes: bytes.max(0.0).round() as u64, scale }
    }
}

/// What a section takes of device memory at a [`MemoryQuery`] (ABI 2.2, [`Section::memory`]).
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Default)]
pub struct SectionMemory {
    pub parts: RVec<MemoryPart>,
    /// A drafter: the parameters it trains (the optimizer's [`MemoryQuery::trained_parameters`]).
    pub trained_parameters: u64,
    /// A target: its spec from its config (what the drafter is then asked with, as `ctx.target`).
    pub target: ROption<crate::TargetSpec>,
    /// A drafter with a `checkpoint_layers` switch that is off: its parts that scale with the batch
    /// (`Batch`, `BatchAnchors`), in bytes, were it on.
    pub checkpointed_bytes: ROption<u64>,
    /// A data loader: the largest micro-batch it gives, [sequences, tokens a sequence] (what the
    /// host then asks the target and the drafter at).
    pub batch_shape: ROption<[u32; 2]>,
}

/// Parameter names and shapes ([`Section::saved_shapes`]).
pub type Shapes = Vec<(String, Vec<i64>)>;

/// A type a config field can have: how the reference names it and writes its values.
pub trait ConfigType {
    fn toml_type() -> String;

    /// A value as TOML writes it (the field's default).
    fn toml_text(&self) -> String;

    /// The tables below a field of this type named `key` (a struct's, an array of them).
    fn tables_under(key: &str) -> Vec<TableDoc> {
        let _ = key;
        Vec::new()
    }
}

/// A struct a section or table is read into (`#[derive(Describe)]`).
pub trait Describe {
    fn type_name() -> &'static str;

    fn fields() -> Vec<FieldDoc>;

    /// The tables of fields whose type is a described struct, paths below this one.
    fn nested_tables() -> Vec<TableDoc>;
}

/// `T`'s table and those within it, below `key` (empty: the section itself).
pub fn tables_of<T: Describe>(key: &str) -> Vec<TableDoc> {
    let mut out =
        vec![TableDoc { path: key.into(), array: false, type_name: T::type_name().into(), fields: T::fields().into() }];
    for mut t in T::nested_tables() {
        t.path = match (key.is_empty(), t.path.is_empty()) {
            (true, _) => t.path,
            (false, true) => key.into(),
            (false, false) => format!("{key}.{}", t.path).into(),
        };
        out.push(t);
    }
    out
}

/// A section plugin's config: parsed from its TOML, described, and checked before anything heavy
/// loads. Declare it with `declare_plugin!(name, info, create, section = Type)`.
pub trait Section: DeserializeOwned + Describe {
    /// Whether the fields are described (only [`Undescribed`] says no).
    const DESCRIBED: bool = true;

    /// Check the fields as far as they go without loading anything heavy (no weights, no
    /// dataset beyond what counting needs) and name the files the run reads. Errors name the
    /// field: `field `lr`: must be > 0`.
    fn check(&self, ctx: &HostContext) -> Result<SectionCheck, PluginError> {
        let _ = ctx;
        Ok(SectionCheck::default())
    }

    /// Markdown shown after the field tables in the reference.
    fn notes() -> String {
        String::new()
    }

    /// A drafter's parameters as a saved `config.json` of this plugin implies them (what `export`
    /// checks the weights against before writing them); None when the config is not this
    /// plugin's (its `architectures` name another model). Errors name the config's field.
    fn saved_shapes(config_json: &str) -> Result<Option<Shapes>, PluginError> {
        let _ = config_json;
        Ok(None)
    }

    /// The device memory this section takes at `query`, by part, from its config without its
    /// weights (ABI 2.2); None: unknown (the host then leaves it out of its estimate and says so).
    fn memory(&self, ctx: &HostContext, query: MemoryQuery) -> Result<Option<SectionMemory>, PluginError> {
        let _ = (ctx, query);
        Ok(None)
    }

    /// A target's forward FLOPs by part, from its config without its weights; None: unknown
    /// (the host then counts a dense decoder of the loaded target's shape).
    fn target_flops(&self, ctx: &HostContext, query: FlopsQuery) -> Result<Option<Vec<FlopsPart>>, PluginError> {
        let _ = (ctx, query);
        Ok(None)
    }
}

/// The [`SectionDoc`] of a section type.
pub fn section_doc<T: Section>() -> SectionDoc {
    if !T::DESCRIBED {
        return SectionDoc::default();
    }
    SectionDoc { described: true, tables: tables_of::<T>("").into(), notes: T::notes().into() }
}

/// Parse a section and check it ([`Section::check`]).
pub fn check_section<T: Section>(text: &str, ctx: &HostContext) -> Result<SectionCheck, PluginError> {
    crate::parse_section::<T>(text)?.check(ctx)
}

/// Parse a section and count its target's FLOPs ([`Section::target_flops`]).
pub fn section_flops<T: Section>(
    text: &str,
    ctx: &HostContext,
    query: FlopsQuery,
) -> Result<ROption<RVec<FlopsPart>>, PluginError> {
    Ok(crate::parse_section::<T>(text)?.target_flops(ctx, query)?.map(RVec::from).into())
}

/// Parse a section and estimate its device memory ([`Section::memory`]).
pub fn section_memory<T: Section>(
    text: &str,
    ctx: &HostContext,
    query: MemoryQuery,
) -> Result<ROption<SectionMemory>, PluginError> {
    Ok(crate::parse_section::<T>(text)?.memory(ctx, query)?.into())
}

/// [`Section::saved_shapes`] across the ABI.
pub fn section_saved_shapes<T: Section>(config_json: &str) -> Result<ROption<RVec<ParamShape>>, PluginError> {
    let shapes = T::saved_shapes(config_json)?;
    Ok(shapes
        .map(|v| v.into_iter().map(|(name, shape)| ParamShape { name: name.into(), shape: shape.into() }).collect())
        .into())
}

/// The section of a plugin declared without `section = TYPE`: any TOML parses, nothing is
/// described or checked (the plugin checks its section when it is created).
pub struct Undescribed;

impl<'de> serde::Deserialize<'de> for Undescribed {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        serde::de::IgnoredAny::deserialize(d).map(|_| Undescribed)
    }
}

impl Describe for Undescribed {
    fn type_name() -> &'static str {
        ""
    }
    fn fields() -> Vec<FieldDoc> {
        Vec::new()
    }
    fn nested_tables() -> Vec<TableDoc> {
        Vec::new()
    }
}

impl Section for Undescribed {
    const DESCRIBED: bool = false;
}

/// A `Debug` value as TOML would write it, for fields described with `#[describe(ty = ...)]`.
pub fn debug_text<T: Debug>(value: &T) -> String {
    fn text(v: &str) -> String {
        let v = v.trim();
        if v == "None" {
            return "-".into();
        }
        if let Some(inner) = v.strip_prefix("Some(").and_then(|t| t.strip_suffix(')')) {
            return text(inner);
        }
        if v.contains('{') {
            return "see below".into();
        }
        if v.chars().next().is_some_and(char::is_uppercase) && v.chars().all(char::is_alphanumeric) {
            let mut s = String::from('"');
            for (i, c) in v.chars().enumerate() {
                if c.is_uppercase() && i > 0 {
                    s.push('_');
                }
                s.extend(c.to_lowercase());
            }
            return s + "\"";
        }
        v.to_string()
    }
    text(&format!("{value:?}"))
}

macro_rules! config_type {
    ($name:literal, $($t:ty),*) => {$(
        impl ConfigType for $t {
            fn toml_type() -> String {
                $name.into()
            }
            fn toml_text(&self) -> String {
                format!("{self:?}")
            }
        }
    )*};
}

config_type!("integer", u8, u16, u32, u64, usize, i8, i16, i32, i64, isize);
config_type!("float", f32, f64);
config_type!("bool", bool);
config_type!("string", String, std::path::PathBuf);

impl<T: ConfigType> ConfigType for Option<T> {
    fn toml_type() -> String {
        T::toml_type()
    }
    fn toml_text(&self) -> String {
        self.as_ref().map_or_else(|| "-".into(), T::toml_text)
    }
    fn tables_under(key: &str) -> Vec<TableDoc> {
        T::tables_under(key)
    }
}

fn list_text<'a, T: ConfigType + 'a>(items: impl Iterator<Item = &'a T>) -> String {
    format!("[{}]", items.map(T::toml_text).collect::<Vec<_>>().join(", "))
}

impl<T: ConfigType> ConfigType for Vec<T> {
    fn toml_type() -> String {
        format!("list of {}", T::toml_type())
    }
    fn toml_text(&self) -> String {
        list_text(self.iter())
    }
    fn tables_under(key: &str) -> Vec<TableDoc> {
        let mut tables = T::tables_under(key);
        tables.iter_mut().filter(|t| t.path == key).for_each(|t| t.array = true);
        tables
    }
}

impl<T: ConfigType, const N: usize> ConfigType for [T; N] {
    fn toml_type() -> String {
        format!("list of {N} {}", T::toml_type())
    }
    fn toml_text(&self) -> String {
        list_text(self.iter())
    }
}

fn table_text<'a, V: ConfigType + 'a>(entries: impl Iterator<Item = (&'a String, &'a V)>) -> String {
    let entries: Vec<String> = entries.map(|(k, v)| format!("{k} = {}", v.toml_text())).collect();
    if entries.is_empty() {
        "{}".into()
    } else {
        format!("{{ {} }}", entries.join(", "))
    }
}

impl<V: ConfigType> ConfigType for BTreeMap<String, V> {
    fn toml_type() -> String {
        "table".into()
    }
    fn toml_text(&self) -> String {
        table_text(self.iter())
    }
}

impl<V: ConfigType> ConfigType for HashMap<String, V> {
    fn toml_type() -> String {
        "table".into()
    }
    fn toml_text(&self) -> String {
        let sorted: BTreeMap<&String, &V> = self.iter().collect();
        table_text(sorted.into_iter())
    }
}

impl ConfigType for toml::Table {
    fn toml_type() -> String {
        "table".into()
    }
    fn toml_text(&self) -> String {
        table_text(self.iter())
    }
}

impl ConfigType for toml::Value {
    fn toml_type() -> String {
        "any".into()
    }
    fn toml_text(&self) -> String {
        match self {
            toml::Value::Table(t) => t.toml_text(),
            v => v.to_string(),
        }
    }
}

/// The closest of `known` to `name` (edit distance at most a third of its length), for "unknown
/// field `lrr`, did you mean `lr`?".
pub fn closest<'a>(name: &str, known: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let limit = (name.chars().count() / 3).max(1);
    known
        .into_iter()
        .map(|k| (edit_distance(name, k), k))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let here = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(row[j + 1] + 1);
            prev = here;
        }
    }
    row[b.len()]
}

impl SectionDoc {
    /// The table at `path` (`` for the section).
    pub fn table(&self, path: &str) -> Option<&TableDoc> {
        self.tables.iter().find(|t| t.path.as_str() == path)
    }

    /// Why `key` (dotted below the section: `lr`, `adamw.lr`) is no field of this section, with
    /// the closest field named; None when it is one (or the section is not described).
    pub fn unknown_field(&self, key: &str) -> Option<String> {
        if !self.described {
            return None;
        }
        let (table, field) = key.rsplit_once('.').unwrap_or(("", key));
        let Some(t) = self.table(table) else {
            // `adamw.lr` where `adamw` is a field of another type: not ours to judge.
            return None;
        };
        if t.fields.iter().any(|f| f.name.as_str() == field) {
            return None;
        }
        let names = t.fields.iter().map(|f| f.name.as_str());
        Some(match closest(field, names) {
            Some(near) => format!("unknown field `{field}`, did you mean `{near}`?"),
            None => {
                let all: Vec<&str> = t.fields.iter().map(|f| f.name.as_str()).collect();
                format!("unknown field `{field}` (fields: {})", all.join(", "))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The inner table of [`Outer`].
    #[derive(Debug, Default, serde::Deserialize, Describe)]
    #[serde(deny_unknown_fields, default)]
    #[allow(dead_code)]
    struct Inner {
        /// How many.
        #[describe(range = ">= 1")]
        count: usize,
        /// Its name.
        name: Option<String>,
    }

    #[derive(Debug, Default, Clone, Copy, serde::Deserialize, Describe)]
    #[serde(rename_all = "snake_case")]
    #[allow(dead_code)]
    enum Mode {
        #[default]
        FastPath,
        Slow,
        #[serde(rename = "off")]
        Disabled,
    }

    #[derive(Debug, serde::Deserialize, Describe)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Outer {
        /// Where the data is.
        path: String,
        /// The rate, over
        /// two lines.
        #[serde(default = "rate")]
        #[describe(range = "> 0")]
        lr: f64,
        /// Betas.
        #[serde(default)]
        betas: [f64; 2],
        /// The mode.
        #[serde(default)]
        mode: Mode,
        /// The inner table.
        #[serde(default)]
        inner: Inner,
        /// Rules.
        #[serde(default)]
        rules: Vec<Inner>,
        /// Written by hand.
        #[serde(default)]
        #[describe(ty = "float or \"none\"")]
        gamma: Option<f32>,
        #[serde(skip)]
        hidden: u8,
    }

    fn rate() -> f64 {
        1e-3
    }

    impl Section for Outer {}

    fn row(doc: &SectionDoc, table: &str, field: &str) -> (String, String, String, String) {
        let f = doc.table(table).unwrap().fields.iter().find(|f| f.name == field).unwrap().clone();
        (f.ty.into(), f.default.into(), f.range.into(), f.doc.into())
    }

    #[test]
    fn the_derive_reads_types_defaults_ranges_and_docs_from_the_struct() {
        let doc = section_doc::<Outer>();
        assert!(doc.described);
        let paths: Vec<(&str, bool)> = doc.tables.iter().map(|t| (t.path.as_str(), t.array)).collect();
        assert_eq!(paths, [("", false), ("inner", false), ("rules", true)]);
        let s = |a: &str, b: &str, c: &str, d: &str| (a.to_string(), b.to_string(), c.to_string(), d.to_string());
        assert_eq!(row(&doc, "", "path"), s("string", "required", "", "Where the data is."));
        assert_eq!(row(&doc, "", "lr"), s("float", "0.001", "> 0", "The rate, over two lines."));
        assert_eq!(row(&doc, "", "betas"), s("list of 2 float", "[0.0, 0.0]", "", "Betas."));
        assert_eq!(row(&doc, "", "mode"), s("\"fast_path\" | \"slow\" | \"off\"", "\"fast_path\"", "", "The mode."));
        assert_eq!(row(&doc, "", "inner"), s("table", "see below", "", "The inner table."));
        assert_eq!(row(&doc, "", "rules").0, "list of table");
        assert_eq!(row(&doc, "", "gamma"), s("float or \"none\"", "-", "", "Written by hand."));
        assert!(doc.table("").unwrap().fields.iter().all(|f| f.name != "hidden"), "serde(skip) is no field");
        assert_eq!(row(&doc, "inner", "count"), s("integer", "0", ">= 1", "How many."));
        assert_eq!(row(&doc, "inner", "name").1, "-");
        assert_eq!(doc.table("inner").unwrap().type_name, "Inner");
    }

    #[test]
    fn unknown_fields_are_named_with_the_closest_known_one() {
        let doc = section_doc::<Outer>();
        assert_eq!(doc.unknown_field("lr"), None);
        assert_eq!(doc.unknown_field("lrr").as_deref(), Some("unknown field `lrr`, did you mean `lr`?"));
        assert_eq!(doc.unknown_field("inner.cont").as_deref(), Some("unknown field `cont`, did you mean `count`?"));
        assert!(doc.unknown_field("zzzzzz").unwrap().contains("(fields: path, lr, betas, mode, inner, rules, gamma)"));
        assert_eq!(SectionDoc::default().unknown_field("anything"), None, "an undescribed section judges nothing");
    }
}
