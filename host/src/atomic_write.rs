//! Durable file writes: bytes fsynced before a rename publishes them, so a crash leaves the old
//! file or the new one, never a torn one.

use anyhow::{Context, Result};
use std::{
    fs::{self, File},
    io::Write,
    path::Path,
};

pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path.file_name().with_context(|| format!("{}: not a file name", path.display()))?.to_string_lossy();
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let written = write_synced(&tmp, bytes).and_then(|_| {
        fs::rename(&tmp, path)
            .with_context(|| format!("writing {} (renaming {} over it)", path.display(), tmp.display()))
    });
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written?;
    sync_dir(path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")))
}

/// Fail now, naming `path`, if a file could not be written there later (a read-only or missing
/// folder, a folder in the file's place): a temporary file is created beside it and removed.
pub fn check_writable(path: &Path) -> Result<()> {
    if path.is_dir() {
        anyhow::bail!("cannot write {}: it is a folder", path.display());
    }
    let name = path.file_name().with_context(|| format!("{}: not a file name", path.display()))?.to_string_lossy();
    let probe = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    File::create(&probe).with_context(|| format!("cannot write {}", path.display()))?;
    let _ = fs::remove_file(&probe);
    Ok(())
}

/// Write and fsync, so the bytes are on disk before a rename publishes them.
pub fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).with_context(|| format!("writing {}", path.display()))?;
    f.write_all(bytes).with_context(|| format!("writing {}", path.display()))?;
    f.sync_all().with_context(|| format!("syncing {}", path.display()))
}

pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).with_context(|| format!("syncing {}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_place_results_cannot_go_is_named_before_any_work() {
        let root = tempfile::tempdir().unwrap();
        check_writable(&root.path().join("eval.json")).unwrap();
        assert_eq!(fs::read_dir(root.path()).unwrap().count(), 0, "the probe file is removed");
        fs::create_dir(root.path().join("eval.json")).unwrap();
        let err = format!("{:#}", check_writable(&root.path().join("eval.json")).unwrap_err());
        assert!(err.ends_with("eval.json: it is a folder"), "{err}");
        let err = format!("{:#}", check_writable(&root.path().join("gone/eval.json")).unwrap_err());
        assert!(err.contains("cannot write") && err.contains("gone/eval.json"), "{err}");
    }
}
