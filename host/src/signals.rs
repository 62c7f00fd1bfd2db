//! One signal policy for every process a command starts.
//!
//! A process that works (a training rank, a rank serving its replica's target, an `ab --only`
//! run) takes SIGINT, SIGTERM and SIGHUP (a closed terminal) as a request to stop
//! ([`StopSignal`]): the first lets it finish what it is doing and write a checkpoint, then it
//! exits 130 / 143 / 129; a second exits at once (checkpoints are written whole or not at all).
//!
//! A process that starts others (`--nproc N`, `ab --jobs N`) starts each in a process group of
//! its own, tied to its life ([`spawn_child`]), and passes every such signal it gets on to them
//! ([`Forward`]). So each child hears a signal once, from its parent, whether it was sent to the
//! parent's pid or typed at the terminal (Ctrl-C reaches the terminal's foreground group, which
//! holds the parent but not its children), and a child that checkpoints is not killed by the same
//! Ctrl-C reaching it twice. A parent killed with SIGKILL takes its children with it: they get
//! SIGTERM and stop as above.

use anyhow::Result;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use std::{
    process::{Child, Command, ExitCode},
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, Mutex,
    },
};

/// The signals that ask a run to stop, each with the exit code it stops with.
const STOPPING: [(i32, u8); 3] = [(SIGINT, 130), (SIGTERM, 143), (SIGHUP, 129)];

/// The stop signals this process took, once [`StopSignal::install`] was called.
static INSTALLED: Mutex<Option<Arc<AtomicUsize>>> = Mutex::new(None);

/// SIGINT / SIGTERM / SIGHUP taken as a request to stop (see the module's doc). One set of
/// handlers per process, however many times it is installed.
pub struct StopSignal {
    code: Arc<AtomicUsize>,
}

impl StopSignal {
    pub fn install() -> Result<Self> {
        use signal_hook::flag;
        let mut installed = INSTALLED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(code) = installed.as_ref() {
            return Ok(Self { code: Arc::clone(code) });
        }
        let code = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(AtomicBool::new(false));
        for (sig, exit) in STOPPING {
            flag::register_conditional_shutdown(sig, exit as i32, Arc::clone(&seen))?;
            flag::register(sig, Arc::clone(&seen))?;
            flag::register_usize(sig, Arc::clone(&code), exit as usize)?;
        }
        *installed = Some(Arc::clone(&code));
        Ok(Self { code })
    }

    /// The signal an exit code stands for.
    pub fn name(code: u8) -> &'static str {
        match code {
            130 => "SIGINT",
            129 => "SIGHUP",
            _ => "SIGTERM",
        }
    }

    /// The exit code if a signal asked to stop.
    pub fn requested(&self) -> Option<u8> {
        match self.code.load(Ordering::Relaxed) {
            0 => None,
            c => Some(c as u8),
        }
    }
}

/// The exit code of the stop signal this process took (None: none, or no [`StopSignal`]).
pub fn requested() -> Option<u8> {
    let installed = INSTALLED.lock().unwrap_or_else(|e| e.into_inner());
    installed.as_ref().and_then(|code| StopSignal { code: Arc::clone(code) }.requested())
}

/// What a command that returned `code` exits with: the code of the stop signal it took where it
/// says success (a rank that served its replica's target until its lead stopped for a signal).
pub fn exit_code(code: ExitCode) -> ExitCode {
    match requested() {
        Some(signal) if code == ExitCode::SUCCESS => ExitCode::from(signal),
        _ => code,
    }
}

/// Start `cmd` as a child of this process: in a process group of its own (a Ctrl-C at the
/// terminal reaches it only through [`Forward`]), and sent SIGTERM when this process dies, however
/// it dies (Linux's parent-death signal; a parent already gone when it is set is seen, and the
/// child does not start). The death signal follows the thread that starts the child: start
/// children from a thread that lives as long as they should (the main one).
pub fn spawn_child(cmd: &mut Command) -> std::io::Result<Child> {
    use std::os::unix::process::CommandExt;
    cmd.process_group(0);
    #[cfg(target_os = "linux")]
    {
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: between fork and exec the closure calls only async-signal-safe functions
        // (prctl, getppid) and allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent died before the death signal was set: nobody would send it.
                if libc::getppid() != parent {
                    return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            })
        };
    }
    cmd.spawn()
}

/// A parent's side of the policy: SIGINT, SIGTERM and SIGHUP sent to it are passed on to its
/// children, each time one arrives (a second Ctrl-C stops them at once, as it stops one process).
pub struct Forward {
    signals: signal_hook::iterator::Signals,
    first: Option<u8>,
}

impl Forward {
    /// From now on this process outlives these signals; call [`pass_on`](Self::pass_on) often.
    pub fn install() -> Result<Self> {
        let signals = signal_hook::iterator::Signals::new(STOPPING.map(|(sig, _)| sig))?;
        Ok(Self { signals, first: None })
    }

    /// Pass the signals that arrived since the last call on to `children` (their pids).
    pub fn pass_on(&mut self, children: &[u32]) {
        for sig in self.signals.pending() {
            let code = STOPPING.iter().find(|(s, _)| *s == sig).map_or(143, |(_, c)| *c);
            self.first.get_or_insert(code);
            tracing::info!("{}: passed on to {} process(es)", StopSignal::name(code), children.len());
            for &pid in children {
                // SAFETY: a plain kill(2) on a child of this process (not yet waited for).
                unsafe { libc::kill(pid as libc::pid_t, sig) };
            }
        }
    }

    /// The exit code of the first signal passed on (130 / 143 / 129), if any.
    pub fn code(&self) -> Option<u8> {
        self.first
    }
}
