//! `metrics.jsonl`: one JSON record per logged step, appended and flushed line by line. Read
//! through a line cap (a corrupt file cannot take the reader's memory), cut back atomically on
//! resume.

use crate::atomic_write::write_synced;
use anyhow::{Context, Result};
use serde_json::Value;
use std::path::Path;

pub const METRICS: &str = "metrics.jsonl";
/// A metrics record is about 1 KB; anything past this is not one.
pub const MAX_LINE: usize = 1 << 20;

/// The file's lines, each at most [`MAX_LINE`] bytes (a regular file only).
pub fn lines(path: &Path) -> Result<input_files::Lines<std::io::BufReader<std::fs::File>>, input_files::InputError> {
    input_files::lines(path, MAX_LINE)
}

/// The records up to and including `step`, in file order; a line that is not a record (cut
/// short by a crash) is dropped, and so is everything from a line that cannot be read on.
pub fn records_through(path: &Path, step: u64) -> Result<Vec<String>> {
    let mut kept = Vec::new();
    let lines = match lines(path) {
        Ok(l) => l,
        Err(input_files::InputError::NotFound { .. }) => return Ok(kept),
        Err(e) => return Err(e.into()),
    };
    for line in lines {
        let line = match line {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!("{e}: the rest of the file is dropped");
                break;
            }
        };
        let record_step = serde_json::from_str::<Value>(&line).ok().and_then(|v| v["step"].as_u64());
        if record_step.is_some_and(|s| s <= step) {
            kept.push(line);
        }
    }
    Ok(kept)
}

/// Cut the file back to the records through `step` (written to a temporary file and renamed
/// over it: a crash leaves the old file or the new one).
pub fn truncate_after(exp_dir: &Path, step: u64) -> Result<()> {
    let path = exp_dir.join(METRICS);
    let kept: String = records_through(&path, step)?.into_iter().map(|l| l + "\n").collect();
    let tmp = exp_dir.join(format!(".{METRICS}.tmp"));
    write_synced(&tmp, kept.as_bytes())?;
    std::fs::rename(&tmp, &path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

/// `key` of the last record that has it as a number.
pub fn last_number(exp_dir: &Path, key: &str) -> Option<f64> {
    lines(&exp_dir.join(METRICS))
        .ok()?
        .map_while(Result::ok)
        .filter_map(|l| serde_json::from_str::<Value>(&l).ok()?.get(key)?.as_f64())
        .last()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_keeps_whole_records_through_the_step() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(METRICS);
        std::fs::write(
            &path,
            "{\"step\":1,\"tau_hat\":1.5}\n{\"step\":2,\"tau_hat\":1.7}\n{\"step\":3}\n{\"step\":4,\"lo",
        )
        .unwrap();
        assert_eq!(last_number(dir.path(), "tau_hat"), Some(1.7));
        truncate_after(dir.path(), 2).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"step\":1,\"tau_hat\":1.5}\n{\"step\":2,\"tau_hat\":1.7}\n"
        );
        assert!(!dir.path().join(".metrics.jsonl.tmp").exists());
    }
}
