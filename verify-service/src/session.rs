//! One verification session: the target's KV cache for one generation and the per-step rule
//! (validate → one tree-masked forward → exact verification → compact the cache to the
//! accepted path). Plain library code; the gRPC layer only translates messages and errors.

use sequoia_core::sampling::{SamplingParams, SessionRng, SparseDist, VERIFY_STREAM};
use sequoia_core::tree::{Tree, TreeLimits};
use sequoia_core::verify::{verify_with_logits, Step, Verdict};
use sequoia_engine::{EngineError, KvCache, Model};
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
}

pub struct VerifySession {
    cache: KvCache,
    params: SamplingParams,
    rng: SessionRng,
    next_step: u64,
    limits: SessionLimits,
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
        let mut cache = model.new_cache();
        let t0 = Instant::now();
        if !prefix.is_empty() {
            model.forward_chain_last(&mut cache, prefix)?;
        }
        let prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
        Ok((
            Self {
                cache,
                params,
                rng: SessionRng::new(seed, VERIFY_STREAM),
                next_step: 0,
                limits: SessionLimits {
                    max_context,
                    ..limits
                },
            },
            prefill_ms,
        ))
    }

    pub fn context_len(&self) -> usize {
        self.cache.len()
    }

    pub fn context_limit(&self) -> usize {
        self.limits.max_context
    }

    /// Verify one tree. On any error the session's state is unchanged.
    pub fn verify(
        &mut self,
        model: &Model,
        step: u64,
        parents: &[i32],
        tokens: &[u32],
        dists: &[SparseDist],
    ) -> Result<StepResult, SessionError> {
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
        let need_dists = !self.params.is_greedy();
        let checked = Step::new(&tree, tokens, dists, vocab, need_dists)
            .map_err(|e| SessionError::Invalid(format!("tree: {e}")))?;
        let needed = self.cache.len() + tree.len();
        if needed > self.limits.max_context {
            return Err(SessionError::Exhausted(format!(
                "context full: {} committed tokens + {} tree nodes exceed the session limit of {}",
                self.cache.len(),
                tree.len(),
                self.limits.max_context
            )));
        }
        let t0 = Instant::now();
        let logits = model.forward_tree(&mut self.cache, tokens, &tree)?;
        let verdict = verify_with_logits(&checked, |v| logits.row(v), &self.params, &mut self.rng);
        // Keep the root and the accepted path; the next tree's root is verdict.next_token.
        let mut keep = Vec::with_capacity(verdict.accepted.len() + 1);
        keep.push(0);
        keep.extend(&verdict.accepted);
        self.cache.keep_newest(tree.len(), &keep)?;
        self.next_step += 1;
        Ok(StepResult {
            step,
            verdict,
            verify_ms: t0.elapsed().as_secs_f64() * 1e3,
        })
    }
}
