//! Metrics against target tokens (a thin line per run, a thick mean per group) and the accuracy
//! per block position at T.

use super::draw::{draw_legend, plot_err, Figure, LogAxis, COLORS, FONT};
use crate::compare::{
    format::{fmt_tokens_short, tick_decimals, trim_decimals},
    runs::{Record, Run, Status, MAX_ABS},
    stats::{lerp, Comparison},
};
use anyhow::Result;
use plotters::{
    coord::{
        ranged1d::{AsRangedCoord, Ranged, ValueFormatter},
        Shift,
    },
    prelude::*,
};

/// Points drawn per run line at most (SVG size stays small on long runs).
const MAX_POINTS: usize = 2000;

pub(super) struct Line {
    group: usize,
    points: Vec<(f64, f64)>,
    /// Unfinished runs are dashed.
    finished: bool,
}

/// (x, y) points of one line.
type Points = Vec<(f64, f64)>;
/// (block position, mean, std) of one group.
type Whiskers = Vec<(f64, f64, f64)>;

/// Metric vs tokens: a thin line per run, a thick mean line per group, T marked.
pub(super) struct CurveFigure {
    title: String,
    y_desc: String,
    log_y: bool,
    runs: Vec<Line>,
    /// (group index, label, mean points).
    means: Vec<(usize, String, Points)>,
    tokens: Option<f64>,
    pub(super) legend: SeriesLabelPosition,
    group_names: Vec<String>,
}

impl CurveFigure {
    pub(super) fn new(
        title: &str,
        y_desc: &str,
        log_y: bool,
        runs: &[Run],
        cmp: &Comparison,
        metric: fn(&Record) -> f64,
    ) -> Self {
        let group_of = |r: &Run| cmp.groups.iter().position(|g| g.name == r.group);
        let lines = runs
            .iter()
            .filter_map(|r| {
                let group = group_of(r)?;
                let points =
                    decimate(r.records.iter().map(|x| (x.tokens, metric(x))).filter(|p| p.1.is_finite()).collect());
                Some(Line { group, points, finished: r.status == Status::Complete })
            })
            .collect();
        let means = cmp
            .groups
            .iter()
            .enumerate()
            .filter_map(|(gi, g)| {
                let members: Vec<&Run> = g.members.iter().map(|&i| &runs[i]).collect();
                let points = mean_curve(&members, metric);
                (!points.is_empty()).then(|| (gi, format!("{} (n={})", g.name, members.len()), points))
            })
            .collect();
        Self {
            title: title.into(),
            y_desc: y_desc.into(),
            log_y,
            runs: lines,
            means,
            tokens: cmp.tokens,
            legend: SeriesLabelPosition::UpperRight,
            group_names: cmp.groups.iter().map(|g| g.name.clone()).collect(),
        }
    }

    fn draw_on<DB: DrawingBackend, Y>(&self, root: &DrawingArea<DB, Shift>, y: Y, y_range: (f64, f64)) -> Result<()>
    where
        Y: AsRangedCoord<Value = f64>,
        Y::CoordDescType: Ranged<ValueType = f64> + ValueFormatter<f64>,
    {
        let x_max = self.runs.iter().flat_map(|l| l.points.iter().map(|p| p.0)).fold(0.0, f64::max).max(1.0);
        let mut chart = ChartBuilder::on(root)
            .caption(&self.title, (FONT, 24))
            .margin(18)
            .x_label_area_size(50)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..x_max * 1.02, y)
            .map_err(plot_err)?;
        let decimals = tick_decimals(y_range.1 - y_range.0);
        let y_fmt = |v: &f64| trim_decimals(*v, if self.log_y { decimals.max(1) + 1 } else { decimals });
        chart
            .configure_mesh()
            .x_desc("target tokens")
            .y_desc(self.y_desc.as_str())
            .x_label_formatter(&|x| fmt_tokens_short(*x))
            .y_label_formatter(&y_fmt)
            .label_style((FONT, 14))
            .axis_desc_style((FONT, 16))
            .light_line_style(RGBColor(240, 240, 240))
            .bold_line_style(RGBColor(215, 215, 215))
            .draw()
            .map_err(plot_err)?;
        let mut labelled: Vec<usize> = self.means.iter().map(|m| m.0).collect();
        for line in &self.runs {
            let color = COLORS[line.group % COLORS.len()];
            let style = color.mix(0.45).stroke_width(1);
            let drawn = if line.finished {
                chart.draw_series(LineSeries::new(line.points.iter().copied(), style)).map_err(plot_err)?
            } else {
                chart.draw_series(DashedLineSeries::new(line.points.iter().copied(), 6, 4, style)).map_err(plot_err)?
            };
            // A group with no mean line (no complete run) still gets a legend entry.
            if !labelled.contains(&line.group) {
                labelled.push(line.group);
                drawn
                    .label(format!("{} (no complete run)", self.group_names[line.group]))
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(1)));
            }
        }
        for (gi, label, points) in &self.means {
            let color = COLORS[gi % COLORS.len()];
            chart
                .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(3)))
                .map_err(plot_err)?
                .label(label.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(3)));
        }
        if let Some(t) = self.tokens {
            let grey = RGBColor(90, 90, 90);
            chart
                .draw_series(DashedLineSeries::new([(t, y_range.0), (t, y_range.1)], 5, 5, grey.stroke_width(1)))
                .map_err(plot_err)?
                .label(format!("T = {} tokens", fmt_tokens_short(t)))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], grey.stroke_width(1)));
        }
        draw_legend(&mut chart, self.legend.clone())?;
        Ok(())
    }
}

impl Figure for CurveFigure {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()> {
        root.fill(&WHITE).map_err(plot_err)?;
        let ys: Vec<f64> =
            self.runs.iter().flat_map(|l| l.points.iter().map(|p| p.1)).filter(|y| y.is_finite()).collect();
        let (lo, hi) = ys.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &y| (a.min(y), b.max(y)));
        // Values are capped on reading (MAX_ABS); an axis span that is still not finite (or a
        // range plotters' tick search cannot cover) gets the default axis, never a hang.
        if !lo.is_finite() || !hi.is_finite() || !(hi - lo).is_finite() || hi.abs().max(lo.abs()) > MAX_ABS {
            return self.draw_on(root, 0.0..1.0, (0.0, 1.0));
        }
        if self.log_y && lo > 0.0 {
            let (lo, hi) = (lo / 1.15, hi * 1.15);
            self.draw_on(root, LogAxis(lo..hi), (lo, hi))
        } else {
            let pad = ((hi - lo) * 0.08).max(1e-3);
            self.draw_on(root, (lo - pad)..(hi + pad), (lo - pad, hi + pad))
        }
    }
}

/// Accuracy per block position at T: a line per group (mean), whiskers ± std.
pub(super) struct AccFigure {
    pub(super) title: String,
    /// (label, [(position, mean, std)]).
    pub(super) groups: Vec<(String, Whiskers)>,
}

impl Figure for AccFigure {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()> {
        root.fill(&WHITE).map_err(plot_err)?;
        let positions = self.groups.iter().map(|g| g.1.len()).max().unwrap_or(1).max(1);
        let hi = self
            .groups
            .iter()
            .flat_map(|g| g.1.iter().map(|p| p.1 + p.2))
            .filter(|v| v.is_finite())
            .fold(0.0, f64::max);
        let y_max = (hi * 1.2).clamp(0.01, 1.0);
        let mut chart = ChartBuilder::on(root)
            .caption(&self.title, (FONT, 24))
            .margin(18)
            .x_label_area_size(50)
            .y_label_area_size(70)
            .build_cartesian_2d(0.5..positions as f64 + 0.5, 0.0..y_max)
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .x_desc("block position")
            .y_desc("top-1 accuracy")
            .x_labels(positions.min(32))
            .x_label_formatter(&|x| if (x - x.round()).abs() < 1e-6 { format!("{x:.0}") } else { String::new() })
            .y_label_formatter(&|y| trim_decimals(*y, tick_decimals(y_max)))
            .label_style((FONT, 14))
            .axis_desc_style((FONT, 16))
            .light_line_style(RGBColor(240, 240, 240))
            .bold_line_style(RGBColor(215, 215, 215))
            .draw()
            .map_err(plot_err)?;
        let n = self.groups.len() as f64;
        for (gi, (label, points)) in self.groups.iter().enumerate() {
            let color = COLORS[gi % COLORS.len()];
            // Offset groups a little so whiskers do not overlap.
            let dx = (gi as f64 - (n - 1.0) / 2.0) * 0.06;
            let pts: Vec<(f64, f64)> = points.iter().filter(|p| p.1.is_finite()).map(|p| (p.0 + dx, p.1)).collect();
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
                .map_err(plot_err)?
                .label(label.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(2)));
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled()))).map_err(plot_err)?;
            let whiskers = points.iter().filter(|p| p.1.is_finite() && p.2 > 0.0).flat_map(|&(x, m, sd)| {
                let x = x + dx;
                let (a, b) = ((m - sd).max(0.0), m + sd);
                [
                    PathElement::new(vec![(x, a), (x, b)], color.stroke_width(1)),
                    PathElement::new(vec![(x - 0.05, a), (x + 0.05, a)], color.stroke_width(1)),
                    PathElement::new(vec![(x - 0.05, b), (x + 0.05, b)], color.stroke_width(1)),
                ]
            });
            chart.draw_series(whiskers).map_err(plot_err)?;
        }
        draw_legend(&mut chart, SeriesLabelPosition::UpperRight)?;
        Ok(())
    }
}

/// Keep at most MAX_POINTS points, always the last.
pub(super) fn decimate(points: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    if points.len() <= MAX_POINTS {
        return points;
    }
    let stride = points.len().div_ceil(MAX_POINTS);
    let last = *points.last().expect("non-empty");
    let mut out: Vec<(f64, f64)> = points.into_iter().step_by(stride).collect();
    if out.last() != Some(&last) {
        out.push(last);
    }
    out
}

/// A group's mean curve over the token range all its runs cover (each run interpolated onto one
/// grid); one run: its own points.
pub(super) fn mean_curve(members: &[&Run], metric: fn(&Record) -> f64) -> Vec<(f64, f64)> {
    match members {
        [] => Vec::new(),
        [one] => decimate(one.records.iter().map(|r| (r.tokens, metric(r))).filter(|p| p.1.is_finite()).collect()),
        _ => {
            let lo = members.iter().filter_map(|r| r.records.first()).map(|r| r.tokens).fold(f64::MIN, f64::max);
            let hi = members.iter().filter_map(|r| r.records.last()).map(|r| r.tokens).fold(f64::MAX, f64::min);
            if hi < lo {
                return Vec::new();
            }
            // The mean of piecewise-linear curves is piecewise linear with corners at the members'
            // records: evaluating there is exact.
            let mut grid: Vec<f64> = members
                .iter()
                .flat_map(|r| r.records.iter().map(|x| x.tokens))
                .filter(|&t| t >= lo && t <= hi)
                .collect();
            grid.sort_by(f64::total_cmp);
            grid.dedup();
            let points = grid
                .into_iter()
                .filter_map(|t| {
                    let ys: Vec<f64> = members.iter().filter_map(|r| interp(&r.records, t, metric)).collect();
                    (ys.len() == members.len()).then(|| (t, ys.iter().sum::<f64>() / ys.len() as f64))
                })
                .filter(|p| p.1.is_finite())
                .collect();
            decimate(points)
        }
    }
}

pub(super) fn interp(records: &[Record], t: f64, metric: fn(&Record) -> f64) -> Option<f64> {
    let i = records.partition_point(|r| r.tokens < t);
    let b = records.get(i)?;
    if b.tokens == t || i == 0 {
        return (b.tokens == t).then(|| metric(b));
    }
    let a = &records[i - 1];
    Some(lerp(metric(a), metric(b), (t - a.tokens) / (b.tokens - a.tokens)))
}
