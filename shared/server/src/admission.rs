//! Admission control: a node serves at most `max` concurrent sessions (verify) or generations
//! (draft), refuses new ones while draining, and counts them in the metrics. A [`Permit`] holds
//! one slot and gives it back when dropped (stream end, error or client disconnect), so no code
//! path can leak a slot.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::metrics::Metrics;

/// Why a new session was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The node is shutting down.
    Draining,
    /// All `max` slots are taken (`active` at the time of the attempt).
    Full { active: usize, max: usize },
}

/// The slot counter of one node.
pub struct Admission {
    max: usize,
    active: AtomicUsize,
    draining: AtomicBool,
    metrics: Metrics,
}

impl Admission {
    pub fn new(max: usize, metrics: Metrics) -> Arc<Self> {
        Arc::new(Admission {
            max,
            active: AtomicUsize::new(0),
            draining: AtomicBool::new(false),
            metrics,
        })
    }

    /// Take a slot, atomically (concurrent callers never exceed `max`).
    pub fn try_acquire(self: &Arc<Self>) -> Result<Permit, Refused> {
        if self.is_draining() {
            return Err(Refused::Draining);
        }
        let max = self.max;
        self.active
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max).then_some(n + 1)
            })
            .map_err(|active| Refused::Full { active, max })?;
        self.metrics.session_started();
        Ok(Permit(self.clone()))
    }

    /// Sessions open now.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::SeqCst)
    }

    pub fn max(&self) -> usize {
        self.max
    }

    /// Refuse new sessions from now on (open ones keep their permits).
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }
}

/// One admitted session; the slot is released on drop.
pub struct Permit(Arc<Admission>);

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Admission({} of {})", self.active(), self.max)
    }
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Permit")
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
        self.0.metrics.session_ended();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_bounded_released_and_refused_while_draining() {
        let a = Admission::new(2, Metrics::default());
        let p1 = a.try_acquire().unwrap();
        let _p2 = a.try_acquire().unwrap();
        assert_eq!(
            a.try_acquire().unwrap_err(),
            Refused::Full { active: 2, max: 2 }
        );
        drop(p1);
        assert_eq!(a.active(), 1);
        let _p3 = a.try_acquire().unwrap();
        a.start_draining();
        assert_eq!(a.try_acquire().unwrap_err(), Refused::Draining);
        assert_eq!(a.active(), 2);
    }

    #[test]
    fn concurrent_acquires_never_exceed_the_limit() {
        let a = Admission::new(8, Metrics::default());
        let got: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..32).map(|_| s.spawn(|| a.try_acquire().ok())).collect();
            hs.into_iter().filter_map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(got.len(), 8);
        assert_eq!(a.active(), 8);
        drop(got);
        assert_eq!(a.active(), 0);
    }
}
