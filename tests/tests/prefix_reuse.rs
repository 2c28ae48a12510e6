//! Prefix reuse across chat turns (docs/ALGORITHMS.md §11): an ended session's cache is kept,
//! and a new session whose prompt starts with the same tokens prefills only the rest.
//!
//! - through the service pair: the second turn of a conversation reuses the first turn's caches
//!   on both sides (metrics), and its greedy output is still the target's;
//! - on the verify node alone: a session on a reused prefix gets the verdicts (T = 0 and T > 0,
//!   fixed seeds) it gets on a node without prefix reuse (the next tokens are the target's
//!   argmax or seeded samples, which a wrong cache would change; the engine test
//!   shared/engine/tests/prefix_reuse.rs checks the logits themselves bit for bit);
//! - kept caches count against `kv_budget_mb`, are evicted before a session is refused, and a
//!   refused session still gets RESOURCE_EXHAUSTED; closed sessions reserve nothing.

use sequoia_core::limits;
use sequoia_engine::random::{RandomQuant, RandomSpec};
use sequoia_engine::tokenizer::testing::write_tiny_tokenizer;
use sequoia_engine::tokenizer::TextTokenizer;
use sequoia_engine::{Kernels, LoadOptions, Model};
use sequoia_proto::v1 as pb;
use sequoia_proto::v1::verifier_client::VerifierClient;
use sequoia_tests::*;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;
use verify_service::config::VerifyConfig;
use verify_service::service::VerifyState;

const VOCAB: u32 = 512; // the random "tiny" shape

fn mix(a: u64, b: u64) -> u32 {
    let mut x = a.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ b.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 29;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    ((x ^ (x >> 32)) % VOCAB as u64) as u32
}

fn tokens(n: usize, salt: u64) -> Vec<u32> {
    (0..n as u64).map(|i| mix(salt, i)).collect()
}

/// A verify node on a batch-invariant random target; the state is returned to read its pool.
fn node(configure: impl FnOnce(&mut VerifyConfig)) -> (Running, Arc<VerifyState>) {
    let spec = RandomSpec {
        seed: 21,
        quant: RandomQuant::Q4KM,
        ..RandomSpec::named("tiny").unwrap()
    };
    let model = Model::random(&spec, &LoadOptions::default(), Kernels::Native).unwrap();
    assert!(model.info().batch_invariant);
    let dir = tempfile::tempdir().unwrap();
    write_tiny_tokenizer(dir.path()).unwrap();
    let tokenizer = TextTokenizer::load_for_model(dir.path()).unwrap();
    let mut config = verify_config(dir.path());
    config.metrics_listen = "127.0.0.1:0".into();
    config.prefix_cache.min_tokens = 1;
    configure(&mut config);
    let state = Arc::new(VerifyState::new(model, tokenizer, config));
    (start_verify_state(state.clone()), state)
}

struct Session {
    tx: mpsc::Sender<pb::SessionRequest>,
    inbound: tonic::Streaming<pb::SessionResponse>,
}

async fn open(
    url: &str,
    prefix: &[u32],
    temperature: f32,
    seed: u64,
) -> Result<Session, tonic::Status> {
    let mut client = VerifierClient::connect(url.to_string()).await.unwrap();
    let (tx, rx) = mpsc::channel(4);
    tx.send(pb::SessionRequest {
        msg: Some(pb::session_request::Msg::Open(pb::OpenSession {
            prefix_tokens: prefix.to_vec(),
            sampling: Some(pb::SamplingConfig {
                temperature,
                ..Default::default()
            }),
            seed,
            max_new_tokens: 64,
            protocol_version: limits::PROTOCOL_VERSION,
            ..Default::default()
        })),
    })
    .await
    .unwrap();
    let mut inbound = client.session(ReceiverStream::new(rx)).await?.into_inner();
    match inbound.message().await?.and_then(|m| m.msg) {
        Some(pb::session_response::Msg::Opened(_)) => Ok(Session { tx, inbound }),
        other => panic!("expected opened, got {other:?}"),
    }
}

impl Session {
    /// One step with a fixed 4-node tree below `root` (children and q from `salt`); returns the
    /// verdict and the committed tokens (root, accepted nodes).
    async fn step(
        &mut self,
        step: u64,
        root: u32,
        temperature: f32,
        salt: u64,
    ) -> (pb::Verdict, Vec<u32>) {
        let parents = vec![-1, 0, 0, 1];
        let toks = vec![root, mix(salt, 1), (mix(salt, 1) + 1) % VOCAB, mix(salt, 2)];
        let dists = if temperature > 0.0 {
            vec![
                pb::SparseDist {
                    tokens: vec![toks[1], toks[2], (toks[1] + 2) % VOCAB],
                    probs: vec![0.4, 0.4, 0.2],
                },
                pb::SparseDist {
                    tokens: vec![toks[3]],
                    probs: vec![1.0],
                },
            ]
        } else {
            Vec::new()
        };
        self.tx
            .send(pb::SessionRequest {
                msg: Some(pb::session_request::Msg::Tree(pb::VerifyTree {
                    step,
                    parents,
                    tokens: toks.clone(),
                    draft_dists: dists,
                    assumes: None,
                })),
            })
            .await
            .unwrap();
        match self.inbound.message().await.unwrap().and_then(|m| m.msg) {
            Some(pb::session_response::Msg::Verdict(v)) => {
                let mut committed = vec![root];
                committed.extend(v.accepted_nodes.iter().map(|&a| toks[a as usize]));
                (v, committed)
            }
            other => panic!("expected a verdict, got {other:?}"),
        }
    }

    /// Close the stream and wait for the node to end the session.
    async fn close(mut self) {
        drop(self.tx);
        while self.inbound.message().await.ok().flatten().is_some() {}
    }
}

/// A conversation turn: open with `prompt`, run `steps` steps; returns the verdicts and the
/// whole sequence afterwards (prompt, committed tokens, the last verdict's next token).
async fn turn(
    url: &str,
    prompt: &[u32],
    steps: u64,
    temperature: f32,
    seed: u64,
) -> (Vec<(Vec<u32>, u32)>, Vec<u32>) {
    let (prefix, mut root) = (&prompt[..prompt.len() - 1], *prompt.last().unwrap());
    let mut s = open(url, prefix, temperature, seed).await.unwrap();
    let mut seq = prefix.to_vec();
    let mut verdicts = Vec::new();
    for step in 0..steps {
        let (v, committed) = s.step(step, root, temperature, seed * 100 + step).await;
        seq.extend(committed);
        root = v.next_token;
        verdicts.push((v.accepted_nodes, v.next_token));
    }
    seq.push(root);
    s.close().await;
    (verdicts, seq)
}

async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..500 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting until {what}");
}

#[test]
fn a_session_on_a_reused_prefix_gets_the_verdicts_of_a_fresh_prefill() {
    let (reuse, state) = node(|_| {});
    let (fresh, fresh_state) = node(|c| c.prefix_cache.enabled = false);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(within(120, async {
        let mut hits = 0;
        for (i, temperature) in [0.0f32, 0.8].into_iter().enumerate() {
            let seed = 5 + i as u64;
            // Turn 1 on the reusing node only; its cache is kept when the session ends.
            let (_, mut seq) = turn(&reuse.url(), &tokens(90, seed), 6, temperature, seed).await;
            wait_until("the session's cache is kept", || state.kv.kept().1 > 0).await;
            // Turn 2: the whole history plus a new user message, on both nodes.
            seq.extend(tokens(20, 1000 + seed));
            let (got, _) = turn(&reuse.url(), &seq, 6, temperature, seed + 10).await;
            let (want, _) = turn(&fresh.url(), &seq, 6, temperature, seed + 10).await;
            assert_eq!(
                got, want,
                "T = {temperature}: verdicts on a reused prefix differ"
            );
            hits += 1;
        }
        let text = scrape(reuse.metrics.unwrap()).await;
        let hit_tokens = series_value(
            &text,
            "sequoia_prefix_cache_hit_tokens_total{service=\"verify-service\"}",
        )
        .unwrap();
        // Turn 2 reuses turn 1's 89 prefix tokens plus at least the 6 steps' roots.
        assert!(hit_tokens >= (hits * 95) as f64, "{hit_tokens}");
        assert!(
            series_value(
                &text,
                "sequoia_prefix_cache_stored_bytes{service=\"verify-service\"}"
            )
            .unwrap()
                > 0.0
        );
        let text = scrape(fresh.metrics.unwrap()).await;
        assert_eq!(
            series_value(
                &text,
                "sequoia_prefix_cache_hit_tokens_total{service=\"verify-service\"}"
            ),
            Some(0.0)
        );
        // Nothing is reserved for sessions once they have all closed; kept caches are
        // accounted apart, and only where reuse is on.
        assert_eq!(state.kv.used(), 0);
        assert_eq!(fresh_state.kv.used(), 0);
        assert!(state.kv.kept().0 > 0);
        assert_eq!(fresh_state.kv.kept(), (0, 0));
    }));
}

#[test]
fn kept_prefixes_are_evicted_before_a_session_is_refused() {
    // Tiny shape: 2 KiB per token, so a 2 MiB budget holds 1024 tokens. With 16-node trees a
    // session reserves prompt + 64 new tokens + 16.
    let (verify, state) = node(|c| {
        c.kv_budget_mb = 2;
        c.max_tree_nodes = 16;
    });
    let per_token = 2048;
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(within(120, async {
        let url = verify.url();
        // A 300-token conversation ends and is kept (about 300 tokens).
        turn(&url, &tokens(300, 1), 2, 0.0, 1).await;
        wait_until("the session's cache is kept", || state.kv.kept().1 == 1).await;
        let (kept_bytes, _) = state.kv.kept();
        assert!(kept_bytes >= 300 * per_token, "{kept_bytes}");
        assert_eq!(state.kv.used(), 0);
        // Two unrelated 400-token sessions (481 tokens reserved each): the second fits only
        // if the kept cache goes.
        let a = open(&url, &tokens(400, 2), 0.0, 1).await.unwrap();
        assert_eq!(
            state.kv.kept().1,
            1,
            "the first session fits beside the kept cache"
        );
        let b = open(&url, &tokens(400, 3), 0.0, 1)
            .await
            .expect("the kept cache is evicted to admit the session");
        assert_eq!(state.kv.kept(), (0, 0));
        assert_eq!(state.kv.used(), 2 * 481 * per_token);
        // Nothing left to evict: a third is refused, with a message a client can act on.
        let err = open(&url, &tokens(400, 4), 0.0, 1)
            .await
            .err()
            .expect("refused");
        assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
        assert!(err.message().contains("KV memory is full"), "{err:?}");
        a.close().await;
        b.close().await;
        wait_until("both sessions are freed", || state.kv.used() == 0).await;
        // Both are kept now, within what the budget leaves (here all of it).
        wait_until("the closed sessions are kept", || state.kv.kept().1 == 2).await;
        let text = scrape(verify.metrics.unwrap()).await;
        let stored = series_value(
            &text,
            "sequoia_prefix_cache_stored_bytes{service=\"verify-service\"}",
        )
        .unwrap();
        assert_eq!(stored as usize, state.kv.kept().0);
    }));
}

#[test]
fn the_second_turn_of_a_chat_reuses_both_sides_caches_and_stays_exact() {
    let pair = TinyPair::new();
    let mut vc = verify_config(&pair.target);
    vc.metrics_listen = "127.0.0.1:0".into();
    vc.prefix_cache.min_tokens = 1;
    let verify = start_verify(vc);
    let mut dc = draft_config(&pair.draft, &[verify.url()], 4, 3);
    dc.metrics_listen = "127.0.0.1:0".into();
    dc.prefix_cache.min_tokens = 1;
    let draft = start_draft(dc);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(within(240, async {
        let first = "The quick brown fox jumps over the lazy dog. Tell me a story";
        let want1 = plain_greedy(&pair.target, first, 24);
        let got1 = generate(&draft.url(), request(first, 24, 0.0, 1))
            .await
            .unwrap();
        assert_eq!(got1.tokens, want1);
        // The client resends the history with a new message.
        let second = format!("{first}{} And then what happened?", got1.text);
        let stored = "sequoia_prefix_cache_stored_bytes{service=\"verify-service\"}";
        for _ in 0..500 {
            let text = scrape(verify.metrics.unwrap()).await;
            if series_value(&text, stored).unwrap() > 0.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let want2 = plain_greedy(&pair.target, &second, 24);
        let got2 = generate(&draft.url(), request(&second, 24, 0.0, 1))
            .await
            .unwrap();
        assert_eq!(
            got2.tokens, want2,
            "turn 2 on reused prefixes is not the target's output"
        );
        for (m, service) in [
            (verify.metrics, "verify-service"),
            (draft.metrics, "draft-service"),
        ] {
            let text = scrape(m.unwrap()).await;
            let hits = series_value(
                &text,
                &format!("sequoia_prefix_cache_hit_tokens_total{{service=\"{service}\"}}"),
            )
            .unwrap();
            assert!(hits > 0.0, "{service} reused nothing");
            let hit_count = series_value(
                &text,
                &format!("sequoia_prefix_cache_hits_total{{service=\"{service}\"}}"),
            )
            .unwrap();
            assert_eq!(hit_count, 1.0, "{service}: only turn 2 can hit");
        }
    }));
}
