//! Numbers as the tables and plots show them: a dash for none, `mean ± std`, thousands
//! separated, tokens short (12k, 3.5M), decimals trimmed.

use super::stats::Stat;
use std::fmt::Write as _;

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
