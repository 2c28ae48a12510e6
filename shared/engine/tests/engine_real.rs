//! Tree attention on real quantized weights: every node of a tree forward must predict the same
//! next token (argmax) as decoding its root-to-node path one token at a time, and the logits must
//! agree closely. The models are fetched on first use (`models::ensure_model`); a failed fetch
//! fails the test with the fetch error, it never skips.
//!
//! - SmolLM2-135M (llama architecture, Q4_1 + Q8_0): GGUF Q/K un-permutation, tied embeddings;
//! - Qwen2.5-Coder-0.5B (qwen2, Q5_0 / Q8_0 / Q4_K / Q6_K): QKV biases and every CPU kernel the
//!   default model pair uses.

use sequoia_core::sampling::argmax;
use sequoia_core::tree::Tree;
use sequoia_engine::tokenizer::TextTokenizer;
use sequoia_engine::{LoadOptions, Model};
use sequoia_models as models;

fn load(name: &str) -> (Model, TextTokenizer) {
    let path = models::ensure_model(name)
        .unwrap_or_else(|e| panic!("real-model test needs {name}; fetching it failed: {e}"));
    let model = Model::load(&path, &LoadOptions::default()).expect("load model");
    let tok = TextTokenizer::load_for_model(&path).expect("load tokenizer");
    (model, tok)
}

/// Greedy top-k children of a path (realistic tree tokens).
fn top_k(logits: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    idx.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    idx.truncate(k);
    idx
}

fn check_tree_matches_sequential(name: &str) {
    let (model, tok) = load(name);
    let prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n";
    let prefix = tok.encode(prompt, true).unwrap();
    assert!(prefix.len() > 5);

    // An irregular tree (BFS order) whose tokens are the model's own top candidates, so the
    // comparison happens where it matters: on likely continuations.
    let parents: Vec<i32> = vec![-1, 0, 0, 0, 1, 1, 2, 3, 4, 4, 5, 6, 8, 9, 9, 12];
    let tree = Tree::from_parents(&parents).unwrap();
    let mut cache = model.new_cache();
    let root_logits = model.forward_chain_last(&mut cache, &prefix).unwrap();
    let root = argmax(&root_logits);
    let mut tokens = vec![root; tree.len()];
    {
        // Fill children with the top-k of a sequential run along each parent's path.
        for v in 0..tree.len() {
            let kids = tree.children(v);
            if kids.is_empty() {
                continue;
            }
            let path: Vec<u32> = tree.path_to(v).iter().map(|&i| tokens[i]).collect();
            let mut c = model.new_cache();
            model.forward_chain_last(&mut c, &prefix).unwrap();
            let l = model.forward_chain_last(&mut c, &path).unwrap();
            for (&kid, t) in kids.iter().zip(top_k(&l, kids.len())) {
                tokens[kid as usize] = t;
            }
        }
    }

    let logits = model.forward_tree(&mut cache, &tokens, &tree).unwrap();
    let mut max_diff = 0f32;
    for i in 0..tree.len() {
        let mut c = model.new_cache();
        model.forward_chain_last(&mut c, &prefix).unwrap();
        let mut want = Vec::new();
        for &j in &tree.path_to(i) {
            want = model.forward_chain_last(&mut c, &[tokens[j]]).unwrap();
        }
        let got = logits.row(i);
        let d = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        max_diff = max_diff.max(d);
        assert_eq!(
            argmax(got),
            argmax(&want),
            "{name}: node {i} predicts a different token (max logit diff {d})"
        );
    }
    println!(
        "{name}: tree of {} nodes after {} prompt tokens: argmax identical at every node, \
         max |logit diff| = {max_diff:.3e}",
        tree.len(),
        prefix.len()
    );
    // Quantized weights run batch-invariant kernels (matmul and attention): bit for bit.
    assert_eq!(
        max_diff, 0.0,
        "{name}: tree logits differ from sequential decoding"
    );

    // Compaction to one root-to-leaf path, then more decoding, equals a fresh sequential run.
    let leaf = 15;
    let path = tree.path_to(leaf);
    cache.keep_newest(tree.len(), &path).unwrap();
    let next = argmax(logits.row(leaf));
    let got = model.forward_chain_last(&mut cache, &[next]).unwrap();
    let mut seq = prefix.clone();
    seq.extend(path.iter().map(|&j| tokens[j]));
    seq.push(next);
    let mut c = model.new_cache();
    let want = model.forward_chain_last(&mut c, &seq).unwrap();
    assert_eq!(argmax(&got), argmax(&want), "{name}: after compaction");
}

#[test]
fn engine_real_smollm2_tree_matches_sequential() {
    check_tree_matches_sequential(models::SMOLLM2_135M);
}

#[test]
fn engine_real_qwen_0_5b_tree_matches_sequential() {
    check_tree_matches_sequential(models::QWEN_CODER_0_5B);
}
