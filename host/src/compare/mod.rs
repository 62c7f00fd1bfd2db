//! `dflash-host compare DIR...`: compare experiment directories at equal target tokens.
//!
//! Reads each run's `config.toml`, `manifest.json`, `metrics.jsonl`, `summary.json` (present =
//! finished) and optional `eval.json` (`tau`: measured acceptance length on the test prompts) and
//! `eval-validation.json`, groups runs (manifest `arm`, else config `name`, or `--group-by KEY`),
//! and writes `report.md` plus PNG and SVG plots into the output folder, and prints the tables.
//! Every run is read at one token count T, the smallest final token count among finished runs,
//! interpolating linearly between logged records, and at one training time W likewise. An A/B
//! folder's `selection.json` shows each swept arm's values as its sweep, and only its runs at the
//! chosen value are compared. Broken or unfinished runs are reported, never fatal.
//!
//! Files: `runs.rs` reads the folders, `sweep.rs` the sweeps, `stats.rs` compares them at equal
//! tokens and time, `report/` writes the tables, `plot/` the plots, `format.rs` the numbers both
//! show; this file runs the command.

use anyhow::Result;
use std::path::{Path, PathBuf};

mod format;
mod plot;
mod report;
mod runs;
mod stats;
mod sweep;

use plot::*;
use report::*;
pub use runs::*;
pub use stats::*;
pub use sweep::*;

// ---------------------------------------------------------------------------------------------
// Entry point

/// Default output, one folder reused by every comparison of the same runs: an A/B folder's
/// `report/` when one A/B folder is given, else `compare/` beside the first run.
pub fn default_out(dirs: &[PathBuf]) -> PathBuf {
    if let [one] = dirs {
        if !one.join("config.toml").exists() && one.is_dir() {
            return one.join("report");
        }
    }
    let parent = dirs
        .first()
        .and_then(|d| d.parent())
        .filter(|p| !p.as_os_str().is_empty())
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf);
    parent.join("compare")
}

/// `dflash-host compare`: load, compare, write `report.md` + plots into `out`, print the tables.
/// Returns the report's path.
pub fn run(dirs: &[PathBuf], out: Option<&Path>, group_by: Option<&str>) -> Result<PathBuf> {
    let out = out.map_or_else(|| default_out(dirs), Path::to_path_buf);
    // Outputs are checked, and the folder opened, before any work.
    let out_dir = crate::outputs::OutDir::create("--out", &out, Vec::new())?;
    let dirs = &expand_dirs(dirs);
    let all = load_runs(dirs, group_by);
    // A swept arm's values other than the chosen one are its sweep, not its comparison.
    let (selections, notes) = read_selections(&all);
    let runs: Vec<Run> = all.iter().filter(|r| !is_unchosen(r, &selections)).cloned().collect();
    let sweeps = Sweeps { selections, runs: all, notes };
    let cmp = compare(&runs);
    let (plots, plot_errors) = write_plots(&runs, &cmp, &sweeps, &out_dir);
    let report = out_dir.write("report.md", render_markdown(&runs, &cmp, &sweeps, &plots, &plot_errors).as_bytes())?;
    crate::say!("{}", render_terminal(&runs, &cmp, &sweeps).trim_end_matches('\n'));
    for e in &plot_errors {
        crate::say!("plot failed: {e}");
    }
    Ok(report)
}

#[cfg(test)]
mod tests;
