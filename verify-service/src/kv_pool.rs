//! KV-cache memory budget of a verify node: every session reserves, at `open`, the memory its
//! cache can grow to (its prefix, every new token and one tree: `session::kv_tokens`), and a
//! session that does not fit is refused with RESOURCE_EXHAUSTED instead of the node running out
//! of memory later. Caches are bounded to their reservation (`Model::new_cache_limited`), so
//! the budget holds however the sessions grow.
//!
//! The pool also holds the kept prefix caches of ended sessions (prefix reuse,
//! docs/ALGORITHMS.md §11). They count against the same budget, but they are the first thing
//! given up: a session that would not fit evicts them, least recently used first, before it is
//! refused. `used` counts open sessions only.

use sequoia_engine::prefix::{PrefixStore, Reused};
use sequoia_engine::KvCache;
use sequoia_server::metrics::Metrics;
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex, MutexGuard};

/// `[prefix_cache]` settings.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct PrefixCacheConfig {
    /// Keep ended sessions' caches and let new sessions whose prompt starts with the same
    /// tokens reuse them (prefill only the rest).
    pub enabled: bool,
    /// Most memory the kept caches may hold, in MiB (within `kv_budget_mb`; sessions evict
    /// them when they need the memory).
    pub max_mb: usize,
    /// Shortest shared prefix worth reusing, in tokens.
    pub min_tokens: usize,
}

impl Default for PrefixCacheConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            max_mb: 2048,
            min_tokens: 16,
        }
    }
}

/// Bytes reserved by open sessions against a fixed budget, and the kept prefix caches.
pub struct KvPool {
    /// 0 = no limit (usage is still tracked and reported).
    budget: usize,
    inner: Mutex<Inner>,
    min_tokens: usize,
    metrics: Metrics,
}

struct Inner {
    /// Reserved by open sessions.
    used: usize,
    kept: PrefixStore,
}

/// One session's share of the pool, given back when dropped (session end, error, disconnect).
pub struct KvReservation {
    pool: Arc<KvPool>,
    bytes: usize,
}

impl KvPool {
    pub fn new(budget_bytes: usize, metrics: Metrics) -> Arc<Self> {
        Self::with_prefix_cache(budget_bytes, &PrefixCacheConfig::default(), metrics)
    }

    /// A pool that keeps ended sessions' caches as `prefix` says (`enabled = false`: none).
    pub fn with_prefix_cache(
        budget_bytes: usize,
        prefix: &PrefixCacheConfig,
        metrics: Metrics,
    ) -> Arc<Self> {
        let kept = if prefix.enabled {
            prefix.max_mb.saturating_mul(1 << 20)
        } else {
            0
        };
        Arc::new(Self {
            budget: budget_bytes,
            inner: Mutex::new(Inner {
                used: 0,
                kept: PrefixStore::new(kept),
            }),
            min_tokens: prefix.min_tokens.max(1),
            metrics,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes currently reserved by open sessions (kept prefix caches not included).
    pub fn used(&self) -> usize {
        self.lock().used
    }

    /// Bytes held by kept prefix caches, and how many there are.
    pub fn kept(&self) -> (usize, usize) {
        let inner = self.lock();
        (inner.kept.bytes(), inner.kept.len())
    }

    /// Reserve `bytes`, evicting kept prefix caches (least recently used first) if that makes
    /// room, or say (in words a client can act on) why not.
    pub fn reserve(self: &Arc<Self>, bytes: usize) -> Result<KvReservation, String> {
        let mut inner = self.lock();
        if self.budget > 0 {
            while inner.used + inner.kept.bytes() + bytes > self.budget && !inner.kept.is_empty() {
                inner.kept.evict_lru();
            }
            if inner.used + bytes > self.budget {
                let used = inner.used;
                self.report(&inner);
                return Err(format!(
                    "verify node's KV memory is full: this session needs {:.1} MB, {:.1} of {:.1} MB are in use; retry later, use a shorter prompt or max_tokens, or another node",
                    mb(bytes),
                    mb(used),
                    mb(self.budget)
                ));
            }
        }
        inner.used += bytes;
        self.report(&inner);
        Ok(KvReservation {
            pool: self.clone(),
            bytes,
        })
    }

    /// Take the kept cache sharing the longest prefix with `prompt` (at least `min_tokens`),
    /// out of the store: the caller reuses its first `reused` entries. Counted in the
    /// prefix-cache metrics.
    pub fn take_prefix(&self, prompt: &[u32]) -> Option<Reused> {
        let mut inner = self.lock();
        let hit = inner.kept.take(prompt, self.min_tokens);
        self.metrics
            .prefix_lookup(prompt.len(), hit.as_ref().map_or(0, |h| h.reused));
        self.report(&inner);
        hit
    }

    /// Keep an ended session's cache (holding the first `cache.len()` of `tokens`) for later
    /// sessions, within `prefix_cache.max_mb` and the free part of the budget; evicts older
    /// kept caches as needed. Copies the live entries (giving back spare storage), so call it
    /// off the async threads.
    pub fn keep_prefix(&self, tokens: Vec<u32>, mut cache: KvCache) {
        // The copy runs before taking the lock, so admissions do not wait for it.
        if let Err(e) = cache.shrink_to_fit() {
            tracing::warn!(error = %e, "could not keep a prefix cache");
            return;
        }
        let mut inner = self.lock();
        let room = if self.budget > 0 {
            self.budget.saturating_sub(inner.used)
        } else {
            usize::MAX
        };
        if let Err(e) = inner.kept.put(tokens, cache, room) {
            tracing::warn!(error = %e, "could not keep a prefix cache");
        }
        self.report(&inner);
    }

    fn report(&self, inner: &Inner) {
        if self.budget > 0 {
            self.metrics
                .set_kv_usage(inner.used as f64 / self.budget as f64);
        }
        self.metrics.set_prefix_stored_bytes(inner.kept.bytes());
    }
}

impl Drop for KvReservation {
    fn drop(&mut self) {
        let mut inner = self.pool.lock();
        inner.used = inner.used.saturating_sub(self.bytes);
        self.pool.report(&inner);
    }
}

fn mb(bytes: usize) -> f64 {
    bytes as f64 / 1e6
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_are_refused_past_the_budget_and_returned_on_drop() {
        let pool = KvPool::new(1000, Metrics::disabled());
        let a = pool.reserve(600).unwrap();
        let err = pool.reserve(500).err().unwrap();
        assert!(err.contains("KV memory is full"), "{err}");
        let b = pool.reserve(400).unwrap();
        assert_eq!(pool.used(), 1000);
        drop(a);
        assert_eq!(pool.used(), 400);
        let _c = pool.reserve(500).unwrap();
        drop(b);
        assert_eq!(pool.used(), 500);
    }

    #[test]
    fn zero_budget_tracks_without_limit() {
        let pool = KvPool::new(0, Metrics::disabled());
        let _a = pool.reserve(usize::MAX / 4).unwrap();
        let _b = pool.reserve(usize::MAX / 4).unwrap();
        assert_eq!(pool.used(), usize::MAX / 4 * 2);
    }
}
