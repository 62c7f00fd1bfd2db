//! `dflash-host train --nproc N`: N local ranks of the same command, for people without torchrun.
//! Each rank is this binary again with the variables torchrun sets (`RANK`, `LOCAL_RANK`,
//! `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) and a random `DFLASH_RUN_TOKEN` (unless the
//! environment sets one), which tells this run's ranks from another's at the rendezvous. The
//! launcher waits for them; when one fails, the
//! others stop on their own with an error naming it (dist.rs), and any still running after
//! [`GRACE`] are ended. The ranks are this launcher's children under the signal policy of every
//! command (crate::signals): SIGINT, SIGTERM and SIGHUP, whether sent to the launcher or typed at
//! its terminal, reach each rank once, from the launcher (each finishes its step and writes a
//! checkpoint; a rank serving a target replica waits for its lead), and the ranks die with the
//! launcher.

use anyhow::{Context, Result};
use std::{
    ffi::OsString,
    os::unix::process::ExitStatusExt,
    process::{Child, Command, ExitCode, ExitStatus},
    time::{Duration, Instant},
};

/// The most local ranks `--nproc` starts: each is a process with the whole pipeline (or a part
/// of the target) and its own device context; a machine has far fewer GPUs.
pub const MAX_NPROC: usize = 1024;

/// `--nproc N`: a number of ranks from 1 to [`MAX_NPROC`].
pub fn nproc(s: &str) -> Result<usize, String> {
    let n: usize = s.trim().parse().map_err(|e| format!("`{s}`: {e}"))?;
    if !(1..=MAX_NPROC).contains(&n) {
        return Err(format!("{n} ranks: from 1 to {MAX_NPROC}"));
    }
    Ok(n)
}

/// How long the other ranks get to stop on their own after one failed.
pub const GRACE: Duration = Duration::from_secs(60);

/// `args` without `--nproc N` / `--nproc=N` (what each rank runs).
pub fn without_nproc(args: &[OsString]) -> Vec<OsString> {
    let mut out = Vec::new();
    let mut skip = false;
    for a in args {
        if std::mem::take(&mut skip) {
            continue;
        }
        match a.to_str() {
            Some("--nproc") => skip = true,
            Some(s) if s.starts_with("--nproc=") => {}
            _ => out.push(a.clone()),
        }
    }
    out
}

/// `--nproc N` given to a command outside a launcher: N ranks of this same command (its arguments
/// without `--nproc`, then what `extra` adds), and the exit code `launch` gives. None: this
/// process runs the command itself (no `--nproc`, or it is one of the ranks).
pub fn relaunch(nproc: Option<usize>, extra: impl FnOnce() -> Vec<OsString>) -> Result<Option<ExitCode>> {
    let Some(n) = nproc.filter(|_| std::env::var_os("RANK").is_none()) else { return Ok(None) };
    let mut argv = without_nproc(&std::env::args_os().collect::<Vec<_>>());
    argv.extend(extra());
    Ok(Some(ExitCode::from(launch(n, &argv)?)))
}

fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (None, Some(s)) => format!("was killed by signal {s}"),
        _ => "ended".into(),
    }
}

/// 128 random bits in hex (the kernel's random source; the clock and pid where it cannot be read).
fn random_token() -> String {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    if std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes)).is_err() {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        bytes[..8].copy_from_slice(&now.as_nanos().to_le_bytes()[..8]);
        bytes[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Start `nproc` ranks of `args` (this binary's arguments, without `--nproc`) and wait for them.
/// Returns the exit code: the first failing rank's, else rank 0's (0, or 130 / 143 / 129 when a
/// signal stopped them).
pub fn launch(nproc: usize, args: &[OsString]) -> Result<u8> {
    if nproc == 0 {
        anyhow::bail!("--nproc 0: at least one rank");
    }
    let exe = std::env::current_exe().context("this binary's path")?;
    let addr = std::env::var("MASTER_ADDR").unwrap_or_else(|_| "127.0.0.1".into());
    let port = match std::env::var("MASTER_PORT") {
        Ok(p) => p,
        Err(_) => std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port().to_string(),
    };
    let token = std::env::var("DFLASH_RUN_TOKEN").ok().filter(|t| !t.is_empty()).unwrap_or_else(random_token);
    let mut forward = crate::signals::Forward::install()?;
    tracing::info!("launching {nproc} ranks through {addr}:{port}");
    let mut ranks: Vec<(usize, Child)> = Vec::new();
    for rank in 0..nproc {
        let mut cmd = Command::new(&exe);
        cmd.args(&args[1..])
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", nproc.to_string())
            .env("LOCAL_WORLD_SIZE", nproc.to_string())
            .env("MASTER_ADDR", &addr)
            .env("MASTER_PORT", &port)
            .env("DFLASH_RUN_TOKEN", &token);
        let child = crate::signals::spawn_child(&mut cmd).with_context(|| format!("starting rank {rank}"))?;
        ranks.push((rank, child));
    }
    let mut codes: Vec<Option<u8>> = vec![None; nproc];
    let mut failed: Option<(usize, Instant)> = None;
    while codes.iter().any(Option::is_none) {
        for (rank, child) in &mut ranks {
            if codes[*rank].is_some() {
                continue;
            }
            if let Some(status) = child.try_wait()? {
                let code = status.code().map_or(128 + status.signal().unwrap_or(0) as u8, |c| c as u8);
                codes[*rank] = Some(code);
                // A rank that stopped for the signal passed on to it has not failed: the others
                // finish their step and checkpoint in their own time.
                let stopped = forward.code().is_some() && matches!(code, 129 | 130 | 143);
                if !status.success() && !stopped {
                    tracing::warn!("rank {rank} {}", describe(status));
                    if failed.is_none() {
                        failed = Some((*rank, Instant::now()));
                    }
                }
            }
        }
        let running: Vec<u32> =
            ranks.iter().filter(|(rank, _)| codes[*rank].is_none()).map(|(_, child)| child.id()).collect();
        forward.pass_on(&running);
        if let Some((r, at)) = failed {
            if at.elapsed() > GRACE {
                for (rank, child) in &mut ranks {
                    if codes[*rank].is_none() {
                        tracing::warn!(
                            "rank {rank} still running {} s after rank {r} failed: ending it",
                            GRACE.as_secs()
                        );
                        let _ = child.kill();
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let codes: Vec<u8> = codes.into_iter().map(|c| c.expect("every rank ended")).collect();
    Ok(match failed {
        Some((r, _)) => codes[r],
        None => codes[0],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nproc_is_taken_out_of_the_ranks_arguments() {
        let a = |v: &[&str]| v.iter().map(OsString::from).collect::<Vec<_>>();
        assert_eq!(
            without_nproc(&a(&["x", "train", "--nproc", "3", "--config", "c.toml"])),
            a(&["x", "train", "--config", "c.toml"])
        );
        assert_eq!(without_nproc(&a(&["x", "train", "--nproc=2", "--steps", "4"])), a(&["x", "train", "--steps", "4"]));
    }
}
