//! A persistent pool of worker threads that run one job at a time, split into chunks that the
//! threads claim.
//!
//! A decode step of a small model is a hundred ops of a few microseconds each, so what a
//! hand-off costs matters more than anything else the pool does. Workers spin on the job word
//! for a short while after each job (a new job reaches them within a cache-line transfer), then
//! park until woken, so an idle engine costs no CPU time. The caller claims chunks too, so when
//! a worker is late (descheduled on a busy machine) the caller does its share instead of
//! waiting. Each chunk is a fixed range of output rows, whoever runs it, never part of a
//! reduction, so results do not depend on the thread count or on which thread ran what.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a waiting thread spins before it starts yielding the core to other runnable
/// threads between looks: longer than most gaps between two ops of a forward.
const SPIN: Duration = Duration::from_micros(20);
/// How long a worker keeps looking (spinning, then yielding) before it parks: longer than the
/// gap between two engine steps, short enough that an idle engine soon costs nothing.
const LOOK: Duration = Duration::from_millis(2);
/// Chunks per thread a split makes: a late thread's share can be taken over by the others.
const CHUNKS_PER_THREAD: usize = 4;
/// Most chunks one job may have (the job word's field).
const MAX_CHUNKS: usize = 0xFFFF;

/// The current job, on the caller's stack while the job runs.
struct JobRef<'a> {
    f: &'a (dyn Fn(usize) + Sync),
}

/// The job word: the job's number (upper 32 bits), its chunk count (16 bits) and the next
/// unclaimed chunk (low 16 bits). A thread claims chunk `i` by moving `next` from `i` to
/// `i + 1` under the job number it saw, so it can never claim a chunk of a job that has ended.
fn word(job: u64, chunks: usize, next: usize) -> u64 {
    (job << 32) | ((chunks as u64) << 16) | next as u64
}
fn job_of(w: u64) -> u64 {
    w >> 32
}
fn chunks_of(w: u64) -> usize {
    ((w >> 16) & 0xFFFF) as usize
}
fn next_of(w: u64) -> usize {
    (w & 0xFFFF) as usize
}

struct Shared {
    word: AtomicU64,
    /// The current job; read only by a thread that has claimed one of its chunks, which keeps
    /// the job (and this pointer) alive until that chunk is done.
    job: AtomicPtr<JobRef<'static>>,
    /// Chunks of the current job finished.
    done: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    /// Parked workers wait here; `sleeping` says whether a publisher must notify.
    sleeping: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

/// A pool of `threads - 1` workers plus the calling thread.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    threads: usize,
    /// One job at a time, whichever thread calls.
    caller: Mutex<()>,
}

impl ThreadPool {
    /// A pool that runs each job on `threads` threads (at least 1; the caller is one of them).
    pub fn new(threads: usize) -> Self {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            word: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleeping: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let workers = (1..threads)
            .map(|i| {
                let s = shared.clone();
                std::thread::Builder::new().name(format!("kestrel-cpu-{i}")).spawn(move || worker(&s)).expect("spawn a CPU worker thread")
            })
            .collect();
        ThreadPool { shared, workers, threads, caller: Mutex::new(()) }
    }

    /// Threads a job runs on.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f(c)` for every chunk `c` in `0..chunks` (at most 65535), each once, on whichever
    /// threads claim them, and returns when all have finished. A panic in any chunk is raised
    /// here after every claimed chunk has stopped.
    pub fn run_chunks(&self, chunks: usize, f: &(dyn Fn(usize) + Sync)) {
        assert!(chunks <= MAX_CHUNKS, "a job of {chunks} chunks");
        if self.threads == 1 || chunks <= 1 {
            (0..chunks).for_each(f);
            return;
        }
        let _one_job = self.caller.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        let job = JobRef { f };
        // SAFETY: the workers dereference the job only while one of its chunks is claimed and
        // unfinished, and this function returns only once every chunk has finished.
        let ptr = unsafe { std::mem::transmute::<*const JobRef<'_>, *mut JobRef<'static>>(&job) };
        s.job.store(ptr, Ordering::Release);
        s.done.store(0, Ordering::Relaxed);
        s.panicked.store(false, Ordering::Relaxed);
        let number = job_of(s.word.load(Ordering::Relaxed)).wrapping_add(1) & 0xFFFF_FFFF;
        s.word.store(word(number, chunks, 0), Ordering::SeqCst);
        if s.sleeping.load(Ordering::SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        // The caller's own claims; a panic is kept until every claimed chunk has stopped.
        let mine = catch_unwind(AssertUnwindSafe(|| while let Some(c) = claim(s, number) {
            let r = catch_unwind(AssertUnwindSafe(|| f(c)));
            s.done.fetch_add(1, Ordering::AcqRel);
            if let Err(p) = r {
                resume_unwind(p);
            }
        }));
        if mine.is_err() {
            // Nobody else may start the chunks left; count them as done.
            while claim(s, number).is_some() {
                s.done.fetch_add(1, Ordering::AcqRel);
            }
        }
        let mut wait = Backoff::new();
        while s.done.load(Ordering::Acquire) != chunks {
            if !wait.spin() {
                std::thread::yield_now();
            }
        }
        if let Err(p) = mine {
            resume_unwind(p);
        }
        if s.panicked.load(Ordering::Relaxed) {
            panic!("a CPU worker thread panicked");
        }
    }

    /// Calls `f(range)` on disjoint ranges that cover `0..n`, each range's bounds a multiple
    /// of `align` (except `n`), several per thread. Work too small to share (`n <= align`, or
    /// a single thread) runs on the caller alone.
    pub fn split(&self, n: usize, align: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        let align = align.max(1);
        let units = n.div_ceil(align);
        let chunks = (self.threads * CHUNKS_PER_THREAD).min(units);
        if self.threads == 1 || chunks <= 1 {
            if n > 0 {
                f(0..n);
            }
            return;
        }
        self.run_chunks(chunks, &|c| {
            let (u0, u1) = (units * c / chunks, units * (c + 1) / chunks);
            let (a, b) = ((u0 * align).min(n), (u1 * align).min(n));
            if a < b {
                f(a..b);
            }
        });
    }

    /// Calls `f(i, row)` for every `row_len`-long row `i` of `data`, the rows split between the
    /// threads where `rows * work_per_row` (any unit: multiply-adds, say) is worth sharing.
    pub fn rows_mut(&self, data: &mut [f32], row_len: usize, work_per_row: usize, f: &(dyn Fn(usize, &mut [f32]) + Sync)) {
        if row_len == 0 {
            return;
        }
        let rows = data.len() / row_len;
        if rows * work_per_row < SHARED_WORK || self.threads == 1 {
            for (i, row) in data.chunks_exact_mut(row_len).enumerate() {
                f(i, row);
            }
            return;
        }
        let out = SharedOut::new(data);
        self.split(rows, 1, &|range| {
            for i in range {
                // SAFETY: the ranges of `split` are disjoint, so no other chunk touches row i.
                f(i, unsafe { out.slice(i * row_len, row_len) });
            }
        });
    }
}

/// Work (in the caller's unit, about a multiply-add) below which an op runs on the caller:
/// a hand-off costs about a microsecond.
pub const SHARED_WORK: usize = 8 * 1024;

/// Claims the next chunk of job `number`, if it has one left.
fn claim(s: &Shared, number: u64) -> Option<usize> {
    let mut w = s.word.load(Ordering::Acquire);
    loop {
        if job_of(w) != number || next_of(w) >= chunks_of(w) {
            return None;
        }
        match s.word.compare_exchange_weak(w, w + 1, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return Some(next_of(w)),
            Err(now) => w = now,
        }
    }
}

/// Spinning for at most [`SPIN`], reading the clock once every 64 spins.
struct Backoff {
    start: Option<Instant>,
    spins: u32,
}

impl Backoff {
    fn new() -> Self {
        Backoff { start: None, spins: 0 }
    }
    /// Spins once; false once the spinning time is over.
    #[inline]
    fn spin(&mut self) -> bool {
        self.spins = self.spins.wrapping_add(1);
        if self.spins % 64 == 0 {
            let start = *self.start.get_or_insert_with(Instant::now);
            if start.elapsed() > SPIN {
                return false;
            }
        }
        std::hint::spin_loop();
        true
    }

    /// Whether the wait has lasted [`LOOK`] (after spinning is over).
    fn looked_long_enough(&mut self) -> bool {
        self.start.get_or_insert_with(Instant::now).elapsed() > LOOK
    }
}

fn worker(s: &Shared) {
    let mut seen = 0u64;
    loop {
        // Wait for a job this worker has not looked at.
        let mut wait = Backoff::new();
        let number = loop {
            let n = job_of(s.word.load(Ordering::Acquire));
            if n != seen || s.shutdown.load(Ordering::Acquire) {
                break n;
            }
            if wait.spin() {
                continue;
            }
            if !wait.looked_long_enough() {
                std::thread::yield_now();
            } else {
                let mut g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
                s.sleeping.fetch_add(1, Ordering::SeqCst);
                while job_of(s.word.load(Ordering::SeqCst)) == seen && !s.shutdown.load(Ordering::SeqCst) {
                    g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                s.sleeping.fetch_sub(1, Ordering::SeqCst);
                wait = Backoff::new();
            }
        };
        if s.shutdown.load(Ordering::Acquire) {
            return;
        }
        seen = number;
        while let Some(c) = claim(s, number) {
            // SAFETY: the claimed chunk is unfinished, so the job is alive and `job` is its.
            let job = unsafe { &*s.job.load(Ordering::Acquire) };
            if catch_unwind(AssertUnwindSafe(|| (job.f)(c))).is_err() {
                s.panicked.store(true, Ordering::Relaxed);
            }
            s.done.fetch_add(1, Ordering::AcqRel);
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _g = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// A raw pointer to an output buffer that the shares of a job write at disjoint elements.
pub(crate) struct SharedOut<T = f32>(*mut T);

impl<T> Clone for SharedOut<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SharedOut<T> {}

// SAFETY: each share writes only elements no other share touches (the callers' row ranges are
// disjoint), and the job ends before the buffer is read.
unsafe impl<T: Send> Send for SharedOut<T> {}
unsafe impl<T: Send> Sync for SharedOut<T> {}

impl<T: Copy> SharedOut<T> {
    pub(crate) fn new(out: &mut [T]) -> Self {
        SharedOut(out.as_mut_ptr())
    }
    /// `len` elements from `start`.
    ///
    /// # Safety
    /// The range lies inside the buffer and no other share accesses it during the job.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self, start: usize, len: usize) -> &mut [T] {
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
    /// Writes `v` at `at`.
    ///
    /// # Safety
    /// `at` lies inside the buffer and no other share accesses it during the job.
    #[inline(always)]
    pub(crate) unsafe fn write(&self, at: usize, v: T) {
        unsafe { *self.0.add(at) = v }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_chunk_runs_once_per_job() {
        for threads in [1, 2, 3, 5] {
            let pool = ThreadPool::new(threads);
            for chunks in [0, 1, 2, 7, 64] {
                let hits: Vec<AtomicUsize> = (0..chunks).map(|_| AtomicUsize::new(0)).collect();
                for _ in 0..300 {
                    pool.run_chunks(chunks, &|i| {
                        hits[i].fetch_add(1, Ordering::Relaxed);
                    });
                }
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 300), "{threads} threads, {chunks} chunks");
            }
        }
    }

    #[test]
    fn split_covers_the_range_in_aligned_pieces() {
        let pool = ThreadPool::new(3);
        for (n, align) in [(0, 4), (1, 4), (7, 1), (100, 4), (101, 8), (5, 16)] {
            let seen = Mutex::new(Vec::new());
            pool.split(n, align, &|r| seen.lock().unwrap().push(r));
            let mut ranges = seen.into_inner().unwrap();
            ranges.sort_by_key(|r| r.start);
            let mut next = 0;
            for r in &ranges {
                assert_eq!(r.start, next, "n {n} align {align}: {ranges:?}");
                assert!(r.start % align == 0, "n {n} align {align}: {ranges:?}");
                next = r.end;
            }
            assert_eq!(next, n, "n {n} align {align}: {ranges:?}");
        }
    }

    #[test]
    fn a_panicking_share_is_raised_on_the_caller_and_the_pool_survives() {
        let pool = ThreadPool::new(2);
        let message = |e: Box<dyn std::any::Any + Send>| e.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| e.downcast_ref::<String>().cloned()).unwrap_or_default();
        // Whichever thread claims chunk 3 panics; the caller raises it either way.
        for _ in 0..20 {
            let err = catch_unwind(AssertUnwindSafe(|| pool.run_chunks(8, &|i| assert!(i != 3, "chunk three fails")))).expect_err("the chunk's panic");
            let m = message(err);
            assert!(m.contains("worker thread panicked") || m.contains("chunk three fails"), "{m}");
        }
        let count = AtomicUsize::new(0);
        pool.run_chunks(8, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 8);
    }

    #[test]
    fn parked_workers_wake_for_the_next_job() {
        let pool = ThreadPool::new(2);
        std::thread::sleep(std::time::Duration::from_millis(50));
        let count = AtomicUsize::new(0);
        pool.run_chunks(2, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 2);
    }
}
