//! Pipelined drafting (docs/ALGORITHMS.md §10) on a batch-invariant random quantized model:
//! whatever was grown ahead, and whether the verdict hit or missed, the next trees must be
//! exactly (bit for bit, tokens and q) the trees a drafter without pipelining grows from the same
//! committed tokens, at T = 0 and at T > 0 with the same seed.

mod common;

use common::tokens;
use sequoia_core::sampling::SamplingParams;
use sequoia_core::tree::Tree;
use sequoia_engine::drafting::{DraftSession, DraftedTree, SpeculationOutcome};
use sequoia_engine::random::{RandomQuant, RandomSpec};
use sequoia_engine::{EngineError, Kernels, LoadOptions, Model};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

fn model() -> Model {
    let spec = RandomSpec {
        seed: 7,
        quant: RandomQuant::Q4KM,
        ..RandomSpec::named("tiny").unwrap()
    };
    let m = Model::random(&spec, &LoadOptions::default(), Kernels::Native).unwrap();
    assert!(
        m.info().batch_invariant,
        "the test needs bit-identical rows"
    );
    m
}

fn params(t: f32) -> SamplingParams {
    SamplingParams {
        temperature: t,
        ..SamplingParams::default()
    }
}

fn same_tree(a: &DraftedTree, b: &DraftedTree, what: &str) {
    assert_eq!(a.tree, b.tree, "{what}: shape");
    assert_eq!(a.tokens, b.tokens, "{what}: tokens");
    assert_eq!(a.dists, b.dists, "{what}: q");
}

/// The accepted path (indices of `t`) from the root to `end`.
fn path_to(t: &Tree, end: usize) -> Vec<usize> {
    t.path_to(end).into_iter().filter(|&v| v != 0).collect()
}

/// Draft tree k with and without pipelining, apply the verdict (path to `end`, then `bonus`
/// or the speculation's own guess for `end`), and check the next two trees are identical.
/// Returns whether the pipelined drafter hit.
fn run_case(
    model: &Model,
    temperature: f32,
    shape: &Tree,
    ends: usize,
    max_forwards: usize,
    verdict: impl Fn(&DraftedTree, &[(usize, Option<u32>)]) -> (usize, u32),
) -> SpeculationOutcome {
    let vocab = model.info().vocab_size;
    let prefix = tokens(20, 3, vocab);
    let root = tokens(1, 4, vocab)[0];
    let p = params(temperature);
    let mut plain = DraftSession::new(model, &prefix, p, 99, 64).unwrap();
    let mut piped = DraftSession::new(model, &prefix, p, 99, 64).unwrap();
    let a = plain.grow(model, root, shape).unwrap();
    let b = piped.grow(model, root, shape).unwrap();
    same_tree(&a, &b, "tree k");
    let candidates = b.likeliest_ends(&[0.6, 0.2, 0.1], ends);
    let stop = AtomicBool::new(false);
    let mut handed = Vec::new();
    let spec = piped
        .speculate(
            model,
            &b,
            shape,
            &candidates,
            max_forwards,
            &stop,
            Some(&mut |end, t| handed.push((end, t))),
        )
        .unwrap();
    // Trees are handed out complete, once each, for candidates only; with forwards to spare,
    // for every candidate.
    let cands = spec.candidates();
    for (end, t) in &handed {
        assert!(cands
            .iter()
            .any(|(e, g)| e == end && *g == Some(t.tokens[0])));
        assert!(t.was_drafted_ahead());
    }
    assert!(handed.len() <= cands.len());
    if max_forwards >= 100 {
        assert_eq!(
            handed.len(),
            cands.len(),
            "every candidate's tree completes"
        );
    }
    let (end, bonus) = verdict(&b, &cands);
    let accepted = path_to(&b.tree, end);
    plain.commit(&a, &accepted).unwrap();
    let outcome = piped.commit_speculated(&b, &accepted, bonus, spec).unwrap();
    assert_eq!(plain.context_len(), piped.context_len());
    let a1 = plain.grow(model, bonus, shape).unwrap();
    let b1 = piped.grow(model, bonus, shape).unwrap();
    same_tree(&a1, &b1, "tree k+1");
    assert_eq!(b1.was_drafted_ahead(), outcome == SpeculationOutcome::Hit);
    // A tree handed out for the verdict that came is the one sent ahead: it must be the tree
    // the drafter grows after the verdict.
    if let Some((_, sent)) = handed
        .iter()
        .find(|(e, t)| *e == end && t.tokens[0] == bonus)
    {
        assert_eq!(outcome, SpeculationOutcome::Hit);
        same_tree(&a1, sent, "tree k+1 sent ahead");
    }
    // The caches must agree too: follow tree k+1's deepest first-child path and grow again.
    let mut end1 = 0;
    while let Some(&c) = a1.tree.children(end1).first() {
        end1 = c as usize;
    }
    let acc1 = path_to(&a1.tree, end1);
    plain.commit(&a1, &acc1).unwrap();
    piped.commit(&b1, &acc1).unwrap();
    let next = tokens(1, 5, vocab)[0];
    let a2 = plain.grow(model, next, shape).unwrap();
    let b2 = piped.grow(model, next, shape).unwrap();
    same_tree(&a2, &b2, "tree k+2");
    outcome
}

fn guessed(cands: &[(usize, Option<u32>)], i: usize) -> (usize, u32) {
    let (end, tok) = cands[i];
    (end, tok.expect("the copy was forwarded, so a guess exists"))
}

#[test]
fn pipelined_hits_grow_the_same_next_tree() {
    let model = model();
    let shapes = [Tree::spine(3, 4), Tree::k_by_d(2, 3), Tree::chain(4)];
    for t in [0.0, 0.7] {
        for shape in &shapes {
            for max_forwards in [1, 2, 3, 100] {
                for which in 0..2 {
                    let outcome = run_case(&model, t, shape, 2, max_forwards, |_, c| {
                        guessed(c, which.min(c.len() - 1))
                    });
                    assert_eq!(
                        outcome,
                        SpeculationOutcome::Hit,
                        "T {t}, shape {shape:?}, {max_forwards} forwards, candidate {which}"
                    );
                }
            }
        }
    }
}

#[test]
fn pipelined_misses_continue_exactly() {
    let model = model();
    let vocab = model.info().vocab_size as u32;
    let shape = Tree::spine(3, 4);
    for t in [0.0, 0.7] {
        // The right end with another token; an end nobody grew; a root-only verdict.
        let outcome = run_case(&model, t, &shape, 2, 100, |_, c| {
            let (end, tok) = guessed(c, 0);
            (end, (tok + 1) % vocab)
        });
        assert_eq!(outcome, SpeculationOutcome::Miss);
        let outcome = run_case(&model, t, &shape, 1, 100, |d, c| {
            let grown: Vec<usize> = c.iter().map(|x| x.0).collect();
            let other = (0..d.tree.len())
                .rev()
                .find(|v| !grown.contains(v))
                .unwrap();
            (other, 5)
        });
        assert_eq!(outcome, SpeculationOutcome::Miss);
        // Stopped before anything was forwarded.
        let outcome = run_case(&model, t, &shape, 2, 0, |_, _| (0, 9));
        assert_eq!(outcome, SpeculationOutcome::Miss);
    }
}

/// The decode fallback: tokens committed without a tree (`commit_decoded`, the old root and the
/// decoded tokens but the newest) leave the drafter exactly where a drafter that prefilled the
/// same committed tokens is: the next tree is identical (tokens and q), also when a tree grown
/// ahead was waiting and had to be dropped, and also when the tokens came in messages and the
/// drafter caught up after each one (`keep_up`: the draft node keeping up during a decode).
#[test]
fn decoded_tokens_leave_the_drafter_where_a_prefill_would() {
    let model = model();
    let vocab = model.info().vocab_size;
    let shape = Tree::spine(3, 4);
    for t in [0.0, 0.7] {
        for (ahead, keep_up) in [(false, false), (true, false), (false, true), (true, true)] {
            let prefix = tokens(20, 3, vocab);
            let root = tokens(1, 4, vocab)[0];
            let mut d = DraftSession::new(&model, &prefix, params(t), 99, 64).unwrap();
            let a = d.grow(&model, root, &shape).unwrap();
            // A verdict (with a tree grown ahead for it: a hit, so one is waiting), then the
            // verify node decodes three tokens.
            let (accepted, next) = if ahead {
                let ends = a.likeliest_ends(&[0.6, 0.2, 0.1], 2);
                let stop = AtomicBool::new(false);
                let spec = d
                    .speculate(&model, &a, &shape, &ends, 100, &stop, None)
                    .unwrap();
                let (end, next) = guessed(&spec.candidates(), 0);
                let accepted = path_to(&a.tree, end);
                let outcome = d.commit_speculated(&a, &accepted, next, spec).unwrap();
                assert_eq!(outcome, SpeculationOutcome::Hit);
                (accepted, next)
            } else {
                let accepted = vec![a.tree.children(0)[0] as usize];
                d.commit(&a, &accepted).unwrap();
                (accepted, tokens(1, 6, vocab)[0])
            };
            let mut committed = prefix.clone();
            committed.push(root);
            committed.extend(accepted.iter().map(|&v| a.tokens[v]));
            let decoded = tokens(3, 7, vocab);
            let mut follow = vec![next];
            follow.extend_from_slice(&decoded[..2]);
            if keep_up {
                // One message per token: the old root, then each decoded token but the newest.
                for piece in follow.chunks(1) {
                    d.commit_decoded(piece);
                    assert_eq!(d.pending_len(), 1);
                    assert_eq!(d.catch_up(&model).unwrap(), 1);
                    assert_eq!(d.pending_len(), 0);
                }
            } else {
                d.commit_decoded(&follow);
                assert_eq!(d.pending_len(), follow.len());
            }
            committed.extend_from_slice(&follow);
            assert_eq!(d.context_len(), committed.len());
            let mut fresh = DraftSession::new(&model, &committed, params(t), 99, 64).unwrap();
            let want = fresh.grow(&model, decoded[2], &shape).unwrap();
            let got = d.grow(&model, decoded[2], &shape).unwrap();
            same_tree(
                &got,
                &want,
                &format!("T {t}, ahead {ahead}, keep up {keep_up}"),
            );
            assert!(!got.was_drafted_ahead());
        }
    }
}

/// A first tree grown ahead while the verify node prefills (`grow_ahead`), whole or stopped
/// after its first level, is finished by `grow` into exactly the tree a drafter that grows it
/// only when asked draws (tokens and q, T = 0 and T > 0, same seed); the next tree after its
/// verdict is identical too. A stop set before the first forward holds nothing, and a tree
/// grown for another shape is dropped, leaving the drafter as if it had never grown it.
#[test]
fn a_first_tree_grown_during_the_prefill_is_the_tree_grow_would_draw() {
    let model = model();
    let vocab = model.info().vocab_size;
    let shape = Tree::spine(3, 4);
    let prefix = tokens(20, 3, vocab);
    let root = tokens(1, 4, vocab)[0];
    let go = AtomicBool::new(false);
    for t in [0.0, 0.7] {
        // Levels forwarded ahead: all of them (4), or the first only.
        for max_forwards in [usize::MAX, 1] {
            let what = format!("T {t}, at most {max_forwards} levels ahead");
            let mut plain = DraftSession::new(&model, &prefix, params(t), 99, 64).unwrap();
            let mut early = DraftSession::new(&model, &prefix, params(t), 99, 64).unwrap();
            let levels = early
                .grow_ahead(&model, root, &shape, max_forwards, &go)
                .unwrap();
            assert_eq!(levels, max_forwards.min(4), "{what}");
            assert_eq!(early.context_len(), plain.context_len(), "{what}");
            assert!(early.holds_ahead(root, &shape), "{what}");
            let a = plain.grow(&model, root, &shape).unwrap();
            let b = early.grow(&model, root, &shape).unwrap();
            same_tree(&a, &b, &format!("{what}: first tree"));
            assert!(b.was_drafted_ahead() && !a.was_drafted_ahead());
            let accepted = vec![a.tree.children(0)[0] as usize];
            plain.commit(&a, &accepted).unwrap();
            early.commit(&b, &accepted).unwrap();
            let next = tokens(1, 6, vocab)[0];
            let a1 = plain.grow(&model, next, &shape).unwrap();
            let b1 = early.grow(&model, next, &shape).unwrap();
            same_tree(&a1, &b1, &format!("{what}: next tree"));
        }
        // Stopped before the first forward: nothing is held.
        let mut early = DraftSession::new(&model, &prefix, params(t), 99, 64).unwrap();
        let stopped = AtomicBool::new(true);
        let levels = early
            .grow_ahead(&model, root, &shape, usize::MAX, &stopped)
            .unwrap();
        assert_eq!(levels, 0);
        assert!(!early.holds_ahead(root, &shape));
        // Grown for a shape the plan did not ask for: dropped by `grow`.
        let mut plain = DraftSession::new(&model, &prefix, params(t), 99, 64).unwrap();
        let mut early = DraftSession::new(&model, &prefix, params(t), 99, 64).unwrap();
        early
            .grow_ahead(&model, root, &Tree::spine(2, 3), usize::MAX, &go)
            .unwrap();
        assert!(!early.holds_ahead(root, &shape));
        let a = plain.grow(&model, root, &shape).unwrap();
        let b = early.grow(&model, root, &shape).unwrap();
        same_tree(&a, &b, &format!("T {t}: another shape"));
        assert!(!b.was_drafted_ahead());
    }
}

/// A forward given a stop flag that is already set gives up before its first layer and leaves
/// the cache as it was: the same forward afterwards gives the logits a fresh cache gives.
#[test]
fn a_stopped_forward_changes_no_cache() {
    let model = model();
    let vocab = model.info().vocab_size;
    let prefix = tokens(20, 3, vocab);
    let nodes = tokens(3, 5, vocab);
    let parents = [-1, 0, 0];
    let mut cache = model.new_cache();
    model.forward_chain(&mut cache, &prefix).unwrap();
    let stop = AtomicBool::new(true);
    let err = model
        .forward_forest_extend_until(
            &mut cache,
            &nodes,
            &parents,
            0,
            &[0, 1, 2],
            vocab,
            Some(sequoia_engine::Stop::at_any_layer(&stop)),
        )
        .unwrap_err();
    assert!(matches!(err, EngineError::Stopped), "{err}");
    assert_eq!(cache.len(), prefix.len());
    let after = model
        .forward_forest_extend(&mut cache, &nodes, &parents, 0, &[0, 1, 2], vocab)
        .unwrap();
    let mut fresh = model.new_cache();
    model.forward_chain(&mut fresh, &prefix).unwrap();
    let want = model
        .forward_forest_extend(&mut fresh, &nodes, &parents, 0, &[0, 1, 2], vocab)
        .unwrap();
    for r in 0..3 {
        assert_eq!(after.row(r), want.row(r), "row {r}");
    }
}

/// A stop flag honoured only before a given layer: set from the start, it stops a forward whose
/// `before_layer` is 1 (before layer 0) and lets one whose `before_layer` is 0 run to its end,
/// with the logits and cache of a forward given no flag at all.
#[test]
fn a_stop_past_its_last_layer_lets_the_forward_finish() {
    let model = model();
    let vocab = model.info().vocab_size;
    let prefix = tokens(20, 3, vocab);
    let nodes = tokens(3, 5, vocab);
    let parents = [-1, 0, 0];
    let set = AtomicBool::new(true);
    let layer = AtomicUsize::new(0);
    let run = |before_layer: Option<usize>| {
        let mut cache = model.new_cache();
        model.forward_chain(&mut cache, &prefix).unwrap();
        let stop = before_layer.map(|before_layer| {
            layer.store(before_layer, Ordering::Relaxed);
            sequoia_engine::Stop {
                flag: &set,
                before_layer: &layer,
            }
        });
        let r = model.forward_forest_extend_until(
            &mut cache,
            &nodes,
            &parents,
            0,
            &[0, 1, 2],
            vocab,
            stop,
        );
        (r, cache.len())
    };
    let (stopped, len) = run(Some(1));
    assert!(matches!(stopped, Err(EngineError::Stopped)));
    assert_eq!(len, prefix.len());
    let (finished, len) = run(Some(0));
    let (plain, plain_len) = run(None);
    let (finished, plain) = (finished.unwrap(), plain.unwrap());
    assert_eq!((len, plain_len), (prefix.len() + 3, prefix.len() + 3));
    for r in 0..3 {
        assert_eq!(finished.row(r), plain.row(r), "row {r}");
    }
}

/// The verdict's arrival stops growth ahead at any moment, also inside a forward (the level in
/// progress is dropped): whatever the moment, hit or miss, the next trees are exactly those of
/// a drafter that never grew ahead. The moments are spread over the growth's duration.
#[test]
fn growth_ahead_stopped_at_any_moment_continues_exactly() {
    let model = model();
    let vocab = model.info().vocab_size;
    let shape = Tree::spine(3, 4);
    let prefix = tokens(20, 3, vocab);
    let root = tokens(1, 4, vocab)[0];
    // How long an unstopped growth ahead takes here, to spread the stops over.
    let full = {
        let mut d = DraftSession::new(&model, &prefix, params(0.0), 99, 64).unwrap();
        let a = d.grow(&model, root, &shape).unwrap();
        let ends = a.likeliest_ends(&[0.6, 0.2, 0.1], 2);
        let t0 = std::time::Instant::now();
        d.speculate(
            &model,
            &a,
            &shape,
            &ends,
            100,
            &AtomicBool::new(false),
            None,
        )
        .unwrap();
        t0.elapsed()
    };
    let mut hits = 0;
    for t in [0.0, 0.7] {
        for i in 0..24u32 {
            let p = params(t);
            let mut plain = DraftSession::new(&model, &prefix, p, 99, 64).unwrap();
            let mut piped = DraftSession::new(&model, &prefix, p, 99, 64).unwrap();
            let a = plain.grow(&model, root, &shape).unwrap();
            let b = piped.grow(&model, root, &shape).unwrap();
            let ends = b.likeliest_ends(&[0.6, 0.2, 0.1], 2);
            let stop = AtomicBool::new(false);
            let spec = std::thread::scope(|s| {
                let grower =
                    s.spawn(|| piped.speculate(&model, &b, &shape, &ends, 100, &stop, None));
                std::thread::sleep(full * i / 20);
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
                grower.join().unwrap().unwrap()
            });
            // The verdict the first candidate guessed if it got that far, else another one.
            let (end, next) = match spec.candidates().first() {
                Some(&(end, Some(tok))) => (end, tok),
                _ => (b.tree.children(0)[0] as usize, tokens(1, 6, vocab)[0]),
            };
            let accepted = path_to(&b.tree, end);
            plain.commit(&a, &accepted).unwrap();
            let outcome = piped.commit_speculated(&b, &accepted, next, spec).unwrap();
            hits += usize::from(outcome == SpeculationOutcome::Hit);
            let a1 = plain.grow(&model, next, &shape).unwrap();
            let b1 = piped.grow(&model, next, &shape).unwrap();
            same_tree(&a1, &b1, &format!("T {t}, stop {i}/20 of the growth"));
        }
    }
    assert!(hits > 0, "no stop let a candidate's guess through");
}

/// `Tree::follow_chain` counts the leading tokens of a guess that follow drafted nodes from the
/// root, which is exactly the part `graft_lookup` merges: grafting adds a node for every later
/// token.
#[test]
fn the_followed_prefix_of_a_guess_is_what_grafting_merges() {
    let model = model();
    let vocab = model.info().vocab_size;
    let shape = Tree::spine(3, 4);
    let prefix = tokens(20, 3, vocab);
    let root = tokens(1, 4, vocab)[0];
    let mut d = DraftSession::new(&model, &prefix, params(0.0), 99, 64).unwrap();
    let a = d.grow(&model, root, &shape).unwrap();
    // The tokens along the first-child path, then two tokens no node has.
    let mut path = Vec::new();
    let mut at = 0usize;
    while let Some(&c) = a.tree.children(at).first() {
        at = c as usize;
        path.push(a.tokens[at]);
    }
    let fresh: Vec<u32> = (0..vocab as u32)
        .filter(|t| !a.tokens.contains(t))
        .take(2)
        .collect();
    for keep in 0..=path.len() {
        let mut guess = path[..keep].to_vec();
        guess.extend_from_slice(&fresh);
        assert_eq!(a.tree.follow_chain(&a.tokens, &guess).1, keep);
        let mut grafted = a.clone();
        assert_eq!(grafted.graft_lookup(&guess), fresh.len());
    }
    assert_eq!(a.tree.follow_chain(&a.tokens, &[]), (0, 0));
}
