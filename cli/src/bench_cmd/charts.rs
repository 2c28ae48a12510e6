//! PNG charts for the bench report (plotters, bitmap backend).
//!
//! Text is drawn with ab_glyph from a TrueType font found on the machine at run time
//! (`SEQUOIA_CHART_FONT`, else common DejaVu / Liberation paths, else `fc-match`), so the build
//! needs no C font libraries; without any font the charts are skipped.

use anyhow::{anyhow, bail, Result};
use plotters::prelude::*;
use plotters::style::FontStyle;
use std::path::Path;
use std::sync::OnceLock;

/// Font family name the charts use.
pub(crate) const FONT: &str = "sans-serif";

const COLORS: [RGBColor; 10] = [
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

pub(crate) fn color(i: usize) -> RGBColor {
    COLORS[i % COLORS.len()]
}

pub(crate) fn plot_err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing a chart: {e:?}")
}

fn font_candidates() -> Vec<String> {
    let mut out = Vec::new();
    if let Ok(p) = std::env::var("SEQUOIA_CHART_FONT") {
        out.push(p);
    }
    for p in [
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/TTF/DejaVuSans.ttf",
        "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
        "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
        "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
        "/Library/Fonts/Arial.ttf",
        "/System/Library/Fonts/Supplemental/Arial.ttf",
        "C:\\Windows\\Fonts\\arial.ttf",
    ] {
        out.push(p.to_string());
    }
    if let Ok(o) = std::process::Command::new("fc-match")
        .args(["-f", "%{file}", "sans-serif:fontformat=TrueType"])
        .output()
    {
        let p = String::from_utf8_lossy(&o.stdout).trim().to_string();
        if !p.is_empty() {
            out.push(p);
        }
    }
    out
}

/// Register a system TrueType font for the charts (once per process).
pub fn ensure_font() -> Result<()> {
    static FONT_LOADED: OnceLock<Result<String, String>> = OnceLock::new();
    let r = FONT_LOADED.get_or_init(|| {
        for path in font_candidates() {
            let Ok(bytes) = std::fs::read(&path) else {
                continue;
            };
            // plotters keeps a reference to the font for the life of the process.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if plotters::style::register_font(FONT, FontStyle::Normal, bytes).is_ok() {
                return Ok(path);
            }
        }
        Err("no TrueType font found (set SEQUOIA_CHART_FONT to a .ttf file)".to_string())
    });
    match r {
        Ok(_) => Ok(()),
        Err(e) => bail!("{e}"),
    }
}

/// Grouped bars: for every category (x) one bar per method, height = `value(method, category)`
/// (missing values leave a gap), with a line at 1.0 (no speedup).
pub fn speedup_chart(
    path: &Path,
    title: &str,
    categories: &[String],
    methods: &[String],
    value: impl Fn(&str, &str) -> Option<f64>,
) -> Result<()> {
    let n = categories.len().max(1);
    let ymax = categories
        .iter()
        .flat_map(|c| methods.iter().filter_map(|m| value(m, c)))
        .fold(1.0f64, f64::max);
    let width = (160 + 110 * n) as u32;
    let root = BitMapBackend::new(path, (width.max(800), 620)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, (FONT, 24))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(64)
        // Headroom above the tallest bar for the legend.
        .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), 0f64..ymax * 1.45)
        .map_err(plot_err)?;
    let names = categories.to_vec();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n + 1)
        .x_label_formatter(&|x: &f64| {
            let i = x.round();
            if (x - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < names.len() {
                names[i as usize].clone()
            } else {
                String::new()
            }
        })
        .y_desc("speedup over target-only (×)")
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 15))
        .draw()
        .map_err(plot_err)?;
    let group = 0.84;
    let bar = group / methods.len().max(1) as f64;
    for (j, m) in methods.iter().enumerate() {
        let c = color(j);
        let bars: Vec<Rectangle<(f64, f64)>> = categories
            .iter()
            .enumerate()
            .filter_map(|(i, cat)| {
                value(m, cat).map(|v| {
                    let x0 = i as f64 - group / 2.0 + j as f64 * bar;
                    Rectangle::new([(x0, 0.0), (x0 + bar * 0.9, v)], c.filled())
                })
            })
            .collect();
        chart
            .draw_series(bars)
            .map_err(plot_err)?
            .label(m.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], c.filled()));
    }
    chart
        .draw_series(LineSeries::new(
            [(-0.5, 1.0), (n as f64 - 0.5, 1.0)],
            BLACK.stroke_width(2),
        ))
        .map_err(plot_err)?;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font((FONT, 14))
        .draw()
        .map_err(plot_err)?;
    root.present().map_err(plot_err)?;
    Ok(())
}

/// A line of the tokens-per-step chart: (tree nodes, tokens per step, point label) points.
pub struct Series {
    pub name: String,
    /// Index into the color table (the same method family keeps its color in every panel).
    pub color: usize,
    pub points: Vec<(f64, f64, String)>,
}

/// Mean tokens per step against tree size (nodes, root included): one panel per
/// (title, series) entry, side by side with shared axes, one line per series.
pub fn tokens_per_step_chart(path: &Path, panels: &[(String, Vec<Series>)]) -> Result<()> {
    let pts = panels
        .iter()
        .flat_map(|(_, s)| s.iter())
        .flat_map(|s| s.points.iter());
    let xmax = pts.clone().map(|p| p.0).fold(2.0f64, f64::max);
    let ymax = pts.map(|p| p.1).fold(1.5f64, f64::max);
    let n = panels.len().max(1);
    let root = BitMapBackend::new(path, (760 * n as u32, 640)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let root = root
        .titled("Tokens per step vs tree size", (FONT, 24))
        .map_err(plot_err)?;
    for (area, (title, series)) in root.split_evenly((1, n)).iter().zip(panels) {
        let mut chart = ChartBuilder::on(area)
            .caption(title, (FONT, 18))
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(64)
            .build_cartesian_2d(0f64..xmax * 1.15, 0.8f64..ymax * 1.2)
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .x_desc("tree nodes (root included; auto: mean of its plans)")
            .y_desc("mean tokens per step")
            .label_style((FONT, 14))
            .axis_desc_style((FONT, 15))
            .draw()
            .map_err(plot_err)?;
        for s in series {
            let c = color(s.color);
            let xy: Vec<(f64, f64)> = s.points.iter().map(|p| (p.0, p.1)).collect();
            chart
                .draw_series(LineSeries::new(xy.clone(), c.stroke_width(2)))
                .map_err(plot_err)?
                .label(s.name.as_str())
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], c.stroke_width(3)));
            // Each point: a dot, and the method's name just above and right of it.
            chart
                .draw_series(s.points.iter().map(|(x, y, label)| {
                    EmptyElement::at((*x, *y))
                        + Circle::new((0, 0), 4, c.filled())
                        + Text::new(label.clone(), (6, -16), (FONT, 12).into_font().color(&c))
                }))
                .map_err(plot_err)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .label_font((FONT, 14))
            .draw()
            .map_err(plot_err)?;
    }
    root.present().map_err(plot_err)?;
    Ok(())
}
