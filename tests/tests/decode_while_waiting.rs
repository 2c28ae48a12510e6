//! The verify node decodes while it waits (docs/ALGORITHMS.md §10): a greedy session that
//! decoded the target's next token before its tree came gives every verdict a session without
//! it gives, and ends each step with the same cache: for a tree holding the token below its
//! root (only the subtree is forwarded), one without it (no forward), a `decode`, and a tree
//! whose root the token did not follow (the token is taken back); and a forward that a message
//! interrupts leaves the session as it was. The same holds for sampled sessions, seed for seed.

use sequoia_core::sampling::{SamplingParams, SparseDist};
use sequoia_engine::tokenizer::TextTokenizer;
use sequoia_engine::LoadOptions;
use sequoia_engine::{Model, Stop};
use sequoia_tests::*;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use verify_service::session::{Prepared, SessionLimits, StepResult, VerifySession};

fn limits() -> SessionLimits {
    SessionLimits {
        max_context: 512,
        max_tree_nodes: 64,
        max_tree_levels: 16,
        max_dist_entries: 64,
    }
}

/// The tiny target model and its tokenizer.
fn target() -> (TinyPair, Model, TextTokenizer) {
    let pair = TinyPair::new();
    let model = Model::load(&pair.target, &LoadOptions::default()).unwrap();
    let tok = TextTokenizer::load_for_model(&pair.target).unwrap();
    (pair, model, tok)
}

/// Verify one greedy tree; also says whether the model ran for it.
fn verify(
    s: &mut VerifySession,
    model: &Model,
    step: u64,
    parents: &[i32],
    tokens: &[u32],
) -> (StepResult, bool) {
    verify_sampled(s, model, step, parents, tokens, Vec::new())
}

/// Verify one tree with its draft distributions; also says whether the model ran for it.
fn verify_sampled(
    s: &mut VerifySession,
    model: &Model,
    step: u64,
    parents: &[i32],
    tokens: &[u32],
    dists: Vec<SparseDist>,
) -> (StepResult, bool) {
    match s.prepare_step(model, step, parents, tokens, dists).unwrap() {
        Prepared::Done(r) => (r, false),
        Prepared::Tree(p) => (s.run(model, p).unwrap(), true),
    }
}

fn same(a: &StepResult, b: &StepResult, what: &str) {
    assert_eq!(
        (&a.verdict.accepted, &a.verdict.ranks, a.verdict.next_token),
        (&b.verdict.accepted, &b.verdict.ranks, b.verdict.next_token),
        "{what}"
    );
}

#[test]
fn a_token_decoded_while_waiting_changes_no_verdict() {
    let (_pair, model, tok) = target();
    let vocab = model.info().vocab_size as u32;
    let ids = tok.encode("The quick brown fox", true).unwrap();
    let (g, _) = plain_greedy_ids(&model, &[], &ids, 8);
    assert_eq!(g.len(), 8);
    let other = |t: u32| (t + 1) % vocab;
    let (prefix, root) = (&ids[..ids.len() - 1], ids[ids.len() - 1]);
    let open = || {
        VerifySession::open(&model, prefix, SamplingParams::greedy(), 1, 64, limits())
            .unwrap()
            .0
    };
    let (mut waits, mut plain) = (open(), open());
    let go = AtomicBool::new(false);
    // Nothing to wait for before the first verdict.
    assert!(!waits
        .decode_while_waiting(&model, Stop::at_any_layer(&go))
        .unwrap());
    for s in [&mut waits, &mut plain] {
        let (r, _) = verify(s, &model, 0, &[-1], &[root]);
        assert_eq!(r.verdict.next_token, g[0]);
    }

    // A message that came while it decoded stops the forward: nothing decoded, nothing changed.
    let before = waits.context_len();
    assert!(!waits
        .decode_while_waiting(&model, Stop::at_any_layer(&AtomicBool::new(true)))
        .unwrap());
    assert!(!waits.has_root_ahead());
    assert_eq!(waits.context_len(), before);

    // A message that says to finish (a decode, or a tree that comes past the layer where
    // finishing costs less than its own forward) lets the forward finish despite the flag.
    // The target's token is the root's second child; both children have a child.
    let finish = Stop {
        flag: &AtomicBool::new(true),
        before_layer: &AtomicUsize::new(0),
    };
    assert!(waits.decode_while_waiting(&model, finish).unwrap());
    assert!(waits.has_root_ahead());
    let (parents, tokens) = ([-1, 0, 0, 1, 2], [g[0], other(g[1]), g[1], g[2], g[2]]);
    let (a, ran) = verify(&mut waits, &model, 1, &parents, &tokens);
    let (b, _) = verify(&mut plain, &model, 1, &parents, &tokens);
    same(&a, &b, "tree holding the waiting token");
    assert!(ran, "the subtree below the waiting token is forwarded");
    assert_eq!(a.batch_rows, 2, "only the subtree (2 nodes) is forwarded");
    assert_eq!(a.verdict.accepted, vec![2, 4]);
    assert_eq!(a.verdict.ranks, vec![2, 1]);
    assert_eq!(a.verdict.next_token, g[3]);

    // No child holds the target's token: the verdict comes without a forward.
    assert!(waits
        .decode_while_waiting(&model, Stop::at_any_layer(&go))
        .unwrap());
    let (parents, tokens) = ([-1, 0, 0], [g[3], other(g[4]), other(other(g[4]))]);
    let (a, ran) = verify(&mut waits, &model, 2, &parents, &tokens);
    let (b, _) = verify(&mut plain, &model, 2, &parents, &tokens);
    same(&a, &b, "tree without the waiting token");
    assert!(!ran, "no forward for a tree without the waiting token");
    assert_eq!(a.verdict.next_token, g[4]);

    // A decode (a root-only tree) takes the waiting token as its first, with no forward.
    assert!(waits
        .decode_while_waiting(&model, Stop::at_any_layer(&go))
        .unwrap());
    let (a, ran) = verify(&mut waits, &model, 3, &[-1], &[g[4]]);
    let (b, _) = verify(&mut plain, &model, 3, &[-1], &[g[4]]);
    same(&a, &b, "decode");
    assert!(
        !ran,
        "no forward for a decode that the waiting token answers"
    );
    assert_eq!(a.verdict.next_token, g[5]);

    // A tree with another root than the token followed: it is taken back, the tree verified
    // whole.
    assert!(waits
        .decode_while_waiting(&model, Stop::at_any_layer(&go))
        .unwrap());
    let (parents, tokens) = ([-1, 0], [other(g[5]), g[6]]);
    let (a, ran) = verify(&mut waits, &model, 4, &parents, &tokens);
    let (b, _) = verify(&mut plain, &model, 4, &parents, &tokens);
    same(&a, &b, "tree with another root");
    assert!(ran && !waits.has_root_ahead());

    // Both caches hold the same tokens: the next step agrees too.
    assert_eq!(waits.context_len(), plain.context_len());
    let next = a.verdict.next_token;
    let (a, _) = verify(&mut waits, &model, 5, &[-1], &[next]);
    let (b, _) = verify(&mut plain, &model, 5, &[-1], &[next]);
    same(&a, &b, "the step after");
}

/// A sampled session decides at the root from the row forwarded while it waited, drawing what
/// the whole tree's verification draws there: over 300 seeds its verdicts equal those of a
/// session with the same seed that did not wait, step after step (a tree with two children at
/// the root and a child below each, then a `decode`), so seeded outputs never depend on when
/// the node decoded. Every kind of verdict occurs: a root child and its child accepted, a root
/// child alone, none (no forward).
#[test]
fn a_sampled_session_that_decoded_while_waiting_gives_the_verdicts_of_one_that_did_not() {
    let (pair, model, tok) = target();
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
    };
    let prompt = "The quick brown fox";
    // Children the target often picks: its two likeliest second tokens and likeliest third.
    let (_, p2) = target_first_two(&pair.target, prompt, &params);
    let p3 = target_third(&pair.target, prompt, &params);
    let top = |p: &[f64], k: usize| {
        let mut order: Vec<u32> = (0..p.len() as u32).collect();
        order.sort_by(|&a, &b| p[b as usize].total_cmp(&p[a as usize]));
        order.truncate(k);
        order
    };
    let (children, below) = (top(&p2, 2), top(&p3, 1)[0]);
    let ids = tok.encode(prompt, true).unwrap();
    let (prefix, root) = (&ids[..ids.len() - 1], ids[ids.len() - 1]);
    let go = AtomicBool::new(false);
    let q = |t: &[u32]| SparseDist {
        tokens: t.to_vec(),
        probs: vec![1.0 / t.len() as f32; t.len()],
    };
    let mut kinds = [0usize; 3]; // root children accepted below the first: 2, 1, 0 nodes
    for seed in 0..300u64 {
        let open = || {
            VerifySession::open(&model, prefix, params, seed, 64, limits())
                .unwrap()
                .0
        };
        let (mut waits, mut plain) = (open(), open());
        let mut next = root;
        for step in 0..6u64 {
            if step > 0 {
                assert!(waits
                    .decode_while_waiting(&model, Stop::at_any_layer(&go))
                    .unwrap());
            }
            // Alternate trees and decodes (root-only trees).
            let (parents, tokens, dists) = if step % 3 == 2 {
                (vec![-1], vec![next], Vec::new())
            } else {
                (
                    vec![-1, 0, 0, 1, 2],
                    vec![next, children[0], children[1], below, below],
                    vec![q(&children), q(&[below]), q(&[below])],
                )
            };
            let run = |s: &mut VerifySession| {
                verify_sampled(s, &model, step, &parents, &tokens, dists.clone()).0
            };
            let (a, b) = (run(&mut waits), run(&mut plain));
            same(&a, &b, &format!("seed {seed}, step {step}"));
            if step > 0 && parents.len() > 1 {
                kinds[2 - a.verdict.accepted.len().min(2)] += 1;
            }
            next = a.verdict.next_token;
        }
        assert_eq!(waits.context_len(), plain.context_len(), "seed {seed}");
    }
    assert!(
        kinds.iter().all(|&k| k > 0),
        "every kind of verdict must occur (2, 1, 0 accepted: {kinds:?})"
    );
}

/// A verify node says in `Info` whether it decodes while waiting, as configured: the draft's
/// planner prices the trees it drafts after a verdict by it (docs/ALGORITHMS.md §10).
#[test]
fn the_node_says_whether_it_decodes_while_waiting() {
    use sequoia_proto::v1::verifier_client::VerifierClient;
    use sequoia_proto::v1::InfoRequest;
    let pair = TinyPair::new();
    let rt = tokio::runtime::Runtime::new().unwrap();
    for on in [true, false] {
        let mut config = verify_config(&pair.target);
        config.decode_while_waiting = on;
        let node = start_verify(config);
        let said = rt.block_on(async {
            let mut c = VerifierClient::connect(node.url()).await.unwrap();
            c.info(InfoRequest {}).await.unwrap().into_inner()
        });
        assert_eq!(said.decodes_while_waiting, on);
    }
}
