//! Where commands' outputs are written: a folder ([`OutDir`]: `compare --out`, `ab --out`,
//! `capture --out`, `plugins new --out`) or a file ([`OutFile`]: `distill --out`, `bench --json`). Each is checked
//! by the output guard ([`crate::experiment::guard`]: never part of an experiment, never one of
//! the command's inputs) before any work, then opened without following symbolic links: the
//! folder that will hold the output is opened once and every file is written in it as a
//! temporary file created exclusively (`O_EXCL | O_NOFOLLOW`), fsynced and renamed over its name
//! relative to that open folder. A link planted inside the output (to an experiment's
//! `config.toml`, to the data set) is replaced as a link, never written through. Just before
//! each replacement the guard runs again on the open folder and on what the name holds then, so
//! an experiment or input that appeared meanwhile is left as it is and the command fails naming
//! it. `export` replaces its folder whole through the same checks (`export.rs`).

use crate::experiment::guard::{self, FileId, Input};
use anyhow::{bail, Context, Result};
use std::{
    ffi::CString,
    fs::File,
    io::Write,
    os::{
        fd::{AsRawFd, FromRawFd, RawFd},
        unix::ffi::OsStrExt,
    },
    path::{Path, PathBuf},
};

/// A run's inputs, which its outputs may never be, hold or lie inside: the config file and every
/// path a config value names (data, target, tokenizer, templates, a capture, ...).
pub fn run_inputs(
    cfg: &crate::config::RunConfig,
    config_path: &Path,
    config_dir: &Path,
    registry: &crate::plugins::Registry,
) -> Result<Vec<Input>> {
    let mut inputs = vec![Input::new("the config file", config_path)];
    let named = crate::experiment::manifest::input_paths(cfg, registry, config_dir, &crate::environment::cache_dir())?;
    inputs.extend(named.into_iter().map(|(path, field)| Input::new(format!("field `{field}`"), &path)));
    Ok(inputs)
}

fn cstr(s: &std::ffi::OsStr) -> Result<CString> {
    CString::new(s.as_bytes()).with_context(|| format!("{}: a NUL byte in the name", s.to_string_lossy()))
}

/// Open the folder `abs` (absolute, links above it resolved) without following a link in its
/// last part.
pub fn open_dir(abs: &Path) -> Result<File> {
    let c = cstr(abs.as_os_str())?;
    // SAFETY: a NUL-terminated path that lives through the call.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| format!("opening {}", abs.display()));
    }
    // SAFETY: a descriptor just opened and owned by nothing else.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// The path an open folder has now (it may have moved since it was opened).
fn path_now(dir: &File) -> Result<PathBuf> {
    std::fs::read_link(format!("/proc/self/fd/{}", dir.as_raw_fd())).context("the output folder's path")
}

/// What `name` in the open folder is now (its identity, and whether a folder), without
/// following a link.
fn id_at(dir: &File, name: &CString) -> Option<(FileId, bool)> {
    // SAFETY: fstatat into a zeroed stat, on an open folder and a NUL-terminated name.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::fstatat(dir.as_raw_fd(), name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) };
    (r == 0).then(|| (FileId::new(st.st_dev, st.st_ino), st.st_mode & libc::S_IFMT == libc::S_IFDIR))
}

/// `renameat2(from_dir/from, to_dir/to, flags)` (Linux 3.15; on a file system that lacks a flag:
/// EINVAL).
pub fn rename_at(
    from_dir: RawFd,
    from: &CString,
    to_dir: RawFd,
    to: &CString,
    flags: libc::c_uint,
) -> std::io::Result<()> {
    // SAFETY: open folders and NUL-terminated names that live through the call.
    let r = unsafe { libc::renameat2(from_dir, from.as_ptr(), to_dir, to.as_ptr(), flags) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Write `bytes` as `name` in the open folder `dir`: a temporary file created exclusively there
/// (no link followed), fsynced, and renamed over `name` after `recheck` passes. `shown` is the
/// path errors name.
fn write_in(dir: &File, name: &str, bytes: &[u8], shown: &Path, recheck: impl FnOnce() -> Result<()>) -> Result<()> {
    if name.contains('/') || name == ".." || name == "." || name.is_empty() {
        bail!("{}: not a file name", shown.display());
    }
    let target = cstr(name.as_ref())?;
    let tmp = cstr(format!(".{name}.tmp-{}", std::process::id()).as_ref())?;
    let fd = dir.as_raw_fd();
    // SAFETY: an open folder and a NUL-terminated name; the descriptor returned is owned below.
    let f = unsafe {
        libc::openat(
            fd,
            tmp.as_ptr(),
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            0o644,
        )
    };
    if f < 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| format!("writing {}", shown.display()));
    }
    // SAFETY: a descriptor just opened and owned by nothing else.
    let mut file = unsafe { File::from_raw_fd(f) };
    let unlink_tmp = || {
        // SAFETY: an open folder and a NUL-terminated name.
        unsafe { libc::unlinkat(fd, tmp.as_ptr(), 0) };
    };
    let written = file
        .write_all(bytes)
        .and_then(|_| file.sync_all())
        .with_context(|| format!("writing {}", shown.display()))
        .and_then(|_| recheck())
        .and_then(|_| rename_at(fd, &tmp, fd, &target, 0).with_context(|| format!("writing {}", shown.display())));
    if written.is_err() {
        unlink_tmp();
    }
    written?;
    dir.sync_all().with_context(|| format!("syncing {}", shown.display()))
}

/// The guard again on an open output folder, as it is now: not part of an experiment, not inside
/// one, and not one of the inputs.
fn recheck_dir(flag: &str, given: &Path, dir: &File, inputs: &[Input]) -> Result<()> {
    let now = path_now(dir)?;
    guard::check_ancestors(flag, given, &now)?;
    let id = FileId::of(&dir.metadata()?);
    if let Some(input) = guard::input_with_id(inputs, id) {
        bail!("{flag} {}: is now {} {}; left as it is", given.display(), input.what, input.path.display());
    }
    Ok(())
}

/// What `name` in the open folder holds now must not be an input or a folder (an experiment moved
/// there is never replaced).
fn recheck_name(flag: &str, shown: &Path, dir: &File, name: &str, inputs: &[Input]) -> Result<()> {
    let Some((id, is_dir)) = id_at(dir, &cstr(name.as_ref())?) else { return Ok(()) };
    if let Some(input) = guard::input_with_id(inputs, id) {
        bail!(
            "{flag} {}: is {} {}; a command's output never replaces one of its inputs (choose another path)",
            shown.display(),
            input.what,
            input.path.display()
        );
    }
    if is_dir {
        bail!("{flag} {}: is a folder now; left as it is", shown.display());
    }
    Ok(())
}

/// An output folder, checked and open: files are written into it without following links.
pub struct OutDir {
    flag: String,
    given: PathBuf,
    /// The folder, absolute, its links resolved.
    pub path: PathBuf,
    dir: File,
    inputs: Vec<Input>,
}

impl OutDir {
    /// Check `given` (the value of `flag`) against the guard and `inputs` (before any work), create
    /// it where missing, and open it.
    pub fn create(flag: &str, given: &Path, inputs: Vec<Input>) -> Result<Self> {
        let path = guard::check_out_folder(flag, given, &inputs)?;
        std::fs::create_dir_all(&path).with_context(|| format!("{flag} {}: creating it", given.display()))?;
        let dir = open_dir(&path).with_context(|| format!("{flag} {}", given.display()))?;
        let out = Self { flag: flag.to_string(), given: given.to_path_buf(), path, dir, inputs };
        out.recheck()?;
        Ok(out)
    }

    fn recheck(&self) -> Result<()> {
        recheck_dir(&self.flag, &self.given, &self.dir, &self.inputs)
    }

    /// Write `bytes` as the file `name` in the folder (replacing a file or link of that name,
    /// never following it). Returns its path.
    pub fn write(&self, name: &str, bytes: &[u8]) -> Result<PathBuf> {
        let shown = self.path.join(name);
        write_in(&self.dir, name, bytes, &shown, || {
            self.recheck()?;
            recheck_name(&self.flag, &shown, &self.dir, name, &self.inputs)
        })?;
        Ok(shown)
    }

    /// The subfolder `name` of the folder, created where missing and opened without following a
    /// link: a link planted under that name is refused, never written through.
    pub fn subdir(&self, name: &str) -> Result<OutDir> {
        let path = self.path.join(name);
        if name.contains('/') || name == ".." || name == "." || name.is_empty() {
            bail!("{}: not a folder name", path.display());
        }
        let c = cstr(name.as_ref())?;
        let fd = self.dir.as_raw_fd();
        // SAFETY: an open folder and a NUL-terminated name.
        if unsafe { libc::mkdirat(fd, c.as_ptr(), 0o755) } != 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::AlreadyExists {
                return Err(err).with_context(|| format!("creating {}", path.display()));
            }
        }
        // SAFETY: as above; the descriptor returned is owned below.
        let sub = unsafe {
            libc::openat(fd, c.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        };
        if sub < 0 {
            return Err(std::io::Error::last_os_error()).with_context(|| format!("opening {}", path.display()));
        }
        // SAFETY: a descriptor just opened and owned by nothing else.
        let dir = unsafe { File::from_raw_fd(sub) };
        let out = OutDir { flag: self.flag.clone(), given: path.clone(), path, dir, inputs: self.inputs.clone() };
        out.recheck()?;
        Ok(out)
    }
}

/// An output file, checked (before any work) and written whole later, into its folder held open.
pub struct OutFile {
    flag: String,
    given: PathBuf,
    /// The file, absolute, the links of its folder resolved.
    pub path: PathBuf,
    name: String,
    parent: File,
    inputs: Vec<Input>,
}

impl OutFile {
    /// Check `given` (the value of `flag`) against the guard and `inputs`, and open its folder
    /// (created where missing).
    pub fn create(flag: &str, given: &Path, inputs: Vec<Input>) -> Result<Self> {
        let path = guard::check_out_file(flag, given, &inputs)?;
        let name = path.file_name().with_context(|| format!("{flag} {}: not a file name", given.display()))?;
        let name = name.to_str().with_context(|| format!("{flag} {}: not a UTF-8 name", given.display()))?.to_string();
        let parent = path.parent().with_context(|| format!("{flag} {}: no folder", given.display()))?;
        std::fs::create_dir_all(parent)
            .with_context(|| format!("{flag} {}: creating {}", given.display(), parent.display()))?;
        let parent = open_dir(parent).with_context(|| format!("{flag} {}", given.display()))?;
        let out = Self { flag: flag.to_string(), given: given.to_path_buf(), path, name, parent, inputs };
        out.recheck()?;
        Ok(out)
    }

    fn recheck(&self) -> Result<()> {
        recheck_dir(&self.flag, &self.given, &self.parent, &self.inputs)?;
        recheck_name(&self.flag, &self.given, &self.parent, &self.name, &self.inputs)
    }

    /// Write the file whole.
    pub fn write(&self, bytes: &[u8]) -> Result<()> {
        write_in(&self.parent, &self.name, bytes, &self.path, || self.recheck())
    }

    /// A new private folder beside the output (`.NAME.partial-PID`), for a writer that takes a
    /// path (a plugin): it writes [`Staged::path`], then [`commit`](Self::commit) moves that in.
    pub fn stage(&self) -> Result<Staged> {
        let dir_name = format!(".{}.partial-{}", self.name, std::process::id());
        let c = cstr(dir_name.as_ref())?;
        let fd = self.parent.as_raw_fd();
        // SAFETY: an open folder and a NUL-terminated name. A leftover of a dead process of the
        // same pid is removed first.
        unsafe {
            let left = CString::new(format!("{dir_name}/{}", self.name)).expect("no NUL");
            libc::unlinkat(fd, left.as_ptr(), 0);
            libc::unlinkat(fd, c.as_ptr(), libc::AT_REMOVEDIR);
        }
        // SAFETY: as above.
        if unsafe { libc::mkdirat(fd, c.as_ptr(), 0o700) } != 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("creating {}", self.path.with_file_name(&dir_name).display()));
        }
        let folder = self.path.with_file_name(&dir_name);
        // SAFETY: as above; owned below.
        let dfd = unsafe {
            libc::openat(fd, c.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        };
        if dfd < 0 {
            return Err(std::io::Error::last_os_error()).with_context(|| format!("opening {}", folder.display()));
        }
        // SAFETY: a descriptor just opened and owned by nothing else.
        let dir = unsafe { File::from_raw_fd(dfd) };
        Ok(Staged { path: folder.join(&self.name), folder, dir })
    }

    /// Move the staged file over the output, after the guard passes again.
    pub fn commit(&self, staged: Staged) -> Result<()> {
        let name = cstr(self.name.as_ref())?;
        self.recheck()?;
        rename_at(staged.dir.as_raw_fd(), &name, self.parent.as_raw_fd(), &name, 0)
            .with_context(|| format!("writing {} (from {})", self.path.display(), staged.path.display()))?;
        self.parent.sync_all().with_context(|| format!("syncing {}", self.path.display()))
    }
}

/// A private folder a writer that takes a path writes the output in (see [`OutFile::stage`]);
/// removed when dropped.
pub struct Staged {
    /// Where to write the file.
    pub path: PathBuf,
    folder: PathBuf,
    dir: File,
}

impl Drop for Staged {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.folder);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    /// An experiment folder as `Experiment::create` leaves it.
    fn experiment(dir: &Path) {
        fs::create_dir_all(dir.join("checkpoints")).unwrap();
        fs::write(dir.join("config.toml"), "name = \"x\"\n").unwrap();
        fs::write(dir.join("manifest.json"), "{}").unwrap();
    }

    #[test]
    fn files_replace_links_in_the_output_folder_and_never_write_through_them() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        experiment(&r.join("exp"));
        fs::create_dir(r.join("out")).unwrap();
        std::os::unix::fs::symlink(r.join("exp/config.toml"), r.join("out/report.md")).unwrap();
        let out = OutDir::create("--out", &r.join("out"), Vec::new()).unwrap();
        out.write("report.md", b"# report\n").unwrap();
        assert_eq!(fs::read_to_string(r.join("exp/config.toml")).unwrap(), "name = \"x\"\n");
        assert!(fs::symlink_metadata(r.join("out/report.md")).unwrap().is_file());
        assert_eq!(fs::read_to_string(r.join("out/report.md")).unwrap(), "# report\n");
        let names: Vec<_> = fs::read_dir(r.join("out")).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["report.md"], "no temporary file left");
    }

    #[test]
    fn a_subfolder_is_written_in_place_and_a_link_under_its_name_is_refused() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        fs::create_dir_all(r.join("elsewhere")).unwrap();
        fs::create_dir(r.join("out")).unwrap();
        std::os::unix::fs::symlink(r.join("elsewhere"), r.join("out/.cargo")).unwrap();
        let out = OutDir::create("--out", &r.join("out"), Vec::new()).unwrap();
        out.subdir("src").unwrap().write("lib.rs", b"// lib\n").unwrap();
        assert_eq!(fs::read_to_string(r.join("out/src/lib.rs")).unwrap(), "// lib\n");
        let err = format!("{:#}", out.subdir(".cargo").err().unwrap());
        assert!(err.contains("out/.cargo"), "{err}");
        assert!(fs::read_dir(r.join("elsewhere")).unwrap().next().is_none(), "written through the link");
    }

    #[test]
    fn an_experiment_or_input_that_appears_before_a_write_is_left_as_it_is() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        fs::write(r.join("data.jsonl"), "mine\n").unwrap();
        let data = Input::new("field `data.path`", &r.join("data.jsonl"));
        // An input hard-linked under the output's name after the check: not replaced.
        let file = OutFile::create("--out", &r.join("out.jsonl"), vec![data.clone()]).unwrap();
        fs::hard_link(r.join("data.jsonl"), r.join("out.jsonl")).unwrap();
        let err = format!("{:#}", file.write(b"two records\n").unwrap_err());
        assert!(err.contains("is field `data.path`"), "{err}");
        assert_eq!(fs::read_to_string(r.join("data.jsonl")).unwrap(), "mine\n");
        // The output folder made part of an experiment after the check: nothing written.
        let out = OutDir::create("--out", &r.join("report"), vec![data]).unwrap();
        fs::write(r.join("report/config.toml"), "x").unwrap();
        fs::create_dir(r.join("report/checkpoints")).unwrap();
        let err = format!("{:#}", out.write("report.md", b"x").unwrap_err());
        assert!(err.contains("is an experiment folder"), "{err}");
        assert!(!r.join("report/report.md").exists());
        // A staged file goes in whole, its private folder removed.
        let file = OutFile::create("--out", &r.join("new.jsonl"), Vec::new()).unwrap();
        let staged = file.stage().unwrap();
        fs::write(&staged.path, "a\n").unwrap();
        file.commit(staged).unwrap();
        assert_eq!(fs::read_to_string(r.join("new.jsonl")).unwrap(), "a\n");
        assert!(!fs::read_dir(r).unwrap().any(|e| e.unwrap().file_name().to_string_lossy().contains("partial")));
    }
}
