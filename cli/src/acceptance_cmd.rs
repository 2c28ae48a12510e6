//! `sequoia tree measure-acceptance`: run a draft/target pair locally over a prompt file
//! (Spec-Bench JSONL) and measure the acceptance vector (ALGORITHMS.md §6), overall and by depth.
//!
//! Each step drafts a "spine" tree: W children at every level along the rank-1 path, D levels
//! deep, so every rank is tried at every depth the accepted path reaches. The target verifies
//! it with the same exact rule the services use.

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use sequoia_shared::drafting::DraftSession;
use sequoia_shared::engine::{LoadOptions, Model};
use sequoia_shared::sampling::{SamplingParams, SessionRng, VERIFY_STREAM};
use sequoia_shared::tokenizer::{ChatMessage, TextTokenizer};
use sequoia_shared::tree::Tree;
use sequoia_shared::verify::{verify_with_logits, Step};
use serde::Serialize;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct MeasureArgs {
    #[arg(long, default_value = sequoia_shared::models::QWEN_CODER_0_5B)]
    pub draft: String,
    #[arg(long, default_value = sequoia_shared::models::QWEN_CODER_1_5B)]
    pub target: String,
    /// JSONL prompts with a `turns` list (Spec-Bench / MT-Bench format); the first turn is used.
    #[arg(long)]
    pub prompts: PathBuf,
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Children tried per level (ranks measured).
    #[arg(long, default_value_t = 8)]
    pub width: usize,
    /// Levels below the root along the spine.
    #[arg(long, default_value_t = 4)]
    pub depth: usize,
    /// Use at most this many prompts (spread over the file's categories in file order).
    #[arg(long, default_value_t = 20)]
    pub max_prompts: usize,
    /// New tokens per prompt.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Draft-distribution entries kept (the q the draft samples from).
    #[arg(long, default_value_t = 64)]
    pub wire_top_k: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long)]
    pub threads: Option<usize>,
    /// Write the result JSON here (what `tree plan --acceptance-file` reads).
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(Serialize, Default)]
struct Report {
    /// p_r overall: what `tree plan` and the draft-service config take.
    acceptance: Vec<f64>,
    /// p_r at each depth of the verified node (0 = root).
    by_depth: Vec<Vec<f64>>,
    trials_by_depth: Vec<Vec<u64>>,
    accepted_by_depth: Vec<Vec<u64>>,
    temperature: f32,
    top_p: f32,
    width: usize,
    depth: usize,
    prompts: usize,
    steps: u64,
    tokens: u64,
    mean_tokens_per_step: f64,
    draft: String,
    target: String,
}

fn spine(width: usize, depth: usize) -> Tree {
    let mut parents = vec![-1i32];
    let mut head = 0i32;
    for _ in 0..depth {
        let first = parents.len() as i32;
        parents.extend(std::iter::repeat_n(head, width));
        head = first;
    }
    Tree::from_parents_limited(
        &parents,
        sequoia_shared::tree::TreeLimits {
            max_nodes: usize::MAX,
            max_levels: usize::MAX,
        },
    )
    .expect("a spine is a valid tree")
}

fn first_turns(path: &PathBuf, max: usize) -> Result<Vec<String>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not JSON", path.display(), i + 1))?;
        let Some(turn) = v
            .get("turns")
            .and_then(|t| t.get(0))
            .and_then(|t| t.as_str())
        else {
            bail!("{}:{}: no \"turns\" list of strings", path.display(), i + 1);
        };
        out.push(turn.to_string());
    }
    if out.is_empty() {
        bail!("{} has no prompts", path.display());
    }
    // Spread the sample over the whole file (its categories come in blocks).
    let step = (out.len() / max.max(1)).max(1);
    Ok(out.into_iter().step_by(step).take(max).collect())
}

pub fn measure(args: &MeasureArgs) -> Result<()> {
    let params = SamplingParams {
        temperature: args.temperature,
        top_k: 0,
        top_p: args.top_p,
    };
    params.validate()?;
    if args.width == 0 || args.depth == 0 {
        bail!("--width and --depth must be at least 1");
    }
    let prompts = first_turns(&args.prompts, args.max_prompts)?;
    let target_path = crate::engine_cmds::resolve_model(&args.target)?;
    let draft_path = crate::engine_cmds::resolve_model(&args.draft)?;
    let opts = LoadOptions {
        threads: args.threads,
        ..LoadOptions::default()
    };
    let target = Model::load(&target_path, &opts)?;
    let draft = Model::load(&draft_path, &opts)?;
    let tok = TextTokenizer::load_for_model(&target_path)?;
    let shape = spine(args.width, args.depth);
    let levels = args.depth + 1;
    let mut rep = Report {
        trials_by_depth: vec![vec![0; args.width]; levels],
        accepted_by_depth: vec![vec![0; args.width]; levels],
        temperature: args.temperature,
        top_p: args.top_p,
        width: args.width,
        depth: args.depth,
        prompts: prompts.len(),
        draft: draft_path.display().to_string(),
        target: target_path.display().to_string(),
        ..Report::default()
    };
    let bar = ProgressBar::new(prompts.len() as u64);
    bar.set_style(ProgressStyle::with_template(
        "{bar:30} {pos}/{len} prompts, {msg} [{elapsed_precise}, eta {eta}]",
    )?);
    for (i, prompt) in prompts.iter().enumerate() {
        let text = tok.apply_chat_template(&[ChatMessage::user(prompt.clone())], true)?;
        let ids = tok.encode(&text, false)?;
        let (prefix, mut root) = (&ids[..ids.len() - 1], ids[ids.len() - 1]);
        let seed = args.seed.wrapping_add(i as u64);
        let mut ds = DraftSession::new(&draft, prefix, params, seed, args.wire_top_k)?;
        let mut cache = target.new_cache();
        target.forward_chain_last(&mut cache, prefix)?;
        let mut rng = SessionRng::new(seed, VERIFY_STREAM);
        let mut produced = 0usize;
        while produced < args.max_tokens {
            let drafted = ds.grow(&draft, root, &shape)?;
            let tree = &drafted.tree;
            let logits = target.forward_tree(&mut cache, &drafted.tokens, tree)?;
            let step = Step::new(
                tree,
                &drafted.tokens,
                &drafted.dists,
                target.info().vocab_size,
                !params.is_greedy(),
            )?;
            let verdict = verify_with_logits(&step, |v| logits.row(v), &params, &mut rng);
            let mut keep = vec![0];
            keep.extend(&verdict.accepted);
            cache.keep_newest(tree.len(), &keep)?;
            ds.commit(&drafted, &verdict.accepted)?;
            // Every verified node with c children is a trial for ranks 1..=c at its depth.
            for (k, &v) in keep.iter().enumerate() {
                let c = tree.children(v).len().min(args.width);
                let d = tree.depth(v);
                for r in 0..c {
                    rep.trials_by_depth[d][r] += 1;
                }
                if let Some(&rank) = verdict.ranks.get(k) {
                    rep.accepted_by_depth[d][rank - 1] += 1;
                }
            }
            rep.steps += 1;
            let emitted = verdict.emitted(&drafted.tokens);
            produced += emitted.len();
            rep.tokens += emitted.len() as u64;
            root = verdict.next_token;
            if emitted.iter().any(|&t| tok.is_eos(t))
                || cache.len() + shape.len() + 1 >= cache.capacity()
            {
                break;
            }
        }
        bar.set_message(format!(
            "p1 so far {:.3}",
            ratio(
                rep.accepted_by_depth.iter().map(|a| a[0]).sum(),
                rep.trials_by_depth.iter().map(|t| t[0]).sum()
            )
        ));
        bar.inc(1);
    }
    bar.finish();
    let total = |m: &Vec<Vec<u64>>, r: usize| m.iter().map(|row| row[r]).sum::<u64>();
    rep.acceptance = (0..args.width)
        .map(|r| {
            ratio(
                total(&rep.accepted_by_depth, r),
                total(&rep.trials_by_depth, r),
            )
        })
        .collect();
    // Nodes where q had fewer than W tokens tried fewer ranks, which can push the sum over 1.
    let sum: f64 = rep.acceptance.iter().sum();
    if sum > 1.0 {
        rep.acceptance.iter_mut().for_each(|p| *p /= sum);
    }
    rep.by_depth = rep
        .accepted_by_depth
        .iter()
        .zip(&rep.trials_by_depth)
        .map(|(a, t)| a.iter().zip(t).map(|(&a, &t)| ratio(a, t)).collect())
        .collect();
    rep.mean_tokens_per_step = rep.tokens as f64 / rep.steps.max(1) as f64;
    let json = serde_json::to_string_pretty(&rep)?;
    std::fs::write(&args.out, &json).with_context(|| format!("writing {}", args.out.display()))?;
    println!("acceptance (overall): {}", fmt(&rep.acceptance));
    for (d, row) in rep.by_depth.iter().enumerate().take(args.depth) {
        println!(
            "  depth {d}: {} ({} trials of rank 1)",
            fmt(row),
            rep.trials_by_depth[d][0]
        );
    }
    println!(
        "{} steps, {:.2} tokens/step with a {}x{} spine; wrote {}",
        rep.steps,
        rep.mean_tokens_per_step,
        args.width,
        args.depth,
        args.out.display()
    );
    Ok(())
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

fn fmt(v: &[f64]) -> String {
    v.iter()
        .map(|x| format!("{x:.3}"))
        .collect::<Vec<_>>()
        .join(", ")
}
