//! Transparent huge pages for the engine's large buffers. A decode streams every weight once a
//! token; with 4 KiB pages that is a TLB miss every 4 KiB and a hardware prefetcher that stops
//! at each page. On a host whose THP setting is `madvise` (nothing gets huge pages unless asked),
//! a 512 MiB read ran at 22.5–24 GB/s on 4 KiB pages and 30–35 GB/s on 2 MiB pages (2 threads),
//! and the 370M model decoded ~17% faster with its weights on huge pages.
//!
//! The repacked weights are carved from 2 MiB-aligned chunks (`k3_kernels::hugebuf`).
//! [`collapse_anonymous`] asks the kernel to back every large anonymous mapping of the process
//! (the chunks, and the heap with what a load keeps there: f32 and f16 matrices, matrices made at
//! load from others, and the larger buffers mapped on their own) by huge pages now
//! (`MADV_COLLAPSE`, Linux 6.1+) and from then on (`MADV_HUGEPAGE`, so that the heap's later
//! growth faults them in directly). [`advise`] does it for one buffer. Both are hints: on other
//! systems, with THP disabled or when the kernel refuses, nothing changes and they return 0.
//!
//! When ([`Timing`], `K3MINI_HUGEPAGES`): by default a model's load returns with its weights on
//! 4 KiB pages and [`promote_after_load`] collapses them on a thread of its own, so a load does
//! not wait for fresh huge pages, which on a VM with free page reporting the host must back again
//! first (`hugebuf`); [`wait_promoted`] waits for it (the benchmark does, before it measures).
//! `K3MINI_HUGEPAGES=load` puts the chunks on huge pages from their first write and collapses
//! the rest before the load returns; `K3MINI_HUGEPAGES=0` turns huge pages off (to measure
//! without).

#[cfg(target_os = "linux")]
use k3_kernels::hugebuf::sys;
pub use k3_kernels::hugebuf::{enabled, timing, Timing, HUGE};

use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Promotions running on threads of their own, each its start and thread.
static PROMOTIONS: Mutex<Vec<(Instant, JoinHandle<()>)>> = Mutex::new(Vec::new());

/// After a load: this process's large anonymous memory onto huge pages ([`collapse_anonymous`]),
/// as [`timing`] says: on a thread of its own (the default; [`wait_promoted`] waits for it), before
/// returning (`K3MINI_HUGEPAGES=load`), or not at all (`0`).
pub fn promote_after_load() {
    match timing() {
        Timing::Off => {}
        Timing::AtLoad => {
            collapse_anonymous();
        }
        Timing::After => {
            let start = Instant::now();
            // One thread, at the lowest priority: the cores a prefill or decode that starts
            // meanwhile needs stay theirs.
            let spawned = std::thread::Builder::new().name("k3-hugepages".into()).spawn(|| {
                #[cfg(target_os = "linux")]
                sys::nice_this_thread(19);
                collapse_anonymous_on(1);
            });
            match spawned {
                Ok(h) => PROMOTIONS.lock().unwrap_or_else(|e| e.into_inner()).push((start, h)),
                // No thread to spare: collapse here rather than not at all.
                Err(_) => {
                    collapse_anonymous();
                }
            }
        }
    }
}

/// Wait for every promotion still running ([`promote_after_load`]); how long after its start the
/// last one waited for finished (zero when none was running).
pub fn wait_promoted() -> Duration {
    let running: Vec<_> = std::mem::take(&mut *PROMOTIONS.lock().unwrap_or_else(|e| e.into_inner()));
    running
        .into_iter()
        .map(|(start, h)| {
            // A promotion only advises; a panic in one (none is expected) loses nothing.
            let _ = h.join();
            start.elapsed()
        })
        .max()
        .unwrap_or_default()
}

/// The whole huge pages inside [start, start + len).
fn inner(start: usize, len: usize) -> Option<(usize, usize)> {
    let lo = start.checked_next_multiple_of(HUGE)?;
    let hi = start.checked_add(len)? / HUGE * HUGE;
    hi.checked_sub(lo).filter(|&n| n > 0).map(|n| (lo, n))
}

/// Ask for huge pages on the whole 2 MiB pages of [ptr, ptr + len): from now on, and with
/// `collapse` also for the pages already there (as far as the kernel finds free huge pages; what
/// it could not collapse, its background thread may later). Returns the bytes the kernel took
/// the advice for (0 where it refused, or where the range holds no whole huge page);
/// [`huge_bytes`] tells what the process has on huge pages.
pub fn advise(ptr: *const u8, len: usize, collapse: bool) -> usize {
    let Some((lo, n)) = inner(ptr as usize, len) else { return 0 };
    if !enabled() {
        return 0;
    }
    #[cfg(target_os = "linux")]
    {
        let p = lo as *mut std::ffi::c_void;
        // SAFETY: madvise with these advices changes how the range is backed, never its contents;
        // the caller's range is mapped (it is a live buffer), and so is its inner part.
        if unsafe { sys::madvise(p, n, sys::MADV_HUGEPAGE) } != 0 {
            return 0;
        }
        if collapse {
            // SAFETY: as above. A refusal (no free huge pages, an older kernel) leaves the range
            // as it was; the advice above still holds for its later faults.
            unsafe { sys::madvise(p, n, sys::MADV_COLLAPSE) };
        }
        return n;
    }
    #[allow(unreachable_code)]
    {
        let _ = (lo, n, collapse);
        0
    }
}

/// The words 0..n in a buffer advised onto huge pages before it is filled (a bandwidth probe's
/// buffer, read as the engine's weights are).
pub fn counting_words(n: usize) -> Vec<u64> {
    let mut buf: Vec<u64> = Vec::with_capacity(n);
    advise(buf.as_ptr() as *const u8, 8 * n, false);
    buf.extend(0..n as u64);
    buf
}

/// Bytes of this process's anonymous memory on huge pages (`AnonHugePages` of
/// `/proc/self/smaps_rollup`), where the system reports it.
pub fn huge_bytes() -> Option<usize> {
    let s = std::fs::read_to_string("/proc/self/smaps_rollup").ok()?;
    let line = s.lines().find(|l| l.starts_with("AnonHugePages:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<usize>().ok()? * 1024)
}

/// [`advise`] (with collapse) for every private, writable, anonymous mapping of this process of
/// at least one whole huge page: the heap and the buffers mapped on their own. Returns the bytes
/// advised. Reads `/proc/self/maps`; 0 where there is none.
///
/// The collapse copies every 2 MiB of 4 KiB pages into a fresh huge page: for the 370M Q4_0 on
/// the Zen 4 host (~180 MiB collapsed) 61–427 ms in one call (median ~105 over ten loads, half
/// of them past 120), against 61–78 ms (median ~71) with the bytes collapsed in runs of
/// [`COLLAPSE_RUN`] by one scoped thread a core, as now (loads alternating, 2 cores). The
/// fastest loads are alike both ways: what two threads remove is the slow tail.
pub fn collapse_anonymous() -> usize {
    collapse_anonymous_on(std::thread::available_parallelism().map_or(1, |c| c.get()))
}

/// [`collapse_anonymous`] on at most `threads` threads (this one among them).
fn collapse_anonymous_on(threads: usize) -> usize {
    if !enabled() {
        return 0;
    }
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else { return 0 };
    // Advised first (cheap), so that each run below is inside a range the kernel took.
    let runs: Vec<(usize, usize)> = anonymous_ranges(&maps)
        .into_iter()
        .filter_map(|(lo, len)| inner(lo, len).filter(|_| advise(lo as *const u8, len, false) > 0))
        .flat_map(|(lo, n)| (lo..lo + n).step_by(COLLAPSE_RUN).map(move |a| (a, COLLAPSE_RUN.min(lo + n - a))))
        .collect();
    let threads = threads.clamp(1, runs.len().max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let work = || {
        while let Some(&(a, n)) = runs.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) {
            collapse(a, n);
        }
    };
    std::thread::scope(|s| {
        for _ in 1..threads {
            s.spawn(work);
        }
        work();
    });
    runs.iter().map(|r| r.1).sum()
}

/// Bytes one thread collapses at a time (a whole number of huge pages).
const COLLAPSE_RUN: usize = 16 * HUGE;

/// `MADV_COLLAPSE` on [a, a + n), whole huge pages of a range already advised.
fn collapse(a: usize, n: usize) {
    #[cfg(target_os = "linux")]
    // SAFETY: as in `advise`: the range lies inside a live anonymous mapping, and a collapse
    // changes how it is backed, never its contents; a refusal leaves it as it was.
    unsafe {
        sys::madvise(a as *mut std::ffi::c_void, n, sys::MADV_COLLAPSE);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (a, n);
}

/// `/proc/self/maps` lines of private writable mappings with no file (or the heap): (start, len).
fn anonymous_ranges(maps: &str) -> Vec<(usize, usize)> {
    maps.lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let (range, perms, _off, _dev, inode) = (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?);
            let name = f.next();
            let anonymous = inode == "0" && (name.is_none() || name == Some("[heap]"));
            if !(anonymous && perms.starts_with("rw") && perms.ends_with('p')) {
                return None;
            }
            let (a, b) = range.split_once('-')?;
            let (a, b) = (usize::from_str_radix(a, 16).ok()?, usize::from_str_radix(b, 16).ok()?);
            (b > a && inner(a, b - a).is_some()).then_some((a, b - a))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_whole_huge_pages_of_private_anonymous_mappings() {
        let maps = "\
00400000-00600000 r-xp 00000000 08:01 123 /usr/bin/x
01000000-05000000 rw-p 00000000 00:00 0 [heap]
7f0000000000-7f0000100000 rw-p 00000000 00:00 0
7f0000200000-7f0000a00000 rw-p 00000000 00:00 0
7f0001000000-7f0001800000 rw-s 00000000 00:05 77 /dev/shm/x
7f0002000000-7f0002800000 rw-p 00000000 08:01 99 /data/model.gguf
7ffd00000000-7ffd00400000 rw-p 00000000 00:00 0 [stack]
";
        // The heap and the 8 MiB anonymous mapping; not the 1 MiB one (no whole huge page), the
        // shared or file-backed ones, the code or the stack.
        assert_eq!(anonymous_ranges(maps), vec![(0x0100_0000, 0x0400_0000), (0x7f00_0020_0000, 0x80_0000)]);
        assert_eq!(inner(HUGE + 1, 3 * HUGE), Some((2 * HUGE, 2 * HUGE)));
        assert_eq!(inner(1, HUGE), None);
        assert_eq!(inner(HUGE + 1, 10), None); // inside one huge page: none whole
        assert_eq!(inner(usize::MAX - 5, 3), None);
    }

    #[test]
    fn advising_keeps_the_contents() {
        // Whatever the kernel does with the advice (take it, refuse it), the bytes stay.
        let v = counting_words(3 * HUGE / 8);
        advise(v.as_ptr() as *const u8, v.len() * 8, true);
        collapse_anonymous();
        assert!(v.iter().enumerate().all(|(i, &x)| x == i as u64));
    }
}
