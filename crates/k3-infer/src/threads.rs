//! Coarse parallelism over disjoint ranges with scoped threads (the speed issue replaces this
//! with a persistent pool).

/// Split `0..n` into `threads` contiguous ranges, run `f(lo, hi)` on each (the first on the
/// calling thread) and return `(lo, hi, result)` in order.
pub fn par_chunks<T: Send>(n: usize, threads: usize, f: impl Fn(usize, usize) -> T + Sync) -> Vec<(usize, usize, T)> {
    let threads = threads.clamp(1, n.max(1));
    if threads == 1 {
        return vec![(0, n, f(0, n))];
    }
    let per = n.div_ceil(threads);
    let ranges: Vec<(usize, usize)> =
        (0..threads).map(|i| (i * per, ((i + 1) * per).min(n))).filter(|(a, b)| a < b).collect();
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = ranges[1..].iter().map(|&(lo, hi)| s.spawn(move || (lo, hi, f(lo, hi)))).collect();
        let mut out = vec![(ranges[0].0, ranges[0].1, f(ranges[0].0, ranges[0].1))];
        for h in handles {
            // A worker only panics if `f` does; propagate it unchanged.
            out.push(h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)));
        }
        out
    })
}
