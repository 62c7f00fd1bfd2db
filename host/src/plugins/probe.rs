//! The probe: a child process (`dflash-host plugins probe PATH --sha256 HASH`) that loads a plugin
//! library and checks what only loading can show, so that the host runs none of its code before
//! the checks pass. The child is confined, so a hostile or broken library costs it, not the host:
//!
//! - a session and process group of its own (a `kill(0, ...)` reaches no one else; the group is
//!   ended after the probe, taking any process the library started with it), and killed if the
//!   host dies first;
//! - a seccomp filter that lets it signal or trace no process but itself;
//! - resource limits: [`MAX_ADDRESS_SPACE`] of memory, [`MAX_CPU`] of CPU time, the library's
//!   size plus [`MAX_FILE`] per file written (its in-memory copy of the library is one), no core dumps; and [`PROBE_TIMEOUT`] of wall time;
//! - its output read up to [`MAX_OUTPUT`] a stream, the rest drained and dropped.
//!
//! Its death by a signal is one line naming the library and the signal.

use super::record::PluginRecord;
use crate::out::first_line;
use anyhow::{anyhow, bail, Context, Result};
use std::{
    io::Read,
    os::unix::process::{CommandExt, ExitStatusExt},
    path::Path,
    process::{Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

/// How long a probe may take to load a library (a library whose constructor hangs is refused).
const PROBE_TIMEOUT: Duration = Duration::from_secs(120);
/// The probe's address space: ~20 times what loading a plugin takes (libtorch included).
const MAX_ADDRESS_SPACE: u64 = 8 << 30;
/// The probe's CPU time (loading takes about 2 s).
const MAX_CPU: Duration = Duration::from_secs(60);
/// What the probe may write to a file beyond its in-memory copy of the library (a library's log
/// would fit).
const MAX_FILE: u64 = 1 << 20;
/// What is kept of the probe's stdout and of its stderr (its record is a line of JSON).
const MAX_OUTPUT: usize = 1 << 20;

/// The library's record, from a confined child process that loads and checks the bytes whose
/// SHA-256 is `sha256` (`dflash-host plugins probe`, which runs [`super::load_library`] and prints
/// the record as JSON).
pub fn probe(path: &Path, sha256: &str) -> Result<PluginRecord> {
    let shown = path.display();
    let exe = std::env::current_exe().context("finding this program to probe a plugin with")?;
    let mut cmd = Command::new(&exe);
    cmd.args(["plugins", "probe"])
        .arg(path)
        .args(["--sha256", sha256])
        .env("RUST_LOG", "error")
        .env_remove("RUST_BACKTRACE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut filter = seccomp_filter();
    let max_file = std::fs::metadata(path).map_or(0, |m| m.len()) + MAX_FILE;
    // SAFETY: the closure runs in the child between fork and exec and makes only async-signal-safe
    // system calls (no allocation: the filter was built before the fork).
    unsafe { cmd.pre_exec(move || confine(&mut filter, max_file)) };
    let mut child =
        cmd.spawn().with_context(|| format!("plugin {shown}: starting a probe process ({})", exe.display()))?;
    let group = child.id() as i32;
    let stdout = capped(child.stdout.take().expect("piped"));
    let stderr = capped(child.stderr.take().expect("piped"));
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if started.elapsed() > PROBE_TIMEOUT {
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    // The probe's whole group goes (what the library started too), then the child is reaped.
    // SAFETY: kill(2) on the process group of our own child, which setsid made its leader.
    unsafe { libc::kill(-group, libc::SIGKILL) };
    let status = match status {
        Some(s) => s,
        None => {
            let _ = child.wait();
            bail!(
                "plugin {shown}: still loading after {} s in a probe process (a constructor that never returns?); refused",
                PROBE_TIMEOUT.as_secs()
            );
        }
    };
    // What the readers took, once the pipes closed (a process that left the group may hold them:
    // then what was read so far).
    let (out, err) = (stdout.wait(Duration::from_secs(2)), stderr.wait(Duration::from_secs(2)));
    if status.success() {
        let text = String::from_utf8_lossy(&out);
        return serde_json::from_str(text.trim())
            .map_err(|e| anyhow!("plugin {shown}: its probe printed no plugin record ({e})"));
    }
    if let Some(sig) = status.signal() {
        bail!("plugin {shown}: loading it killed the probe process ({}); refused", signal_name(sig));
    }
    let err = String::from_utf8_lossy(&err);
    if let Some(line) = err.lines().rev().find_map(|l| l.strip_prefix("error: ")) {
        bail!("{line}");
    }
    let mut lines = err.lines().map(str::trim);
    if lines.by_ref().any(|l| l.contains("panicked at")) {
        let message = lines.next().unwrap_or("");
        bail!("plugin {shown}: loading it crashed the probe process (a panic: {message}); refused");
    }
    bail!("plugin {shown}: its probe process failed ({status}): {}", first_line(&err))
}

fn signal_name(sig: i32) -> String {
    let name = match sig {
        libc::SIGSEGV => "SIGSEGV, a segmentation fault",
        libc::SIGABRT => "SIGABRT, an abort",
        libc::SIGBUS => "SIGBUS, a bus error",
        libc::SIGILL => "SIGILL, an illegal instruction",
        libc::SIGFPE => "SIGFPE, an arithmetic fault",
        libc::SIGKILL => "SIGKILL: killed, by itself or for running out of memory",
        libc::SIGXCPU => "SIGXCPU: past its CPU time limit",
        libc::SIGXFSZ => "SIGXFSZ: past its file size limit",
        _ => return format!("signal {sig}"),
    };
    name.to_string()
}

/// A stream read on a thread of its own: the first [`MAX_OUTPUT`] bytes kept, the rest read and
/// dropped (so the writer never blocks on a full pipe).
struct Capped {
    kept: Arc<Mutex<Vec<u8>>>,
    done: std::sync::mpsc::Receiver<()>,
}

fn capped(mut stream: impl Read + Send + 'static) -> Capped {
    let kept = Arc::new(Mutex::new(Vec::new()));
    let (tx, done) = std::sync::mpsc::channel();
    let into = Arc::clone(&kept);
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        while let Ok(n @ 1..) = stream.read(&mut buf) {
            let mut kept = into.lock().expect("output lock");
            let room = MAX_OUTPUT.saturating_sub(kept.len()).min(n);
            kept.extend_from_slice(&buf[..room]);
        }
        let _ = tx.send(());
    });
    Capped { kept, done }
}

impl Capped {
    /// What was kept, after the stream ended or `grace` passed.
    fn wait(self, grace: Duration) -> Vec<u8> {
        let _ = self.done.recv_timeout(grace);
        std::mem::take(&mut *self.kept.lock().expect("output lock"))
    }
}

/// In the child, before exec: its own session, death with the host, the limits, then the filter.
fn confine(filter: &mut [libc::sock_filter], max_file: u64) -> std::io::Result<()> {
    let check = |rc: libc::c_int| if rc < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) };
    // SAFETY: plain system calls on this (child) process.
    unsafe {
        check(libc::setsid())?;
        check(libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong))?;
        let limit = |resource, n: u64| {
            let l = libc::rlimit { rlim_cur: n as libc::rlim_t, rlim_max: n as libc::rlim_t };
            check(libc::setrlimit(resource, &l))
        };
        limit(libc::RLIMIT_AS, MAX_ADDRESS_SPACE)?;
        limit(libc::RLIMIT_CPU, MAX_CPU.as_secs())?;
        limit(libc::RLIMIT_FSIZE, max_file)?;
        limit(libc::RLIMIT_CORE, 0)?;
        // The filter names this process: its pid is known only now.
        let pid = libc::getpid() as u32;
        for insn in filter.iter_mut().filter(|i| i.k == PID_PLACEHOLDER) {
            insn.k = pid;
        }
        let prog = libc::sock_fprog { len: filter.len() as u16, filter: filter.as_mut_ptr() };
        check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
        check(libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &prog as *const libc::sock_fprog))?;
    }
    Ok(())
}

/// Stands for the child's pid in the filter until [`confine`] knows it.
const PID_PLACEHOLDER: u32 = 0xffff_fffe;

#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xc000_003e; // AUDIT_ARCH_X86_64
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xc000_00b7; // AUDIT_ARCH_AARCH64

/// A seccomp filter (classic BPF over `struct seccomp_data`) that fails with EPERM every call that
/// signals or traces another process: kill, tkill, tgkill, rt_(tg)sigqueueinfo and pidfd_open
/// unless their first argument is the probe's own pid, ptrace always, and any call of another
/// architecture's table or x86's x32 numbering (which would go around the checks). Everything
/// else is allowed.
fn seccomp_filter() -> Vec<libc::sock_filter> {
    const LD_ABS_W: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
    const JEQ: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
    const JGE: u16 = (libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K) as u16;
    const RET: u16 = (libc::BPF_RET | libc::BPF_K) as u16;
    let insn = |code: u16, jt: u8, jf: u8, k: u32| libc::sock_filter { code, jt, jf, k };
    let allow = libc::SECCOMP_RET_ALLOW;
    let deny = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
    let pid_checked = [
        libc::SYS_kill,
        libc::SYS_tkill,
        libc::SYS_tgkill,
        libc::SYS_rt_sigqueueinfo,
        libc::SYS_rt_tgsigqueueinfo,
        libc::SYS_pidfd_open,
    ];
    // Layout: [0-2] architecture, [3-4] number range, one test per checked call, ptrace, allow;
    // then CHECK: the first argument against the pid; DENY last.
    let n = pid_checked.len();
    let check = 5 + n + 2; // index of CHECK
    let deny_at = check + 3; // index of DENY
    let mut f = vec![
        insn(LD_ABS_W, 0, 0, 4), // seccomp_data.arch
        insn(JEQ, 1, 0, AUDIT_ARCH),
        insn(RET, 0, 0, deny),
        insn(LD_ABS_W, 0, 0, 0), // seccomp_data.nr
        insn(JGE, (deny_at - 5) as u8, 0, 0x4000_0000),
    ];
    for (i, nr) in pid_checked.iter().enumerate() {
        f.push(insn(JEQ, (check - (5 + i) - 1) as u8, 0, *nr as u32));
    }
    f.push(insn(JEQ, (deny_at - (5 + n) - 1) as u8, 0, libc::SYS_ptrace as u32));
    f.push(insn(RET, 0, 0, allow));
    f.push(insn(LD_ABS_W, 0, 0, 16)); // CHECK: the low half of seccomp_data.args[0]
    f.push(insn(JEQ, 0, 1, PID_PLACEHOLDER));
    f.push(insn(RET, 0, 0, allow));
    f.push(insn(RET, 0, 0, deny)); // DENY
    debug_assert_eq!(f.len(), deny_at + 1);
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child under the filter may signal itself but no other process, and the others stay alive.
    #[test]
    fn the_filter_lets_a_child_signal_only_itself() {
        let mut filter = seccomp_filter();
        let mut cmd = Command::new("sh");
        // kill(0) and kill(parent) fail (EPERM), a signal to itself is delivered.
        cmd.args(["-c", "kill -TERM 0 2>/dev/null || echo group-refused; kill -TERM $PPID 2>/dev/null || echo parent-refused; kill -KILL $$"]);
        // SAFETY: as in `probe`.
        unsafe { cmd.pre_exec(move || confine(&mut filter, MAX_FILE)) };
        let out = cmd.output().unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "group-refused\nparent-refused\n");
        assert_eq!(out.status.signal(), Some(libc::SIGKILL));
    }
}
