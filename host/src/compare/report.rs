//! The comparison as tables: one model, rendered as Markdown and for the terminal.

use super::*;

pub(super) struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
    /// Leading columns that are text (left-aligned); the rest are numbers.
    text_cols: usize,
}

impl Table {
    fn markdown(&self) -> String {
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

    fn terminal(&self) -> String {
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

pub(super) const DASH: &str = "—";

pub(super) fn fmt_opt(x: Option<f64>, prec: usize) -> String {
    match x {
        Some(x) if x.is_finite() => format!("{x:.prec$}"),
        Some(x) => format!("{x}"),
        None => DASH.into(),
    }
}

/// `mean ± std`; `mean` alone for one run; `(n=k)` when fewer runs than the group counts.
pub(super) fn fmt_stat(s: Option<Stat>, prec: usize, group_n: usize) -> String {
    let Some(s) = s else { return DASH.into() };
    let mut out = match s.std {
        Some(sd) => format!("{:.prec$} ± {sd:.prec$}", s.mean),
        None => format!("{:.prec$}", s.mean),
    };
    if s.n < group_n {
        let _ = write!(out, " (n={})", s.n);
    }
    out
}

/// 1234567 -> "1,234,567".
pub(super) fn fmt_count(x: f64) -> String {
    let digits = format!("{:.0}", x.max(0.0));
    let mut out = String::new();
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// Axis labels: 950, 12k, 3.5M.
pub(super) fn fmt_tokens_short(x: f64) -> String {
    let a = x.abs();
    if a >= 1e9 {
        format!("{}G", trim_num(x / 1e9))
    } else if a >= 1e6 {
        format!("{}M", trim_num(x / 1e6))
    } else if a >= 1e3 {
        format!("{}k", trim_num(x / 1e3))
    } else {
        trim_num(x)
    }
}

pub(super) fn trim_num(x: f64) -> String {
    trim_decimals(x, 2)
}

/// `x` with at most `decimals` decimals, trailing zeros dropped.
pub(super) fn trim_decimals(x: f64, decimals: usize) -> String {
    let s = format!("{x:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// Decimals that tell ticks apart on an axis spanning `span` (about ten ticks).
pub(super) fn tick_decimals(span: f64) -> usize {
    if span > 0.0 && span.is_finite() {
        (1.0 - (span / 10.0).log10().floor()).clamp(0.0, 8.0) as usize
    } else {
        2
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

pub(super) fn comparison_sentence(runs: &[Run], cmp: &Comparison) -> String {
    let Some(t) = cmp.tokens else { return "No run has metrics: nothing to compare.".into() };
    let n_complete = runs.iter().filter(|r| r.status == Status::Complete && r.has_data()).count();
    let basis = if cmp.from_complete {
        format!("the smallest final token count among the {n_complete} complete run(s)")
    } else {
        "the smallest token count among the runs with metrics: NO run has finished, so these numbers are provisional"
            .into()
    };
    format!(
        "Compared at **T = {} target tokens** ({basis}). Each run's metrics at T are linearly interpolated between the \
         two logged records around T (exact where a record sits at T).",
        fmt_count(t)
    )
}

pub(super) fn problems(runs: &[Run]) -> Vec<(String, String)> {
    runs.iter()
        .filter(|r| !r.notes.is_empty())
        .map(|r| (r.dir.display().to_string(), format!("{}: {}", r.status.as_str(), r.notes.join("; "))))
        .collect()
}

/// The terminal version: sweeps, comparison point, group and run tables, problems.
pub fn render_terminal(runs: &[Run], cmp: &Comparison, sweeps: &Sweeps) -> String {
    let mut s = String::new();
    for (dir, sel, arm) in sweeps.arms() {
        s += &(sweep_sentence(sel, arm).replace("**", "") + "\n");
        s += &sweep_table(sweeps, dir, sel, arm).terminal();
        s.push('\n');
    }
    let finals = final_table(runs);
    if !finals.rows.is_empty() {
        s += "final values (each run at its own end)\n";
        s += &finals.terminal();
        s.push('\n');
    }
    let evals = eval_table(runs);
    if !evals.rows.is_empty() {
        s += "evaluations (eval*.json)\n";
        s += &evals.terminal();
        s.push('\n');
    }
    s += "equal-token comparison: ";
    s += &(comparison_sentence(runs, cmp).replace("**", "") + "\n\n");
    if !cmp.groups.is_empty() {
        s += if cmp.from_complete {
            "groups (mean ± std over complete runs)\n"
        } else {
            "groups (mean ± std over all runs: none has finished)\n"
        };
        s += &group_table(cmp).terminal();
        s.push('\n');
        if has_held_out(cmp) {
            s += "held-out data (validation split at each run's end; test prompts)\n";
            s += &held_out_table(cmp).terminal();
            s.push('\n');
        }
        if let Some(w) = cmp.wall {
            let _ = writeln!(s, "equal wall time: W = {w:.1} training seconds");
            s += &wall_table(cmp).terminal();
            s.push('\n');
        }
    }
    s += "runs\n";
    s += &run_table(runs, cmp).terminal();
    let probs = problems(runs);
    if !probs.is_empty() {
        s += "\nproblems\n";
        for (dir, msg) in probs {
            let _ = writeln!(s, "  {dir}: {msg}");
        }
    }
    s
}

/// `report.md`. `plots`: (file stem, title) of the figures written beside it; `plot_errors`
/// lines for figures that failed.
pub fn render_markdown(
    runs: &[Run],
    cmp: &Comparison,
    sweeps: &Sweeps,
    plots: &[(String, String)],
    plot_errors: &[String],
) -> String {
    let mut s = String::from("# dflash experiment comparison\n\n");
    let _ = writeln!(s, "Generated {} UTC from {} folder(s):\n", utc_timestamp(unix_now(), true), runs.len());
    for r in runs {
        let _ = writeln!(s, "- `{}` ({}): {}", r.label, r.status.as_str(), r.dir.display());
    }
    let finals = final_table(runs);
    if !finals.rows.is_empty() {
        s += "\n## Final values\n\nEach run at its own last logged step, whatever the other runs reached.\n\n";
        s += &finals.markdown();
    }
    let evals = eval_table(runs);
    if !evals.rows.is_empty() {
        s += "\n## Evaluations\n\nEvery `eval*.json`: tau per response (z-lab's benchmark) and pooled over all verify \
              cycles (as serving engines report it).\n\n";
        s += &evals.markdown();
    }
    if sweeps.arms().next().is_some() || !sweeps.notes.is_empty() {
        s +=
            "\n## Sweeps\n\nEach swept arm's values, run with the first seed and scored on the validation split only. \
              The other columns are shown for reading, not for choosing.\n";
        for (dir, sel, arm) in sweeps.arms() {
            let _ = write!(s, "\n### {}\n\n{}\n\n", arm.arm, sweep_sentence(sel, arm));
            s += &sweep_table(sweeps, dir, sel, arm).markdown();
            let stem = sweep_plot_stem(&arm.arm);
            if plots.iter().any(|(p, _)| *p == stem) {
                let _ = write!(s, "\n![{} sweep]({stem}.png)\n\n[SVG]({stem}.svg)\n", arm.arm);
            }
        }
        for n in &sweeps.notes {
            let _ = writeln!(s, "\n- {n}");
        }
    }
    let _ = writeln!(s, "\n## Equal-token comparison\n\n{}\n", comparison_sentence(runs, cmp));
    if !cmp.groups.is_empty() {
        let over = if cmp.from_complete { "complete runs" } else { "runs (none has finished)" };
        let _ = write!(
            s,
            "## Groups\n\nMean ± sample standard deviation (n−1) over each group's {over} at T; a value alone is one \
             run; `(n=k)` marks a column only k of the group's runs have.\n\n"
        );
        s += &group_table(cmp).markdown();
        s.push('\n');
        if has_held_out(cmp) {
            s += "## Held-out data\n\nThe validation split at each run's end (`train.eval_every`: loss and tau_hat on its \
                  fixed anchors; `eval --prompts validation`: real tau on its prompts) and real tau on the test prompts \
                  (`eval.json`), mean ± std over the group's runs.\n\n";
            s += &held_out_table(cmp).markdown();
            s.push('\n');
        }
        if let Some(w) = cmp.wall {
            let _ = write!(
                s,
                "## Equal wall time\n\nEvery run read after **W = {w:.1} training seconds** (`elapsed_s`, validation time left \
                 out; the smallest final time among the runs T comes from), linearly interpolated.\n\n"
            );
            s += &wall_table(cmp).markdown();
            s.push('\n');
        }
    }
    s += "## Runs\n\n";
    s += &run_table(runs, cmp).markdown();
    s += "\n";
    let (acc_groups, acc_runs) = acc_tables(runs, cmp);
    if !acc_runs.rows.is_empty() {
        s += "## Per-position accuracy at T\n\nTop-1 accuracy of block positions 1..B-1 (the logging window around \
              T, interpolated).\n\n";
        s += &acc_groups.markdown();
        s += "\n";
        s += &acc_runs.markdown();
        s += "\n";
    }
    if !plots.is_empty() || !plot_errors.is_empty() {
        s += "## Plots\n\n";
        // Sweep plots are shown with their sweeps.
        for (stem, title) in
            plots.iter().filter(|(stem, _)| !sweeps.arms().any(|(_, _, a)| *stem == sweep_plot_stem(&a.arm)))
        {
            let _ = writeln!(s, "### {title}\n\n![{title}]({stem}.png)\n\n[SVG]({stem}.svg)\n");
        }
        for e in plot_errors {
            let _ = writeln!(s, "- plot failed: {e}");
        }
        s.push('\n');
    }
    let probs = problems(runs);
    if !probs.is_empty() {
        s += "## Problems\n\n";
        for (dir, msg) in probs {
            let _ = writeln!(s, "- `{dir}`: {msg}");
        }
        s.push('\n');
    }
    s += "## Columns\n\n\
- **loss @T**, **tau_hat @T**, **acc@1 @T**: the logged window values (`metrics.jsonl`) interpolated to T. \
tau_hat is the expected acceptance length implied by the per-position accuracies.\n\
- **best loss**, **best tau_hat**: lowest loss / highest tau_hat among the records up to T and the value at T.\n\
- **wall @T**: training seconds (`elapsed_s`) to reach T; **tok/s**: T / wall @T.\n\
- **final tokens**, **wall total**: the run's own end (`summary.json`'s `wall_s`, every process of a resumed run counted, else the last `elapsed_s`).\n\
- **tau (eval)**, **test tau (eval)**: measured acceptance length on the test prompts, from the run's `eval.json` \
(`tau`), — when none; **val tau (eval)**: the same on the validation prompts (`eval-validation.json`).\n\
- **val loss**, **val tau_hat**: the validation split's scores at the run's last evaluation (`train.eval_every`).\n\
- **@W**: after W training seconds, interpolated between the records around W.\n\
- Group statistics cover complete runs only; an unfinished run that reached T is listed with its values at T.\n";
    s
}
