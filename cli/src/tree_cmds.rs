//! `sequoia tree ...`: plan Sequoia trees from an acceptance vector and time the DP.

use anyhow::{bail, Context, Result};
use sequoia_core::planner::{self, SequoiaDp};
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
    /// Planner profile (from `sequoia tree profile`): choose the size too, from measured costs.
    /// --nodes is then the largest tree considered.
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// With --profile: draft-distribution entries sent per expanded node (0 at temperature 0).
    #[arg(long, default_value_t = 0)]
    pub q_entries: usize,
}

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    #[arg(long, default_value_t = 1024)]
    pub nodes: usize,
    /// Ranks considered (the acceptance vector is the docs/ALGORITHMS.md §2 example, cut or padded).
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
    if let Some(profile) = &args.profile {
        return plan_with_profile(args, profile);
    }
    let p = load_acceptance(&args.acceptance, &args.acceptance_file)?;
    if args.nodes == 0 || args.nodes > 4096 {
        bail!("--nodes must be in 1..=4096, got {}", args.nodes);
    }
    let plan = planner::plan(&p, args.nodes, args.max_depth)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
        return Ok(());
    }
    let tree = sequoia_core::tree::Tree::from_parents_limited(
        &plan.parents,
        sequoia_core::tree::TreeLimits {
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

#[derive(clap::Args, Debug)]
pub struct ProfileArgs {
    /// Draft model (path or default name).
    #[arg(long, default_value = sequoia_models::QWEN_CODER_0_5B)]
    pub draft: String,
    /// Target model (path or default name).
    #[arg(long, default_value = sequoia_models::QWEN_CODER_1_5B)]
    pub target: String,
    /// Context length to measure at.
    #[arg(long, default_value_t = 128)]
    pub context: usize,
    /// Largest tree size measured.
    #[arg(long, default_value_t = 32)]
    pub max_nodes: u32,
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Round-trip time to assume between draft and verify node, ms.
    #[arg(long, default_value_t = 0.2)]
    pub rtt_ms: f64,
    /// Bandwidth to assume, Mbit/s.
    #[arg(long, default_value_t = 10_000.0)]
    pub bandwidth_mbps: f64,
    /// Price trees drafted after their verdict as a verify node that decodes while waiting
    /// serves them (the verify-service default, `decode_while_waiting`; docs/ALGORITHMS.md
    /// §10). Off: every tree at its whole forward.
    #[arg(long)]
    pub decodes_while_waiting: bool,
    #[arg(long)]
    pub threads: Option<usize>,
    /// Tokens the draft's LM head scores (draft-service's `draft_vocab`; 0 = all).
    #[arg(long, default_value_t = 0)]
    pub draft_vocab: usize,
    /// --draft and --target name shapes (qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, qwen2.5-14b;
    /// the default Coder names are the same shapes) with random weights made in memory: no
    /// download, for machines without network access. Costs depend on shapes, not values.
    #[arg(long)]
    pub random_weights: bool,
    /// Weight format with --random-weights: q4_k_m or q8_0.
    #[arg(long, default_value = "q4_k_m")]
    pub random_format: String,
    /// Run both models on the first CUDA device.
    #[arg(long)]
    pub cuda: bool,
    /// Write the profile JSON here (printed to stdout too).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// Measure t_v(n) and t_d(w) on this machine and write a planner profile.
pub fn profile(args: &ProfileArgs) -> Result<()> {
    use sequoia_core::planner::cost::{CostCurve, NetworkProfile, Profile};
    use sequoia_engine::profiling::{measure_draft, measure_verify, DEFAULT_SIZES};
    use sequoia_engine::{LoadOptions, Model};
    let opts = LoadOptions {
        threads: args.threads,
        cuda: args.cuda,
        ..LoadOptions::default()
    };
    // Past the default sizes (up to 32) for accelerators, where large trees cost little more.
    let sizes: Vec<u32> = DEFAULT_SIZES
        .iter()
        .copied()
        .chain([48, 64, 96, 128, 192, 256])
        .filter(|&n| n <= args.max_nodes)
        .collect();
    let load = |name: &str| -> Result<(Model, String)> {
        if args.random_weights {
            let m = crate::engine_cmds::load_random(
                name,
                &args.random_format,
                args.threads,
                args.cuda,
                opts.max_context,
            )?;
            Ok((m, format!("random {name} ({})", args.random_format)))
        } else {
            let path = crate::engine_cmds::resolve_model(name)?;
            let m = Model::load(&path, &opts)?;
            Ok((m, path.display().to_string()))
        }
    };
    eprintln!(
        "measuring target t_v(n) for n in {sizes:?} at context {}",
        args.context
    );
    let (target, target_name) = load(&args.target)?;
    let device = target.info().device.clone();
    let tv = measure_verify(&target, &sizes, args.context, args.repeats)?;
    drop(target);
    let widths: Vec<u32> = sizes.iter().copied().filter(|&w| w <= 16).collect();
    eprintln!("measuring draft t_d(w) for w in {widths:?}");
    let (draft, draft_name) = load(&args.draft)?;
    let head = sequoia_engine::drafting::head_vocab(&draft, args.draft_vocab);
    let td = measure_draft(&draft, &widths, args.context, args.repeats, head)?;
    let profile = Profile {
        verify: CostCurve::new(sizes, tv)?,
        draft: CostCurve::new(widths, td)?,
        network: NetworkProfile {
            rtt_ms: args.rtt_ms,
            bytes_per_ms: args.bandwidth_mbps * 125.0,
        },
        overhead_ms: 0.5,
        step_extra_ms: 0.0,
        sends_ahead: false,
        ahead_candidates: 0,
        decodes_while_waiting: args.decodes_while_waiting,
        lookup: Default::default(),
        drafted_scale: 1.0,
        context: args.context,
        note: format!(
            "target {target_name}, draft {draft_name}, on {device}, threads {}",
            sequoia_engine::current_threads()
        ),
    };
    let json = serde_json::to_string_pretty(&profile)?;
    println!("{json}");
    if let Some(out) = &args.out {
        std::fs::write(out, &json).with_context(|| format!("writing {}", out.display()))?;
        eprintln!("wrote {}", out.display());
    }
    Ok(())
}

/// Load and check a profile file.
pub fn load_profile(path: &std::path::Path) -> Result<sequoia_core::planner::cost::Profile> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let p: sequoia_core::planner::cost::Profile = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a planner profile", path.display()))?;
    p.validate()?;
    Ok(p)
}

/// `tree plan --profile`: the planner's choice from measured costs.
pub fn plan_with_profile(args: &PlanArgs, path: &std::path::Path) -> Result<()> {
    use sequoia_core::planner::cost::choose;
    let p = load_acceptance(&args.acceptance, &args.acceptance_file)?;
    let profile = load_profile(path)?;
    let levels = args.max_depth.unwrap_or(16);
    let plan = choose(&profile, &p, args.nodes, levels, args.q_entries)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
        return Ok(());
    }
    let b = &plan.best;
    if plan.speculate {
        println!("chosen tree: {} nodes, {} levels", b.nodes, b.levels);
    } else {
        println!("no tree pays for itself here: plain decoding (root only)");
    }
    // On a node that decodes while waiting the tree costs less than its forward on arrival
    // (docs/ALGORITHMS.md §10).
    let verify = if b.arrival_verify_ms < b.verify_ms {
        format!(
            "{:.1} (decoding while waiting; its whole forward {:.1})",
            b.arrival_verify_ms, b.verify_ms
        )
    } else {
        format!("{:.1}", b.verify_ms)
    };
    println!(
        "predicted tokens/step {:.3}; step {:.1} ms = draft {:.1} + network {:.1} + verify {verify} + overhead {:.1}; speedup {:.2}x over target-only (t_v(1) = {:.1} ms)",
        b.expected_tokens, b.step_ms, b.draft_ms.max(0.0), b.network_ms, b.overhead_ms, b.speedup, profile.verify.at(1)
    );
    let mut ranked: Vec<_> = plan.by_size.iter().collect();
    ranked.sort_by(|a, c| c.speedup.total_cmp(&a.speedup));
    println!("runners-up:");
    for r in ranked.iter().skip(1).take(5) {
        println!(
            "  {:>3} nodes {:>2} levels: tokens/step {:.3}, step {:.1} ms, speedup {:.2}x",
            r.nodes, r.levels, r.expected_tokens, r.step_ms, r.speedup
        );
    }
    let tree = sequoia_core::tree::Tree::from_parents_limited(
        &b.parents,
        sequoia_core::tree::TreeLimits {
            max_nodes: usize::MAX,
            max_levels: usize::MAX,
        },
    )?;
    println!();
    print!("{}", tree.draw());
    Ok(())
}
