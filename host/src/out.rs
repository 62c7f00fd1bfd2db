//! Results on stdout. A closed stdout (`dflash-host ... | head -1`) stops the printing quietly
//! instead of panicking ("failed printing to stdout"): the command still runs to its end (a
//! training run is not cut short by its reader going away) and exits with its own code.

use std::{
    io::{self, Write},
    sync::atomic::{AtomicBool, Ordering},
};

static CLOSED: AtomicBool = AtomicBool::new(false);

/// One line to stdout (use [`say!`](crate::say)); after the first failed write, nothing more.
pub fn write_line(args: std::fmt::Arguments) {
    if CLOSED.load(Ordering::Relaxed) {
        return;
    }
    let mut out = io::stdout().lock();
    if let Err(e) = out.write_fmt(args).and_then(|_| out.write_all(b"\n")).and_then(|_| out.flush()) {
        CLOSED.store(true, Ordering::Relaxed);
        if e.kind() != io::ErrorKind::BrokenPipe {
            tracing::warn!("stdout: {e}; no more results are printed");
        }
    }
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
