//! `ab --jobs N`: the runs of a phase trained N at a time, each its own `dflash-host ab --only
//! RUN` process (its own seed, allocator and device context, as a separate `train` would have),
//! its log lines tagged with the run's folder name. Small runs leave most of a GPU idle; several
//! at once fill it. The runs are this process's children under the signal policy of every command
//! (crate::signals): SIGINT, SIGTERM and SIGHUP reach each running run once (it checkpoints and
//! stops), no new run starts, and the phase is not done (the A/B exits with the signal's code and
//! a rerun resumes); the runs die with this process. A run that fails starts no new one either.

use super::plan::{ArmRun, How, Stage};
use anyhow::{bail, Context, Result};
use std::{
    ffi::OsString,
    os::unix::process::ExitStatusExt,
    path::Path,
    process::{Child, Command},
    time::Duration,
};

/// The A/B a parent `ab` runs, to start its runs with.
pub struct Jobs<'a> {
    pub config: &'a Path,
    pub how: &'a How,
    /// Installed by the first phase and kept to the end of the A/B: a signal between phases
    /// stops the next one before it starts a run.
    pub forward: Option<crate::signals::Forward>,
}

/// An `ab --only` process and the run it trains.
struct Running {
    name: String,
    child: Child,
}

impl Jobs<'_> {
    /// Train `runs` (and their evaluations for `stage`), `how.jobs` at a time. Returns the exit
    /// code when a signal stopped the phase (rerunning the A/B resumes it); an error names every
    /// run that failed.
    pub fn run(&mut self, runs: &[&ArmRun], stage: Stage) -> Result<Option<u8>> {
        let mut forward = match self.forward.take() {
            Some(f) => f,
            None => crate::signals::Forward::install()?,
        };
        let stopped = self.run_with(&mut forward, runs, stage);
        self.forward = Some(forward);
        stopped
    }

    fn run_with(&self, forward: &mut crate::signals::Forward, runs: &[&ArmRun], stage: Stage) -> Result<Option<u8>> {
        let mut queue = runs.iter().rev().map(|r| folder(r)).collect::<Vec<_>>();
        let (total, mut running, mut ended) = (runs.len(), Vec::<Running>::new(), Vec::<(String, i32)>::new());
        forward.pass_on(&[]); // a signal since the last phase
        while !queue.is_empty() || !running.is_empty() {
            forward.pass_on(&running.iter().map(|r| r.child.id()).collect::<Vec<_>>());
            let stopping = forward.code().is_some() || ended.iter().any(|(_, code)| *code != 0);
            while running.len() < self.how.jobs && !stopping {
                let Some(name) = queue.pop() else { break };
                let phase = if stage == Stage::First { 1 } else { 2 };
                let k = total - queue.len();
                tracing::info!("A/B phase {phase}, run {k}/{total}: `{name}` started ({} at once)", self.how.jobs);
                running.push(Running { child: self.start(&name, stage)?, name });
            }
            let mut i = 0;
            while i < running.len() {
                match running[i].child.try_wait()? {
                    Some(status) => {
                        let r = running.swap_remove(i);
                        let code = status.code().unwrap_or(128 + status.signal().unwrap_or(0));
                        if code != 0 {
                            tracing::warn!("A/B: run `{}` exited with status {code}", r.name);
                        }
                        ended.push((r.name, code));
                    }
                    None => i += 1,
                }
            }
            if stopping && running.is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        // SIGINT, SIGTERM and SIGHUP stop a run with a checkpoint and status 130 / 143 / 129.
        let failed: Vec<&(String, i32)> =
            ended.iter().filter(|(_, code)| *code != 0 && !matches!(code, 129 | 130 | 143)).collect();
        if !failed.is_empty() {
            let names: Vec<String> = failed.iter().map(|(n, c)| format!("`{n}` (status {c})")).collect();
            bail!("A/B: {} of {total} runs failed: {} (their logs above name why)", failed.len(), names.join(", "));
        }
        // A signal stops the phase: whatever its runs did, it is not done, and a rerun goes on.
        let stopped = ended.iter().find(|(_, code)| *code != 0).map(|(_, code)| *code as u8);
        Ok(forward.code().or(stopped))
    }

    /// `dflash-host ab --config C [--seeds N] [--device D] --only NAME --stage S`, its log lines
    /// tagged with NAME.
    fn start(&self, name: &str, stage: Stage) -> Result<Child> {
        let exe = std::env::current_exe().context("this binary's path")?;
        let mut args: Vec<OsString> = vec!["ab".into(), "--config".into(), self.config.into()];
        if let Some(n) = self.how.seeds {
            args.extend(["--seeds".into(), n.to_string().into()]);
        }
        if let Some(d) = &self.how.device {
            args.extend(["--device".into(), d.into()]);
        }
        let stage = match stage {
            Stage::First => "first",
            Stage::Compared => "compared",
        };
        args.extend(["--only".into(), name.into(), "--stage".into(), stage.into()]);
        let mut cmd = Command::new(exe);
        cmd.args(args).env(crate::out::LOG_TAG, name);
        crate::signals::spawn_child(&mut cmd).with_context(|| format!("starting run `{name}`"))
    }
}

fn folder(r: &ArmRun) -> String {
    r.dir.file_name().map_or_else(String::new, |n| n.to_string_lossy().to_string())
}
