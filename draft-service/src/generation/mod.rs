//! One `Generate` call end to end. Read it in this order:
//!
//! 1. [`request`]: the request checked and tokenized ([`prepare`]);
//! 2. [`generate`] here: prefill the draft while the verify side prefills the target, then the
//!    step loop — choose the tree shape ([`Generation::next_shape`]), draft it
//!    ([`Generation::draft`]), verify it over the [`link`] (which moves the session to another
//!    verify node if one dies), commit the accepted path ([`Generation::commit`]) and stream
//!    the new text ([`text`]) — until EOS, a stop string, `max_tokens` or the context limit;
//! 3. [`summary`]: the final chunk's statistics.

mod errors;
mod link;
mod request;
mod summary;
mod text;

pub use errors::{public_status, request_id};
pub use request::{prepare, Prepared};
pub use summary::record_summary;

use crate::nodes::{unavailable, VerifyNode};
use crate::plan::ActivePlan;
use crate::state::DraftState;
use link::{AheadTree, VerifyLink};
use sequoia_core::lookup::{worth_grafting, LookupRecord};
use sequoia_core::planner::cost::{pipeline_hit_rate, NodeCosts};
use sequoia_core::stats::{AcceptanceCounts, RankCounts};
use sequoia_core::tree::Tree;
use sequoia_core::types::FinishReason;
use sequoia_engine::drafting::{DraftSession, DraftedTree, Speculation, SpeculationOutcome};
use sequoia_proto::v1::{GenerateChunk, Verdict};
use sequoia_server::admission::Permit;
use sequoia_server::wire;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use summary::StepTimes;
use text::TextOut;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;
use tracing::{debug, info_span, Instrument};

pub type ChunkTx = mpsc::Sender<Result<GenerateChunk, Status>>;

/// The chunks of one running generation: text deltas, then the chunk with the summary; or an
/// error as the last item.
pub type Chunks = ReceiverStream<Result<GenerateChunk, Status>>;

/// Run a prepared generation on a task of its own, holding the admission `slot` until it ends.
/// Both front ends (gRPC `Generate`, the HTTP API) start generations here. Dropping the
/// returned stream (the client went away) stops the generation at its next step, which closes
/// the verify session and frees the slot.
pub fn spawn(state: Arc<DraftState>, prep: Prepared, slot: Permit) -> Chunks {
    spawn_with_id(state, prep, slot, errors::request_id())
}

/// [`spawn`] under a request id the caller already gave the client. Errors reach the client in
/// their public form (code, short reason, request id); the detail goes to the log.
pub fn spawn_with_id(state: Arc<DraftState>, prep: Prepared, slot: Permit, id: String) -> Chunks {
    use futures::FutureExt;
    let (tx, rx) = mpsc::channel(16);
    let span = info_span!("request", id = %id);
    tokio::spawn(
        async move {
            let _slot = slot;
            // A panic must still end the client's stream with an error, never with a plain end
            // of stream that looks like success without a summary.
            let run = std::panic::AssertUnwindSafe(run(state.clone(), prep, &tx));
            let status = match run.catch_unwind().await {
                Ok(Ok(())) => return,
                Ok(Err(status)) => status,
                Err(panic) => Status::internal(format!(
                    "generation panicked: {}",
                    errors::panic_text(&*panic)
                )),
            };
            tracing::warn!(request_id = %id, code = ?status.code(), detail = ?status.message(), "generation failed");
            send_to_client(&state, &tx, Err(errors::public_status(&status, &id))).await;
        }
        .instrument(span),
    );
    ReceiverStream::new(rx)
}

/// Run one generation, streaming chunks to `tx`. Errors are returned for the caller to send.
pub async fn run(state: Arc<DraftState>, prep: Prepared, tx: &ChunkTx) -> Result<(), Status> {
    let t_start = Instant::now();
    generate(&state, prep, tx, t_start)
        .instrument(info_span!("generate", node = tracing::field::Empty))
        .await
}

/// What a step's committed tokens did to the generation.
enum Delivered {
    /// Keep going.
    More,
    /// The generation is complete.
    Finished(FinishReason),
    /// The client went away; dropping the link frees the session on the verify node.
    ClientGone,
}

async fn generate(
    state: &Arc<DraftState>,
    prep: Prepared,
    tx: &ChunkTx,
    t_start: Instant,
) -> Result<(), Status> {
    let (mut g, mut draft) = Generation::start(state, &prep, t_start).await?;
    let mut out = TextOut::new(&state.tokenizer, &prep.stop);
    let t_gen = Instant::now();
    let finish = loop {
        if g.generated.len() >= prep.max_tokens {
            break FinishReason::Length;
        }
        let room = g.context_limit().saturating_sub(draft.context_len());
        if room == 0 {
            break FinishReason::Context;
        }
        g.maybe_replan()?;
        if let Some(k) = g.decode_size(room) {
            // No tree pays: the verify node decodes on its own (the decode fallback).
            let (back, delivered) = g.decode(draft, k, &mut out, tx).await?;
            draft = back;
            match delivered {
                Delivered::More => continue,
                Delivered::Finished(f) => break f,
                Delivered::ClientGone => return Ok(()),
            }
        }
        let shape = match (&g.in_flight, &g.first_tree) {
            (Some(sent), _) => sent.shape.clone(),
            (_, Some(first)) => first.shape.clone(),
            (None, None) => g.step_shape(room, &draft),
        };
        let t_step = Instant::now();
        // Grown during the prefill: this step's tree, already at the node if it went with the
        // `open` (only the first step has one).
        let (mut drafted, first_sent) = match g.first_tree.take() {
            Some(first) => (first.drafted, g.first_tree_with_open),
            None => {
                let (back, drafted) = g.draft(draft, &shape).await?;
                draft = back;
                (drafted, false)
            }
        };
        let draft_ms = t_step.elapsed().as_secs_f64() * 1e3;
        let hit = drafted.was_drafted_ahead();
        if g.steps() == 0 {
            g.first_tree_early = hit;
        }
        let sent = g.in_flight.take();
        let lookup = match &sent {
            // Sent as grown, without lookup branches (they depend on text not committed then).
            Some(tree) => {
                same_as_sent(&drafted, tree)?;
                LookupStep::default()
            }
            None if first_sent => LookupStep::default(),
            None => g.add_lookup(&mut drafted, room),
        };
        // At the node already: the verdict is awaited without sending the tree. A first tree
        // can be there even where this generation does not pipeline (the latest one did).
        let at_node = sent.is_some() || first_sent;
        let (verdict, ahead) = if g.pipeline {
            let (back, verdict, ahead) = g.verify_pipelined(draft, &drafted, room, at_node).await?;
            draft = back;
            (verdict, ahead)
        } else {
            (g.verify(&drafted, at_node, None).await?, None)
        };
        let lookup_before = g.lookup_accepted;
        let emitted = g.commit(&mut draft, &drafted, &verdict, ahead)?;
        g.lookup_record.record(&lookup.guess, &emitted);
        g.observe_step(&shape, hit, t_step.elapsed(), lookup.cost_ms);
        let through_lookup = (g.lookup_accepted - lookup_before) as usize;
        g.observe_lookup(through_lookup, lookup.cost_ms);
        g.observe_tree_tokens(&shape, emitted.len().saturating_sub(through_lookup));
        debug!(
            nodes = shape.len(),
            ahead = hit,
            sent_ahead = sent.is_some(),
            accepted = emitted.len(),
            caught_up = g.caught_up,
            draft_ms,
            verify_ms = verdict.verify_ms,
            ms = t_step.elapsed().as_secs_f64() * 1e3,
            "step time"
        );
        match g.deliver(&emitted, &mut out, tx).await? {
            Delivered::More => {}
            Delivered::Finished(f) => break f,
            Delivered::ClientGone => return Ok(()),
        }
    };
    // Flush whatever text was held back for stop-string matching.
    let tail = out.take_ready(true);
    g.fold_acceptance();
    state
        .planner
        .observe_generation(prep.params.is_greedy(), &g.counts.by_rank());
    let summary = g.summary(finish, t_start, t_gen.elapsed());
    // Recorded here rather than by a front end, so gRPC and HTTP generations count alike.
    record_summary(&state.metrics, &summary);
    // End the verify session before the client hears of the end, so its cache is being kept
    // by the time the conversation's next turn arrives; then keep the draft's own.
    let mut committed = prep.prompt_tokens.clone();
    committed.extend_from_slice(&g.generated);
    drop(g);
    debug!(
        since_start_ms = t_start.elapsed().as_secs_f64() * 1e3,
        "generation done"
    );
    if state.config.prefix_cache.enabled {
        let keeper = state.clone();
        let _ = tokio::task::spawn_blocking(move || {
            keeper.keep_prefix(committed, draft.into_committed_cache())
        })
        .await;
    }
    send_to_client(
        state,
        tx,
        Ok(GenerateChunk {
            text: tail,
            token_ids: vec![],
            summary: Some(summary),
        }),
    )
    .await;
    Ok(())
}

/// Hand one item to the client's stream, waiting at most `send_timeout_secs` for room. A client
/// that stops reading fills its HTTP/2 window and then this buffer; without a deadline the
/// generation would hold its slot and its verify session for as long as the connection lives.
/// false: the client is gone or too slow, and the generation ends (freeing both).
async fn send_to_client(
    state: &DraftState,
    tx: &ChunkTx,
    item: Result<GenerateChunk, Status>,
) -> bool {
    let limit = sequoia_server::process::secs(state.config.send_timeout_secs);
    match tx.send_timeout(item, limit).await {
        Ok(()) => true,
        Err(mpsc::error::SendTimeoutError::Timeout(_)) => {
            tracing::warn!(
                send_timeout_secs = state.config.send_timeout_secs,
                "the client stopped reading its stream; ending the generation"
            );
            false
        }
        Err(mpsc::error::SendTimeoutError::Closed(_)) => false,
    }
}

/// The state of one generation between steps.
struct Generation<'a> {
    state: &'a Arc<DraftState>,
    prep: &'a Prepared,
    link: VerifyLink,
    /// The newest committed token: the next tree's root.
    root: u32,
    generated: Vec<u32>,
    costs: Option<NodeCosts>,
    plan: ActivePlan,
    replans: u32,
    counts: AcceptanceCounts,
    /// Counts already folded into the planner's running estimate.
    folded: RankCounts,
    times: StepTimes,
    /// Prompt-lookup nodes sent, and accepted.
    lookup_proposed: u64,
    lookup_accepted: u64,
    /// What this generation's lookup guesses would have been worth, sent or not.
    lookup_record: LookupRecord,
    /// Drafted tokens verified so far (tree nodes minus roots).
    drafted: u64,
    /// Pipelined drafting (docs/ALGORITHMS.md §10): the request's choice, else the configured
    /// default unless the verify node shares this node's CPUs.
    pipeline: bool,
    /// Pipelined drafting: steps whose tree had been grown ahead, steps where it had not
    /// (though the step before tried), the draft time those misses cost, and the time spent
    /// drafting ahead during the last verification (until the next tree shows hit or miss).
    pipeline_hits: u32,
    pipeline_misses: u32,
    pipeline_wasted: Duration,
    /// Sessions in the verify node's recent batches (smoothed, ≥ 1): its load. The planner
    /// prices a tree of n nodes as a forward of n × this many rows (every session sending a
    /// tree like ours), so trees shrink when the node is busy.
    load_sessions: f64,
    ahead_time: Option<Duration>,
    /// The first tree had been grown (whole or in part) during the verify node's prefill.
    first_tree_early: bool,
    /// The first tree, complete before the verify node had prefilled the prompt: the first
    /// step verifies it (it went with the `open` unless the node answered first).
    first_tree: Option<FirstTree>,
    /// The first tree went to the verify node with the `open` (the first step waits for its
    /// verdict without sending it).
    first_tree_with_open: bool,
    /// A tree sent ahead that the latest verdict confirmed: the verify node is verifying it,
    /// so the next step takes it over instead of sending a tree (docs/ALGORITHMS.md §10).
    in_flight: Option<AheadTree>,
    /// Steps whose tree had been sent ahead and was confirmed.
    ahead_taken: u32,
    /// Committed tokens the draft caught up over before its latest tree.
    caught_up: usize,
    /// Tokens the verify node decoded on its own (the decode fallback), and whether a decode
    /// ended since the last re-plan (each one is followed by a re-plan).
    fallback_tokens: u32,
    /// Tokens the decode fallback committed since the last tree step (when to probe).
    decoded_since_tree: usize,
    replan_due: bool,
    /// When the generation started, and when text last went to the client (for the
    /// time-to-first-token and inter-token-latency metrics).
    t_start: Instant,
    last_delivery: Option<Instant>,
}

impl<'a> Generation<'a> {
    /// Prefill the draft model while the verify node prefills the target, and make the first
    /// plan. The verify node holds every committed token but the newest (the root).
    async fn start(
        state: &'a Arc<DraftState>,
        prep: &'a Prepared,
        t_start: Instant,
    ) -> Result<(Generation<'a>, DraftSession), Status> {
        let prompt = &prep.prompt_tokens;
        let (prefix, root) = (
            prompt[..prompt.len() - 1].to_vec(),
            prompt[prompt.len() - 1],
        );
        let model = state.model.clone();
        let (params, seed, wire_k) = (prep.params, prep.seed, state.config.wire_top_k);
        let head_vocab = state.config.draft_vocab;
        let t_prefill = Instant::now();
        let draft_prefix = prefix.clone();
        // The previous turn of this conversation may have left its draft cache: then only the
        // new part of the prompt is prefilled (the verify node does the same on its side).
        let kept = state.take_prefix(&prefix);
        // The verify node's prefill of the target takes longer than the draft's: meanwhile the
        // draft grows the first tree of the latest pipelined generation (this one's plan is
        // only known once the session is open, and is nearly always the same), until the
        // session opens; a tree forced by the request is grown instead. Only where the latest
        // generation pipelined: on shared CPUs the growth would slow the verify prefill down.
        let early_tree = state
            .first_trees
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(prep.params.is_greedy())
            .filter(|_| state.config.pipeline.first_tree_during_prefill)
            .filter(|_| prep.pipeline != Some(false))
            .map(|planned| prep.forced_tree.clone().unwrap_or(planned))
            .filter(|t| t.len() > 1 && prompt.len() + t.len() < state.context_limit());
        // Complete before the node has answered, it goes right behind the `open`.
        let (first_tx, first_rx) = match &early_tree {
            Some(_) if state.config.pipeline.first_tree_with_open => {
                let (tx, rx) = tokio::sync::watch::channel(None);
                (Some(tx), Some(rx))
            }
            _ => (None, None),
        };
        let first_shape = early_tree.clone();
        let opened = Arc::new(AtomicBool::new(false));
        let stop = opened.clone();
        let draft_prefill = tokio::task::spawn_blocking(move || {
            let draft = match kept {
                Some(k) => DraftSession::resume(
                    &model,
                    k.cache,
                    k.reused,
                    &draft_prefix,
                    params,
                    seed,
                    wire_k,
                ),
                None => DraftSession::new(&model, &draft_prefix, params, seed, wire_k),
            }
            .map(|d| d.with_head_vocab(&model, head_vocab));
            let prefilled = Instant::now();
            let draft = draft.and_then(|mut d| {
                let mut first = None;
                if let Some(shape) = &early_tree {
                    d.grow_ahead(&model, root, shape, usize::MAX, &stop)?;
                    // Whole while the node still prefills: from here on it is the first
                    // step's tree, and it goes to the node now.
                    if let (Some(tx), false) = (&first_tx, stop.load(Ordering::Acquire)) {
                        let drafted = d.grow(&model, root, shape)?;
                        tx.send_replace(Some(wire::tree_message(
                            &drafted.tree,
                            &drafted.tokens,
                            &drafted.dists,
                        )));
                        first = Some(drafted);
                    }
                }
                Ok((d, first))
            });
            (draft, prefilled)
        });
        let sampling = wire::sampling_config(&prep.params);
        let link = VerifyLink::open(state, prefix, sampling, seed, prep.max_tokens, first_rx).await;
        opened.store(true, Ordering::Release);
        let link_opened = Instant::now();
        let link = match link {
            Ok(link) => link,
            Err(e) => {
                // The prefill cannot be stopped midway: wait for it, so this generation's slot
                // stays taken (the work stays counted) until the CPU is free again.
                let _ = draft_prefill.await;
                return Err(e);
            }
        };
        tracing::Span::current().record("node", link.addr());
        let (draft, draft_prefilled) = draft_prefill
            .await
            .map_err(|e| Status::internal(format!("draft prefill task failed: {e}")))?;
        let (draft, first_drafted) =
            draft.map_err(|e| Status::internal(format!("draft model failed: {e}")))?;
        // Both prefills, not the early growth: that belongs to the first step.
        let times = StepTimes {
            prefill_ms: link_opened
                .max(draft_prefilled)
                .duration_since(t_prefill)
                .as_secs_f64()
                * 1e3,
            ..StepTimes::default()
        };
        let costs = node_costs(state, link.node()).await?;
        let pipeline = match prep.pipeline {
            Some(asked) => asked,
            None => {
                let cfg = &state.config.pipeline;
                cfg.enabled && (cfg.on_shared_cpus || !link.node().shares_cpus().await)
            }
        };
        let hit = pipeline.then(|| pipeline_hit_rate(0, 0));
        let plan = plan(
            state,
            costs.as_ref(),
            prep.params.is_greedy(),
            &RankCounts::default(),
            hit,
            1.0,
            link.can_decode(),
        )?;
        let first_tree_with_open = link.first_tree_sent();
        let first_tree = first_drafted
            .zip(first_shape)
            .map(|(drafted, shape)| FirstTree { drafted, shape });
        let g = Generation {
            state,
            prep,
            link,
            root,
            generated: Vec::new(),
            costs,
            plan,
            replans: 0,
            counts: AcceptanceCounts::default(),
            folded: RankCounts::default(),
            times,
            lookup_proposed: 0,
            lookup_accepted: 0,
            lookup_record: LookupRecord::default(),
            drafted: 0,
            pipeline,
            pipeline_hits: 0,
            pipeline_misses: 0,
            pipeline_wasted: Duration::ZERO,
            load_sessions: 1.0,
            ahead_time: None,
            first_tree_early: false,
            first_tree,
            first_tree_with_open,
            in_flight: None,
            ahead_taken: 0,
            caught_up: 0,
            fallback_tokens: 0,
            decoded_since_tree: 0,
            replan_due: false,
            t_start,
            last_delivery: None,
        };
        debug!(
            since_start_ms = t_start.elapsed().as_secs_f64() * 1e3,
            prefill_ms = g.times.prefill_ms,
            link_open_ms = link_opened.duration_since(t_prefill).as_secs_f64() * 1e3,
            draft_prefill_ms = draft_prefilled.duration_since(t_prefill).as_secs_f64() * 1e3,
            first_tree = g.first_tree.is_some(),
            first_tree_with_open = g.first_tree_with_open,
            "generation ready"
        );
        if prep.forced_tree.is_none() {
            let room = g.context_limit().saturating_sub(draft.context_len());
            let first = pipeline.then(|| g.next_shape(room));
            state
                .first_trees
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .set(prep.params.is_greedy(), first);
        }
        Ok((g, draft))
    }

    fn context_limit(&self) -> usize {
        self.state.context_limit().min(self.link.context_limit())
    }

    fn steps(&self) -> u32 {
        self.counts.steps as u32
    }

    /// Every `replan_every` steps, after the [`EARLY_REPLANS`] steps, and after every decode:
    /// fold the new verdicts into the estimate and plan again.
    fn maybe_replan(&mut self) -> Result<(), Status> {
        let steps = self.steps();
        let every = self.state.planner.replan_every();
        if self.replan_due || (steps > 0 && (steps % every == 0 || EARLY_REPLANS.contains(&steps)))
        {
            self.replan_due = false;
            self.fold_acceptance();
            self.plan = plan(
                self.state,
                self.costs.as_ref(),
                self.prep.params.is_greedy(),
                &self.counts.by_rank(),
                self.pipeline_hit(),
                self.load_sessions,
                self.link.can_decode(),
            )?;
            self.replans += 1;
            if tracing::enabled!(tracing::Level::DEBUG) {
                let planner = &self.state.planner;
                let (verify_one, verify_tree, draft) = planner.drift();
                let best = self.plan.prediction.as_ref();
                debug!(
                    steps,
                    p = ?self.plan.acceptance.iter().take(3).map(|p| (p * 1e3).round() / 1e3).collect::<Vec<_>>(),
                    own_weight = planner.own_prior_trials(self.prep.params.is_greedy()),
                    nodes = best.map_or(0, |b| b.nodes),
                    decode = ?self.plan.decode_tokens,
                    speedup = best.map_or(0.0, |b| b.speedup),
                    verify_one,
                    verify_tree,
                    draft,
                    "plan"
                );
            }
        }
        Ok(())
    }

    /// Tokens to ask the verify node to decode on its own now, with `room` tokens of context
    /// left: Some when the plan is no speculation served by the decode fallback, the node takes
    /// it, the request forces no tree, and this step is not a probe.
    fn decode_size(&self, room: usize) -> Option<usize> {
        let k = self.plan.decode_tokens?;
        // A tree sent ahead that the last verdict confirmed is being verified already: its
        // verdict comes next, whatever the plan now says.
        if self.prep.forced_tree.is_some()
            || !self.link.can_decode()
            || self.in_flight.is_some()
            || self.first_tree.is_some()
        {
            return None;
        }
        if self.next_shape(room).len() != 1 {
            return None;
        }
        let left = self.prep.max_tokens - self.generated.len();
        Some(k.min(left).min(room)).filter(|&k| k > 0)
    }

    /// One decode of up to `k` tokens by the verify node alone: the tokens are committed and
    /// streamed as they arrive (EOS, stop strings and `max_tokens` exactly as for verified
    /// tokens), and the draft queues them for its next tree. A lost node's decode continues on
    /// another node from the committed tokens.
    ///
    /// Where the draft has CPUs of its own (the generation pipelines), it also runs the queued
    /// tokens through its model while the next message is on its way (docs/ALGORITHMS.md §5.5,
    /// "The draft keeps up"), so the next tree does not start with a catch-up over every
    /// decoded token; elsewhere that work would slow the verify node down, and it waits for a
    /// tree as before.
    async fn decode(
        &mut self,
        draft: DraftSession,
        k: usize,
        out: &mut TextOut<'_>,
        tx: &ChunkTx,
    ) -> Result<(DraftSession, Delivered), Status> {
        let t0 = Instant::now();
        let per_message = self.state.config.fallback.tokens_per_message;
        self.link.start_decode(self.root, k, per_message).await;
        // One round trip: counted as one step (with no drafted tokens), like a root-only tree.
        self.counts
            .record_step(&Tree::chain(1), &[], std::iter::empty(), 0);
        self.replan_due = true;
        let mut result = Delivered::More;
        let keep_up = self.pipeline;
        let mut slot = Some(draft);
        // The draft's catch-up over the tokens of earlier messages, while the next one comes.
        let mut catching: Option<tokio::task::JoinHandle<_>> = None;
        loop {
            let remaining = self.prep.max_tokens - self.generated.len();
            let (prompt, generated) = (&self.prep.prompt_tokens, &self.generated);
            let committed = || {
                let mut c = prompt.clone();
                c.extend_from_slice(generated);
                c
            };
            let m = self.link.decoded(self.state, committed, remaining).await;
            if let Some(task) = catching.take() {
                let (back, caught): (DraftSession, Result<usize, sequoia_engine::EngineError>) =
                    task.await
                        .map_err(|e| Status::internal(format!("draft task failed: {e}")))?;
                caught.map_err(|e| Status::internal(format!("draft model failed: {e}")))?;
                slot = Some(back);
            }
            let m = m?;
            let draft = slot
                .as_mut()
                .expect("the draft is back once its catch-up ends");
            self.times.verify_ms += m.verify_ms;
            let sessions = m.batch_sessions.clamp(1, MAX_LOAD_SESSIONS) as f64;
            self.load_sessions = 0.5 * self.load_sessions + 0.5 * sessions;
            if let (Some(costs), false) = (&self.costs, m.tokens.is_empty()) {
                let rows = m.batch_rows.max(1) as usize;
                self.state
                    .planner
                    .observe_verify(costs, rows, m.tokens.len(), m.verify_ms);
            }
            if let Some(&newest) = m.tokens.last() {
                // The draft follows: the old root and every decoded token but the newest (the
                // next root) become its pending context.
                let mut follow = Vec::with_capacity(m.tokens.len());
                follow.push(self.root);
                follow.extend_from_slice(&m.tokens[..m.tokens.len() - 1]);
                draft.commit_decoded(&follow);
                self.root = newest;
                self.fallback_tokens += m.tokens.len() as u32;
                self.decoded_since_tree += m.tokens.len();
                self.counts.tokens += m.tokens.len() as u64;
                result = self.deliver(&m.tokens, out, tx).await?;
            }
            if m.done || !matches!(result, Delivered::More) {
                break;
            }
            if keep_up && draft.pending_len() >= KEEP_UP_CHUNK {
                let mut session = slot.take().expect("the draft is here between messages");
                let model = self.state.model.clone();
                catching = Some(tokio::task::spawn_blocking(move || {
                    let caught = session.catch_up(&model);
                    (session, caught)
                }));
            }
        }
        self.times.roundtrip += t0.elapsed();
        self.state.planner.relax_after_decode();
        debug!(
            tokens = k,
            ms = t0.elapsed().as_secs_f64() * 1e3,
            "decode time"
        );
        Ok((
            slot.expect("the draft is back after the last message"),
            result,
        ))
    }

    /// Pipelined requests: the estimated chance that a verdict is one the draft grew the next
    /// tree for, from this generation's hits and misses so far (what the planner's step time
    /// assumes). None when the request does not pipeline.
    fn pipeline_hit(&self) -> Option<f64> {
        self.pipeline
            .then(|| pipeline_hit_rate(self.pipeline_hits, self.pipeline_misses))
    }

    /// The tree to draft with `room` tokens of context left.
    fn next_shape(&self, room: usize) -> Tree {
        self.shape_at(room, self.steps())
    }

    /// The tree to draft this step: the plan's, or, when pipelining and the draft holds no
    /// tree grown ahead for this root (a miss, or the first step), the plan's miss tree:
    /// drafted while the verify node waits, it is sized for that (docs/ALGORITHMS.md §10).
    /// Probes and forced trees are drafted as they are.
    fn step_shape(&self, room: usize, draft: &DraftSession) -> Tree {
        let planned = self.next_shape(room);
        if !self.pipeline
            || self.prep.forced_tree.is_some()
            || draft.holds_ahead(self.root, &planned)
        {
            return planned;
        }
        self.plan.on_miss(planned, room)
    }

    /// The tree to draft at step `steps` (steps verified before it) with `room` tokens left.
    fn shape_at(&self, room: usize, steps: u32) -> Tree {
        let every = self.state.planner.replan_every();
        match &self.prep.forced_tree {
            Some(t) if t.len() <= room => t.clone(),
            // Auto mode without speculation would never see a verdict again: probe with a
            // two-node chain once every two re-plan periods, or once `PROBE_AFTER_TOKENS`
            // tokens were decoded since the last tree, so that the acceptance estimate and the
            // tree and draft factors keep learning (a probe costs the draft's catch-up over
            // the tokens it skipped) — but only while a tree could pay at an optimistic
            // acceptance (`plan.probe`). Every four periods was too rare where decodes are one
            // token each (one host): a generation whose first trees were unlucky stayed on
            // decodes for 64 tokens. Periods count decode messages, of 5–6 tokens each at two
            // hosts (RTT 10 ms), so there a probe came after some 180 tokens: never, in a
            // 64-token answer that two slow steps had put on decodes.
            _ if self.plan.is_auto()
                && self.plan.probe
                && self.plan.shape(room).len() == 1
                && room >= 2
                && probe_due(steps, every, self.decoded_since_tree) =>
            {
                Tree::chain(2)
            }
            _ => self.plan.shape(room),
        }
    }

    /// A step of `shape` took `took`, from drafting to following its verdict: the planner
    /// learns what its step-time model misses (`Planner::observe_step`) from steps of the
    /// plan's own tree. Not from probes (another shape), nor from the first tree after a
    /// decode, whose draft first caught up over the decoded tokens (the switch's cost, not a
    /// step's), nor from a generation's first step (first touches of its caches on both nodes:
    /// on a fresh service one slow first step put the demo on decodes).
    /// With pipelining, a step is compared with the prediction of its kind: a hit with the
    /// planned tree's overlapped step, a miss with the miss tree's step.
    fn observe_step(&self, shape: &Tree, hit: bool, took: Duration, lookup_ms: f64) {
        let plan = &self.plan;
        if !(plan.is_auto()
            && plan.decode_tokens.is_none()
            && self.caught_up <= 1
            && self.steps() > 1)
        {
            return;
        }
        let Some(pred) = &plan.prediction else {
            return;
        };
        // Each prediction holds the average lookup time per step (`Prediction::lookup_ms`).
        let predicted = match (pred.hit_step_ms, &plan.miss_prediction) {
            (Some(hit_ms), _) if hit && shape.len() == plan.full_size() => {
                Some(hit_ms - pred.lookup_ms)
            }
            (Some(_), Some(miss)) if !hit && shape.len() == miss.nodes => {
                Some(miss.step_ms - miss.lookup_ms)
            }
            (Some(_), _) => None,
            (None, _) => (shape.len() == plan.full_size()).then_some(pred.step_ms - pred.lookup_ms),
        };
        if let Some(ms) = predicted {
            // The lookup nodes sent this step were priced apart: this step's price replaces
            // the average.
            self.state
                .planner
                .observe_step(ms + lookup_ms, took.as_secs_f64() * 1e3);
        }
    }

    /// Teach the planner how the acceptance model's G for the plan's own tree compares with the
    /// tokens a step of it committed from drafted nodes (docs/ALGORITHMS.md §5.4, "Acceptance
    /// bias"). Auto plans only, full-size trees only (not probes, miss trees or trees shrunk by
    /// the context's end), not forced trees.
    fn observe_tree_tokens(&self, shape: &Tree, tree_tokens: usize) {
        let plan = &self.plan;
        if plan.is_auto()
            && plan.decode_tokens.is_none()
            && self.prep.forced_tree.is_none()
            && shape.len() > 1
            && *shape == plan.shape(usize::MAX)
        {
            self.state.planner.observe_tree_tokens(
                self.prep.params.is_greedy(),
                plan.expected_tokens(),
                tree_tokens,
            );
        }
    }

    /// Teach the planner what this tree step's lookup branch added (docs/ALGORITHMS.md §9, "In
    /// the prediction"): `tokens` committed by accepted lookup nodes, `ms` priced for the nodes
    /// the branch added. Greedy steps of auto plans only, branch or not: lookup branches go to
    /// greedy requests, and a tree the request forced is no plan's.
    fn observe_lookup(&self, tokens: usize, ms: f64) {
        if self.plan.is_auto() && self.prep.params.is_greedy() && self.prep.forced_tree.is_none() {
            self.state.planner.observe_lookup(tokens, ms);
        }
    }

    /// Grow the tree with the draft model (CPU-bound, so off the async workers).
    async fn draft(
        &mut self,
        mut draft: DraftSession,
        shape: &Tree,
    ) -> Result<(DraftSession, DraftedTree), Status> {
        let t0 = Instant::now();
        let (model, root, grown) = (self.state.model.clone(), self.root, shape.clone());
        let (back, drafted, growing) = tokio::task::spawn_blocking(move || {
            // The catch-up over committed tokens (after a decode, dozens) is not the tree's
            // cost: time the tree's own forwards apart for the planner.
            let caught_up = if grown.len() > 1 {
                draft.catch_up(&model)
            } else {
                Ok(0)
            };
            let t1 = Instant::now();
            let r = caught_up.and_then(|n| Ok((n, draft.grow(&model, root, &grown)?)));
            (draft, r, t1.elapsed())
        })
        .await
        .map_err(|e| Status::internal(format!("draft task failed: {e}")))?;
        draft = back;
        let (caught_up, drafted) =
            drafted.map_err(|e| Status::internal(format!("draft model failed: {e}")))?;
        self.caught_up = caught_up;
        self.times.draft += t0.elapsed();
        if shape.len() > 1 && !drafted.was_drafted_ahead() && self.plan.is_auto() {
            self.state
                .planner
                .observe_draft(shape, growing.as_secs_f64() * 1e3);
        }
        if let Some(ahead) = self.ahead_time.take() {
            if drafted.was_drafted_ahead() {
                self.pipeline_hits += 1;
            } else {
                self.pipeline_misses += 1;
                self.pipeline_wasted += ahead;
            }
        }
        Ok((draft, drafted))
    }

    /// Graft a prompt-lookup branch onto the tree (greedy requests, while context and
    /// `max_tokens` leave room for it). A tree shape forced by the request is sent exactly as
    /// given: benchmarks force root-only trees to measure plain target decoding.
    ///
    /// In auto mode the branch is priced (docs/ALGORITHMS.md §9, "What a branch costs"): each
    /// added node costs the verify time of one more row on the node, and only the prefix of the
    /// guess whose expected tokens (from this generation's [`LookupRecord`]) are worth more than
    /// that at the plan's rate is grafted.
    fn add_lookup(&mut self, drafted: &mut DraftedTree, room: usize) -> LookupStep {
        let params = self.state.config.lookup.params();
        if !params.enabled() || !self.prep.params.is_greedy() || self.prep.forced_tree.is_some() {
            return LookupStep::default();
        }
        let left = self.prep.max_tokens - self.generated.len();
        let budget = room.saturating_sub(drafted.tree.len()).min(left);
        let mut context = self.prep.prompt_tokens.clone();
        context.extend_from_slice(&self.generated);
        let chain = sequoia_core::lookup::continuation(&context, &params);
        let chain = &chain[..chain.len().min(budget)];
        let (mut send, mut cost_ms) = (chain.len(), 0.0);
        if let (Some(costs), Some(pred)) = (&self.costs, &self.plan.prediction) {
            if pred.expected_tokens > 0.0 {
                let (n, load) = (drafted.tree.len(), self.load_sessions);
                let planner = &self.state.planner;
                let node_ms = |j: usize| {
                    planner.verify_ms(costs, n + j, load)
                        - planner.verify_ms(costs, n + j - 1, load)
                };
                let (_, merged) = drafted.tree.follow_chain(&drafted.tokens, chain);
                let per_token = pred.step_ms / pred.expected_tokens;
                send = worth_grafting(&self.lookup_record, chain.len(), merged, per_token, node_ms);
                cost_ms = (1..=send.saturating_sub(merged)).map(node_ms).sum();
            }
        }
        self.lookup_proposed += drafted.graft_lookup(&chain[..send]) as u64;
        LookupStep {
            guess: chain.to_vec(),
            cost_ms,
        }
    }

    /// Verify the drafted tree (on whichever node holds the session) and check the verdict.
    /// `sent`: it went ahead of the previous verdict, which confirmed it (it is not sent
    /// again). Trees arriving on `ahead` meanwhile are sent ahead of this verdict; the one it
    /// confirms becomes [`Generation::in_flight`].
    async fn verify(
        &mut self,
        drafted: &DraftedTree,
        sent: bool,
        ahead: Option<&mut mpsc::UnboundedReceiver<AheadTree>>,
    ) -> Result<Verdict, Status> {
        let committed = || {
            let mut c = self.prep.prompt_tokens.clone();
            c.extend_from_slice(&self.generated);
            c
        };
        let remaining = self.prep.max_tokens - self.generated.len();
        let message = || wire::tree_message(&drafted.tree, &drafted.tokens, &drafted.dists);
        let (verdict, round_trip, taken) = self
            .link
            .verify(self.state, message, committed, remaining, sent, ahead)
            .await?;
        self.ahead_taken += taken.is_some() as u32;
        self.in_flight = taken;
        self.times.roundtrip += round_trip;
        self.times.verify_ms += verdict.verify_ms;
        let sessions = verdict.batch_sessions.clamp(1, MAX_LOAD_SESSIONS) as f64;
        self.load_sessions = 0.5 * self.load_sessions + 0.5 * sessions;
        if let Some(costs) = &self.costs {
            // Nodes that do not report their batch: the tree was the forward.
            let rows = match verdict.batch_rows {
                0 => drafted.tree.len(),
                r => r as usize,
            };
            self.state
                .planner
                .observe_verify(costs, rows, 1, verdict.verify_ms);
        }
        if verdict.next_token as usize >= self.state.model.info().vocab_size {
            return Err(Status::internal(format!(
                "verify node {} sent token {} outside the vocabulary",
                self.link.addr(),
                verdict.next_token
            )));
        }
        Ok(verdict)
    }

    /// [`verify`](Self::verify), while the draft grows the next tree ahead for the likeliest
    /// verdicts (pipelined drafting, docs/ALGORITHMS.md §10) on a blocking thread. The
    /// verdict's arrival stops it (after the level in progress); what it grew goes to
    /// [`commit`](Self::commit).
    ///
    /// Each candidate's tree, once complete, goes to the verify node ahead of the verdict it
    /// assumes (`pipeline.send_ahead`), unless that verdict would end the generation or leave
    /// no room for it.
    async fn verify_pipelined(
        &mut self,
        mut draft: DraftSession,
        drafted: &DraftedTree,
        room: usize,
        sent: bool,
    ) -> Result<(DraftSession, Verdict, Option<Speculation>), Status> {
        // The next step's shape, assuming the deepest path (the least room) and the plan as it
        // is; if the plan changes at the next re-plan, the tree grown ahead is dropped.
        let next = self.shape_at(room.saturating_sub(drafted.tree.levels()), self.steps() + 1);
        if next.len() < 2 || drafted.forwarded() == 0 {
            return Ok((draft, self.verify(drafted, sent, None).await?, None));
        }
        let cfg = &self.state.config.pipeline;
        let ends = drafted.likeliest_ends(&self.plan.acceptance, cfg.candidates);
        let stop = Arc::new(AtomicBool::new(false));
        let (model, tree, flag, max) = (
            self.state.model.clone(),
            drafted.clone(),
            stop.clone(),
            cfg.max_forwards,
        );
        let (ahead_tx, mut ahead_rx) = mpsc::unbounded_channel();
        let rules = cfg.send_ahead.then(|| SendAhead {
            eos: self.state.tokenizer.eos_ids().to_vec(),
            tokens_left: self.prep.max_tokens - self.generated.len(),
            room,
            shape: next.clone(),
        });
        let ahead = tokio::task::spawn_blocking(move || {
            let t0 = Instant::now();
            let mut send = |end, t| {
                if let Some(message) = rules.as_ref().and_then(|r| r.message(&tree, end, t)) {
                    let _ = ahead_tx.send(message);
                }
            };
            let send: Option<&mut dyn FnMut(usize, DraftedTree)> = match &rules {
                Some(_) => Some(&mut send),
                None => None,
            };
            let spec = draft.speculate(&model, &tree, &next, &ends, max, &flag, send);
            (draft, spec, t0.elapsed())
        });
        let verdict = self.verify(drafted, sent, Some(&mut ahead_rx)).await;
        stop.store(true, Ordering::Relaxed);
        let stopped = Instant::now();
        let (draft, spec, took) = ahead
            .await
            .map_err(|e| Status::internal(format!("draft task failed: {e}")))?;
        debug!(
            wait_ms = stopped.elapsed().as_secs_f64() * 1e3,
            "growth ahead stopped"
        );
        let verdict = verdict?;
        let spec = spec.map_err(|e| Status::internal(format!("draft model failed: {e}")))?;
        self.ahead_time = Some(took);
        Ok((draft, verdict, Some(spec)))
    }

    /// Follow the verdict in the draft's cache (keeping a tree grown `ahead` if the verdict
    /// is the one it assumed) and count it; returns the committed tokens (accepted path, then
    /// the corrected/bonus token).
    fn commit(
        &mut self,
        draft: &mut DraftSession,
        drafted: &DraftedTree,
        verdict: &Verdict,
        ahead: Option<Speculation>,
    ) -> Result<Vec<u32>, Status> {
        self.decoded_since_tree = 0;
        let accepted: Vec<usize> = verdict.accepted_nodes.iter().map(|&i| i as usize).collect();
        // The path through the tree the draft grew: what its statistics count (lookup nodes are
        // counted apart), and where a pipelined step's verdict ended.
        let (grown, path) = drafted.drafted_path(&accepted);
        let followed = match ahead {
            None => draft.commit(drafted, &accepted).map(|()| None),
            Some(spec) => {
                // How the verdict met the guesses grown ahead (how misses miss: at another end
                // node, or at a grown end with another token). The fields are only computed
                // when the line is logged.
                let end = path.last().copied().unwrap_or(0);
                debug!(
                    end,
                    next = verdict.next_token,
                    end_grown = spec.candidates().iter().any(|&(e, _)| e == end),
                    hit = spec.candidates().contains(&(end, Some(verdict.next_token))),
                    candidates = ?spec.candidates(),
                    "speculation"
                );
                draft
                    .commit_speculated(drafted, &accepted, verdict.next_token, spec)
                    .map(Some)
            }
        };
        let outcome = followed
            .map_err(|e| Status::internal(format!("verify node {}: {e}", self.link.addr())))?;
        if self.in_flight.is_some() && outcome != Some(SpeculationOutcome::Hit) {
            // The verdict confirmed a tree sent ahead, so its growth must be the one kept.
            return Err(Status::internal(
                "a tree sent ahead was confirmed but the draft did not keep its growth",
            ));
        }
        let ranks = verdict.accepted_ranks.iter().map(|&r| r as usize);
        self.counts
            .record_step(grown, &path, ranks, accepted.len() + 1);
        self.lookup_accepted += accepted.iter().filter(|&&v| drafted.is_lookup(v)).count() as u64;
        let draft_tokens = drafted.tree.len().saturating_sub(1);
        self.drafted += draft_tokens as u64;
        self.state.metrics.spec_step(draft_tokens, accepted.len());
        debug!(
            step = self.steps(),
            accepted = accepted.len(),
            nodes = drafted.tree.len(),
            "step"
        );
        let mut emitted: Vec<u32> = accepted.iter().map(|&v| drafted.tokens[v]).collect();
        emitted.push(verdict.next_token);
        self.root = verdict.next_token;
        Ok(emitted)
    }

    /// Append the committed tokens to the output (up to EOS, a stop string or `max_tokens`)
    /// and send the new text.
    async fn deliver(
        &mut self,
        emitted: &[u32],
        out: &mut TextOut<'_>,
        tx: &ChunkTx,
    ) -> Result<Delivered, Status> {
        let eos = self.state.tokenizer.eos_ids();
        let mut chunk_ids = Vec::new();
        let mut finished = None;
        for &t in emitted {
            if eos.contains(&t) {
                finished = Some(FinishReason::Eos);
                break;
            }
            self.generated.push(t);
            chunk_ids.push(t);
            if out.push(t)? {
                finished = Some(FinishReason::Stop);
                break;
            }
            if self.generated.len() >= self.prep.max_tokens {
                finished = Some(FinishReason::Length);
                break;
            }
        }
        let text = out.take_ready(finished.is_some());
        if !text.is_empty() || !chunk_ids.is_empty() {
            let now = Instant::now();
            match self.last_delivery {
                None => self.state.metrics.first_token(now - self.t_start),
                Some(last) => self.state.metrics.inter_token(now - last, chunk_ids.len()),
            }
            self.last_delivery = Some(now);
            let chunk = GenerateChunk {
                text,
                token_ids: chunk_ids,
                summary: None,
            };
            if !send_to_client(self.state, tx, Ok(chunk)).await {
                return Ok(Delivered::ClientGone);
            }
        }
        Ok(finished.map_or(Delivered::More, Delivered::Finished))
    }

    /// Add the verdict statistics counted since the last fold to the planner's estimate.
    fn fold_acceptance(&mut self) {
        let now = self.counts.by_rank();
        let new = now.since(&self.folded);
        self.state
            .planner
            .observe_acceptance(self.prep.params.is_greedy(), &new);
        self.folded = now;
    }
}

/// A generation's first tree, grown whole during the verify node's prefill.
struct FirstTree {
    drafted: DraftedTree,
    /// The planned shape it was grown for.
    shape: Tree,
}

/// A step's prompt-lookup guess: whole (also the part not sent), for the record after the
/// verdict, and the verify time priced for the nodes it added.
#[derive(Default)]
struct LookupStep {
    guess: Vec<u32>,
    cost_ms: f64,
}

/// What decides whether a candidate's next tree may go ahead of the verdict it assumes, and
/// its wire form: the verdict must leave the generation running (no EOS among its tokens, fewer
/// than the tokens left) with room in the context for the tree.
struct SendAhead {
    eos: Vec<u32>,
    tokens_left: usize,
    room: usize,
    shape: Tree,
}

impl SendAhead {
    /// The tree `next` grown for the verdict that ends at node `end` of `tree` (in indices of
    /// the tree as drafted) and draws `next`'s root, as a tree to send ahead; None if it may
    /// not go.
    fn message(&self, tree: &DraftedTree, end: usize, next: DraftedTree) -> Option<AheadTree> {
        let (accepted, mut emitted) = tree.path_to_drafted(end)?;
        emitted.push(next.tokens[0]);
        if emitted.iter().any(|t| self.eos.contains(t))
            || emitted.len() >= self.tokens_left
            || emitted.len() + next.tree.len() > self.room
        {
            return None;
        }
        let mut message = wire::tree_message(&next.tree, &next.tokens, &next.dists);
        message.assumes = Some(sequoia_proto::v1::TreeAssumption {
            accepted_nodes: accepted.iter().map(|&v| v as u32).collect(),
        });
        Some(AheadTree {
            message,
            shape: self.shape.clone(),
        })
    }
}

/// A step's tree grown after the verdict must be the one sent ahead for it (the drafter's
/// trees depend only on the committed tokens and their position, §10); anything else is a bug,
/// reported rather than verified under the wrong tokens.
fn same_as_sent(drafted: &DraftedTree, sent: &AheadTree) -> Result<(), Status> {
    if drafted.tree.parents() == sent.message.parents.as_slice()
        && drafted.tokens == sent.message.tokens
    {
        Ok(())
    } else {
        Err(Status::internal(
            "the tree grown after a verdict differs from the one sent ahead for it",
        ))
    }
}

/// Decoded tokens the draft lets queue before it runs them through its model during a decode.
/// One forward per token would stream the draft's weights once per token; where the two hosts
/// share a memory bus (the two-host emulation) a draft forward loop slowed the target's t(1) by
/// 7 %. Eight per forward reads them an eighth as often, and leaves at most seven for the next
/// tree to catch up on.
const KEEP_UP_CHUNK: usize = 8;

/// Tokens decoded by the fallback after which the next step probes with a tree, whatever the
/// step count (see `Generation::shape_at`).
const PROBE_AFTER_TOKENS: usize = 16;

/// Whether a generation on the decode fallback probes with a tree at step `steps` (steps so
/// far, a decode message counting as one), with re-plans every `every` steps and `decoded`
/// tokens decoded since its last tree: once every two re-plan periods, or once
/// [`PROBE_AFTER_TOKENS`] tokens went by without a tree.
fn probe_due(steps: u32, every: u32, decoded: usize) -> bool {
    let period = 2 * every.max(1);
    steps % period == period - 1 || decoded >= PROBE_AFTER_TOKENS
}

/// Steps after which a generation re-plans besides every `replan_every_steps`: early, so that
/// its own acceptance (which the plan blends in) takes effect within the first tokens rather
/// than after 16 steps, which is most of a short answer. After each of the first four: each
/// step of a translation whose drafts were all rejected cost about 80 ms more than decoding its
/// one token (two hosts, RTT 0), and the whole answer was 16 tokens; a plan costs about 2 ms.
const EARLY_REPLANS: [u32; 6] = [1, 2, 3, 4, 6, 8];

/// Most sessions a verdict's `batch_sessions` is believed for (a node batches at most its
/// `max_sessions`; anything larger is a buggy or hostile peer).
const MAX_LOAD_SESSIONS: u32 = 1024;

/// The planner's plan for this node's costs and load.
fn plan(
    state: &DraftState,
    costs: Option<&NodeCosts>,
    greedy: bool,
    own: &RankCounts,
    pipeline_hit: Option<f64>,
    load_sessions: f64,
    can_decode: bool,
) -> Result<ActivePlan, Status> {
    state
        .planner
        .plan(costs, greedy, own, pipeline_hit, load_sessions, can_decode)
        .map_err(|e| Status::internal(format!("tree planner: {e}")))
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
    tokio::task::spawn_blocking(move || st.planner.measure_draft(&st.model, st.config.draft_vocab))
        .await
        .map_err(|e| Status::internal(format!("draft profiling task failed: {e}")))?
        .map_err(|e| Status::internal(format!("draft profiling failed: {e}")))?;
    let connect = std::time::Duration::from_secs_f64(state.config.connect_timeout_secs);
    // A node on this node's CPUs does not decode while our sessions wait (they tell it so at
    // `open`: `draft_shares_cpus`), so its trees are priced without that.
    let decodes_while_waiting =
        node.info(connect).await?.decodes_while_waiting && !node.shares_cpus().await;
    let costs = state
        .planner
        .measure_node(node.client(), decodes_while_waiting)
        .await
        .map_err(|s| unavailable(&node.addr, &s))?;
    tracing::info!(node = %node.addr, rtt_ms = costs.network.rtt_ms, verify_ms = ?costs.verify.ms, "profiled verify node");
    *slot = Some(costs.clone());
    Ok(Some(costs))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A generation the fallback serves keeps probing: with one-token decode messages (one
    /// host) every two re-plan periods at most, and with the multi-token messages of two hosts
    /// after [`PROBE_AFTER_TOKENS`] tokens, not only after two periods of messages (some 180
    /// tokens at six per message, longer than most answers).
    #[test]
    fn decodes_probe_by_steps_and_by_tokens() {
        let every = 16;
        // One token per message: the period's last step, and the token count at 16.
        let one_token: Vec<u32> = (0..64)
            .filter(|&s| probe_due(s, every, (s % 32) as usize))
            .collect();
        assert_eq!(one_token.first(), Some(&16));
        assert!(one_token.contains(&31));
        // Six tokens per message since the last tree: due at the third message.
        let due: Vec<usize> = (1..=5)
            .filter(|&m| probe_due(m as u32, every, 6 * m))
            .collect();
        assert_eq!(due, vec![3, 4, 5]);
        // Right after a tree, nothing is due until the period's end.
        assert!(!probe_due(4, every, 0));
        assert!(probe_due(31, every, 0));
        // A period of 0 steps (a bad setting) does not divide by zero.
        assert!(probe_due(1, 0, 0));
    }
}
