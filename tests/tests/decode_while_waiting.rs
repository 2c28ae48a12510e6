//! The verify node decodes while it waits (docs/ALGORITHMS.md §10): a greedy session that
//! decoded the target's next token before its tree came gives every verdict a session without
//! it gives, and ends each step with the same cache: for a tree holding the token below its
//! root (only the subtree is forwarded), one without it (no forward), a `decode`, and a tree
//! whose root the token did not follow (the token is taken back); and a forward that a message
//! interrupts leaves the session as it was. A sampled session that decoded while waiting
//! commits tokens distributed as the target's.

use sequoia_core::sampling::{SamplingParams, SparseDist};
use sequoia_engine::tokenizer::TextTokenizer;
use sequoia_engine::LoadOptions;
use sequoia_engine::Model;
use sequoia_tests::*;
use std::sync::atomic::AtomicBool;
use verify_service::session::{Prepared, SessionLimits, StepResult, VerifySession};

fn limits() -> SessionLimits {
    SessionLimits {
        max_context: 512,
        max_tree_nodes: 64,
        max_tree_levels: 16,
        max_dist_entries: 64,
    }
}

/// Verify one tree; also says whether the model ran for it.
fn verify(
    s: &mut VerifySession,
    model: &Model,
    step: u64,
    parents: &[i32],
    tokens: &[u32],
) -> (StepResult, bool) {
    match s
        .prepare_step(model, step, parents, tokens, Vec::new())
        .unwrap()
    {
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
    let pair = TinyPair::new();
    let model = Model::load(&pair.target, &LoadOptions::default()).unwrap();
    let tok = TextTokenizer::load_for_model(&pair.target).unwrap();
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
    assert!(!waits.decode_while_waiting(&model, &go).unwrap());
    for s in [&mut waits, &mut plain] {
        let (r, _) = verify(s, &model, 0, &[-1], &[root]);
        assert_eq!(r.verdict.next_token, g[0]);
    }

    // A message that came while it decoded stops the forward: nothing decoded, nothing changed.
    let before = waits.context_len();
    assert!(!waits
        .decode_while_waiting(&model, &AtomicBool::new(true))
        .unwrap());
    assert!(!waits.has_waiting_token());
    assert_eq!(waits.context_len(), before);

    // The target's token is the root's second child; both children have a child.
    assert!(waits.decode_while_waiting(&model, &go).unwrap());
    assert!(waits.has_waiting_token());
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
    assert!(waits.decode_while_waiting(&model, &go).unwrap());
    let (parents, tokens) = ([-1, 0, 0], [g[3], other(g[4]), other(other(g[4]))]);
    let (a, ran) = verify(&mut waits, &model, 2, &parents, &tokens);
    let (b, _) = verify(&mut plain, &model, 2, &parents, &tokens);
    same(&a, &b, "tree without the waiting token");
    assert!(!ran, "no forward for a tree without the waiting token");
    assert_eq!(a.verdict.next_token, g[4]);

    // A decode (a root-only tree) takes the waiting token as its first, with no forward.
    assert!(waits.decode_while_waiting(&model, &go).unwrap());
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
    assert!(waits.decode_while_waiting(&model, &go).unwrap());
    let (parents, tokens) = ([-1, 0], [other(g[5]), g[6]]);
    let (a, ran) = verify(&mut waits, &model, 4, &parents, &tokens);
    let (b, _) = verify(&mut plain, &model, 4, &parents, &tokens);
    same(&a, &b, "tree with another root");
    assert!(ran && !waits.has_waiting_token());

    // Both caches hold the same tokens: the next step agrees too.
    assert_eq!(waits.context_len(), plain.context_len());
    let next = a.verdict.next_token;
    let (a, _) = verify(&mut waits, &model, 5, &[-1], &[next]);
    let (b, _) = verify(&mut plain, &model, 5, &[-1], &[next]);
    same(&a, &b, "the step after");
}

/// A sampled session draws the token while it waits, then accepts the child holding it: the
/// tokens it commits must follow the target's distribution. Over 3000 seeds, each session
/// samples its first token (a root-only step), decodes while waiting, then gets a tree whose
/// root's children are the two likeliest second tokens, each with the likeliest third below;
/// the second and third committed tokens are tallied against the target's marginals (every
/// cell within 5σ; seeds are fixed, so the outcome is deterministic). All three kinds of
/// verdict must occur: a child and its child accepted, a child alone, no child (no forward).
#[test]
fn a_sampled_session_that_decoded_while_waiting_commits_the_target_distribution() {
    let pair = TinyPair::new();
    let model = Model::load(&pair.target, &LoadOptions::default()).unwrap();
    let tok = TextTokenizer::load_for_model(&pair.target).unwrap();
    let eos = tok.eos_ids().to_vec();
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
    };
    let prompt = "The quick brown fox";
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
    const N: usize = 3000;
    let (mut c2, mut c3) = (vec![0usize; p2.len()], vec![0usize; p3.len()]);
    let mut kinds = [0usize; 3]; // accepted 2, 1, 0 nodes
    for seed in 0..N as u64 {
        let (mut s, _) = VerifySession::open(&model, prefix, params, seed, 64, limits()).unwrap();
        let (first, _) = verify(&mut s, &model, 0, &[-1], &[root]);
        let b = first.verdict.next_token;
        if eos.contains(&b) {
            continue;
        }
        assert!(s.decode_while_waiting(&model, &go).unwrap());
        let parents = [-1, 0, 0, 1, 2];
        let tokens = [b, children[0], children[1], below, below];
        let q = |t: &[u32]| SparseDist {
            tokens: t.to_vec(),
            probs: vec![1.0 / t.len() as f32; t.len()],
        };
        let dists = vec![q(&children), q(&[below]), q(&[below])];
        let r = match s.prepare_step(&model, 1, &parents, &tokens, dists).unwrap() {
            Prepared::Done(r) => r,
            Prepared::Tree(p) => s.run(&model, p).unwrap(),
        };
        let mut committed: Vec<u32> = r.verdict.accepted.iter().map(|&v| tokens[v]).collect();
        committed.push(r.verdict.next_token);
        kinds[2 - r.verdict.accepted.len()] += 1;
        if committed.len() == 1 && !eos.contains(&committed[0]) {
            // Nothing accepted: the third token comes from the next step.
            let (next, _) = verify(&mut s, &model, 2, &[-1], &[committed[0]]);
            committed.push(next.verdict.next_token);
        }
        c2[committed[0] as usize] += 1;
        if !eos.contains(&committed[0]) {
            c3[committed[1] as usize] += 1;
        }
    }
    assert!(
        kinds.iter().all(|&k| k > 0),
        "every kind of verdict must occur (2, 1, 0 accepted: {kinds:?})"
    );
    let n2: usize = c2.iter().sum();
    let s2 = worst_sigma(&c2, &p2, n2);
    assert!(s2 <= 5.0, "second token deviates by {s2:.2}σ");
    let n3: usize = c3.iter().sum();
    let s3 = worst_sigma(&c3, &p3, n3);
    assert!(s3 <= 5.0, "third token deviates by {s3:.2}σ");
}
