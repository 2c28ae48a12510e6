//! Prometheus metrics for both services: what an operator's dashboards and the autoscaler read.
//!
//! Why a handle instead of the `metrics` macros and a global recorder: a process can install
//! only one global recorder, and the tests run a draft and several verify services in one process,
//! each with its own `/metrics`. So every service owns a [`Metrics`] value holding its own
//! Prometheus recorder and pre-registered series, and the services call the small recording
//! methods below. A disabled [`Metrics`] (no `metrics_listen`) records nothing and costs nothing.
//!
//! Series (every one carries the label `service="draft-service"` or `"verify-service"`):
//!
//! | name | kind | recorded by |
//! |---|---|---|
//! | [`REQUESTS`] | counter | draft: `Generate` calls; verify: sessions opened |
//! | [`GENERATED_TOKENS`] | counter | tokens committed (verify: per step; draft: per generation) |
//! | [`STEPS`] | counter | verification steps (one tree each) |
//! | [`TOKENS_PER_STEP`] | histogram | tokens committed per step |
//! | [`ACCEPTED_BY_RANK`] | counter, `rank` | accepted tree nodes that were their parent's rank-th child |
//! | [`TRIALS_BY_RANK`] | counter, `rank` | draft: verified nodes with at least `rank` children |
//! | [`VERIFY_LATENCY`] | histogram, seconds | verify: forward + verification per step; draft: round trip per step |
//! | [`ACTIVE_SESSIONS`] | gauge | open sessions (verify) / running generations (draft); the HPA metric |
//! | [`QUEUE_DEPTH`] | gauge | requests waiting for a slot (0: the services refuse instead of queueing) |
//! | [`FAILOVERS`] | counter | draft: sessions moved to another verify node |
//! | [`FALLBACK_TOKENS`] | counter | draft: tokens the verify node decoded on its own (the decode fallback, when no tree pays) |
//! | [`SPEC_DRAFTS`] | counter | draft: steps that verified at least one drafted token (vLLM's `spec_decode_num_drafts`) |
//! | [`SPEC_DRAFT_TOKENS`] | counter | draft: drafted tokens sent for verification (tree nodes minus roots) |
//! | [`SPEC_ACCEPTED_TOKENS`] | counter | draft: drafted tokens the target accepted |
//! | [`SPEC_ACCEPTED_PER_POS`] | counter, `position` | draft: accepted tokens at depth `position` of the tree (1 = first drafted token; the last label also counts deeper ones) |
//! | [`TIME_TO_FIRST_TOKEN`] | histogram, seconds | draft: generation start → first text sent |
//! | [`INTER_TOKEN_LATENCY`] | histogram, seconds | draft: gap between text deliveries per token delivered (one observation per token) |
//! | [`BATCH_ROWS`] | histogram | verify: rows (tree nodes and prefill tokens) per batched forward |
//! | [`BATCH_SESSIONS`] | histogram | verify: sessions per batched forward |
//! | [`BATCH_QUEUE_WAIT`] | histogram, seconds | verify: a tree's or prefill chunk's wait for its batch |
//! | [`BATCH_FORWARD`] | histogram, seconds | verify: one batched forward (all its sessions) |
//! | [`REQUESTS_RUNNING`] | gauge | verify: sessions in the batch now computing (vLLM's `num_requests_running`) |
//! | [`REQUESTS_WAITING`] | gauge | verify: trees and prefills queued for the next batch (vLLM's `num_requests_waiting`) |
//! | [`KV_CACHE_USAGE`] | gauge, 0..1 | verify: KV memory reserved by open sessions / `kv_budget_mb` (vLLM's `kv_cache_usage_perc`) |
//! | [`PREFIX_CACHE_QUERIES`] | counter | both: prompt tokens looked up in the prefix cache (vLLM's `prefix_cache_queries`) |
//! | [`PREFIX_CACHE_HITS`] | counter | both: sessions/generations that reused a kept prefix |
//! | [`PREFIX_CACHE_HIT_TOKENS`] | counter | both: prompt tokens not prefilled because a kept cache held them (vLLM's `prefix_cache_hits`) |
//! | [`PREFIX_CACHE_STORED_BYTES`] | gauge, bytes | both: memory of the kept prefix caches (on the verify node part of `kv_budget_mb`) |
//! | [`BUSY_RATIO`] | gauge, 0..1 | verify: share of the last ~10 s the node spent in forwards; the autoscaler's metric |
//! | [`HTTP_REQUESTS`] | counter, `route`, `status` | draft: OpenAI-compatible HTTP requests (appears with the first request) |
//!
//! The spec-decode, latency and HTTP series are recorded per step and per request, where they
//! happen, by the generation loop both front ends (gRPC and HTTP) share.
//!
//! The draft side records from each generation's final summary, which carries totals rather than
//! per-step values: its histograms get one observation per step at the generation's mean, so
//! their `_sum` and `_count` are exact and their buckets approximate.

use metrics::{Counter, Gauge, Histogram, Key, Label, Metadata, Recorder};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusRecorder};
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

pub const REQUESTS: &str = "sequoia_requests_total";
pub const GENERATED_TOKENS: &str = "sequoia_generated_tokens_total";
pub const STEPS: &str = "sequoia_steps_total";
pub const TOKENS_PER_STEP: &str = "sequoia_tokens_per_step";
pub const ACCEPTED_BY_RANK: &str = "sequoia_accepted_by_rank_total";
pub const TRIALS_BY_RANK: &str = "sequoia_trials_by_rank_total";
pub const VERIFY_LATENCY: &str = "sequoia_verify_latency_seconds";
pub const ACTIVE_SESSIONS: &str = "sequoia_active_sessions";
pub const QUEUE_DEPTH: &str = "sequoia_queue_depth";
pub const FAILOVERS: &str = "sequoia_failovers_total";
pub const FALLBACK_TOKENS: &str = "sequoia_fallback_tokens_total";
pub const SPEC_DRAFTS: &str = "sequoia_spec_decode_num_drafts_total";
pub const SPEC_DRAFT_TOKENS: &str = "sequoia_spec_decode_num_draft_tokens_total";
pub const SPEC_ACCEPTED_TOKENS: &str = "sequoia_spec_decode_num_accepted_tokens_total";
pub const SPEC_ACCEPTED_PER_POS: &str = "sequoia_spec_decode_num_accepted_tokens_per_pos_total";
pub const TIME_TO_FIRST_TOKEN: &str = "sequoia_time_to_first_token_seconds";
pub const INTER_TOKEN_LATENCY: &str = "sequoia_inter_token_latency_seconds";
pub const HTTP_REQUESTS: &str = "sequoia_http_requests_total";
pub const BATCH_ROWS: &str = "sequoia_batch_rows";
pub const BATCH_SESSIONS: &str = "sequoia_batch_sessions";
pub const BATCH_QUEUE_WAIT: &str = "sequoia_batch_queue_wait_seconds";
pub const BATCH_FORWARD: &str = "sequoia_batch_forward_seconds";
pub const REQUESTS_RUNNING: &str = "sequoia_num_requests_running";
pub const REQUESTS_WAITING: &str = "sequoia_num_requests_waiting";
pub const KV_CACHE_USAGE: &str = "sequoia_kv_cache_usage_perc";
pub const BUSY_RATIO: &str = "sequoia_verify_busy_ratio";
/// The verify node's fitted forward cost: fixed part (reading the weights) and per row.
pub const FORWARD_FIXED: &str = "sequoia_verify_forward_fixed_seconds";
pub const FORWARD_PER_ROW: &str = "sequoia_verify_forward_per_row_seconds";
pub const PREFIX_CACHE_QUERIES: &str = "sequoia_prefix_cache_queries_total";
pub const PREFIX_CACHE_HITS: &str = "sequoia_prefix_cache_hits_total";
pub const PREFIX_CACHE_HIT_TOKENS: &str = "sequoia_prefix_cache_hit_tokens_total";
pub const PREFIX_CACHE_STORED_BYTES: &str = "sequoia_prefix_cache_stored_bytes";

/// Every series registered from the start (all but [`HTTP_REQUESTS`], whose labels are only
/// known once requests arrive), for tests and docs.
pub const ALL: [&str; 31] = [
    REQUESTS,
    GENERATED_TOKENS,
    STEPS,
    TOKENS_PER_STEP,
    ACCEPTED_BY_RANK,
    TRIALS_BY_RANK,
    VERIFY_LATENCY,
    ACTIVE_SESSIONS,
    QUEUE_DEPTH,
    FAILOVERS,
    FALLBACK_TOKENS,
    SPEC_DRAFTS,
    SPEC_DRAFT_TOKENS,
    SPEC_ACCEPTED_TOKENS,
    SPEC_ACCEPTED_PER_POS,
    TIME_TO_FIRST_TOKEN,
    INTER_TOKEN_LATENCY,
    BATCH_ROWS,
    BATCH_SESSIONS,
    BATCH_QUEUE_WAIT,
    BATCH_FORWARD,
    REQUESTS_RUNNING,
    REQUESTS_WAITING,
    KV_CACHE_USAGE,
    BUSY_RATIO,
    FORWARD_FIXED,
    FORWARD_PER_ROW,
    PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_HIT_TOKENS,
    PREFIX_CACHE_STORED_BYTES,
];

/// Ranks above this share the last `rank` label value (keeps the label set bounded).
const MAX_RANK_LABEL: usize = 16;

const TOKENS_PER_STEP_BUCKETS: [f64; 10] = [1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0];
const LATENCY_BUCKETS: [f64; 14] = [
    0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5,
];
const BATCH_ROW_BUCKETS: [f64; 11] = [
    1.0, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0, 48.0, 64.0, 128.0, 256.0,
];
const BATCH_SESSION_BUCKETS: [f64; 8] = [1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0];
const TTFT_BUCKETS: [f64; 14] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 60.0,
];

static METADATA: Metadata<'static> =
    Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

/// One service's metrics; cheap to clone.
#[derive(Clone, Default)]
pub struct Metrics(Option<Arc<Inner>>);

struct Inner {
    recorder: PrometheusRecorder,
    requests: Counter,
    tokens: Counter,
    steps: Counter,
    tokens_per_step: Histogram,
    latency: Histogram,
    active: Gauge,
    queue: Gauge,
    failovers: Counter,
    fallback_tokens: Counter,
    accepted: Vec<Counter>,
    trials: Vec<Counter>,
    drafts: Counter,
    draft_tokens: Counter,
    accepted_tokens: Counter,
    accepted_per_pos: Vec<Counter>,
    ttft: Histogram,
    itl: Histogram,
    batch_rows: Histogram,
    batch_sessions: Histogram,
    batch_wait: Histogram,
    batch_forward: Histogram,
    running: Gauge,
    waiting: Gauge,
    kv_usage: Gauge,
    busy: Gauge,
    forward_fixed: Gauge,
    forward_per_row: Gauge,
    prefix_queries: Counter,
    prefix_hits: Counter,
    prefix_hit_tokens: Counter,
    prefix_stored: Gauge,
    addr: OnceLock<SocketAddr>,
}

impl Metrics {
    /// Records nothing.
    pub fn disabled() -> Self {
        Self(None)
    }

    /// A fresh registry for `service` with every series registered (so dashboards and the HPA
    /// see zeros rather than missing series before the first request).
    pub fn new(service: &str) -> Self {
        let recorder = PrometheusBuilder::new()
            .add_global_label("service", service)
            .set_buckets_for_metric(
                Matcher::Full(TOKENS_PER_STEP.into()),
                &TOKENS_PER_STEP_BUCKETS,
            )
            .and_then(|b| {
                b.set_buckets_for_metric(Matcher::Full(VERIFY_LATENCY.into()), &LATENCY_BUCKETS)
            })
            .and_then(|b| {
                b.set_buckets_for_metric(Matcher::Full(TIME_TO_FIRST_TOKEN.into()), &TTFT_BUCKETS)
            })
            .and_then(|b| {
                b.set_buckets_for_metric(
                    Matcher::Full(INTER_TOKEN_LATENCY.into()),
                    &LATENCY_BUCKETS,
                )
            })
            .and_then(|b| {
                b.set_buckets_for_metric(Matcher::Full(BATCH_ROWS.into()), &BATCH_ROW_BUCKETS)
            })
            .and_then(|b| {
                b.set_buckets_for_metric(
                    Matcher::Full(BATCH_SESSIONS.into()),
                    &BATCH_SESSION_BUCKETS,
                )
            })
            .and_then(|b| {
                b.set_buckets_for_metric(Matcher::Full(BATCH_QUEUE_WAIT.into()), &LATENCY_BUCKETS)
            })
            .and_then(|b| {
                b.set_buckets_for_metric(Matcher::Full(BATCH_FORWARD.into()), &LATENCY_BUCKETS)
            })
            .expect("bucket lists are non-empty")
            .build_recorder();
        let key = |name: &'static str| Key::from_static_name(name);
        let labelled = |name: &'static str, label: &'static str| -> Vec<Counter> {
            (1..=MAX_RANK_LABEL)
                .map(|r| {
                    let label = Label::new(label, r.to_string());
                    recorder.register_counter(&Key::from_parts(name, vec![label]), &METADATA)
                })
                .collect()
        };
        let inner = Inner {
            requests: recorder.register_counter(&key(REQUESTS), &METADATA),
            tokens: recorder.register_counter(&key(GENERATED_TOKENS), &METADATA),
            steps: recorder.register_counter(&key(STEPS), &METADATA),
            tokens_per_step: recorder.register_histogram(&key(TOKENS_PER_STEP), &METADATA),
            latency: recorder.register_histogram(&key(VERIFY_LATENCY), &METADATA),
            active: recorder.register_gauge(&key(ACTIVE_SESSIONS), &METADATA),
            queue: recorder.register_gauge(&key(QUEUE_DEPTH), &METADATA),
            failovers: recorder.register_counter(&key(FAILOVERS), &METADATA),
            fallback_tokens: recorder.register_counter(&key(FALLBACK_TOKENS), &METADATA),
            accepted: labelled(ACCEPTED_BY_RANK, "rank"),
            trials: labelled(TRIALS_BY_RANK, "rank"),
            drafts: recorder.register_counter(&key(SPEC_DRAFTS), &METADATA),
            draft_tokens: recorder.register_counter(&key(SPEC_DRAFT_TOKENS), &METADATA),
            accepted_tokens: recorder.register_counter(&key(SPEC_ACCEPTED_TOKENS), &METADATA),
            accepted_per_pos: labelled(SPEC_ACCEPTED_PER_POS, "position"),
            ttft: recorder.register_histogram(&key(TIME_TO_FIRST_TOKEN), &METADATA),
            itl: recorder.register_histogram(&key(INTER_TOKEN_LATENCY), &METADATA),
            batch_rows: recorder.register_histogram(&key(BATCH_ROWS), &METADATA),
            batch_sessions: recorder.register_histogram(&key(BATCH_SESSIONS), &METADATA),
            batch_wait: recorder.register_histogram(&key(BATCH_QUEUE_WAIT), &METADATA),
            batch_forward: recorder.register_histogram(&key(BATCH_FORWARD), &METADATA),
            running: recorder.register_gauge(&key(REQUESTS_RUNNING), &METADATA),
            waiting: recorder.register_gauge(&key(REQUESTS_WAITING), &METADATA),
            kv_usage: recorder.register_gauge(&key(KV_CACHE_USAGE), &METADATA),
            busy: recorder.register_gauge(&key(BUSY_RATIO), &METADATA),
            forward_fixed: recorder.register_gauge(&key(FORWARD_FIXED), &METADATA),
            forward_per_row: recorder.register_gauge(&key(FORWARD_PER_ROW), &METADATA),
            prefix_queries: recorder.register_counter(&key(PREFIX_CACHE_QUERIES), &METADATA),
            prefix_hits: recorder.register_counter(&key(PREFIX_CACHE_HITS), &METADATA),
            prefix_hit_tokens: recorder.register_counter(&key(PREFIX_CACHE_HIT_TOKENS), &METADATA),
            prefix_stored: recorder.register_gauge(&key(PREFIX_CACHE_STORED_BYTES), &METADATA),
            addr: OnceLock::new(),
            recorder,
        };
        for g in [
            &inner.queue,
            &inner.running,
            &inner.waiting,
            &inner.kv_usage,
            &inner.busy,
            &inner.forward_fixed,
            &inner.forward_per_row,
            &inner.prefix_stored,
        ] {
            g.set(0.0);
        }
        Self(Some(Arc::new(inner)))
    }

    /// Enabled when `listen` is non-empty.
    pub fn for_listen(service: &str, listen: &str) -> Self {
        if listen.trim().is_empty() {
            Self::disabled()
        } else {
            Self::new(service)
        }
    }

    pub fn is_enabled(&self) -> bool {
        self.0.is_some()
    }

    /// The Prometheus text exposition of every series (empty when disabled).
    pub fn render(&self) -> String {
        self.0
            .as_ref()
            .map(|i| i.recorder.handle().render())
            .unwrap_or_default()
    }

    /// A request (draft: `Generate` call; verify: session) arrived.
    pub fn request(&self) {
        if let Some(i) = &self.0 {
            i.requests.increment(1);
        }
    }

    /// A session (verify) or generation (draft) started holding a slot.
    pub fn session_started(&self) {
        if let Some(i) = &self.0 {
            i.active.increment(1.0);
        }
    }

    /// ... and released it.
    pub fn session_ended(&self) {
        if let Some(i) = &self.0 {
            i.active.decrement(1.0);
        }
    }

    /// Requests waiting for a slot.
    pub fn set_queue_depth(&self, n: usize) {
        if let Some(i) = &self.0 {
            i.queue.set(n as f64);
        }
    }

    /// A session moved to another verify node.
    pub fn failover(&self) {
        if let Some(i) = &self.0 {
            i.failovers.increment(1);
        }
    }

    /// A generation's tokens that the verify node decoded on its own (the decode fallback).
    pub fn fallback_tokens(&self, n: u64) {
        if let Some(i) = &self.0 {
            i.fallback_tokens.increment(n);
        }
    }

    /// One verification step: `tokens` committed, the accepted nodes' `ranks` (1-based), and how
    /// long verification took.
    pub fn step(&self, tokens: usize, ranks: impl IntoIterator<Item = usize>, latency: Duration) {
        let Some(i) = &self.0 else { return };
        i.steps.increment(1);
        i.tokens.increment(tokens as u64);
        i.tokens_per_step.record(tokens as f64);
        i.latency.record(latency.as_secs_f64());
        for r in ranks {
            i.rank_counter(&i.accepted, r).increment(1);
        }
    }

    /// One draft step: `draft_tokens` drafted tokens verified (tree nodes minus the root), of
    /// which the first `accepted` positions of the path were accepted. A step without drafted
    /// tokens (no speculation) is not a draft and records nothing.
    pub fn spec_step(&self, draft_tokens: usize, accepted: usize) {
        let Some(i) = &self.0 else { return };
        if draft_tokens == 0 {
            return;
        }
        i.drafts.increment(1);
        i.draft_tokens.increment(draft_tokens as u64);
        i.accepted_tokens.increment(accepted as u64);
        for pos in 1..=accepted {
            i.rank_counter(&i.accepted_per_pos, pos).increment(1);
        }
    }

    /// The first text of a generation went out `after` its start.
    pub fn first_token(&self, after: Duration) {
        if let Some(i) = &self.0 {
            i.ttft.record(after.as_secs_f64());
        }
    }

    /// `tokens` tokens went out `gap` after the previous delivery: one observation of
    /// gap / tokens per token, so the histogram counts tokens as vLLM's does.
    pub fn inter_token(&self, gap: Duration, tokens: usize) {
        let Some(i) = &self.0 else { return };
        if tokens == 0 {
            return;
        }
        let per = gap.as_secs_f64() / tokens as f64;
        for _ in 0..tokens {
            i.itl.record(per);
        }
    }

    /// A batched forward is about to run: `rows` rows from `sessions` sessions, each of whose
    /// work waited `waits` in the queue; `waiting` items stay queued for later batches.
    pub fn batch_started(&self, rows: usize, sessions: usize, waits: &[Duration], waiting: usize) {
        let Some(i) = &self.0 else { return };
        i.batch_rows.record(rows as f64);
        i.batch_sessions.record(sessions as f64);
        for w in waits {
            i.batch_wait.record(w.as_secs_f64());
        }
        i.running.set(sessions as f64);
        i.waiting.set(waiting as f64);
    }

    /// ... and took `took`.
    pub fn batch_finished(&self, took: Duration) {
        let Some(i) = &self.0 else { return };
        i.batch_forward.record(took.as_secs_f64());
        i.running.set(0.0);
    }

    /// Share of KV memory reserved (0..1).
    pub fn set_kv_usage(&self, fraction: f64) {
        if let Some(i) = &self.0 {
            i.kv_usage.set(fraction);
        }
    }

    /// A prefix-cache lookup for a prompt of `prompt_tokens` tokens that found `hit_tokens`
    /// of them kept (0 = a miss).
    pub fn prefix_lookup(&self, prompt_tokens: usize, hit_tokens: usize) {
        if let Some(i) = &self.0 {
            i.prefix_queries.increment(prompt_tokens as u64);
            if hit_tokens > 0 {
                i.prefix_hits.increment(1);
                i.prefix_hit_tokens.increment(hit_tokens as u64);
            }
        }
    }

    /// Memory held by kept prefix caches now.
    pub fn set_prefix_stored_bytes(&self, bytes: usize) {
        if let Some(i) = &self.0 {
            i.prefix_stored.set(bytes as f64);
        }
    }

    /// Share of recent time spent computing (0..1).
    pub fn set_busy_ratio(&self, fraction: f64) {
        if let Some(i) = &self.0 {
            i.busy.set(fraction);
        }
    }

    /// The batch scheduler's fit of forward time = fixed + per row × rows (milliseconds in,
    /// seconds out): what sizes its prefill chunks, and what a row costs this node now.
    pub fn set_forward_cost(&self, fixed_ms: f64, per_row_ms: f64) {
        if let Some(i) = &self.0 {
            i.forward_fixed.set(fixed_ms / 1e3);
            i.forward_per_row.set(per_row_ms / 1e3);
        }
    }

    /// One HTTP request answered (`route` from a fixed set, so the label set stays bounded).
    pub fn http_request(&self, route: &'static str, status: u16) {
        let Some(i) = &self.0 else { return };
        let labels = vec![
            Label::new("route", route),
            Label::new("status", status.to_string()),
        ];
        i.recorder
            .register_counter(&Key::from_parts(HTTP_REQUESTS, labels), &METADATA)
            .increment(1);
    }

    /// One finished generation, from its summary totals (draft side; see the module docs).
    /// `accepted_by_rank[r]` / `trials_by_rank[r]` count rank r + 1; `round_trip` is the total
    /// time spent waiting for verdicts.
    pub fn generation(
        &self,
        tokens: u64,
        steps: u64,
        accepted_by_rank: &[u64],
        trials_by_rank: &[u64],
        round_trip: Duration,
    ) {
        let Some(i) = &self.0 else { return };
        i.tokens.increment(tokens);
        i.steps.increment(steps);
        for (r, &n) in accepted_by_rank.iter().enumerate() {
            i.rank_counter(&i.accepted, r + 1).increment(n);
        }
        for (r, &n) in trials_by_rank.iter().enumerate() {
            i.rank_counter(&i.trials, r + 1).increment(n);
        }
        if steps > 0 {
            let per_step = tokens as f64 / steps as f64;
            let latency = round_trip.as_secs_f64() / steps as f64;
            for _ in 0..steps {
                i.tokens_per_step.record(per_step);
                i.latency.record(latency);
            }
        }
    }

    /// Where [`serve`](Self::serve) listens, once it does.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.0.as_ref().and_then(|i| i.addr.get().copied())
    }

    /// Bind `listen` and serve `/metrics` in a background task that stops when the returned
    /// guard is dropped; `None` when metrics are off (empty `listen` or a disabled handle).
    pub async fn spawn_server(&self, listen: &str) -> std::io::Result<Option<MetricsServer>> {
        if !self.is_enabled() || listen.trim().is_empty() {
            return Ok(None);
        }
        let listener = tokio::net::TcpListener::bind(listen.trim())
            .await
            .map_err(|e| std::io::Error::new(e.kind(), format!("metrics_listen {listen}: {e}")))?;
        let addr = listener.local_addr()?;
        let served = self.clone().serve(listener);
        let task = tokio::spawn(async move {
            if let Err(e) = served.await {
                tracing::warn!(error = %e, "metrics endpoint stopped");
            }
        });
        Ok(Some(MetricsServer { addr, task }))
    }

    /// Serve `GET /metrics` (Prometheus text format, HTTP/1.1) on `listener` until the task is
    /// dropped or aborted. Also runs the recorder's periodic upkeep, which bounds the memory
    /// histograms hold between scrapes.
    pub async fn serve(self, listener: tokio::net::TcpListener) -> std::io::Result<()> {
        let Some(inner) = self.0.clone() else {
            return Ok(());
        };
        let _ = inner.addr.set(listener.local_addr()?);
        let handle = inner.recorder.handle();
        let upkeep = handle.clone();
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let handle = handle.clone();
                async move { handle.render() }
            }),
        );
        // One future for both, so dropping it (MetricsServer) stops both.
        let mut every = tokio::time::interval(Duration::from_secs(5));
        let upkeep = async move {
            loop {
                every.tick().await;
                upkeep.run_upkeep();
            }
        };
        tokio::select! {
            served = axum::serve(listener, app) => served,
            never = upkeep => never,
        }
    }
}

/// A running `/metrics` endpoint; stops on drop.
pub struct MetricsServer {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Inner {
    fn rank_counter<'a>(&self, counters: &'a [Counter], rank: usize) -> &'a Counter {
        &counters[rank.clamp(1, MAX_RANK_LABEL) - 1]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_series_is_rendered_from_the_start() {
        let m = Metrics::new("verify-service");
        let text = m.render();
        for name in ALL {
            assert!(text.contains(name), "{name} missing from\n{text}");
        }
        assert!(text.contains("service=\"verify-service\""));
        assert!(Metrics::disabled().render().is_empty());
    }

    #[test]
    fn steps_and_summaries_add_up() {
        let m = Metrics::new("draft-service");
        m.request();
        m.session_started();
        m.step(3, [1, 2], Duration::from_millis(20));
        m.generation(10, 4, &[5, 1], &[6, 2], Duration::from_millis(80));
        m.failover();
        let text = m.render();
        let value = |series: &str| -> f64 {
            text.lines()
                .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
                .unwrap_or_else(|| panic!("{series} not in\n{text}"))
                .rsplit(' ')
                .next()
                .unwrap()
                .parse()
                .unwrap()
        };
        let svc = "service=\"draft-service\"";
        assert_eq!(value(&format!("{STEPS}{{{svc}}}")), 5.0);
        assert_eq!(value(&format!("{GENERATED_TOKENS}{{{svc}}}")), 13.0);
        assert_eq!(value(&format!("{TOKENS_PER_STEP}_count{{{svc}}}")), 5.0);
        assert_eq!(value(&format!("{TOKENS_PER_STEP}_sum{{{svc}}}")), 13.0);
        assert_eq!(value(&format!("{ACTIVE_SESSIONS}{{{svc}}}")), 1.0);
        assert_eq!(value(&format!("{FAILOVERS}{{{svc}}}")), 1.0);
        assert_eq!(
            value(&format!("{ACCEPTED_BY_RANK}{{{svc},rank=\"1\"}}")),
            6.0
        );
        assert_eq!(value(&format!("{TRIALS_BY_RANK}{{{svc},rank=\"2\"}}")), 2.0);
    }

    #[test]
    fn spec_decode_latency_and_http_series() {
        let m = Metrics::new("draft-service");
        m.spec_step(5, 2);
        m.spec_step(0, 0); // no speculation: not a draft
        m.spec_step(3, 3);
        m.first_token(Duration::from_millis(200));
        m.inter_token(Duration::from_millis(30), 3);
        m.http_request("/v1/completions", 200);
        m.http_request("/v1/completions", 200);
        m.http_request("/v1/completions", 400);
        let text = m.render();
        let svc = "service=\"draft-service\"";
        let v = |s: String| -> f64 {
            text.lines()
                .find_map(|l| l.strip_prefix(s.as_str())?.strip_prefix(' ')?.parse().ok())
                .unwrap_or_else(|| panic!("{s} not in\n{text}"))
        };
        assert_eq!(v(format!("{SPEC_DRAFTS}{{{svc}}}")), 2.0);
        assert_eq!(v(format!("{SPEC_DRAFT_TOKENS}{{{svc}}}")), 8.0);
        assert_eq!(v(format!("{SPEC_ACCEPTED_TOKENS}{{{svc}}}")), 5.0);
        let pos = |p: u32| v(format!("{SPEC_ACCEPTED_PER_POS}{{{svc},position=\"{p}\"}}"));
        assert_eq!((pos(1), pos(2), pos(3), pos(4)), (2.0, 2.0, 1.0, 0.0));
        assert_eq!(v(format!("{TIME_TO_FIRST_TOKEN}_count{{{svc}}}")), 1.0);
        assert_eq!(v(format!("{INTER_TOKEN_LATENCY}_count{{{svc}}}")), 3.0);
        let route = "route=\"/v1/completions\"";
        assert_eq!(
            v(format!("{HTTP_REQUESTS}{{{svc},{route},status=\"200\"}}")),
            2.0
        );
        assert_eq!(
            v(format!("{HTTP_REQUESTS}{{{svc},{route},status=\"400\"}}")),
            1.0
        );
    }
}
