//! Reading files a user or another program handed us, without trusting them to be files.
//!
//! `std::fs::read` on a FIFO blocks until a writer comes, on `/dev/zero` it grows memory until
//! the process dies, and one 100 MB line read with `BufRead::lines` is 100 MB (plus what parsing
//! it takes). Here every open refuses anything but a regular file, without blocking (a FIFO is
//! opened non-blocking, then refused), whole-file reads are capped, and lines are read with a cap
//! on each; every error names the file (and line). A file is opened once: its type and size are
//! checked on the open handle, and what is read (or memory-mapped, [`map_regular`]) comes from
//! that handle, so nothing can be swapped in between. A symlink (an HF hub snapshot links its
//! blobs) is followed, and its target is what is checked; the error says where it led.
//!
//! [`limits`] holds the caps for the files of a model folder, sized for real files; with the
//! `tensors` feature, [`tensors::read_safetensors`] reads a safetensors file through the same
//! checked, memory-mapped handle.
//!
//! ```no_run
//! # fn main() -> Result<(), input_files::InputError> {
//! let path = std::path::Path::new("data.jsonl");
//! let text = input_files::read_to_string_capped(path, 16 << 20)?; // config-sized files
//! for line in input_files::lines(path, 1 << 20)? {                 // or line by line
//!     let line = line?;
//! #   let _ = (&text, line);
//! }
//! # Ok(()) }
//! ```

use std::{
    fs::{File, FileType, OpenOptions},
    io::{self, BufRead, BufReader, Read},
    os::unix::fs::{FileTypeExt, OpenOptionsExt},
    path::{Path, PathBuf},
};

#[cfg(feature = "tensors")]
pub mod tensors;

/// Caps for the files of a model folder (HF or drafter), each well above the largest real file
/// of its kind and far below what would hurt: what a reader passes to [`read_capped`] and its
/// siblings.
pub mod limits {
    /// `config.json`, `generation_config.json`, a drafter's `config.json` (real ones: a few KB).
    pub const CONFIG_JSON: u64 = 16 << 20;
    /// `tokenizer.json` (real ones: 2-35 MB; Gemma 3's, 33 MB, is among the largest).
    pub const TOKENIZER_JSON: u64 = 512 << 20;
    /// `tokenizer_config.json` (real ones: up to a few MB with many added tokens).
    pub const TOKENIZER_CONFIG_JSON: u64 = 64 << 20;
    /// A chat template file, `chat_template.jinja` (real ones: under 20 KB).
    pub const CHAT_TEMPLATE: u64 = 8 << 20;
    /// `model.safetensors.index.json` (real ones: up to ~10 MB for the largest MoE models).
    pub const SAFETENSORS_INDEX: u64 = 256 << 20;
    /// A hub cache `refs/<branch>` file: one commit hash.
    pub const HUB_REF: u64 = 4 << 10;
}

#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error("{}: no such file", path.display())]
    NotFound { path: PathBuf },
    #[error("{}: not a regular file ({kind}{})", path.display(), linked(resolved))]
    NotRegular { path: PathBuf, kind: &'static str, resolved: Option<PathBuf> },
    #[error("{}: {size} bytes, more than the {max} bytes allowed", path.display())]
    TooLarge { path: PathBuf, size: u64, max: u64 },
    #[error("{}:{line}: line longer than {max} bytes", path.display())]
    LineTooLong { path: PathBuf, line: usize, max: usize },
    #[error("{}:{line}: not valid UTF-8", path.display())]
    NotUtf8 { path: PathBuf, line: usize },
    #[error("{}: {cause}", path.display())]
    Io { path: PathBuf, cause: io::Error },
    /// The file is there but not what its reader expects (a corrupt safetensors header, ...).
    #[error("{}: {what}", path.display())]
    Format { path: PathBuf, what: String },
}

/// ", reached through a link to X" for a path that is (or passes through) a symlink.
fn linked(resolved: &Option<PathBuf>) -> String {
    resolved.as_ref().map(|r| format!(", reached through a link to {}", r.display())).unwrap_or_default()
}

impl InputError {
    pub fn path(&self) -> &Path {
        match self {
            Self::NotFound { path }
            | Self::NotRegular { path, .. }
            | Self::TooLarge { path, .. }
            | Self::LineTooLong { path, .. }
            | Self::NotUtf8 { path, .. }
            | Self::Io { path, .. }
            | Self::Format { path, .. } => path,
        }
    }
}

fn io_error(path: &Path, cause: io::Error) -> InputError {
    match cause.kind() {
        io::ErrorKind::NotFound => InputError::NotFound { path: path.to_path_buf() },
        _ => InputError::Io { path: path.to_path_buf(), cause },
    }
}

/// What a file type is, for "not a regular file (...)".
fn kind_name(t: FileType) -> &'static str {
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a file"
    }
}

/// Open `path` for reading if it is a regular file (symlinks followed). A FIFO is opened
/// non-blocking, so the open returns at once and the FIFO is refused; the type is checked on the
/// opened file, so nothing can be swapped in between a check and the open.
pub fn open_regular(path: &Path) -> Result<File, InputError> {
    let file =
        OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path).map_err(|e| io_error(path, e))?;
    let meta = file.metadata().map_err(|e| io_error(path, e))?;
    if !meta.is_file() {
        return Err(not_regular(path, meta.file_type()));
    }
    Ok(file)
}

/// The error for `path` of type `t`, naming where a link led.
fn not_regular(path: &Path, t: FileType) -> InputError {
    let is_link = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    let resolved = is_link.then(|| std::fs::canonicalize(path).ok()).flatten();
    InputError::NotRegular { path: path.to_path_buf(), kind: kind_name(t), resolved }
}

/// `path` memory-mapped read-only, from the handle [`open_regular`] checked: a FIFO or device
/// is refused before anything is mapped. For large files read in place (weights); the caller
/// must not let the file be truncated while mapped (as with any mmap).
pub fn map_regular(path: &Path) -> Result<memmap2::Mmap, InputError> {
    let file = open_regular(path)?;
    // SAFETY: read-only map of a regular file; a file truncated by another process while mapped
    // is outside what any reader can guard against.
    unsafe { memmap2::Mmap::map(&file) }.map_err(|e| io_error(path, e))
}

/// A path a config names: a regular file or a directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathKind {
    File,
    Dir,
}

/// Whether `path` is a regular file or a directory (symlinks followed); anything else (FIFO,
/// device, socket) is an error, and so is a path that does not exist.
pub fn check_path(path: &Path) -> Result<PathKind, InputError> {
    let meta = std::fs::metadata(path).map_err(|e| io_error(path, e))?;
    match meta.file_type() {
        t if t.is_file() => Ok(PathKind::File),
        t if t.is_dir() => Ok(PathKind::Dir),
        t => Err(not_regular(path, t)),
    }
}

/// The whole file, at most `max` bytes (checked against its size first, then while reading, in
/// case it grows).
pub fn read_capped(path: &Path, max: u64) -> Result<Vec<u8>, InputError> {
    let file = open_regular(path)?;
    let size = file.metadata().map_err(|e| io_error(path, e))?.len();
    if size > max {
        return Err(InputError::TooLarge { path: path.to_path_buf(), size, max });
    }
    let mut bytes = Vec::with_capacity(size as usize);
    file.take(max + 1).read_to_end(&mut bytes).map_err(|e| io_error(path, e))?;
    if bytes.len() as u64 > max {
        return Err(InputError::TooLarge { path: path.to_path_buf(), size: bytes.len() as u64, max });
    }
    Ok(bytes)
}

/// The whole file as UTF-8 text, at most `max` bytes; invalid UTF-8 is named by its line.
pub fn read_to_string_capped(path: &Path, max: u64) -> Result<String, InputError> {
    String::from_utf8(read_capped(path, max)?).map_err(|e| {
        let line = e.as_bytes()[..e.utf8_error().valid_up_to()].iter().filter(|&&b| b == b'\n').count() + 1;
        InputError::NotUtf8 { path: path.to_path_buf(), line }
    })
}

/// [`read_to_string_capped`] for a file that may be absent (a model folder's optional files):
/// None when there is nothing at `path`; anything else there (a FIFO, a device, a file too large)
/// is the error it would be.
pub fn read_optional(path: &Path, max: u64) -> Result<Option<String>, InputError> {
    match read_to_string_capped(path, max) {
        Err(InputError::NotFound { .. }) => Ok(None),
        other => other.map(Some),
    }
}

/// The lines of a regular file, each at most `max_line` bytes (without its `\n` or `\r\n`).
pub fn lines(path: &Path, max_line: usize) -> Result<Lines<BufReader<File>>, InputError> {
    Ok(Lines::new(BufReader::new(open_regular(path)?), path, max_line))
}

/// Lines of any reader (e.g. a decompressor over [`open_regular`]'s file), each at most `max`
/// bytes: memory stays within `max` whatever the input. Iteration ends after the first error.
pub struct Lines<R> {
    reader: R,
    path: PathBuf,
    max: usize,
    line: usize,
    done: bool,
}

impl<R: BufRead> Lines<R> {
    pub fn new(reader: R, path: &Path, max: usize) -> Self {
        Self { reader, path: path.to_path_buf(), max, line: 0, done: false }
    }

    /// The 1-based number of the line last returned.
    pub fn line_number(&self) -> usize {
        self.line
    }
}

impl<R: BufRead> Iterator for Lines<R> {
    type Item = Result<String, InputError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        self.line += 1;
        let mut buf = Vec::new();
        // At most the cap plus "\r\n": a longer line is refused before more of it is held.
        let read = (&mut self.reader).take(self.max as u64 + 2).read_until(b'\n', &mut buf);
        let fail = |me: &mut Self, e: InputError| {
            me.done = true;
            Some(Err(e))
        };
        match read {
            Ok(0) => {
                self.done = true;
                None
            }
            Ok(_) => {
                let ended = buf.last() == Some(&b'\n');
                if ended {
                    buf.pop();
                    if buf.last() == Some(&b'\r') {
                        buf.pop();
                    }
                }
                if buf.len() > self.max || (!ended && buf.len() as u64 == self.max as u64 + 2) {
                    let e = InputError::LineTooLong { path: self.path.clone(), line: self.line, max: self.max };
                    return fail(self, e);
                }
                match String::from_utf8(buf) {
                    Ok(s) => Some(Ok(s)),
                    Err(_) => {
                        let e = InputError::NotUtf8 { path: self.path.clone(), line: self.line };
                        fail(self, e)
                    }
                }
            }
            Err(e) => {
                let e = io_error(&self.path, e);
                fail(self, e)
            }
        }
    }
}

/// Whether `s` reads as a hub repository id: `owner/name`, each part letters, digits, `-`, `_`,
/// `.`, not starting with `.` or `-` (HF's rule), nothing else. Such an input names a model to
/// look up in the hub cache, not a file.
pub fn is_hub_repo_id(s: &str) -> bool {
    let part = |p: &str| {
        !p.is_empty()
            && p.len() <= 96
            && !p.starts_with(['.', '-'])
            && !p.contains("..")
            && p.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    matches!(s.split_once('/'), Some((owner, name)) if part(owner) && part(name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn mkfifo(path: &Path) {
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo {}", path.display());
    }

    #[test]
    fn a_fifo_a_device_and_a_directory_are_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        mkfifo(&fifo);
        let t0 = Instant::now();
        let err = read_to_string_capped(&fifo, 1 << 20).unwrap_err().to_string();
        assert!(err.contains("fifo: not a regular file (a FIFO)"), "{err}");
        assert!(t0.elapsed() < Duration::from_secs(5), "blocked on the FIFO");
        assert!(lines(&fifo, 10).is_err());
        let err = read_capped(Path::new("/dev/zero"), 1 << 20).unwrap_err().to_string();
        assert_eq!(err, "/dev/zero: not a regular file (a character device)");
        let err = read_capped(dir.path(), 1 << 20).unwrap_err().to_string();
        assert!(err.ends_with("not a regular file (a directory)"), "{err}");
        assert!(matches!(check_path(Path::new("/dev/zero")), Err(InputError::NotRegular { .. })));
        assert!(matches!(check_path(&fifo), Err(InputError::NotRegular { kind: "a FIFO", .. })));
        assert_eq!(check_path(dir.path()).unwrap(), PathKind::Dir);
        let missing = dir.path().join("nope");
        assert_eq!(read_capped(&missing, 1).unwrap_err().to_string(), format!("{}: no such file", missing.display()));
    }

    #[test]
    fn a_link_is_followed_and_the_error_says_where_it_led() {
        // As an HF hub snapshot links `tokenizer.json` to a blob: the blob is what is checked.
        let dir = tempfile::tempdir().unwrap();
        let (blob, link) = (dir.path().join("blob"), dir.path().join("tokenizer.json"));
        mkfifo(&blob);
        std::os::unix::fs::symlink(&blob, &link).unwrap();
        let t0 = Instant::now();
        let err = read_optional(&link, 1 << 20).unwrap_err().to_string();
        assert!(t0.elapsed() < Duration::from_secs(5), "blocked on the FIFO");
        let want = format!("{}: not a regular file (a FIFO, reached through a link to ", link.display());
        assert!(err.starts_with(&want) && err.ends_with("blob)"), "{err}");
        assert!(map_regular(&link).is_err());
        std::os::unix::fs::symlink("/dev/zero", dir.path().join("zero")).unwrap();
        let err = read_capped(&dir.path().join("zero"), 1 << 20).unwrap_err().to_string();
        assert!(
            err.ends_with("zero: not a regular file (a character device, reached through a link to /dev/zero)"),
            "{err}"
        );
        // A regular file behind a link reads; nothing at all is None, not an error.
        std::fs::remove_file(&blob).unwrap();
        std::fs::write(&blob, "{}").unwrap();
        assert_eq!(read_optional(&link, 2).unwrap().as_deref(), Some("{}"));
        assert_eq!(&map_regular(&link).unwrap()[..], b"{}");
        assert_eq!(read_optional(&dir.path().join("absent.json"), 2).unwrap(), None);
        assert!(matches!(read_optional(&link, 1), Err(InputError::TooLarge { size: 2, max: 1, .. })));
    }

    #[test]
    fn sizes_and_lines_are_capped_and_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.jsonl");
        std::fs::write(&path, "ab\r\ncd\n").unwrap();
        assert_eq!(read_to_string_capped(&path, 7).unwrap(), "ab\r\ncd\n");
        let err = read_capped(&path, 6).unwrap_err().to_string();
        assert!(err.ends_with("f.jsonl: 7 bytes, more than the 6 bytes allowed"), "{err}");
        let got: Vec<String> = lines(&path, 2).unwrap().map(Result::unwrap).collect();
        assert_eq!(got, ["ab", "cd"]);
        // A line of exactly the cap is fine, with or without its newline; one byte more is not.
        std::fs::write(&path, "abc\nxyz").unwrap();
        assert_eq!(lines(&path, 3).unwrap().map(Result::unwrap).collect::<Vec<_>>(), ["abc", "xyz"]);
        std::fs::write(&path, "ok\n12345\nnever read\n").unwrap();
        let got: Vec<_> = lines(&path, 4).unwrap().collect();
        assert_eq!(got.len(), 2, "iteration stops at the first error");
        let err = got[1].as_ref().unwrap_err().to_string();
        assert!(err.ends_with("f.jsonl:2: line longer than 4 bytes"), "{err}");
        std::fs::write(&path, "12345").unwrap();
        assert!(matches!(lines(&path, 4).unwrap().next(), Some(Err(InputError::LineTooLong { line: 1, .. }))));
        std::fs::write(&path, b"ok\n\xff\n").unwrap();
        let err = lines(&path, 9).unwrap().nth(1).unwrap().unwrap_err().to_string();
        assert!(err.ends_with("f.jsonl:2: not valid UTF-8"), "{err}");
        let err = read_to_string_capped(&path, 9).unwrap_err().to_string();
        assert!(err.ends_with("f.jsonl:2: not valid UTF-8"), "{err}");
    }

    #[test]
    fn a_huge_line_costs_no_more_memory_than_the_cap() {
        // 64 MiB without a newline, read through a cap of 1 KiB: the reader holds ~1 KiB.
        struct Endless(u64);
        impl Read for Endless {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                let n = buf.len().min(self.0 as usize);
                buf[..n].fill(b'x');
                self.0 -= n as u64;
                Ok(n)
            }
        }
        let mut it = Lines::new(BufReader::new(Endless(64 << 20)), Path::new("big"), 1024);
        assert!(matches!(it.next(), Some(Err(InputError::LineTooLong { line: 1, max: 1024, .. }))));
        assert!(it.next().is_none());
        assert!(it.reader.get_ref().0 > 60 << 20, "the reader went on past the cap");
    }
}
