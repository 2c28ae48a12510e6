//! The `sequoia.v1.Verifier` gRPC service: a thin layer that turns messages into calls on
//! [`VerifySession`](crate::session::VerifySession) and errors into status codes.

use crate::batch::Scheduler;
use crate::config::VerifyConfig;
use crate::kv_pool::KvPool;
use crate::session::{Prepared, SessionError, SessionLimits, VerifySession};
use crate::wait::{Interrupt, Waiting};
use sequoia_core::limits;
use sequoia_core::planner::cost::CostCurve;
use sequoia_engine::tokenizer::TextTokenizer;
use sequoia_engine::Model;
use sequoia_proto::v1::verifier_server::Verifier;
use sequoia_proto::v1::{
    session_request, session_response, InfoRequest, InfoResponse, PingRequest, PingResponse,
    ProfileRequest, ProfileResponse, SessionOpened, SessionRequest, SessionResponse,
};
use sequoia_server::admission::{Admission, Permit, Refused};
use sequoia_server::metrics::Metrics;
use sequoia_server::process::secs;
use sequoia_server::wire;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::{info, info_span, warn, Instrument};

/// Everything a verify node shares across sessions.
pub struct VerifyState {
    pub model: Arc<Model>,
    pub tokenizer: Arc<TextTokenizer>,
    pub config: VerifyConfig,
    /// Session slots (`max_sessions`); refuses new sessions once draining.
    pub admission: Arc<Admission>,
    /// Set when the drain timeout has passed: open sessions end at once (UNAVAILABLE) so their
    /// draft nodes move them elsewhere.
    pub moving: tokio::sync::watch::Sender<bool>,
    /// Prometheus series (recording is a no-op when `metrics_listen` is empty).
    pub metrics: Metrics,
    /// Batches every session's work into shared forwards (`[batch] enabled`); `None` runs each
    /// session's forwards on their own.
    pub scheduler: Option<Scheduler>,
    /// KV memory reserved by open sessions against `kv_budget_mb`.
    pub kv: Arc<KvPool>,
    /// Forward times per number of rows from the latest `Profile` (the draft nodes ask for
    /// one before they plan): what a tree's forward costs against one row's, for the choice
    /// between stopping and finishing a forward run in a session's wait (crate::wait).
    pub forward_costs: std::sync::Mutex<Option<CostCurve>>,
    next_session: AtomicUsize,
}

impl VerifyState {
    pub fn new(model: Model, tokenizer: TextTokenizer, config: VerifyConfig) -> Self {
        let metrics = Metrics::for_listen("verify-service", &config.metrics_listen);
        let admission = Admission::new(config.max_sessions, metrics.clone());
        let model = Arc::new(model);
        let scheduler = config.batch.enabled.then(|| {
            Scheduler::start(
                model.clone(),
                config.batch.clone(),
                admission.clone(),
                metrics.clone(),
            )
        });
        Self {
            kv: KvPool::with_prefix_cache(
                config.kv_budget_mb.saturating_mul(1 << 20),
                &config.prefix_cache,
                metrics.clone(),
            ),
            scheduler,
            admission,
            metrics,
            model,
            tokenizer: Arc::new(tokenizer),
            config,
            moving: tokio::sync::watch::Sender::new(false),
            forward_costs: std::sync::Mutex::new(None),
            next_session: AtomicUsize::new(0),
        }
    }

    fn limits(&self) -> SessionLimits {
        SessionLimits {
            max_context: self.config.max_context,
            max_tree_nodes: self.config.max_tree_nodes,
            max_tree_levels: self.config.max_tree_levels,
            max_dist_entries: self.config.max_dist_entries,
        }
    }
}

/// Take one of the node's session slots (released when the permit drops: stream end, error or
/// disconnect).
fn admit(state: &VerifyState) -> Result<Permit, Status> {
    state.admission.try_acquire().map_err(|r| match r {
        Refused::Draining => Status::unavailable("verify node is shutting down; use another node"),
        Refused::Full { active, max } => Status::resource_exhausted(format!(
            "verify node is at its session limit ({active} of {max} active); retry later or use another node"
        )),
    })
}

/// Refuse a new stream at once (no slot held) when the node drains or is full.
fn refuse_early(state: &VerifyState) -> Result<(), Status> {
    admit(state).map(drop)
}

fn version_refused(peer: u32) -> Status {
    Status::failed_precondition(format!(
        "this verify node speaks protocol versions {}..={}, the draft node {}; upgrade the older side",
        limits::MIN_PROTOCOL_VERSION,
        limits::PROTOCOL_VERSION,
        limits::peer_protocol(peer)
    ))
}

/// Sets the flag when dropped: the blocking work of a call sees that its caller went away.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

#[derive(Clone)]
pub struct VerifierService {
    state: Arc<VerifyState>,
}

impl VerifierService {
    pub fn new(state: Arc<VerifyState>) -> Self {
        Self { state }
    }
}

pub(crate) fn to_status(e: SessionError) -> Status {
    match e {
        SessionError::Invalid(m) => Status::invalid_argument(m),
        SessionError::Exhausted(m) => Status::resource_exhausted(m),
        SessionError::Unavailable(m) => Status::unavailable(m),
        SessionError::Engine(e) => Status::internal(e.to_string()),
    }
}

/// Run blocking model work off the async threads.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(format!("verification task failed: {e}")))
}

type Tx = mpsc::Sender<Result<SessionResponse, Status>>;

async fn run_session(
    state: Arc<VerifyState>,
    mut inbound: Streaming<SessionRequest>,
    tx: &Tx,
) -> Result<(), Status> {
    // A stream holds nothing but this task until its `open` arrives, and only for so long.
    let open_timeout = secs(state.config.open_timeout_secs);
    let first = match tokio::time::timeout(open_timeout, inbound.message()).await {
        Err(_) => {
            return Err(Status::deadline_exceeded(format!(
                "no `open` message within {open_timeout:?} of the stream's start; the stream was closed"
            )))
        }
        Ok(m) => m?,
    };
    let Some(first) = first else {
        return Ok(());
    };
    let Some(session_request::Msg::Open(open)) = first.msg else {
        return Err(Status::invalid_argument(
            "the first message of a session must be `open` (prompt tokens, sampling, seed)",
        ));
    };
    let Some(version) = limits::negotiate_protocol(open.protocol_version, open.protocol_version)
    else {
        return Err(version_refused(open.protocol_version));
    };
    // The slot is taken only now, so silent streams never count against `max_sessions`.
    let _slot = admit(&state)?;
    let params = wire::sampling_from_config(open.sampling);
    let limits = state.limits();
    let prefix = open.prefix_tokens;
    let max_new = open.max_new_tokens as usize;
    let mut session = VerifySession::new(&state.model, &prefix, params, open.seed, max_new, limits)
        .map_err(to_status)?;
    // A kept cache of an earlier session whose tokens start like this prompt (the previous
    // turn of a chat): only the rest is prefilled. Taken before the reservation so that the
    // reservation cannot evict it.
    let kept = if state.config.prefix_cache.enabled {
        state.kv.take_prefix(&prefix)
    } else {
        None
    };
    // Memory for everything this session's cache can grow to, or a clear refusal now.
    let kv_bytes = session.cache_capacity() * state.model.kv_bytes_per_token();
    let kv = match state.kv.reserve(kv_bytes) {
        Ok(kv) => kv,
        Err(message) => {
            if let Some(k) = kept {
                // Not this session's to lose: it stays for the next one.
                let pool = state.kv.clone();
                let tokens = prefix[..k.reused].to_vec();
                keep_kept(pool, k, tokens).await;
            }
            return Err(Status::resource_exhausted(message));
        }
    };
    let reused = match kept {
        Some(k) => {
            session.adopt(k.cache, k.reused).map_err(to_status)?;
            k.reused
        }
        None => 0,
    };
    let suffix = prefix[reused..].to_vec();
    let (mut session, prefill_ms) = match &state.scheduler {
        Some(scheduler) => scheduler.prefill(session, suffix).await,
        None => {
            let model = state.model.clone();
            blocking(move || {
                let mut session = session;
                session.prefill(&model, &suffix).map(|ms| (session, ms))
            })
            .await?
        }
    }
    .map_err(to_status)?;
    let opened = SessionOpened {
        context_limit: u32::try_from(session.context_limit()).unwrap_or(u32::MAX),
        prefill_ms,
        active_sessions: state.admission.active() as u32,
        protocol_version: version,
    };
    if tx
        .send(Ok(SessionResponse {
            msg: Some(session_response::Msg::Opened(opened)),
        }))
        .await
        .is_err()
    {
        return Ok(()); // client went away
    }
    let idle = secs(state.config.idle_timeout_secs);
    let mut moving = state.moving.subscribe();
    // The session's messages, each with the time it arrived, read on a task of their own so
    // that the wait for a tree can be timed (and used) while the session decodes. `interrupt`
    // tells a forward run while waiting that a message came the session will act on, and
    // whether to stop or finish (crate::wait).
    let (msg_tx, mut msgs) = mpsc::channel(4);
    let interrupt = Arc::new(Interrupt::default());
    let reader = (interrupt.clone(), state.clone());
    let _reader = AbortOnDrop(tokio::spawn(async move {
        let (interrupt, state) = reader;
        let layers = state.model.info().n_layers;
        loop {
            let m = inbound.message().await;
            let end = !matches!(m, Ok(Some(_)));
            let stops = {
                let costs = state
                    .forward_costs
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                interrupt.stops_before(&m, layers, costs.as_ref())
            };
            // Handed over first, then raised (`Interrupt::stops_before` says why).
            let sent = msg_tx.send((Instant::now(), m)).await;
            if let Some(before_layer) = stops {
                interrupt.raise(before_layer);
            }
            if sent.is_err() || end {
                break;
            }
        }
    }));
    let mut waiting = Waiting::new(open.draft_shares_cpus);
    loop {
        if waiting.worth_decoding(&state, &session) {
            // Cleared before looking, so a message that comes after the look stops the forward.
            interrupt.pending.store(false, Ordering::Release);
            if let Ok(next) = msgs.try_recv() {
                waiting.early = Some(next);
            } else {
                let model = state.model.clone();
                let interrupt = interrupt.clone();
                let (back, r) = blocking(move || {
                    let r = session.decode_while_waiting(&model, interrupt.stop());
                    (session, r)
                })
                .await?;
                session = back;
                let decoded = r.map_err(to_status)?;
                tracing::debug!(decoded, wait_ms = ?waiting.wait_ms, "decode while waiting");
            }
        }
        let next = match waiting.early.take() {
            Some(next) => Some(next),
            None => tokio::select! {
                next = tokio::time::timeout(idle, msgs.recv()) => match next {
                    Ok(next) => next,
                    Err(_) => return Err(Status::deadline_exceeded(format!(
                        "no tree for {idle:?}; the idle session was closed to free its slot"
                    ))),
                },
                _ = moved(&mut moving) => {
                    return Err(Status::unavailable(
                        "verify node is shutting down; the session continues on another node",
                    ));
                }
            },
        };
        let (arrived, msg) = match next {
            Some((arrived, msg)) => (arrived, msg?),
            None => (Instant::now(), None),
        };
        let Some(msg) = msg else {
            // The generation ended normally: keep its cache for the conversation's next turn.
            end_session(&state, session, kv).await;
            break;
        };
        let tree = match msg.msg {
            Some(session_request::Msg::Tree(tree)) => tree,
            Some(session_request::Msg::Decode(req)) => {
                waiting.arrived(arrived);
                interrupt.expect(None, session.root_accept_rate());
                crate::decode::check_decode(
                    &req,
                    &session,
                    state.model.info().vocab_size,
                    version,
                )?;
                match crate::decode::decode(&state, session, req, tx, &moving).await? {
                    crate::decode::Outcome::Done(back) => session = back,
                    crate::decode::Outcome::ClientGone => return Ok(()),
                }
                // The next message starts from the decode's next token: forward it meanwhile.
                waiting.decoded();
                interrupt.expect(session.next_root(), session.root_accept_rate());
                continue;
            }
            _ => {
                return Err(Status::invalid_argument(
                    "after `open`, every message must be a `tree` or a `decode`",
                ))
            }
        };
        if let Some(assumed) = &tree.assumes {
            if version < limits::AHEAD_PROTOCOL_VERSION {
                return Err(Status::invalid_argument(format!(
                    "tree.assumes needs protocol version {} or later; this session runs {version}",
                    limits::AHEAD_PROTOCOL_VERSION
                )));
            }
            let root = tree.tokens.first().copied();
            if !session.ahead_holds(tree.step, &assumed.accepted_nodes, root) {
                // Sent ahead for a verdict that did not come: dropped, no model work, no answer.
                tracing::debug!(
                    step = tree.step,
                    "tree sent ahead dropped: its assumed verdict did not come"
                );
                continue;
            }
        }
        // Only a message the session acts on ends the wait (a dropped one leaves it going).
        waiting.arrived(arrived);
        let dists = wire::dists_from_wire(tree.draft_dists);
        let model = state.model.clone();
        let span = info_span!("verify_step", step = tree.step, nodes = tree.parents.len());
        let r = match &state.scheduler {
            Some(scheduler) => {
                // Checks run off the async threads, in parallel across sessions; the forward
                // is batched.
                let (back, prepared) = blocking(move || {
                    let p =
                        session.prepare_step(&model, tree.step, &tree.parents, &tree.tokens, dists);
                    (session, p)
                })
                .await?;
                match prepared.map_err(to_status)? {
                    Prepared::Done(r) => {
                        session = back;
                        r
                    }
                    Prepared::Tree(prepared) => {
                        let (back, r) = scheduler
                            .verify(back, prepared)
                            .instrument(span)
                            .await
                            .map_err(to_status)?;
                        session = back;
                        r
                    }
                }
            }
            None => {
                let (back, result) = blocking(move || {
                    let _e = span.enter();
                    let r = session.verify(&model, tree.step, &tree.parents, &tree.tokens, &dists);
                    (session, r)
                })
                .await?;
                session = back;
                result.map_err(to_status)?
            }
        };
        state.metrics.step(
            r.verdict.accepted.len() + 1,
            r.verdict.ranks.iter().copied(),
            secs(r.verify_ms / 1e3),
        );
        let verdict = wire::verdict_message(
            r.step,
            &r.verdict,
            r.verify_ms,
            (r.batch_rows, r.batch_sessions),
        );
        if tx
            .send(Ok(SessionResponse {
                msg: Some(session_response::Msg::Verdict(verdict)),
            }))
            .await
            .is_err()
        {
            return Ok(());
        }
        waiting.answered(r.verify_ms);
        interrupt.expect(Some(r.verdict.next_token), session.root_accept_rate());
    }
    Ok(())
}

/// A task that is stopped when this is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Free an ended session's reservation, then keep its cache (prompt and generated tokens) for
/// a later session that starts with the same tokens.
async fn end_session(
    state: &Arc<VerifyState>,
    session: VerifySession,
    kv: crate::kv_pool::KvReservation,
) {
    drop(kv);
    if !state.config.prefix_cache.enabled {
        return;
    }
    let pool = state.kv.clone();
    let _ = blocking(move || {
        let (tokens, cache) = session.into_kept();
        pool.keep_prefix(tokens, cache);
    })
    .await;
}

/// Put back a kept cache a session took but could not use. Only the part known here (the
/// `tokens` it shares with the refused prompt) is kept.
async fn keep_kept(pool: Arc<KvPool>, kept: sequoia_engine::prefix::Reused, tokens: Vec<u32>) {
    let mut cache = kept.cache;
    let _ = blocking(move || {
        if cache.reuse_prefix(kept.reused, cache.capacity()).is_ok() {
            pool.keep_prefix(tokens, cache);
        }
    })
    .await;
}

/// Resolves once the node tells its sessions to move (never if the flag's sender is gone).
async fn moved(flag: &mut tokio::sync::watch::Receiver<bool>) {
    if flag.wait_for(|m| *m).await.is_err() {
        std::future::pending::<()>().await;
    }
}

#[tonic::async_trait]
impl Verifier for VerifierService {
    type SessionStream = ReceiverStream<Result<SessionResponse, Status>>;

    async fn session(
        &self,
        request: Request<Streaming<SessionRequest>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        self.state.metrics.request();
        // Refuse at once when no slot could be had; the slot itself is taken at `open`.
        refuse_early(&self.state)?;
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        let state = self.state.clone();
        let id = state.next_session.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(
            async move {
                let t0 = Instant::now();
                match run_session(state, inbound, &tx).await {
                    Ok(()) => info!(elapsed_ms = t0.elapsed().as_millis() as u64, "session closed"),
                    Err(status) => {
                        warn!(code = ?status.code(), message = ?status.message(), "session ended with error");
                        let _ = tx.send(Err(status)).await;
                    }
                }
            }
            .instrument(info_span!("session", id)),
        );
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn info(&self, _request: Request<InfoRequest>) -> Result<Response<InfoResponse>, Status> {
        let s = &self.state;
        let mi = s.model.info();
        Ok(Response::new(InfoResponse {
            model_name: mi.name.clone(),
            architecture: mi.architecture.clone(),
            vocab_size: mi.vocab_size as u32,
            tokenizer_fingerprint: s.tokenizer.fingerprint().to_string(),
            eos_token_ids: s.tokenizer.eos_ids().to_vec(),
            max_context: s.config.max_context.min(mi.max_context) as u32,
            active_sessions: s.admission.active() as u32,
            max_sessions: s.config.max_sessions as u32,
            max_tree_nodes: s.config.max_tree_nodes as u32,
            draining: s.admission.is_draining(),
            protocol_version: limits::PROTOCOL_VERSION,
            min_protocol_version: limits::MIN_PROTOCOL_VERSION,
            device: mi.device.clone(),
            batch_invariant: mi.batch_invariant,
            machine_id: sequoia_server::host::machine_id().unwrap_or_default(),
            cpus: sequoia_server::host::allowed_cpus(),
            decodes_while_waiting: s.config.decode_while_waiting,
        }))
    }

    async fn ping(&self, request: Request<PingRequest>) -> Result<Response<PingResponse>, Status> {
        let n = request.into_inner().reply_bytes as usize;
        if n > limits::MAX_PING_BYTES {
            return Err(Status::invalid_argument(format!(
                "reply_bytes: {n} exceeds 8 MiB"
            )));
        }
        Ok(Response::new(PingResponse {
            payload: vec![0u8; n],
        }))
    }

    async fn profile(
        &self,
        request: Request<ProfileRequest>,
    ) -> Result<Response<ProfileResponse>, Status> {
        let req = request.into_inner();
        let s = &self.state;
        let max_ctx = s.config.max_context.min(s.model.info().max_context);
        if req.tree_sizes.len() > limits::MAX_PROFILE_SIZES {
            return Err(Status::invalid_argument(format!(
                "tree_sizes: {} sizes exceed the limit of {}",
                req.tree_sizes.len(),
                limits::MAX_PROFILE_SIZES
            )));
        }
        if req.tree_sizes.is_empty() {
            return Err(Status::invalid_argument(
                "tree_sizes: give at least one size, e.g. [1, 2, 4, 8, 16]",
            ));
        }
        if let Some(&n) = req
            .tree_sizes
            .iter()
            .find(|&&n| n == 0 || n as usize > s.config.max_tree_nodes)
        {
            return Err(Status::invalid_argument(format!(
                "tree_sizes: {n} is outside 1..={}",
                s.config.max_tree_nodes
            )));
        }
        let largest = req.tree_sizes.iter().copied().max().unwrap_or(1) as usize;
        let ctx = req.context_length as usize;
        if ctx + largest > max_ctx {
            return Err(Status::invalid_argument(format!(
                "context_length: {ctx} + tree size {largest} exceeds the context limit {max_ctx}"
            )));
        }
        let repeats = req.repeats.clamp(1, limits::MAX_PROFILE_REPEATS) as usize;
        let slot = admit(&self.state)?;
        let model = s.model.clone();
        let sizes = req.tree_sizes.clone();
        // The work stops between forwards once the caller goes away (this future is dropped)
        // or the deadline passes, so a cancelled Profile ends within one forward.
        let cancelled = Arc::new(AtomicBool::new(false));
        let _cancel = CancelOnDrop(cancelled.clone());
        let budget = secs(s.config.profile_timeout_secs);
        let deadline = Instant::now() + budget;
        // The slot goes with the work, not with this future: it is freed when the forwards
        // have actually stopped, so a cancelled Profile is counted until its CPU is free.
        let times = blocking(move || {
            let _slot = slot;
            let go_on = || !cancelled.load(Ordering::Relaxed) && Instant::now() < deadline;
            sequoia_engine::profiling::measure_verify_while(&model, &sizes, ctx, repeats, &go_on)
        })
        .await?
        .map_err(|e| Status::internal(e.to_string()))?
        .ok_or_else(|| {
            Status::deadline_exceeded(format!(
                "profiling took longer than this node allows ({budget:?}); ask for fewer tree_sizes or repeats"
            ))
        })?;
        if let Ok(curve) = CostCurve::new(req.tree_sizes.clone(), times.clone()) {
            *s.forward_costs.lock().unwrap_or_else(|e| e.into_inner()) = Some(curve);
        }
        Ok(Response::new(ProfileResponse {
            tree_sizes: req.tree_sizes,
            forward_ms: times,
        }))
    }
}
