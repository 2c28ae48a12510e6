//! Measuring the costs the planner needs on the machine at hand: target forward time over trees
//! of n nodes, t_v(n), and draft forward time over one level of w nodes, t_d(w), each at a
//! working context length (the fastest of a few repeats). The verify node runs the first
//! (`Profile` RPC), the draft node the second; `sequoia tree profile` runs both locally.

use crate::{EngineError, Model};
use sequoia_core::planner::{SequoiaDp, EXAMPLE_ACCEPTANCE};
use sequoia_core::tree::Tree;
use std::time::Instant;

/// Sizes measured by default (nodes per tree, or nodes per level).
pub const DEFAULT_SIZES: [u32; 10] = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32];

/// Fastest milliseconds of one forward over a tree of each size, after `context` committed
/// tokens. `shape(n)` gives the tree measured for size n; the LM head scores token ids
/// `0..head_vocab` (the model's whole vocabulary, or a pruned draft's).
pub fn measure_forward(
    model: &Model,
    sizes: &[u32],
    context: usize,
    repeats: usize,
    shape: impl Fn(usize) -> Tree,
    head_vocab: usize,
) -> Result<Vec<f64>, EngineError> {
    let all = measure_forward_while(model, sizes, context, repeats, shape, head_vocab, &|| true)?;
    Ok(all.unwrap_or_default()) // `go_on` never says no here
}

/// [`measure_forward`] that asks `go_on` before every forward and returns `None` as soon as it
/// says no (the caller went away or ran out of time), so a long profile can be stopped.
pub fn measure_forward_while(
    model: &Model,
    sizes: &[u32],
    context: usize,
    repeats: usize,
    shape: impl Fn(usize) -> Tree,
    head_vocab: usize,
    go_on: &dyn Fn() -> bool,
) -> Result<Option<Vec<f64>>, EngineError> {
    let vocab = model.info().vocab_size as u32;
    let mut cache = model.new_cache();
    // Deterministic filler tokens spread over the vocabulary.
    let filler: Vec<u32> = (0..context as u32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();
    if !filler.is_empty() {
        model.forward_chain(&mut cache, &filler)?;
    }
    // One untimed forward warms caches and thread pools.
    model.forward_tree(&mut cache, &[1 % vocab], &Tree::chain(1))?;
    cache.truncate(context);
    let trees: Vec<(Tree, Vec<u32>, Vec<usize>)> = sizes
        .iter()
        .map(|&n| {
            let tree = shape(n as usize);
            let tokens: Vec<u32> = (0..tree.len() as u32)
                .map(|i| (i * 104_729 + 7) % vocab)
                .collect();
            let rows: Vec<usize> = (0..tree.len()).collect();
            (tree, tokens, rows)
        })
        .collect();
    // Round-robin over the sizes, not all repeats of one size and then the next: the machine's
    // speed drifts over seconds (other tenants, clocks), and what the planner needs most is the
    // curve's shape, t(n) against t(1), which a slow spell would bend if it hit only some sizes.
    let mut times = vec![Vec::with_capacity(repeats.max(1)); sizes.len()];
    for _ in 0..repeats.max(1) {
        for ((tree, tokens, rows), t) in trees.iter().zip(&mut times) {
            if !go_on() {
                return Ok(None);
            }
            let t0 = Instant::now();
            model.forward_tree_extend(&mut cache, tokens, tree, 0, rows, head_vocab)?;
            t.push(t0.elapsed().as_secs_f64() * 1e3);
            cache.truncate(context);
        }
    }
    // The fastest of the repeats: the work is the same every time, so anything slower was
    // slowed from outside (other tenants, the memory bus). A median of three forwards was
    // itself off by up to 25 % here (t(1) of 84, 105 and 92 ms in three back-to-back profiles
    // on one core of a shared host), and a t_v(1) priced 25 % high makes every tree look 25 %
    // better against plain decoding than it is. What runs slower than this in service the
    // planner's drift factors learn (docs/ALGORITHMS.md §5.4).
    Ok(Some(
        times
            .into_iter()
            .map(|t| t.into_iter().fold(f64::INFINITY, f64::min))
            .collect(),
    ))
}

/// t_v(n): Sequoia-shaped trees, as the target will see them.
pub fn measure_verify(
    model: &Model,
    sizes: &[u32],
    context: usize,
    repeats: usize,
) -> Result<Vec<f64>, EngineError> {
    let all = measure_verify_while(model, sizes, context, repeats, &|| true)?;
    Ok(all.unwrap_or_default()) // `go_on` never says no here
}

/// [`measure_verify`] that stops (returning `None`) once `go_on` says no.
pub fn measure_verify_while(
    model: &Model,
    sizes: &[u32],
    context: usize,
    repeats: usize,
    go_on: &dyn Fn() -> bool,
) -> Result<Option<Vec<f64>>, EngineError> {
    let largest = sizes.iter().copied().max().unwrap_or(1) as usize;
    let dp = SequoiaDp::solve(&EXAMPLE_ACCEPTANCE, largest.max(1), 16)
        .expect("the example vector is valid");
    let vocab = model.info().vocab_size;
    measure_forward_while(
        model,
        sizes,
        context,
        repeats,
        |n| dp.tree(n, 16),
        vocab,
        go_on,
    )
}

/// t_d(w): one level of w siblings (a star of w − 1 children under a root stands in for it),
/// with the draft's LM head over `head_vocab` tokens.
pub fn measure_draft(
    model: &Model,
    sizes: &[u32],
    context: usize,
    repeats: usize,
    head_vocab: usize,
) -> Result<Vec<f64>, EngineError> {
    measure_forward(
        model,
        sizes,
        context,
        repeats,
        |w| Tree::star(w.saturating_sub(1)),
        head_vocab,
    )
}
