//! The figure kit: a bundled font, the group colours, a legend, a log axis ticked at 1, 2, 5,
//! and a figure written as PNG and SVG.

use crate::outputs::OutDir;
use anyhow::{anyhow, Context, Result};
use plotters::{
    coord::{
        ranged1d::{DefaultFormatting, KeyPointHint, Ranged},
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
pub(in crate::compare) const SIZE: (u32, u32) = (1000, 600);
pub(super) const FONT: &str = "sans-serif";

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
pub(super) fn draw_legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
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
pub(super) struct LogAxis(pub(super) Range<f64>);

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
