//! KV-cache memory budget of a verify node: every session reserves, at `open`, the memory its
//! cache can grow to (its prefix, every new token and one tree: `session::kv_tokens`), and a
//! session that does not fit is refused with RESOURCE_EXHAUSTED instead of the node running out
//! of memory later. Caches are bounded to their reservation (`Model::new_cache_limited`), so
//! the budget holds however the sessions grow.

use sequoia_server::metrics::Metrics;
use std::sync::{Arc, Mutex};

/// Bytes reserved by open sessions against a fixed budget.
pub struct KvPool {
    /// 0 = no limit (usage is still tracked and reported).
    budget: usize,
    used: Mutex<usize>,
    metrics: Metrics,
}

/// One session's share of the pool, given back when dropped (session end, error, disconnect).
pub struct KvReservation {
    pool: Arc<KvPool>,
    bytes: usize,
}

impl KvPool {
    pub fn new(budget_bytes: usize, metrics: Metrics) -> Arc<Self> {
        Arc::new(Self {
            budget: budget_bytes,
            used: Mutex::new(0),
            metrics,
        })
    }

    /// Bytes currently reserved.
    pub fn used(&self) -> usize {
        *self.used.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reserve `bytes`, or say (in words a client can act on) why not.
    pub fn reserve(self: &Arc<Self>, bytes: usize) -> Result<KvReservation, String> {
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        if self.budget > 0 && *used + bytes > self.budget {
            return Err(format!(
                "verify node's KV memory is full: this session needs {:.1} MB, {:.1} of {:.1} MB are in use; retry later, use a shorter prompt or max_tokens, or another node",
                mb(bytes),
                mb(*used),
                mb(self.budget)
            ));
        }
        *used += bytes;
        self.report(*used);
        Ok(KvReservation {
            pool: self.clone(),
            bytes,
        })
    }

    fn report(&self, used: usize) {
        if self.budget > 0 {
            self.metrics.set_kv_usage(used as f64 / self.budget as f64);
        }
    }
}

impl Drop for KvReservation {
    fn drop(&mut self) {
        let mut used = self.pool.used.lock().unwrap_or_else(|p| p.into_inner());
        *used = used.saturating_sub(self.bytes);
        self.pool.report(*used);
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
