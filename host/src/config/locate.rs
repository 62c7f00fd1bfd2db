//! Where in the config file an error points: TOML parse errors and plugin errors as
//! `file:line`.

use std::path::Path;

/// A TOML parse error as `file:line:col: message`.
pub fn toml_error(path: &Path, text: &str, e: &toml::de::Error) -> String {
    match e.span() {
        Some(span) => {
            let (line, col) = line_col(text, span.start);
            format!("{}:{line}:{col}: {}", path.display(), e.message())
        }
        None => format!("{}: {}", path.display(), e.message()),
    }
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
    (line, col)
}

/// Where `key` is set inside `[section]` of the config text (1-based line), to point plugin
/// errors at the file.
pub fn locate_key(text: &str, section: &str, key: &str) -> Option<usize> {
    let mut current = String::new();
    for (i, line) in text.lines().enumerate() {
        let l = line.trim();
        if let Some(name) = l.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
            current = name.trim().to_string();
        } else if current == section {
            if let Some((k, _)) = l.split_once('=') {
                if k.trim() == key {
                    return Some(i + 1);
                }
            }
        }
    }
    None
}

/// For a plugin error like "[optimizer] plugin `adamw`: unknown field `lrr`, ...", the config
/// line that set the field, if any.
pub fn locate_plugin_error(text: &str, message: &str) -> Option<usize> {
    let section = message.strip_prefix('[')?.split(']').next()?;
    let field = ["unknown field `", "field `"].iter().find_map(|p| {
        let rest = &message[message.find(p)? + p.len()..];
        rest.split('`').next()
    })?;
    locate_key(text, section, field).or_else(|| {
        // A missing field has no line: point at the section header instead.
        text.lines().position(|l| l.trim() == format!("[{section}]")).map(|i| i + 1)
    })
}
