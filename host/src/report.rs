//! `report`: what bounds a run, from its metrics.jsonl. Each line gives a logging window's
//! seconds per step in each stage: the targets' work summed over their workers (`target_s`),
//! the drafter's forward + loss + backward (`drafter_s`), the optimizer (`optim_s`) and the
//! drafter waiting for features (`wait_s`). The targets run in parallel workers beside the
//! drafter's thread, so a step takes at least the slower of target_s / workers and
//! drafter_s + optim_s; the report models a faster drafter step or optimizer on that.

use crate::{
    config::MAX_STEPS,
    experiment::{self, metrics::METRICS},
};
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::path::Path;

/// The stage timings of a run, averaged over its logging windows (each weighed by its steps;
/// the first window, which holds the start-up, is left out when there are others).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Report {
    pub steps_done: u64,
    pub steps_total: u64,
    pub grad_accum: u64,
    pub target_workers: usize,
    /// Seconds per step: target work (all workers), drafter, optimizer, drafter waiting.
    pub target_s: f64,
    pub drafter_s: f64,
    pub optim_s: f64,
    pub wait_s: f64,
    /// Micro-batches per second one target worker computes, and the drafter stage consumes.
    pub target_batches_per_s_per_worker: f64,
    pub drafter_batches_per_s: f64,
    /// The optimizer's share of the drafter stage's step.
    pub optimizer_share: f64,
    /// `target` or `drafter` (its forward, backward and optimizer), and the slower stage's time
    /// over the faster's.
    pub bound_by: String,
    pub bound_ratio: f64,
    /// The hidden-state queue: mean batches waiting, the most seen at a window's end, and the
    /// share of windows where it was mostly empty (mean < 0.5: the drafter waited on targets).
    pub q_hs_mean: f64,
    pub q_hs_max: usize,
    pub q_hs_empty_share: f64,
    /// Measured seconds per step (the drafter's thread: work + waiting).
    pub step_s: f64,
    /// The ETA to `steps_total` at the measured step time.
    pub eta_s: f64,
    /// The data's epochs: where the run is, and what the configured steps amount to.
    pub epochs: Epochs,
    pub what_if: Vec<WhatIf>,
}

/// The data's passes, from the `epoch` of each metrics line (the data loader's epoch after the
/// window's last batch).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Epochs {
    /// The epoch the run is in (0: the first pass).
    pub current: u64,
    /// Steps an epoch takes: the last step logged before the current epoch over the epochs
    /// completed (to within `train.log_every` steps); None before the first epoch completes.
    pub steps_per_epoch: Option<f64>,
    /// The epochs the configured steps make.
    pub configured: Option<f64>,
    /// The ETA to the end of the current epoch.
    pub eta_epoch_end_s: Option<f64>,
}

/// A k-times faster drafter step or optimizer: the modelled step time and the wall time left.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct WhatIf {
    pub what: String,
    pub k: f64,
    pub step_s: f64,
    pub eta_s: f64,
    /// The share of wall time it saves (0: none, the other stage bounds the run).
    pub saves: f64,
}

/// The what-ifs a report lists.
const SPEEDUPS: [f64; 2] = [2.0, 4.0];

/// Read `exp`'s config.toml (steps, grad_accum) and metrics.jsonl, and report.
pub fn report(exp: &Path) -> Result<Report> {
    let cfg_path = exp.join(experiment::CONFIG);
    let text = input_files::read_to_string_capped(&cfg_path, 16 << 20)?;
    let cfg: toml::Table = toml::from_str(&text).with_context(|| format!("{}: not valid TOML", cfg_path.display()))?;
    let train = cfg.get("train").and_then(|t| t.as_table());
    // A count the run could have been given (1..=MAX_STEPS), or a refusal naming the field.
    let count = |key: &str| -> Result<Option<u64>> {
        let Some(v) = train.and_then(|t| t.get(key)) else { return Ok(None) };
        match v.as_integer().and_then(|n| u64::try_from(n).ok()).filter(|n| (1..=MAX_STEPS).contains(n)) {
            Some(n) => Ok(Some(n)),
            None => bail!("{}: train.{key} is {v}, not a count in 1..={MAX_STEPS}", cfg_path.display()),
        }
    };
    let steps = count("steps")?.with_context(|| format!("{}: no train.steps", cfg_path.display()))?;
    let grad_accum = count("grad_accum")?.unwrap_or(1);
    // Line by line through the cap every reader of metrics.jsonl uses: a corrupt line is refused
    // before it is held whole.
    let path = exp.join(METRICS);
    let file = path.display().to_string();
    let windows = parse(crate::experiment::metrics::lines(&path)?.map(|l| l.map_err(Into::into)), &file)?;
    from_windows(windows, &file, steps, grad_accum)
}

/// Most seconds a stage's time a step may read (a day): beyond it the line is not a measurement.
const MAX_STEP_SECONDS: f64 = 86_400.0;
/// Most batches the hidden-state queue may read as holding.
const MAX_QUEUE: f64 = (1u64 << 20) as f64;

/// One window of metrics.jsonl, as far as the report needs it.
struct Window {
    /// Its line in the file (from 1), for errors.
    line: usize,
    step: u64,
    epoch: u64,
    target_s: f64,
    drafter_s: f64,
    optim_s: f64,
    wait_s: f64,
    workers: usize,
    q_hs: f64,
    q_hs_now: usize,
}

fn parse(lines: impl Iterator<Item = Result<String>>, file: &str) -> Result<Vec<Window>> {
    let mut out = Vec::new();
    for (i, line) in lines.enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(&line).with_context(|| format!("{file}:{}: not a JSON line", i + 1))?;
        // Not a step line: skipped.
        let Some(target_s) = v.get("target_s").and_then(|x| x.as_f64()) else { continue };
        // Every number in its range, so no sum, ratio or ETA below overflows or reads NaN.
        let within = |k: &str, x: f64, max: f64| {
            if x.is_finite() && (0.0..=max).contains(&x) {
                Ok(x)
            } else {
                let shown = if x.abs() >= 1e9 { format!("{x:e}") } else { x.to_string() };
                Err(anyhow::anyhow!("{file}:{}: `{k}` is {shown}, not in 0..={max}", i + 1))
            }
        };
        let num =
            |k: &str| v.get(k).and_then(|x| x.as_f64()).with_context(|| format!("{file}:{}: no number `{k}`", i + 1));
        let seconds = |k: &str| within(k, num(k)?, MAX_STEP_SECONDS);
        let step = v.get("step").and_then(|x| x.as_u64()).with_context(|| format!("{file}:{}: no `step`", i + 1))?;
        if step > MAX_STEPS {
            bail!("{file}:{}: `step` is {step}, beyond any run's steps ({MAX_STEPS})", i + 1);
        }
        out.push(Window {
            line: i + 1,
            step,
            epoch: v.get("epoch").and_then(|x| x.as_u64()).unwrap_or(0),
            target_s: within("target_s", target_s, MAX_STEP_SECONDS)?,
            drafter_s: seconds("drafter_s")?,
            optim_s: seconds("optim_s")?,
            wait_s: seconds("wait_s")?,
            workers: v.get("target_busy").and_then(|x| x.as_array()).map_or(1, |a| a.len().max(1)),
            q_hs: within("q_hs", num("q_hs")?, MAX_QUEUE)?,
            q_hs_now: within("q_hs_now", v.get("q_hs_now").and_then(|x| x.as_f64()).unwrap_or(0.0), MAX_QUEUE)?
                as usize,
        });
    }
    Ok(out)
}

/// The report from metrics.jsonl's text (`file` names it in errors).
pub fn from_metrics(text: &str, file: &str, steps_total: u64, grad_accum: u64) -> Result<Report> {
    from_windows(parse(text.lines().map(|l| Ok(l.to_string())), file)?, file, steps_total, grad_accum)
}

fn from_windows(windows: Vec<Window>, file: &str, steps_total: u64, grad_accum: u64) -> Result<Report> {
    if windows.is_empty() {
        bail!("{file}: no step lines yet (the first comes after train.log_every steps)");
    }
    // The run's lines are of its own steps, and its data loader's epochs are at most one a batch.
    for w in &windows {
        if w.step > steps_total {
            bail!("{file}:{}: step {} is beyond the run's train.steps ({steps_total})", w.line, w.step);
        }
        if w.epoch > w.step.saturating_mul(grad_accum) {
            bail!(
                "{file}:{}: epoch {} after {} micro-batches (at most one an epoch)",
                w.line,
                w.epoch,
                w.step * grad_accum
            );
        }
    }
    // Each window's length in steps; the first (start-up) only when it is the only one.
    let mut weighted: Vec<(f64, &Window)> = Vec::new();
    let mut prev = 0;
    for (i, w) in windows.iter().enumerate() {
        let len = w.step.saturating_sub(prev).max(1) as f64;
        prev = w.step;
        if i > 0 || windows.len() == 1 {
            weighted.push((len, w));
        }
    }
    let total: f64 = weighted.iter().map(|(n, _)| n).sum();
    let mean = |f: &dyn Fn(&Window) -> f64| weighted.iter().map(|(n, w)| n * f(w)).sum::<f64>() / total;
    let (target_s, drafter_s, optim_s, wait_s) =
        (mean(&|w| w.target_s), mean(&|w| w.drafter_s), mean(&|w| w.optim_s), mean(&|w| w.wait_s));
    let workers = windows.last().map_or(1, |w| w.workers);
    let target_stage = target_s / workers as f64;
    let drafter_stage = drafter_s + optim_s;
    // The slower stage over the faster (1 when both took no time; infinite when only the faster did).
    let (bound_by, slower, faster) = if target_stage >= drafter_stage {
        ("target", target_stage, drafter_stage)
    } else {
        ("drafter", drafter_stage, target_stage)
    };
    let bound_ratio = if slower == 0.0 { 1.0 } else { slower / faster };
    let step_s = drafter_s + optim_s + wait_s;
    let steps_done = windows.last().map_or(0, |w| w.step);
    let left = steps_total.saturating_sub(steps_done) as f64;
    let modelled_now = target_stage.max(drafter_stage);
    // A modelled step time scales the measured one: what the model says changes, nothing else.
    let what_if = |what: &str, k: f64, drafter: f64| {
        let modelled = target_stage.max(drafter);
        let saves = if modelled_now > 0.0 { 1.0 - modelled / modelled_now } else { 0.0 };
        let step = step_s * (1.0 - saves);
        WhatIf { what: what.into(), k, step_s: step, eta_s: left * step, saves }
    };
    let mut what_ifs = Vec::new();
    for k in SPEEDUPS {
        what_ifs.push(what_if("drafter step", k, drafter_s / k + optim_s));
    }
    for k in SPEEDUPS {
        what_ifs.push(what_if("optimizer", k, drafter_s + optim_s / k));
    }
    let per_s = |secs: f64, batches: f64| if secs > 0.0 { batches / secs } else { f64::INFINITY };
    Ok(Report {
        steps_done,
        steps_total,
        grad_accum,
        target_workers: workers,
        target_s,
        drafter_s,
        optim_s,
        wait_s,
        // Each worker computes grad_accum / workers micro-batches a step in target_s / workers.
        target_batches_per_s_per_worker: per_s(target_s, grad_accum as f64),
        drafter_batches_per_s: per_s(drafter_stage, grad_accum as f64),
        optimizer_share: if drafter_stage > 0.0 { optim_s / drafter_stage } else { 0.0 },
        bound_by: bound_by.into(),
        bound_ratio,
        q_hs_mean: mean(&|w| w.q_hs),
        q_hs_max: windows.iter().map(|w| w.q_hs_now).max().unwrap_or(0),
        q_hs_empty_share: weighted.iter().filter(|(_, w)| w.q_hs < 0.5).fold(0.0, |a, (n, _)| a + n) / total,
        step_s,
        eta_s: left * step_s,
        epochs: epochs(&windows, steps_total, step_s),
        what_if: what_ifs,
    })
}

/// Where the run is in its data, from the lines' epochs.
fn epochs(windows: &[Window], steps_total: u64, step_s: f64) -> Epochs {
    let last = windows.last().expect("at least one window");
    let current = last.epoch;
    // The last step seen before the current epoch began: exact with `log_every = 1`.
    let before_current = windows.iter().take_while(|w| w.epoch < current).last().map_or(0, |w| w.step);
    let steps_per_epoch = (current > 0 && before_current > 0).then(|| before_current as f64 / current as f64);
    Epochs {
        current,
        steps_per_epoch,
        configured: steps_per_epoch.map(|n| steps_total as f64 / n),
        eta_epoch_end_s: steps_per_epoch.map(|n| ((current + 1) as f64 * n - last.step as f64).max(0.0) * step_s),
    }
}

/// The report as the lines `dflash-host report` prints.
pub fn lines(r: &Report) -> Vec<String> {
    let mut out = vec![
        format!("steps          {} of {} (grad_accum {})", r.steps_done, r.steps_total, r.grad_accum),
        format!(
            "target         {} batches/s per worker ({} worker{}; {:.3} s of target work a step)",
            rate(r.target_batches_per_s_per_worker),
            r.target_workers,
            if r.target_workers == 1 { "" } else { "s" },
            r.target_s
        ),
        format!(
            "drafter        {} batches/s ({:.3} s forward + backward, {:.3} s optimizer a step: optimizer {:.0}%)",
            rate(r.drafter_batches_per_s),
            r.drafter_s,
            r.optim_s,
            100.0 * r.optimizer_share
        ),
        format!(
            "bound by       the {} stage, {} the other{}",
            r.bound_by,
            if r.bound_ratio.is_finite() { format!("{:.2}x", r.bound_ratio) } else { "while no time was measured for".into() },
            if r.bound_by == "target" { " (more target workers would help)" } else { "" }
        ),
        format!(
            "queue q_hs     {:.2} batches waiting on average, {} at most; nearly empty in {:.0}% of the steps; drafter waited {:.3} s a step",
            r.q_hs_mean,
            r.q_hs_max,
            100.0 * r.q_hs_empty_share,
            r.wait_s
        ),
    ];
    // A finished run has nothing left to estimate: it says so, and the what-ifs say what each
    // speed-up would have saved.
    let finished = r.steps_done >= r.steps_total;
    if finished {
        out.push(format!("step           {:.3} s measured; finished: all {} steps done", r.step_s, r.steps_total));
    } else {
        out.push(format!(
            "step           {:.3} s measured; ETA {} to step {}",
            r.step_s,
            duration(r.eta_s),
            r.steps_total
        ));
    }
    out.push(epoch_line(&r.epochs, finished));
    for w in &r.what_if {
        let eta = if finished { String::new() } else { format!(", ETA {}", duration(w.eta_s)) };
        let less = if finished { "a step less" } else { "less" };
        out.push(format!(
            "what if        {}x faster {}: {:.3} s a step{eta} ({:.0}% {less})",
            w.k,
            w.what,
            w.step_s,
            100.0 * w.saves
        ));
    }
    out
}

fn epoch_line(e: &Epochs, finished: bool) -> String {
    match (e.steps_per_epoch, e.configured, e.eta_epoch_end_s) {
        (Some(n), Some(total), _) if finished => format!(
            "epochs         {total:.2} epochs of ~{n:.0} steps each (ended in epoch {})",
            e.current
        ),
        (Some(n), Some(total), Some(eta)) => format!(
            "epochs         in epoch {} ({} completed, ~{n:.0} steps each): the configured steps make {total:.2} epochs; ETA {} to the end of epoch {}",
            e.current,
            e.current,
            duration(eta),
            e.current
        ),
        _ => format!("epochs         in epoch {}; none completed yet, so an epoch's length is not measured", e.current),
    }
}

/// A rate, or `-` where no time was measured to divide by.
fn rate(per_s: f64) -> String {
    if per_s.is_finite() {
        format!("{per_s:.3}")
    } else {
        "-".into()
    }
}

/// Seconds as a person reads them: `42 s`, `3m05s`, `27h40m`, `412 days`, at most
/// `more than 1000 years` (never a count of hours no one can read).
fn duration(s: f64) -> String {
    const DAY: f64 = 86_400.0;
    // NaN reads as too long too.
    if s.is_nan() || s >= 1000.0 * 365.25 * DAY {
        return "more than 1000 years".into();
    }
    let s = s.max(0.0).round() as u64;
    match s {
        0..=59 => format!("{s} s"),
        60..=3599 => format!("{}m{:02}s", s / 60, s % 60),
        3600..=359_999 => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
        _ => format!("{} days", s / 86_400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(step: u64, target_s: f64, workers: usize, drafter_s: f64, optim_s: f64, wait_s: f64, q: f64) -> String {
        let busy = vec![0.5; workers];
        serde_json::json!({
            "step": step, "loss": 1.0, "target_s": target_s, "drafter_s": drafter_s, "optim_s": optim_s,
            "wait_s": wait_s, "target_busy": busy, "q_hs": q, "q_hs_now": (q as usize) + 1,
        })
        .to_string()
    }

    #[test]
    fn a_target_bound_run_gains_nothing_from_a_faster_drafter() {
        // Two workers, 4 s of target work a step: 2 s a step of target stage; the drafter 1.5 s.
        let mut text = line(10, 9.0, 2, 5.0, 5.0, 5.0, 3.0) + "\n"; // start-up window, left out
        for s in [20, 30, 40] {
            text += &(line(s, 4.0, 2, 1.0, 0.5, 0.5, 0.2) + "\n");
        }
        text += r#"{"step": 40, "val_loss": 1.2}"#;
        let r = from_metrics(&text, "m.jsonl", 100, 4).unwrap();
        assert_eq!(r.bound_by, "target");
        assert!((r.bound_ratio - 2.0 / 1.5).abs() < 1e-9, "{}", r.bound_ratio);
        assert_eq!(r.target_workers, 2);
        assert!((r.target_batches_per_s_per_worker - 1.0).abs() < 1e-9); // 4 batches / 4 s
        assert!((r.drafter_batches_per_s - 4.0 / 1.5).abs() < 1e-9);
        assert!((r.optimizer_share - 1.0 / 3.0).abs() < 1e-9);
        assert!((r.step_s - 2.0).abs() < 1e-9);
        assert!((r.eta_s - 60.0 * 2.0).abs() < 1e-6);
        assert_eq!(r.q_hs_empty_share, 1.0);
        for w in &r.what_if {
            assert_eq!(w.saves, 0.0, "{w:?}");
            assert!((w.eta_s - 120.0).abs() < 1e-6);
        }
    }

    #[test]
    fn a_drafter_bound_run_gains_what_the_slower_stage_loses() {
        // One worker, 1 s of target work; the drafter 2 s + 1 s optimizer.
        let text: String = [10, 20].map(|s| line(s, 1.0, 1, 2.0, 1.0, 0.0, 6.0) + "\n").concat();
        let r = from_metrics(&text, "m.jsonl", 20, 1).unwrap();
        assert_eq!(r.bound_by, "drafter");
        assert!((r.bound_ratio - 3.0).abs() < 1e-9);
        assert!(r.q_hs_empty_share == 0.0 && r.q_hs_empty_share.is_sign_positive()); // printed "0%", not "-0%"
        assert_eq!(r.eta_s, 0.0);
        // Finished: no ETA of 0 s, the run says it is done.
        let printed = lines(&r).join("\n");
        assert!(printed.contains("finished: all 20 steps done") && !printed.contains("ETA"), "{printed}");
        assert!(printed.contains("2x faster drafter step: 2.000 s a step (33% a step less)"), "{printed}");
        let find = |what: &str, k: f64| r.what_if.iter().find(|w| w.what == what && w.k == k).unwrap().clone();
        // 2x drafter step: 1 + 1 = 2 s (a third less); 4x: 0.5 + 1 = 1.5 s.
        assert!((find("drafter step", 2.0).step_s - 2.0).abs() < 1e-9);
        assert!((find("drafter step", 4.0).step_s - 1.5).abs() < 1e-9);
        // 2x optimizer: 2 + 0.5 = 2.5 s; 4x: 2.25 s.
        assert!((find("optimizer", 2.0).step_s - 2.5).abs() < 1e-9);
        assert!((find("optimizer", 4.0).saves - 0.25).abs() < 1e-9);
    }

    #[test]
    fn a_drafter_step_faster_than_the_target_is_bound_by_the_target() {
        // 4x faster drafter: 0.5 + 1 = 1.5 s, but the target stage takes 1.8 s.
        let text: String = [10, 20].map(|s| line(s, 1.8, 1, 2.0, 1.0, 0.0, 6.0) + "\n").concat();
        let r = from_metrics(&text, "m.jsonl", 120, 1).unwrap();
        let w = r.what_if.iter().find(|w| w.what == "drafter step" && w.k == 4.0).unwrap();
        assert!((w.step_s - 1.8).abs() < 1e-9, "{w:?}");
        assert!((w.eta_s - 100.0 * 1.8).abs() < 1e-6);
    }

    #[test]
    fn the_epochs_come_from_the_step_where_each_began() {
        // 2 s a step; epoch 2 began after step 60: 30 steps an epoch.
        let at = |step: u64, epoch: u64| {
            let mut v: serde_json::Value = serde_json::from_str(&line(step, 1.0, 1, 1.5, 0.5, 0.0, 1.0)).unwrap();
            v["epoch"] = epoch.into();
            v.to_string() + "\n"
        };
        let text: String =
            [(10, 0), (20, 0), (30, 0), (40, 1), (50, 1), (60, 1), (70, 2)].map(|(s, e)| at(s, e)).concat();
        let r = from_metrics(&text, "m.jsonl", 120, 1).unwrap();
        assert_eq!(r.epochs.current, 2);
        assert_eq!(r.epochs.steps_per_epoch, Some(30.0));
        assert_eq!(r.epochs.configured, Some(4.0));
        // The end of epoch 2 at step 90: 20 steps of 2 s.
        assert!((r.epochs.eta_epoch_end_s.unwrap() - 40.0).abs() < 1e-9);
        assert!(lines(&r).iter().any(|l| l.contains("4.00 epochs") && l.contains("ETA 40 s to the end of epoch 2")));
        let first_pass = from_metrics(&at(10, 0), "m.jsonl", 120, 1).unwrap();
        assert_eq!((first_pass.epochs.current, first_pass.epochs.steps_per_epoch), (0, None));
    }

    #[test]
    fn errors_name_the_file_and_line() {
        let e = from_metrics("{\"step\": 1, \"target_s\": 1.0}\n", "m.jsonl", 10, 1).unwrap_err();
        assert!(format!("{e:#}").contains("m.jsonl:1: no number `drafter_s`"), "{e:#}");
        let e = from_metrics("not json\n", "m.jsonl", 10, 1).unwrap_err();
        assert!(format!("{e:#}").contains("m.jsonl:1"), "{e:#}");
        assert!(from_metrics("", "m.jsonl", 10, 1).is_err());
    }

    /// Numbers no run writes are refused naming the file, line and field, so no ETA of
    /// "5124095576030431h", ratio of "NaNx" or "step 4 of 18446744073709551615" is printed.
    #[test]
    fn absurd_numbers_are_refused_or_read_sanely() {
        let with = |k: &str, x: serde_json::Value| {
            let mut v: serde_json::Value = serde_json::from_str(&line(10, 1.0, 1, 1.0, 0.5, 0.0, 1.0)).unwrap();
            v[k] = x;
            v.to_string() + "\n"
        };
        for (k, x, want) in [
            ("drafter_s", serde_json::json!(1e300), "m.jsonl:1: `drafter_s` is 1e300, not in 0..=86400"),
            ("target_s", serde_json::json!(-1.0), "m.jsonl:1: `target_s` is -1, not in 0..=86400"),
            ("q_hs", serde_json::json!(1e30), "m.jsonl:1: `q_hs` is 1e30, not in 0..="),
            ("step", serde_json::json!(u64::MAX), "m.jsonl:1: `step` is 18446744073709551615, beyond any run's steps"),
            ("step", serde_json::json!(200), "m.jsonl:1: step 200 is beyond the run's train.steps (100)"),
            ("epoch", serde_json::json!(u64::MAX), "m.jsonl:1: epoch 18446744073709551615 after 10 micro-batches"),
        ] {
            let e = format!("{:#}", from_metrics(&with(k, x), "m.jsonl", 100, 1).unwrap_err());
            assert!(e.contains(want), "{k}: {e}");
        }
        // A long run reads in days, a longer one is capped; no stage time gives no NaN.
        assert_eq!(duration(86_400.0 * 412.0), "412 days");
        assert_eq!(duration(3600.0 * 27.0 + 40.0 * 60.0), "27h40m");
        assert_eq!(duration(f64::MAX), "more than 1000 years");
        assert_eq!(duration(f64::NAN), "more than 1000 years");
        let idle = from_metrics(&line(10, 0.0, 1, 0.0, 0.0, 0.0, 0.0), "m.jsonl", (1u64 << 40) - 1, 1).unwrap();
        let text = lines(&idle).join("\n");
        assert!(!text.contains("NaN") && !text.contains("inf"), "{text}");
        assert!(text.contains("1.00x the other") && text.contains("ETA 0 s"), "{text}");
        let slow = from_metrics(&line(10, 80_000.0, 1, 80_000.0, 0.0, 0.0, 0.0), "m.jsonl", 1u64 << 40, 1).unwrap();
        let text = lines(&slow).join("\n");
        assert!(text.contains("ETA more than 1000 years"), "{text}");
    }
}
