//! One verification session: the target's KV cache for one generation and the per-step rule
//! (validate → one tree-masked forward → exact verification → compact the cache to the
//! accepted path). Plain library code; the gRPC layer only translates messages and errors.

use sequoia_core::sampling::{SamplingParams, SessionRng, SparseDist, VERIFY_STREAM};
use sequoia_core::tree::{Tree, TreeLimits};
use sequoia_core::verify::{decide_with_logits, verify_with_logits, Decision, Step, Verdict};
use sequoia_engine::{EngineError, KvCache, Logits, Model, Stop};
use std::time::Instant;

/// Limits a session enforces on each message.
#[derive(Debug, Clone, Copy)]
pub struct SessionLimits {
    pub max_context: usize,
    pub max_tree_nodes: usize,
    pub max_tree_levels: usize,
    pub max_dist_entries: usize,
}

/// Why a message was refused; the service maps each kind to a gRPC status code.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// Malformed input (INVALID_ARGUMENT); the message names the field.
    #[error("{0}")]
    Invalid(String),
    /// A limit was hit (RESOURCE_EXHAUSTED).
    #[error("{0}")]
    Exhausted(String),
    /// The node cannot serve the session any more (UNAVAILABLE: the draft moves it elsewhere).
    #[error("{0}")]
    Unavailable(String),
    /// The engine failed (INTERNAL).
    #[error("target model failed: {0}")]
    Engine(#[from] EngineError),
}

/// A verified step: the verdict plus how long the target took.
#[derive(Debug)]
pub struct StepResult {
    pub step: u64,
    pub verdict: Verdict,
    pub verify_ms: f64,
    /// Rows of the forward this tree was verified in (its own nodes plus other sessions'), and
    /// the sessions in it.
    pub batch_rows: usize,
    pub batch_sessions: usize,
}

pub struct VerifySession {
    pub(crate) cache: KvCache,
    /// The tokens the cache's entries hold (the prefix, then each step's root and accepted
    /// path), at least `cache.len()` of them: what a kept cache is matched by.
    tokens: Vec<u32>,
    params: SamplingParams,
    rng: SessionRng,
    next_step: u64,
    limits: SessionLimits,
    /// Cache length at which the `open`'s max_new_tokens are all committed (each committed
    /// token but the newest is in the cache): where a `decode` stops.
    token_limit: usize,
    /// The latest verdict (step, accepted nodes, next token): what a tree sent ahead for the
    /// next step is checked against.
    last_verdict: Option<(u64, Vec<usize>, u32)>,
    /// The latest verdict's next token, forwarded while the session waited for its next tree
    /// ([`decode_while_waiting`](Self::decode_while_waiting)): it is in the cache, and this is
    /// the target's logits row at it, with the time its forward took.
    root_ahead: Option<RootAhead>,
    /// Trees that met a root forwarded while waiting: how many had a child of the root
    /// accepted (a subtree to forward), and how many had none.
    waits_matched: (u32, u32),
}

/// A tree that passed every check of [`VerifySession::prepare`]: ready to be forwarded (alone
/// or batched with other sessions' trees) and then finished by [`VerifySession::finish`].
#[derive(Debug)]
pub struct PreparedTree {
    pub step: u64,
    pub tree: Tree,
    pub tokens: Vec<u32>,
    dists: Vec<SparseDist>,
    /// The tree is the subtree below the root's child that matched the token decoded while the
    /// session waited: how its verdict maps back onto the tree that was sent.
    below: Option<Below>,
}

/// Where a subtree sits in the tree that was sent: the root's child it hangs from, that
/// child's 1-based rank, and each subtree node's index in the sent tree.
#[derive(Debug)]
struct Below {
    child: usize,
    rank: usize,
    nodes: Vec<usize>,
}

/// A root forwarded while the session waited: the target's logits row at it, and how long
/// its forward took.
#[derive(Debug)]
struct RootAhead {
    logits: Vec<f32>,
    ms: f64,
}

/// What a tree meets on a session that decoded while it waited.
pub enum Prepared {
    /// Forward this tree (as always), then [`VerifySession::finish`].
    Tree(PreparedTree),
    /// The verdict is already known with no forward: the rule, deciding at the root from the
    /// row forwarded while waiting, accepted none of its children.
    Done(StepResult),
}

impl VerifySession {
    /// Prefill the committed prefix (the prompt without its last token, which is the first
    /// tree's root).
    pub fn open(
        model: &Model,
        prefix: &[u32],
        params: SamplingParams,
        seed: u64,
        max_new_tokens: usize,
        limits: SessionLimits,
    ) -> Result<(Self, f64), SessionError> {
        let mut session = Self::new(model, prefix, params, seed, max_new_tokens, limits)?;
        let prefill_ms = session.prefill(model, prefix)?;
        Ok((session, prefill_ms))
    }

    /// Forward the committed prefix in one go (without the batch scheduler); returns its time
    /// in ms.
    pub fn prefill(&mut self, model: &Model, prefix: &[u32]) -> Result<f64, SessionError> {
        let t0 = Instant::now();
        if !prefix.is_empty() {
            model.forward_chain(&mut self.cache, prefix)?;
        }
        Ok(t0.elapsed().as_secs_f64() * 1e3)
    }

    /// Check an `open` and make the session with an empty cache; the caller prefills `prefix`
    /// with [`prefill`](Self::prefill) (the batch scheduler does it in chunks between other
    /// sessions' trees). The cache is limited to what this session can need (prompt, new
    /// tokens and one tree, [`kv_tokens`]); the node reserves KV memory for
    /// [`cache_capacity`](Self::cache_capacity) entries.
    pub fn new(
        model: &Model,
        prefix: &[u32],
        params: SamplingParams,
        seed: u64,
        max_new_tokens: usize,
        limits: SessionLimits,
    ) -> Result<Self, SessionError> {
        params
            .validate()
            .map_err(|e| SessionError::Invalid(format!("open.sampling: {e}")))?;
        let vocab = model.info().vocab_size;
        if let Some((i, t)) = prefix
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= vocab)
        {
            return Err(SessionError::Invalid(format!(
                "open.prefix_tokens[{i}] = {t} is outside the vocabulary (size {vocab})"
            )));
        }
        let max_context = limits.max_context.min(model.info().max_context);
        let needed = prefix.len() + 1 + max_new_tokens;
        if needed > max_context {
            return Err(SessionError::Exhausted(format!(
                "prompt ({} tokens) + max_new_tokens ({max_new_tokens}) needs {needed} tokens of context; this verify node allows {max_context}",
                prefix.len() + 1
            )));
        }
        let limits = SessionLimits {
            max_context,
            ..limits
        };
        let cache = model.new_cache_limited(kv_tokens(prefix.len(), max_new_tokens, &limits));
        Ok(Self {
            cache,
            tokens: prefix.to_vec(),
            params,
            rng: SessionRng::new(seed, VERIFY_STREAM),
            next_step: 0,
            limits,
            token_limit: prefix.len() + max_new_tokens,
            last_verdict: None,
            root_ahead: None,
            waits_matched: (0, 0),
        })
    }

    /// Start from a kept cache whose first `reused` entries hold this session's first `reused`
    /// prefix tokens (prefix reuse); the caller then prefills only the rest of the prefix.
    /// Call before any prefill.
    pub fn adopt(&mut self, mut cache: KvCache, reused: usize) -> Result<(), SessionError> {
        if !self.cache.is_empty() || reused > self.tokens.len() {
            return Err(SessionError::Invalid(format!(
                "a kept cache of {reused} tokens cannot start a session holding {} of a {}-token prefix",
                self.cache.len(),
                self.tokens.len()
            )));
        }
        cache.reuse_prefix(reused, self.cache.capacity())?;
        self.cache = cache;
        Ok(())
    }

    /// The session's tokens and cache, to keep for a later session (prefix reuse).
    pub fn into_kept(self) -> (Vec<u32>, KvCache) {
        let mut tokens = self.tokens;
        tokens.truncate(self.cache.len());
        (tokens, self.cache)
    }

    pub fn context_len(&self) -> usize {
        self.cache.len()
    }

    pub fn context_limit(&self) -> usize {
        self.limits.max_context
    }

    /// Step number the next tree (or decoded token) must carry.
    pub fn next_step(&self) -> u64 {
        self.next_step
    }

    /// Whether to verify now a tree sent ahead (`VerifyTree.assumes`, docs/ALGORITHMS.md §10)
    /// for `step`, assuming that the verdict before it accepted `accepted` and drew `root`:
    /// true when that is this session's latest verdict, false when another verdict came or the
    /// step was verified already (the tree is then dropped unanswered). A step beyond the next
    /// one is not the draft's to assume: true, so that [`prepare`](Self::prepare) refuses it.
    pub fn ahead_holds(&self, step: u64, accepted: &[u32], root: Option<u32>) -> bool {
        if step > self.next_step {
            return true;
        }
        match &self.last_verdict {
            Some((last, acc, next)) => {
                step == self.next_step
                    && last + 1 == step
                    && Some(*next) == root
                    && acc.iter().copied().eq(accepted.iter().map(|&v| v as usize))
            }
            None => false,
        }
    }

    /// New tokens this session may still commit under its `open`'s max_new_tokens.
    pub fn tokens_left(&self) -> usize {
        self.token_limit.saturating_sub(self.cache.len())
    }

    /// Most entries this session's cache may hold (what its KV reservation covers).
    pub fn cache_capacity(&self) -> usize {
        self.cache.capacity()
    }

    /// Between a verdict and the next tree: forward the verdict's next token now (the root of
    /// the next tree), keeping the target's logits row at it, so that the time the next tree
    /// spends on its way is not lost (docs/ALGORITHMS.md §10, "The verify node decodes while
    /// it waits"). The next tree (a `decode`'s root-only tree too) then meets it in
    /// [`prepare_step`](Self::prepare_step). Nothing is drawn or decided here, so
    /// the verdicts are the ones the whole tree gets, greedy or sampled. False (nothing run)
    /// where there is nothing to do: no verdict yet, a root already forwarded, or fewer than
    /// two tokens left to commit.
    ///
    /// `stop` (its flag set when the next message arrives) abandons the forward within a
    /// layer, with nothing changed (then also false): a tree that comes sooner than expected
    /// waits at most a layer, not a whole forward. Past `stop`'s layer the forward is finished
    /// instead; the message sets that layer from what finishing saves it
    /// (crate::wait::before_layer_for).
    pub fn decode_while_waiting(
        &mut self,
        model: &Model,
        stop: Stop<'_>,
    ) -> Result<bool, SessionError> {
        let Some(&(_, _, root)) = self.last_verdict.as_ref() else {
            return Ok(false);
        };
        if self.root_ahead.is_some() || self.tokens_left() < 2 {
            return Ok(false);
        }
        let t0 = Instant::now();
        let chain = Tree::chain(1);
        let roots = [root];
        let logits = match model.forward_forest_extend_until(
            &mut self.cache,
            &roots,
            chain.parents(),
            0,
            &[0],
            model.info().vocab_size,
            Some(stop),
        ) {
            Ok(logits) => logits,
            Err(EngineError::Stopped) => return Ok(false),
            Err(e) => return Err(e.into()),
        };
        self.cache.keep_newest(1, &[0])?;
        self.tokens.truncate(self.cache.len() - 1);
        self.tokens.push(root);
        // Nothing is decided yet (a sampled session draws nothing now): the tree's rule decides
        // at the root from this row when the tree comes, drawing what it always draws there.
        self.root_ahead = Some(RootAhead {
            logits: logits.row(0).to_vec(),
            ms: t0.elapsed().as_secs_f64() * 1e3,
        });
        Ok(true)
    }

    /// The latest verdict's next token: the root of the session's next step (None before the
    /// first verdict).
    pub fn next_root(&self) -> Option<u32> {
        self.last_verdict.as_ref().map(|&(_, _, token)| token)
    }

    /// The share of this session's trees that met a root forwarded while waiting and had a
    /// child of it accepted (with one of each counted in advance): how often finishing that
    /// forward leaves a subtree to forward (crate::wait::finish_from_layer).
    pub fn root_accept_rate(&self) -> f64 {
        let (held, missed) = self.waits_matched;
        (held as f64 + 1.0) / ((held + missed) as f64 + 2.0)
    }

    /// Whether a root forwarded while waiting is held.
    pub fn has_root_ahead(&self) -> bool {
        self.root_ahead.is_some()
    }

    /// The verdict of a step that the root forwarded while waiting settled with no forward:
    /// nothing accepted, `token` next.
    fn answered_ahead(&mut self, step: u64, token: u32, ms: f64) -> StepResult {
        self.next_step += 1;
        self.last_verdict = Some((step, Vec::new(), token));
        tracing::debug!(
            step,
            "verdict from the token decoded while waiting, no forward"
        );
        StepResult {
            step,
            verdict: Verdict {
                accepted: Vec::new(),
                ranks: Vec::new(),
                next_token: token,
            },
            verify_ms: ms,
            batch_rows: 1,
            batch_sessions: 1,
        }
    }

    /// Take back a root forwarded while waiting (taken out of `root_ahead` by the caller): it
    /// leaves the cache again.
    fn take_back_root(&mut self) {
        let len = self.cache.len() - 1;
        self.cache.truncate(len);
        self.tokens.truncate(len);
    }

    /// [`prepare`](Self::prepare), where the root may have been forwarded while waiting. If it
    /// was, the tree is checked whole and the rule decides at the root from that row, drawing
    /// (a sampled session) exactly what the whole tree's verification draws there; then:
    /// - a child accepted: only that child's subtree is forwarded, and its verification goes
    ///   on from the child (its verdict is mapped back onto the tree in
    ///   [`finish`](Self::finish));
    /// - no child accepted: the verdict is known without a forward, nothing accepted and the
    ///   rule's next token.
    ///
    /// Every verdict, and the random stream after it, is the one the whole tree would get.
    pub fn prepare_step(
        &mut self,
        model: &Model,
        step: u64,
        parents: &[i32],
        tokens: &[u32],
        dists: Vec<SparseDist>,
    ) -> Result<Prepared, SessionError> {
        let Some(ahead) = self.root_ahead.take() else {
            return self
                .prepare(model, step, parents, tokens, dists)
                .map(Prepared::Tree);
        };
        let whole = match self.prepare(model, step, parents, tokens, dists) {
            Ok(whole) => whole,
            Err(e) => {
                self.take_back_root();
                return Err(e);
            }
        };
        let root = whole.tokens[0];
        if self.last_verdict.as_ref().map(|v| v.2) != Some(root) {
            // Another root than the one forwarded: the whole tree, as sent.
            self.take_back_root();
            return Ok(Prepared::Tree(whole));
        }
        // The rule's decision at the root, from the row forwarded while waiting: it draws what
        // the whole tree's verification would draw there, in the same order.
        let sampled = !self.params.is_greedy();
        let vocab = ahead.logits.len();
        let checked = match Step::new(&whole.tree, &whole.tokens, &whole.dists, vocab, sampled) {
            Ok(checked) => checked,
            Err(e) => {
                self.take_back_root();
                return Err(SessionError::Invalid(format!("tree: {e}")));
            }
        };
        let (child, rank) =
            match decide_with_logits(&checked, 0, &ahead.logits, &self.params, &mut self.rng) {
                Decision::Next(token) => {
                    self.waits_matched.1 += 1;
                    return Ok(Prepared::Done(self.answered_ahead(step, token, ahead.ms)));
                }
                Decision::Accept { child, rank } => (child, rank),
            };
        self.waits_matched.0 += 1;
        // The child's subtree in the sent order (parents come before their children).
        let mut index = vec![usize::MAX; whole.tokens.len()];
        let mut nodes = vec![child];
        let mut sub_parents = vec![-1i32];
        index[child] = 0;
        for (v, &p) in whole.tree.parents().iter().enumerate().skip(child + 1) {
            if p >= 0 && index[p as usize] != usize::MAX {
                index[v] = nodes.len();
                sub_parents.push(index[p as usize] as i32);
                nodes.push(v);
            }
        }
        let tree = Tree::from_parents(&sub_parents)
            .map_err(|e| SessionError::Invalid(format!("tree.parents: {e}")))?;
        let sub_tokens = nodes.iter().map(|&v| whole.tokens[v]).collect();
        // A sampled session's subtree keeps its nodes' draft distributions (one per expanded
        // node, in the tree's order of expanded nodes).
        let dists = if whole.dists.is_empty() {
            Vec::new()
        } else {
            let mut dist_of = vec![usize::MAX; whole.tokens.len()];
            for (i, v) in whole.tree.expanded_nodes().enumerate() {
                dist_of[v] = i;
            }
            tree.expanded_nodes()
                .map(|v| whole.dists[dist_of[nodes[v]]].clone())
                .collect()
        };
        tracing::debug!(
            step,
            rows = nodes.len(),
            "subtree below the token decoded while waiting"
        );
        Ok(Prepared::Tree(PreparedTree {
            step,
            tree,
            tokens: sub_tokens,
            dists,
            below: Some(Below { child, rank, nodes }),
        }))
    }

    /// Verify one tree alone: [`prepare_step`](Self::prepare_step), then (unless the root
    /// forwarded while waiting already gave the verdict) one forward and
    /// [`finish`](Self::finish). A tree that its checks refuse leaves the session as if it had
    /// not decoded while waiting.
    pub fn verify(
        &mut self,
        model: &Model,
        step: u64,
        parents: &[i32],
        tokens: &[u32],
        dists: &[SparseDist],
    ) -> Result<StepResult, SessionError> {
        match self.prepare_step(model, step, parents, tokens, dists.to_vec())? {
            Prepared::Done(r) => Ok(r),
            Prepared::Tree(prepared) => self.run(model, prepared),
        }
    }

    /// Forward a prepared tree alone, then [`finish`](Self::finish) it.
    pub fn run(
        &mut self,
        model: &Model,
        prepared: PreparedTree,
    ) -> Result<StepResult, SessionError> {
        let t0 = Instant::now();
        let logits = model.forward_tree(&mut self.cache, &prepared.tokens, &prepared.tree)?;
        let rows = prepared.tree.len();
        self.finish(prepared, &logits, t0, (rows, 1))
    }

    /// Every check of a tree message, before any model work: step order, size limits, shape,
    /// tokens, distributions, room in the context.
    pub fn prepare(
        &self,
        model: &Model,
        step: u64,
        parents: &[i32],
        tokens: &[u32],
        dists: Vec<SparseDist>,
    ) -> Result<PreparedTree, SessionError> {
        if step != self.next_step {
            return Err(SessionError::Invalid(format!(
                "tree.step: expected {}, got {step} (steps are sent in order starting at 0)",
                self.next_step
            )));
        }
        if parents.len() > self.limits.max_tree_nodes {
            return Err(SessionError::Exhausted(format!(
                "tree.parents: {} nodes exceed this verify node's limit of {}",
                parents.len(),
                self.limits.max_tree_nodes
            )));
        }
        let limits = TreeLimits {
            max_nodes: self.limits.max_tree_nodes,
            max_levels: self.limits.max_tree_levels,
        };
        let tree = Tree::from_parents_limited(parents, limits)
            .map_err(|e| SessionError::Invalid(format!("tree.parents: {e}")))?;
        if let Some((i, q)) = dists
            .iter()
            .enumerate()
            .find(|(_, q)| q.tokens.len() > self.limits.max_dist_entries)
        {
            return Err(SessionError::Invalid(format!(
                "tree.draft_dists[{i}]: {} entries exceed the limit of {}",
                q.tokens.len(),
                self.limits.max_dist_entries
            )));
        }
        let vocab = model.info().vocab_size;
        Step::new(&tree, tokens, &dists, vocab, !self.params.is_greedy())
            .map_err(|e| SessionError::Invalid(format!("tree: {e}")))?;
        let needed = self.cache.len() + tree.len();
        if needed > self.limits.max_context.min(self.cache.capacity()) {
            return Err(SessionError::Exhausted(format!(
                "context full: {} committed tokens + {} tree nodes exceed the session limit of {}",
                self.cache.len(),
                tree.len(),
                self.limits.max_context.min(self.cache.capacity())
            )));
        }
        Ok(PreparedTree {
            step,
            tree,
            tokens: tokens.to_vec(),
            dists,
            below: None,
        })
    }

    /// The rest of a step once the tree's nodes are in the cache and `logits` holds a row per
    /// node: exact verification, then compaction of the cache to the accepted path. `started`
    /// is when the forward began (the step's reported verify time runs from there);
    /// `batch`: how many rows and sessions that forward had.
    pub fn finish(
        &mut self,
        prepared: PreparedTree,
        logits: &Logits,
        started: Instant,
        batch: (usize, usize),
    ) -> Result<StepResult, SessionError> {
        let PreparedTree {
            step,
            tree,
            tokens,
            dists,
            below,
        } = prepared;
        let vocab = logits.vocab();
        let checked = Step::new(&tree, &tokens, &dists, vocab, !self.params.is_greedy())
            .map_err(|e| SessionError::Invalid(format!("tree: {e}")))?;
        let mut verdict =
            verify_with_logits(&checked, |v| logits.row(v), &self.params, &mut self.rng);
        // Keep the root and the accepted path; the next tree's root is verdict.next_token.
        let mut keep = Vec::with_capacity(verdict.accepted.len() + 1);
        keep.push(0);
        keep.extend(&verdict.accepted);
        self.cache.keep_newest(tree.len(), &keep)?;
        self.tokens.truncate(self.cache.len() - keep.len());
        self.tokens.extend(keep.iter().map(|&v| tokens[v]));
        if let Some(b) = below {
            // A subtree below the root's child that the waiting token matched: the verdict in
            // the sent tree's nodes starts with that child.
            verdict.accepted = std::iter::once(b.child)
                .chain(verdict.accepted.iter().map(|&v| b.nodes[v]))
                .collect();
            verdict.ranks.insert(0, b.rank);
        }
        self.next_step += 1;
        self.last_verdict = Some((step, verdict.accepted.clone(), verdict.next_token));
        Ok(StepResult {
            step,
            verdict,
            verify_ms: started.elapsed().as_secs_f64() * 1e3,
            batch_rows: batch.0,
            batch_sessions: batch.1,
        })
    }
}

/// KV entries a session may come to hold: its prefix, every new token, and one tree in
/// flight (capped by the context limit). The node reserves memory for this many at `open`.
fn kv_tokens(prefix: usize, max_new_tokens: usize, limits: &SessionLimits) -> usize {
    (prefix + 1 + max_new_tokens + limits.max_tree_nodes).min(limits.max_context)
}
