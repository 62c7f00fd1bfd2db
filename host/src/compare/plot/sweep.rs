//! One swept arm's figure: the score that chose against the swept value.

use super::draw::{draw_legend, plot_err, Figure, LogAxis, COLORS, FONT};
use crate::compare::{
    format::{tick_decimals, trim_decimals},
    sweep::{ArmSweep, Selection},
};
use anyhow::Result;
use plotters::{
    coord::{
        ranged1d::{AsRangedCoord, Ranged, ValueFormatter},
        Shift,
    },
    prelude::*,
};
use std::ops::Range;

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
    pub(super) fn new(sel: &Selection, arm: &ArmSweep) -> Option<Self> {
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
