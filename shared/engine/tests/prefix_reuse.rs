//! Prefix reuse across chat turns (docs/ALGORITHMS.md §11): a cache kept from an earlier
//! sequence, cut back to the prefix it shares with a new one, then extended by the new suffix,
//! must give exactly the logits of a fresh prefill of the whole new sequence — whatever chunks
//! either was forwarded in, and whether its entries came from prefill or from verified trees.

mod common;

use common::tokens;
use sequoia_core::tree::Tree;
use sequoia_engine::random::{RandomQuant, RandomSpec};
use sequoia_engine::{Kernels, KvCache, LoadOptions, Model};

fn model() -> Model {
    let spec = RandomSpec {
        seed: 23,
        quant: RandomQuant::Q4KM,
        ..RandomSpec::named("tiny").unwrap()
    };
    let m = Model::random(&spec, &LoadOptions::default(), Kernels::Native).unwrap();
    assert!(
        m.info().batch_invariant,
        "the test needs batch-invariant kernels"
    );
    m
}

/// Forward `seq` in chunks of `chunk` tokens; the logits after its last token.
fn prefill(model: &Model, cache: &mut KvCache, seq: &[u32], chunk: usize) -> Vec<f32> {
    let mut last = Vec::new();
    for part in seq.chunks(chunk) {
        last = model.forward_chain_last(cache, part).unwrap();
    }
    last
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn reused_prefix_plus_suffix_gives_the_full_prefills_logits_bit_for_bit() {
    let model = model();
    let vocab = model.info().vocab_size;
    let shared = tokens(70, 1, vocab);
    let old_tail = tokens(30, 2, vocab);
    let new_tail = tokens(25, 3, vocab);
    let new_seq: Vec<u32> = shared.iter().chain(&new_tail).copied().collect();

    let fresh = prefill(&model, &mut model.new_cache(), &new_seq, new_seq.len());
    for chunk in [1, 7, 64, 200] {
        // Turn 1: the shared prefix plus a tail the new sequence does not have.
        let mut kept = model.new_cache();
        let old: Vec<u32> = shared.iter().chain(&old_tail).copied().collect();
        prefill(&model, &mut kept, &old, chunk);
        kept.shrink_to_fit().unwrap();
        assert_eq!(kept.allocated(), old.len());
        // Turn 2: keep what is shared, under a new size limit, then forward only the rest.
        kept.reuse_prefix(shared.len(), new_seq.len() + 4).unwrap();
        assert_eq!(kept.len(), shared.len());
        let reused = prefill(&model, &mut kept, &new_tail, chunk);
        assert_eq!(
            bits(&reused),
            bits(&fresh),
            "chunk {chunk}: logits after a reused prefix differ from a fresh prefill"
        );
    }
}

#[test]
fn entries_written_by_verified_trees_equal_prefill_entries() {
    // On a verify node the kept cache's generated part was written by tree forwards and then
    // compacted to the accepted path; its entries must be those a prefill would write.
    let model = model();
    let vocab = model.info().vocab_size;
    let prompt = tokens(40, 4, vocab);
    let mut cache = model.new_cache();
    prefill(&model, &mut cache, &prompt, 16);
    let tree = Tree::from_parents(&[-1, 0, 0, 1, 1, 2, 3]).unwrap();
    let toks = tokens(tree.len(), 5, vocab);
    model.forward_tree(&mut cache, &toks, &tree).unwrap();
    let path = [0usize, 1, 4]; // root, its first child, that child's second child
    cache.keep_newest(tree.len(), &path).unwrap();
    let mut seq = prompt.clone();
    seq.extend(path.iter().map(|&v| toks[v]));
    assert_eq!(cache.len(), seq.len());

    let turn2 = tokens(12, 6, vocab);
    let mut full: Vec<u32> = seq.clone();
    full.extend(&turn2);
    let fresh = prefill(&model, &mut model.new_cache(), &full, full.len());
    cache.reuse_prefix(seq.len(), full.len()).unwrap();
    let reused = prefill(&model, &mut cache, &turn2, turn2.len());
    assert_eq!(bits(&reused), bits(&fresh));
}

#[test]
fn reuse_refuses_what_the_cache_does_not_hold() {
    let model = model();
    let mut cache = model.new_cache();
    prefill(
        &model,
        &mut cache,
        &tokens(10, 7, model.info().vocab_size),
        10,
    );
    assert!(cache.reuse_prefix(11, 100).is_err());
    assert!(cache.reuse_prefix(8, 5).is_err());
    // A smaller limit gives back storage past it.
    cache.reuse_prefix(4, 6).unwrap();
    assert_eq!((cache.len(), cache.capacity()), (4, 6));
    assert!(cache.allocated() <= 6);
    let before = cache.allocated_bytes();
    assert_eq!(before, cache.allocated() * model.kv_bytes_per_token());
}

#[test]
fn the_store_hands_out_the_longest_match_and_evicts_least_recently_used() {
    use sequoia_engine::prefix::PrefixStore;
    let model = model();
    let vocab = model.info().vocab_size;
    let per = model.kv_bytes_per_token();
    let filled = |seq: &[u32]| {
        let mut c = model.new_cache();
        prefill(&model, &mut c, seq, 64);
        c
    };
    let a = tokens(20, 8, vocab);
    let mut b = a[..10].to_vec();
    b.extend(tokens(15, 9, vocab));
    let c = tokens(30, 10, vocab);
    let mut store = PrefixStore::new(60 * per);
    store.put(a.clone(), filled(&a), usize::MAX).unwrap();
    store.put(b.clone(), filled(&b), usize::MAX).unwrap();
    assert_eq!((store.len(), store.bytes()), (2, 45 * per));
    // A prefix of a kept sequence adds nothing.
    store
        .put(a[..12].to_vec(), filled(&a[..12]), usize::MAX)
        .unwrap();
    assert_eq!(store.len(), 2);
    // 30 more tokens pass 60: the least recently used (b; a was just refreshed) goes.
    store.put(c.clone(), filled(&c), usize::MAX).unwrap();
    assert_eq!((store.len(), store.bytes()), (2, 50 * per));
    // The longest match wins, and is moved out.
    let mut q = a[..15].to_vec();
    q.extend(tokens(5, 11, vocab));
    let hit = store.take(&q, 1).unwrap();
    assert_eq!((hit.reused, hit.cache.len()), (15, 20));
    assert_eq!(store.len(), 1);
    assert!(store.take(&q, 1).is_none(), "c shares nothing with q");
    assert!(store.take(&c[..8], 9).is_none(), "below min_tokens");
    // A cache holding more than the committed tokens (a verified path cut short by
    // max_tokens) is kept for the tokens only.
    let d = tokens(16, 12, vocab);
    store.put(d[..13].to_vec(), filled(&d), usize::MAX).unwrap();
    let mut q = d[..13].to_vec();
    q.push(d[0]);
    let hit = store.take(&q, 1).unwrap();
    assert_eq!((hit.reused, hit.cache.len()), (13, 13));
    // Room smaller than the cache: not kept.
    store.put(a.clone(), filled(&a), 5 * per).unwrap();
    assert_eq!(store.len(), 1);
    assert_eq!(store.evict_lru(), 30 * per);
    assert_eq!((store.len(), store.bytes()), (0, 0));
}
