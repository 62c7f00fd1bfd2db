//! The experiment folder's config file name and its JSON files, read back capped and written
//! whole: what the folder's other modules share.

use crate::atomic_write::{write_atomic, write_synced};
use anyhow::{Context, Result};
use serde::{de::DeserializeOwned, Serialize};
use std::path::Path;

pub const CONFIG: &str = "config.toml";
/// JSON files the host writes (manifest, summaries, states) are far below this.
pub(crate) const MAX_JSON_BYTES: u64 = 64 << 20;

/// A JSON file the host wrote, read back (a regular file, size capped), errors naming it.
pub fn read_json<T: DeserializeOwned>(path: &Path) -> Result<T> {
    let text = input_files::read_to_string_capped(path, MAX_JSON_BYTES)?;
    serde_json::from_str(&text).with_context(|| format!("{}: not valid", path.display()))
}

pub(crate) fn write_json(path: &Path, value: &impl Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(value)? + "\n";
    write_synced(path, text.as_bytes())
}

/// Replace `path` whole: a temporary file beside it, fsynced, renamed over it.
pub fn write_json_atomic(path: &Path, value: &impl Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(value)? + "\n";
    write_atomic(path, text.as_bytes())
}
