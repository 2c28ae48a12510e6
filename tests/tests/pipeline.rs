//! Pipelined drafting (docs/ALGORITHMS.md §10) end to end on tiny models: greedy output equals
//! plain target decoding, seeded sampled output is the same with pipelining on and off, and
//! sampled output follows the target's distribution where the next tree was grown ahead.

use sequoia_core::sampling::SamplingParams;
use sequoia_proto::v1::GenerateRequest;
use sequoia_tests::*;

const PROMPTS: [&str; 3] = [
    "hello world",
    "The quick brown fox",
    "fn main() { println!(\"hi\"); }",
];

/// A verify node that forwards every tree as sent. Decoding while it waits (docs/ALGORITHMS.md
/// §10) answers tiny models' trees so soon after they come that the draft may have no time to
/// grow the next ones ahead (no hit in a whole run), and these tests are about trees grown
/// ahead.
fn node_verifying_every_tree(pair: &TinyPair) -> Running {
    let mut config = verify_config(&pair.target);
    config.decode_while_waiting = false;
    start_verify(config)
}

fn piped(prompt: &str, max_tokens: u32, temperature: f32, seed: u64, on: bool) -> GenerateRequest {
    GenerateRequest {
        pipeline: Some(on),
        ..request(prompt, max_tokens, temperature, seed)
    }
}

#[test]
fn pipelined_greedy_output_equals_target_only_decoding() {
    let pair = TinyPair::new();
    let verify = node_verifying_every_tree(&pair);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (mut hits, mut misses) = (0, 0);
    for (nodes, levels) in [(4, 4), (8, 4), (16, 6)] {
        let mut config = draft_config(&pair.draft, &[verify.url()], nodes, levels);
        config.pipeline.candidates = 2;
        let draft = start_draft(config);
        for prompt in PROMPTS {
            let want = plain_greedy(&pair.target, prompt, 48);
            let got = rt
                .block_on(within(
                    120,
                    generate(&draft.url(), piped(prompt, 48, 0.0, 1, true)),
                ))
                .expect("generation succeeds");
            assert_eq!(got.tokens, want, "prompt {prompt:?}, tree of {nodes} nodes");
            let s = got.summary.expect("summary");
            assert!(
                s.pipeline_hits + s.pipeline_misses < s.steps,
                "every step but the first can follow a step that drafted ahead"
            );
            hits += s.pipeline_hits;
            misses += s.pipeline_misses;
        }
    }
    assert!(
        hits > 0,
        "no tree grown ahead was ever used ({misses} misses)"
    );
}

#[test]
fn seeded_sampling_is_the_same_with_pipelining_on_and_off() {
    let pair = TinyPair::new();
    let verify = node_verifying_every_tree(&pair);
    let draft = start_draft(draft_config(&pair.draft, &[verify.url()], 8, 4));
    // And through a node that decodes while it waits, which must not change a seeded output
    // either, whenever it happens to decode.
    let waiting = start_verify(verify_config(&pair.target));
    let draft_waiting = start_draft(draft_config(&pair.draft, &[waiting.url()], 8, 4));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut hits = 0;
    for t in [0.3, 0.7, 1.0] {
        for seed in 0..6 {
            let prompt = PROMPTS[seed as usize % PROMPTS.len()];
            let run = |url: &str, on| {
                rt.block_on(within(120, generate(url, piped(prompt, 40, t, seed, on))))
                    .expect("generation succeeds")
            };
            let (off, on) = (run(&draft.url(), false), run(&draft.url(), true));
            assert_eq!(off.tokens, on.tokens, "T {t}, seed {seed}");
            let waited = run(&draft_waiting.url(), true);
            assert_eq!(
                off.tokens, waited.tokens,
                "T {t}, seed {seed}, a node that decodes while waiting"
            );
            let s = on.summary.unwrap();
            assert_eq!(off.summary.unwrap().pipeline_hits, 0);
            hits += s.pipeline_hits;
        }
    }
    assert!(hits > 0, "no tree grown ahead was ever used");
}

/// The third token through one-token chains, with the target itself as the draft: the first
/// step commits two tokens (the drafted one and the bonus), and when the bonus is the token the
/// draft guessed, the third token comes from the tree grown ahead (a hit), else from one grown
/// afresh. Either way it must follow the target's distribution, at every temperature.
#[test]
fn pipelined_sampling_follows_the_target_distribution() {
    let pair = TinyPair::new();
    let verify = node_verifying_every_tree(&pair);
    let draft = start_draft(draft_config(&pair.target, &[verify.url()], 2, 2));
    let eos = sequoia_engine::tokenizer::TextTokenizer::load_for_model(&pair.target)
        .unwrap()
        .eos_ids()[0];
    let prompt = "The quick brown fox";
    let rt = tokio::runtime::Runtime::new().unwrap();
    const N: usize = 1200;
    for t in [0.3f32, 0.7, 1.0] {
        let params = SamplingParams {
            temperature: t,
            top_k: 0,
            top_p: 1.0,
        };
        let p3 = target_third(&pair.target, prompt, &params);
        let mut c3 = vec![0usize; p3.len()];
        let mut hits = 0;
        rt.block_on(async {
            let mut client =
                sequoia_proto::v1::generation_client::GenerationClient::connect(draft.url())
                    .await
                    .unwrap();
            for seed in 0..N as u64 {
                let mut stream = client
                    .generate(GenerateRequest {
                        tree_parents: vec![-1, 0],
                        ..piped(prompt, 3, t, seed, true)
                    })
                    .await
                    .unwrap()
                    .into_inner();
                let mut toks = Vec::new();
                let mut finish = String::new();
                while let Some(chunk) = stream.message().await.unwrap() {
                    toks.extend(chunk.token_ids);
                    if let Some(s) = chunk.summary {
                        hits += s.pipeline_hits;
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
        assert!(
            hits > 0,
            "T {t}: no third token came from a tree grown ahead"
        );
        let n3: usize = c3.iter().sum();
        let s3 = worst_sigma(&c3, &p3, n3);
        assert!(
            s3 <= 5.0,
            "T {t}: third token deviates by {s3:.2}σ ({hits} hits)"
        );
        eprintln!("T {t}: {n3} third tokens, {hits} from trees grown ahead, worst {s3:.2}σ");
    }
}

/// A verify node on this machine with overlapping CPUs (here: the same process) competes with
/// the draft for cores, so requests that leave `pipeline` unset do not draft ahead there unless
/// `pipeline.on_shared_cpus` says so; the output is the same either way.
#[test]
fn by_default_no_drafting_ahead_against_a_node_on_the_same_cpus() {
    let pair = TinyPair::new();
    let verify = start_verify(verify_config(&pair.target));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let run = |on_shared_cpus: bool| {
        let mut config = draft_config(&pair.draft, &[verify.url()], 8, 4);
        config.pipeline.on_shared_cpus = on_shared_cpus;
        let draft = start_draft(config);
        let got = rt
            .block_on(within(
                120,
                generate(&draft.url(), request(PROMPTS[2], 40, 0.0, 1)),
            ))
            .expect("generation succeeds");
        let s = got.summary.clone().expect("summary");
        (got.tokens, s.pipeline_hits + s.pipeline_misses)
    };
    let (shared_tokens, shared_ahead) = run(false);
    let (forced_tokens, forced_ahead) = run(true);
    assert_eq!(shared_tokens, forced_tokens);
    assert_eq!(
        shared_ahead, 0,
        "drafted ahead against a node on its own CPUs"
    );
    assert!(
        forced_ahead > 0,
        "pipeline.on_shared_cpus = true must draft ahead"
    );
}

/// While the verify node prefills, the draft grows the first tree the previous pipelined
/// generation drafted (docs/ALGORITHMS.md §10). Behind a verify node 300 ms of round trip away
/// (so its `opened` arrives late), every generation after the first has its first tree grown
/// that way, and the
/// output does not change: greedy output is the target's own, and a seeded sampled generation
/// repeats exactly whether its first tree was grown early or not.
#[test]
fn the_first_tree_grows_during_the_verify_prefill_without_changing_the_output() {
    let pair = TinyPair::new();
    let verify = start_verify(verify_config(&pair.target));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let slow = far_away(&rt, &verify.url(), 300);
    let draft = start_draft(draft_config(&pair.draft, &[slow], 8, 4));
    let run = |req: GenerateRequest| {
        rt.block_on(within(120, generate(&draft.url(), req)))
            .expect("generation succeeds")
    };
    for (i, prompt) in PROMPTS.iter().enumerate() {
        let got = run(piped(prompt, 12, 0.0, 1, true));
        assert_eq!(
            got.tokens,
            plain_greedy(&pair.target, prompt, 12),
            "{prompt:?}"
        );
        let early = got.summary.expect("summary").first_tree_early;
        assert_eq!(
            early,
            i > 0,
            "generation {i}: first tree grown early = {early}"
        );
    }
    for seed in [3, 4] {
        let first = run(piped(PROMPTS[1], 12, 0.8, seed, true));
        let again = run(piped(PROMPTS[1], 12, 0.8, seed, true));
        assert!(
            again.summary.expect("summary").first_tree_early,
            "seed {seed}"
        );
        assert_eq!(first.tokens, again.tokens, "seed {seed}");
    }
    // A generation that does not pipeline grows nothing early, and neither does the next.
    let off = run(piped(PROMPTS[0], 12, 0.0, 1, false));
    assert!(!off.summary.expect("summary").first_tree_early);
    let next = run(piped(PROMPTS[0], 12, 0.0, 1, true));
    assert!(!next.summary.expect("summary").first_tree_early);
}

/// When that first tree is whole before the verify node has answered the `open` (here the node
/// is 300 ms of round trip away), it goes right behind the `open`, and the node verifies it as
/// soon as its prefill ends (docs/ALGORITHMS.md §10, "The first tree goes with the open"). The
/// output does not change: greedy output is the target's own, and seeded sampled output is the
/// same with `pipeline.first_tree_with_open` off.
#[test]
fn the_first_tree_goes_with_the_open_without_changing_the_output() {
    let pair = TinyPair::new();
    let verify = start_verify(verify_config(&pair.target));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let slow = far_away(&rt, &verify.url(), 300);
    // (temperature, seed, prompt) of each generation, in order: greedy and sampled generations
    // keep their first trees apart, so the first of each kind has none.
    let mut runs: Vec<(f32, u64, &str)> = PROMPTS.iter().map(|p| (0.0, 1, *p)).collect();
    runs.extend([
        (0.8, 3, PROMPTS[1]),
        (0.8, 3, PROMPTS[1]),
        (0.8, 4, PROMPTS[2]),
    ]);
    let run_all = |with_open: bool| {
        let mut config = draft_config(&pair.draft, std::slice::from_ref(&slow), 8, 4);
        config.pipeline.first_tree_with_open = with_open;
        let draft = start_draft(config);
        runs.iter()
            .map(|&(t, seed, prompt)| {
                let got = rt
                    .block_on(within(
                        120,
                        generate(&draft.url(), piped(prompt, 12, t, seed, true)),
                    ))
                    .expect("generation succeeds");
                let s = got.summary.expect("summary");
                (got.tokens, s.first_tree_early, s.first_tree_with_open)
            })
            .collect::<Vec<_>>()
    };
    let on = run_all(true);
    let off = run_all(false);
    for (i, (&(t, seed, prompt), (on, off))) in runs.iter().zip(on.iter().zip(&off)).enumerate() {
        assert_eq!(
            on.0, off.0,
            "generation {i} ({prompt:?}, T = {t}, seed {seed})"
        );
        if t == 0.0 {
            assert_eq!(on.0, plain_greedy(&pair.target, prompt, 12), "{prompt:?}");
        }
        let first_of_kind = i == 0 || i == PROMPTS.len();
        assert_eq!(
            on.2, !first_of_kind,
            "generation {i}: first tree sent with the open = {}",
            on.2
        );
        assert!(
            !off.2,
            "generation {i}: sent with the open although turned off"
        );
        assert_eq!(
            (on.1, off.1),
            (!first_of_kind, !first_of_kind),
            "generation {i}"
        );
    }
}
