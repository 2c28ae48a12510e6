//! Trees sent ahead of the verdict they assume (docs/ALGORITHMS.md §10, "Trees sent ahead"): on
//! the wire, the verify node verifies such a tree right after the verdict it assumed and drops,
//! unanswered and without model work, those whose verdict did not come or whose step is done;
//! end to end, behind a verify node far enough away that the next trees are grown before the
//! verdicts come back, the output is unchanged: greedy output is the target's, and seeded sampled
//! output is the same with sending ahead on and off (a dropped tree consumes no random draws).

use sequoia_core::limits;
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

/// A chain tree `root → next` at `step`, sent ahead for a verdict that accepted `accepted`
/// (None: an ordinary tree).
fn chain(step: u64, tokens: Vec<u32>, assumes: Option<Vec<u32>>) -> pb::SessionRequest {
    let parents = (0..tokens.len() as i32).map(|i| i - 1).collect();
    pb::SessionRequest {
        msg: Some(pb::session_request::Msg::Tree(pb::VerifyTree {
            step,
            parents,
            tokens,
            draft_dists: vec![],
            assumes: assumes.map(|accepted_nodes| pb::TreeAssumption { accepted_nodes }),
        })),
    }
}

async fn verdict(s: &mut tonic::Streaming<pb::SessionResponse>) -> pb::Verdict {
    match s.message().await.unwrap().unwrap().msg {
        Some(pb::session_response::Msg::Verdict(v)) => v,
        other => panic!("expected a verdict, got {other:?}"),
    }
}

#[test]
fn the_verify_node_takes_the_tree_whose_assumption_held_and_drops_the_rest() {
    let pair = TinyPair::new();
    let verify = start_verify(verify_config(&pair.target));
    let tok = TextTokenizer::load_for_model(&pair.target).unwrap();
    let prompt = tok.encode("hello world", true).unwrap();
    let root = *prompt.last().unwrap();
    // The target's greedy continuation: a chain of its own tokens is accepted whole.
    let want = plain_greedy(&pair.target, "hello world", 8);
    let vocab = sequoia_engine::tokenizer::testing::TINY_VOCAB_SIZE as u32;
    let other = (want[1] + 1) % vocab;
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(within(120, async {
        let (tx, mut s) = open_session(&verify.url(), &prompt, limits::PROTOCOL_VERSION).await;
        // Step 0 commits want[0] and draws want[1]. Sent before its verdict: a tree for another
        // next token (dropped), the right one (taken), the right one again (its step is done by
        // then: dropped), and one assuming another path (dropped).
        tx.send(chain(0, vec![root, want[0]], None)).await.unwrap();
        tx.send(chain(1, vec![other, want[2]], Some(vec![1])))
            .await
            .unwrap();
        tx.send(chain(1, vec![want[1], want[2]], Some(vec![1])))
            .await
            .unwrap();
        tx.send(chain(1, vec![want[1], want[2]], Some(vec![1])))
            .await
            .unwrap();
        tx.send(chain(2, vec![want[3], want[4]], Some(vec![])))
            .await
            .unwrap();
        // Then an ordinary tree for step 2.
        tx.send(chain(2, vec![want[3], want[4]], None))
            .await
            .unwrap();
        let v0 = verdict(&mut s).await;
        assert_eq!(
            (v0.step, v0.accepted_nodes, v0.next_token),
            (0, vec![1], want[1])
        );
        let v1 = verdict(&mut s).await;
        assert_eq!(
            (v1.step, v1.accepted_nodes, v1.next_token),
            (1, vec![1], want[3])
        );
        let v2 = verdict(&mut s).await;
        assert_eq!(
            (v2.step, v2.accepted_nodes, v2.next_token),
            (2, vec![1], want[5])
        );
        // Nothing else was answered: the next answer is to the next tree.
        tx.send(chain(3, vec![want[5]], None)).await.unwrap();
        assert_eq!(verdict(&mut s).await.step, 3);

        // A tree sent ahead for a step beyond the next is a protocol error.
        let (tx, mut s) = open_session(&verify.url(), &prompt, limits::PROTOCOL_VERSION).await;
        tx.send(chain(1, vec![want[0]], Some(vec![])))
            .await
            .unwrap();
        let err = s.message().await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
        assert!(err.message().contains("tree.step"), "{err:?}");

        // A session at an older protocol version may not send trees ahead.
        let (tx, mut s) =
            open_session(&verify.url(), &prompt, limits::AHEAD_PROTOCOL_VERSION - 1).await;
        tx.send(chain(0, vec![root, want[0]], None)).await.unwrap();
        tx.send(chain(1, vec![want[1], want[2]], Some(vec![1])))
            .await
            .unwrap();
        assert_eq!(verdict(&mut s).await.step, 0);
        let err = s.message().await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
        assert!(err.message().contains("tree.assumes"), "{err:?}");
    }));
}

fn piped(prompt: &str, max_tokens: u32, temperature: f32, seed: u64) -> GenerateRequest {
    GenerateRequest {
        pipeline: Some(true),
        ..request(prompt, max_tokens, temperature, seed)
    }
}

#[test]
fn trees_sent_ahead_change_no_output() {
    let pair = TinyPair::new();
    let verify = start_verify(verify_config(&pair.target));
    let rt = tokio::runtime::Runtime::new().unwrap();
    // 40 ms of round trip: the tiny draft grows the next trees long before a verdict is back.
    let far = far_away(&rt, &verify.url(), 40);
    let draft_with = |send_ahead: bool| {
        let mut config = draft_config(&pair.draft, std::slice::from_ref(&far), 8, 4);
        config.pipeline.send_ahead = send_ahead;
        start_draft(config)
    };
    let (ahead, plain) = (draft_with(true), draft_with(false));
    let run = |draft: &Running, req: GenerateRequest| {
        rt.block_on(within(120, generate(&draft.url(), req)))
            .expect("generation succeeds")
    };
    let (mut sent, mut taken) = (0, 0);
    for prompt in PROMPTS {
        let got = run(&ahead, piped(prompt, 32, 0.0, 1));
        assert_eq!(
            got.tokens,
            plain_greedy(&pair.target, prompt, 32),
            "{prompt:?}"
        );
        let s = got.summary.expect("summary");
        assert!(s.trees_taken_ahead <= s.trees_sent_ahead, "{s:?}");
        assert!(s.trees_taken_ahead <= s.pipeline_hits, "{s:?}");
        sent += s.trees_sent_ahead;
        taken += s.trees_taken_ahead;
    }
    for t in [0.7, 1.0] {
        for seed in 0..3 {
            let prompt = PROMPTS[seed as usize % PROMPTS.len()];
            let on = run(&ahead, piped(prompt, 24, t, seed));
            let off = run(&plain, piped(prompt, 24, t, seed));
            assert_eq!(on.tokens, off.tokens, "T {t}, seed {seed}");
            let s = on.summary.expect("summary");
            assert_eq!(off.summary.expect("summary").trees_sent_ahead, 0);
            sent += s.trees_sent_ahead;
            taken += s.trees_taken_ahead;
        }
    }
    assert!(taken > 0, "no tree sent ahead was ever taken ({sent} sent)");
}
