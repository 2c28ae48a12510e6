//! `sequoia tree measure-acceptance`: run a draft/target pair locally over a prompt file
//! (Spec-Bench JSONL) and measure the acceptance vector (docs/ALGORITHMS.md §6), overall and by depth.
//!
//! Each step drafts a "spine" tree: W children at every level along the rank-1 path, D levels
//! deep, so every rank is tried at every depth the accepted path reaches. The target verifies
//! it with the same exact rule the services use.

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use sequoia_core::sampling::{SamplingParams, SessionRng, VERIFY_STREAM};
use sequoia_core::stats::AcceptanceCounts;
use sequoia_core::tree::Tree;
use sequoia_core::verify::{verify_with_logits, Step};
use sequoia_engine::drafting::DraftSession;
use sequoia_engine::tokenizer::{ChatMessage, TextTokenizer};
use sequoia_engine::{LoadOptions, Model};
use serde::Serialize;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct MeasureArgs {
    #[arg(long, default_value = sequoia_models::QWEN_CODER_0_5B)]
    pub draft: String,
    #[arg(long, default_value = sequoia_models::QWEN_CODER_1_5B)]
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
    /// Token ids the draft's LM head scores (draft-service's `draft_vocab`; 0 = all).
    #[arg(long, default_value_t = 0)]
    pub draft_vocab: usize,
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
    draft_vocab: usize,
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
    let shape = Tree::spine(args.width, args.depth);
    let levels = args.depth + 1;
    let mut counts = AcceptanceCounts::default();
    let mut rep = Report {
        temperature: args.temperature,
        top_p: args.top_p,
        width: args.width,
        depth: args.depth,
        prompts: prompts.len(),
        draft: draft_path.display().to_string(),
        target: target_path.display().to_string(),
        draft_vocab: args.draft_vocab,
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
        let mut ds = DraftSession::new(&draft, prefix, params, seed, args.wire_top_k)?
            .with_head_vocab(&draft, args.draft_vocab);
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
            let emitted = verdict.emitted(&drafted.tokens);
            counts.record_step(
                tree,
                &verdict.accepted,
                verdict.ranks.iter().copied(),
                emitted.len(),
            );
            produced += emitted.len();
            root = verdict.next_token;
            if emitted.iter().any(|&t| tok.is_eos(t))
                || cache.len() + shape.len() + 1 >= cache.capacity()
            {
                break;
            }
        }
        bar.set_message(format!("p1 so far {:.3}", counts.by_rank().rates(1)[0]));
        bar.inc(1);
    }
    bar.finish();
    // The spine has `width` ranks at each of `levels` depths; pad what was never reached.
    let row = |d: usize| {
        let mut r = counts.by_depth.get(d).cloned().unwrap_or_default();
        r.accepted.resize(args.width, 0);
        r.trials.resize(args.width, 0);
        r
    };
    rep.accepted_by_depth = (0..levels).map(|d| row(d).accepted).collect();
    rep.trials_by_depth = (0..levels).map(|d| row(d).trials).collect();
    rep.by_depth = (0..levels).map(|d| row(d).rates(args.width)).collect();
    rep.acceptance = counts.acceptance_vector(args.width);
    rep.steps = counts.steps;
    rep.tokens = counts.tokens;
    rep.mean_tokens_per_step = counts.tokens_per_step();
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

fn fmt(v: &[f64]) -> String {
    v.iter()
        .map(|x| format!("{x:.3}"))
        .collect::<Vec<_>>()
        .join(", ")
}
