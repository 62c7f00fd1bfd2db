//! Results on stdout, logs on stderr. A closed stdout or stderr (`dflash-host ... 2>&1 | head -1`)
//! stops that printing quietly instead of panicking ("failed printing to stdout"): the command
//! still runs to its end (a training run is not cut short by its reader going away) and exits with
//! its own code. The mechanism is below every writer: when the reader of a pipe (or socket) on
//! stdout or stderr goes away, a watcher thread puts /dev/null in its place, so no writer in the
//! process (ours, tracing's, a plugin's `eprintln!`, libtorch's) meets a broken pipe; our own
//! writers also do so at the first failed write, in case they get there first.
//!
//! With several data-parallel ranks, each log line starts with the rank (`[rank1]: `, as
//! torchrun's prefixes), and ranks other than 0 log warnings and errors only (the info lines are
//! rank 0's to say once) unless `RUST_LOG` asks for more.

use std::{
    io::{self, Write},
    os::fd::RawFd,
    sync::{
        atomic::{AtomicBool, Ordering},
        OnceLock,
    },
};

static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);
static STDERR_CLOSED: AtomicBool = AtomicBool::new(false);

fn closed(fd: RawFd) -> &'static AtomicBool {
    if fd == libc::STDOUT_FILENO {
        &STDOUT_CLOSED
    } else {
        &STDERR_CLOSED
    }
}

/// Put /dev/null in the place of `fd` (its reader is gone): later writes succeed and go nowhere.
fn silence(fd: RawFd) {
    closed(fd).store(true, Ordering::Relaxed);
    // SAFETY: open, dup2 and close on descriptors this function owns or that exist for the
    // process's whole life; dup2 replaces `fd` atomically.
    unsafe {
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if null >= 0 {
            libc::dup2(null, fd);
            libc::close(null);
        }
    }
}

/// Watch stdout and stderr where they are pipes or sockets, and [`silence`] each whose reader
/// goes away (the kernel reports POLLERR / POLLHUP on the writing end then; the thread sleeps in
/// `poll` until it does).
fn watch_outputs() {
    let watched: Vec<RawFd> = [libc::STDOUT_FILENO, libc::STDERR_FILENO]
        .into_iter()
        .filter(|&fd| {
            // SAFETY: fstat on a descriptor number into a zeroed stat.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            let kind = if unsafe { libc::fstat(fd, &mut st) } == 0 { st.st_mode & libc::S_IFMT } else { 0 };
            kind == libc::S_IFIFO || kind == libc::S_IFSOCK
        })
        .collect();
    if watched.is_empty() {
        return;
    }
    let _ = std::thread::Builder::new().name("output-watch".into()).spawn(move || {
        let mut fds: Vec<libc::pollfd> = watched.iter().map(|&fd| libc::pollfd { fd, events: 0, revents: 0 }).collect();
        while !fds.is_empty() {
            // SAFETY: `fds` is a valid array of its length.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
            if n < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                return;
            }
            for p in &fds {
                if p.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
                    silence(p.fd);
                }
            }
            fds.retain(|p| p.revents == 0);
        }
    });
}

/// A message's lines joined into one (blank ones dropped).
pub fn one_line(s: &str) -> String {
    s.lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join(" ")
}

/// A message's first non-blank line.
pub fn first_line(s: &str) -> String {
    s.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("").to_string()
}

/// One line to stdout (use [`say!`](crate::say)); after the first failed write, nothing more.
pub fn write_line(args: std::fmt::Arguments) {
    if STDOUT_CLOSED.load(Ordering::Relaxed) {
        return;
    }
    let mut out = io::stdout().lock();
    if let Err(e) = out.write_fmt(args).and_then(|_| out.write_all(b"\n")).and_then(|_| out.flush()) {
        drop(out);
        silence(libc::STDOUT_FILENO);
        if e.kind() != io::ErrorKind::BrokenPipe {
            tracing::warn!("stdout: {e}; no more results are printed");
        }
    }
}

/// This process's data-parallel rank when a launcher started several (`WORLD_SIZE` > 1).
pub fn rank() -> Option<usize> {
    static RANK: OnceLock<Option<usize>> = OnceLock::new();
    *RANK.get_or_init(|| {
        let num = |k: &str| std::env::var(k).ok().and_then(|v| v.trim().parse::<usize>().ok());
        num("RANK").filter(|_| num("WORLD_SIZE").is_some_and(|w| w > 1))
    })
}

/// Whether this process speaks for the run: not a data-parallel rank other than 0 (which print no
/// summary).
pub fn is_lead() -> bool {
    rank().is_none_or(|r| r == 0)
}

/// The variable that names a process's runs in its log lines (`ab --jobs` sets it to each run's
/// folder name).
pub const LOG_TAG: &str = "DFLASH_LOG_TAG";

/// `[rankN]: ` with several ranks, `[<DFLASH_LOG_TAG>]: ` where it is set, else nothing.
fn tag() -> String {
    static TAG: OnceLock<Option<String>> = OnceLock::new();
    let named = TAG.get_or_init(|| std::env::var(LOG_TAG).ok().filter(|t| !t.is_empty()));
    match (rank(), named) {
        (Some(r), _) => format!("[rank{r}]: "),
        (None, Some(t)) => format!("[{t}]: "),
        (None, None) => String::new(),
    }
}

/// The logs' writer: stderr, each line tagged with the rank, a failed write the end of the logs
/// (not a panic, not tracing's own complaint on stderr).
struct LogWriter;

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if STDERR_CLOSED.load(Ordering::Relaxed) {
            return Ok(buf.len());
        }
        // One event a call: a tag at its start and after each line break inside it.
        let tag = tag();
        let mut tagged = Vec::with_capacity(buf.len() + tag.len());
        for line in buf.split_inclusive(|&b| b == b'\n') {
            tagged.extend_from_slice(tag.as_bytes());
            tagged.extend_from_slice(line);
        }
        if io::stderr().lock().write_all(&tagged).is_err() {
            silence(libc::STDERR_FILENO);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        let _ = io::stderr().flush();
        Ok(())
    }
}

/// The logs: tracing on stderr through [`LogWriter`], at `RUST_LOG`'s level (default: info, and
/// warn on ranks other than 0), and the watcher that keeps a closed stdout or stderr harmless.
/// Call once, at the start of `main`.
pub fn init_logging() {
    use tracing_subscriber::EnvFilter;
    watch_outputs();
    let default = if is_lead() { "info" } else { "warn" };
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| default.into()))
        .with_writer(|| LogWriter)
        .with_ansi(colour_on_stderr())
        .with_target(false)
        .log_internal_errors(false)
        .init();
}

/// The last line of a failed command: `error: ...` on stderr, tagged with the rank, one line.
pub fn error_line(message: &str) {
    let _ = LogWriter.write(format!("error: {}\n", message.replace('\n', " ")).as_bytes());
}

/// `println!` that survives a closed stdout.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => { $crate::out::write_line(format_args!($($arg)*)) };
}

/// Colour codes in the logs only when stderr is a terminal and `NO_COLOR` is unset or empty
/// (no-color.org): a log piped to a file stays plain text.
pub fn colour_on_stderr() -> bool {
    use std::io::IsTerminal;
    colour_allowed(std::env::var_os("NO_COLOR").as_deref(), io::stderr().is_terminal())
}

fn colour_allowed(no_color: Option<&std::ffi::OsStr>, terminal: bool) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::colour_allowed;
    use std::ffi::OsStr;

    #[test]
    fn colour_needs_a_terminal_and_no_no_color() {
        assert!(colour_allowed(None, true));
        assert!(colour_allowed(Some(OsStr::new("")), true));
        assert!(!colour_allowed(Some(OsStr::new("1")), true));
        assert!(!colour_allowed(None, false));
    }
}
