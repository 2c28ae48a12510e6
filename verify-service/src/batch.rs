//! The verify node's batch scheduler (docs/ALGORITHMS.md §11): trees and prefill chunks from
//! every session queue here, and one thread runs them as batched forwards, so N sessions read
//! the weights once per step instead of N times.
//!
//! Batch formation, on the scheduler thread:
//! 1. Wait for work; then take whatever else has arrived, and while fewer sessions are queued
//!    than are open (others may send a tree any moment) wait up to `max_wait_us` for more, or
//!    until `max_rows` rows of trees are queued (queued prompts do not end the wait).
//! 2. Drop the work of sessions whose caller went away (their cache is freed now).
//! 3. Trees in arrival order until the next one would pass `max_rows` (the first is always
//!    taken, so a tree larger than the budget runs alone). Nobody is overtaken: a tree that does
//!    not fit is first in the next batch.
//! 4. Running sessions come first. While any other session is running (its tree is in the batch,
//!    or it is between steps), prefills get a small chunk of rows together, so every running
//!    session's step costs at most a forward of its batch's trees plus that chunk, not a whole
//!    row budget of someone's prompt (that made the slowest steps at 8 sessions 10× a lone
//!    session's); a long new prompt still advances every batch, by at least one row. The chunk
//!    is what keeps the forward within `1 + prefill_share` times the forward of every open
//!    session's trees, at this node's measured cost per row ([`RowCost`]): `prefill_share` of
//!    the batch's trees once all sessions run, more while the prompts of sessions that will
//!    soon run are still coming in. At most `prefill_chunk` rows: a node whose forwards are bound by memory
//!    takes the whole chunk almost free, one bound by compute (a CPU without int8 dot products)
//!    takes a few rows. When every open session is prefilling, the prefills take the whole row
//!    budget, so a prompt on an idle node runs at full speed.
//!    An unfinished prefill keeps its place at the head of the queue.
//! 5. One `Model::forward_batch`; then each tree is verified and its cache compacted, each
//!    session gets its verdict. If the batch fails, every entry is run again on its own so one
//!    session's failure is not another's.
//!
//! A row's logits do not depend on what else is in the batch (batch-invariant kernels), so a
//! session's verdicts are bit-identical batched or alone; `tests/tests/batching.rs` checks it.

use crate::session::{PreparedTree, SessionError, StepResult, VerifySession};
use sequoia_engine::{BatchEntry, BatchShape, Logits, Model};
use sequoia_server::admission::Admission;
use sequoia_server::metrics::Metrics;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// `[batch]` settings.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct BatchConfig {
    /// Batch sessions' work into shared forwards (false: each session runs alone, as before).
    pub enabled: bool,
    /// Rows (tree nodes) per batch; a larger tree runs alone.
    pub max_rows: usize,
    /// How long a batch may wait for other open sessions' trees, in microseconds.
    pub max_wait_us: u64,
    /// Most prompt tokens the prefills advance by, together, per batch while other sessions
    /// are running (when every open session is prefilling, up to `max_rows`).
    pub prefill_chunk: usize,
    /// While other sessions are running, the prefill rows of a batch may make its forward at
    /// most `1 +` this share times the forward of every open session's trees (at the node's
    /// measured cost per row; at least one row per waiting prompt, at most `prefill_chunk`).
    /// Lower: steadier steps for running sessions, a later first token for new ones and less
    /// throughput while prompts come in.
    pub prefill_share: f64,
}

impl Default for BatchConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            max_rows: 64,
            max_wait_us: 2000,
            prefill_chunk: 16,
            prefill_share: 0.5,
        }
    }
}

impl BatchConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.max_rows == 0 {
            return Err("batch.max_rows must be at least 1".into());
        }
        if self.prefill_chunk == 0 {
            return Err("batch.prefill_chunk must be at least 1".into());
        }
        if !(self.prefill_share > 0.0 && self.prefill_share <= 100.0) {
            return Err(format!(
                "batch.prefill_share must be above 0 and at most 100, got {}",
                self.prefill_share
            ));
        }
        if self.max_wait_us > 1_000_000 {
            return Err("batch.max_wait_us must be at most 1000000 (one second)".into());
        }
        Ok(())
    }
}

/// Handle to the scheduler thread; cheap to clone. The thread ends when every handle is gone.
#[derive(Clone)]
pub struct Scheduler {
    tx: mpsc::Sender<Job>,
}

type Reply = oneshot::Sender<(VerifySession, Result<Done, SessionError>)>;

struct Job {
    session: VerifySession,
    work: Work,
    reply: Reply,
    queued: Instant,
}

enum Work {
    Prefill {
        tokens: Vec<u32>,
        done: usize,
        started: Option<Instant>,
    },
    Tree(PreparedTree),
}

enum Done {
    Prefilled { prefill_ms: f64 },
    Verified(StepResult),
}

/// Rows the waiting prefills may take together in a batch (module doc, step 4): the whole
/// budget on a node with nothing but prefills to do; while any other session is running (its
/// tree is in this batch, or it is between steps and may send one while this forward runs), as
/// many rows as keep the forward within `1 + prefill_share` times what the trees of every open
/// session take (`load_rows`: the open sessions times the rows per tree of this batch, or of
/// recent batches, and at least the `tree_rows` of this batch) at the fitted `cost` (fixed ms,
/// ms per row). Once every session runs, that is `prefill_share` of the batch's own trees;
/// while new prompts are still coming in, it is more, and those sessions join the batches
/// sooner. At least one row per
/// `prefilling` session (a prompt waiting behind others is not starved) and at most
/// `prefill_chunk`; the whole chunk before the node has a fit.
fn prefill_budget(
    config: &BatchConfig,
    others_running: bool,
    tree_rows: f64,
    load_rows: f64,
    prefilling: usize,
    cost: Option<(f64, f64)>,
) -> usize {
    if !others_running {
        return config.max_rows.max(config.prefill_chunk);
    }
    let Some((fixed_ms, row_ms)) = cost else {
        return config.prefill_chunk;
    };
    let trees_ms = fixed_ms + row_ms * tree_rows;
    let loaded_ms = fixed_ms + row_ms * load_rows.max(tree_rows);
    let rows = (((1.0 + config.prefill_share) * loaded_ms - trees_ms) / row_ms).floor() as usize;
    rows.max(prefilling).clamp(1, config.prefill_chunk)
}

/// Forward time against rows, fitted by least squares over recent batches with exponential
/// forgetting: the node's fixed cost per forward (reading the weights) and what one more row
/// adds, as they are now (they move with load on the host and differ by an order of magnitude
/// between CPUs that are bound by memory and those bound by compute at a few rows).
#[derive(Debug, Default)]
struct RowCost {
    weight: f64,
    rows: f64,
    ms: f64,
    rows_sq: f64,
    rows_ms: f64,
    /// The last fit the batches could tell apart; kept while recent batches are all of one size.
    last: Option<(f64, f64)>,
}

/// Weight of older batches in [`RowCost`] (per batch): about the last 30 count.
const ROW_COST_DECAY: f64 = 0.97;

impl RowCost {
    fn observe(&mut self, rows: usize, ms: f64) {
        if rows == 0 || !(ms.is_finite() && ms > 0.0) {
            return;
        }
        let (x, d) = (rows as f64, ROW_COST_DECAY);
        self.weight = d * self.weight + 1.0;
        self.rows = d * self.rows + x;
        self.ms = d * self.ms + ms;
        self.rows_sq = d * self.rows_sq + x * x;
        self.rows_ms = d * self.rows_ms + x * ms;
        // A fit needs batches of different sizes (a spread of two rows either way), or noise
        // in the times decides the slope.
        let (mx, my) = (self.rows / self.weight, self.ms / self.weight);
        let var = self.rows_sq / self.weight - mx * mx;
        if self.weight >= 3.0 && var >= 4.0 {
            let per_row = (self.rows_ms / self.weight - mx * my) / var;
            if per_row > 0.0 {
                self.last = Some(((my - per_row * mx).max(0.0), per_row));
            }
        }
    }

    /// (fixed ms per forward, ms per row), once batches of different sizes have been seen.
    fn fit(&self) -> Option<(f64, f64)> {
        self.last
    }
}

/// Weight of the newest batch in the running mean of tree rows per batch.
const TREE_ROWS_GAIN: f64 = 0.2;

fn stopped() -> SessionError {
    SessionError::Unavailable("the verify node's batch scheduler stopped".into())
}

impl Scheduler {
    /// Start the scheduler thread for `model`. `admission` tells it how many sessions are open
    /// (so it knows when waiting for more work is pointless).
    pub fn start(
        model: Arc<Model>,
        config: BatchConfig,
        admission: Arc<Admission>,
        metrics: Metrics,
    ) -> Self {
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("batch-scheduler".into())
            .spawn(move || Runner::new(model, config, admission, metrics).run(rx))
            .expect("spawn the batch scheduler thread");
        Self { tx }
    }

    async fn submit(
        &self,
        session: VerifySession,
        work: Work,
    ) -> Result<(VerifySession, Done), SessionError> {
        let (reply, rx) = oneshot::channel();
        let job = Job {
            session,
            work,
            reply,
            queued: Instant::now(),
        };
        self.tx.send(job).map_err(|_| stopped())?;
        let (session, done) = rx.await.map_err(|_| stopped())?;
        Ok((session, done?))
    }

    /// Prefill a new session's prefix in chunks between other sessions' work; returns the
    /// session and the prefill time in ms.
    pub async fn prefill(
        &self,
        session: VerifySession,
        prefix: Vec<u32>,
    ) -> Result<(VerifySession, f64), SessionError> {
        if prefix.is_empty() {
            return Ok((session, 0.0));
        }
        let work = Work::Prefill {
            tokens: prefix,
            done: 0,
            started: None,
        };
        match self.submit(session, work).await? {
            (s, Done::Prefilled { prefill_ms }) => Ok((s, prefill_ms)),
            (_, Done::Verified(_)) => Err(stopped()),
        }
    }

    /// Verify a prepared tree in the next batch that has room for it.
    pub async fn verify(
        &self,
        session: VerifySession,
        tree: PreparedTree,
    ) -> Result<(VerifySession, StepResult), SessionError> {
        match self.submit(session, Work::Tree(tree)).await? {
            (s, Done::Verified(r)) => Ok((s, r)),
            (_, Done::Prefilled { .. }) => Err(stopped()),
        }
    }
}

/// Share of time spent in forwards over windows of this length.
const BUSY_WINDOW: Duration = Duration::from_secs(10);

struct Runner {
    model: Arc<Model>,
    config: BatchConfig,
    admission: Arc<Admission>,
    metrics: Metrics,
    queue: VecDeque<Job>,
    window_start: Instant,
    busy: Duration,
    row_cost: RowCost,
    /// Running mean of tree rows in batches that had trees: what the running sessions' next
    /// batch will likely hold when this one has none yet (they are between steps).
    tree_rows: f64,
    /// Running mean of rows per tree: with the open sessions, the rows their trees will take
    /// once the prompts now being prefilled run too (for batches without trees).
    rows_per_tree: f64,
}

/// One job's part of a batch: how many of its tokens go in.
struct Slot {
    job: Job,
    rows: usize,
}

impl Runner {
    fn new(
        model: Arc<Model>,
        config: BatchConfig,
        admission: Arc<Admission>,
        metrics: Metrics,
    ) -> Self {
        Self {
            model,
            config,
            admission,
            metrics,
            queue: VecDeque::new(),
            window_start: Instant::now(),
            busy: Duration::ZERO,
            row_cost: RowCost::default(),
            tree_rows: 0.0,
            rows_per_tree: 1.0,
        }
    }

    fn run(mut self, rx: mpsc::Receiver<Job>) {
        loop {
            if self.queue.is_empty() {
                match rx.recv_timeout(Duration::from_secs(1)) {
                    Ok(job) => self.queue.push_back(job),
                    Err(RecvTimeoutError::Timeout) => {
                        self.account(Duration::ZERO);
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            self.gather(&rx);
            // Work whose caller went away frees its session (and cache) now.
            self.queue.retain(|j| !j.reply.is_closed());
            let batch = self.take_batch();
            if batch.is_empty() {
                continue;
            }
            self.run_batch(batch);
        }
    }

    /// Rows of the trees queued. (Prompts do not count: while others run they get a budget of
    /// their own, not the batch. Counted, a few queued prompts passed `max_rows` at once, every
    /// batch left without waiting for the running sessions' next trees, and those sessions fell
    /// into alternate batches, each step then spanning two forwards: 8 sessions opening
    /// together, session 21.)
    fn queued_tree_rows(&self) -> usize {
        self.queue
            .iter()
            .map(|j| match &j.work {
                Work::Tree(t) => t.tree.len(),
                Work::Prefill { .. } => 0,
            })
            .sum()
    }

    /// Collect what has arrived, waiting a little while other open sessions may still send.
    fn gather(&mut self, rx: &mpsc::Receiver<Job>) {
        let deadline = Instant::now() + Duration::from_micros(self.config.max_wait_us);
        loop {
            while let Ok(job) = rx.try_recv() {
                self.queue.push_back(job);
            }
            if self.queued_tree_rows() >= self.config.max_rows
                || self.queue.len() >= self.admission.active()
            {
                return;
            }
            let now = Instant::now();
            if now >= deadline {
                tracing::debug!(
                    queued = self.queue.len(),
                    open = self.admission.active(),
                    "batch leaves without every open session's work"
                );
                return;
            }
            match rx.recv_timeout(deadline - now) {
                Ok(job) => self.queue.push_back(job),
                Err(_) => return,
            }
        }
    }

    /// Choose the next batch (module doc, steps 3 and 4).
    fn take_batch(&mut self) -> Vec<Slot> {
        let max_rows = self.config.max_rows;
        let mut batch = Vec::new();
        let mut rows = 0;
        let mut rest = VecDeque::with_capacity(self.queue.len());
        let mut trees = 0usize;
        let mut trees_done = false;
        let mut prefills = Vec::new();
        while let Some(job) = self.queue.pop_front() {
            match &job.work {
                Work::Tree(t) if !trees_done => {
                    let n = t.tree.len();
                    if rows == 0 || rows + n <= max_rows {
                        rows += n;
                        trees += 1;
                        batch.push(Slot { job, rows: n });
                    } else {
                        trees_done = true;
                        rest.push_back(job);
                    }
                }
                Work::Tree(_) => rest.push_back(job),
                Work::Prefill { .. } => prefills.push(job),
            }
        }
        // Open sessions without prefill work are running (a tree in this batch is one): between
        // steps, they may send a tree any moment, and it should not wait behind a whole row
        // budget of someone's prompt.
        let others_running = rows > 0 || self.admission.active() > prefills.len();
        if rows > 0 {
            self.tree_rows += TREE_ROWS_GAIN * (rows as f64 - self.tree_rows);
            let per_tree = rows as f64 / trees as f64;
            self.rows_per_tree += TREE_ROWS_GAIN * (per_tree - self.rows_per_tree);
        }
        // The trees the open sessions will send: this batch's size per tree where it has trees
        // (the draft's planner sizes them for the load it sees now), else the recent mean.
        let per_tree = if trees > 0 {
            rows as f64 / trees as f64
        } else {
            self.rows_per_tree
        };
        let fit = self.row_cost.fit();
        let mut budget = prefill_budget(
            &self.config,
            others_running,
            (rows as f64).max(self.tree_rows),
            self.admission.active() as f64 * per_tree,
            prefills.len(),
            fit,
        );
        if !prefills.is_empty() {
            tracing::debug!(
                budget,
                tree_rows = rows,
                prefills = prefills.len(),
                ?fit,
                "prefill rows"
            );
        }
        let mut unfinished = Vec::new();
        for job in prefills {
            let Work::Prefill { tokens, done, .. } = &job.work else {
                unreachable!("only prefills were collected")
            };
            let n = (tokens.len() - done).min(budget);
            if n == 0 {
                unfinished.push(job);
            } else {
                budget -= n;
                batch.push(Slot { job, rows: n });
            }
        }
        // Prefills that got no rows keep their place ahead of later arrivals.
        for job in unfinished.into_iter().rev() {
            rest.push_front(job);
        }
        self.queue = rest;
        batch
    }

    fn run_batch(&mut self, mut batch: Vec<Slot>) {
        let started = Instant::now();
        let rows: usize = batch.iter().map(|s| s.rows).sum();
        let (rows_total, sessions) = (rows, batch.len());
        let waits: Vec<Duration> = batch.iter().map(|s| started - s.job.queued).collect();
        self.metrics
            .batch_started(rows, batch.len(), &waits, self.queue.len());
        let batched = forward(&self.model, &mut batch);
        // Only a batch that ran as one forward says what a forward of its rows costs.
        let one_forward = batched.is_ok();
        let results = match batched {
            Ok(logits) => logits.into_iter().map(Ok).collect(),
            // Retry each alone, so one session's failure is not another's.
            Err(_) if batch.len() > 1 => batch
                .iter_mut()
                .map(|slot| {
                    forward(&self.model, std::slice::from_mut(slot))
                        .map(|mut l| l.pop().expect("one entry, one result"))
                })
                .collect(),
            Err(e) => vec![Err(e)],
        };
        let took = started.elapsed();
        if one_forward {
            self.row_cost.observe(rows_total, took.as_secs_f64() * 1e3);
        }
        if let Some((fixed_ms, per_row_ms)) = self.row_cost.fit() {
            self.metrics.set_forward_cost(fixed_ms, per_row_ms);
        }
        self.metrics.batch_finished(took);
        self.account(took);
        let mut unfinished = Vec::new();
        for (slot, logits) in batch.into_iter().zip(results) {
            let Slot { mut job, rows } = slot;
            let outcome = match (job.work, logits) {
                (_, Err(e)) => {
                    let _ = job.reply.send((job.session, Err(SessionError::Engine(e))));
                    continue;
                }
                (Work::Tree(tree), Ok(logits)) => job
                    .session
                    .finish(tree, &logits, started, (rows_total, sessions))
                    .map(Done::Verified),
                (
                    Work::Prefill {
                        tokens,
                        done,
                        started: first,
                    },
                    Ok(_),
                ) => {
                    let first = first.unwrap_or(started);
                    if done + rows < tokens.len() {
                        job.work = Work::Prefill {
                            tokens,
                            done: done + rows,
                            started: Some(first),
                        };
                        unfinished.push(job);
                        continue;
                    }
                    Ok(Done::Prefilled {
                        prefill_ms: first.elapsed().as_secs_f64() * 1e3,
                    })
                }
            };
            let _ = job.reply.send((job.session, outcome));
        }
        for job in unfinished.into_iter().rev() {
            self.queue.push_front(job);
        }
    }

    /// Busy share over the last window, for the autoscaler.
    fn account(&mut self, busy: Duration) {
        self.busy += busy;
        let elapsed = self.window_start.elapsed();
        if elapsed >= BUSY_WINDOW {
            self.metrics
                .set_busy_ratio((self.busy.as_secs_f64() / elapsed.as_secs_f64()).min(1.0));
            self.window_start = Instant::now();
            self.busy = Duration::ZERO;
        }
    }
}

/// One forward over the slots' entries.
fn forward(model: &Model, batch: &mut [Slot]) -> Result<Vec<Logits>, sequoia_engine::EngineError> {
    let all_rows: Vec<Vec<usize>> = batch
        .iter()
        .map(|s| match &s.job.work {
            Work::Tree(t) => (0..t.tree.len()).collect(),
            Work::Prefill { .. } => Vec::new(),
        })
        .collect();
    let mut entries: Vec<BatchEntry> = batch
        .iter_mut()
        .zip(&all_rows)
        .map(|(slot, rows)| {
            let rows_in = slot.rows;
            let Job { session, work, .. } = &mut slot.job;
            match work {
                Work::Tree(t) => BatchEntry {
                    cache: &mut session.cache,
                    tokens: &t.tokens,
                    shape: BatchShape::Tree(&t.tree),
                    rows,
                },
                Work::Prefill { tokens, done, .. } => BatchEntry {
                    cache: &mut session.cache,
                    tokens: &tokens[*done..*done + rows_in],
                    shape: BatchShape::Chain,
                    rows,
                },
            }
        })
        .collect();
    model.forward_batch(&mut entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefills_take_a_small_chunk_while_others_run_and_the_whole_budget_alone() {
        let config = BatchConfig::default();
        assert_eq!(
            prefill_budget(&config, false, 8.0, 8.0, 1, None),
            config.max_rows
        );
        assert_eq!(
            prefill_budget(&config, false, 8.0, 8.0, 1, Some((40.0, 11.0))),
            config.max_rows
        );
        // Trees in the batch, or another session between steps: its next tree must not wait
        // behind a whole row budget of prompt. Before the node knows its costs, the chunk.
        assert_eq!(
            prefill_budget(&config, true, 8.0, 8.0, 1, None),
            config.prefill_chunk
        );
        assert!(config.prefill_chunk < config.max_rows / 2);
        // A chunk larger than the budget is honoured alone too.
        let wide = BatchConfig {
            max_rows: 8,
            prefill_chunk: 32,
            ..BatchConfig::default()
        };
        assert_eq!(prefill_budget(&wide, false, 0.0, 0.0, 1, None), 32);
        assert_eq!(prefill_budget(&wide, true, 0.0, 0.0, 1, None), 32);
    }

    #[test]
    fn prefill_chunks_follow_what_a_row_costs_on_this_node() {
        let config = BatchConfig {
            prefill_share: 0.25,
            ..BatchConfig::default()
        };
        // Bound by memory: 40 ms to read the weights, 1 ms per row. 8 rows of trees take 48
        // ms; a quarter of that buys 12 rows.
        assert_eq!(
            prefill_budget(&config, true, 8.0, 8.0, 1, Some((40.0, 1.0))),
            12
        );
        // Faster still: capped at the chunk.
        assert_eq!(
            prefill_budget(&config, true, 8.0, 8.0, 1, Some((40.0, 0.2))),
            config.prefill_chunk
        );
        // Bound by compute (AVX2 without int8 dot products): 11 ms per row, so 8 rows of trees
        // take 128 ms and a quarter of that is 2 rows, where 16 would have more than doubled
        // every running session's step.
        assert_eq!(
            prefill_budget(&config, true, 8.0, 8.0, 1, Some((40.0, 11.0))),
            2
        );
        // More trees, more room; nothing affordable still advances the prompt by a row.
        assert!(prefill_budget(&config, true, 32.0, 32.0, 1, Some((40.0, 11.0))) > 2);
        assert_eq!(
            prefill_budget(&config, true, 0.0, 0.0, 1, Some((1.0, 50.0))),
            1
        );
        // Every waiting prompt advances by a row per batch, however little that buys.
        assert_eq!(
            prefill_budget(&config, true, 0.0, 0.0, 5, Some((1.0, 50.0))),
            5
        );
        assert_eq!(
            prefill_budget(&config, true, 0.0, 0.0, 40, Some((1.0, 50.0))),
            config.prefill_chunk
        );
        // A larger share buys more rows (the default is half the trees' time).
        let generous = BatchConfig {
            prefill_share: 1.0,
            ..BatchConfig::default()
        };
        assert_eq!(
            prefill_budget(&generous, true, 8.0, 8.0, 1, Some((40.0, 11.0))),
            11
        );
        let default = BatchConfig::default();
        assert_eq!(
            prefill_budget(&default, true, 8.0, 8.0, 1, Some((40.0, 11.0))),
            5
        );
    }

    #[test]
    fn prefills_take_more_while_new_sessions_have_not_joined_the_batches_yet() {
        let config = BatchConfig::default();
        let cost = Some((40.0, 11.0));
        // Eight sessions open, two of them running one-row trees: the running steps may cost
        // up to 1.5 times what all eight sessions' trees will (40 + 88 ms), so the prompts
        // get the rows that fills, not half of two rows' forward.
        let alone = prefill_budget(&config, true, 2.0, 2.0, 6, cost);
        let loaded = prefill_budget(&config, true, 2.0, 8.0, 6, cost);
        assert_eq!(alone, 6, "one row per waiting prompt");
        assert_eq!(loaded, 11, "(1.5 · 128 − 62) / 11 rows");
        // Once every session runs, the rule is the plain share of the batch's own trees.
        assert_eq!(
            prefill_budget(&config, true, 8.0, 8.0, 1, cost),
            prefill_budget(&config, true, 8.0, 3.0, 1, cost)
        );
    }

    #[test]
    fn row_cost_fits_fixed_and_per_row_time_and_waits_for_different_sizes() {
        let mut cost = RowCost::default();
        // Batches all of one size cannot separate the two.
        for _ in 0..10 {
            cost.observe(8, 128.0);
        }
        assert_eq!(cost.fit(), None);
        // Other sizes on the same line 40 + 11 · rows.
        for rows in [1, 24, 9, 16, 2, 64] {
            cost.observe(rows, 40.0 + 11.0 * rows as f64);
        }
        let (fixed, per_row) = cost.fit().expect("a fit");
        assert!((fixed - 40.0).abs() < 1e-6 && (per_row - 11.0).abs() < 1e-9);
        // Bad times are ignored; a run of one size keeps the last fit.
        cost.observe(8, f64::NAN);
        cost.observe(0, 10.0);
        for _ in 0..200 {
            cost.observe(8, 128.0);
        }
        let (fixed, per_row) = cost.fit().expect("kept");
        assert!((fixed - 40.0).abs() < 1e-6 && (per_row - 11.0).abs() < 1e-9);
        // The host slows down: the fit follows.
        for rows in [1, 24, 9, 16, 2, 64].repeat(40) {
            cost.observe(rows, 60.0 + 20.0 * rows as f64);
        }
        let (fixed, per_row) = cost.fit().expect("a fit");
        assert!((fixed - 60.0).abs() < 1.0 && (per_row - 20.0).abs() < 0.1);
    }

    #[test]
    fn bad_prefill_shares_are_refused() {
        for share in [0.0, -1.0, f64::NAN, 1e9] {
            let c = BatchConfig {
                prefill_share: share,
                ..BatchConfig::default()
            };
            assert!(c.validate().unwrap_err().contains("prefill_share"));
        }
    }
}
