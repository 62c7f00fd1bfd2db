//! The comparison's tables, each a header and rows of cells, rendered as Markdown or aligned
//! for the terminal.

use crate::compare::{
    format::{fmt_opt, fmt_stat, DASH},
    runs::{Run, Status},
    stats::Comparison,
    sweep::{ArmSweep, Selection, Sweeps},
};
use std::{fmt::Write as _, path::Path};

pub(super) struct Table {
    header: Vec<String>,
    pub(super) rows: Vec<Vec<String>>,
    /// Leading columns that are text (left-aligned); the rest are numbers.
    text_cols: usize,
}

impl Table {
    pub(super) fn markdown(&self) -> String {
        let mut s = format!("| {} |\n|", self.header.join(" | "));
        for c in 0..self.header.len() {
            s += if c < self.text_cols { " --- |" } else { " ---: |" };
        }
        s.push('\n');
        for row in &self.rows {
            let cells: Vec<String> = row.iter().map(|c| c.replace('|', "\\|")).collect();
            let _ = writeln!(s, "| {} |", cells.join(" | "));
        }
        s
    }

    pub(super) fn terminal(&self) -> String {
        let width = |s: &str| s.chars().count();
        let widths: Vec<usize> = (0..self.header.len())
            .map(|c| self.rows.iter().map(|r| width(&r[c])).chain([width(&self.header[c])]).max().unwrap_or(0))
            .collect();
        let line = |cells: &[String]| {
            let parts: Vec<String> = cells
                .iter()
                .enumerate()
                .map(|(c, cell)| {
                    let pad = " ".repeat(widths[c] - width(cell));
                    if c < self.text_cols {
                        format!("{cell}{pad}")
                    } else {
                        format!("{pad}{cell}")
                    }
                })
                .collect();
            parts.join("  ").trim_end().to_string() + "\n"
        };
        let mut s = line(&self.header);
        s += &line(&widths.iter().map(|&w| "-".repeat(w)).collect::<Vec<_>>());
        for row in &self.rows {
            s += &line(row);
        }
        s
    }
}

pub(super) fn group_table(cmp: &Comparison) -> Table {
    let header = [
        "group",
        "runs",
        "loss @T",
        "best loss",
        "tau_hat @T",
        "best tau_hat",
        "acc@1 @T",
        "wall @T (s)",
        "tok/s",
        "final tokens",
        "wall total (s)",
        "tau (eval)",
    ];
    let rows = cmp
        .groups
        .iter()
        .map(|g| {
            let n = g.members.len();
            let runs = if n == g.listed { n.to_string() } else { format!("{n} of {}", g.listed) };
            vec![
                g.name.clone(),
                runs,
                fmt_stat(g.loss, 4, n),
                fmt_stat(g.best_loss, 4, n),
                fmt_stat(g.tau_hat, 3, n),
                fmt_stat(g.best_tau_hat, 3, n),
                fmt_stat(g.acc.first().copied().flatten(), 3, n),
                fmt_stat(g.elapsed_s, 1, n),
                fmt_stat(g.tok_per_s, 0, n),
                fmt_stat(g.final_tokens, 0, n),
                fmt_stat(g.wall_s, 1, n),
                fmt_stat(g.eval_tau, 3, n),
            ]
        })
        .collect();
    Table { header: header.map(String::from).to_vec(), rows, text_cols: 2 }
}

/// Each group on held-out data: the validation split at each run's end (loss, tau-hat, real
/// tau on its prompts) and real tau on the test prompts.
pub(super) fn held_out_table(cmp: &Comparison) -> Table {
    let header = ["group", "runs", "val loss", "val tau_hat", "val tau (eval)", "test tau (eval)"];
    let rows = cmp
        .groups
        .iter()
        .map(|g| {
            let n = g.members.len();
            vec![
                g.name.clone(),
                n.to_string(),
                fmt_stat(g.val_loss, 4, n),
                fmt_stat(g.val_tau_hat, 3, n),
                fmt_stat(g.val_eval_tau, 3, n),
                fmt_stat(g.eval_tau, 3, n),
            ]
        })
        .collect();
    Table { header: header.map(String::from).to_vec(), rows, text_cols: 2 }
}

pub(super) fn has_held_out(cmp: &Comparison) -> bool {
    cmp.groups
        .iter()
        .any(|g| g.val_loss.is_some() || g.val_tau_hat.is_some() || g.val_eval_tau.is_some() || g.eval_tau.is_some())
}

/// Each group after W training seconds.
pub(super) fn wall_table(cmp: &Comparison) -> Table {
    let header = ["group", "runs", "loss @W", "tau_hat @W", "tokens @W"];
    let rows = cmp
        .groups
        .iter()
        .map(|g| {
            let n = g.members.len();
            vec![
                g.name.clone(),
                n.to_string(),
                fmt_stat(g.loss_at_wall, 4, n),
                fmt_stat(g.tau_hat_at_wall, 3, n),
                fmt_stat(g.tokens_at_wall, 0, n),
            ]
        })
        .collect();
    Table { header: header.map(String::from).to_vec(), rows, text_cols: 2 }
}

/// One swept arm's values: the score that chose (what `selection.json` recorded) and each
/// value's first-seed run on the validation split and in training.
pub(super) fn sweep_table(sweeps: &Sweeps, ab_dir: &Path, sel: &Selection, arm: &ArmSweep) -> Table {
    let header = [
        "value",
        "run",
        "status",
        &format!("{} (chooses)", sel.select),
        "val loss",
        "val tau_hat",
        "val tau (eval)",
        "train loss (end)",
        "chosen",
    ];
    let rows = arm
        .points
        .iter()
        .map(|p| {
            let run = sweeps.run_of(ab_dir, p);
            let val = run.and_then(Run::last_val);
            vec![
                p.label.clone(),
                p.run.clone(),
                run.map_or("missing".into(), |r| r.status.as_str().to_string()),
                fmt_opt(p.score, 4),
                fmt_opt(val.map(|v| v.loss), 4),
                fmt_opt(val.map(|v| v.tau_hat), 3),
                fmt_opt(run.and_then(|r| r.val_eval_tau), 3),
                fmt_opt(run.and_then(|r| r.records.last()).map(|x| x.loss), 4),
                if p.label == arm.chosen { "yes".into() } else { String::new() },
            ]
        })
        .collect();
    Table { header: header.iter().map(|h| h.to_string()).collect(), rows, text_cols: 3 }
}

pub(super) fn sweep_sentence(sel: &Selection, arm: &ArmSweep) -> String {
    format!(
        "Arm **{}** swept `{}` over {} values with seed {}, each scored on the validation split by `{}` ({} is better); \
         chosen: **{}**. Its runs at that value, one per seed, are the arm's in the comparison; the test prompts played no \
         part in the choice.",
        arm.arm,
        arm.fields.join("`, `"),
        arm.points.len(),
        sel.seed,
        sel.select,
        if sel.higher_is_better { "higher" } else { "lower" },
        arm.chosen
    )
}

pub(super) fn run_table(runs: &[Run], cmp: &Comparison) -> Table {
    let header = [
        "run",
        "group",
        "status",
        "loss @T",
        "best loss",
        "tau_hat @T",
        "best tau_hat",
        "acc@1 @T",
        "wall @T (s)",
        "tok/s",
        "final tokens",
        "wall total (s)",
        "tau (eval)",
    ];
    let rows = runs
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let a = cmp.at[i].as_ref();
            let mut status = r.status.as_str().to_string();
            if r.has_data() && a.is_none() {
                status += " (< T)";
            } else if r.has_data() && !cmp.counted[i] {
                status += " (not in group stats)";
            }
            vec![
                r.label.clone(),
                if r.status == Status::NotExperiment { DASH.into() } else { r.group.clone() },
                status,
                fmt_opt(a.map(|a| a.loss), 4),
                fmt_opt(a.map(|a| a.best_loss), 4),
                fmt_opt(a.map(|a| a.tau_hat), 3),
                fmt_opt(a.map(|a| a.best_tau_hat), 3),
                fmt_opt(a.and_then(|a| a.acc.first().copied()), 3),
                fmt_opt(a.map(|a| a.elapsed_s), 1),
                fmt_opt(a.map(|a| a.tok_per_s), 0),
                r.final_tokens().map_or(DASH.into(), |t| format!("{t:.0}")),
                fmt_opt(r.wall_s(), 1),
                fmt_opt(r.eval_tau, 3),
            ]
        })
        .collect();
    Table { header: header.map(String::from).to_vec(), rows, text_cols: 3 }
}

/// Each run at its own end: what it reached, whatever the others did.
pub(super) fn final_table(runs: &[Run]) -> Table {
    let header = [
        "run",
        "group",
        "status",
        "step",
        "tokens",
        "loss",
        "tau_hat",
        "acc@1",
        "lr",
        "grad norm",
        "wall (s)",
        "tau (eval)",
    ];
    let rows = runs
        .iter()
        .filter(|r| r.has_data())
        .map(|r| {
            let last = r.records.last().expect("has data");
            vec![
                r.label.clone(),
                r.group.clone(),
                r.status.as_str().to_string(),
                last.step.to_string(),
                format!("{:.0}", last.tokens),
                fmt_opt(Some(last.loss), 4),
                fmt_opt(Some(last.tau_hat), 3),
                fmt_opt(last.acc.first().copied(), 3),
                format!("{:.2e}", last.lr),
                fmt_opt(Some(last.grad_norm), 3),
                fmt_opt(r.wall_s(), 1),
                fmt_opt(r.eval_tau, 3),
            ]
        })
        .collect();
    Table { header: header.map(String::from).to_vec(), rows, text_cols: 3 }
}

/// Every eval*.json of every run.
pub(super) fn eval_table(runs: &[Run]) -> Table {
    let header = ["run", "file", "prompts", "evaluated", "tau", "tau pooled", "cycles"];
    let rows = runs
        .iter()
        .flat_map(|r| r.evals.iter().map(move |e| (r, e)))
        .map(|(r, e)| {
            let what = match (&e.drafter, e.checkpoint_step) {
                (Some(d), _) => d.clone(),
                (None, Some(s)) => format!("step-{s}"),
                (None, None) => DASH.into(),
            };
            vec![
                r.label.clone(),
                e.file.clone(),
                format!("{} ({})", e.prompts.map_or(DASH.into(), |n| n.to_string()), e.source),
                what,
                fmt_opt(e.tau, 3),
                fmt_opt(e.tau_pooled, 3),
                e.cycles.map_or(DASH.into(), |c| c.to_string()),
            ]
        })
        .collect();
    Table { header: header.map(String::from).to_vec(), rows, text_cols: 4 }
}

pub(super) fn acc_tables(runs: &[Run], cmp: &Comparison) -> (Table, Table) {
    let positions = cmp.at.iter().flatten().map(|a| a.acc.len()).max().unwrap_or(0);
    let pos_header =
        |first: &str| std::iter::once(first.to_string()).chain((1..=positions).map(|k| format!("pos {k}"))).collect();
    let groups = Table {
        header: pos_header("group"),
        rows: cmp
            .groups
            .iter()
            .map(|g| {
                let n = g.members.len();
                std::iter::once(g.name.clone())
                    .chain((0..positions).map(|k| fmt_stat(g.acc.get(k).copied().flatten(), 3, n)))
                    .collect()
            })
            .collect(),
        text_cols: 1,
    };
    let per_run = Table {
        header: pos_header("run"),
        rows: runs
            .iter()
            .zip(&cmp.at)
            .filter_map(|(r, a)| a.as_ref().map(|a| (r, a)))
            .map(|(r, a)| {
                std::iter::once(r.label.clone())
                    .chain((0..positions).map(|k| fmt_opt(a.acc.get(k).copied(), 3)))
                    .collect()
            })
            .collect(),
        text_cols: 1,
    };
    (groups, per_run)
}
