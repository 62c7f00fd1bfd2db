//! The one rule of every command that writes an output folder or file (`--out`, `--json`,
//! `--trace`): it never writes into, replaces or deletes a folder that holds an experiment. The
//! output is refused when it is an experiment folder, lies inside one, or (a folder) holds one at
//! any depth; `--force` never lifts that. Checked before any work, on the path with its symbolic
//! links resolved, so `--out link-to-an-experiment` and `--out a/../exp` are refused too.
//!
//! An experiment is a folder with `config.toml` and `manifest.json` (or `config.toml` and a
//! `checkpoints/` folder, for one whose manifest was lost): what `Experiment::create` writes.

use super::{manifest::MANIFEST, CONFIG};
use anyhow::{bail, Context, Result};
use std::path::{Component, Path, PathBuf};

/// At most this many entries are looked at under an existing output folder; a larger folder is
/// refused rather than walked for minutes (it is no folder a command's output belongs in).
pub const MAX_SCANNED: usize = 100_000;

/// Whether `dir` is an experiment folder.
pub fn is_experiment(dir: &Path) -> bool {
    dir.join(CONFIG).is_file() && (dir.join(MANIFEST).is_file() || dir.join("checkpoints").is_dir())
}

/// Refuse `out` (given as `flag`) as an output folder when it is an experiment, lies inside one,
/// or holds one at any depth. Returns `out` absolute, its symbolic links resolved (as far as it
/// exists).
pub fn check_out_folder(flag: &str, out: &Path) -> Result<PathBuf> {
    let abs = resolve(out).with_context(|| format!("{flag} {}", out.display()))?;
    check_ancestors(flag, out, &abs)?;
    if abs.is_dir() {
        if let Some(inner) =
            find_experiment_under(&abs, MAX_SCANNED).with_context(|| format!("{flag} {}", out.display()))?
        {
            bail!(
                "{flag} {}: holds the experiment {}; a command's output never replaces or writes into a folder \
                 with experiments in it (choose a new folder)",
                out.display(),
                inner.display()
            );
        }
    }
    Ok(abs)
}

/// Refuse `file` (given as `flag`) as an output file when its folder is an experiment or lies
/// inside one (writing it could overwrite an experiment's own files).
pub fn check_out_file(flag: &str, file: &Path) -> Result<PathBuf> {
    let abs = resolve(file).with_context(|| format!("{flag} {}", file.display()))?;
    check_ancestors(flag, file, &abs)?;
    Ok(abs)
}

/// `abs` itself (when it exists) and every folder above it: none may be an experiment.
fn check_ancestors(flag: &str, given: &Path, abs: &Path) -> Result<()> {
    if abs.exists() && is_experiment(abs) {
        bail!(
            "{flag} {}: is an experiment folder; a command's output never replaces or writes into an experiment \
             (choose a new folder outside it)",
            given.display()
        );
    }
    if let Some(exp) = abs.ancestors().skip(1).find(|a| is_experiment(a)) {
        bail!(
            "{flag} {}: lies inside the experiment {}; a command's output never writes into an experiment (choose a \
             folder outside it)",
            given.display(),
            exp.display()
        );
    }
    Ok(())
}

/// `path` absolute with the symbolic links of its existing part resolved; the part that does
/// not exist yet is appended as given (`..` in it taken lexically).
fn resolve(path: &Path) -> Result<PathBuf> {
    let abs = if path.is_absolute() { path.to_path_buf() } else { std::env::current_dir()?.join(path) };
    let mut missing = Vec::new();
    let mut existing = abs.as_path();
    loop {
        match existing.canonicalize() {
            Ok(real) => {
                let mut out = real;
                for part in missing.iter().rev() {
                    match part {
                        Component::ParentDir => {
                            out.pop();
                        }
                        Component::Normal(name) => out.push(name),
                        _ => {}
                    }
                }
                return Ok(out);
            }
            Err(_) => {
                let name = existing.components().next_back().context("no folder of it exists")?;
                missing.push(name);
                existing = existing.parent().context("no folder of it exists")?;
            }
        }
    }
}

/// The first experiment folder at any depth under `dir` (`dir` itself not counted), walked
/// without following symbolic links (a link is replaced or removed as a link, never followed).
fn find_experiment_under(dir: &Path, limit: usize) -> Result<Option<PathBuf>> {
    let mut stack = vec![dir.to_path_buf()];
    let mut seen = 0usize;
    while let Some(d) = stack.pop() {
        let entries = std::fs::read_dir(&d).with_context(|| format!("reading {}", d.display()))?;
        for e in entries {
            let e = e.with_context(|| format!("reading {}", d.display()))?;
            seen += 1;
            if seen > limit {
                bail!("holds more than {limit} files and folders; not an output folder (choose a new folder)");
            }
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                let p = e.path();
                if is_experiment(&p) {
                    return Ok(Some(p));
                }
                stack.push(p);
            }
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    /// An experiment folder as `Experiment::create` leaves it.
    fn experiment(dir: &Path) {
        fs::create_dir_all(dir.join("checkpoints")).unwrap();
        fs::write(dir.join(CONFIG), "name = \"x\"\n").unwrap();
        fs::write(dir.join(MANIFEST), "{}").unwrap();
    }

    #[test]
    fn an_output_that_is_in_or_holds_an_experiment_is_refused() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        experiment(&r.join("experiments/run1"));
        experiment(&r.join("experiments/deep/er/run2"));
        fs::create_dir_all(r.join("free/sub")).unwrap();
        std::os::unix::fs::symlink(r.join("experiments/run1"), r.join("link")).unwrap();
        let refused = |out: &Path, why: &str| {
            let err = format!("{:#}", check_out_folder("--out", out).unwrap_err());
            assert!(err.starts_with(&format!("--out {}: ", out.display())) && err.contains(why), "{err}");
        };
        refused(&r.join("experiments/run1"), "is an experiment folder");
        refused(&r.join("experiments/run1/checkpoints"), "lies inside the experiment");
        refused(&r.join("experiments/run1/new/deeper"), "lies inside the experiment");
        refused(&r.join("experiments"), "holds the experiment");
        refused(&r.join("experiments/deep"), "holds the experiment");
        refused(r, "holds the experiment");
        refused(&r.join("free/../experiments"), "holds the experiment");
        refused(&r.join("link"), "is an experiment folder");
        refused(&r.join("link/zlab"), "lies inside the experiment");
        // Beside them, or new: fine.
        for ok in [r.join("free"), r.join("free/sub"), r.join("zlab"), r.join("experiments/zlab"), r.join("a/b/c")] {
            check_out_folder("--out", &ok).unwrap();
        }
        assert_eq!(check_out_folder("--out", &r.join("free/../zlab")).unwrap(), r.canonicalize().unwrap().join("zlab"));
        // Files: not inside an experiment.
        check_out_file("--json", &r.join("experiments/bench.json")).unwrap();
        let err = format!("{:#}", check_out_file("--out", &r.join("experiments/run1/metrics.jsonl")).unwrap_err());
        assert!(err.contains("lies inside the experiment"), "{err}");
    }

    #[test]
    fn a_symbolic_link_inside_the_output_is_not_followed() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        experiment(&r.join("run1"));
        fs::create_dir(r.join("out")).unwrap();
        std::os::unix::fs::symlink(r.join("run1"), r.join("out/run1")).unwrap();
        // Replacing `out` removes the link, never what it points at.
        check_out_folder("--out", &r.join("out")).unwrap();
    }

    #[test]
    fn a_huge_folder_is_refused_not_walked() {
        let root = tempfile::tempdir().unwrap();
        let d = root.path().join("big");
        fs::create_dir(&d).unwrap();
        for i in 0..=10 {
            fs::File::create(d.join(i.to_string())).unwrap();
        }
        let err = format!("{:#}", find_experiment_under(&d, 10).unwrap_err());
        assert!(err.contains("holds more than 10 files"), "{err}");
        assert_eq!(find_experiment_under(&d, 11).unwrap(), None);
    }
}
