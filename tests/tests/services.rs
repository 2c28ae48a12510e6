//! Both services end to end on tiny random-weight models made by the test.

use sequoia_core::sampling::SamplingParams;
use sequoia_proto::v1::verifier_client::VerifierClient;
use sequoia_proto::v1::{
    session_request, session_response, GenerateRequest, OpenSession, SamplingConfig,
    SessionRequest, SparseDist, VerifyTree,
};
use sequoia_tests::*;
use tonic::Code;

const PROMPTS: [&str; 4] = [
    "hello world",
    "The quick brown fox",
    "fn main() { println!(\"hi\"); }",
    "a",
];

/// (a) At T = 0 the service pair emits exactly the target's greedy tokens, for several tree
/// shapes (1 node = no speculation, chains, Sequoia trees).
#[test]
fn greedy_output_equals_target_only_decoding() {
    let pair = TinyPair::new();
    let verify = start_verify(verify_config(&pair.target));
    let want: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| plain_greedy(&pair.target, p, 40))
        .collect();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut total_steps = 0;
    let mut total_tokens = 0;
    for (nodes, levels) in [(1, 1), (4, 4), (8, 4), (16, 6)] {
        let mut config = draft_config(&pair.draft, &[verify.url()], nodes, levels);
        // One node means no speculation at all here: no lookup branches either, and root-only
        // trees rather than the decode fallback (tests/tests/fallback.rs covers that), so each
        // token is one verified step.
        config.lookup.max_tokens = 0;
        config.fallback.enabled = false;
        let draft = start_draft(config);
        for (prompt, want) in PROMPTS.iter().zip(&want) {
            let got = rt
                .block_on(within(
                    120,
                    generate(&draft.url(), request(prompt, 40, 0.0, 1)),
                ))
                .expect("generation succeeds");
            assert_eq!(
                &got.tokens, want,
                "prompt {prompt:?}, tree of {nodes} nodes"
            );
            let s = got.summary.expect("final chunk carries a summary");
            assert_eq!(s.generated_tokens as usize, want.len());
            if nodes > 1 {
                total_steps += s.steps;
                total_tokens += s.generated_tokens;
            } else {
                assert_eq!(
                    s.steps as usize,
                    want.len() + usize::from(s.finish_reason == "eos")
                );
            }
        }
    }
    // The noisy draft agrees with the target often enough to save steps.
    assert!(
        total_steps < total_tokens,
        "{total_steps} steps for {total_tokens} tokens"
    );
}

/// Prompt-lookup branches (ALGORITHMS.md §9) grafted onto root-only trees and onto drafted
/// trees: the output is still exactly the target's greedy decoding, and on a prompt that
/// repeats itself lookup nodes are proposed and accepted.
#[test]
fn lookup_branches_stay_exact_and_are_accepted() {
    let pair = TinyPair::new();
    let verify = start_verify(verify_config(&pair.target));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let repetitive =
        "one two three four five one two three four five one two three four five one two";
    let prompts = [PROMPTS[0], PROMPTS[2], repetitive];
    let mut proposed = 0;
    let mut accepted = 0;
    for (nodes, levels) in [(1, 1), (4, 3)] {
        let mut config = draft_config(&pair.draft, &[verify.url()], nodes, levels);
        config.lookup.max_tokens = 6;
        let draft = start_draft(config);
        for prompt in prompts {
            let want = plain_greedy(&pair.target, prompt, 48);
            let got = rt
                .block_on(within(
                    120,
                    generate(&draft.url(), request(prompt, 48, 0.0, 1)),
                ))
                .expect("generation succeeds");
            assert_eq!(got.tokens, want, "prompt {prompt:?}, tree of {nodes} nodes");
            let s = got.summary.expect("summary");
            assert!(s.lookup_accepted <= s.lookup_proposed);
            proposed += s.lookup_proposed;
            accepted += s.lookup_accepted;
            // A forced root-only tree is plain target decoding: no lookup branches.
            let forced = rt
                .block_on(within(
                    120,
                    generate(
                        &draft.url(),
                        GenerateRequest {
                            tree_parents: vec![-1],
                            ..request(prompt, 48, 0.0, 1)
                        },
                    ),
                ))
                .expect("generation succeeds");
            assert_eq!(forced.tokens, want);
            let s = forced.summary.expect("summary");
            assert_eq!(s.lookup_proposed, 0, "a forced tree is sent as given");
            assert!(s.mean_tokens_per_step <= 1.0 + 1e-9, "{s:?}");
        }
    }
    assert!(proposed > 0, "no lookup branch was ever proposed");
    assert!(
        accepted > 0,
        "no lookup node was ever accepted ({proposed} proposed)"
    );
}

/// Auto mode profiles the verify node, plans from measured costs, re-plans as verdicts come
/// in, and stays exact.
#[test]
fn auto_planner_stays_exact_and_reports_its_plan() {
    let pair = TinyPair::new();
    let verify = start_verify(verify_config(&pair.target));
    let mut cfg = draft_config(&pair.draft, &[verify.url()], 16, 6);
    cfg.tree.mode = "auto".into();
    cfg.tree.replan_every_steps = 2;
    let draft = start_draft(cfg);
    let rt = tokio::runtime::Runtime::new().unwrap();
    for prompt in PROMPTS {
        let want = plain_greedy(&pair.target, prompt, 40);
        let got = rt
            .block_on(within(
                120,
                generate(&draft.url(), request(prompt, 40, 0.0, 1)),
            ))
            .unwrap();
        assert_eq!(got.tokens, want, "prompt {prompt:?}");
        let plan = got.summary.unwrap().plan.unwrap();
        assert_eq!(plan.mode, "auto");
        assert!(plan.nodes >= 1 && plan.nodes <= 16);
        assert!(plan.predicted_speedup > 0.0 && plan.predicted_step_ms > 0.0);
        assert!(!plan.acceptance.is_empty());
        if want.len() > 8 {
            assert!(plan.replans > 0, "long generations re-plan");
        }
    }
}

/// (b) At T = 1 the first two generated tokens follow the target's own sampling distribution.
/// Statistic: for each token, |empirical − p| in binomial standard deviations; bound 5σ per
/// token (false alarm < 6e-7 per cell, < 4e-4 over the whole vocabulary of both positions);
/// seeds are fixed, so the outcome is deterministic.
#[test]
fn sampled_output_follows_the_target_distribution() {
    let pair = TinyPair::new();
    let verify = start_verify(verify_config(&pair.target));
    let draft = start_draft(draft_config(&pair.draft, &[verify.url()], 8, 4));
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
    };
    let prompt = "The quick brown fox";
    let (p1, p2) = target_first_two(&pair.target, prompt, &params);
    let eos = sequoia_engine::tokenizer::TextTokenizer::load_for_model(&pair.target)
        .unwrap()
        .eos_ids()[0];
    let rt = tokio::runtime::Runtime::new().unwrap();
    const N: usize = 3000;
    let (mut c1, mut c2) = (vec![0usize; p1.len()], vec![0usize; p2.len()]);
    let mut accepted = 0u64;
    rt.block_on(async {
        let mut client =
            sequoia_proto::v1::generation_client::GenerationClient::connect(draft.url())
                .await
                .unwrap();
        for seed in 0..N as u64 {
            let mut stream = client
                .generate(request(prompt, 2, 1.0, seed))
                .await
                .unwrap()
                .into_inner();
            let mut toks = Vec::new();
            let mut finish = String::new();
            while let Some(chunk) = stream.message().await.unwrap() {
                toks.extend(chunk.token_ids);
                if let Some(s) = chunk.summary {
                    accepted += s.accepted_by_rank.iter().sum::<u64>();
                    finish = s.finish_reason;
                }
            }
            // An EOS is not part of the output; put it back where it was sampled.
            if finish == "eos" {
                toks.push(eos);
            }
            c1[toks[0] as usize] += 1;
            if toks[0] != eos {
                c2[toks[1] as usize] += 1;
            }
        }
    });
    assert!(
        accepted > 0,
        "the draft proposals were never accepted: the test would not exercise the rule"
    );
    let s1 = worst_sigma(&c1, &p1, N);
    assert!(s1 <= 5.0, "first token deviates by {s1:.2}σ");
    let n2: usize = c2.iter().sum();
    let s2 = worst_sigma(&c2, &p2, n2);
    assert!(s2 <= 5.0, "second token deviates by {s2:.2}σ");
}

fn open_msg(prefix: Vec<u32>, temperature: f32) -> SessionRequest {
    SessionRequest {
        msg: Some(session_request::Msg::Open(OpenSession {
            prefix_tokens: prefix,
            sampling: Some(SamplingConfig {
                temperature,
                top_p: 1.0,
                top_k: 0,
            }),
            seed: 7,
            max_new_tokens: 16,
            protocol_version: sequoia_core::limits::PROTOCOL_VERSION,
            ..Default::default()
        })),
    }
}

fn tree_msg(
    step: u64,
    parents: Vec<i32>,
    tokens: Vec<u32>,
    dists: Vec<SparseDist>,
) -> SessionRequest {
    SessionRequest {
        msg: Some(session_request::Msg::Tree(VerifyTree {
            step,
            parents,
            tokens,
            draft_dists: dists,
            assumes: None,
        })),
    }
}

/// Run a session with the given messages; return the first error status (or None).
async fn session_error(url: &str, msgs: Vec<SessionRequest>) -> Option<tonic::Status> {
    let mut client = VerifierClient::connect(url.to_string()).await.unwrap();
    let out = client.session(tokio_stream::iter(msgs)).await;
    let mut stream = match out {
        Ok(r) => r.into_inner(),
        Err(s) => return Some(s),
    };
    loop {
        match stream.message().await {
            Ok(Some(_)) => continue,
            Ok(None) => return None,
            Err(s) => return Some(s),
        }
    }
}

/// (c) Malformed session messages get INVALID_ARGUMENT naming the field; the node keeps serving.
#[test]
fn malformed_session_messages_are_rejected() {
    let pair = TinyPair::new();
    let verify = start_verify(verify_config(&pair.target));
    let url = verify.url();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let q = |tokens: Vec<u32>, probs: Vec<f32>| SparseDist { tokens, probs };
    let cases: Vec<(Vec<SessionRequest>, &str)> = vec![
        (
            vec![tree_msg(0, vec![-1], vec![1], vec![])],
            "first message",
        ),
        (
            vec![
                open_msg(vec![1, 2], 0.0),
                tree_msg(0, vec![-1, 5], vec![1, 2], vec![]),
            ],
            "tree.parents",
        ),
        (
            vec![
                open_msg(vec![1, 2], 0.0),
                tree_msg(0, vec![0], vec![1], vec![]),
            ],
            "tree.parents",
        ),
        (
            vec![
                open_msg(vec![1, 2], 0.0),
                tree_msg(0, vec![-1, 0], vec![1], vec![]),
            ],
            "tokens",
        ),
        (
            vec![
                open_msg(vec![1, 2], 0.0),
                tree_msg(0, vec![-1], vec![1_000_000], vec![]),
            ],
            "vocabulary",
        ),
        (
            vec![
                open_msg(vec![1, 2], 0.0),
                tree_msg(3, vec![-1], vec![1], vec![]),
            ],
            "tree.step",
        ),
        (
            vec![
                open_msg(vec![1, 2], 1.0),
                tree_msg(0, vec![-1, 0], vec![1, 2], vec![]),
            ],
            "draft_dists",
        ),
        (
            vec![
                open_msg(vec![1, 2], 1.0),
                tree_msg(
                    0,
                    vec![-1, 0],
                    vec![1, 2],
                    vec![q(vec![2, 3], vec![0.9, 0.9])],
                ),
            ],
            "draft_dists[0]",
        ),
        (
            vec![
                open_msg(vec![1, 2], 1.0),
                tree_msg(0, vec![-1, 0], vec![1, 2], vec![q(vec![2], vec![f32::NAN])]),
            ],
            "draft_dists[0]",
        ),
        (
            vec![
                open_msg(vec![1, 2], 1.0),
                tree_msg(0, vec![-1, 0], vec![1, 4], vec![q(vec![2], vec![1.0])]),
            ],
            "probability 0",
        ),
        (
            vec![open_msg(vec![9_999_999], 0.0)],
            "open.prefix_tokens[0]",
        ),
        (
            vec![SessionRequest {
                msg: Some(session_request::Msg::Open(OpenSession {
                    sampling: Some(SamplingConfig {
                        temperature: -1.0,
                        top_p: 1.0,
                        top_k: 0,
                    }),
                    ..Default::default()
                })),
            }],
            "open.sampling",
        ),
    ];
    for (msgs, field) in cases {
        let status = rt
            .block_on(within(30, session_error(&url, msgs)))
            .expect("an error status");
        assert_eq!(status.code(), Code::InvalidArgument, "{field}: {status:?}");
        assert!(
            status.message().contains(field),
            "message {:?} should name {field:?}",
            status.message()
        );
    }
    // Too much context is a resource limit, not a malformed message.
    let status = rt
        .block_on(session_error(
            &url,
            vec![SessionRequest {
                msg: Some(session_request::Msg::Open(OpenSession {
                    prefix_tokens: vec![1; 10],
                    max_new_tokens: 100_000,
                    ..Default::default()
                })),
            }],
        ))
        .unwrap();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    // Still serving: a valid session verifies.
    let ok = rt.block_on(async {
        let mut client = VerifierClient::connect(url.clone()).await.unwrap();
        let msgs = vec![
            open_msg(vec![1, 2], 0.0),
            tree_msg(0, vec![-1, 0], vec![3, 4], vec![]),
        ];
        let mut stream = client
            .session(tokio_stream::iter(msgs))
            .await
            .unwrap()
            .into_inner();
        let mut verdicts = 0;
        while let Some(r) = stream.message().await.unwrap() {
            if let Some(session_response::Msg::Verdict(v)) = r.msg {
                assert!(v.accepted_nodes.len() <= 1);
                verdicts += 1;
            }
        }
        verdicts
    });
    assert_eq!(ok, 1);
}

/// (d) A verify node whose tokenizer differs is refused with FAILED_PRECONDITION.
#[test]
fn mismatched_tokenizers_fail_precondition() {
    let pair = TinyPair::new();
    let verify = start_verify(verify_config(&pair.other));
    let draft = start_draft(draft_config(&pair.draft, &[verify.url()], 4, 3));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let err = rt
        .block_on(within(
            60,
            generate(&draft.url(), request("hello", 8, 0.0, 1)),
        ))
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("tokenizer"), "{}", err.message());
}

/// (e) A verify node that is down, or dies mid-generation, gives UNAVAILABLE with a request id
/// (the node's address goes to the draft's log, not to the public client) — no hang.
#[test]
fn dead_verify_node_gives_unavailable() {
    let pair = TinyPair::new();
    let rt = tokio::runtime::Runtime::new().unwrap();
    // Down from the start: nothing listens on the address.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let draft = start_draft(draft_config(&pair.draft, &[dead.clone()], 4, 3));
    let err = rt
        .block_on(within(
            60,
            generate(&draft.url(), request("hello", 8, 0.0, 1)),
        ))
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    // Public clients get a reason and a request id; the node's address stays in the log.
    assert!(!err.message().contains(&dead), "{}", err.message());
    assert!(err.message().contains("request id"), "{}", err.message());

    // Killed mid-generation. A sampled answer that reaches EOS before the kill takes effect
    // (a short one, on a loaded machine) proves nothing: then the next seed runs.
    let (err, url) = (5..15)
        .find_map(|seed| {
            let mut verify = start_verify(verify_config(&pair.target));
            let url = verify.url();
            let draft = start_draft(draft_config(&pair.draft, &[url.clone()], 4, 3));
            rt.block_on(within(60, async {
                let mut client =
                    sequoia_proto::v1::generation_client::GenerationClient::connect(draft.url())
                        .await
                        .unwrap();
                let mut stream = client
                    .generate(request("The quick brown fox", 900, 1.0, seed))
                    .await
                    .unwrap()
                    .into_inner();
                let first = stream.message().await.expect("first chunk arrives");
                assert!(first.is_some());
                verify.kill();
                let mut finish = None;
                loop {
                    match stream.message().await {
                        Ok(Some(c)) => finish = c.summary.map(|s| s.finish_reason).or(finish),
                        Ok(None) => {
                            assert_eq!(
                                finish.as_deref(),
                                Some("eos"),
                                "stream ended without an error after its verify node died"
                            );
                            return None;
                        }
                        Err(s) => return Some((s, url)),
                    }
                }
            }))
        })
        .expect("some generation was still running when its verify node died");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(!err.message().contains(&url), "{}", err.message());
    assert!(err.message().contains("request id"), "{}", err.message());
}

/// Bad Generate requests are INVALID_ARGUMENT naming the field.
#[test]
fn bad_generate_requests_are_invalid_argument() {
    let pair = TinyPair::new();
    let verify = start_verify(verify_config(&pair.target));
    let draft = start_draft(draft_config(&pair.draft, &[verify.url()], 4, 3));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let cases = [
        (request("", 8, 0.0, 1), "prompt"),
        (request("hi", 8, -1.0, 1), "temperature"),
        (request("hi", 8, f32::NAN, 1), "temperature"),
        (
            sequoia_proto::v1::GenerateRequest {
                top_p: 1.5,
                ..request("hi", 8, 1.0, 1)
            },
            "top_p",
        ),
        (
            sequoia_proto::v1::GenerateRequest {
                stop: vec![String::new()],
                ..request("hi", 8, 1.0, 1)
            },
            "stop",
        ),
    ];
    for (req, field) in cases {
        let err = rt.block_on(generate(&draft.url(), req)).unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{field}: {err:?}");
        assert!(err.message().contains(field), "{}", err.message());
    }
    let err = rt
        .block_on(generate(&draft.url(), request("hi", 100_000, 0.0, 1)))
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
}

/// Stop strings end the text before the match; max_tokens bounds the output.
#[test]
fn stop_strings_and_max_tokens() {
    let pair = TinyPair::new();
    let verify = start_verify(verify_config(&pair.target));
    let draft = start_draft(draft_config(&pair.draft, &[verify.url()], 8, 4));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let full = rt
        .block_on(generate(&draft.url(), request("hello world", 30, 0.0, 1)))
        .unwrap();
    assert!(full.tokens.len() <= 30);
    let s = full.summary.as_ref().unwrap();
    assert!(s.finish_reason == "length" || s.finish_reason == "eos");
    // Pick a stop string from the middle of the greedy text.
    let chars: Vec<char> = full.text.chars().collect();
    if chars.len() >= 6 {
        let stop: String = chars[3..5].iter().collect();
        let req = sequoia_proto::v1::GenerateRequest {
            stop: vec![stop.clone()],
            ..request("hello world", 30, 0.0, 1)
        };
        let cut = rt.block_on(generate(&draft.url(), req)).unwrap();
        let expect_end = full.text.find(&stop).unwrap();
        assert_eq!(cut.text, full.text[..expect_end], "stop {stop:?}");
        assert_eq!(cut.summary.unwrap().finish_reason, "stop");
    }
}
