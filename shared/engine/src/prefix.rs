//! Kept prefix caches (docs/ALGORITHMS.md §11, prefix reuse): chat clients resend the whole
//! conversation every turn, so when a sequence ends its KV cache is kept here with the tokens
//! it holds, and a new sequence takes the entry sharing the longest token prefix with it and
//! forwards only the rest.
//!
//! Matching compares tokens, never hashes, so a match is always an exact prefix and exactness
//! cannot depend on a collision. The store holds few entries (it is bounded by memory, and one
//! entry is a whole conversation), so a linear scan costs microseconds against the
//! milliseconds per token a prefill costs; matching at token rather than block granularity also
//! keeps the part of the last block that a block hash would lose.
//!
//! An entry is moved out on a hit, not copied: the new sequence extends it and puts it back,
//! longer, when it ends. Least recently used entries go first when memory is needed.

use crate::{EngineError, KvCache};

struct Entry {
    tokens: Vec<u32>,
    cache: KvCache,
    bytes: usize,
    last_used: u64,
}

/// LRU store of kept KV caches, bounded to `max_bytes` of K/V storage.
pub struct PrefixStore {
    entries: Vec<Entry>,
    max_bytes: usize,
    bytes: usize,
    clock: u64,
}

/// A kept cache taken for a new sequence: its first `reused` entries equal that sequence's
/// first `reused` tokens. Entries past them are still there; cut them off with
/// [`KvCache::reuse_prefix`].
pub struct Reused {
    pub cache: KvCache,
    pub reused: usize,
}

impl PrefixStore {
    /// `max_bytes` = 0 keeps nothing.
    pub fn new(max_bytes: usize) -> Self {
        Self {
            entries: Vec::new(),
            max_bytes,
            bytes: 0,
            clock: 0,
        }
    }

    /// K/V bytes held by kept caches.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Take the kept cache sharing the longest prefix with `tokens`, if that prefix has at
    /// least `min_tokens` tokens (and at least one).
    pub fn take(&mut self, tokens: &[u32], min_tokens: usize) -> Option<Reused> {
        let (best, reused) = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (i, common_prefix(&e.tokens, tokens)))
            .max_by_key(|&(i, n)| (n, self.entries[i].last_used))?;
        if reused == 0 || reused < min_tokens {
            return None;
        }
        let e = self.entries.swap_remove(best);
        self.bytes -= e.bytes;
        Some(Reused {
            cache: e.cache,
            reused,
        })
    }

    /// Keep `cache`, whose entries hold the first `min(cache.len(), tokens.len())` of `tokens`:
    /// entries past the tokens (a verified path that `max_tokens` or a stop string cut short
    /// leaves some in the draft's cache) were never committed and are dropped. Its spare storage
    /// is given back first. An entry whose tokens are a prefix of another's is redundant and
    /// is dropped. Least recently used entries are evicted until the store fits `max_bytes`
    /// and `room` more bytes would not pass it (the caller's own budget, e.g. the verify
    /// node's free KV memory); a cache that cannot fit is dropped.
    pub fn put(
        &mut self,
        mut tokens: Vec<u32>,
        mut cache: KvCache,
        room: usize,
    ) -> Result<(), EngineError> {
        cache.truncate(tokens.len());
        tokens.truncate(cache.len());
        if tokens.is_empty() || self.max_bytes == 0 {
            return Ok(());
        }
        self.clock += 1;
        // Already covered by a longer (or equal) kept sequence: refresh that one instead.
        if let Some(e) = self
            .entries
            .iter_mut()
            .find(|e| e.tokens.len() >= tokens.len() && e.tokens[..tokens.len()] == tokens[..])
        {
            e.last_used = self.clock;
            return Ok(());
        }
        cache.shrink_to_fit()?;
        let bytes = cache.allocated_bytes();
        let limit = self.max_bytes.min(room);
        if bytes > limit {
            return Ok(());
        }
        let mut freed = 0;
        self.entries.retain(|e| {
            let covered =
                e.tokens.len() <= tokens.len() && tokens[..e.tokens.len()] == e.tokens[..];
            if covered {
                freed += e.bytes;
            }
            !covered
        });
        self.bytes -= freed;
        while self.bytes + bytes > limit {
            self.evict_lru();
        }
        self.bytes += bytes;
        self.entries.push(Entry {
            tokens,
            cache,
            bytes,
            last_used: self.clock,
        });
        Ok(())
    }

    /// Drop the least recently used entry; returns the bytes freed (0 when empty).
    pub fn evict_lru(&mut self) -> usize {
        let Some(i) = self
            .entries
            .iter()
            .enumerate()
            .min_by_key(|(_, e)| e.last_used)
            .map(|(i, _)| i)
        else {
            return 0;
        };
        let e = self.entries.swap_remove(i);
        self.bytes -= e.bytes;
        e.bytes
    }

    /// Drop everything.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.bytes = 0;
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
