//! The one rule of every command that writes an output folder or file (`--out`, `--json`,
//! `--trace`): it never writes into, replaces or deletes a folder that holds an experiment, nor
//! any of the command's own inputs. The output is refused when it is part of an experiment (the
//! experiment folder, its `checkpoints/` or a checkpoint, wherever they are mounted), lies inside
//! one, or (a folder) holds one at any depth; and when it is, holds or lies inside one of the
//! command's inputs (its config file, data, target, ...), found by path and by device and inode,
//! so a hard link or a bind mount of an input is refused too. `--force` never lifts that.
//! Checked before any work, on the path with its symbolic links resolved, so
//! `--out link-to-an-experiment` and `--out a/../exp` are refused; and checked again when the
//! output is written or replaced ([`crate::output`] opens outputs without following links).
//!
//! An experiment is a folder with `config.toml` and `manifest.json` (or `config.toml` and a
//! `checkpoints/` folder, for one whose manifest was lost): what `Experiment::create` writes. Its
//! `checkpoints/` folder is known by what is inside (a `step-N/` folder with `checksums.json`),
//! and so is a checkpoint (`checksums.json` and `trainer_state.json`), so one mounted or linked
//! elsewhere is still part of an experiment.

use super::{files::CONFIG, manifest::MANIFEST};
use anyhow::{bail, Context, Result};
use std::{
    os::unix::fs::MetadataExt,
    path::{Component, Path, PathBuf},
};

/// At most this many entries are looked at under an existing output folder; a larger folder is
/// refused rather than walked for minutes (it is no folder a command's output belongs in).
pub const MAX_SCANNED: usize = 100_000;

/// Whether `dir` is an experiment folder.
pub fn is_experiment(dir: &Path) -> bool {
    dir.join(CONFIG).is_file() && (dir.join(MANIFEST).is_file() || dir.join("checkpoints").is_dir())
}

/// What part of an experiment `dir` is, if any: the experiment folder, its checkpoints folder
/// (known by a `step-N/checksums.json` inside), or one checkpoint.
pub fn experiment_part(dir: &Path) -> Option<&'static str> {
    if is_experiment(dir) {
        return Some("an experiment folder");
    }
    if is_checkpoint(dir) {
        return Some("an experiment's checkpoint");
    }
    let entries = std::fs::read_dir(dir).ok()?;
    let holds_a_checkpoint = entries.flatten().take(MAX_SCANNED).any(|e| {
        let name = e.file_name();
        let step = name.to_str().and_then(|n| n.strip_prefix("step-")).is_some_and(|n| n.parse::<u64>().is_ok());
        step && e.file_type().is_ok_and(|t| t.is_dir()) && e.path().join("checksums.json").is_file()
    });
    holds_a_checkpoint.then_some("an experiment's checkpoints folder")
}

fn is_checkpoint(dir: &Path) -> bool {
    dir.join("checksums.json").is_file() && dir.join("trainer_state.json").is_file()
}

/// A file's or folder's device and inode: what a hard link or a bind mount of it shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileId {
    dev: u64,
    ino: u64,
}

impl FileId {
    pub fn of(meta: &std::fs::Metadata) -> Self {
        Self { dev: meta.dev(), ino: meta.ino() }
    }

    pub fn new(dev: u64, ino: u64) -> Self {
        Self { dev, ino }
    }
}

/// One input of a command, which its outputs may never be, hold or lie inside.
#[derive(Debug, Clone)]
pub struct Input {
    /// What it is, as the user named it: "the config file", "field `data.path`", "--prompts".
    pub what: String,
    pub path: PathBuf,
    /// Its path with links resolved, and its identity (None where it does not exist).
    real: Option<(PathBuf, FileId, bool)>,
}

impl Input {
    pub fn new(what: impl Into<String>, path: &Path) -> Self {
        let real = path.canonicalize().ok().and_then(|p| {
            let meta = std::fs::metadata(&p).ok()?;
            Some((p, FileId::of(&meta), meta.is_dir()))
        });
        Self { what: what.into(), path: path.to_path_buf(), real }
    }

    fn id(&self) -> Option<FileId> {
        self.real.as_ref().map(|r| r.1)
    }

    fn describe(&self) -> String {
        format!("{} {}", self.what, self.path.display())
    }
}

/// The input `id` is (by device and inode), if any.
pub fn input_with_id(inputs: &[Input], id: FileId) -> Option<&Input> {
    inputs.iter().find(|i| i.id() == Some(id))
}

/// Refuse `out` (given as `flag`) as an output folder when it is part of an experiment, lies
/// inside one, or holds one at any depth, or is, holds or lies inside one of `inputs`. Returns
/// `out` absolute, its symbolic links resolved (as far as it exists).
pub fn check_out_folder(flag: &str, out: &Path, inputs: &[Input]) -> Result<PathBuf> {
    let abs = resolve(out).with_context(|| format!("{flag} {}", out.display()))?;
    check_ancestors(flag, out, &abs)?;
    if abs.is_dir() {
        if let Some(found) =
            find_under(&abs, inputs, MAX_SCANNED).with_context(|| format!("{flag} {}", out.display()))?
        {
            bail!("{flag} {}: {}", out.display(), found.refusal());
        }
    }
    check_inputs(flag, out, &abs, inputs, true)?;
    Ok(abs)
}

/// Refuse `file` (given as `flag`) as an output file when its folder is part of an experiment or
/// lies inside one (writing it could overwrite an experiment's own files), or it is one of
/// `inputs` (by path, or by device and inode: a hard link) or lies inside one.
pub fn check_out_file(flag: &str, file: &Path, inputs: &[Input]) -> Result<PathBuf> {
    let abs = resolve(file).with_context(|| format!("{flag} {}", file.display()))?;
    check_ancestors(flag, file, &abs)?;
    check_inputs(flag, file, &abs, inputs, false)?;
    Ok(abs)
}

/// `abs` against each input: not the same path or file, not inside an input folder, and (a
/// folder output) not above an input.
fn check_inputs(flag: &str, given: &Path, abs: &Path, inputs: &[Input], folder: bool) -> Result<()> {
    let id = std::fs::symlink_metadata(abs).ok().map(|m| FileId::of(&m));
    for input in inputs {
        let Some((real, input_id, input_is_dir)) = &input.real else { continue };
        if real == abs || id == Some(*input_id) {
            bail!(
                "{flag} {}: is {}; a command's output never replaces one of its inputs (choose another path)",
                given.display(),
                input.describe()
            );
        }
        if *input_is_dir && abs.starts_with(real) {
            bail!(
                "{flag} {}: lies inside {}; a command's output never writes into one of its inputs (choose another \
                 path)",
                given.display(),
                input.describe()
            );
        }
        if folder && real.starts_with(abs) {
            bail!(
                "{flag} {}: holds {}; a command's output never replaces a folder with one of its inputs in it \
                 (choose a new folder)",
                given.display(),
                input.describe()
            );
        }
    }
    Ok(())
}

/// `abs` itself (when it exists) and every folder above it: none may be part of an experiment.
pub fn check_ancestors(flag: &str, given: &Path, abs: &Path) -> Result<()> {
    if let Some(part) = abs.exists().then(|| experiment_part(abs)).flatten() {
        bail!(
            "{flag} {}: is {part}; a command's output never replaces or writes into an experiment (choose a new \
             folder outside it)",
            given.display()
        );
    }
    if let Some((exp, part)) = abs.ancestors().skip(1).find_map(|a| experiment_part(a).map(|p| (a, p))) {
        bail!(
            "{flag} {}: lies inside {part} {}; a command's output never writes into an experiment (choose a folder \
             outside it)",
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

/// What a folder about to be written or replaced holds that it must not.
#[derive(Debug)]
pub enum Found {
    Experiment(PathBuf, &'static str),
    Input(PathBuf, String),
}

impl Found {
    /// What was found, with its path.
    pub fn what(&self) -> String {
        match self {
            Found::Experiment(p, part) => format!("{part} {}", p.display()),
            Found::Input(p, what) => format!("{} ({what}, one of the command's inputs)", p.display()),
        }
    }

    /// Why the output is refused, after `FLAG PATH: `.
    pub fn refusal(&self) -> String {
        match self {
            Found::Experiment(p, part) => format!(
                "holds {part} {}; a command's output never replaces or writes into a folder with experiments in it \
                 (choose a new folder)",
                p.display()
            ),
            Found::Input(p, what) => format!(
                "holds {p} ({what}, one of the command's inputs); a command's output never replaces a folder with \
                 one of its inputs in it (choose a new folder)",
                p = p.display()
            ),
        }
    }
}

/// The first part of an experiment, or entry that is one of `inputs` (by device and inode), at any
/// depth under `dir` (`dir` itself not counted), walked without following symbolic links (a link
/// is replaced or removed as a link, never followed).
pub fn find_under(dir: &Path, inputs: &[Input], limit: usize) -> Result<Option<Found>> {
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
            let p = e.path();
            let Ok(meta) = std::fs::symlink_metadata(&p) else { continue };
            if let Some(input) = input_with_id(inputs, FileId::of(&meta)) {
                return Ok(Some(Found::Input(p, input.what.clone())));
            }
            if meta.is_dir() {
                if let Some(part) = experiment_part(&p) {
                    return Ok(Some(Found::Experiment(p, part)));
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
            let err = format!("{:#}", check_out_folder("--out", out, &[]).unwrap_err());
            assert!(err.starts_with(&format!("--out {}: ", out.display())) && err.contains(why), "{err}");
        };
        refused(&r.join("experiments/run1"), "is an experiment folder");
        refused(&r.join("experiments/run1/checkpoints"), "lies inside an experiment folder");
        refused(&r.join("experiments/run1/new/deeper"), "lies inside an experiment folder");
        refused(&r.join("experiments"), "holds an experiment folder");
        refused(&r.join("experiments/deep"), "holds an experiment folder");
        refused(r, "holds an experiment folder");
        refused(&r.join("free/../experiments"), "holds an experiment folder");
        refused(&r.join("link"), "is an experiment folder");
        refused(&r.join("link/zlab"), "lies inside an experiment folder");
        // Beside them, or new: fine.
        for ok in [r.join("free"), r.join("free/sub"), r.join("zlab"), r.join("experiments/zlab"), r.join("a/b/c")] {
            check_out_folder("--out", &ok, &[]).unwrap();
        }
        assert_eq!(
            check_out_folder("--out", &r.join("free/../zlab"), &[]).unwrap(),
            r.canonicalize().unwrap().join("zlab")
        );
        // Files: not inside an experiment.
        check_out_file("--json", &r.join("experiments/bench.json"), &[]).unwrap();
        let err = format!("{:#}", check_out_file("--out", &r.join("experiments/run1/metrics.jsonl"), &[]).unwrap_err());
        assert!(err.contains("lies inside an experiment folder"), "{err}");
    }

    #[test]
    fn a_symbolic_link_inside_the_output_is_not_followed() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        experiment(&r.join("run1"));
        fs::create_dir(r.join("out")).unwrap();
        std::os::unix::fs::symlink(r.join("run1"), r.join("out/run1")).unwrap();
        // Replacing `out` removes the link, never what it points at.
        check_out_folder("--out", &r.join("out"), &[]).unwrap();
    }

    #[test]
    fn a_huge_folder_is_refused_not_walked() {
        let root = tempfile::tempdir().unwrap();
        let d = root.path().join("big");
        fs::create_dir(&d).unwrap();
        for i in 0..=10 {
            fs::File::create(d.join(i.to_string())).unwrap();
        }
        let err = format!("{:#}", find_under(&d, &[], 10).unwrap_err());
        assert!(err.contains("holds more than 10 files"), "{err}");
        assert!(find_under(&d, &[], 11).unwrap().is_none());
    }
}
