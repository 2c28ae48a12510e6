//! Issue 17, chaos run: three verify-service processes behind one draft-service, 16 concurrent
//! greedy clients, and verify nodes SIGKILLed and restarted at random for a bounded time. Every
//! generation must either complete with the target's own greedy output or end with a retriable
//! status (UNAVAILABLE, RESOURCE_EXHAUSTED), and afterwards nothing is left held: open sessions
//! on every node and the draft's running generations return to zero. `sequoia chaos` runs the
//! same for longer, by hand.

#[path = "../../cli/src/chaos_driver.rs"]
mod chaos_driver;

use chaos_driver::{chaos_loop, run_clients, Case};
use sequoia_proto::v1::verifier_client::VerifierClient;
use sequoia_proto::v1::InfoRequest;
use sequoia_server::metrics;
use sequoia_tests::*;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

const VERIFY_EXE: &str = env!("CARGO_BIN_EXE_verify-node-under-test");

const PROMPTS: [&str; 6] = [
    "hello world",
    "The quick brown fox",
    "fn main() { println!(\"hi\"); }",
    "a",
    "world hello world",
    "quick fox",
];

/// Short generations, so many start and end while nodes come and go.
const TOKENS: usize = 40;
const CLIENTS: usize = 16;
/// How long the clients run while nodes are killed (the test ends well within two minutes).
const RUN: Duration = Duration::from_secs(20);

async fn active_sessions(url: &str) -> Option<u32> {
    let mut c = VerifierClient::connect(url.to_string()).await.ok()?;
    Some(
        c.info(InfoRequest {})
            .await
            .ok()?
            .into_inner()
            .active_sessions,
    )
}

fn draft_running(text: &str) -> f64 {
    let series = format!("{}{{service=\"draft-service\"}}", metrics::ACTIVE_SESSIONS);
    series_value(text, &series).expect("active sessions series present")
}

#[test]
fn verify_nodes_killed_at_random_under_load_lose_nothing_and_leak_nothing() {
    let pair = TinyPair::new();
    let nodes: Vec<VerifyProcess> = (0..3)
        .map(|_| VerifyProcess::start(VERIFY_EXE, &pair.target, &[]))
        .collect();
    let addrs: Vec<SocketAddr> = nodes.iter().map(|n| n.addr).collect();
    let urls: Vec<String> = nodes.iter().map(VerifyProcess::url).collect();
    let mut cfg = draft_config(&pair.draft, &urls, 4, 3);
    cfg.metrics_listen = "127.0.0.1:0".into();
    cfg.max_sessions = 2 * CLIENTS;
    cfg.step_timeout_secs = 5.0;
    cfg.connect_timeout_secs = 1.0;
    let draft = start_draft(cfg);
    let draft_metrics = draft.metrics.unwrap();
    let cases: Vec<Case> = PROMPTS
        .iter()
        .map(|p| Case {
            prompt: p.to_string(),
            reference: plain_greedy(&pair.target, p, TOKENS),
        })
        .collect();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let baseline = draft_running(&rt.block_on(scrape(draft_metrics)));

    // The killer owns the processes; it runs until the clients are done.
    let stop = Arc::new(AtomicBool::new(false));
    let killer = {
        let stop = stop.clone();
        let target = pair.target.clone();
        let mut nodes = nodes;
        std::thread::spawn(move || {
            let (kills, up) = chaos_loop(
                nodes.len(),
                17,
                (Duration::from_millis(300), Duration::from_millis(1500)),
                &stop,
                |i, kill| {
                    if kill {
                        nodes[i].kill();
                    } else {
                        nodes[i] = VerifyProcess::start_at(VERIFY_EXE, &target, addrs[i], &[]);
                    }
                },
            );
            // Bring every node back for the leak check.
            for (i, up) in up.into_iter().enumerate() {
                if !up {
                    nodes[i] = VerifyProcess::start_at(VERIFY_EXE, &target, addrs[i], &[]);
                }
            }
            (kills, nodes)
        })
    };
    let outcome = rt.block_on(within(
        RUN.as_secs() + 60,
        run_clients(&draft.url(), &cases, CLIENTS, RUN),
    ));
    stop.store(true, Ordering::Relaxed);
    let (kills, _nodes) = killer.join().expect("the kill/restart loop");
    eprintln!("chaos: {kills} kills, {outcome:?}");

    assert!(kills > 0, "no node was killed");
    assert!(
        outcome.failures.is_empty(),
        "{} of {} generations neither completed correctly nor got a retriable status:\n{}",
        outcome.failures.len(),
        outcome.total(),
        outcome.failures.join("\n")
    );
    assert!(
        outcome.completed > 0,
        "no generation completed: {outcome:?}"
    );

    // Nothing is left held: every node's sessions and the draft's running generations go back.
    rt.block_on(within(60, async {
        for url in &urls {
            let mut open = None;
            for _ in 0..300 {
                open = active_sessions(url).await;
                if open == Some(0) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            assert_eq!(open, Some(0), "{url} still holds sessions after the run");
        }
        let mut running = f64::NAN;
        for _ in 0..300 {
            running = draft_running(&scrape(draft_metrics).await);
            if running == baseline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(
            running, baseline,
            "the draft still counts running generations"
        );
    }));

    // And the deployment still serves, with the reference output.
    let again = rt
        .block_on(within(
            120,
            generate(&draft.url(), request(PROMPTS[0], TOKENS as u32, 0.0, 1)),
        ))
        .expect("a generation after the chaos run succeeds");
    assert_eq!(again.tokens, cases[0].reference);
}
