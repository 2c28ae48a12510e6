//! Continuous batching on the verify node (verify-service/src/batch.rs, docs/ALGORITHMS.md §11):
//! sessions verified together in shared forwards get verdicts bit-identical to the same
//! sessions run alone, at T = 0 and at T > 0 with fixed seeds; long prompts are prefilled in
//! chunks between other sessions' trees; the KV memory budget refuses what does not fit.
//!
//! The target is a random-weight quantized model (batch-invariant kernels), driven by a test
//! client that plays the draft side: it sends trees of fixed shapes with pseudo-random tokens.

use sequoia_core::limits;
use sequoia_engine::random::{RandomQuant, RandomSpec};
use sequoia_engine::tokenizer::testing::write_tiny_tokenizer;
use sequoia_engine::tokenizer::TextTokenizer;
use sequoia_engine::{Kernels, LoadOptions, Model};
use sequoia_proto::v1 as pb;
use sequoia_proto::v1::verifier_client::VerifierClient;
use sequoia_tests::*;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;
use verify_service::config::VerifyConfig;
use verify_service::service::VerifyState;

const VOCAB: u32 = 512; // the random "tiny" shape

/// Most sessions any verdict said shared its forward (the load the draft's planner reads).
static MAX_BATCH_SESSIONS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

fn node(configure: impl FnOnce(&mut VerifyConfig)) -> Running {
    let spec = RandomSpec {
        seed: 21,
        quant: RandomQuant::Q4KM,
        ..RandomSpec::named("tiny").unwrap()
    };
    let model = Model::random(&spec, &LoadOptions::default(), Kernels::Native).unwrap();
    assert!(
        model.info().batch_invariant,
        "the test needs batch-invariant kernels"
    );
    let dir = tempfile::tempdir().unwrap();
    write_tiny_tokenizer(dir.path()).unwrap();
    let tokenizer = TextTokenizer::load_for_model(dir.path()).unwrap();
    let mut config = verify_config(dir.path());
    config.metrics_listen = "127.0.0.1:0".into();
    // Every tree here goes through the batch scheduler whole: a lone session that decodes
    // while it waits would forward only a subtree, or nothing, and report fewer rows than its
    // tree (its verdicts are the same; that feature has its own tests).
    config.decode_while_waiting = false;
    configure(&mut config);
    start_verify_state(Arc::new(VerifyState::new(model, tokenizer, config)))
}

fn mix(a: u64, b: u64, c: u64) -> u64 {
    let mut x = a.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ b.wrapping_mul(0xbf58_476d_1ce4_e5b9) ^ c;
    x ^= x >> 29;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 32)
}

/// What one session does: its prompt, sampling, and the tree shape it sends every step.
#[derive(Clone)]
struct Plan {
    id: u64,
    prompt_len: usize,
    temperature: f32,
    seed: u64,
    parents: Vec<i32>,
    steps: u64,
}

/// Tokens (root first) and, at T > 0, a q per expanded node for one step's tree; children are
/// distinct pseudo-random tokens, q uniform over them plus one more token.
fn tree_for(plan: &Plan, step: u64, root: u32) -> pb::VerifyTree {
    let n = plan.parents.len();
    let mut tokens = vec![root; n];
    let mut dists = Vec::new();
    for v in 0..n {
        let children: Vec<usize> = (0..n).filter(|&c| plan.parents[c] == v as i32).collect();
        if children.is_empty() {
            continue;
        }
        let mut used = Vec::new();
        for (k, &c) in children.iter().enumerate() {
            let mut t = (mix(plan.id, step, (v * 64 + k) as u64) % VOCAB as u64) as u32;
            while used.contains(&t) {
                t = (t + 1) % VOCAB;
            }
            used.push(t);
            tokens[c] = t;
        }
        let mut extra = (mix(plan.id, step, 9999 + v as u64) % VOCAB as u64) as u32;
        while used.contains(&extra) {
            extra = (extra + 1) % VOCAB;
        }
        used.push(extra);
        let p = 1.0 / used.len() as f32;
        dists.push(pb::SparseDist {
            probs: vec![p; used.len()],
            tokens: used,
        });
    }
    pb::VerifyTree {
        step,
        parents: plan.parents.clone(),
        tokens,
        draft_dists: if plan.temperature > 0.0 {
            dists
        } else {
            Vec::new()
        },
        assumes: None,
    }
}

/// Play one session; returns every verdict (accepted nodes, next token).
async fn play(url: String, plan: Plan) -> Result<Vec<(Vec<u32>, u32)>, tonic::Status> {
    let mut client = VerifierClient::connect(url).await.unwrap();
    let prompt: Vec<u32> = (0..plan.prompt_len as u64)
        .map(|i| (mix(plan.id, 7, i) % VOCAB as u64) as u32)
        .collect();
    let (tx, rx) = mpsc::channel(4);
    tx.send(pb::SessionRequest {
        msg: Some(pb::session_request::Msg::Open(pb::OpenSession {
            prefix_tokens: prompt[..prompt.len() - 1].to_vec(),
            sampling: Some(pb::SamplingConfig {
                temperature: plan.temperature,
                ..Default::default()
            }),
            seed: plan.seed,
            max_new_tokens: 64,
            protocol_version: limits::PROTOCOL_VERSION,
            ..Default::default()
        })),
    })
    .await
    .unwrap();
    let mut inbound = client.session(ReceiverStream::new(rx)).await?.into_inner();
    match inbound.message().await?.and_then(|m| m.msg) {
        Some(pb::session_response::Msg::Opened(_)) => {}
        other => panic!("expected opened, got {other:?}"),
    }
    let mut root = *prompt.last().unwrap();
    let mut verdicts = Vec::new();
    for step in 0..plan.steps {
        let tree = tree_for(&plan, step, root);
        tx.send(pb::SessionRequest {
            msg: Some(pb::session_request::Msg::Tree(tree)),
        })
        .await
        .unwrap();
        match inbound.message().await?.and_then(|m| m.msg) {
            Some(pb::session_response::Msg::Verdict(v)) => {
                assert!(
                    v.batch_rows as usize >= plan.parents.len() && v.batch_sessions >= 1,
                    "a verdict's batch holds at least its own tree: {v:?}"
                );
                MAX_BATCH_SESSIONS
                    .fetch_max(v.batch_sessions, std::sync::atomic::Ordering::Relaxed);
                root = v.next_token;
                verdicts.push((v.accepted_nodes, v.next_token));
            }
            other => panic!("expected a verdict, got {other:?}"),
        }
    }
    Ok(verdicts)
}

fn plans() -> Vec<Plan> {
    let shapes: [Vec<i32>; 4] = [
        vec![-1, 0, 1, 2],
        vec![-1, 0, 0, 0, 1, 1, 2],
        vec![-1, 0, 0, 1, 1, 2, 2, 3, 4],
        vec![-1],
    ];
    let mut out = Vec::new();
    for (i, parents) in shapes.into_iter().enumerate() {
        for (t, temperature) in [0.0f32, 0.8].into_iter().enumerate() {
            out.push(Plan {
                id: (i * 2 + t) as u64,
                // One prompt longer than the prefill chunk, so its prefill is split.
                prompt_len: if i == 2 { 150 } else { 5 + 7 * i },
                temperature,
                seed: 40 + i as u64,
                parents: parents.clone(),
                steps: 12,
            });
        }
    }
    out
}

#[test]
fn batched_sessions_get_the_verdicts_they_get_alone() {
    let batched = node(|c| {
        c.batch.prefill_chunk = 32;
        c.batch.max_wait_us = 20_000;
    });
    let alone = node(|c| c.batch.enabled = false);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(within(240, async {
        let plans = plans();
        let mut want = Vec::new();
        for p in &plans {
            want.push(play(alone.url(), p.clone()).await.expect("alone"));
        }
        // All eight at once, twice (different interleavings), against the batching node.
        for round in 0..2 {
            let runs: Vec<_> = plans
                .iter()
                .map(|p| tokio::spawn(play(batched.url(), p.clone())))
                .collect();
            for (p, (run, want)) in plans.iter().zip(runs.into_iter().zip(&want)) {
                let got = run.await.unwrap().expect("batched");
                assert_eq!(
                    &got, want,
                    "session {} (T = {}) differs batched, round {round}",
                    p.id, p.temperature
                );
            }
        }
        assert!(
            want.iter().flatten().any(|(acc, _)| !acc.is_empty()),
            "no tree node was ever accepted: the comparison would not cover accepted paths"
        );
        // The sessions really shared forwards, and their verdicts said so.
        assert!(MAX_BATCH_SESSIONS.load(std::sync::atomic::Ordering::Relaxed) > 1);
        let text = scrape(batched.metrics.unwrap()).await;
        let sum = series_value(
            &text,
            "sequoia_batch_sessions_sum{service=\"verify-service\"}",
        )
        .unwrap();
        let count = series_value(
            &text,
            "sequoia_batch_sessions_count{service=\"verify-service\"}",
        )
        .unwrap();
        assert!(sum / count > 1.5, "mean sessions per batch {sum}/{count}");
        assert!(
            series_value(
                &text,
                "sequoia_batch_rows_count{service=\"verify-service\"}"
            )
            .unwrap()
                >= count
        );
    }));
}

#[test]
fn kv_budget_refuses_a_session_that_does_not_fit_and_frees_on_close() {
    // Tiny shape: 2 layers × 2 KV heads × 64 dims × 4 bytes × 2 = 2 KiB per token; a session
    // with the default 512-node tree limit reserves > 1 MiB.
    let verify = node(|c| c.kv_budget_mb = 2);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(within(60, async {
        let hold = Plan {
            id: 1,
            prompt_len: 8,
            temperature: 0.0,
            seed: 1,
            parents: vec![-1, 0],
            steps: 1,
        };
        // One session fits; hold it open while a second tries.
        let mut client = VerifierClient::connect(verify.url()).await.unwrap();
        let (tx, rx) = mpsc::channel(4);
        tx.send(pb::SessionRequest {
            msg: Some(pb::session_request::Msg::Open(pb::OpenSession {
                prefix_tokens: vec![1, 2, 3],
                max_new_tokens: 64,
                protocol_version: limits::PROTOCOL_VERSION,
                ..Default::default()
            })),
        })
        .await
        .unwrap();
        let mut held = client
            .session(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        assert!(held.message().await.unwrap().is_some());
        let err = play(verify.url(), hold.clone()).await.unwrap_err();
        assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
        assert!(err.message().contains("KV memory"), "{err:?}");
        let text = scrape(verify.metrics.unwrap()).await;
        assert!(
            series_value(
                &text,
                "sequoia_kv_cache_usage_perc{service=\"verify-service\"}"
            )
            .unwrap()
                > 0.4
        );
        // Closing the first frees its memory.
        drop(tx);
        while held.message().await.ok().flatten().is_some() {}
        let mut ok = None;
        for _ in 0..50 {
            match play(verify.url(), hold.clone()).await {
                Ok(v) => {
                    ok = Some(v);
                    break;
                }
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
            }
        }
        assert!(
            ok.is_some(),
            "the freed memory was not given to the next session"
        );
    }));
}
