//! The client side of a chaos run (issue 17), shared by `sequoia chaos` and
//! `tests/tests/chaos.rs`: N concurrent clients generate greedily through one draft-service
//! until a deadline while something else kills and restarts verify nodes, and every result is
//! classified. The test includes this file by path (`#[path]`) because the CLI must not link
//! the test harness and the test must not need the CLI binary; it uses only tokio, tonic and
//! the proto crate, which both have.

use sequoia_proto::v1::generation_client::GenerationClient;
use sequoia_proto::v1::GenerateRequest;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tonic::Code;

/// One prompt and the target's own greedy continuation of it (plain decoding).
#[derive(Clone, Debug)]
pub struct Case {
    pub prompt: String,
    pub reference: Vec<u32>,
}

/// What the clients saw.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Generations that completed with a summary and the reference tokens.
    pub completed: usize,
    /// Generations refused or ended with a retriable status (UNAVAILABLE, RESOURCE_EXHAUSTED).
    pub retriable: usize,
    /// Everything else: wrong tokens, a missing summary, a non-retriable status. Must be empty.
    pub failures: Vec<String>,
    /// Failovers reported in the summaries of completed generations.
    pub failovers: u64,
}

impl Outcome {
    pub fn total(&self) -> usize {
        self.completed + self.retriable + self.failures.len()
    }
}

/// The statuses a client may see while nodes die: it should retry, nothing is lost.
pub fn retriable(code: Code) -> bool {
    matches!(code, Code::Unavailable | Code::ResourceExhausted)
}

/// Run `clients` concurrent clients against `draft_url` until `duration` has passed (each
/// finishes the generation it is in), cycling through `cases` at temperature 0.
pub async fn run_clients(
    draft_url: &str,
    cases: &[Case],
    clients: usize,
    duration: Duration,
) -> Outcome {
    let outcome = Arc::new(Mutex::new(Outcome::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for client in 0..clients {
        let url = draft_url.to_string();
        let cases = cases.to_vec();
        let outcome = outcome.clone();
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut i = client;
            while !stop.load(Ordering::Relaxed) {
                let case = &cases[i % cases.len()];
                i += 1;
                let result = generate_once(&url, case).await;
                let mut o = outcome.lock().unwrap();
                match result {
                    Ok(failovers) => {
                        o.completed += 1;
                        o.failovers += failovers;
                    }
                    Err(Verdict::Retriable) => o.retriable += 1,
                    Err(Verdict::Failure(why)) => o.failures.push(why),
                }
                drop(o);
            }
        }));
    }
    let t0 = Instant::now();
    while t0.elapsed() < duration {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        if let Err(e) = t.await {
            outcome
                .lock()
                .unwrap()
                .failures
                .push(format!("client task failed: {e}"));
        }
    }
    let mut o = outcome.lock().unwrap();
    std::mem::take(&mut *o)
}

enum Verdict {
    Retriable,
    Failure(String),
}

fn status_verdict(prompt: &str, s: &tonic::Status) -> Verdict {
    if retriable(s.code()) {
        Verdict::Retriable
    } else {
        Verdict::Failure(format!(
            "prompt {prompt:?}: non-retriable status {:?}: {}",
            s.code(),
            s.message()
        ))
    }
}

/// One greedy generation; the failovers it reported, or how it went wrong.
async fn generate_once(url: &str, case: &Case) -> Result<u64, Verdict> {
    let mut client = GenerationClient::connect(url.to_string())
        .await
        .map_err(|e| Verdict::Failure(format!("cannot connect to the draft-service: {e}")))?;
    let request = GenerateRequest {
        prompt: case.prompt.clone(),
        max_tokens: case.reference.len().max(1) as u32,
        temperature: 0.0,
        seed: Some(1),
        ..Default::default()
    };
    let mut stream = client
        .generate(request)
        .await
        .map_err(|s| status_verdict(&case.prompt, &s))?
        .into_inner();
    let mut tokens = Vec::new();
    let mut summary = None;
    loop {
        match stream.message().await {
            Ok(Some(chunk)) => {
                tokens.extend(chunk.token_ids);
                if chunk.summary.is_some() {
                    summary = chunk.summary;
                }
            }
            Ok(None) => break,
            Err(s) => return Err(status_verdict(&case.prompt, &s)),
        }
    }
    let Some(summary) = summary else {
        return Err(Verdict::Failure(format!(
            "prompt {:?}: the stream ended without a summary or an error",
            case.prompt
        )));
    };
    // The reference stops at EOS or at its length, exactly where greedy decoding stops.
    if tokens != case.reference {
        return Err(Verdict::Failure(format!(
            "prompt {:?}: greedy output differs from the target's after {} failovers: got {:?}, want {:?}",
            case.prompt, summary.failovers, tokens, case.reference
        )));
    }
    Ok(summary.failovers as u64)
}

/// A small deterministic generator for the kill schedule (xorshift64*), so a run can be
/// repeated with its seed.
pub struct Schedule(u64);

impl Schedule {
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// A pause between `lo` and `hi`.
    pub fn pause(&mut self, lo: Duration, hi: Duration) -> Duration {
        let span = hi.saturating_sub(lo).as_millis().max(1) as u64;
        lo + Duration::from_millis(self.next_u64() % span)
    }
}

/// The kill/restart loop: until `stop`, after each pause pick a node; a live one is SIGKILLed
/// (while at least one other stays up), a dead one restarted. `act(i, true)` kills node i,
/// `act(i, false)` restarts it. Returns the number of kills and which nodes are up at the end.
pub fn chaos_loop(
    nodes: usize,
    seed: u64,
    pause: (Duration, Duration),
    stop: &AtomicBool,
    mut act: impl FnMut(usize, bool),
) -> (usize, Vec<bool>) {
    let mut rng = Schedule::new(seed);
    let mut up = vec![true; nodes];
    let mut kills = 0;
    while !stop.load(Ordering::Relaxed) {
        let wait = rng.pause(pause.0, pause.1);
        let t0 = Instant::now();
        while t0.elapsed() < wait && !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(20));
        }
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let i = rng.below(nodes);
        if up[i] {
            if up.iter().filter(|&&u| u).count() > 1 {
                act(i, true);
                up[i] = false;
                kills += 1;
            }
        } else {
            act(i, false);
            up[i] = true;
        }
    }
    (kills, up)
}
