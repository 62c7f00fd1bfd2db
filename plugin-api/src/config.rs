//! Plugin config sections arrive as TOML text; this parses one with the key named in errors.

use crate::PluginError;
use serde::de::DeserializeOwned;

/// Parse a plugin's config section. Errors read `field `key`: why`, so the host can point at the
/// line in the user's file.
pub fn parse_section<T: DeserializeOwned>(text: &str) -> Result<T, PluginError> {
    toml::from_str(text).map_err(|e| {
        let msg = e.message().to_string();
        let key = e.span().and_then(|span| {
            let line_start = text[..span.start.min(text.len())].rfind('\n').map_or(0, |i| i + 1);
            let line = text[line_start..].lines().next()?;
            let key = line.split_once('=')?.0.trim().trim_matches('"');
            (!key.is_empty()).then(|| key.to_string())
        });
        match key {
            Some(k) if !msg.contains(&format!("`{k}`")) => PluginError::new(format!("field `{k}`: {msg}")),
            _ => PluginError::new(msg),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct S {
        a: usize,
        #[serde(default)]
        b: f64,
    }

    #[test]
    fn errors_name_the_key() {
        let e = parse_section::<S>("a = 1\nb = \"x\"\n").unwrap_err().to_string();
        assert!(e.starts_with("field `b`: invalid type"), "{e}");
        let e = parse_section::<S>("a = 1\nc = 2\n").unwrap_err().to_string();
        assert!(e.contains("unknown field `c`"), "{e}");
        let e = parse_section::<S>("b = 1.0\n").unwrap_err().to_string();
        assert!(e.contains("missing field `a`"), "{e}");
        assert_eq!(parse_section::<S>("a = 3").unwrap().a, 3);
    }
}
