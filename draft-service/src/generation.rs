//! One `Generate` call end to end: tokenize, open a verify session, then loop
//! grow tree → verify → follow the verdict → stream text, until EOS, a stop string, max_tokens
//! or the context limit. When the verify node dies or drains mid-generation, the session moves
//! to another node, which prefills the committed tokens and verifies the same tree: the client
//! sees neither an error nor a change in its text.

use crate::nodes::{unavailable, Reservation, VerifyNode};
use crate::plan::NodeCosts;
use crate::DraftState;
use sequoia_proto::v1::{
    session_request, session_response, GenerateChunk, GenerateRequest, GenerateSummary,
    OpenSession, SamplingConfig, SessionOpened, SessionRequest, SessionResponse,
    SparseDist as PbDist, Timings, Verdict, VerifyTree,
};
use sequoia_shared::drafting::{DraftSession, DraftedTree};
use sequoia_shared::sampling::SamplingParams;
use sequoia_shared::tokenizer::{ChatMessage, IncrementalDecoder};
use sequoia_shared::tree::Tree;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tonic::{Code, Status};
use tracing::{debug, info_span, Instrument};

pub type ChunkTx = mpsc::Sender<Result<GenerateChunk, Status>>;

/// A request checked and turned into tokens and settings.
pub struct Prepared {
    pub prompt_tokens: Vec<u32>,
    /// A tree shape forced by the request (benchmarks), instead of the plan.
    pub forced_tree: Option<sequoia_shared::tree::Tree>,
    pub params: SamplingParams,
    pub max_tokens: usize,
    pub seed: u64,
    pub stop: Vec<String>,
}

/// Validate a request (INVALID_ARGUMENT naming the field) and tokenize its prompt.
pub fn prepare(state: &DraftState, req: &GenerateRequest) -> Result<Prepared, Status> {
    let invalid = |m: String| Status::invalid_argument(m);
    if req.prompt.is_empty() == req.messages.is_empty() {
        return Err(invalid(
            "give exactly one of `prompt` (text) or `messages` (chat)".into(),
        ));
    }
    if !req.temperature.is_finite() || req.temperature < 0.0 {
        return Err(invalid(format!(
            "temperature must be finite and ≥ 0, got {}",
            req.temperature
        )));
    }
    if !req.top_p.is_finite() || !(0.0..=1.0).contains(&req.top_p) {
        return Err(invalid(format!(
            "top_p must be in [0, 1] (0 = off), got {}",
            req.top_p
        )));
    }
    if req.stop.iter().any(|s| s.is_empty()) {
        return Err(invalid("stop strings must not be empty".into()));
    }
    let tok = &state.tokenizer;
    let text = if !req.messages.is_empty() || req.apply_chat_template {
        let messages: Vec<ChatMessage> = if req.messages.is_empty() {
            vec![ChatMessage {
                role: "user".into(),
                content: req.prompt.clone(),
            }]
        } else {
            for (i, m) in req.messages.iter().enumerate() {
                if !matches!(m.role.as_str(), "system" | "user" | "assistant") {
                    return Err(invalid(format!(
                        "messages[{i}].role must be system, user or assistant, got {:?}",
                        m.role
                    )));
                }
            }
            req.messages
                .iter()
                .map(|m| ChatMessage {
                    role: m.role.clone(),
                    content: m.content.clone(),
                })
                .collect()
        };
        tok.apply_chat_template(&messages, true).map_err(|e| {
            Status::failed_precondition(format!("cannot render the chat template: {e}"))
        })?
    } else {
        req.prompt.clone()
    };
    // A rendered chat template already carries its own special tokens (BOS included).
    let templated = !req.messages.is_empty() || req.apply_chat_template;
    let prompt_tokens = tok
        .encode(&text, !templated)
        .map_err(|e| invalid(format!("prompt cannot be tokenized: {e}")))?;
    if prompt_tokens.is_empty() {
        return Err(invalid("prompt tokenizes to nothing".into()));
    }
    let max_tokens = if req.max_tokens == 0 {
        state.config.default_max_tokens
    } else {
        req.max_tokens
    } as usize;
    let limit = state.context_limit();
    if prompt_tokens.len() + max_tokens > limit {
        return Err(Status::resource_exhausted(format!(
            "prompt ({} tokens) + max_tokens ({max_tokens}) exceeds the context limit of {limit} tokens",
            prompt_tokens.len()
        )));
    }
    let forced_tree = if req.tree_parents.is_empty() {
        None
    } else {
        let limits = sequoia_shared::tree::TreeLimits {
            max_nodes: 512,
            max_levels: 64,
        };
        Some(
            sequoia_shared::tree::Tree::from_parents_limited(&req.tree_parents, limits)
                .map_err(|e| invalid(format!("tree_parents: {e}")))?,
        )
    };
    Ok(Prepared {
        prompt_tokens,
        forced_tree,
        params: SamplingParams {
            temperature: req.temperature,
            top_k: req.top_k as usize,
            top_p: if req.top_p <= 0.0 { 1.0 } else { req.top_p },
        },
        max_tokens,
        seed: req.seed.unwrap_or_else(rand_seed),
        stop: req.stop.clone(),
    })
}

fn rand_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    h.finish()
}

/// Text bookkeeping: detokenize committed tokens one at a time, detect stop strings exactly at
/// the token that completes them, and hold back text that could still become a stop string.
struct TextOut<'a> {
    decoder: IncrementalDecoder<'a>,
    text: String,
    sent: usize,
    stop: Vec<String>,
    hold: usize,
}

impl<'a> TextOut<'a> {
    /// Append one token's text; returns true when a stop string is now complete (text is cut
    /// before it).
    fn push(&mut self, token: u32) -> Result<bool, Status> {
        let delta = self
            .decoder
            .push(&[token])
            .map_err(|e| Status::internal(format!("detokenize: {e}")))?;
        let from = self
            .text
            .len()
            .saturating_sub(self.hold)
            .max(self.sent.min(self.text.len()));
        let from = floor_char(&self.text, from);
        self.text.push_str(&delta);
        for s in &self.stop {
            if let Some(pos) = self.text[from..].find(s.as_str()) {
                self.text.truncate(from + pos);
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Text safe to send now (cannot be the start of a stop string).
    fn take_ready(&mut self, finished: bool) -> String {
        let end = if finished {
            self.text.len()
        } else {
            floor_char(&self.text, self.text.len().saturating_sub(self.hold))
        };
        if end <= self.sent {
            return String::new();
        }
        let out = self.text[self.sent..end].to_string();
        self.sent = end;
        out
    }
}

fn floor_char(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// Statistics reported in the final chunk.
#[derive(Default)]
struct Stats {
    steps: u32,
    accepted_by_rank: Vec<u64>,
    trials_by_rank: Vec<u64>,
    draft: Duration,
    verify_ms: f64,
    roundtrip: Duration,
}

impl Stats {
    /// Every verified node with c children is a trial for ranks 1..=c (ALGORITHMS.md §6).
    fn record(&mut self, drafted: &DraftedTree, accepted: &[usize], ranks: &[u32]) {
        let tree = &drafted.tree;
        let mut path = vec![0usize];
        path.extend_from_slice(accepted);
        for (k, &v) in path.iter().enumerate() {
            let c = tree.children(v).len();
            if self.trials_by_rank.len() < c {
                self.trials_by_rank.resize(c, 0);
                self.accepted_by_rank.resize(c, 0);
            }
            for r in 0..c {
                self.trials_by_rank[r] += 1;
            }
            if let Some(&rank) = ranks.get(k) {
                if rank >= 1 && (rank as usize) <= c {
                    self.accepted_by_rank[rank as usize - 1] += 1;
                }
            }
        }
    }
}

/// Run one generation, streaming chunks to `tx`. Errors are returned for the caller to send.
pub async fn run(state: Arc<DraftState>, prep: Prepared, tx: &ChunkTx) -> Result<(), Status> {
    let t_start = Instant::now();
    generate(&state, prep, tx, t_start)
        .instrument(info_span!("generate", node = tracing::field::Empty))
        .await
}

/// How often one generation may move to another verify node before giving up.
const MAX_FAILOVERS: u32 = 8;

/// Whether a failed verify call means "try another node" rather than "report it": the node is
/// unreachable, drains, died mid-session, or is at its session limit.
fn try_elsewhere(s: &Status) -> bool {
    matches!(s.code(), Code::Unavailable | Code::ResourceExhausted)
}

/// One open verification session on one verify node.
struct Link {
    reservation: Reservation,
    req_tx: mpsc::Sender<SessionRequest>,
    inbound: tonic::Streaming<SessionResponse>,
    /// Step number of the next tree on this session (each session counts from 0).
    next_step: u64,
    opened: SessionOpened,
}

impl Link {
    fn node(&self) -> &Arc<VerifyNode> {
        self.reservation.node()
    }

    fn addr(&self) -> &str {
        &self.node().addr
    }

    /// Open a session on the reserved node and wait until it has prefilled `open.prefix_tokens`.
    async fn open(
        reservation: Reservation,
        open: OpenSession,
        timeout: Duration,
    ) -> Result<Link, Status> {
        let node = reservation.node().clone();
        let addr = node.addr.clone();
        let (req_tx, req_rx) = mpsc::channel::<SessionRequest>(2);
        req_tx
            .send(SessionRequest {
                msg: Some(session_request::Msg::Open(open)),
            })
            .await
            .map_err(|_| Status::internal("session request channel closed"))?;
        let mut client = node.client();
        let mut inbound = tokio::time::timeout(
            timeout,
            client.session(tokio_stream::wrappers::ReceiverStream::new(req_rx)),
        )
        .await
        .map_err(|_| {
            Status::unavailable(format!(
                "verify node {addr} did not answer within {timeout:?}"
            ))
        })?
        .map_err(|s| unavailable(&addr, &s))?
        .into_inner();
        let Some(session_response::Msg::Opened(opened)) =
            next_response(&mut inbound, &addr, timeout).await?
        else {
            return Err(Status::internal(format!(
                "verify node {addr} answered `open` with something else"
            )));
        };
        node.set_reported(opened.active_sessions as usize);
        Ok(Link {
            reservation,
            req_tx,
            inbound,
            next_step: 0,
            opened,
        })
    }

    /// Send one tree (numbered here, per session) and wait for its verdict.
    async fn verify(&mut self, mut tree: VerifyTree, timeout: Duration) -> Result<Verdict, Status> {
        let step = self.next_step;
        tree.step = step;
        let addr = self.addr().to_string();
        self.req_tx
            .send(SessionRequest {
                msg: Some(session_request::Msg::Tree(tree)),
            })
            .await
            .map_err(|_| Status::unavailable(format!("verify node {addr} closed the session")))?;
        let Some(session_response::Msg::Verdict(verdict)) =
            next_response(&mut self.inbound, &addr, timeout).await?
        else {
            return Err(Status::internal(format!(
                "verify node {addr} answered a tree with something else"
            )));
        };
        if verdict.step != step {
            return Err(Status::internal(format!(
                "verify node {addr} answered step {} for step {step}",
                verdict.step
            )));
        }
        self.next_step += 1;
        Ok(verdict)
    }
}

/// Open a session on the best verify node that takes it, trying the others (not in `tried`)
/// when one is unreachable, drains or is full. A node serving another tokenizer is an error.
async fn open_anywhere(
    state: &DraftState,
    open: &OpenSession,
    tried: &mut Vec<String>,
) -> Result<Link, Status> {
    let timeout = Duration::from_secs_f64(state.config.step_timeout_secs);
    let connect = Duration::from_secs_f64(state.config.connect_timeout_secs);
    let mut last_err: Option<Status> = None;
    while let Some(reservation) = state.pool.reserve(tried).await {
        let node = reservation.node().clone();
        tried.push(node.addr.clone());
        let info = match node.info(connect).await {
            Ok(info) => info,
            Err(e) => {
                last_err = Some(e);
                continue;
            }
        };
        if info.tokenizer_fingerprint != state.tokenizer.fingerprint() {
            return Err(Status::failed_precondition(format!(
                "verify node {} serves {:?}, whose tokenizer differs from the draft model {:?} (fingerprints {} vs {}); draft and target must share a tokenizer",
                node.addr,
                info.model_name,
                state.model.info().name,
                short(&info.tokenizer_fingerprint),
                short(state.tokenizer.fingerprint())
            )));
        }
        match Link::open(reservation, open.clone(), timeout).await {
            Ok(link) => return Ok(link),
            Err(e) if try_elsewhere(&e) => {
                if e.code() == Code::Unavailable {
                    node.mark_unreachable();
                }
                tracing::warn!(node = %node.addr, error = e.message(), "verify node did not take the session; trying another");
                last_err = Some(e);
            }
            Err(e) => return Err(e),
        }
    }
    Err(last_err.unwrap_or_else(|| {
        Status::unavailable(format!(
            "no verify node is available (configured: {}); check that verify-service runs and the names resolve",
            state.pool.describe()
        ))
    }))
}

fn short(s: &str) -> &str {
    &s[..s.len().min(12)]
}

/// The wire form of a drafted tree (its step number is set by the session it is sent on).
fn tree_message(drafted: &DraftedTree) -> VerifyTree {
    VerifyTree {
        step: 0,
        parents: drafted.tree.parents().to_vec(),
        tokens: drafted.tokens.clone(),
        draft_dists: drafted
            .dists
            .iter()
            .map(|q| PbDist {
                tokens: q.tokens.clone(),
                probs: q.probs.clone(),
            })
            .collect(),
    }
}

/// Seed of the verify side's random stream after the k-th move, so a moved session never
/// reuses the uniforms its earlier steps consumed.
fn moved_seed(seed: u64, k: u32) -> u64 {
    seed ^ (k as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

async fn generate(
    state: &Arc<DraftState>,
    prep: Prepared,
    tx: &ChunkTx,
    t_start: Instant,
) -> Result<(), Status> {
    let step_timeout = Duration::from_secs_f64(state.config.step_timeout_secs);
    let prompt = &prep.prompt_tokens;
    // The verify node holds every committed token but the newest (the next tree's root).
    let (prefix, mut root) = (
        prompt[..prompt.len() - 1].to_vec(),
        prompt[prompt.len() - 1],
    );
    let sampling = SamplingConfig {
        temperature: prep.params.temperature,
        top_p: prep.params.top_p,
        top_k: prep.params.top_k as u32,
    };
    let open = OpenSession {
        prefix_tokens: prefix.clone(),
        sampling: Some(sampling),
        seed: prep.seed,
        max_new_tokens: prep.max_tokens as u32,
    };

    // Prefill the draft while the verify node prefills the target.
    let model = state.model.clone();
    let (params, seed, wire_k) = (prep.params, prep.seed, state.config.wire_top_k);
    let t_prefill = Instant::now();
    let draft_prefill = tokio::task::spawn_blocking(move || {
        DraftSession::new(&model, &prefix, params, seed, wire_k)
    });
    let mut link = open_anywhere(state, &open, &mut Vec::new()).await?;
    tracing::Span::current().record("node", link.addr());
    let mut draft = draft_prefill
        .await
        .map_err(|e| Status::internal(format!("draft prefill task failed: {e}")))?
        .map_err(|e| Status::internal(format!("draft model failed: {e}")))?;
    let prefill_ms = t_prefill.elapsed().as_secs_f64() * 1e3;
    let mut context_limit = state
        .context_limit()
        .min(link.opened.context_limit as usize);
    let mut failovers = 0u32;

    let eos = state.tokenizer.eos_ids().to_vec();
    let mut out = TextOut {
        decoder: IncrementalDecoder::new(&state.tokenizer, true),
        text: String::new(),
        sent: 0,
        hold: prep
            .stop
            .iter()
            .map(|s| s.len())
            .max()
            .unwrap_or(1)
            .saturating_sub(1),
        stop: prep.stop.clone(),
    };
    let greedy = prep.params.is_greedy();
    let costs = node_costs(state, link.node()).await?;
    let mut plan = state
        .planner
        .plan(costs.as_ref(), greedy)
        .map_err(|e| Status::internal(format!("tree planner: {e}")))?;
    let mut replans = 0u32;
    let mut folded = Stats::default(); // counts already folded into the planner's estimate
    let mut generated: Vec<u32> = Vec::new();
    let mut stats = Stats::default();
    let mut finish = "length";
    let t_gen = Instant::now();
    'steps: while generated.len() < prep.max_tokens {
        let room = context_limit.saturating_sub(draft.context_len());
        if room == 0 {
            finish = "context";
            break;
        }
        if stats.steps > 0 && stats.steps % state.planner.replan_every() == 0 {
            fold_acceptance(state, greedy, &stats, &mut folded);
            plan = state
                .planner
                .plan(costs.as_ref(), greedy)
                .map_err(|e| Status::internal(format!("tree planner: {e}")))?;
            replans += 1;
        }
        let every = state.planner.replan_every();
        let shape = match &prep.forced_tree {
            Some(t) if t.len() <= room => t.clone(),
            // Auto mode without speculation would never see a verdict again: probe with a
            // two-node chain once every four re-plan periods so the acceptance estimate keeps
            // learning (a probe costs the draft's catch-up over the tokens it skipped) — but
            // only while a tree could pay at an optimistic acceptance (`plan.probe`).
            _ if plan.mode == "auto"
                && plan.probe
                && plan.shape(room).len() == 1
                && room >= 2
                && stats.steps % (4 * every) == 4 * every - 1 =>
            {
                Tree::chain(2)
            }
            _ => plan.shape(room),
        };
        // Grow the tree (CPU-bound) without stalling the async workers.
        let t0 = Instant::now();
        let model = state.model.clone();
        let shape_c = shape.clone();
        let full_tree = shape.len() == plan.shape(usize::MAX).len();
        let (back, drafted) = tokio::task::spawn_blocking(move || {
            let r = draft.grow(&model, root, &shape_c);
            (draft, r)
        })
        .await
        .map_err(|e| Status::internal(format!("draft task failed: {e}")))?;
        draft = back;
        let drafted = drafted.map_err(|e| Status::internal(format!("draft model failed: {e}")))?;
        let step_draft = t0.elapsed();
        stats.draft += step_draft;

        let (verdict, round_trip) = loop {
            let t_rt = Instant::now();
            match link.verify(tree_message(&drafted), step_timeout).await {
                Ok(v) => break (v, t_rt.elapsed()),
                Err(e) if e.code() == Code::Unavailable && failovers < MAX_FAILOVERS => {
                    // The node died or drains: continue on another one from the committed
                    // tokens (prompt + generated; the root is the newest) and re-send this tree.
                    failovers += 1;
                    state.metrics.failover();
                    link.node().mark_unreachable();
                    let lost = link.addr().to_string();
                    tracing::warn!(node = %lost, error = e.message(), failovers, "verify node lost mid-generation; moving the session");
                    let mut committed = prep.prompt_tokens.clone();
                    committed.extend_from_slice(&generated);
                    debug_assert_eq!(committed.last(), Some(&root));
                    let moved = OpenSession {
                        prefix_tokens: committed[..committed.len() - 1].to_vec(),
                        sampling: Some(sampling),
                        seed: moved_seed(prep.seed, failovers),
                        max_new_tokens: (prep.max_tokens - generated.len()) as u32,
                    };
                    link = open_anywhere(state, &moved, &mut vec![lost.clone()])
                        .await
                        .map_err(|e2| {
                            Status::unavailable(format!(
                                "verify node {lost} failed mid-generation ({}) and no other node could continue it: {}",
                                e.message(),
                                e2.message()
                            ))
                        })?;
                    context_limit = context_limit.min(link.opened.context_limit as usize);
                    tracing::info!(node = %link.addr(), "session moved");
                }
                Err(e) => return Err(e),
            }
        };
        stats.roundtrip += round_trip;
        stats.verify_ms += verdict.verify_ms;
        if let (Some(pred), true) = (&plan.prediction, full_tree) {
            state
                .planner
                .observe_times(pred, verdict.verify_ms, step_draft.as_secs_f64() * 1e3);
        }
        if verdict.next_token as usize >= state.model.info().vocab_size {
            return Err(Status::internal(format!(
                "verify node {} sent token {} outside the vocabulary",
                link.addr(),
                verdict.next_token
            )));
        }
        let accepted: Vec<usize> = verdict.accepted_nodes.iter().map(|&i| i as usize).collect();
        draft
            .commit(&drafted, &accepted)
            .map_err(|e| Status::internal(format!("verify node {}: {e}", link.addr())))?;
        stats.record(&drafted, &accepted, &verdict.accepted_ranks);
        stats.steps += 1;
        debug!(
            step = stats.steps,
            accepted = accepted.len(),
            nodes = drafted.tree.len(),
            "step"
        );

        let mut emitted: Vec<u32> = accepted.iter().map(|&v| drafted.tokens[v]).collect();
        emitted.push(verdict.next_token);
        root = verdict.next_token;
        let mut chunk_ids = Vec::new();
        let mut done = false;
        for t in emitted {
            if eos.contains(&t) {
                finish = "eos";
                done = true;
                break;
            }
            generated.push(t);
            chunk_ids.push(t);
            if out.push(t)? {
                finish = "stop";
                done = true;
                break;
            }
            if generated.len() >= prep.max_tokens {
                done = true;
                break;
            }
        }
        let text = out.take_ready(done);
        if (!text.is_empty() || !chunk_ids.is_empty())
            && tx
                .send(Ok(GenerateChunk {
                    text,
                    token_ids: chunk_ids,
                    summary: None,
                }))
                .await
                .is_err()
        {
            return Ok(()); // client went away; dropping the session frees it on the verify node
        }
        if done {
            break 'steps;
        }
    }
    // Flush whatever text was held back for stop-string matching.
    let tail = out.take_ready(true);
    let gen_secs = t_gen.elapsed().as_secs_f64();
    let n = generated.len();
    fold_acceptance(state, greedy, &stats, &mut folded);
    let summary = GenerateSummary {
        prompt_tokens: prep.prompt_tokens.len() as u32,
        generated_tokens: n as u32,
        steps: stats.steps,
        mean_tokens_per_step: if stats.steps > 0 {
            n as f64 / stats.steps as f64
        } else {
            0.0
        },
        accepted_by_rank: stats.accepted_by_rank,
        trials_by_rank: stats.trials_by_rank,
        timings: Some(Timings {
            total_ms: t_start.elapsed().as_secs_f64() * 1e3,
            prefill_ms,
            draft_ms: stats.draft.as_secs_f64() * 1e3,
            verify_ms: stats.verify_ms,
            network_ms: (stats.roundtrip.as_secs_f64() * 1e3 - stats.verify_ms).max(0.0),
            tokens_per_second: if gen_secs > 0.0 {
                n as f64 / gen_secs
            } else {
                0.0
            },
        }),
        finish_reason: finish.into(),
        seed: prep.seed,
        verify_node: link.addr().to_string(),
        failovers,
        plan: Some(match &prep.forced_tree {
            None => plan.to_proto(replans),
            Some(t) => sequoia_proto::v1::TreePlan {
                parents: t.parents().to_vec(),
                nodes: t.len() as u32,
                levels: t.levels() as u32,
                expected_tokens_per_step: sequoia_shared::planner::expected_tokens(
                    t,
                    &plan.acceptance,
                ),
                mode: "request".into(),
                acceptance: plan.acceptance.clone(),
                ..Default::default()
            },
        }),
    };
    let _ = tx
        .send(Ok(GenerateChunk {
            text: tail,
            token_ids: vec![],
            summary: Some(summary),
        }))
        .await;
    Ok(())
}

/// Add this generation's new verdict statistics to the planner's running estimate.
fn fold_acceptance(state: &DraftState, greedy: bool, stats: &Stats, folded: &mut Stats) {
    let delta = |now: &[u64], before: &[u64]| -> Vec<u64> {
        now.iter()
            .enumerate()
            .map(|(i, &x)| x - before.get(i).copied().unwrap_or(0))
            .collect()
    };
    let acc = delta(&stats.accepted_by_rank, &folded.accepted_by_rank);
    let tri = delta(&stats.trials_by_rank, &folded.trials_by_rank);
    state.planner.observe_acceptance(greedy, &acc, &tri);
    folded.accepted_by_rank = stats.accepted_by_rank.clone();
    folded.trials_by_rank = stats.trials_by_rank.clone();
}

/// The node's measured costs for the auto planner, profiling it (and this node's draft cost)
/// on first use. None in fixed mode.
async fn node_costs(
    state: &Arc<DraftState>,
    node: &Arc<VerifyNode>,
) -> Result<Option<NodeCosts>, Status> {
    if !state.planner.is_auto() {
        return Ok(None);
    }
    let mut slot = node.costs.lock().await;
    if let Some(c) = slot.as_ref() {
        return Ok(Some(c.clone()));
    }
    let st = state.clone();
    tokio::task::spawn_blocking(move || st.planner.measure_draft(&st.model))
        .await
        .map_err(|e| Status::internal(format!("draft profiling task failed: {e}")))?
        .map_err(|e| Status::internal(format!("draft profiling failed: {e}")))?;
    let costs = state
        .planner
        .measure_node(node.client())
        .await
        .map_err(|s| unavailable(&node.addr, &s))?;
    tracing::info!(node = %node.addr, rtt_ms = costs.network.rtt_ms, verify_ms = ?costs.verify.ms, "profiled verify node");
    *slot = Some(costs.clone());
    Ok(Some(costs))
}

async fn next_response(
    inbound: &mut tonic::Streaming<sequoia_proto::v1::SessionResponse>,
    addr: &str,
    timeout: Duration,
) -> Result<Option<session_response::Msg>, Status> {
    match tokio::time::timeout(timeout, inbound.message()).await {
        Err(_) => Err(Status::unavailable(format!(
            "verify node {addr} did not answer within {timeout:?}"
        ))),
        Ok(Err(s)) => Err(unavailable(addr, &s)),
        Ok(Ok(None)) => Err(Status::unavailable(format!(
            "verify node {addr} ended the session unexpectedly"
        ))),
        Ok(Ok(Some(r))) => Ok(r.msg),
    }
}
