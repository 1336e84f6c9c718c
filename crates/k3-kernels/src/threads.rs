//! A persistent worker pool for the engine's parallel loops (matmul row bands, heads, chunks).
//!
//! Workers are started once per process and wait for jobs, spinning briefly before they sleep,
//! so back-to-back matmuls of a decode step do not pay thread start-up or wake-up each time.
//! A job is `n` tasks `f(0..n)` taken from a shared counter by the caller and up to
//! `threads − 1` workers; `run` returns when every task is done. Jobs from different callers are
//! serialised. A job of two tasks on two threads (most of a decode step's) skips the job slot:
//! it is posted to the first worker through one cache line and answered through another
//! (`PairPost`).

use std::cell::{Cell, UnsafeCell};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::switch::Switch;

/// How long an idle worker spins before sleeping on the condition variable.
const SPIN: Duration = Duration::from_micros(200);

type Task = dyn Fn(usize) + Sync;

/// One `run`: its task function and counters. Workers hold an `Arc` while they take part.
struct Job {
    /// Valid until `run` returns, which it does only after every participant has left.
    f: &'static Task,
    n: usize,
    helpers: usize,
    next: AtomicUsize,
    remaining: AtomicUsize,
    /// Workers inside `work` for this job.
    active: AtomicUsize,
    panicked: AtomicBool,
}

/// A two-task job handed to the first worker without the job slot ([`Pool::run_pair`]): one
/// line the caller writes and the worker reads, one the worker writes back. A pool job crosses
/// between the cores' caches some seven times (the slot's lock each way, the job, its counters)
/// and took 0.81 µs empty on the Emerald Rapids class host; this takes two or three.
#[repr(align(128))]
struct PairPost {
    /// `seq << 2 | claim`: the pair's number, and who took its task 1 ([`OPEN`], [`BY_WORKER`],
    /// [`BY_CALLER`]); a claim is a compare-exchange from `OPEN`, so exactly one side runs it.
    state: AtomicU64,
    /// The pair's tasks. Written before `state` publishes the pair; read only by the worker, and
    /// only after it has claimed task 1 from `OPEN`.
    f: UnsafeCell<Option<&'static Task>>,
}

// SAFETY: `f` is written only by the caller holding `Pool::submit` while no pair is in flight
// (the last one finished or was taken back), and read only by the worker after a successful
// claim, which orders it after that write (release store, acquire compare-exchange).
unsafe impl Sync for PairPost {}

/// What the worker writes back: the number of the last pair whose task 1 it finished.
#[repr(align(128))]
struct PairDone {
    seq: AtomicU64,
    /// When the worker finished it, in ns after [`epoch`] (for the pair's balance).
    end: AtomicU64,
    panicked: AtomicBool,
}

/// The process's reference instant for times passed between threads as integers.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

const OPEN: u64 = 0;
const BY_WORKER: u64 = 1;
const BY_CALLER: u64 = 2;

struct Shared {
    /// The pair posted to the first worker, and its answer.
    post: PairPost,
    done: PairDone,
    /// The job being run, if any; workers join it only while it is here.
    slot: Mutex<Option<Arc<Job>>>,
    generation: AtomicU64,
    /// Workers asleep (or about to sleep) on `wake`; `run` skips the wake-up syscall when none.
    sleepers: AtomicUsize,
    wake: Condvar,
}

pub struct Pool {
    shared: &'static Shared,
    workers: usize,
    submit: Mutex<()>,
}

fn work(job: &Job) {
    loop {
        let i = job.next.fetch_add(1, Ordering::AcqRel);
        if i >= job.n {
            return;
        }
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (job.f)(i))).is_err() {
            job.panicked.store(true, Ordering::Release);
        }
        job.remaining.fetch_sub(1, Ordering::AcqRel);
    }
}

thread_local! {
    /// Set on the pool's own threads, so a task can tell whether the caller runs it.
    static ON_WORKER: Cell<bool> = const { Cell::new(false) };
    /// Set on the caller while it runs its part of a job spread over several threads.
    static SHARING: Cell<bool> = const { Cell::new(false) };
}

/// Whether the calling thread is running a task of a job spread over several threads (the
/// pool's workers run nothing else), so that its memory traffic shares the machine with the
/// job's other threads; false for a job run on its caller alone.
#[inline]
pub fn in_shared_job() -> bool {
    ON_WORKER.with(|w| w.get()) || SHARING.with(|s| s.get())
}

/// `f` on the caller as its part of a job spread over several threads ([`in_shared_job`]).
fn sharing<R>(f: impl FnOnce() -> R) -> R {
    let was = SHARING.with(|s| s.replace(true));
    let r = f();
    SHARING.with(|s| s.set(was));
    r
}

/// The first worker's side of a posted pair (`state` as it read it): claim task 1 and run it,
/// unless the caller took it back first.
fn run_posted_pair(sh: &Shared, state: u64) {
    let seq = state >> 2;
    if state & 3 != OPEN {
        return;
    }
    let taken =
        sh.post.state.compare_exchange(seq << 2 | OPEN, seq << 2 | BY_WORKER, Ordering::AcqRel, Ordering::Acquire);
    if taken.is_err() {
        return;
    }
    // SAFETY: the claim succeeded, so the caller wrote `f` for this pair before publishing it and
    // waits for `done` before it writes `f` again.
    let f = unsafe { *sh.post.f.get() }.expect("a posted pair has its tasks");
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(1))).is_err() {
        sh.done.panicked.store(true, Ordering::Release);
    }
    sh.done.end.store(epoch().elapsed().as_nanos() as u64, Ordering::Relaxed);
    sh.done.seq.store(seq, Ordering::Release);
}

fn worker(sh: &'static Shared, index: usize) {
    ON_WORKER.with(|w| w.set(true));
    let mut seen = 0u64;
    // The first worker also takes the pairs posted to it.
    let pairs = index == 0;
    let mut pair_seen = 0u64;
    loop {
        // Wait for a new generation: spin, then sleep.
        let mut start = Instant::now();
        while sh.generation.load(Ordering::Acquire) == seen {
            if pairs {
                let state = sh.post.state.load(Ordering::Acquire);
                if state >> 2 != pair_seen {
                    pair_seen = state >> 2;
                    run_posted_pair(sh, state);
                    start = Instant::now();
                    continue;
                }
            }
            if start.elapsed() < SPIN {
                std::hint::spin_loop();
                continue;
            }
            let guard = sh.slot.lock().unwrap_or_else(|e| e.into_inner());
            // Counted under the lock, which `run` holds while it bumps the generation: either it
            // sees this sleeper and wakes it, or this worker sees the new generation here. A
            // pair is posted without the lock, but its post and this count are both SeqCst and
            // each side checks the other's after its own: one of them sees the other.
            sh.sleepers.fetch_add(1, Ordering::SeqCst);
            let pair_waits = !pairs || sh.post.state.load(Ordering::SeqCst) >> 2 == pair_seen;
            if sh.generation.load(Ordering::SeqCst) == seen && pair_waits {
                let _ = sh.wake.wait_timeout(guard, Duration::from_millis(50));
            }
            sh.sleepers.fetch_sub(1, Ordering::SeqCst);
        }
        seen = sh.generation.load(Ordering::Acquire);
        // Join under the lock, so `run` knows every participant before it clears the slot.
        let job = {
            let slot = sh.slot.lock().unwrap_or_else(|e| e.into_inner());
            match slot.as_ref() {
                Some(j) if index < j.helpers => {
                    j.active.fetch_add(1, Ordering::AcqRel);
                    Some(Arc::clone(j))
                }
                _ => None,
            }
        };
        if let Some(j) = job {
            work(&j);
            j.active.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Pool {
    fn new(workers: usize) -> Self {
        let shared: &'static Shared = Box::leak(Box::new(Shared {
            post: PairPost { state: AtomicU64::new(0), f: UnsafeCell::new(None) },
            done: PairDone { seq: AtomicU64::new(0), end: AtomicU64::new(0), panicked: AtomicBool::new(false) },
            slot: Mutex::new(None),
            generation: AtomicU64::new(0),
            sleepers: AtomicUsize::new(0),
            wake: Condvar::new(),
        }));
        for i in 0..workers {
            std::thread::Builder::new()
                .name(format!("k3-worker-{i}"))
                .spawn(move || worker(shared, i))
                .expect("spawning an engine worker thread");
        }
        Self { shared, workers, submit: Mutex::new(()) }
    }

    /// The process-wide pool (one worker per core beyond the caller's).
    pub fn global() -> &'static Pool {
        static POOL: OnceLock<Pool> = OnceLock::new();
        POOL.get_or_init(|| {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            Pool::new(cores.clamp(1, 64) - 1)
        })
    }

    /// Run `f(0..n)` on the caller plus up to `threads − 1` workers; returns when all are done.
    pub fn run(&self, threads: usize, n: usize, f: &(dyn Fn(usize) + Sync)) {
        let helpers = threads.saturating_sub(1).min(self.workers).min(n.saturating_sub(1));
        if helpers == 0 {
            (0..n).for_each(f);
            return;
        }
        if n == 2 && lean_pairs() {
            // Two tasks on two threads (a decode step's KDA heads, attention shares): the lean
            // hand-off of `run_pair`, without its balance.
            self.run_two(f);
            return;
        }
        let _one_job = self.submit.lock().unwrap_or_else(|e| e.into_inner());
        let sh = self.shared;
        // SAFETY: workers call `f` only through this job, which they join under the slot lock
        // and leave (`active`) before this function returns; the slot is cleared first.
        let f_static: &'static Task = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync + '_), &'static Task>(f) };
        let job = Arc::new(Job {
            f: f_static,
            n,
            helpers,
            next: AtomicUsize::new(0),
            remaining: AtomicUsize::new(n),
            active: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
        });
        // Publish under the lock, wake after it: a spinning worker that sees the new generation
        // then finds the lock free instead of sleeping on it behind the wake-up syscall.
        let sleepers = {
            let mut slot = sh.slot.lock().unwrap_or_else(|e| e.into_inner());
            *slot = Some(Arc::clone(&job));
            sh.generation.fetch_add(1, Ordering::SeqCst);
            sh.sleepers.load(Ordering::SeqCst)
        };
        if sleepers > 0 {
            sh.wake.notify_all();
        }
        sharing(|| work(&job));
        while job.remaining.load(Ordering::Acquire) > 0 {
            std::hint::spin_loop();
        }
        *sh.slot.lock().unwrap_or_else(|e| e.into_inner()) = None;
        while job.active.load(Ordering::Acquire) > 0 {
            std::hint::spin_loop();
        }
        if job.panicked.load(Ordering::Acquire) {
            panic!("an engine worker task panicked");
        }
    }
}

/// Whether jobs of two tasks on two threads take the lean hand-off ([`PairPost`]);
/// `K3MINI_LEAN_PAIR=0` sends them through the job slot like any job.
static LEAN_PAIR: Switch = Switch::new("K3MINI_LEAN_PAIR", "0");

/// Whether [`Pool::run_pair`] and two-task [`Pool::run`]s post to the first worker directly.
pub fn lean_pairs() -> bool {
    LEAN_PAIR.on()
}

/// Set [`lean_pairs`] for the rest of the process (in-process A/B measurements).
pub fn set_lean_pairs(on: bool) {
    LEAN_PAIR.set(on);
}

impl Pool {
    /// `f(0)` on the caller and `f(1)` on the first worker, handed over by [`PairPost`]; the
    /// caller runs `f(1)` too when the worker has not taken it by the time `f(0)` is done.
    /// Returns when each side finished, in ns after [`epoch`]: the caller's `f(0)`, and the
    /// worker's `f(1)` if the worker ran it.
    fn run_two(&self, f: &(dyn Fn(usize) + Sync)) -> (u64, Option<u64>) {
        let _one_job = self.submit.lock().unwrap_or_else(|e| e.into_inner());
        let sh = self.shared;
        // SAFETY: the worker calls `f` only for this pair, after claiming it, and this function
        // returns only once that call is over (`done`) or the claim went to the caller.
        let f_static: &'static Task = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync + '_), &'static Task>(f) };
        let seq = (sh.post.state.load(Ordering::Relaxed) >> 2) + 1;
        // SAFETY: no pair is in flight (the last one ended before its caller returned) and only
        // the holder of `submit` writes here.
        unsafe { *sh.post.f.get() = Some(f_static) };
        sh.post.state.store(seq << 2 | OPEN, Ordering::SeqCst);
        if sh.sleepers.load(Ordering::SeqCst) > 0 {
            // Under the lock: a worker that counted itself asleep is then waiting on `wake`.
            let _slot = sh.slot.lock().unwrap_or_else(|e| e.into_inner());
            sh.wake.notify_all();
        }
        let mut panicked = sharing(|| std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(0))).is_err());
        let mine = epoch().elapsed().as_nanos() as u64;
        // Take task 1 back only if the worker has neither finished nor claimed it; look first,
        // so that the usual case reads the worker's lines instead of pulling the post back.
        let open = seq << 2 | OPEN;
        let back = sh.done.seq.load(Ordering::Acquire) != seq
            && sh.post.state.load(Ordering::Acquire) == open
            && sh.post.state.compare_exchange(open, seq << 2 | BY_CALLER, Ordering::AcqRel, Ordering::Acquire).is_ok();
        let theirs = if back {
            panicked |= std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(1))).is_err();
            None
        } else {
            while sh.done.seq.load(Ordering::Acquire) != seq {
                std::hint::spin_loop();
            }
            panicked |= sh.done.panicked.swap(false, Ordering::AcqRel);
            Some(sh.done.end.load(Ordering::Relaxed))
        };
        if panicked {
            panic!("an engine worker task panicked");
        }
        (mine, theirs)
    }

    /// Wait until `threads` threads of the pool (the caller and `threads − 1` workers) run at
    /// once: repeated meetings, each task arriving and spinning until all have, until one
    /// completes within 100 µs (all on cores together), or `limit` has passed. Returns whether
    /// they met in time. After a sleep (a benchmark's probe in another process, an idle server)
    /// the workers wake on the next job, and the scheduler may first queue a woken worker
    /// behind the caller on its core: a timed region that starts after this does not pay that.
    pub fn rendezvous(&self, threads: usize, limit: Duration) -> bool {
        let n = threads.clamp(1, self.workers + 1);
        if n == 1 {
            return true;
        }
        let start = Instant::now();
        while start.elapsed() < limit {
            let arrived = AtomicUsize::new(0);
            let t0 = Instant::now();
            self.run(n, n, &|_| {
                arrived.fetch_add(1, Ordering::AcqRel);
                while arrived.load(Ordering::Acquire) < n && start.elapsed() < limit {
                    std::hint::spin_loop();
                }
            });
            if t0.elapsed() < Duration::from_micros(100) {
                return true;
            }
        }
        false
    }
}

/// The caller's share of the work of a two-task job ([`Pool::run_pair`]), learned from when each
/// side finished. With equal halves the two cores of a decode step did not finish together: on
/// the Zen 4 host the worker's side ran slower, by an amount that drifted from minute to minute
/// (the learned share moved between 0.49 and 0.57), and the caller waited for it at the end of
/// each of ~110 jobs a token. Each finished pair moves the share a step towards the split at
/// which both sides would have ended together at the speeds just seen.
pub struct PairBalance {
    /// The caller's share, as f32 bits.
    share: AtomicU32,
}

/// The one balance every two-thread decode job shared before each packed matrix had its own
/// (`Packed::pair`, [`pair_balance`]); `K3MINI_PAIR_BALANCE=global` brings it back.
pub static DECODE_PAIR: PairBalance = PairBalance::new();

impl PairBalance {
    /// Most a share may move from a half: the learned split is a correction, not a hand-over.
    const LIMIT: f32 = 0.2;
    /// Weight of each new pair (one decode token runs ~110).
    const STEP: f32 = 0.05;

    pub const fn new() -> Self {
        Self { share: AtomicU32::new(0x3f00_0000) } // 0.5
    }

    /// The caller's share of the next pair's work, within 0.5 ± 0.2; 0.5 when
    /// `K3MINI_PAIR_BALANCE=0` (for measuring what the balance is worth).
    pub fn share(&self) -> f32 {
        static ON: Switch = Switch::new("K3MINI_PAIR_BALANCE", "0");
        if ON.on() {
            self.learned()
        } else {
            0.5
        }
    }

    /// The share as learned, whatever the environment says.
    fn learned(&self) -> f32 {
        f32::from_bits(self.share.load(Ordering::Relaxed))
    }

    /// Take in one pair run with the caller's side at `share` of the work: that side finished
    /// `caller` after the job was published, the worker's side `worker` after.
    pub fn observe(&self, share: f32, caller: Duration, worker: Duration) {
        let (tc, tw) = (caller.as_secs_f32(), worker.as_secs_f32());
        if !(tc > 0.0 && tw > 0.0 && share > 0.0 && share < 1.0) {
            return;
        }
        // Speeds in work per second, and the split at which both sides would have ended together.
        let (vc, vw) = (share / tc, (1.0 - share) / tw);
        let target = vc / (vc + vw);
        let old = self.learned();
        let new = (old + Self::STEP * (target - old)).clamp(0.5 - Self::LIMIT, 0.5 + Self::LIMIT);
        self.share.store(new.to_bits(), Ordering::Relaxed);
    }
}

impl Default for PairBalance {
    fn default() -> Self {
        Self::new()
    }
}

impl Clone for PairBalance {
    fn clone(&self) -> Self {
        Self { share: AtomicU32::new(self.share.load(Ordering::Relaxed)) }
    }
}

impl std::fmt::Debug for PairBalance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PairBalance({:.3})", self.learned())
    }
}

/// Whether each decode job site learns its own split ([`pair_balance`]).
static SITE_BALANCE: Switch = Switch::new("K3MINI_PAIR_BALANCE", "global");

/// Whether two-thread decode jobs take the balance of their own site (the first matrix of the
/// job, `Packed::pair`) rather than the one [`DECODE_PAIR`] all of them shared until
/// 2026-12-06; `K3MINI_PAIR_BALANCE=global` shares it again. The jobs of a decode token differ
/// (three 1024-row products, an FFN band with its GLU and quantizer, the Q8_0 head), and so do
/// the splits that end their two sides together: one share for all of them left the worker
/// finishing first by 0.25–1.5 µs in most of a token's ~97 pairs (Emerald Rapids class host,
/// 370M Q4_0). Per site, decode in one process ran 1.004–1.008× as fast (`examples/decode_ab`
/// variants 110 / 111, 40–60 rounds).
pub fn site_balance() -> bool {
    SITE_BALANCE.on()
}

/// Set [`site_balance`] for the rest of the process (in-process A/B measurements).
pub fn set_site_balance(on: bool) {
    SITE_BALANCE.set(on);
}

/// The balance a two-thread decode job at `site` learns from and splits by: `site` itself, or
/// [`DECODE_PAIR`] when [`site_balance`] is off.
pub fn pair_balance(site: &PairBalance) -> &PairBalance {
    if site_balance() {
        site
    } else {
        &DECODE_PAIR
    }
}

impl Pool {
    /// Run tasks 0 and 1 of `f`, task 0 meant for the caller and task 1 for a worker, where task
    /// 0 holds `share` of the work, and teach `bal` how the two sides' speeds compare. The caller
    /// takes the first task of every job it publishes (it calls `work` at once, while a worker
    /// first has to see the job). A pair in which a worker ran task 0, or the caller both (no
    /// worker, or one that came late), teaches nothing.
    pub fn run_pair(&self, bal: &PairBalance, share: f32, f: &(dyn Fn(usize) + Sync)) {
        if self.workers > 0 && lean_pairs() {
            let t0 = epoch().elapsed().as_nanos() as u64;
            if let (mine, Some(theirs)) = self.run_two(f) {
                let since = |t: u64| Duration::from_nanos(t.saturating_sub(t0));
                bal.observe(share, since(mine), since(theirs));
            }
            return;
        }
        let t0 = Instant::now();
        let ends = [AtomicU64::new(0), AtomicU64::new(0)];
        let by_worker = [AtomicBool::new(false), AtomicBool::new(false)];
        self.run(2, 2, &|i| {
            f(i);
            ends[i].store(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            by_worker[i].store(ON_WORKER.with(|w| w.get()), Ordering::Relaxed);
        });
        if !by_worker[0].load(Ordering::Relaxed) && by_worker[1].load(Ordering::Relaxed) {
            let end = |i: usize| Duration::from_nanos(ends[i].load(Ordering::Relaxed));
            bal.observe(share, end(0), end(1));
        }
    }
}

/// Split `0..n` into `threads` contiguous ranges, run `f(lo, hi)` on each on the global pool and
/// return `(lo, hi, result)` in order.
pub fn par_chunks<T: Send>(n: usize, threads: usize, f: impl Fn(usize, usize) -> T + Sync) -> Vec<(usize, usize, T)> {
    let threads = threads.clamp(1, n.max(1));
    if threads == 1 {
        return vec![(0, n, f(0, n))];
    }
    let per = n.div_ceil(threads);
    let ranges: Vec<(usize, usize)> =
        (0..threads).map(|i| (i * per, ((i + 1) * per).min(n))).filter(|(a, b)| a < b).collect();
    let slots: Vec<Mutex<Option<T>>> = ranges.iter().map(|_| Mutex::new(None)).collect();
    Pool::global().run(threads, ranges.len(), &|i| {
        let (lo, hi) = ranges[i];
        let v = f(lo, hi);
        *slots[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(v);
    });
    ranges
        .into_iter()
        .zip(slots)
        .map(|((lo, hi), s)| {
            let v = s.into_inner().unwrap_or_else(|e| e.into_inner()).expect("every task ran");
            (lo, hi, v)
        })
        .collect()
}

/// Fewest elements for which [`par_rows`] splits the work (below it the pool hand-off costs more
/// than the loop).
pub const PAR_ROWS_MIN: usize = 1 << 15;

/// Split `buf` ([rows, width]) into contiguous row blocks and run `f(first_row, block)` on each,
/// over `threads` pool threads; one block when the buffer is small or `threads` is 1. For the
/// engine's row-wise elementwise work (norms, gates, activations) during prefill.
pub fn par_rows(buf: &mut [f32], width: usize, threads: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    let rows = buf.len().checked_div(width).unwrap_or(0);
    if threads <= 1 || buf.len() < PAR_ROWS_MIN || rows < 2 {
        f(0, buf);
        return;
    }
    let per = rows.div_ceil(threads * 2);
    let tasks = rows.div_ceil(per);
    let base = SendPtr(buf.as_mut_ptr());
    Pool::global().run(threads, tasks, &|i| {
        let (lo, hi) = (i * per, ((i + 1) * per).min(rows));
        // SAFETY: task i alone gets rows lo..hi, which lie inside `buf`, borrowed for this call.
        let block = unsafe { std::slice::from_raw_parts_mut(base.get().add(lo * width), (hi - lo) * width) };
        f(lo, block);
    });
}

/// A raw pointer shared with the tasks of one `Pool::run`, each of which writes only its own,
/// disjoint elements (row blocks, output columns).
pub struct SendPtr<T>(pub *mut T);
// By hand: a derive would ask T itself to be Copy.
impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}
impl<T> SendPtr<T> {
    pub fn get(self) -> *mut T {
        self.0
    }
}
// SAFETY: users dereference it only for disjoint elements inside one `Pool::run`.
unsafe impl<T: Send> Send for SendPtr<T> {}
unsafe impl<T: Send> Sync for SendPtr<T> {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tasks_know_whether_their_job_is_shared() {
        let pool = Pool::new(1);
        for (threads, shared) in [(1, false), (2, true)] {
            let seen: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(9)).collect();
            pool.run(threads, 3, &|i| seen[i].store(usize::from(in_shared_job()), Ordering::Relaxed));
            let seen: Vec<usize> = seen.iter().map(|s| s.load(Ordering::Relaxed)).collect();
            assert_eq!(seen, vec![usize::from(shared); 3], "{threads} thread(s)");
            assert!(!in_shared_job(), "the caller after a job of {threads} thread(s)");
        }
    }

    #[test]
    fn pool_runs_every_task_once_from_many_callers() {
        let handles: Vec<_> = (0..4)
            .map(|k| {
                std::thread::spawn(move || {
                    for rep in 0..50 {
                        let n = 7 + (k + rep) % 5;
                        let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                        Pool::global().run(3, n, &|i| {
                            hits[i].fetch_add(1, Ordering::Relaxed);
                        });
                        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().expect("caller thread");
        }
        let parts = par_chunks(10, 3, |lo, hi| (lo..hi).sum::<usize>());
        assert_eq!(parts.iter().map(|p| p.2).sum::<usize>(), 45);
        // par_rows: every row visited once, with its own index, at 1 and 3 threads.
        for threads in [1, 3] {
            let (rows, width) = (300, 128);
            let mut buf = vec![0f32; rows * width];
            par_rows(&mut buf, width, threads, |r0, block| {
                for (i, row) in block.chunks_exact_mut(width).enumerate() {
                    row.iter_mut().for_each(|v| *v += (r0 + i) as f32);
                }
            });
            assert!(buf.chunks_exact(width).enumerate().all(|(r, row)| row.iter().all(|&v| v == r as f32)));
        }
    }

    #[test]
    fn pair_balance_moves_to_the_split_that_ends_both_sides_together() {
        // The worker's side runs at 3/4 of the caller's speed: both end together when the caller
        // takes 4/7 of the work.
        let bal = PairBalance::new();
        for _ in 0..400 {
            let s = bal.learned();
            let (tc, tw) = (s / 1.0, (1.0 - s) / 0.75);
            bal.observe(s, Duration::from_secs_f32(tc * 1e-4), Duration::from_secs_f32(tw * 1e-4));
        }
        assert!((bal.learned() - 4.0 / 7.0).abs() < 1e-3, "{}", bal.learned());
        // A very slow worker: the share stops at its limit.
        for _ in 0..400 {
            let s = bal.learned();
            bal.observe(s, Duration::from_secs_f32(s * 1e-4), Duration::from_secs_f32((1.0 - s) * 1e-3));
        }
        assert!((bal.learned() - 0.7).abs() < 1e-6, "{}", bal.learned());
        // Nonsense observations change nothing.
        bal.observe(0.5, Duration::ZERO, Duration::from_micros(3));
        bal.observe(1.5, Duration::from_micros(3), Duration::from_micros(3));
        assert!((bal.learned() - 0.7).abs() < 1e-6);
    }

    #[test]
    fn each_site_learns_its_own_split_and_the_switch_shares_one() {
        // Two jobs whose worker sides run at different speeds learn different splits.
        let (fast, slow) = (PairBalance::new(), PairBalance::new());
        for _ in 0..400 {
            for (bal, speed) in [(&fast, 1.0f32), (&slow, 0.5)] {
                let s = bal.learned();
                bal.observe(s, Duration::from_secs_f32(s * 1e-4), Duration::from_secs_f32((1.0 - s) / speed * 1e-4));
            }
        }
        assert!((fast.learned() - 0.5).abs() < 1e-3 && (slow.learned() - 2.0 / 3.0).abs() < 1e-3);
        // A copy (a packed matrix cloned) starts from what was learned.
        assert_eq!(slow.clone().learned(), slow.learned());
        // Off, every site takes the one shared balance.
        let was = site_balance();
        set_site_balance(false);
        assert!(std::ptr::eq(pair_balance(&slow), &DECODE_PAIR));
        set_site_balance(true);
        assert!(std::ptr::eq(pair_balance(&slow), &slow));
        set_site_balance(was);
    }

    #[test]
    fn run_pair_runs_both_tasks_once_and_learns_from_a_slow_side() {
        let bal = PairBalance::new();
        let mut taught = 0;
        for _ in 0..100 {
            let hits = [AtomicUsize::new(0), AtomicUsize::new(0)];
            let on_worker = [AtomicBool::new(false), AtomicBool::new(false)];
            Pool::global().run_pair(&bal, 0.5, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
                on_worker[i].store(ON_WORKER.with(|w| w.get()), Ordering::Relaxed);
                // The worker's side (task 1) is made the slow one.
                std::thread::sleep(Duration::from_micros(if i == 1 { 400 } else { 100 }));
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            taught += usize::from(!on_worker[0].load(Ordering::Relaxed) && on_worker[1].load(Ordering::Relaxed));
        }
        // Pairs run as meant teach the balance that the worker's side is slow (it took 4x as long
        // for the same share: the split that evens them is 0.8, held to 0.7). With one core the
        // caller runs both tasks and nothing is learned.
        if taught >= 20 {
            assert!(bal.learned() > 0.55, "{} after {taught} pairs", bal.learned());
        } else {
            assert!(Pool::global().workers == 0 || taught > 0, "no pair ran as meant");
        }
    }

    /// Pairs through the lean hand-off, from several callers, between ordinary jobs, after the
    /// worker has gone to sleep, and with a task that panics: each task runs once, a panic
    /// reaches the caller, and the pool works on.
    #[test]
    fn lean_pairs_run_each_task_once_and_survive_a_panic() {
        let bal = PairBalance::new();
        let handles: Vec<_> = (0..3)
            .map(|k| {
                std::thread::spawn(move || {
                    let bal = PairBalance::new();
                    for rep in 0..300 {
                        let hits = [AtomicUsize::new(0), AtomicUsize::new(0)];
                        Pool::global().run_pair(&bal, 0.5, &|i| {
                            hits[i].fetch_add(1, Ordering::Relaxed);
                        });
                        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "caller {k}, pair {rep}");
                        if rep % 50 == 0 {
                            // Past the spin: the worker sleeps before the next pair.
                            std::thread::sleep(SPIN * 3);
                        }
                        let n = AtomicUsize::new(0);
                        Pool::global().run(2, 5, &|_| {
                            n.fetch_add(1, Ordering::Relaxed);
                        });
                        assert_eq!(n.load(Ordering::Relaxed), 5);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().expect("caller thread");
        }
        for bad in [0, 1] {
            let r = std::panic::catch_unwind(|| {
                Pool::global().run_pair(&bal, 0.5, &|i| {
                    if i == bad {
                        panic!("task {i} fails on purpose");
                    }
                });
            });
            assert!(r.is_err(), "a panic in task {bad} reaches the caller");
        }
        let hits = [AtomicUsize::new(0), AtomicUsize::new(0)];
        Pool::global().run_pair(&bal, 0.5, &|i| {
            hits[i].fetch_add(1, Ordering::Relaxed);
        });
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "the pool works after a panic");
    }

    #[test]
    fn rendezvous_returns_within_its_limit_and_leaves_the_pool_working() {
        let pool = Pool::global();
        assert!(pool.rendezvous(1, Duration::ZERO), "one thread meets itself");
        // Whether the threads meet depends on the machine's load (tests run beside this one),
        // but the wait is bounded by its limit, and a job right after runs every task once.
        for threads in [2, pool.workers + 1, pool.workers + 8] {
            let t0 = Instant::now();
            let met = pool.rendezvous(threads, Duration::from_millis(50));
            let took = t0.elapsed();
            assert!(took < Duration::from_millis(50 + 500), "{threads} threads: waited {took:?} (met: {met})");
            let hits: Vec<AtomicUsize> = (0..16).map(|_| AtomicUsize::new(0)).collect();
            pool.run(threads, 16, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "{threads} threads: a task not run once");
        }
    }
}
