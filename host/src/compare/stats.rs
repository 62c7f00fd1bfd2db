//! The equal-token comparison: every run read at one token count T (linear interpolation
//! between logged records), then each group's mean and spread.

use super::runs::{Record, Run, Status};

/// One run's metrics at T.
#[derive(Debug, Clone, PartialEq)]
pub struct AtTokens {
    pub loss: f64,
    /// Lowest loss over the records up to T (and the value at T).
    pub best_loss: f64,
    pub tau_hat: f64,
    pub best_tau_hat: f64,
    pub acc: Vec<f64>,
    pub elapsed_s: f64,
    /// T / elapsed seconds at T: mean training throughput up to T.
    pub tok_per_s: f64,
}

pub(super) fn lerp(a: f64, b: f64, w: f64) -> f64 {
    a + (b - a) * w
}

/// The run's metrics at `t` tokens, linearly interpolated between the two records around it;
/// None when the run's records do not span `t`.
pub fn at_tokens(records: &[Record], t: f64) -> Option<AtTokens> {
    let (a, b, w) = around(&records.iter().collect::<Vec<_>>(), t, |r| r.tokens)?;
    let n = a.acc.len().max(b.acc.len());
    let acc = (0..n)
        .map(|k| match (a.acc.get(k), b.acc.get(k)) {
            (Some(&x), Some(&y)) => lerp(x, y, w),
            (Some(&x), None) | (None, Some(&x)) => x,
            (None, None) => f64::NAN,
        })
        .collect();
    let loss = lerp(a.loss, b.loss, w);
    let tau_hat = lerp(a.tau_hat, b.tau_hat, w);
    let elapsed_s = lerp(a.elapsed_s, b.elapsed_s, w);
    let upto = records.iter().filter(|r| r.tokens <= t);
    let best_loss = upto.clone().map(|r| r.loss).fold(loss, f64::min);
    let best_tau_hat = upto.map(|r| r.tau_hat).fold(tau_hat, f64::max);
    Some(AtTokens { loss, best_loss, tau_hat, best_tau_hat, acc, elapsed_s, tok_per_s: t / elapsed_s })
}

/// One run's training metrics after `w` training seconds (`elapsed_s`, validation time left
/// out), linearly interpolated; None when its records do not span `w`.
#[derive(Debug, Clone, PartialEq)]
pub struct AtWall {
    pub loss: f64,
    pub tau_hat: f64,
    pub tokens: f64,
}

pub fn at_wall(records: &[Record], w: f64) -> Option<AtWall> {
    let timed: Vec<&Record> = records.iter().filter(|r| r.elapsed_s.is_finite()).collect();
    let (a, b, x) = around(&timed, w, |r| r.elapsed_s)?;
    Some(AtWall {
        loss: lerp(a.loss, b.loss, x),
        tau_hat: lerp(a.tau_hat, b.tau_hat, x),
        tokens: lerp(a.tokens, b.tokens, x),
    })
}

/// The two records around `x` on the axis `key` (ascending in `records`; one record twice when
/// it sits at `x` or is the first) and `x`'s weight between them; None outside the records.
fn around<'r>(records: &[&'r Record], x: f64, key: fn(&Record) -> f64) -> Option<(&'r Record, &'r Record, f64)> {
    let (first, last) = (records.first()?, records.last()?);
    if x < key(first) || x > key(last) {
        return None;
    }
    let i = records.partition_point(|r| key(r) < x);
    let (a, b) = if key(records[i]) == x || i == 0 { (records[i], records[i]) } else { (records[i - 1], records[i]) };
    let w = if key(b) > key(a) { (x - key(a)) / (key(b) - key(a)) } else { 0.0 };
    Some((a, b, w))
}

/// Mean and sample standard deviation (n-1; None for one value).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stat {
    pub mean: f64,
    pub std: Option<f64>,
    pub n: usize,
}

pub fn stat(xs: impl IntoIterator<Item = f64>) -> Option<Stat> {
    let xs: Vec<f64> = xs.into_iter().collect();
    let n = xs.len();
    if n == 0 {
        return None;
    }
    let mean = xs.iter().sum::<f64>() / n as f64;
    let std = (n > 1).then(|| (xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt());
    Some(Stat { mean, std, n })
}

#[derive(Debug, Clone)]
pub struct GroupStats {
    pub name: String,
    /// Indices (into the runs) of the runs the statistics cover.
    pub members: Vec<usize>,
    /// Runs of the group with metrics, counted or not.
    pub listed: usize,
    pub loss: Option<Stat>,
    pub best_loss: Option<Stat>,
    pub tau_hat: Option<Stat>,
    pub best_tau_hat: Option<Stat>,
    pub acc: Vec<Option<Stat>>,
    pub elapsed_s: Option<Stat>,
    pub tok_per_s: Option<Stat>,
    pub final_tokens: Option<Stat>,
    pub wall_s: Option<Stat>,
    /// Real tau on the test prompts (`eval.json`).
    pub eval_tau: Option<Stat>,
    /// The validation split at each run's end: loss, tau-hat, and real tau on its prompts.
    pub val_loss: Option<Stat>,
    pub val_tau_hat: Option<Stat>,
    pub val_eval_tau: Option<Stat>,
    /// At W training seconds (over the counted runs that reach it).
    pub loss_at_wall: Option<Stat>,
    pub tau_hat_at_wall: Option<Stat>,
    pub tokens_at_wall: Option<Stat>,
}

#[derive(Debug, Clone)]
pub struct Comparison {
    /// T: the common token count; None when no run has metrics.
    pub tokens: Option<f64>,
    /// True when T comes from finished runs; false when none has finished (provisional).
    pub from_complete: bool,
    /// Per run (same order as the runs): metrics at T, when the run reaches T.
    pub at: Vec<Option<AtTokens>>,
    /// Whether a run counts in its group's statistics.
    pub counted: Vec<bool>,
    /// W: the smallest final training time (`elapsed_s`) among the runs T comes from, and each
    /// run's metrics there.
    pub wall: Option<f64>,
    pub at_wall: Vec<Option<AtWall>>,
    pub groups: Vec<GroupStats>,
}

/// T = smallest final token count among complete runs (or among all runs with metrics when none
/// is complete); each run read at T; group statistics over the counted runs.
pub fn compare(runs: &[Run]) -> Comparison {
    let complete: Vec<f64> =
        runs.iter().filter(|r| r.status == Status::Complete).filter_map(Run::final_tokens).collect();
    let from_complete = !complete.is_empty();
    let pool: Vec<f64> = if from_complete { complete } else { runs.iter().filter_map(Run::final_tokens).collect() };
    let tokens = pool.into_iter().reduce(f64::min);
    let at: Vec<Option<AtTokens>> = runs.iter().map(|r| tokens.and_then(|t| at_tokens(&r.records, t))).collect();
    let counted: Vec<bool> = runs
        .iter()
        .zip(&at)
        .map(|(r, a)| a.is_some() && (r.status == Status::Complete || (!from_complete && r.has_data())))
        .collect();
    let in_pool = |r: &Run| if from_complete { r.status == Status::Complete } else { r.has_data() };
    let wall = runs
        .iter()
        .filter(|r| in_pool(r))
        .filter_map(|r| r.records.last().map(|x| x.elapsed_s))
        .filter(|w| w.is_finite())
        .reduce(f64::min);
    let at_wall_: Vec<Option<AtWall>> = runs.iter().map(|r| wall.and_then(|w| at_wall(&r.records, w))).collect();

    let mut names: Vec<&str> = Vec::new();
    for r in runs.iter().filter(|r| r.has_data()) {
        if !names.contains(&r.group.as_str()) {
            names.push(&r.group);
        }
    }
    let groups = names
        .into_iter()
        .map(|name| {
            let members: Vec<usize> = (0..runs.len()).filter(|&i| counted[i] && runs[i].group == name).collect();
            let listed = runs.iter().filter(|r| r.has_data() && r.group == name).count();
            let of = |f: &dyn Fn(&AtTokens) -> f64| {
                stat(members.iter().map(|&i| f(at[i].as_ref().expect("counted runs reach T"))))
            };
            let positions = members.iter().map(|&i| at[i].as_ref().map_or(0, |a| a.acc.len())).max().unwrap_or(0);
            let acc = (0..positions)
                .map(|k| stat(members.iter().filter_map(|&i| at[i].as_ref().and_then(|a| a.acc.get(k).copied()))))
                .collect();
            GroupStats {
                name: name.to_string(),
                listed,
                loss: of(&|a| a.loss),
                best_loss: of(&|a| a.best_loss),
                tau_hat: of(&|a| a.tau_hat),
                best_tau_hat: of(&|a| a.best_tau_hat),
                acc,
                elapsed_s: of(&|a| a.elapsed_s),
                tok_per_s: of(&|a| a.tok_per_s),
                final_tokens: stat(members.iter().filter_map(|&i| runs[i].final_tokens())),
                wall_s: stat(members.iter().filter_map(|&i| runs[i].wall_s())),
                eval_tau: stat(members.iter().filter_map(|&i| runs[i].eval_tau)),
                val_loss: stat(
                    members.iter().filter_map(|&i| runs[i].last_val().map(|v| v.loss)).filter(|x| x.is_finite()),
                ),
                val_tau_hat: stat(
                    members.iter().filter_map(|&i| runs[i].last_val().map(|v| v.tau_hat)).filter(|x| x.is_finite()),
                ),
                val_eval_tau: stat(members.iter().filter_map(|&i| runs[i].val_eval_tau)),
                loss_at_wall: stat(members.iter().filter_map(|&i| at_wall_[i].as_ref().map(|a| a.loss))),
                tau_hat_at_wall: stat(members.iter().filter_map(|&i| at_wall_[i].as_ref().map(|a| a.tau_hat))),
                tokens_at_wall: stat(members.iter().filter_map(|&i| at_wall_[i].as_ref().map(|a| a.tokens))),
                members,
            }
        })
        .collect();
    Comparison { tokens, from_complete, at, counted, wall, at_wall: at_wall_, groups }
}
