//! The comparison as tables: one model, rendered as Markdown and for the terminal.
//!
//! `tables.rs` builds each table; this file puts them in order, with the sentences around them.

mod tables;

use super::{
    format::fmt_count,
    runs::{Run, Status},
    stats::Comparison,
    sweep::{sweep_plot_stem, Sweeps},
};
use std::fmt::Write as _;
use tables::{
    acc_tables, eval_table, final_table, group_table, has_held_out, held_out_table, run_table, sweep_sentence,
    sweep_table, wall_table,
};

fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// UTC `YYYYMMDD-HHMMSS` (folder names) or `YYYY-MM-DD HH:MM:SS` (text), from Unix seconds.
pub(super) fn utc_timestamp(secs: f64, readable: bool) -> String {
    let secs = secs as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (proleptic Gregorian; eras of 400 years).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let (hh, mm, ss) = (rem / 3600, rem % 3600 / 60, rem % 60);
    if readable {
        format!("{y:04}-{m:02}-{d:02} {hh:02}:{mm:02}:{ss:02}")
    } else {
        format!("{y:04}{m:02}{d:02}-{hh:02}{mm:02}{ss:02}")
    }
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
    markdown_sweeps(&mut s, sweeps, plots);
    let _ = writeln!(s, "\n## Equal-token comparison\n\n{}\n", comparison_sentence(runs, cmp));
    markdown_groups(&mut s, cmp);
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
    s += COLUMNS;
    s
}

/// The sweeps section: each swept arm's values, its table and its figure.
fn markdown_sweeps(s: &mut String, sweeps: &Sweeps, plots: &[(String, String)]) {
    if sweeps.arms().next().is_some() || !sweeps.notes.is_empty() {
        *s +=
            "\n## Sweeps\n\nEach swept arm's values, run with the first seed and scored on the validation split only. \
              The other columns are shown for reading, not for choosing.\n";
        for (dir, sel, arm) in sweeps.arms() {
            let _ = write!(s, "\n### {}\n\n{}\n\n", arm.arm, sweep_sentence(sel, arm));
            *s += &sweep_table(sweeps, dir, sel, arm).markdown();
            let stem = sweep_plot_stem(&arm.arm);
            if plots.iter().any(|(p, _)| *p == stem) {
                let _ = write!(s, "\n![{} sweep]({stem}.png)\n\n[SVG]({stem}.svg)\n", arm.arm);
            }
        }
        for n in &sweeps.notes {
            let _ = writeln!(s, "\n- {n}");
        }
    }
}

/// The groups at T, on held-out data, and at W.
fn markdown_groups(s: &mut String, cmp: &Comparison) {
    if !cmp.groups.is_empty() {
        let over = if cmp.from_complete { "complete runs" } else { "runs (none has finished)" };
        let _ = write!(
            s,
            "## Groups\n\nMean ± sample standard deviation (n−1) over each group's {over} at T; a value alone is one \
             run; `(n=k)` marks a column only k of the group's runs have.\n\n"
        );
        *s += &group_table(cmp).markdown();
        s.push('\n');
        if has_held_out(cmp) {
            *s += "## Held-out data\n\nThe validation split at each run's end (`train.eval_every`: loss and tau_hat on its \
                  fixed anchors; `eval --prompts validation`: real tau on its prompts) and real tau on the test prompts \
                  (`eval.json`), mean ± std over the group's runs.\n\n";
            *s += &held_out_table(cmp).markdown();
            s.push('\n');
        }
        if let Some(w) = cmp.wall {
            let _ = write!(
                s,
                "## Equal wall time\n\nEvery run read after **W = {w:.1} training seconds** (`elapsed_s`, validation time left \
                 out; the smallest final time among the runs T comes from), linearly interpolated.\n\n"
            );
            *s += &wall_table(cmp).markdown();
            s.push('\n');
        }
    }
}

/// What each column means.
const COLUMNS: &str = "## Columns\n\n\
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
