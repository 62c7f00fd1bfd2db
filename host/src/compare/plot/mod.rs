//! The comparison as plots (plotters; PNG and SVG; a bundled font, so no system fonts needed).
//!
//! Files: `draw.rs` the figure kit (fonts, colours, the log axis, PNG and SVG written), `curves.rs`
//! metrics against tokens and the accuracy per position, `sweep.rs` a swept arm's scores; this
//! file chooses the figures a comparison gets.

mod curves;
mod draw;
mod sweep;

use super::{
    format::fmt_tokens_short,
    runs::{Record, Run},
    stats::Comparison,
    sweep::{sweep_plot_stem, Sweeps},
};
use crate::outputs::OutDir;
use anyhow::Result;
use curves::{AccFigure, CurveFigure};
use draw::save;
#[cfg(test)]
pub(super) use draw::SIZE;
use plotters::prelude::SeriesLabelPosition;
use sweep::SweepFigure;

/// Write the figures; returns (stem, title) of those written and the errors of the rest.
pub fn write_plots(
    runs: &[Run],
    cmp: &Comparison,
    sweeps: &Sweeps,
    out: &OutDir,
) -> (Vec<(String, String)>, Vec<String>) {
    let (mut done, mut errors) = (Vec::new(), Vec::new());
    let mut attempt = |stem: &str, title: &str, result: Result<()>| match result {
        Ok(()) => done.push((stem.to_string(), title.to_string())),
        Err(e) => errors.push(format!("{stem}: {e:#}")),
    };
    // Each swept arm: its validation score against the swept value (one numeric field).
    for (_, sel, arm) in sweeps.arms() {
        if let Some(fig) = SweepFigure::new(sel, arm) {
            let stem = sweep_plot_stem(&arm.arm);
            attempt(&stem, &format!("{} sweep", arm.arm), save(&fig, out, &stem));
        }
    }
    if cmp.tokens.is_none() {
        return (done, errors);
    }
    let loss = CurveFigure::new("Loss vs target tokens", "loss (log scale)", true, runs, cmp, |r| r.loss);
    attempt("loss_vs_tokens", "Loss vs tokens", save(&loss, out, "loss_vs_tokens"));
    let mut tau =
        CurveFigure::new("tau_hat (expected acceptance length) vs target tokens", "tau_hat", false, runs, cmp, |r| {
            r.tau_hat
        });
    tau.legend = SeriesLabelPosition::LowerRight;
    attempt("tau_hat_vs_tokens", "tau_hat vs tokens", save(&tau, out, "tau_hat_vs_tokens"));
    let t = cmp.tokens.unwrap_or(0.0);
    let acc = AccFigure {
        title: format!("Per-position accuracy at T = {} tokens", fmt_tokens_short(t)),
        groups: cmp
            .groups
            .iter()
            .filter(|g| !g.members.is_empty())
            .map(|g| {
                let pts = g
                    .acc
                    .iter()
                    .enumerate()
                    .filter_map(|(k, s)| s.map(|s| ((k + 1) as f64, s.mean, s.std.unwrap_or(0.0))))
                    .collect();
                (format!("{} (n={})", g.name, g.members.len()), pts)
            })
            .collect(),
    };
    attempt("acc_at_tokens", "Per-position accuracy at T", save(&acc, out, "acc_at_tokens"));
    if runs.iter().any(|r| r.records.iter().any(|x| x.lr.is_finite())) {
        let lr = CurveFigure::new("Learning rate vs target tokens", "lr", false, runs, cmp, |r| r.lr);
        attempt("lr_vs_tokens", "Learning rate vs tokens", save(&lr, out, "lr_vs_tokens"));
    }
    if runs.iter().any(|r| r.records.iter().any(|x| x.grad_norm.is_finite() && x.grad_norm > 0.0)) {
        let gn = CurveFigure::new(
            "Gradient norm (before clipping) vs target tokens",
            "gradient norm (log scale)",
            true,
            runs,
            cmp,
            |r| r.grad_norm,
        );
        attempt("grad_norm_vs_tokens", "Gradient norm vs tokens", save(&gn, out, "grad_norm_vs_tokens"));
    }
    // The validation split's scores, at the tokens each evaluation had trained on.
    let vals: Vec<Run> = runs.iter().map(val_points).collect();
    if vals.iter().any(|r| !r.records.is_empty()) {
        let loss = CurveFigure::new(
            "Validation loss vs target tokens",
            "validation loss (log scale)",
            true,
            &vals,
            cmp,
            |r| r.loss,
        );
        attempt("val_loss_vs_tokens", "Validation loss vs tokens", save(&loss, out, "val_loss_vs_tokens"));
        let mut tau =
            CurveFigure::new("Validation tau_hat vs target tokens", "validation tau_hat", false, &vals, cmp, |r| {
                r.tau_hat
            });
        tau.legend = SeriesLabelPosition::LowerRight;
        attempt("val_tau_hat_vs_tokens", "Validation tau_hat vs tokens", save(&tau, out, "val_tau_hat_vs_tokens"));
    }
    // Measured tau of the evaluated checkpoints, at the tokens each had trained on.
    let evals: Vec<Run> = runs.iter().map(eval_points).collect();
    if evals.iter().any(|r| !r.records.is_empty()) {
        let mut fig = CurveFigure::new(
            "Measured tau (eval, held-out prompts) vs target tokens",
            "tau",
            false,
            &evals,
            cmp,
            |r| r.tau_hat,
        );
        fig.legend = SeriesLabelPosition::LowerRight;
        attempt("eval_tau_vs_tokens", "Eval tau vs tokens", save(&fig, out, "eval_tau_vs_tokens"));
    }
    (done, errors)
}

/// A run whose records are its held-out evals of checkpoints (tau in `tau_hat`), at the tokens
/// of the checkpoint's step.
fn eval_points(run: &Run) -> Run {
    let mut points: Vec<Record> = run
        .evals
        .iter()
        .filter(|e| e.source == "holdout")
        .filter_map(|e| {
            let step = e.checkpoint_step?;
            let at = run.records.iter().find(|r| r.step == step)?;
            Some(Record { tau_hat: e.tau?, ..at.clone() })
        })
        .collect();
    points.sort_by(|a, b| a.tokens.total_cmp(&b.tokens));
    points.dedup_by(|a, b| a.tokens == b.tokens);
    Run { records: points, ..run.clone() }
}

/// A run whose records are its validation scores (loss, tau-hat, accuracy), at their tokens.
fn val_points(run: &Run) -> Run {
    let records = run
        .val
        .iter()
        .map(|v| Record {
            step: v.step,
            tokens: v.tokens,
            loss: v.loss,
            acc: v.acc.clone(),
            tau_hat: v.tau_hat,
            elapsed_s: f64::NAN,
            lr: f64::NAN,
            grad_norm: f64::NAN,
        })
        .collect();
    Run { records, ..run.clone() }
}
