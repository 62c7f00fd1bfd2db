//! An arm's `sweep`: the values its fields take, as points the A/B runs one by one.
//!
//! ```toml
//! [arms.adamw]
//! optimizer = { plugin = "adamw" }
//! sweep = { "optimizer.lr" = [1e-3, 3e-3, 1e-2] }          # every combination of the lists
//! # or points that set fields together:
//! # sweep = [{ "optimizer.lr" = 1e-3, "optimizer.adamw.lr" = 1e-3 }, { ... }]
//! ```
//!
//! Fields are dotted paths into the run config (quoted, or as nested tables). Each point is
//! named for its folder by its values: `lr=0.003`, `lr=0.003-momentum=0.9`.

use anyhow::{bail, Result};

/// One setting of the swept fields.
#[derive(Debug, Clone, PartialEq)]
pub struct SweepPoint {
    /// The folder-name part: `lr=0.003`, `optimizer.lr=0.003-adamw.lr=0.003`.
    pub label: String,
    /// (dotted field, value), one per swept field.
    pub values: Vec<(String, toml::Value)>,
}

/// The swept fields and the points of a `sweep` value, in order (the first field varies
/// slowest). Errors say what is wrong without the arm (the caller names it).
pub fn expand(sweep: &toml::Value) -> Result<(Vec<String>, Vec<SweepPoint>)> {
    let points: Vec<Vec<(String, toml::Value)>> = match sweep {
        toml::Value::Table(t) => {
            let lists = flatten(t);
            let mut points = vec![Vec::new()];
            for (field, values) in &lists {
                let toml::Value::Array(values) = values else { bail!("`sweep.{field}`: expected a list of values") };
                if values.is_empty() {
                    bail!("`sweep.{field}`: no values");
                }
                points = points
                    .into_iter()
                    .flat_map(|p| values.iter().map(move |v| [p.clone(), vec![(field.clone(), v.clone())]].concat()))
                    .collect();
            }
            points
        }
        toml::Value::Array(list) => list
            .iter()
            .enumerate()
            .map(|(i, p)| match p {
                toml::Value::Table(t) => Ok(flatten(t)),
                _ => bail!("`sweep[{i}]`: expected a table of fields and values"),
            })
            .collect::<Result<_>>()?,
        _ => bail!("`sweep`: expected a table (field = [values]) or a list of tables (one per point)"),
    };
    let fields: Vec<String> = points.first().map(|p| p.iter().map(|(f, _)| f.clone()).collect()).unwrap_or_default();
    if fields.is_empty() {
        bail!("`sweep`: sweeps no field");
    }
    for (i, p) in points.iter().enumerate() {
        let these: Vec<&String> = p.iter().map(|(f, _)| f).collect();
        if these.len() != fields.len() || these.iter().zip(&fields).any(|(a, b)| *a != b) {
            bail!("`sweep[{i}]`: sets {these:?}, the first point {fields:?}: every point sets the same fields");
        }
    }
    for f in &fields {
        if matches!(f.as_str(), "name" | "seed" | "sweep") || f.ends_with(".plugin") {
            bail!("`sweep`: `{f}` cannot be swept (the A/B sets names and seeds; another plugin is another arm)");
        }
    }
    let keys = short_keys(&fields);
    let points: Vec<SweepPoint> = points
        .into_iter()
        .map(|values| {
            let label = values
                .iter()
                .zip(&keys)
                .map(|((_, v), k)| format!("{k}={}", value_text(v)))
                .collect::<Vec<_>>()
                .join("-");
            SweepPoint { label, values }
        })
        .collect();
    for (i, p) in points.iter().enumerate() {
        if points[..i].iter().any(|q| q.label == p.label) {
            bail!("`sweep`: two points are both named `{}` (a value repeated?)", p.label);
        }
    }
    Ok((fields, points))
}

/// Nested tables as dotted paths to their leaves (`{ optimizer = { lr = [..] } }` and
/// `{ "optimizer.lr" = [..] }` alike).
fn flatten(t: &toml::Table) -> Vec<(String, toml::Value)> {
    let mut out = Vec::new();
    for (k, v) in t {
        match v {
            toml::Value::Table(inner) => out.extend(flatten(inner).into_iter().map(|(f, v)| (format!("{k}.{f}"), v))),
            _ => out.push((k.clone(), v.clone())),
        }
    }
    out
}

/// Each field's shortest dotted suffix no other field ends with (`optimizer.lr` -> `lr`).
fn short_keys(fields: &[String]) -> Vec<String> {
    fields
        .iter()
        .map(|f| {
            let parts: Vec<&str> = f.split('.').collect();
            (1..=parts.len())
                .map(|n| parts[parts.len() - n..].join("."))
                .find(|s| fields.iter().filter(|g| *g == s || g.ends_with(&format!(".{s}"))).count() == 1)
                .unwrap_or_else(|| f.clone())
        })
        .collect()
}

/// A value as folder-name text: numbers as written by Rust (`0.003`), strings as they are;
/// anything outside letters, digits, `-`, `_`, `.` becomes `_`.
fn value_text(v: &toml::Value) -> String {
    let raw = match v {
        toml::Value::String(s) => s.clone(),
        toml::Value::Float(f) => format!("{f}"),
        other => other.to_string(),
    };
    raw.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect()
}

/// Set a point's values in a run config's table, creating tables on the way.
pub fn apply(table: &mut toml::Table, point: &SweepPoint) -> Result<()> {
    for (field, value) in &point.values {
        crate::config::set_dotted(table, field, value.clone()).map_err(|e| anyhow::anyhow!(e.message("`sweep`")))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sweep(text: &str) -> Result<(Vec<String>, Vec<SweepPoint>)> {
        let t: toml::Table = toml::from_str(&format!("sweep = {text}")).unwrap();
        expand(&t["sweep"])
    }

    fn labels(points: &[SweepPoint]) -> Vec<&str> {
        points.iter().map(|p| p.label.as_str()).collect()
    }

    #[test]
    fn lists_give_every_combination_and_points_set_fields_together() {
        let (fields, points) = sweep(r#"{ "optimizer.lr" = [1e-3, 3e-3, 1e-2] }"#).unwrap();
        assert_eq!(fields, ["optimizer.lr"]);
        assert_eq!(labels(&points), ["lr=0.001", "lr=0.003", "lr=0.01"]);
        assert_eq!(points[1].values, [("optimizer.lr".to_string(), toml::Value::Float(3e-3))]);
        // Nested tables are the same fields; two lists multiply.
        let (fields, points) = sweep(r#"{ optimizer = { lr = [0.01, 0.02], momentum = [0.9, 0.95] } }"#).unwrap();
        assert_eq!(fields, ["optimizer.lr", "optimizer.momentum"]);
        assert_eq!(
            labels(&points),
            ["lr=0.01-momentum=0.9", "lr=0.01-momentum=0.95", "lr=0.02-momentum=0.9", "lr=0.02-momentum=0.95"]
        );
        // Tied fields: names keep what tells them apart.
        let (_, points) = sweep(r#"[{ "optimizer.lr" = 0.01, "optimizer.adamw.lr" = 1e-3 }, { "optimizer.lr" = 0.02, "optimizer.adamw.lr" = 2e-3 }]"#).unwrap();
        assert_eq!(labels(&points), ["adamw.lr=0.001-optimizer.lr=0.01", "adamw.lr=0.002-optimizer.lr=0.02"]);
        let (_, points) =
            sweep(r#"{ "drafter.layer_types" = [["full", "sliding"]], "data.path" = ["a b/c.json"] }"#).unwrap();
        assert_eq!(labels(&points), [r#"path=a_b_c.json-layer_types=__full____sliding__"#]);
        let mut t: toml::Table = toml::from_str("[optimizer]\nplugin = \"adamw\"\nlr = 1.0").unwrap();
        apply(&mut t, &points[0]).unwrap();
        assert_eq!(t["data"]["path"].as_str(), Some("a b/c.json"));
        assert_eq!(t["optimizer"]["lr"].as_float(), Some(1.0));
    }

    #[test]
    fn sweeps_that_cannot_be_run_are_refused() {
        for (text, want) in [
            (r#"{ "optimizer.lr" = 0.1 }"#, "expected a list"),
            (r#"{ "optimizer.lr" = [] }"#, "no values"),
            ("{}", "sweeps no field"),
            (r#"[{ "optimizer.lr" = 0.1 }, { "optimizer.wd" = 0.1 }]"#, "every point sets the same fields"),
            (r#"{ seed = [1, 2] }"#, "`seed` cannot be swept"),
            (r#"{ "optimizer.plugin" = ["adamw", "muon"] }"#, "cannot be swept"),
            (r#"{ "optimizer.lr" = [0.1, 0.1] }"#, "both named `lr=0.1`"),
            ("3", "expected a table"),
        ] {
            let err = sweep(text).unwrap_err().to_string();
            assert!(err.contains(want), "{text}: {err}");
        }
    }
}
