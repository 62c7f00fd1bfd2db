//! One process per experiment folder: an exclusive `flock` on `DIR/.lock`, taken before anything
//! in the folder is read for a change and held until the process ends. The kernel drops it when
//! the process dies however it dies (kill -9 included), so a lock is never stale; the file keeps
//! the holder's pid for the error message only.

use anyhow::{bail, Context, Result};
use std::{
    fs::{File, OpenOptions},
    io::{Read, Seek, Write},
    os::fd::AsRawFd,
    path::{Path, PathBuf},
};

pub const LOCK_FILE: &str = ".lock";

/// Held while alive; dropping it (or the process ending) releases the lock.
#[derive(Debug)]
pub struct ExperimentLock {
    _file: File,
    pub path: PathBuf,
}

impl ExperimentLock {
    /// Take the lock on `dir` or fail at once naming the process that holds it.
    pub fn acquire(dir: &Path) -> Result<Self> {
        let path = dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        // SAFETY: flock on a file descriptor this function owns.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                let mut pid = String::new();
                let _ = file.read_to_string(&mut pid);
                let holder = match pid.trim() {
                    "" => "another process".to_string(),
                    p => format!("another process (pid {p})"),
                };
                bail!("{}: the experiment is in use by {holder}; wait for it to end or stop it", dir.display());
            }
            return Err(err).with_context(|| format!("locking {}", path.display()));
        }
        file.set_len(0)
            .and_then(|_| file.rewind())
            .and_then(|_| writeln!(file, "{}", std::process::id()))
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(Self { _file: file, path })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_naming_the_first_and_a_dropped_lock_is_free() {
        let dir = tempfile::tempdir().unwrap();
        let first = ExperimentLock::acquire(dir.path()).unwrap();
        // flock locks belong to the open file: a second open in this process conflicts like
        // another process would.
        let err = ExperimentLock::acquire(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("in use by another process") && err.contains(&format!("pid {}", std::process::id())),
            "{err}"
        );
        drop(first);
        ExperimentLock::acquire(dir.path()).unwrap();
    }
}
