//! The draft side of one generation: the draft model's KV cache, growing a token tree level by
//! level (docs/ALGORITHMS.md §3), and following the verifier's verdict. Plain library code with no
//! networking: draft-service runs it against remote verify nodes, `sequoia tree
//! measure-acceptance` against a local target.

mod pipeline;

pub use pipeline::{likeliest_hits, Speculation, SpeculationOutcome};

use crate::{EngineError, KvCache, Logits, Model};
use sequoia_core::sampling::{
    draft_tree_stream, greedy_top_k, probs_from_logits, sample_without_replacement, SamplingParams,
    SessionRng, SparseDist,
};
use sequoia_core::tree::{Tree, TreeLimits};
use std::sync::atomic::{AtomicBool, Ordering};

/// A drafted tree ready to send: shape, tokens, and q for every expanded node (empty at T = 0).
#[derive(Debug, Clone)]
pub struct DraftedTree {
    pub tree: Tree,
    pub tokens: Vec<u32>,
    pub dists: Vec<SparseDist>,
    /// Nodes 0..forwarded of the tree as drafted went through the draft model (and sit in its
    /// cache); deeper leaves did not need to.
    forwarded: usize,
    /// origin[v] = node v's index in the tree as drafted; None for a prompt-lookup node.
    origin: Vec<Option<usize>>,
    /// The tree as the draft model grew it (before lookup branches were grafted on), and its
    /// tokens.
    drafted: Tree,
    drafted_tokens: Vec<u32>,
    /// Committed tokens before the root: the position the tree was grown at.
    position: usize,
    /// Grown ahead by pipelined drafting and taken over when the verdict confirmed its
    /// assumption, rather than grown after the verdict.
    resumed: bool,
    /// Per node of the tree as drafted: its token's draft probability at its parent (1 for the
    /// root), and, for a node the draft expanded, the probability of its likeliest token that
    /// is not one of its children (NaN where not expanded). What pipelined drafting ranks its
    /// candidate verdicts by (docs/ALGORITHMS.md §10).
    confidence: Vec<f32>,
    runner_up: Vec<f32>,
}

impl DraftedTree {
    /// Graft a prompt-lookup continuation below the root (docs/ALGORITHMS.md §9); returns the
    /// number of nodes added. Only at T = 0 (no q's): lookup nodes carry no draft distribution,
    /// and the T > 0 rule for them is not implemented yet, so there this adds nothing.
    pub fn graft_lookup(&mut self, chain: &[u32]) -> usize {
        if !self.dists.is_empty() || chain.is_empty() {
            return 0;
        }
        let g = self.tree.graft_chain(&self.tokens, chain);
        let added = g.added.len();
        self.origin = g
            .origin
            .iter()
            .map(|o| o.and_then(|o| self.origin[o]))
            .collect();
        self.tree = g.tree;
        self.tokens = g.tokens;
        added
    }

    /// Nodes that came from prompt lookup rather than the draft model.
    pub fn is_lookup(&self, v: usize) -> bool {
        self.origin.get(v).is_some_and(|o| o.is_none())
    }

    /// The tree as the draft model grew it, and the part of an accepted path (indices of the
    /// sent tree, checked) that runs through it, in its indices: what the draft's acceptance
    /// statistics count. A path that continues into a lookup branch rejected every drafted
    /// child of the node it left from.
    pub fn drafted_path(&self, accepted: &[usize]) -> (&Tree, Vec<usize>) {
        let path = accepted
            .iter()
            .map_while(|&v| self.origin.get(v).copied().flatten())
            .collect();
        (&self.drafted, path)
    }

    /// The `n` nodes of the tree as drafted whose verdicts pipelined drafting most likely
    /// guesses right (docs/ALGORITHMS.md §10): the candidates it grows the next tree for.
    /// `p`: the acceptance vector, whose rank-1 rate stands for the chance that the draft's
    /// likeliest token at a node it did not expand is the target's.
    pub fn likeliest_ends(&self, p: &[f64], n: usize) -> Vec<usize> {
        let top = p.first().copied().unwrap_or(0.0);
        likeliest_hits(&self.drafted, &self.confidence, &self.runner_up, top, n)
    }

    /// The verdict that ends at node `end` of the tree as drafted (a pipelined candidate's end,
    /// [`Speculation::candidates`]): its accepted nodes in indices of the tree as sent (root
    /// excluded) and their tokens. None if `end` is out of range.
    pub fn path_to_drafted(&self, end: usize) -> Option<(Vec<usize>, Vec<u32>)> {
        if end >= self.drafted.len() {
            return None;
        }
        let mut sent = Vec::new();
        let mut tokens = Vec::new();
        for d in self.drafted.path_to(end).into_iter().skip(1) {
            sent.push(self.origin.iter().position(|&o| o == Some(d))?);
            tokens.push(self.drafted_tokens[d]);
        }
        Some((sent, tokens))
    }

    /// Nodes 0..forwarded() went through the draft model; 0 for a root-only tree.
    pub fn forwarded(&self) -> usize {
        self.forwarded
    }

    /// Whether pipelined drafting had grown this tree (or its first levels) before the verdict
    /// that made it the next tree arrived.
    pub fn was_drafted_ahead(&self) -> bool {
        self.resumed
    }
}

/// Why a verdict cannot be applied to the tree it answers.
#[derive(Debug, thiserror::Error)]
pub enum DraftError {
    #[error("verdict does not fit the tree: {0}")]
    BadVerdict(String),
    #[error(transparent)]
    Engine(#[from] EngineError),
}

pub struct DraftSession {
    cache: KvCache,
    /// Committed tokens the draft model has not processed yet. They are run lazily, right
    /// before the next tree that needs the draft, so a root-only plan (no speculation) never
    /// spends draft compute.
    pending: Vec<u32>,
    /// Each tree samples from its own stream, derived from the seed and the tree's position,
    /// so a tree grown ahead by pipelining draws exactly what it would have drawn afterwards.
    seed: u64,
    params: SamplingParams,
    wire_top_k: usize,
    /// The LM head scores token ids `0..head_vocab` only (docs/ALGORITHMS.md §8); q is zero
    /// outside them, which verification handles exactly through the residual.
    head_vocab: usize,
    /// A next tree grown ahead (pipelined drafting) whose assumed verdict held: its forwarded
    /// nodes are the newest cache entries, after the committed context.
    ready: Option<Growth>,
}

impl DraftSession {
    /// Prefill the committed prefix (the prompt without its last token, the first root).
    pub fn new(
        model: &Model,
        prefix: &[u32],
        params: SamplingParams,
        seed: u64,
        wire_top_k: usize,
    ) -> Result<Self, EngineError> {
        Self::resume(
            model,
            model.new_cache(),
            0,
            prefix,
            params,
            seed,
            wire_top_k,
        )
    }

    /// [`new`](Self::new) from a kept cache whose first `reused` entries hold `prefix[..reused]`
    /// (prefix reuse across chat turns): only the rest of the prefix is forwarded.
    pub fn resume(
        model: &Model,
        mut cache: KvCache,
        reused: usize,
        prefix: &[u32],
        params: SamplingParams,
        seed: u64,
        wire_top_k: usize,
    ) -> Result<Self, EngineError> {
        if reused > prefix.len() {
            return Err(EngineError::InvalidInput(format!(
                "resume: {reused} reused tokens but the prefix has {}",
                prefix.len()
            )));
        }
        cache.reuse_prefix(reused, model.info().max_context)?;
        if reused < prefix.len() {
            model.forward_chain(&mut cache, &prefix[reused..])?;
        }
        Ok(Self {
            cache,
            pending: Vec::new(),
            seed,
            params,
            wire_top_k,
            head_vocab: model.info().vocab_size,
            ready: None,
        })
    }

    /// The cache with only the committed tokens the draft model has processed: the first
    /// `len()` of the generation's committed tokens (prompt, then generated). Nodes of trees
    /// grown ahead are dropped. For keeping after the generation ends (prefix reuse).
    pub fn into_committed_cache(self) -> KvCache {
        let committed = self.context_len() - self.pending.len();
        let mut cache = self.cache;
        cache.truncate(committed);
        cache
    }

    /// Score only token ids `0..k` when drafting (clamped to the vocabulary; 0 = all). For
    /// BPE vocabularies whose ids follow merge order, that keeps the most frequent tokens.
    pub fn with_head_vocab(mut self, model: &Model, k: usize) -> Self {
        self.head_vocab = head_vocab(model, k);
        self
    }

    /// Committed context length (tokens before the next root), processed or pending.
    pub fn context_len(&self) -> usize {
        let ahead = self.ready.as_ref().map_or(0, |g| g.forwarded);
        self.cache.len() - ahead + self.pending.len()
    }

    /// Run the committed tokens the draft has not processed yet (after a decode fallback, or
    /// an accepted leaf or lookup node); returns how many. [`grow`](Self::grow) does this itself
    /// before a tree that needs the draft; calling it first lets the caller time the tree's own
    /// forwards apart from the catch-up. Does nothing while a tree grown ahead is ready (the
    /// cache then ends with its nodes, and nothing is pending).
    pub fn catch_up(&mut self, model: &Model) -> Result<usize, EngineError> {
        if self.ready.is_some() || self.pending.is_empty() {
            return Ok(0);
        }
        let pending = std::mem::take(&mut self.pending);
        if let Err(e) = model.forward_chain(&mut self.cache, &pending) {
            self.pending = pending;
            return Err(e);
        }
        Ok(pending.len())
    }

    /// Whether a tree grown ahead (pipelined drafting) is ready for `root` in `shape`, so
    /// that [`grow`](Self::grow) would only finish it.
    pub fn holds_ahead(&self, root: u32, shape: &Tree) -> bool {
        self.ready
            .as_ref()
            .is_some_and(|g| g.tokens[0] == root && g.shape == *shape)
    }

    /// Grow a tree of (at most) `shape` from `root`: one draft forward per level over that
    /// level's nodes, then children by sampling without replacement from q (greedy top-b at
    /// T = 0). A node gets fewer children than planned when q has fewer tokens.
    pub fn grow(
        &mut self,
        model: &Model,
        root: u32,
        shape: &Tree,
    ) -> Result<DraftedTree, EngineError> {
        if self.holds_ahead(root, shape) {
            let ahead = self.ready.take().expect("a tree grown ahead is held");
            return self.finish(model, ahead, true);
        }
        if let Some(ahead) = self.ready.take() {
            // Grown for another shape (the plan changed): drop its nodes.
            self.cache.truncate(self.cache.len() - ahead.forwarded);
        }
        if shape.len() > 1 {
            self.catch_up(model)?;
        }
        let growth = Growth::new(root, shape.clone(), self.seed, self.context_len());
        self.finish(model, growth, false)
    }

    /// Start growing the next tree, of `shape` from `root`, before it is asked for: level by
    /// level while `stop` is unset (checked before each forward), at most `max_forwards`
    /// levels, keeping what was grown for
    /// [`grow`](Self::grow) with the same root and shape to finish. The draft node does this
    /// while the verify node prefills the prompt (docs/ALGORITHMS.md §10). The tree is the one
    /// `grow` would draw: its random stream depends on its position, not on when it is grown.
    /// Returns the levels forwarded; does nothing (0) when a tree is already held or committed
    /// tokens wait to be processed.
    pub fn grow_ahead(
        &mut self,
        model: &Model,
        root: u32,
        shape: &Tree,
        max_forwards: usize,
        stop: &AtomicBool,
    ) -> Result<usize, EngineError> {
        if self.ready.is_some() || !self.pending.is_empty() || shape.len() < 2 {
            return Ok(0);
        }
        let mut g = Growth::new(root, shape.clone(), self.seed, self.context_len());
        let mut levels = 0;
        while levels < max_forwards && !stop.load(Ordering::Acquire) {
            match self.grow_level(model, &mut g) {
                Ok(true) => levels += 1,
                Ok(false) => break,
                Err(e) => {
                    // The failed forward left the cache as it was: drop the levels before it.
                    self.cache.truncate(self.cache.len() - g.forwarded);
                    return Err(e);
                }
            }
        }
        if levels > 0 {
            self.ready = Some(g);
        }
        Ok(levels)
    }

    /// Forward the remaining levels of `g` (one draft forward per level) and hand it out.
    fn finish(
        &mut self,
        model: &Model,
        mut g: Growth,
        resumed: bool,
    ) -> Result<DraftedTree, EngineError> {
        while self.grow_level(model, &mut g)? {}
        let mut drafted = g.into_drafted();
        drafted.resumed = resumed;
        Ok(drafted)
    }

    /// One draft forward over `g`'s next level, and that level's children; false (nothing
    /// run) when the tree is complete. On error the cache is as before the call.
    fn grow_level(&mut self, model: &Model, g: &mut Growth) -> Result<bool, EngineError> {
        let expand = g.to_expand();
        if expand.is_empty() {
            return Ok(false);
        }
        let logits = model.forward_forest_extend(
            &mut self.cache,
            &g.tokens,
            &g.parents,
            g.level_start,
            &expand,
            self.head_vocab,
        )?;
        g.add_children(&expand, &logits, 0, &self.params, self.wire_top_k);
        Ok(true)
    }

    /// Follow the verdict: keep the root and the accepted path in the cache; accepted tokens the
    /// draft has not processed (a deepest-level leaf, the root of a root-only tree, a lookup
    /// node) become pending, run right before the next tree that needs the draft.
    pub fn commit(&mut self, drafted: &DraftedTree, accepted: &[usize]) -> Result<(), DraftError> {
        check_path(&drafted.tree, accepted)?;
        self.keep_path(drafted, accepted, 0, None)
    }

    /// Committed tokens waiting to be run through the model ([`Self::catch_up`]).
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Follow tokens committed without a tree (the verify node's decode fallback): `tokens` are
    /// the old root and every decoded token but the newest (the next root). They become
    /// pending, so a run of decoding costs the draft nothing until a tree needs it (or the
    /// caller runs [`Self::catch_up`] while it waits for the next tokens).
    pub fn commit_decoded(&mut self, tokens: &[u32]) {
        // A tree grown ahead assumed a verdict that never came.
        if let Some(ahead) = self.ready.take() {
            self.cache.truncate(self.cache.len() - ahead.forwarded);
        }
        self.pending.extend_from_slice(tokens);
    }

    /// Keep the root and the accepted path of `drafted` in the cache, whose newest entries are
    /// the tree's `forwarded` nodes and then `appended` more (nodes grown ahead, all dropped).
    /// `end_copy`: index among the appended entries of a copy of the path's last node, used in
    /// its place when that node itself was never forwarded.
    fn keep_path(
        &mut self,
        drafted: &DraftedTree,
        accepted: &[usize],
        appended: usize,
        end_copy: Option<usize>,
    ) -> Result<(), DraftError> {
        let f = drafted.forwarded;
        let mut path = Vec::with_capacity(accepted.len() + 1);
        path.push(0);
        path.extend_from_slice(accepted);
        // Cache slots of the path's forwarded nodes. They form a prefix of the path: below a
        // node the draft did not forward (or a lookup node) nothing was forwarded either.
        let mut keep: Vec<usize> = path
            .iter()
            .map_while(|&v| drafted.origin[v].filter(|&o| o < f))
            .collect();
        if let (Some(c), true) = (end_copy, keep.len() + 1 == path.len()) {
            keep.push(f + c);
        }
        if f + appended > 0 {
            self.cache.keep_newest(f + appended, &keep)?;
        }
        self.pending
            .extend(path[keep.len()..].iter().map(|&v| drafted.tokens[v]));
        Ok(())
    }
}

/// A tree being grown level by level (docs/ALGORITHMS.md §3): the nodes so far, and how many
/// of them the draft model has forwarded. Kept between calls so that a tree grown ahead by
/// pipelining can be finished later.
#[derive(Debug, Clone)]
struct Growth {
    shape: Tree,
    /// Committed tokens before the root.
    position: usize,
    parents: Vec<i32>,
    tokens: Vec<u32>,
    /// shape_of[v] = the shape node that node v stands for.
    shape_of: Vec<usize>,
    /// q of every expanded node, in expansion order (T > 0 only).
    dists: Vec<SparseDist>,
    /// Per node: see [`DraftedTree`]'s fields of the same names.
    confidence: Vec<f32>,
    runner_up: Vec<f32>,
    /// First node of the level the next forward processes.
    level_start: usize,
    /// Nodes 0..forwarded are in the draft's cache.
    forwarded: usize,
    rng: SessionRng,
}

impl Growth {
    fn new(root: u32, shape: Tree, seed: u64, position: usize) -> Self {
        Self {
            shape,
            position,
            parents: vec![-1],
            tokens: vec![root],
            shape_of: vec![0],
            dists: Vec::new(),
            confidence: vec![1.0],
            runner_up: vec![f32::NAN],
            level_start: 0,
            forwarded: 0,
            rng: SessionRng::new(seed, draft_tree_stream(position as u64)),
        }
    }

    /// Nodes of the next level that the shape gives children; empty when the tree is done.
    /// The next forward processes the whole level (`level_start..len`), with logits at these.
    fn to_expand(&self) -> Vec<usize> {
        (self.level_start..self.parents.len())
            .filter(|&v| !self.shape.children(self.shape_of[v]).is_empty())
            .collect()
    }

    /// After the level's forward: children of each node in `expand` from its logits (row
    /// `first_row + i` of `logits` for `expand[i]`), by sampling without replacement from q
    /// (greedy top-b at T = 0). A node gets fewer children than planned when q has fewer tokens.
    fn add_children(
        &mut self,
        expand: &[usize],
        logits: &Logits,
        first_row: usize,
        params: &SamplingParams,
        wire_top_k: usize,
    ) {
        let level_end = self.parents.len();
        for (i, &v) in expand.iter().enumerate() {
            let row = logits.row(first_row + i);
            let want = self.shape.children(self.shape_of[v]);
            let (kids, probs, runner_up) = if params.is_greedy() {
                // One more than the children: the likeliest token left out, for pipelining.
                let mut top = greedy_top_k(row, want.len() + 1);
                let q = Softmax::of(row);
                let runner_up = if top.len() > want.len() {
                    top.pop().map_or(0.0, |t| q.prob(row, t))
                } else {
                    0.0
                };
                let probs: Vec<f32> = top.iter().map(|&t| q.prob(row, t)).collect();
                (top, probs, runner_up)
            } else {
                let dense = probs_from_logits(row, params);
                let q = SparseDist::top_k_of(&dense, wire_top_k);
                let kids = sample_without_replacement(&q, want.len(), &mut self.rng);
                let probs: Vec<f32> = kids.iter().map(|&t| q.prob(t)).collect();
                let runner_up = q
                    .tokens
                    .iter()
                    .zip(&q.probs)
                    .filter(|(t, _)| !kids.contains(t))
                    .map(|(_, &p)| p)
                    .fold(0.0f32, f32::max);
                self.dists.push(q);
                (kids, probs, runner_up)
            };
            self.runner_up[v] = runner_up;
            for (r, (tok, prob)) in kids.into_iter().zip(probs).enumerate() {
                self.parents.push(v as i32);
                self.tokens.push(tok);
                self.shape_of.push(want[r] as usize);
                self.confidence.push(prob);
                self.runner_up.push(f32::NAN);
            }
        }
        self.forwarded = level_end;
        self.level_start = level_end;
    }

    fn into_drafted(self) -> DraftedTree {
        let tree = unchecked_tree(&self.parents);
        let mut dists = self.dists;
        // An expanded node whose q was empty got no children: drop its q so that dists lines up
        // with the nodes that have children.
        if !dists.is_empty() {
            let expanded_planned =
                (0..self.forwarded).filter(|&v| !self.shape.children(self.shape_of[v]).is_empty());
            dists = dists
                .into_iter()
                .zip(expanded_planned)
                .filter(|(_, v)| !tree.children(*v).is_empty())
                .map(|(q, _)| q)
                .collect();
        }
        DraftedTree {
            origin: (0..tree.len()).map(Some).collect(),
            drafted: tree.clone(),
            drafted_tokens: self.tokens.clone(),
            tree,
            tokens: self.tokens,
            dists,
            forwarded: self.forwarded,
            position: self.position,
            resumed: false,
            confidence: self.confidence,
            runner_up: self.runner_up,
        }
    }
}

/// The draft's softmax (temperature 1) over one row of logits, for the probabilities of a few
/// tokens: how sure a greedy draft is of them (greedy drafting picks by logit and computes no
/// distribution; at T > 0 the q it sends serves instead).
struct Softmax {
    max: f32,
    sum: f32,
}

impl Softmax {
    fn of(row: &[f32]) -> Self {
        let max = row
            .iter()
            .copied()
            .filter(|x| x.is_finite())
            .fold(f32::NEG_INFINITY, f32::max);
        let sum = crate::vecmath::sum_exp(row, max);
        Self { max, sum }
    }

    /// Probability of `token`; 0 where the row gives no usable distribution.
    fn prob(&self, row: &[f32], token: u32) -> f32 {
        let p = (row[token as usize] - self.max).exp() / self.sum;
        if p.is_finite() {
            p
        } else {
            0.0
        }
    }
}

/// The LM-head width a `draft_vocab` setting means for `model`: the first `k` ids, clamped to
/// the vocabulary; 0 = all of it.
pub fn head_vocab(model: &Model, k: usize) -> usize {
    let vocab = model.info().vocab_size;
    if k == 0 {
        vocab
    } else {
        k.min(vocab)
    }
}

/// Check that `accepted` is a root-to-leaf path of `tree` (untrusted input from the network).
pub fn check_path(tree: &Tree, accepted: &[usize]) -> Result<(), DraftError> {
    let mut prev = 0usize;
    for (k, &v) in accepted.iter().enumerate() {
        if v == 0 || v >= tree.len() || tree.parent(v) != Some(prev) {
            return Err(DraftError::BadVerdict(format!(
                "accepted_nodes[{k}] = {v} is not a child of node {prev} in a tree of {} nodes",
                tree.len()
            )));
        }
        prev = v;
    }
    Ok(())
}

fn unchecked_tree(parents: &[i32]) -> Tree {
    Tree::from_parents_limited(
        parents,
        TreeLimits {
            max_nodes: usize::MAX,
            max_levels: usize::MAX,
        },
    )
    .expect("drafted trees are built in BFS order")
}
