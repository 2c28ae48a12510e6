//! Aggregation of `results.jsonl` into the bench report: `report.json`, `report.md` (also printed)
//! and the charts.
//!
//! Only (prompt, temperature) groups in which every method finished are counted, so every
//! method's numbers, and every speedup, come from the same prompts. Rates are pooled: tokens/s
//! of a category is its generated tokens over its decode time (total − prefill), not a mean of
//! per-prompt rates; "overall" pools all categories the same way.

use super::{
    charts, machine_description, temp_key, BenchArgs, Calibration, Method, Record, RunConfig,
    RunRecord,
};
use anyhow::Result;
use sequoia_core::stats::RankCounts;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// Category name of the pooled rows.
pub const OVERALL: &str = "overall";
/// Ranks of the acceptance vector shown in the Markdown table.
const SHOWN_RANKS: usize = 4;

/// Sums over the runs of one (temperature, method, category) cell.
#[derive(Default, Clone)]
struct Acc {
    prompts: usize,
    tokens: u64,
    steps: u64,
    decode_ms: f64,
    draft_ms: f64,
    verify_ms: f64,
    network_ms: f64,
    nodes: f64,
    counts: RankCounts,
    greedy_same: usize,
    greedy_compared: usize,
    /// Sum and count of the planner's predicted speedups (runs that report one).
    predicted_sum: f64,
    predicted_runs: usize,
    /// Sums over the same runs of the predicted tokens per step and step time.
    predicted_tokens_sum: f64,
    predicted_step_sum: f64,
    pipelined: bool,
    pipeline_hits: u64,
    pipeline_misses: u64,
    pipeline_wasted_ms: f64,
    first_trees_early: u64,
    first_trees_with_open: u64,
    trees_sent_ahead: u64,
    trees_taken_ahead: u64,
    lookup_proposed: u64,
    lookup_accepted: u64,
}

impl Acc {
    fn add(&mut self, r: &RunRecord) {
        self.prompts += 1;
        self.tokens += r.generated_tokens as u64;
        self.steps += r.steps as u64;
        self.decode_ms += r.decode_ms();
        self.draft_ms += r.draft_ms;
        self.verify_ms += r.verify_ms;
        self.network_ms += r.network_ms;
        self.nodes += r.nodes as f64;
        if r.predicted_speedup > 0.0 {
            self.predicted_sum += r.predicted_speedup;
            self.predicted_runs += 1;
            self.predicted_tokens_sum += r.predicted_tokens_per_step;
            self.predicted_step_sum += r.predicted_step_ms;
        }
        self.pipelined |= r.pipeline;
        self.pipeline_hits += r.pipeline_hits as u64;
        self.pipeline_misses += r.pipeline_misses as u64;
        self.pipeline_wasted_ms += r.pipeline_wasted_ms;
        self.first_trees_early += r.first_tree_early as u64;
        self.first_trees_with_open += r.first_tree_with_open as u64;
        self.trees_sent_ahead += r.trees_sent_ahead as u64;
        self.trees_taken_ahead += r.trees_taken_ahead as u64;
        self.lookup_proposed += r.lookup_proposed;
        self.lookup_accepted += r.lookup_accepted;
        self.counts.add(&RankCounts::new(
            r.accepted_by_rank.clone(),
            r.trials_by_rank.clone(),
        ));
    }
}

/// One row of the report: a method in a category at a temperature.
#[derive(Debug, Clone, Serialize)]
pub struct Cell {
    pub temperature: f32,
    pub method: String,
    pub category: String,
    pub prompts: usize,
    pub generated_tokens: u64,
    pub steps: u64,
    pub decode_ms: f64,
    /// Generated tokens / decode seconds (decode = total − prefill).
    pub tokens_per_second: f64,
    /// Over `target` in the same category and temperature (None without a `target` method).
    pub speedup: Option<f64>,
    /// The auto planner's predicted speedup (over plain target decoding on the verify node),
    /// averaged over the runs that report one; None for forced trees.
    pub predicted_speedup: Option<f64>,
    /// The tokens per step and step time (ms) behind that prediction, averaged the same way.
    pub predicted_tokens_per_step: Option<f64>,
    pub predicted_step_ms: Option<f64>,
    pub tokens_per_step: f64,
    /// Decode time per step (ms), measured.
    pub step_ms: f64,
    /// Mean tree nodes (root included) per generation.
    pub mean_nodes: f64,
    /// p_r = accepted at rank r / trials at rank r, r = 1, 2, ...
    pub acceptance: Vec<f64>,
    pub draft_ms_per_token: f64,
    pub network_ms_per_token: f64,
    pub verify_ms_per_token: f64,
    /// Decode time not spent drafting, on the network or verifying, per token.
    pub overhead_ms_per_token: f64,
    /// T = 0 only: generations whose tokens equal the target-only ones, and how many were
    /// compared.
    pub greedy_identical: Option<(usize, usize)>,
    /// `+pipe` methods: steps whose tree had been drafted ahead, steps where it had not, and
    /// the draft time spent ahead in vain, summed over the runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline_hits: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline_misses: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline_wasted_ms: Option<f64>,
    /// `+pipe` methods: runs whose first tree was grown during the verify node's prefill.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_trees_early: Option<u64>,
    /// `+pipe` methods: runs whose first tree went to the verify node with the `open`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_trees_with_open: Option<u64>,
    /// `+pipe` methods: trees sent ahead of the verdict they assumed, and how many of them that
    /// verdict confirmed (verified with no round trip before them), summed over the runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trees_sent_ahead: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trees_taken_ahead: Option<u64>,
    /// Prompt-lookup nodes sent in the trees (T = 0 only), and how many were accepted.
    pub lookup_proposed: u64,
    pub lookup_accepted: u64,
    /// The setup the row was measured on (from the run's configuration): CPU sets and threads
    /// of the draft and verify sides (None = not pinned / the service's default), the added
    /// round-trip time and the link rate (Mbit/s per direction, 0 = unlimited).
    pub draft_cpus: Option<String>,
    pub verify_cpus: Option<String>,
    pub draft_threads: Option<usize>,
    pub verify_threads: Option<usize>,
    pub rtt_ms: f64,
    pub bandwidth_mbps: f64,
}

impl Cell {
    fn from_acc(t: f32, method: &str, category: &str, a: &Acc) -> Self {
        let per_tok = |x: f64| {
            if a.tokens > 0 {
                x / a.tokens as f64
            } else {
                0.0
            }
        };
        let rate = |num: u64, den: u64| {
            if den > 0 {
                num as f64 / den as f64
            } else {
                0.0
            }
        };

        Cell {
            temperature: t,
            method: method.to_string(),
            category: category.to_string(),
            prompts: a.prompts,
            generated_tokens: a.tokens,
            steps: a.steps,
            decode_ms: a.decode_ms,
            tokens_per_second: if a.decode_ms > 0.0 {
                a.tokens as f64 / (a.decode_ms / 1e3)
            } else {
                0.0
            },
            speedup: None,
            predicted_speedup: (a.predicted_runs > 0)
                .then(|| a.predicted_sum / a.predicted_runs as f64),
            // Results written before these fields existed read as 0: no figure then.
            predicted_tokens_per_step: (a.predicted_runs > 0 && a.predicted_tokens_sum > 0.0)
                .then(|| a.predicted_tokens_sum / a.predicted_runs as f64),
            predicted_step_ms: (a.predicted_runs > 0 && a.predicted_step_sum > 0.0)
                .then(|| a.predicted_step_sum / a.predicted_runs as f64),
            tokens_per_step: rate(a.tokens, a.steps),
            step_ms: if a.steps > 0 {
                a.decode_ms / a.steps as f64
            } else {
                0.0
            },
            mean_nodes: if a.prompts > 0 {
                a.nodes / a.prompts as f64
            } else {
                0.0
            },
            acceptance: if a.counts.is_empty() {
                vec![]
            } else {
                a.counts.rates(a.counts.trials.len())
            },
            draft_ms_per_token: per_tok(a.draft_ms),
            network_ms_per_token: per_tok(a.network_ms),
            verify_ms_per_token: per_tok(a.verify_ms),
            overhead_ms_per_token: per_tok(
                (a.decode_ms - a.draft_ms - a.network_ms - a.verify_ms).max(0.0),
            ),
            greedy_identical: None,
            pipeline_hits: a.pipelined.then_some(a.pipeline_hits),
            pipeline_misses: a.pipelined.then_some(a.pipeline_misses),
            pipeline_wasted_ms: a.pipelined.then_some(a.pipeline_wasted_ms),
            first_trees_early: a.pipelined.then_some(a.first_trees_early),
            first_trees_with_open: a.pipelined.then_some(a.first_trees_with_open),
            trees_sent_ahead: a.pipelined.then_some(a.trees_sent_ahead),
            trees_taken_ahead: a.pipelined.then_some(a.trees_taken_ahead),
            lookup_proposed: a.lookup_proposed,
            lookup_accepted: a.lookup_accepted,
            draft_cpus: None,
            verify_cpus: None,
            draft_threads: None,
            verify_threads: None,
            rtt_ms: 0.0,
            bandwidth_mbps: 0.0,
        }
    }

    /// Fill in the setup fields from the run's configuration.
    fn set_setup(&mut self, c: &RunConfig) {
        self.draft_cpus = c.draft_cpus.clone();
        self.verify_cpus = c.verify_cpus.clone();
        self.draft_threads = c.draft_threads;
        self.verify_threads = c.verify_threads;
        self.rtt_ms = c.rtt_ms;
        self.bandwidth_mbps = c.bandwidth_mbps;
    }

    /// The setup in a few words: "draft 0 ×1 · verify 1 ×1 · RTT 10 ms · 100 Mbit/s".
    pub fn setup_text(&self) -> String {
        let side = |cpus: &Option<String>, threads: Option<usize>| {
            format!(
                "{} ×{}",
                cpus.as_deref().unwrap_or("any"),
                threads.map_or("default".to_string(), |t| t.to_string())
            )
        };
        format!(
            "draft {} · verify {} · RTT {} ms · {}",
            side(&self.draft_cpus, self.draft_threads),
            side(&self.verify_cpus, self.verify_threads),
            self.rtt_ms,
            if self.bandwidth_mbps > 0.0 {
                format!("{} Mbit/s", self.bandwidth_mbps)
            } else {
                "unlimited".to_string()
            }
        )
    }
}

/// The whole report (report.json).
#[derive(Debug, Serialize)]
pub struct Report {
    pub config: Option<RunConfig>,
    /// The machine the report was written on (the runs may have been elsewhere: see config).
    pub report_machine: String,
    pub temperatures: Vec<f32>,
    pub methods: Vec<String>,
    pub categories: Vec<String>,
    /// Acceptance vector used for the fixed trees, per temperature key.
    pub calibration: BTreeMap<String, Calibration>,
    pub cells: Vec<Cell>,
    /// (prompt, temperature) groups counted, and those left out because a method is missing.
    pub complete_groups: usize,
    pub incomplete_groups: usize,
    pub failed_runs: usize,
}

impl Report {
    pub fn cell(&self, t: f32, method: &str, category: &str) -> Option<&Cell> {
        let tk = temp_key(t);
        self.cells
            .iter()
            .find(|c| temp_key(c.temperature) == tk && c.method == method && c.category == category)
    }
}

/// Build the report from the records, for `methods` (in that order; methods found in the
/// records but not asked for are appended) and the temperatures found.
pub fn build(methods: &[Method], records: &[Record]) -> Report {
    let runs: Vec<&RunRecord> = records
        .iter()
        .filter_map(|r| match r {
            Record::Run(r) => Some(r),
            _ => None,
        })
        .collect();
    let failed_runs = runs.iter().filter(|r| r.error.is_some()).count();
    let ok: Vec<&RunRecord> = runs.into_iter().filter(|r| r.error.is_none()).collect();

    let mut method_names: Vec<String> = methods.iter().map(|m| m.to_string()).collect();
    for r in &ok {
        if !method_names.contains(&r.method) {
            method_names.push(r.method.clone());
        }
    }
    // Keep only methods that have any result.
    method_names.retain(|m| ok.iter().any(|r| &r.method == m));
    let mut temperatures: Vec<f32> = Vec::new();
    for r in &ok {
        if !temperatures
            .iter()
            .any(|&t| temp_key(t) == temp_key(r.temperature))
        {
            temperatures.push(r.temperature);
        }
    }
    temperatures.sort_by(f32::total_cmp);
    let mut categories: Vec<String> = Vec::new();
    for r in &ok {
        if !categories.contains(&r.category) {
            categories.push(r.category.clone());
        }
    }

    // The latest record wins for a repeated (prompt, method, T).
    let mut by_group: BTreeMap<(String, u64), BTreeMap<String, &RunRecord>> = BTreeMap::new();
    for r in &ok {
        by_group
            .entry((temp_key(r.temperature), r.question_id))
            .or_default()
            .insert(r.method.clone(), r);
    }
    let (mut complete, mut incomplete) = (0, 0);
    let mut accs: BTreeMap<(String, String, String), Acc> = BTreeMap::new();
    for ((tk, _), group) in &by_group {
        if !method_names.iter().all(|m| group.contains_key(m)) {
            incomplete += 1;
            continue;
        }
        complete += 1;
        let target_tokens = group.get("target").map(|r| &r.tokens);
        for (m, r) in group {
            for cat in [r.category.as_str(), OVERALL] {
                let a = accs
                    .entry((tk.clone(), m.clone(), cat.to_string()))
                    .or_default();
                a.add(r);
                if r.temperature == 0.0 && m != "target" {
                    if let Some(tt) = target_tokens {
                        a.greedy_compared += 1;
                        a.greedy_same += usize::from(&r.tokens == tt);
                    }
                }
            }
        }
    }

    let mut cells = Vec::new();
    for &t in &temperatures {
        for m in &method_names {
            for cat in categories.iter().map(String::as_str).chain([OVERALL]) {
                let Some(a) = accs.get(&(temp_key(t), m.clone(), cat.to_string())) else {
                    continue;
                };
                let mut c = Cell::from_acc(t, m, cat, a);
                if t == 0.0 && m != "target" && a.greedy_compared > 0 {
                    c.greedy_identical = Some((a.greedy_same, a.greedy_compared));
                }
                cells.push(c);
            }
        }
    }
    // Speedups against the target in the same category and temperature.
    let base: BTreeMap<(String, String), f64> = cells
        .iter()
        .filter(|c| c.method == "target")
        .map(|c| {
            (
                (temp_key(c.temperature), c.category.clone()),
                c.tokens_per_second,
            )
        })
        .collect();
    for c in &mut cells {
        if let Some(&b) = base.get(&(temp_key(c.temperature), c.category.clone())) {
            if b > 0.0 {
                c.speedup = Some(c.tokens_per_second / b);
            }
        }
    }

    let mut calibration = BTreeMap::new();
    let mut config = None;
    for r in records {
        match r {
            Record::Calibration(c) => {
                calibration.insert(temp_key(c.temperature), c.clone());
            }
            Record::Config(c) if config.is_none() => config = Some(c.clone()),
            _ => {}
        }
    }
    if let Some(c) = &config {
        for cell in &mut cells {
            cell.set_setup(c);
        }
    }
    Report {
        config,
        report_machine: machine_description(),
        temperatures,
        methods: method_names,
        categories,
        calibration,
        cells,
        complete_groups: complete,
        incomplete_groups: incomplete,
        failed_runs,
    }
}

fn fmt_p(v: &[f64]) -> String {
    v.iter()
        .map(|p| format!("{p:.3}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The Markdown report.
pub fn markdown(rep: &Report) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# sequoia bench");
    if let Some(c) = &rep.config {
        if let Some(l) = &c.label {
            let _ = writeln!(s, "\n**{l}**");
        }
        let _ = writeln!(
            s,
            "\n- draft `{}` → target `{}`; prompts `{}`; up to {} new tokens; seed {}",
            c.draft, c.target, c.prompts, c.max_tokens, c.seed
        );
        let _ = writeln!(s, "- services: {}; baseline: {}", c.services, c.baseline);
        if c.rtt_ms > 0.0 {
            let _ = writeln!(s, "- delay proxy adds {} ms round trip", c.rtt_ms);
        }
        if c.bandwidth_mbps > 0.0 {
            let _ = writeln!(
                s,
                "- link rate capped at {} Mbit/s per direction",
                c.bandwidth_mbps
            );
        }
        let _ = writeln!(s, "- machine: {}", c.machine);
    }
    let _ = writeln!(
        s,
        "- {} (prompt, temperature) groups with every method; {} incomplete groups left out; {} failed runs",
        rep.complete_groups, rep.incomplete_groups, rep.failed_runs
    );
    let _ = writeln!(
        s,
        "- tokens/s = generated tokens / (total − prefill) time, pooled over prompts; speedup = \
         tokens/s over the `target` method's in the same category and temperature"
    );
    for (tk, c) in &rep.calibration {
        let _ = writeln!(
            s,
            "- acceptance vector for fixed trees at T = {tk} ({}{}): {}",
            c.source,
            if c.prompts > 0 {
                format!(", {} held-out prompts", c.prompts)
            } else {
                String::new()
            },
            fmt_p(&c.acceptance)
        );
    }

    let cats: Vec<&str> = rep
        .categories
        .iter()
        .map(String::as_str)
        .chain([OVERALL])
        .collect();
    for &t in &rep.temperatures {
        let cats: Vec<&str> = cats
            .iter()
            .copied()
            .filter(|c| rep.methods.iter().any(|m| rep.cell(t, m, c).is_some()))
            .collect();
        let _ = writeln!(s, "\n## T = {t}\n");
        let _ = writeln!(s, "### Speedup over target-only, by category\n");
        let _ = write!(s, "| category | prompts | target tok/s |");
        let others: Vec<&String> = rep.methods.iter().filter(|m| *m != "target").collect();
        for m in &others {
            let _ = write!(s, " {m} |");
        }
        let _ = write!(s, "\n|---|---:|---:|");
        for _ in &others {
            let _ = write!(s, "---:|");
        }
        s.push('\n');
        for cat in &cats {
            let name = if *cat == OVERALL {
                format!("**{cat}**")
            } else {
                cat.to_string()
            };
            let prompts = rep
                .methods
                .first()
                .and_then(|m| rep.cell(t, m, cat))
                .map_or(0, |c| c.prompts);
            let tps = rep
                .cell(t, "target", cat)
                .map_or("–".into(), |c| format!("{:.2}", c.tokens_per_second));
            let _ = write!(s, "| {name} | {prompts} | {tps} |");
            // Bold the best method of the row.
            let best = others
                .iter()
                .filter_map(|m| rep.cell(t, m, cat).and_then(|c| c.speedup))
                .fold(f64::NEG_INFINITY, f64::max);
            for m in &others {
                let v = rep.cell(t, m, cat).map(|c| match c.speedup {
                    Some(x) if x == best => format!("**{x:.2}×**"),
                    Some(x) => format!("{x:.2}×"),
                    None => format!("{:.2} tok/s", c.tokens_per_second),
                });
                let _ = write!(s, " {} |", v.unwrap_or_else(|| "–".into()));
            }
            s.push('\n');
        }

        let _ = writeln!(s, "\n### Per method, all categories pooled\n");
        let _ = write!(
            s,
            "| method | nodes | tok/s | speedup | predicted | tokens/step (predicted) | step ms (predicted) |"
        );
        for r in 1..=SHOWN_RANKS {
            let _ = write!(s, " p{r} |");
        }
        let _ = writeln!(
            s,
            " draft ms/tok | network ms/tok | verify ms/tok | overhead ms/tok |{} \
             pipeline hits/misses (first trees early, with the open/runs; taken/sent ahead) | pipeline wasted ms | setup |",
            if t == 0.0 {
                " greedy = target | lookup accepted/sent |"
            } else {
                ""
            }
        );
        let _ = write!(s, "|---|---:|---:|---:|---:|---:|---:|");
        for _ in 1..=SHOWN_RANKS {
            let _ = write!(s, "---:|");
        }
        let _ = writeln!(
            s,
            "---:|---:|---:|---:|{}---:|---:|---|",
            if t == 0.0 { "---:|---:|" } else { "" }
        );
        for m in &rep.methods {
            let Some(c) = rep.cell(t, m, OVERALL) else {
                continue;
            };
            let _ = write!(
                s,
                "| {m} | {:.1} | {:.2} | {} | {} | {:.2}{} | {:.1}{} |",
                c.mean_nodes,
                c.tokens_per_second,
                c.speedup.map_or("–".into(), |x| format!("{x:.2}×")),
                c.predicted_speedup
                    .map_or("–".into(), |x| format!("{x:.2}×")),
                c.tokens_per_step,
                c.predicted_tokens_per_step
                    .map_or(String::new(), |x| format!(" ({x:.2})")),
                c.step_ms,
                c.predicted_step_ms
                    .map_or(String::new(), |x| format!(" ({x:.1})")),
            );
            for r in 0..SHOWN_RANKS {
                let _ = write!(
                    s,
                    " {} |",
                    c.acceptance
                        .get(r)
                        .map_or("–".into(), |p| format!("{p:.3}"))
                );
            }
            let _ = write!(
                s,
                " {:.2} | {:.2} | {:.2} | {:.2} |",
                c.draft_ms_per_token,
                c.network_ms_per_token,
                c.verify_ms_per_token,
                c.overhead_ms_per_token
            );
            if t == 0.0 {
                let _ = write!(
                    s,
                    " {} |",
                    c.greedy_identical
                        .map_or("–".into(), |(a, b)| format!("{a}/{b}"))
                );
                let _ = write!(s, " {}/{} |", c.lookup_accepted, c.lookup_proposed);
            }
            let _ = write!(
                s,
                " {} | {} | {} |",
                match (c.pipeline_hits, c.pipeline_misses, c.first_trees_early) {
                    (Some(h), Some(m), Some(e)) => format!(
                        "{h}/{m} ({e}, {}/{}; {}/{})",
                        c.first_trees_with_open.unwrap_or(0),
                        c.prompts,
                        c.trees_taken_ahead.unwrap_or(0),
                        c.trees_sent_ahead.unwrap_or(0)
                    ),
                    _ => "–".into(),
                },
                c.pipeline_wasted_ms
                    .map_or("–".into(), |w| format!("{w:.1}")),
                c.setup_text()
            );
            s.push('\n');
        }

        let _ = writeln!(s, "\n### Tokens per step, by category\n");
        let _ = write!(s, "| category |");
        for m in &rep.methods {
            let _ = write!(s, " {m} |");
        }
        let _ = write!(s, "\n|---|");
        for _ in &rep.methods {
            let _ = write!(s, "---:|");
        }
        s.push('\n');
        for cat in &cats {
            let _ = write!(s, "| {cat} |");
            for m in &rep.methods {
                let v = rep
                    .cell(t, m, cat)
                    .map_or("–".into(), |c| format!("{:.2}", c.tokens_per_step));
                let _ = write!(s, " {v} |");
            }
            s.push('\n');
        }
    }
    s
}

/// Chart file name for the speedup chart at temperature `t`.
pub fn speedup_chart_name(t: f32) -> String {
    format!("speedup_T{}.png", temp_key(t))
}

/// Write report.json, report.md and the charts into the out dir; print the Markdown.
pub fn write_reports(args: &BenchArgs, methods: &[Method], records: &[Record]) -> Result<()> {
    let rep = build(methods, records);
    let dir = &args.out_dir;
    std::fs::write(dir.join("report.json"), serde_json::to_string_pretty(&rep)?)?;
    let mut md = markdown(&rep);
    let mut charts_written = Vec::new();
    if !args.no_charts && !rep.cells.is_empty() {
        match write_charts(&rep, dir) {
            Ok(files) => charts_written = files,
            Err(e) => eprintln!("charts skipped: {e:#}"),
        }
    }
    if !charts_written.is_empty() {
        let _ = writeln!(md, "\n## Charts\n");
        for f in &charts_written {
            let _ = writeln!(md, "![{f}]({f})");
        }
    }
    std::fs::write(dir.join("report.md"), &md)?;
    println!("{md}");
    eprintln!(
        "wrote {}/report.md, report.json{}",
        dir.display(),
        if charts_written.is_empty() {
            String::new()
        } else {
            format!(", {}", charts_written.join(", "))
        }
    );
    Ok(())
}

fn write_charts(rep: &Report, dir: &std::path::Path) -> Result<Vec<String>> {
    charts::ensure_font()?;
    let mut files = Vec::new();
    let others: Vec<String> = rep
        .methods
        .iter()
        .filter(|m| *m != "target")
        .cloned()
        .collect();
    let mut cats = rep.categories.clone();
    cats.push(OVERALL.to_string());
    for &t in &rep.temperatures {
        let name = speedup_chart_name(t);
        charts::speedup_chart(
            &dir.join(&name),
            &format!("Speedup over target-only decoding, T = {t}"),
            &cats,
            &others,
            |m, c| rep.cell(t, m, c).and_then(|c| c.speedup),
        )?;
        files.push(name);
    }
    // Tokens per step against tree size: a panel per temperature, a line per method family.
    const FAMILIES: [&str; 5] = ["target", "chain", "kxd", "sequoia", "auto"];
    let mut panels = Vec::new();
    for &t in &rep.temperatures {
        let mut series = Vec::new();
        for (fi, fam) in FAMILIES.iter().enumerate() {
            let mut points: Vec<(f64, f64, String)> = rep
                .methods
                .iter()
                .filter(|m| {
                    m.parse::<Method>()
                        .is_ok_and(|x| x.family() == *fam && !x.is_pipelined())
                })
                .filter_map(|m| {
                    rep.cell(t, m, OVERALL)
                        .map(|c| (c.mean_nodes, c.tokens_per_step, m.clone()))
                })
                .collect();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            if !points.is_empty() {
                series.push(charts::Series {
                    name: fam.to_string(),
                    color: fi,
                    points,
                });
            }
        }
        panels.push((format!("T = {t}"), series));
    }
    let name = "tokens_per_step.png".to_string();
    charts::tokens_per_step_chart(&dir.join(&name), &panels)?;
    files.push(name);
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench_cmd::parse_methods;

    fn run(q: u64, cat: &str, m: &str, t: f32, tokens: u32, decode_ms: f64) -> Record {
        Record::Run(RunRecord {
            question_id: q,
            category: cat.into(),
            method: m.into(),
            temperature: t,
            nodes: if m == "target" { 1 } else { 5 },
            generated_tokens: tokens,
            steps: if m == "target" { tokens } else { tokens / 2 },
            accepted_by_rank: vec![3, 1],
            trials_by_rank: vec![4, 4],
            total_ms: decode_ms + 100.0,
            prefill_ms: 100.0,
            draft_ms: decode_ms / 4.0,
            verify_ms: decode_ms / 2.0,
            network_ms: decode_ms / 8.0,
            tokens: vec![1, 2, 3],
            ..RunRecord::default()
        })
    }

    fn records() -> Vec<Record> {
        vec![
            run(1, "qa", "target", 0.0, 10, 1000.0),
            run(1, "qa", "chain:2", 0.0, 10, 500.0),
            run(2, "math", "target", 0.0, 20, 2000.0),
            run(2, "math", "chain:2", 0.0, 20, 2000.0),
            // Incomplete group: left out.
            run(3, "math", "target", 0.0, 20, 1.0),
            run(1, "qa", "target", 0.7, 10, 1000.0),
            run(1, "qa", "chain:2", 0.7, 10, 250.0),
            Record::Run(RunRecord {
                question_id: 9,
                method: "chain:2".into(),
                error: Some("x".into()),
                ..RunRecord::default()
            }),
        ]
    }

    #[test]
    fn pooled_rates_and_same_run_speedups() {
        let methods = parse_methods(&["target".into(), "chain:2".into()]).unwrap();
        let mut recs = records();
        // Prompt-lookup nodes in the two T = 0 chain:2 runs: 3 of 5 and 1 of 4 accepted.
        for (i, (acc, sent)) in [(1, (3, 5)), (3, (1, 4))] {
            if let Record::Run(r) = &mut recs[i] {
                (r.lookup_accepted, r.lookup_proposed) = (acc, sent);
            }
        }
        let rep = build(&methods, &recs);
        assert_eq!(rep.complete_groups, 3);
        assert_eq!(rep.incomplete_groups, 1);
        assert_eq!(rep.failed_runs, 1);
        assert_eq!(rep.temperatures, vec![0.0, 0.7]);
        let c = rep.cell(0.0, "chain:2", "qa").unwrap();
        assert!((c.tokens_per_second - 20.0).abs() < 1e-9);
        assert!((c.speedup.unwrap() - 2.0).abs() < 1e-9);
        assert_eq!(c.greedy_identical, Some((1, 1)));
        // Overall pools tokens and time: (10 + 20) / (0.5 + 2.0) s = 12 vs 30 / 3 s = 10.
        let o = rep.cell(0.0, "chain:2", OVERALL).unwrap();
        assert!((o.tokens_per_second - 12.0).abs() < 1e-9);
        assert!((o.speedup.unwrap() - 1.2).abs() < 1e-9);
        assert_eq!(o.prompts, 2);
        assert!((o.tokens_per_step - 2.0).abs() < 1e-9);
        assert_eq!(o.acceptance, vec![0.75, 0.25]);
        assert_eq!((o.lookup_accepted, o.lookup_proposed), (4, 9));
        // Time split per token: draft 1/4, verify 1/2, network 1/8 of decode, overhead the rest.
        let per_tok = 2500.0 / 30.0;
        assert!((o.draft_ms_per_token - per_tok / 4.0).abs() < 1e-9);
        assert!((o.overhead_ms_per_token - per_tok / 8.0).abs() < 1e-9);
        let hot = rep.cell(0.7, "chain:2", "qa").unwrap();
        assert!((hot.speedup.unwrap() - 4.0).abs() < 1e-9);
        assert_eq!(hot.greedy_identical, None);
        assert!((rep.cell(0.0, "target", OVERALL).unwrap().speedup.unwrap() - 1.0).abs() < 1e-9);

        let md = markdown(&rep);
        assert!(md.contains("## T = 0\n"), "{md}");
        assert!(md.contains("## T = 0.7"), "{md}");
        assert!(
            md.contains("| **overall** | 2 | 10.00 | **1.20×** |"),
            "{md}"
        );
        assert!(
            md.contains(
                "| chain:2 | 5.0 | 12.00 | 1.20× | – | 2.00 | 166.7 | 0.750 | 0.250 | – | – |"
            ),
            "{md}"
        );
        assert!(md.contains("| 2/2 | 4/9 |"), "{md}");
        // Categories without results at a temperature get no row there.
        let hot = &md[md.find("## T = 0.7").unwrap()..];
        assert!(!hot.contains("| math |"), "{md}");
    }

    #[test]
    fn rows_state_the_setup_prediction_and_pipeline_counters() {
        let config = RunConfig {
            draft: "d".into(),
            target: "t".into(),
            prompts: "p".into(),
            max_tokens: 16,
            seed: 0,
            max_levels: 8,
            raw: false,
            services: "given addresses".into(),
            baseline: "b".into(),
            rtt_ms: 10.0,
            label: None,
            machine: String::new(),
            draft_cpus: Some("0".into()),
            verify_cpus: Some("1-2".into()),
            draft_threads: Some(1),
            verify_threads: Some(2),
            bandwidth_mbps: 100.0,
        };
        let mut recs = vec![Record::Config(config)];
        for (q, predicted, hits, misses) in [(1, 2.0, 3, 1), (2, 3.0, 5, 0)] {
            recs.push(run(q, "qa", "target", 0.0, 10, 1000.0));
            if let Record::Run(mut r) = run(q, "qa", "auto+pipe", 0.0, 10, 500.0) {
                r.predicted_speedup = predicted;
                r.predicted_tokens_per_step = predicted + 1.0;
                r.predicted_step_ms = 10.0 * predicted;
                r.pipeline = true;
                r.pipeline_hits = hits;
                r.pipeline_misses = misses;
                r.pipeline_wasted_ms = 1.5;
                r.first_tree_early = q == 2;
                r.first_tree_with_open = q == 2;
                r.trees_sent_ahead = 4;
                r.trees_taken_ahead = q as u32;
                recs.push(Record::Run(r));
            }
        }
        let methods = parse_methods(&["target".into(), "auto+pipe".into()]).unwrap();
        let rep = build(&methods, &recs);
        let c = rep.cell(0.0, "auto+pipe", OVERALL).unwrap();
        assert!((c.predicted_speedup.unwrap() - 2.5).abs() < 1e-12);
        // What the prediction rested on, next to what was measured: 10 tokens in 5 steps of
        // 500 ms of decode per run.
        assert!((c.predicted_tokens_per_step.unwrap() - 3.5).abs() < 1e-12);
        assert!((c.predicted_step_ms.unwrap() - 25.0).abs() < 1e-12);
        assert!((c.tokens_per_step - 2.0).abs() < 1e-12);
        assert!((c.step_ms - 100.0).abs() < 1e-12);
        assert_eq!((c.pipeline_hits, c.pipeline_misses), (Some(8), Some(1)));
        assert_eq!(c.first_trees_early, Some(1));
        assert_eq!(c.first_trees_with_open, Some(1));
        assert_eq!(
            (c.trees_taken_ahead, c.trees_sent_ahead),
            (Some(3), Some(8))
        );
        assert!((c.pipeline_wasted_ms.unwrap() - 3.0).abs() < 1e-12);
        assert_eq!(c.verify_cpus.as_deref(), Some("1-2"));
        assert_eq!((c.rtt_ms, c.bandwidth_mbps), (10.0, 100.0));
        let t = rep.cell(0.0, "target", OVERALL).unwrap();
        assert_eq!((t.predicted_speedup, t.pipeline_hits), (None, None));
        assert_eq!(t.draft_threads, Some(1), "every row states the setup");

        let json = serde_json::to_value(&rep).unwrap();
        let cells = json["cells"].as_array().unwrap();
        let target = cells.iter().find(|c| c["method"] == "target").unwrap();
        assert!(target.get("pipeline_hits").is_none());
        assert!(target["predicted_speedup"].is_null());
        assert_eq!(target["bandwidth_mbps"], 100.0);

        let md = markdown(&rep);
        assert!(
            md.contains("| auto+pipe | 5.0 | 20.00 | 2.00× | 2.50× |"),
            "{md}"
        );
        assert!(
            md.contains(
                " 8/1 (1, 1/2; 3/8) | 3.0 | draft 0 ×1 · verify 1-2 ×2 · RTT 10 ms · 100 Mbit/s |"
            ),
            "{md}"
        );
        assert!(md.contains("100 Mbit/s per direction"), "{md}");
    }

    #[test]
    fn without_a_target_method_rates_are_shown() {
        let methods = parse_methods(&["chain:2".into()]).unwrap();
        let recs: Vec<Record> = records()
            .into_iter()
            .filter(|r| !matches!(r, Record::Run(r) if r.method == "target"))
            .collect();
        let rep = build(&methods, &recs);
        assert!(rep.cells.iter().all(|c| c.speedup.is_none()));
        assert!(markdown(&rep).contains("tok/s"));
    }

    #[test]
    fn reports_and_charts_are_written() {
        let dir = tempfile::tempdir().unwrap();
        let args = {
            use clap::Parser;
            #[derive(clap::Parser)]
            struct W {
                #[command(flatten)]
                a: BenchArgs,
            }
            W::parse_from([
                "x",
                "--out-dir",
                dir.path().to_str().unwrap(),
                "--methods",
                "target,chain:2",
            ])
            .a
        };
        let methods = parse_methods(&args.methods).unwrap();
        write_reports(&args, &methods, &records()).unwrap();
        for f in ["report.json", "report.md"] {
            assert!(dir.path().join(f).exists(), "{f}");
        }
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.path().join("report.json")).unwrap())
                .unwrap();
        assert_eq!(v["complete_groups"], 3);
        // Charts need a TTF font on the machine; without one they are skipped with a warning.
        if charts::ensure_font().is_ok() {
            for f in ["speedup_T0.png", "speedup_T0.7.png", "tokens_per_step.png"] {
                let bytes = std::fs::read(dir.path().join(f)).unwrap();
                assert_eq!(&bytes[..4], b"\x89PNG", "{f}");
            }
        }
    }
}
