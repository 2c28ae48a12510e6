//! The draft side of one generation: the draft model's KV cache, growing a token tree level by
//! level (docs/ALGORITHMS.md §3), and following the verifier's verdict. Plain library code with no
//! networking: draft-service runs it against remote verify nodes, `sequoia tree
//! measure-acceptance` against a local target.

use crate::{EngineError, KvCache, Model};
use sequoia_core::sampling::{
    greedy_top_k, probs_from_logits, sample_without_replacement, SamplingParams, SessionRng,
    SparseDist, DRAFT_STREAM,
};
use sequoia_core::tree::{Tree, TreeLimits};

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
    /// The tree as the draft model grew it (before lookup branches were grafted on).
    drafted: Tree,
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
    rng: SessionRng,
    params: SamplingParams,
    wire_top_k: usize,
    /// The LM head scores token ids `0..head_vocab` only (docs/ALGORITHMS.md §8); q is zero
    /// outside them, which verification handles exactly through the residual.
    head_vocab: usize,
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
        let mut cache = model.new_cache();
        if !prefix.is_empty() {
            model.forward_chain(&mut cache, prefix)?;
        }
        Ok(Self {
            cache,
            pending: Vec::new(),
            rng: SessionRng::new(seed, DRAFT_STREAM),
            params,
            wire_top_k,
            head_vocab: model.info().vocab_size,
        })
    }

    /// Score only token ids `0..k` when drafting (clamped to the vocabulary; 0 = all). For
    /// BPE vocabularies whose ids follow merge order, that keeps the most frequent tokens.
    pub fn with_head_vocab(mut self, model: &Model, k: usize) -> Self {
        self.head_vocab = head_vocab(model, k);
        self
    }

    /// Committed context length (tokens before the next root), processed or pending.
    pub fn context_len(&self) -> usize {
        self.cache.len() + self.pending.len()
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
        let mut parents = vec![-1i32];
        let mut tokens = vec![root];
        let mut shape_of = vec![0usize];
        let mut dists = Vec::new();
        let mut level_start = 0;
        let mut forwarded = 0;
        if shape.len() > 1 && !self.pending.is_empty() {
            let pending = std::mem::take(&mut self.pending);
            if let Err(e) = model.forward_chain(&mut self.cache, &pending) {
                self.pending = pending;
                return Err(e);
            }
        }
        while level_start < parents.len() {
            let level_end = parents.len();
            let expand: Vec<usize> = (level_start..level_end)
                .filter(|&v| !shape.children(shape_of[v]).is_empty())
                .collect();
            if expand.is_empty() {
                break;
            }
            let partial = unchecked_tree(&parents);
            let logits = model.forward_tree_extend(
                &mut self.cache,
                &tokens,
                &partial,
                level_start,
                &expand,
                self.head_vocab,
            )?;
            forwarded = level_end;
            for (row, &v) in expand.iter().enumerate() {
                let want = shape.children(shape_of[v]);
                let kids = if self.params.is_greedy() {
                    greedy_top_k(logits.row(row), want.len())
                } else {
                    let dense = probs_from_logits(logits.row(row), &self.params);
                    let q = SparseDist::top_k_of(&dense, self.wire_top_k);
                    let kids = sample_without_replacement(&q, want.len(), &mut self.rng);
                    dists.push(q);
                    kids
                };
                for (r, tok) in kids.into_iter().enumerate() {
                    parents.push(v as i32);
                    tokens.push(tok);
                    shape_of.push(want[r] as usize);
                }
            }
            level_start = level_end;
        }
        // An expanded node whose q was empty got no children: drop its q so that dists lines up
        // with the nodes that have children.
        let tree = unchecked_tree(&parents);
        let origin = (0..tree.len()).map(Some).collect();
        if !self.params.is_greedy() {
            let expanded_planned: Vec<usize> = (0..forwarded)
                .filter(|&v| !shape.children(shape_of[v]).is_empty())
                .collect();
            let mut kept = Vec::with_capacity(dists.len());
            for (q, v) in dists.into_iter().zip(expanded_planned) {
                if !tree.children(v).is_empty() {
                    kept.push(q);
                }
            }
            dists = kept;
        }
        Ok(DraftedTree {
            drafted: tree.clone(),
            tree,
            tokens,
            dists,
            forwarded,
            origin,
        })
    }

    /// Follow the verdict: keep the root and the accepted path in the cache; accepted tokens the
    /// draft has not processed (a deepest-level leaf, the root of a root-only tree, a lookup
    /// node) become pending, run right before the next tree that needs the draft.
    pub fn commit(&mut self, drafted: &DraftedTree, accepted: &[usize]) -> Result<(), DraftError> {
        check_path(&drafted.tree, accepted)?;
        let f = drafted.forwarded;
        let mut path = Vec::with_capacity(accepted.len() + 1);
        path.push(0);
        path.extend_from_slice(accepted);
        // Cache slots of the path's forwarded nodes. They form a prefix of the path: below a
        // node the draft did not forward (or a lookup node) nothing was forwarded either.
        let keep: Vec<usize> = path
            .iter()
            .map_while(|&v| drafted.origin[v].filter(|&o| o < f))
            .collect();
        if f > 0 {
            self.cache.keep_newest(f, &keep)?;
        }
        self.pending
            .extend(path[keep.len()..].iter().map(|&v| drafted.tokens[v]));
        Ok(())
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
