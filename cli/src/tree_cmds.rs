//! `sequoia tree ...`: plan Sequoia trees from an acceptance vector and time the DP.

use anyhow::{bail, Context, Result};
use sequoia_shared::planner::{self, SequoiaDp};
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// Acceptance vector p_1,p_2,... (probability that the r-th child is the accepted one).
    #[arg(long, value_delimiter = ',', conflicts_with = "acceptance_file")]
    pub acceptance: Option<Vec<f64>>,
    /// JSON file with the acceptance vector: an array, or an object with an "acceptance" array.
    #[arg(long)]
    pub acceptance_file: Option<PathBuf>,
    /// Node budget (root included).
    #[arg(long, default_value_t = 64)]
    pub nodes: usize,
    /// Maximum levels, root included (default: unlimited, i.e. 64).
    #[arg(long)]
    pub max_depth: Option<usize>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    #[arg(long, default_value_t = 1024)]
    pub nodes: usize,
    /// Ranks considered (the acceptance vector is the ALGORITHMS.md §2 example, cut or padded).
    #[arg(long, default_value_t = 32)]
    pub width: usize,
    #[arg(long, default_value_t = 20)]
    pub levels: usize,
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
}

/// Read an acceptance vector from flags or a file.
pub fn load_acceptance(inline: &Option<Vec<f64>>, file: &Option<PathBuf>) -> Result<Vec<f64>> {
    if let Some(p) = inline {
        return Ok(p.clone());
    }
    let Some(path) = file else {
        bail!("give the acceptance vector with --acceptance 0.6,0.1,... or --acceptance-file F");
    };
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    let array = match &value {
        serde_json::Value::Object(o) => o.get("acceptance").cloned().unwrap_or_default(),
        v => v.clone(),
    };
    serde_json::from_value(array).with_context(|| {
        format!(
            "{}: expected a JSON array of numbers (or {{\"acceptance\": [...]}})",
            path.display()
        )
    })
}

pub fn plan(args: &PlanArgs) -> Result<()> {
    let p = load_acceptance(&args.acceptance, &args.acceptance_file)?;
    if args.nodes == 0 || args.nodes > 4096 {
        bail!("--nodes must be in 1..=4096, got {}", args.nodes);
    }
    let plan = planner::plan(&p, args.nodes, args.max_depth)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
        return Ok(());
    }
    let tree = sequoia_shared::tree::Tree::from_parents_limited(
        &plan.parents,
        sequoia_shared::tree::TreeLimits {
            max_nodes: usize::MAX,
            max_levels: usize::MAX,
        },
    )?;
    println!(
        "Sequoia tree: {} nodes, {} levels, expected tokens per step {:.4}",
        plan.nodes, plan.levels, plan.expected_tokens
    );
    println!("level widths: {:?}", plan.widths);
    println!(
        "baselines at the same budget: best chain ({}, {} nodes) {:.4}; best k×d ({}, {} nodes) {:.4}",
        plan.baselines.chain.name,
        plan.baselines.chain.nodes,
        plan.baselines.chain.expected_tokens,
        plan.baselines.k_by_d.name,
        plan.baselines.k_by_d.nodes,
        plan.baselines.k_by_d.expected_tokens
    );
    println!();
    print!("{}", tree.draw());
    Ok(())
}

pub fn bench(args: &BenchArgs) -> Result<()> {
    let mut p: Vec<f64> = planner::EXAMPLE_ACCEPTANCE
        .iter()
        .copied()
        .take(args.width)
        .collect();
    while p.len() < args.width {
        p.push(0.0005);
    }
    let total: f64 = p.iter().sum();
    if total > 1.0 {
        p.iter_mut().for_each(|x| *x /= total);
    }
    let mut times = Vec::new();
    let mut g = 0.0;
    for _ in 0..args.repeats.max(1) {
        let t0 = Instant::now();
        let dp = SequoiaDp::solve(&p, args.nodes, args.levels)?;
        let tree = dp.tree(args.nodes, args.levels);
        times.push(t0.elapsed().as_secs_f64());
        g = dp.expected(args.nodes, args.levels);
        std::hint::black_box(tree);
    }
    times.sort_by(f64::total_cmp);
    println!(
        "DP n={} W={} L={}: median {:.3} s over {} runs (min {:.3} s); best G = {:.4}",
        args.nodes,
        args.width,
        args.levels,
        times[times.len() / 2],
        times.len(),
        times[0],
        g
    );
    Ok(())
}
