//! The comparison as plots (plotters; PNG and SVG; a bundled font, so no system fonts needed).

use super::*;
use crate::outputs::OutDir;
use plotters::{
    coord::{
        ranged1d::{AsRangedCoord, DefaultFormatting, KeyPointHint, Ranged, ValueFormatter},
        Shift,
    },
    prelude::*,
};
use std::{ops::Range, sync::Once};

/// Tableau 10: distinct, colour-blind-friendly-ish group colours.
pub(super) const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];
pub(super) const SIZE: (u32, u32) = (1000, 600);
pub(super) const FONT: &str = "sans-serif";
/// Points drawn per run line at most (SVG size stays small on long runs).
pub(super) const MAX_POINTS: usize = 2000;

/// Plotters' `ab_glyph` backend reads no system fonts: register the DejaVu Sans the `dejavu` crate
/// embeds, so text renders on any machine.
pub(super) fn register_fonts() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let ok = plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular()).is_ok()
            && plotters::style::register_font(FONT, FontStyle::Bold, dejavu::sans::bold()).is_ok();
        if !ok {
            tracing::warn!("could not register the embedded DejaVu font: plot text will fail");
        }
    });
}

pub(super) fn plot_err(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow!("{e}")
}

/// The series' legend, the same box on every figure.
fn draw_legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    position: SeriesLabelPosition,
) -> Result<()> {
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.9))
        .border_style(RGBColor(180, 180, 180))
        .label_font((FONT, 14))
        .draw()
        .map_err(plot_err)
}

/// A log-scale axis ticked at 1, 2, 5 × 10^k (plotters' `LogCoord` ticks only powers of ten from
/// the first one inside the range, so a loss between 4 and 9 gets no label).
#[derive(Clone)]
pub(super) struct LogAxis(Range<f64>);

impl LogAxis {
    /// m × 10^k inside the range, for the mantissas given.
    fn ticks(&self, mantissas: &[f64]) -> Vec<f64> {
        let (lo, hi) = (self.0.start, self.0.end);
        let mut out = Vec::new();
        if !(lo > 0.0 && hi.is_finite() && lo < hi) {
            return out;
        }
        // f64 spans 10^-324..10^308: the decades are bounded whatever the range.
        for k in (lo.log10().floor() as i32).max(-330)..=(hi.log10().ceil() as i32).min(310) {
            for m in mantissas {
                let v = m * 10f64.powi(k);
                if v >= lo && v <= hi {
                    out.push(v);
                }
            }
        }
        out
    }
}

impl Ranged for LogAxis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let (a, b) = (self.0.start.ln(), self.0.end.ln());
        let f = (value.max(f64::MIN_POSITIVE).ln() - a) / (b - a);
        limit.0 + (f * f64::from(limit.1 - limit.0)).round() as i32
    }

    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        let max = hint.max_num_points();
        let sets: [&[f64]; 3] = [&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0], &[1.0, 2.0, 5.0], &[1.0]];
        sets.iter().map(|m| self.ticks(m)).find(|t| t.len() <= max).unwrap_or_default()
    }

    fn range(&self) -> Range<f64> {
        self.0.clone()
    }
}

/// A figure drawn the same way on any plotters backend.
pub(super) trait Figure {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()>;
}

/// Write `<stem>.png` and `<stem>.svg` into the output folder: drawn in memory, then written
/// through it (no link in the folder followed).
pub(super) fn save(fig: &impl Figure, out: &OutDir, stem: &str) -> Result<()> {
    register_fonts();
    let png_name = format!("{stem}.png");
    let mut rgb = vec![0u8; SIZE.0 as usize * SIZE.1 as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, SIZE).into_drawing_area();
        fig.draw(&root)?;
        root.present().map_err(plot_err).with_context(|| format!("drawing {png_name}"))?;
    }
    let mut png = Vec::new();
    image::ImageEncoder::write_image(
        image::codecs::png::PngEncoder::new(&mut png),
        &rgb,
        SIZE.0,
        SIZE.1,
        image::ColorType::Rgb8,
    )
    .with_context(|| format!("encoding {png_name}"))?;
    out.write(&png_name, &png)?;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        fig.draw(&root)?;
        root.present().map_err(plot_err).with_context(|| format!("drawing {stem}.svg"))?;
    }
    out.write(&format!("{stem}.svg"), svg.as_bytes())?;
    Ok(())
}

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
    legend: SeriesLabelPosition,
    group_names: Vec<String>,
}

impl CurveFigure {
    fn new(title: &str, y_desc: &str, log_y: bool, runs: &[Run], cmp: &Comparison, metric: fn(&Record) -> f64) -> Self {
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
    title: String,
    /// (label, [(position, mean, std)]).
    groups: Vec<(String, Whiskers)>,
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

/// One swept arm: the score that chose against the swept field's value (log scale when the
/// values span a decade or more), the chosen value ringed.
pub(super) struct SweepFigure {
    title: String,
    field: String,
    measure: String,
    /// (value, score, chosen).
    points: Vec<(f64, f64, bool)>,
    log_x: bool,
}

impl SweepFigure {
    /// None unless the arm sweeps one numeric field and some value has a score.
    fn new(sel: &Selection, arm: &ArmSweep) -> Option<Self> {
        let [field] = arm.fields.as_slice() else { return None };
        let points: Vec<(f64, f64, bool)> = arm
            .points
            .iter()
            .filter_map(|p| Some((p.values.get(field)?.as_f64()?, p.score?, p.label == arm.chosen)))
            .filter(|(x, y, _)| x.is_finite() && y.is_finite())
            .collect();
        if points.is_empty() {
            return None;
        }
        let (lo, hi) = points.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| (a.min(p.0), b.max(p.0)));
        Some(Self {
            title: format!("{}: {} vs {field} (seed {})", arm.arm, sel.select, sel.seed),
            field: field.clone(),
            measure: format!("{} ({} is better)", sel.select, if sel.higher_is_better { "higher" } else { "lower" }),
            log_x: lo > 0.0 && hi / lo >= 10.0,
            points,
        })
    }

    fn draw_on<DB: DrawingBackend, X>(&self, root: &DrawingArea<DB, Shift>, x: X, y: Range<f64>) -> Result<()>
    where
        X: AsRangedCoord<Value = f64>,
        X::CoordDescType: Ranged<ValueType = f64> + ValueFormatter<f64>,
    {
        let mut chart = ChartBuilder::on(root)
            .caption(&self.title, (FONT, 24))
            .margin(18)
            .x_label_area_size(50)
            .y_label_area_size(70)
            .build_cartesian_2d(x, y.clone())
            .map_err(plot_err)?;
        let decimals = tick_decimals(y.end - y.start);
        chart
            .configure_mesh()
            .x_desc(self.field.as_str())
            .y_desc(self.measure.as_str())
            .x_label_formatter(&|v| trim_decimals(*v, 6))
            .y_label_formatter(&|v| trim_decimals(*v, decimals))
            .label_style((FONT, 14))
            .axis_desc_style((FONT, 16))
            .light_line_style(RGBColor(240, 240, 240))
            .bold_line_style(RGBColor(215, 215, 215))
            .draw()
            .map_err(plot_err)?;
        let color = COLORS[0];
        let mut line: Vec<(f64, f64)> = self.points.iter().map(|p| (p.0, p.1)).collect();
        line.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart.draw_series(LineSeries::new(line.iter().copied(), color.stroke_width(2))).map_err(plot_err)?;
        chart.draw_series(line.iter().map(|&p| Circle::new(p, 5, color.filled()))).map_err(plot_err)?;
        let chosen = COLORS[3];
        chart
            .draw_series(
                self.points.iter().filter(|p| p.2).map(|p| Circle::new((p.0, p.1), 10, chosen.stroke_width(3))),
            )
            .map_err(plot_err)?
            .label("chosen")
            .legend(move |(x, y)| Circle::new((x + 12, y), 6, chosen.stroke_width(3)));
        draw_legend(&mut chart, SeriesLabelPosition::UpperRight)?;
        Ok(())
    }
}

impl Figure for SweepFigure {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()> {
        root.fill(&WHITE).map_err(plot_err)?;
        let (xlo, xhi) =
            self.points.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| (a.min(p.0), b.max(p.0)));
        let (ylo, yhi) =
            self.points.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| (a.min(p.1), b.max(p.1)));
        let ypad = ((yhi - ylo) * 0.1).max(1e-3 * yhi.abs().max(1.0));
        let y = (ylo - ypad)..(yhi + ypad);
        if self.log_x {
            self.draw_on(root, LogAxis((xlo / 1.5)..(xhi * 1.5)), y)
        } else {
            let xpad = ((xhi - xlo) * 0.08).max(1e-3 * xhi.abs().max(1e-12));
            self.draw_on(root, (xlo - xpad)..(xhi + xpad), y)
        }
    }
}
