//! The decode fallback (docs/ALGORITHMS.md §5.5) end to end on tiny models: when the plan is no
//! speculation, the verify node decodes several tokens per round trip on its own. Its output
//! must be plain target decoding: greedy equal to the target alone, seeded sampling identical to
//! root-only trees (same sampling rule, same random stream) and distributed as the target's;
//! stop strings and max_tokens cut exactly mid-decode; malformed decodes are refused.

use sequoia_core::limits;
use sequoia_core::sampling::SamplingParams;
use sequoia_engine::tokenizer::TextTokenizer;
use sequoia_proto::v1 as pb;
use sequoia_proto::v1::GenerateRequest;
use sequoia_tests::*;
use tonic::Code;

const PROMPTS: [&str; 3] = [
    "hello world",
    "The quick brown fox",
    "fn main() { println!(\"hi\"); }",
];

/// A draft node whose plan is no speculation (fixed mode, one node), served by decodes of up to
/// `k` tokens, `per_message` tokens per message; `on = false` turns the fallback off (root-only
/// trees, one round trip per token).
fn fallback_draft(pair: &TinyPair, verify: &str, k: usize, per_message: u32, on: bool) -> Running {
    let mut config = draft_config(&pair.draft, &[verify.to_string()], 1, 1);
    config.fallback.enabled = on;
    config.fallback.max_tokens = k;
    config.fallback.tokens_per_message = per_message;
    start_draft(config)
}

#[test]
fn greedy_output_through_the_fallback_equals_target_only_decoding() {
    let pair = TinyPair::new();
    let rt = tokio::runtime::Runtime::new().unwrap();
    for batching in [true, false] {
        let mut vc = verify_config(&pair.target);
        vc.batch.enabled = batching;
        let verify = start_verify(vc);
        for (k, per_message) in [(5, 1), (16, 3)] {
            let draft = fallback_draft(&pair, &verify.url(), k, per_message, true);
            for prompt in PROMPTS {
                let want = plain_greedy(&pair.target, prompt, 40);
                let got = rt
                    .block_on(within(
                        120,
                        generate(&draft.url(), request(prompt, 40, 0.0, 1)),
                    ))
                    .expect("generation succeeds");
                let ctx = format!("prompt {prompt:?}, k {k}, batching {batching}");
                assert_eq!(got.tokens, want, "{ctx}");
                let s = got.summary.unwrap();
                // Every token came from a decode (an EOS that ended it is decoded too, not
                // generated), in fewer round trips than tokens.
                assert!(s.fallback_tokens >= s.generated_tokens, "{ctx}: {s:?}");
                assert!(s.fallback_tokens > 0, "{ctx}");
                let round_trips = (s.generated_tokens as usize).div_ceil(k) as u32;
                assert!(s.steps <= round_trips.max(1), "{ctx}: {} steps", s.steps);
                assert_eq!(s.drafted_tokens, 0, "{ctx}: nothing is drafted");
                // Text streams while the decode goes on: one chunk per message at least.
                if s.generated_tokens as usize > 2 * k {
                    assert!(got.chunks.len() > s.steps as usize, "{ctx}");
                }
            }
        }
    }
}

/// With pipelining asked for, the draft node runs the decoded tokens through its model while
/// the next message comes (generation/mod.rs `decode`, keep-up): the decode loop hands the
/// draft to a catch-up task and takes it back between messages (here 25 catch-ups over the
/// prompts), and no message may be lost, reordered or cut short by it: greedy output stays the
/// target's, and seeded sampled output is the same with and without keep-up. (That the draft's
/// cache ends bit-identical is `decoded_tokens_leave_the_drafter_where_a_prefill_would` in the
/// engine's tests; here the draft proposes nothing.)
#[test]
fn the_draft_keeping_up_during_decodes_changes_no_token() {
    let pair = TinyPair::new();
    let verify = start_verify(verify_config(&pair.target));
    let draft = fallback_draft(&pair, &verify.url(), 6, 1, true);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let run = |prompt: &str, t: f32, seed: u64, pipeline: bool| {
        let mut req = request(prompt, 30, t, seed);
        req.pipeline = Some(pipeline);
        rt.block_on(within(120, generate(&draft.url(), req)))
            .expect("generation succeeds")
    };
    for prompt in PROMPTS {
        let want = plain_greedy(&pair.target, prompt, 30);
        let got = run(prompt, 0.0, 1, true);
        assert_eq!(got.tokens, want, "prompt {prompt:?}");
        let s = got.summary.unwrap();
        assert!(
            s.fallback_tokens > 0,
            "prompt {prompt:?}: nothing was decoded"
        );
        for seed in 0..2 {
            let (on, off) = (run(prompt, 0.8, seed, true), run(prompt, 0.8, seed, false));
            assert_eq!(on.tokens, off.tokens, "prompt {prompt:?}, seed {seed}");
        }
    }
}

#[test]
fn seeded_sampling_through_the_fallback_equals_root_only_trees() {
    let pair = TinyPair::new();
    let verify = start_verify(verify_config(&pair.target));
    let decode = fallback_draft(&pair, &verify.url(), 7, 2, true);
    let trees = fallback_draft(&pair, &verify.url(), 7, 2, false);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut differ = 0;
    for t in [0.3f32, 0.7, 1.0] {
        for seed in 0..4u64 {
            let prompt = PROMPTS[seed as usize % PROMPTS.len()];
            let run = |url: String| {
                rt.block_on(within(120, generate(&url, request(prompt, 30, t, seed))))
                    .expect("generation succeeds")
            };
            let (a, b, again) = (run(decode.url()), run(trees.url()), run(decode.url()));
            assert_eq!(
                a.tokens, b.tokens,
                "T {t}, seed {seed}: decode vs root-only trees"
            );
            assert_eq!(a.tokens, again.tokens, "T {t}, seed {seed}: reproducible");
            let (sa, sb) = (a.summary.unwrap(), b.summary.unwrap());
            assert!(sa.fallback_tokens > 0 && sb.fallback_tokens == 0);
            let other = rt
                .block_on(within(
                    120,
                    generate(&decode.url(), request(prompt, 30, t, seed + 1000)),
                ))
                .unwrap();
            differ += usize::from(other.tokens != a.tokens);
        }
    }
    assert!(differ > 0, "sampling ignored the seed");
}

/// The third generated token through the fallback follows the target's distribution (the
/// statistic of tests/tests/pipeline.rs: |empirical − p| in binomial σ, bound 5σ per cell).
#[test]
fn sampling_through_the_fallback_follows_the_target_distribution() {
    let pair = TinyPair::new();
    let verify = start_verify(verify_config(&pair.target));
    // Two tokens per decode: the third token is the first of the second decode.
    let draft = fallback_draft(&pair, &verify.url(), 2, 1, true);
    let eos = TextTokenizer::load_for_model(&pair.target)
        .unwrap()
        .eos_ids()[0];
    let prompt = "The quick brown fox";
    let rt = tokio::runtime::Runtime::new().unwrap();
    const N: usize = 1000;
    for t in [0.7f32, 1.0] {
        let params = SamplingParams {
            temperature: t,
            top_k: 0,
            top_p: 1.0,
        };
        let p3 = target_third(&pair.target, prompt, &params);
        let mut c3 = vec![0usize; p3.len()];
        let mut decoded = 0u64;
        rt.block_on(async {
            let mut client =
                sequoia_proto::v1::generation_client::GenerationClient::connect(draft.url())
                    .await
                    .unwrap();
            for seed in 0..N as u64 {
                let mut stream = client
                    .generate(request(prompt, 3, t, seed))
                    .await
                    .unwrap()
                    .into_inner();
                let mut toks = Vec::new();
                let mut finish = String::new();
                while let Some(chunk) = stream.message().await.unwrap() {
                    toks.extend(chunk.token_ids);
                    if let Some(s) = chunk.summary {
                        decoded += s.fallback_tokens as u64;
                        finish = s.finish_reason;
                    }
                }
                if finish == "eos" {
                    toks.push(eos);
                }
                if toks.len() == 3 {
                    c3[toks[2] as usize] += 1;
                }
            }
        });
        let n3: usize = c3.iter().sum();
        assert!(
            n3 > N / 2,
            "T {t}: only {n3} generations reached a third token"
        );
        assert!(decoded >= 3 * n3 as u64, "T {t}: tokens were not decoded");
        let s3 = worst_sigma(&c3, &p3, n3);
        assert!(s3 <= 5.0, "T {t}: third token deviates by {s3:.2}σ");
        eprintln!("T {t}: {n3} third tokens through the fallback, worst {s3:.2}σ");
    }
}

#[test]
fn stop_strings_and_max_tokens_cut_a_decode_exactly() {
    let pair = TinyPair::new();
    let verify = start_verify(verify_config(&pair.target));
    let draft = fallback_draft(&pair, &verify.url(), 8, 3, true);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let prompt = "hello world";
    let want = plain_greedy(&pair.target, prompt, 30);
    assert!(want.len() >= 20, "the tiny target must not stop this early");
    // max_tokens in the middle of a decode (13 = 8 + 5).
    let cut = rt
        .block_on(generate(&draft.url(), request(prompt, 13, 0.0, 1)))
        .unwrap();
    assert_eq!(cut.tokens, want[..13]);
    let s = cut.summary.unwrap();
    assert_eq!(s.finish_reason, "length");
    assert_eq!(
        s.fallback_tokens, 13,
        "the last decode asked for only what was left"
    );
    // A stop string completed by the 11th token (mid-decode): the text ends before it, and
    // nothing after it reaches the client.
    let full = rt
        .block_on(generate(&draft.url(), request(prompt, 30, 0.0, 1)))
        .unwrap();
    let tok = TextTokenizer::load_for_model(&pair.target).unwrap();
    let before = tok.decode(&want[..10], true).unwrap();
    let upto = tok.decode(&want[..11], true).unwrap();
    assert!(upto.len() > before.len(), "token 11 has text");
    assert!(full.text.starts_with(&upto));
    // The stop string spans the end of token 10's text and token 11's.
    let start = before.len().saturating_sub(1);
    let start = (0..=start)
        .rev()
        .find(|&i| upto.is_char_boundary(i))
        .unwrap();
    let stop = upto[start..].to_string();
    let req = GenerateRequest {
        stop: vec![stop.clone()],
        ..request(prompt, 30, 0.0, 1)
    };
    let stopped = rt.block_on(generate(&draft.url(), req)).unwrap();
    let end = full.text.find(&stop).unwrap();
    assert_eq!(stopped.text, full.text[..end], "stop {stop:?}");
    let s = stopped.summary.unwrap();
    assert_eq!(s.finish_reason, "stop");
    assert!(s.generated_tokens <= 11, "{s:?}");
    assert!(stopped.tokens.iter().zip(&want).all(|(a, b)| a == b));
}

fn decode_msg(step: u64, root: u32, max_tokens: u32, per_message: u32) -> pb::SessionRequest {
    pb::SessionRequest {
        msg: Some(pb::session_request::Msg::Decode(pb::DecodeTokens {
            step,
            root,
            max_tokens,
            tokens_per_message: per_message,
        })),
    }
}

#[test]
fn verify_node_decodes_on_the_wire_and_refuses_malformed_decodes() {
    let pair = TinyPair::new();
    let verify = start_verify(verify_config(&pair.target));
    let tok = TextTokenizer::load_for_model(&pair.target).unwrap();
    let prompt = tok.encode("hello world", true).unwrap();
    let root = *prompt.last().unwrap();
    let want = plain_greedy(&pair.target, "hello world", 8);
    assert_eq!(want.len(), 8);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(within(120, async {
        // A good decode: 8 tokens, 3 per message, numbered as steps, the last one `done`.
        let (tx, mut s) = open_session(&verify.url(), &prompt, limits::PROTOCOL_VERSION).await;
        tx.send(decode_msg(0, root, 8, 3)).await.unwrap();
        let mut got = Vec::new();
        let mut sizes = Vec::new();
        loop {
            let Some(pb::session_response::Msg::Decoded(d)) =
                s.message().await.unwrap().unwrap().msg
            else {
                panic!("expected decoded")
            };
            assert_eq!(d.step, got.len() as u64);
            assert!(d.verify_ms.is_finite() && d.verify_ms >= 0.0);
            sizes.push(d.tokens.len());
            got.extend(d.tokens);
            if d.done {
                break;
            }
        }
        assert_eq!(got, want);
        assert_eq!(sizes, vec![3, 3, 2]);
        // The session goes on: a tree at the next step is verified after the decode.
        tx.send(pb::SessionRequest {
            msg: Some(pb::session_request::Msg::Tree(pb::VerifyTree {
                step: 8,
                parents: vec![-1],
                tokens: vec![got[7]],
                draft_dists: vec![],
                assumes: None,
            })),
        })
        .await
        .unwrap();
        match s.message().await.unwrap().unwrap().msg {
            Some(pb::session_response::Msg::Verdict(v)) => assert_eq!(v.step, 8),
            other => panic!("expected a verdict, got {other:?}"),
        }

        // Malformed decodes: INVALID_ARGUMENT naming the field.
        let vocab = sequoia_engine::tokenizer::testing::TINY_VOCAB_SIZE as u32;
        for (msg, field) in [
            (decode_msg(0, root, 0, 1), "decode.max_tokens"),
            (
                decode_msg(0, root, limits::MAX_DECODE_TOKENS + 1, 1),
                "decode.max_tokens",
            ),
            (decode_msg(0, vocab + 5, 4, 1), "decode.root"),
            (decode_msg(3, root, 4, 1), "decode.step"),
        ] {
            let (tx, mut s) = open_session(&verify.url(), &prompt, limits::PROTOCOL_VERSION).await;
            tx.send(msg).await.unwrap();
            let err = s.message().await.unwrap_err();
            assert_eq!(err.code(), Code::InvalidArgument, "{field}: {err:?}");
            assert!(err.message().contains(field), "{field}: {err:?}");
        }
        // A session opened at an older version may not decode.
        let (tx, mut s) = open_session(&verify.url(), &prompt, 2).await;
        tx.send(decode_msg(0, root, 4, 1)).await.unwrap();
        let err = s.message().await.unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
        assert!(err.message().contains("protocol version"), "{err:?}");
    }));
}
