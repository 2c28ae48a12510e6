//! The fork-join that runs a forward pass's parallel loops: `for_each(n, f)` calls `f(0..n)`
//! spread over the engine's threads.
//!
//! **Why not rayon alone.** A forward is a chain of about 150 short parallel loops (per layer:
//! fused Q/K/V, attention, the output projection, fused gate/up, down; then the LM head) with
//! short serial steps between them (norms, rotary embedding, residual adds). Rayon's idle
//! workers yield a few times and then sleep on a futex, so nearly every loop began with a
//! wake-up through the kernel: `perf` of a 2-thread decode put 7–9 % of the forward in the
//! scheduler (`try_to_wake_up`, `__schedule`, `sched_yield`). Here the workers spin on a
//! generation counter for [`SPIN`] after each loop, which covers the serial gaps inside a forward
//! and between the forwards of a decode loop, and only then park; the calling thread takes
//! tasks too, so `threads − 1` workers are spawned.
//!
//! **Who gets it.** One loop at a time: a second caller that arrives while a loop runs (a
//! nested loop, or another session's forward on another thread when the verify node runs
//! without batching) goes through rayon's global pool as before, so concurrent forwards share
//! the cores as they always did. Results never depend on the path: each task writes its own
//! outputs with the same code wherever it runs.
//!
//! With one thread there is no pool and no rayon either: loops run on the calling thread.
//!
//! `SEQUOIA_ENGINE_POOL=rayon` sends every loop through rayon (for A/B measurements).

use std::any::Any;
use std::cell::UnsafeCell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rayon::prelude::*;

/// How long an idle worker spins for the next loop before it parks: longer than the serial
/// steps of a forward (tens of µs) and the gap between two decode steps of one process; short
/// enough that a process with no work gives its core back at once. While it spins it yields
/// every few µs, so another process on the same cores (a draft beside its verify node) still
/// gets them.
const SPIN: Duration = Duration::from_micros(500);

/// Run `f(i)` for every `i` in `0..n`, in parallel on the engine's threads, and return when
/// all have run. A panic in `f` is raised again here once every thread has stopped.
pub(crate) fn for_each<F: Fn(usize) + Sync>(n: usize, f: F) {
    let route = match pool() {
        Some(pool) => Route::Pool(pool),
        None if single_threaded() => Route::Caller,
        None => Route::Rayon,
    };
    for_each_on(route, n, f)
}

/// Where a loop runs.
#[derive(Clone, Copy)]
enum Route<'a> {
    /// The pool, if idle; else rayon.
    Pool(&'a Pool),
    /// The calling thread, in order.
    Caller,
    /// Rayon's global pool.
    Rayon,
}

fn for_each_on<F: Fn(usize) + Sync>(route: Route<'_>, n: usize, f: F) {
    if n == 0 {
        return;
    }
    if n == 1 {
        f(0);
        return;
    }
    match route {
        Route::Pool(pool) if n <= u32::MAX as usize && pool.try_run(n, &f) => {}
        // One thread: the loop runs right here. Through rayon, a caller outside its pool hands
        // every loop to the one worker and sleeps until it is done, two context switches per
        // loop and some 300 per forward: 8 % of a one-thread forward in the scheduler (`perf`,
        // Zen 3, 1.5B at 2 and 4 rows), on the one core each host of the two-host setup has.
        Route::Caller => (0..n).for_each(f),
        _ => (0..n).into_par_iter().for_each(&f),
    }
}

/// Whether the engine runs on one thread, so loops run on their caller (not with
/// `SEQUOIA_ENGINE_POOL=rayon`). Read once, like the pool, after the thread count is set.
fn single_threaded() -> bool {
    static ONE: OnceLock<bool> = OnceLock::new();
    *ONE.get_or_init(|| !rayon_only() && crate::current_threads() <= 1)
}

/// `SEQUOIA_ENGINE_POOL=rayon`: every loop through rayon (for A/B measurements).
fn rayon_only() -> bool {
    std::env::var("SEQUOIA_ENGINE_POOL").is_ok_and(|v| v == "rayon")
}

/// The task type the workers see: the caller's closure with its lifetime erased (it outlives
/// the loop: the caller waits for every worker before returning).
type Task = dyn Fn(usize) + Sync;

struct Shared {
    /// Written by the thread holding `busy` before it bumps `generation`; read by the workers
    /// after they see the bump, until they count themselves in `finished`.
    job: UnsafeCell<*const Task>,
    /// Each thread's share of the current loop's tasks, `(next, end)` packed in one word: the
    /// owner takes tasks from the front, in order (its weight columns form one stream that the
    /// prefetchers follow), and a thread done with its own share takes from the back of
    /// another's. Index 0 is the calling thread's, `1 + i` worker i's.
    shares: Vec<AtomicU64>,
    /// Workers done with the current loop.
    finished: AtomicUsize,
    /// Bumped once per loop: what idle workers watch.
    generation: AtomicU64,
    /// A loop is running (its caller owns `job`).
    busy: AtomicBool,
    /// The first panic of the current loop, raised again by its caller.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    /// Parked workers, and what wakes them.
    parked: AtomicUsize,
    park: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is only written by the holder of `busy` while no worker reads it (all workers
// have counted themselves finished, or the generation has not been bumped yet); the pointer it
// holds is to a `Sync` closure.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

/// The calling thread plus `shared.shares.len() − 1` workers.
struct Pool {
    shared: Arc<Shared>,
}

/// The pool, started on first use with one worker fewer than the engine's threads; `None` with
/// one thread or when `SEQUOIA_ENGINE_POOL=rayon`.
fn pool() -> Option<&'static Pool> {
    static POOL: OnceLock<Option<Pool>> = OnceLock::new();
    POOL.get_or_init(|| {
        if rayon_only() {
            return None;
        }
        Pool::start(crate::current_threads().saturating_sub(1))
    })
    .as_ref()
}

impl Pool {
    /// Spawn `workers` threads; `None` with none (or when the system has no threads to give:
    /// every loop then goes through rayon; workers already started only ever wait).
    fn start(workers: usize) -> Option<Pool> {
        if workers == 0 {
            return None;
        }
        let shared = Arc::new(Shared {
            job: UnsafeCell::new(&(|_: usize| {}) as &Task as *const Task),
            shares: (0..=workers).map(|_| AtomicU64::new(0)).collect(),
            finished: AtomicUsize::new(0),
            generation: AtomicU64::new(0),
            busy: AtomicBool::new(false),
            panic: Mutex::new(None),
            parked: AtomicUsize::new(0),
            park: Mutex::new(()),
            wake: Condvar::new(),
        });
        for i in 0..workers {
            let s = shared.clone();
            std::thread::Builder::new()
                .name(format!("sequoia-engine-{}", i + 1))
                .spawn(move || work(&s, i + 1))
                .ok()?;
        }
        Some(Pool { shared })
    }

    /// Run the loop on the pool if no other loop holds it; false (nothing run) otherwise.
    fn try_run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) -> bool {
        let s = &*self.shared;
        if s.busy
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        // SAFETY: erasing the closure's lifetime; it outlives every use, since this function
        // returns only after every worker has counted itself finished with this loop.
        let f: *const Task = unsafe { std::mem::transmute(f as *const (dyn Fn(usize) + Sync)) };
        // SAFETY: we hold `busy` and every worker finished the previous loop: nobody reads
        // `job` until the generation bump below.
        unsafe { *s.job.get() = f };
        let threads = s.shares.len();
        for (t, share) in s.shares.iter().enumerate() {
            share.store(
                pack(t * n / threads, (t + 1) * n / threads),
                Ordering::Relaxed,
            );
        }
        s.finished.store(0, Ordering::Relaxed);
        s.generation.fetch_add(1, Ordering::SeqCst);
        if s.parked.load(Ordering::SeqCst) > 0 {
            let _guard = s.park.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        run_tasks(s, 0);
        let mut spins = 0u32;
        while s.finished.load(Ordering::Acquire) < threads - 1 {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) {
                // A worker still asleep or descheduled: let it have the core.
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        let panic = s.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
        s.busy.store(false, Ordering::Release);
        if let Some(p) = panic {
            resume_unwind(p);
        }
        true
    }
}

/// `(next, end)` of a share in one word.
fn pack(next: usize, end: usize) -> u64 {
    ((next as u64) << 32) | end as u64
}

/// Take the front task of a share (`front`), or its back task; `None` when it is empty.
fn take(share: &AtomicU64, front: bool) -> Option<usize> {
    let mut cur = share.load(Ordering::Relaxed);
    loop {
        let (next, end) = ((cur >> 32) as usize, (cur & 0xFFFF_FFFF) as usize);
        if next >= end {
            return None;
        }
        let (new, task) = if front {
            (pack(next + 1, end), next)
        } else {
            (pack(next, end - 1), end - 1)
        };
        match share.compare_exchange_weak(cur, new, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return Some(task),
            Err(now) => cur = now,
        }
    }
}

/// Run the current loop's tasks as thread `me`: its own share from the front, then the other
/// shares from the back until every share is empty. A panicking task empties every share (the
/// loop's remaining tasks are skipped) and is kept for the caller to raise.
fn run_tasks(s: &Shared, me: usize) {
    // SAFETY: called between the generation bump and this thread's `finished` count (or by the
    // caller before it waits for the workers): `job` is set and its closure alive.
    let f = unsafe { &**s.job.get() };
    let threads = s.shares.len();
    let ran = catch_unwind(AssertUnwindSafe(|| {
        while let Some(i) = take(&s.shares[me], true) {
            f(i);
        }
        for other in (1..threads).map(|d| (me + d) % threads) {
            while let Some(i) = take(&s.shares[other], false) {
                f(i);
            }
        }
    }));
    if let Err(p) = ran {
        for share in &s.shares {
            share.store(0, Ordering::Relaxed);
        }
        let mut slot = s.panic.lock().unwrap_or_else(|e| e.into_inner());
        slot.get_or_insert(p);
    }
}

/// A worker: wait for each new loop (spinning, then parked), take its tasks, report done.
fn work(s: &Shared, me: usize) {
    let mut seen = 0u64;
    loop {
        seen = wait_for_loop(s, seen);
        run_tasks(s, me);
        s.finished.fetch_add(1, Ordering::Release);
    }
}

/// Wait until the generation moves past `seen`; returns the new one.
fn wait_for_loop(s: &Shared, seen: u64) -> u64 {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        let g = s.generation.load(Ordering::Acquire);
        if g != seen {
            return g;
        }
        spins = spins.wrapping_add(1);
        if !spins.is_multiple_of(256) {
            std::hint::spin_loop();
            continue;
        }
        if start.elapsed() < SPIN {
            std::thread::yield_now();
            continue;
        }
        // Park. `parked` goes up before the generation is checked again under the lock, and
        // the caller bumps the generation before it reads `parked`: one of the two sees the
        // other, so no wake-up is lost.
        let mut guard = s.park.lock().unwrap_or_else(|e| e.into_inner());
        s.parked.fetch_add(1, Ordering::SeqCst);
        while s.generation.load(Ordering::SeqCst) == seen {
            guard = s.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
        }
        s.parked.fetch_sub(1, Ordering::SeqCst);
        drop(guard);
        return s.generation.load(Ordering::Acquire);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    fn counts(n: usize) -> Vec<AtomicU32> {
        (0..n).map(|_| AtomicU32::new(0)).collect()
    }

    /// Run `n` tasks on `pool` (which must take the loop) and check each ran exactly once.
    fn run_once_each(pool: &Pool, n: usize) {
        let c = counts(n);
        let f = |i: usize| {
            c[i].fetch_add(1, Ordering::Relaxed);
        };
        assert!(pool.try_run(n, &f), "an idle pool takes the loop");
        assert!(c.iter().all(|x| x.load(Ordering::Relaxed) == 1), "n = {n}");
    }

    #[test]
    fn every_task_runs_exactly_once() {
        for workers in [1, 3] {
            let pool = Pool::start(workers).expect("threads");
            for n in [1, 2, 3, 7, 64, 1000] {
                for _ in 0..20 {
                    run_once_each(&pool, n);
                }
            }
        }
    }

    #[test]
    fn loops_after_the_workers_parked_still_run_every_task() {
        let pool = Pool::start(2).expect("threads");
        for _ in 0..3 {
            // Idle workers park once their spin is over (polled: a loaded machine may
            // deschedule them for a while first).
            let deadline = Instant::now() + Duration::from_secs(10);
            while pool.shared.parked.load(Ordering::SeqCst) < 2 {
                assert!(Instant::now() < deadline, "idle workers never parked");
                std::thread::sleep(SPIN);
            }
            run_once_each(&pool, 100);
        }
    }

    #[test]
    fn a_busy_pool_refuses_a_second_loop_and_for_each_still_runs_everything() {
        let pool = Pool::start(1).expect("threads");
        let inner_taken = AtomicU32::new(0);
        let outer = |_: usize| {
            if pool.try_run(4, &|_| {}) {
                inner_taken.fetch_add(1, Ordering::Relaxed);
            }
        };
        assert!(pool.try_run(8, &outer));
        assert_eq!(
            inner_taken.load(Ordering::Relaxed),
            0,
            "nested loops are refused"
        );
        // Through the process's pool (or rayon), nested and concurrent loops all complete.
        crate::init_threads(2);
        let total = AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    for _ in 0..50 {
                        for_each(8, |_| {
                            for_each(4, |_| {
                                total.fetch_add(1, Ordering::Relaxed);
                            });
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 4 * 50 * 8 * 4);
    }

    #[test]
    fn with_one_thread_loops_run_on_the_caller_in_order() {
        let caller = std::thread::current().id();
        let seen = Mutex::new(Vec::new());
        for_each_on(Route::Caller, 100, |i| {
            seen.lock().unwrap().push((i, std::thread::current().id()));
        });
        let seen = seen.into_inner().unwrap();
        assert_eq!(seen.len(), 100);
        for (k, (i, id)) in seen.iter().enumerate() {
            assert_eq!((*i, *id), (k, caller), "task {k}");
        }
        // A nested loop in a task runs there too.
        let total = AtomicUsize::new(0);
        for_each_on(Route::Caller, 8, |_| {
            for_each_on(Route::Caller, 4, |_| {
                assert_eq!(std::thread::current().id(), caller);
                total.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(total.load(Ordering::Relaxed), 32);
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_and_the_pool_stays_usable() {
        let pool = Pool::start(2).expect("threads");
        let failing = |i: usize| {
            if i == 17 {
                panic!("task 17 failed");
            }
        };
        let r = catch_unwind(AssertUnwindSafe(|| pool.try_run(64, &failing)));
        let msg = r.expect_err("the panic reaches the caller");
        assert_eq!(msg.downcast_ref::<&str>(), Some(&"task 17 failed"));
        run_once_each(&pool, 64);
    }
}
