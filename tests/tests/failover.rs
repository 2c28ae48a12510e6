//! Several verify-service processes behind one draft-service: new sessions spread over them,
//! and a node that dies (SIGKILL) or drains (SIGTERM) mid-generation costs the client nothing:
//! every generation completes, without an error, with the same tokens as without the failure
//! (T = 0, which is also plain target decoding).

use futures::future::join_all;
use sequoia_proto::v1::generation_client::GenerationClient;
use sequoia_proto::v1::verifier_client::VerifierClient;
use sequoia_proto::v1::{GenerateChunk, InfoRequest};
use sequoia_server::metrics;
use sequoia_tests::*;
use std::collections::BTreeSet;

const PROMPTS: [&str; 6] = [
    "hello world",
    "The quick brown fox",
    "fn main() { println!(\"hi\"); }",
    "a",
    "world hello world",
    "quick fox",
];

/// The real verify-service command line, run as separate processes.
const VERIFY_EXE: &str = env!("CARGO_BIN_EXE_verify-node-under-test");

/// Long enough that every generation is still running when a node is taken away.
const TOKENS: u32 = 600;

/// A Generate stream that has delivered its first chunk, and the rest collected later.
struct Started {
    stream: tonic::Streaming<GenerateChunk>,
    first: GenerateChunk,
}

async fn start(draft_url: &str, prompt: &str) -> Started {
    let mut client = GenerationClient::connect(draft_url.to_string())
        .await
        .unwrap();
    let mut stream = client
        .generate(request(prompt, TOKENS, 0.0, 7))
        .await
        .expect("generation starts")
        .into_inner();
    let first = stream
        .message()
        .await
        .expect("first chunk")
        .expect("stream open");
    Started { stream, first }
}

/// Read the rest of a stream; any error fails the test (the client must never see one).
async fn finish(s: Started) -> Generated {
    let mut out = Generated::default();
    let mut next = Some(s.first);
    let mut stream = s.stream;
    while let Some(chunk) = next {
        out.text.push_str(&chunk.text);
        out.tokens.extend(&chunk.token_ids);
        if chunk.summary.is_some() {
            out.summary = chunk.summary.clone();
        }
        next = stream
            .message()
            .await
            .unwrap_or_else(|s| panic!("the client saw an error: {s:?}"));
    }
    out
}

async fn active_sessions(url: &str) -> u32 {
    let mut c = VerifierClient::connect(url.to_string()).await.unwrap();
    c.info(InfoRequest {})
        .await
        .unwrap()
        .into_inner()
        .active_sessions
}

fn failovers_counted(metrics_text: &str) -> f64 {
    let series = format!("{}{{service=\"draft-service\"}}", metrics::FAILOVERS);
    series_value(metrics_text, &series).expect("failover series present")
}

#[test]
fn sessions_spread_over_three_nodes_and_survive_one_killed() {
    let pair = TinyPair::new();
    // Every generation must still be running when its node is killed. A lone session that
    // decodes while it waits ends a short answer within that window on tiny models, so the
    // nodes here verify every tree as sent (the feature has its own tests).
    let nodes_env = [("SEQUOIA_DECODE_WHILE_WAITING", "false")];
    let mut nodes: Vec<VerifyProcess> = (0..3)
        .map(|_| VerifyProcess::start(VERIFY_EXE, &pair.target, &nodes_env))
        .collect();
    let urls: Vec<String> = nodes.iter().map(VerifyProcess::url).collect();
    let mut cfg = draft_config(&pair.draft, &urls, 4, 3);
    cfg.metrics_listen = "127.0.0.1:0".into();
    let draft = start_draft(cfg);
    let want: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| plain_greedy(&pair.target, p, TOKENS as usize))
        .collect();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let draft_url = draft.url();

    // No failure: concurrent generations use all three nodes and equal target-only decoding.
    let base = rt.block_on(within(
        300,
        join_all(
            PROMPTS
                .iter()
                .map(|p| generate(&draft_url, request(p, TOKENS, 0.0, 7))),
        ),
    ));
    let mut used = BTreeSet::new();
    for ((got, want), prompt) in base.into_iter().zip(&want).zip(PROMPTS) {
        let got = got.expect("generation succeeds");
        assert_eq!(&got.tokens, want, "prompt {prompt:?}");
        let s = got.summary.unwrap();
        assert_eq!(s.failovers, 0);
        used.insert(s.verify_node);
    }
    assert_eq!(
        used,
        urls.iter().cloned().collect::<BTreeSet<_>>(),
        "6 concurrent sessions spread over all 3 nodes"
    );

    // SIGKILL the busiest node while every generation is mid-way.
    let (got, victim) = rt.block_on(within(300, async {
        let started = join_all(PROMPTS.iter().map(|p| start(&draft_url, p))).await;
        let load = join_all(urls.iter().map(|u| active_sessions(u))).await;
        let victim = (0..3).max_by_key(|&i| load[i]).unwrap();
        assert!(load[victim] > 0, "sessions are open: {load:?}");
        nodes[victim].kill();
        (join_all(started.into_iter().map(finish)).await, victim)
    }));
    let mut failovers = 0;
    for ((got, want), prompt) in got.into_iter().zip(&want).zip(PROMPTS) {
        assert_eq!(
            &got.tokens, want,
            "prompt {prompt:?} after a node was killed"
        );
        let s = got
            .summary
            .expect("every generation completes with a summary");
        assert_eq!(s.generated_tokens as usize, want.len());
        assert_ne!(s.verify_node, urls[victim], "finished on a live node");
        failovers += s.failovers;
    }
    assert!(failovers >= 1, "the killed node's sessions moved");
    let text = rt.block_on(scrape(draft.metrics.unwrap()));
    assert_eq!(failovers_counted(&text), failovers as f64);

    // New generations avoid the dead node.
    let again = rt
        .block_on(within(120, generate(&draft_url, request("a", 20, 0.0, 1))))
        .expect("a generation after the failure succeeds");
    let s = again.summary.unwrap();
    assert_ne!(s.verify_node, urls[victim]);
    assert_eq!(s.failovers, 0);
}

#[test]
fn sigterm_drains_a_node_its_sessions_move_and_it_exits() {
    let pair = TinyPair::new();
    // drain_timeout_secs = 0: open sessions move at once instead of finishing. Both sessions
    // must still be running when the drain starts; a lone session that decodes while it waits
    // can end a short answer first on tiny models, so these nodes verify every tree as sent.
    let no_waiting_decode = ("SEQUOIA_DECODE_WHILE_WAITING", "false");
    let mut draining = VerifyProcess::start(
        VERIFY_EXE,
        &pair.target,
        &[("SEQUOIA_DRAIN_TIMEOUT_SECS", "0"), no_waiting_decode],
    );
    let other = VerifyProcess::start(VERIFY_EXE, &pair.target, &[no_waiting_decode]);
    let urls = [draining.url(), other.url()];
    let mut cfg = draft_config(&pair.draft, &urls, 4, 3);
    cfg.discovery_interval_secs = 0.2;
    let draft = start_draft(cfg);
    // Two prompts whose greedy answers run the whole TOKENS (the tiny target ends the
    // others after 83–349 tokens): a short answer on the draining node could end before the
    // drain starts, and its session would then never move (seen under the full test suite's
    // load).
    let prompts = [PROMPTS[0], PROMPTS[3]];
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| plain_greedy(&pair.target, p, TOKENS as usize))
        .collect();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let draft_url = draft.url();
    let got = rt.block_on(within(300, async {
        let started = join_all(prompts.iter().map(|p| start(&draft_url, p))).await;
        assert!(active_sessions(&urls[0]).await > 0, "one session per node");
        draining.terminate();
        join_all(started.into_iter().map(finish)).await
    }));
    let mut failovers = 0;
    for ((got, want), prompt) in got.into_iter().zip(&want).zip(prompts) {
        assert_eq!(&got.tokens, want, "prompt {prompt:?} across the drain");
        let s = got.summary.unwrap();
        assert_eq!(s.verify_node, urls[1]);
        failovers += s.failovers;
    }
    assert_eq!(failovers, 1, "the drained node's session moved once");
    let status = draining
        .wait_exit(30)
        .expect("the drained verify-service exits");
    assert!(status.success(), "clean exit after draining: {status:?}");
    // New generations go to the remaining node.
    let again = rt
        .block_on(within(120, generate(&draft_url, request("a", 20, 0.0, 1))))
        .expect("a new generation after the drain succeeds");
    assert_eq!(again.summary.unwrap().verify_node, urls[1]);
}

/// A node killed while it decodes for the fallback (the plan is no speculation): the decode
/// resumes on another node from the committed tokens, and the output is still the target's.
#[test]
fn a_decode_moves_to_another_node_when_its_node_dies() {
    let pair = TinyPair::new();
    let mut nodes: Vec<VerifyProcess> = (0..2)
        .map(|_| VerifyProcess::start(VERIFY_EXE, &pair.target, &[]))
        .collect();
    let urls: Vec<String> = nodes.iter().map(VerifyProcess::url).collect();
    let mut cfg = draft_config(&pair.draft, &urls, 1, 1);
    // A few tokens per message: the tiny model decodes hundreds of tokens in a few
    // milliseconds, so with large messages the whole generation could be on the wire before the
    // kill below lands (CI saw that once); 150 round trips keep it running.
    cfg.fallback.max_tokens = 4;
    let draft = start_draft(cfg);
    let prompts = &PROMPTS[..2];
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| plain_greedy(&pair.target, p, TOKENS as usize))
        .collect();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let draft_url = draft.url();
    let got = rt.block_on(within(300, async {
        let started = join_all(prompts.iter().map(|p| start(&draft_url, p))).await;
        let load = join_all(urls.iter().map(|u| active_sessions(u))).await;
        let victim = (0..2).max_by_key(|&i| load[i]).unwrap();
        assert!(load[victim] > 0, "sessions are open: {load:?}");
        nodes[victim].kill();
        join_all(started.into_iter().map(finish)).await
    }));
    let mut failovers = 0;
    for ((got, want), prompt) in got.into_iter().zip(&want).zip(prompts) {
        assert_eq!(
            &got.tokens, want,
            "prompt {prompt:?} after a node was killed"
        );
        let s = got.summary.expect("a summary");
        assert!(
            s.fallback_tokens as usize >= want.len(),
            "every token was decoded: {s:?}"
        );
        failovers += s.failovers;
    }
    assert!(failovers >= 1, "the killed node's session moved");
}
