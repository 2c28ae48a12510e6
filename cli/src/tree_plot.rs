//! `sequoia tree plot`: charts of what the planner works from and what it predicts —
//! t_v(n) and t_d(w) from a profile, the acceptance vector (overall and by depth), and the
//! predicted speedup against tree size for several network round-trip times.

use crate::bench_cmd::charts::{color, ensure_font, plot_err, FONT};
use anyhow::{Context, Result};
use plotters::prelude::*;
use sequoia_core::planner::cost::choose;
use std::path::{Path, PathBuf};

#[derive(clap::Args, Debug)]
pub struct PlotArgs {
    /// Planner profile (from `sequoia tree profile`).
    #[arg(long)]
    pub profile: PathBuf,
    /// Acceptance file (from `sequoia tree measure-acceptance`, or a JSON array).
    #[arg(long)]
    pub acceptance: PathBuf,
    /// Largest tree considered for the speedup curves.
    #[arg(long, default_value_t = 32)]
    pub max_nodes: usize,
    /// Round-trip times (ms) of the speedup curves.
    #[arg(long, value_delimiter = ',', default_value = "0,2,10,50")]
    pub rtts: Vec<f64>,
    #[arg(long)]
    pub out: PathBuf,
}

/// One line per series on shared axes.
fn line_chart(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> Result<()> {
    let pts = series.iter().flat_map(|(_, p)| p.iter());
    let xmax = pts.clone().map(|p| p.0).fold(1.0f64, f64::max);
    let ymax = pts.map(|p| p.1).fold(0.0f64, f64::max).max(1e-3);
    let root = BitMapBackend::new(path, (900, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, (FONT, 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(0f64..xmax * 1.05, 0f64..ymax * 1.15)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 15))
        .draw()
        .map_err(plot_err)?;
    for (i, (name, points)) in series.iter().enumerate() {
        let c = color(i);
        chart
            .draw_series(LineSeries::new(points.clone(), c.stroke_width(2)))
            .map_err(plot_err)?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], c.stroke_width(3)));
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 3, c.filled())))
            .map_err(plot_err)?;
    }
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

pub fn plot(args: &PlotArgs) -> Result<()> {
    ensure_font()?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let profile = crate::tree_cmds::load_profile(&args.profile)?;
    let text = std::fs::read_to_string(&args.acceptance)
        .with_context(|| format!("reading {}", args.acceptance.display()))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).context("acceptance file is not JSON")?;
    let p = crate::tree_cmds::load_acceptance(&None, &Some(args.acceptance.clone()))?;

    let curve = |c: &sequoia_core::planner::cost::CostCurve| -> Vec<(f64, f64)> {
        c.sizes
            .iter()
            .zip(&c.ms)
            .map(|(&n, &m)| (n as f64, m))
            .collect()
    };
    let costs = args.out.join("costs.png");
    line_chart(
        &costs,
        "Measured forward cost",
        "nodes in the forward (tree size n / level width w)",
        "milliseconds",
        &[
            ("target t_v(n)".into(), curve(&profile.verify)),
            ("draft t_d(w)".into(), curve(&profile.draft)),
        ],
    )?;

    let ranks = |v: &[f64]| -> Vec<(f64, f64)> {
        v.iter()
            .enumerate()
            .map(|(r, &x)| ((r + 1) as f64, x))
            .collect()
    };
    let mut acc = vec![("overall".to_string(), ranks(&p))];
    if let Some(rows) = value.get("by_depth").and_then(|d| d.as_array()) {
        for (d, row) in rows.iter().enumerate() {
            let row: Vec<f64> = serde_json::from_value(row.clone()).unwrap_or_default();
            if row.iter().any(|&x| x > 0.0) {
                acc.push((format!("depth {d}"), ranks(&row)));
            }
        }
    }
    let acceptance = args.out.join("acceptance.png");
    line_chart(
        &acceptance,
        "Acceptance by rank",
        "rank r of the child",
        "p_r",
        &acc,
    )?;

    let mut speed = Vec::new();
    for &rtt in &args.rtts {
        let mut prof = profile.clone();
        prof.network.rtt_ms = rtt;
        let plan = choose(&prof, &p, args.max_nodes, 16, 0)?;
        // Budgets past the useful size give the same (smaller) tree: keep one point per size.
        let mut best = std::collections::BTreeMap::new();
        for b in &plan.by_size {
            let e = best.entry(b.nodes).or_insert(b.speedup);
            *e = f64::max(*e, b.speedup);
        }
        let pts = best.into_iter().map(|(n, s)| (n as f64, s)).collect();
        speed.push((format!("RTT {rtt} ms"), pts));
    }
    let speedup = args.out.join("predicted_speedup.png");
    line_chart(
        &speedup,
        "Predicted speedup over target-only",
        "tree nodes (root included)",
        "speedup",
        &speed,
    )?;
    for f in [costs, acceptance, speedup] {
        println!("wrote {}", f.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use sequoia_core::planner::cost::{CostCurve, NetworkProfile, Profile};

    #[test]
    fn writes_three_pngs() {
        let dir = tempfile::tempdir().unwrap();
        let sizes = vec![1, 2, 4, 8, 16];
        let profile = Profile {
            verify: CostCurve::new(sizes.clone(), vec![20.0, 22.0, 25.0, 30.0, 40.0]).unwrap(),
            draft: CostCurve::new(sizes, vec![2.0, 2.2, 2.5, 3.0, 4.0]).unwrap(),
            network: NetworkProfile {
                rtt_ms: 1.0,
                bytes_per_ms: 125_000.0,
            },
            overhead_ms: 0.5,
            step_extra_ms: 0.0,
            sends_ahead: false,
            ahead_candidates: 0,
            decodes_while_waiting: false,
            lookup: Default::default(),
            drafted_scale: 1.0,
            context: 128,
            note: String::new(),
        };
        let prof = dir.path().join("p.json");
        std::fs::write(&prof, serde_json::to_string(&profile).unwrap()).unwrap();
        let acc = dir.path().join("a.json");
        std::fs::write(
            &acc,
            r#"{"acceptance": [0.6, 0.1, 0.05], "by_depth": [[0.5, 0.1, 0.0], [0.7, 0.1, 0.05]]}"#,
        )
        .unwrap();
        let out = dir.path().join("charts");
        plot(&PlotArgs {
            profile: prof,
            acceptance: acc,
            max_nodes: 16,
            rtts: vec![0.0, 10.0],
            out: out.clone(),
        })
        .unwrap();
        for f in ["costs.png", "acceptance.png", "predicted_speedup.png"] {
            let bytes = std::fs::read(out.join(f)).unwrap();
            assert!(bytes.starts_with(b"\x89PNG"), "{f} is not a PNG");
        }
    }
}
