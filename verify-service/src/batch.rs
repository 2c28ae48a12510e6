//! The verify node's batch scheduler (docs/ALGORITHMS.md §11): trees and prefill chunks from
//! every session queue here, and one thread runs them as batched forwards, so N sessions read
//! the weights once per step instead of N times.
//!
//! Batch formation, on the scheduler thread:
//! 1. Wait for work; then take whatever else has arrived, and while fewer sessions are queued
//!    than are open (others may send a tree any moment) wait up to `max_wait_us` for more, or
//!    until `max_rows` rows are queued.
//! 2. Drop the work of sessions whose caller went away (their cache is freed now).
//! 3. Trees in arrival order until the next one would pass `max_rows` (the first is always
//!    taken, so a tree larger than the budget runs alone). Nobody is overtaken: a tree that does
//!    not fit is first in the next batch.
//! 4. Running sessions come first. While any other session is running (its tree is in the batch,
//!    or it is between steps), prefills get `prefill_chunk` rows together, so every running
//!    session's step costs at most a forward of its batch's trees plus one small chunk, not a
//!    whole row budget of someone's prompt (that made the slowest steps at 8 sessions 10× a
//!    lone session's); a long new prompt still advances every batch. When every open session
//!    is prefilling, the prefills take the whole row budget, so a prompt on an idle node runs at
//!    full speed.
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
    /// Prompt tokens the prefills advance by, together, per batch while other sessions are
    /// running (when every open session is prefilling, up to `max_rows`).
    pub prefill_chunk: usize,
}

impl Default for BatchConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            max_rows: 64,
            max_wait_us: 2000,
            prefill_chunk: 16,
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

/// Rows the waiting prefills may take together in a batch (module doc, step 4): a small chunk
/// while any other session is running (its tree is in this batch, or it is between steps and
/// may send one while this forward runs), the whole budget on a node with nothing but prefills
/// to do.
fn prefill_budget(config: &BatchConfig, others_running: bool) -> usize {
    if !others_running {
        config.max_rows.max(config.prefill_chunk)
    } else {
        config.prefill_chunk
    }
}

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

    fn queued_rows(&self) -> usize {
        self.queue
            .iter()
            .map(|j| match &j.work {
                Work::Tree(t) => t.tree.len(),
                Work::Prefill { tokens, done, .. } => tokens.len() - done,
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
            if self.queued_rows() >= self.config.max_rows
                || self.queue.len() >= self.admission.active()
            {
                return;
            }
            let now = Instant::now();
            if now >= deadline {
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
        let mut trees_done = false;
        let mut prefills = Vec::new();
        while let Some(job) = self.queue.pop_front() {
            match &job.work {
                Work::Tree(t) if !trees_done => {
                    let n = t.tree.len();
                    if rows == 0 || rows + n <= max_rows {
                        rows += n;
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
        let mut budget = prefill_budget(&self.config, others_running);
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
        let results = match forward(&self.model, &mut batch) {
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
        assert_eq!(prefill_budget(&config, false), config.max_rows);
        // Trees in the batch, or another session between steps: its next tree must not wait
        // behind a whole row budget of prompt. The prefill still advances by its chunk, however
        // many rows the trees take.
        assert_eq!(prefill_budget(&config, true), config.prefill_chunk);
        assert!(config.prefill_chunk < config.max_rows / 2);
        // A chunk larger than the budget is honoured alone too.
        let wide = BatchConfig {
            max_rows: 8,
            prefill_chunk: 32,
            ..BatchConfig::default()
        };
        assert_eq!(prefill_budget(&wide, false), 32);
        assert_eq!(prefill_budget(&wide, true), 32);
    }
}
