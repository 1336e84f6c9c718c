//! What each side of a two-thread decode product prefetches while it idles.
//!
//! A decode token runs ~130 two-task pool jobs (`Pool::run_pair`: the products, split at a
//! learned share). Between two of them the caller works alone (norms, activation quantization,
//! the small steps) and the worker waits; at a job's end one side waits for the other. Memory
//! idles then. Decode runs the same jobs in the same order every token, so each caller thread
//! keeps a trace: per job (keyed by its first matrix), the two sides' parts of the job that came
//! after it last time. Each job hands the worker its part of the next one to prefetch once its
//! task is done, and the caller its own to prefetch while it waits (`Pool::run_pair_then`).
//! Mixture-of-experts layers change their experts from token to token: there a hint can be
//! wrong, which costs a little bandwidth, never a result (a prefetch never faults).

use std::cell::RefCell;
use std::collections::HashMap;

use k3_kernels::qgemm::Packed;

/// A side's part of a pair job: (matrix, rows lo..hi), in the order it runs them.
pub type Part<'a> = [(&'a Packed, usize, usize)];

/// Byte spans `(address, bytes)` to prefetch.
pub type Spans = Vec<(usize, usize)>;

/// One caller thread's trace.
#[derive(Default)]
struct Trace {
    /// The key of the previous pair job (0 before the first).
    prev: usize,
    /// Per key, the caller's and the worker's spans of the pair job that followed it last time.
    next: HashMap<usize, [Spans; 2]>,
}

thread_local! {
    static TRACE: RefCell<Trace> = RefCell::new(Trace::default());
}

/// Bytes of codes a prefetch takes from one stream before the next stream's turn.
const PIECE: usize = 4 << 10;

/// The spans of a part to prefetch, until `budget` bytes of codes: each matrix's rows in the
/// order the one-token kernel walks them (`Packed::decode_spans`: on AVX-512 two runs of row
/// groups side by side), [`PIECE`] bytes of each run's codes in turn, each piece after its rows'
/// scales (and second scales). A prefetch of the first run alone would leave the kernel
/// waiting on the second from its first block.
pub fn part_spans(part: &Part, budget: usize) -> Spans {
    let mut out = Vec::new();
    let mut left = budget;
    for &(p, lo, hi) in part {
        let streams = p.decode_spans(lo, hi);
        let mut off = 0;
        while left > 0 {
            let mut more = false;
            for &[qs, d, m] in &streams {
                if off >= qs.1 || left == 0 {
                    continue;
                }
                let take = PIECE.min(qs.1 - off).min(left);
                // The scales of the rows of codes off..off + take (rows are in the same order).
                let scaled = |s: (usize, usize)| {
                    let (a, b) = (s.1 * off / qs.1, s.1 * (off + take) / qs.1);
                    (s.0 + a, b - a)
                };
                out.extend([scaled(d), scaled(m), (qs.0 + off, take)].into_iter().filter(|s| s.1 > 0));
                left -= take;
                more = true;
            }
            if !more {
                break;
            }
            off += PIECE;
        }
    }
    out
}

/// Record the pair job about to run (keyed by its first matrix `key`, the caller's part
/// `caller` and the worker's `worker`) as the successor of the previous one, and return the
/// spans of the job that followed this one last time, `(caller's, worker's)`, each to
/// `k3_kernels::threads::idle_prefetch_bytes()` of codes; empty the first time or when off.
pub fn next_parts(key: &Packed, caller: &Part, worker: &Part) -> (Spans, Spans) {
    let budget = k3_kernels::threads::idle_prefetch_bytes();
    if budget == 0 {
        return Default::default();
    }
    let key = key.qs.as_ptr() as usize;
    let parts = [part_spans(caller, budget), part_spans(worker, budget)];
    TRACE.with(|t| {
        let t = &mut *t.borrow_mut();
        if t.prev != 0 {
            t.next.insert(t.prev, parts);
        }
        t.prev = key;
        t.next.get(&key).map(|[c, w]| (c.clone(), w.clone())).unwrap_or_default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_kernels::quant::GgmlType;
    use k3_kernels::testing::Rng;

    fn packed(rows: usize, cols: usize, seed: u64) -> Packed {
        let v = Rng::new(seed).normals(rows * cols, 1.0);
        let q = GgmlType::Q4_0.quantize_row(&v);
        Packed::pack(GgmlType::Q4_0, rows, cols, &q).expect("Q4_0 packs")
    }

    /// Byte ranges merged where they touch, in address order.
    fn merged(mut v: Vec<(usize, usize)>) -> Vec<(usize, usize)> {
        v.retain(|s| s.1 > 0);
        v.sort();
        let mut out: Vec<(usize, usize)> = Vec::new();
        for (a, n) in v {
            match out.last_mut() {
                Some(last) if last.0 + last.1 == a => last.1 += n,
                _ => out.push((a, n)),
            }
        }
        out
    }

    /// Spans cover exactly the rows' codes and scales, in the kernel's streams taken in turn,
    /// and stop at the budget.
    #[test]
    fn part_spans_cover_the_rows_in_stream_order_within_the_budget() {
        let p = packed(256, 1024, 1);
        for (lo, hi) in [(0, 256), (64, 256), (0, 16), (48, 208)] {
            let [qs, d, _] = p.row_spans(lo, hi);
            let all = part_spans(&[(&p, lo, hi)], usize::MAX);
            assert_eq!(merged(all.clone()), merged(vec![qs, d]), "rows {lo}..{hi}");
            // Each stream's first piece comes before any stream's second.
            let streams = p.decode_spans(lo, hi);
            let codes: Vec<usize> = all.iter().filter(|s| s.0 >= qs.0 && s.0 < qs.0 + qs.1).map(|s| s.0).collect();
            let firsts: Vec<usize> = streams.iter().map(|s| s[0].0).collect();
            assert_eq!(codes[..firsts.len()], firsts[..], "rows {lo}..{hi}");
            // A budget: that many bytes of codes, and the scales of just those rows.
            for budget in [1000, 4096, 10_000, qs.1 / 2] {
                let some = part_spans(&[(&p, lo, hi)], budget);
                let code_bytes: usize = some.iter().filter(|s| s.0 >= qs.0 && s.0 < qs.0 + qs.1).map(|s| s.1).sum();
                assert_eq!(code_bytes, budget.min(qs.1), "rows {lo}..{hi}, budget {budget}");
                let scale_bytes: usize = some.iter().filter(|s| s.0 >= d.0 && s.0 < d.0 + d.1).map(|s| s.1).sum();
                assert!(
                    scale_bytes.abs_diff(d.1 * code_bytes / qs.1) <= streams.len() * 2 * some.len(),
                    "{scale_bytes}"
                );
            }
        }
        // Two matrices: the budget runs over into the second, then stops.
        let p2 = packed(32, 256, 2);
        let spans = part_spans(&[(&p, 0, 16), (&p2, 0, 32)], p.row_spans(0, 16)[0].1 + 100);
        let q2 = p2.qs.as_ptr() as usize;
        assert_eq!(spans.iter().filter(|s| s.0 >= q2 && s.0 < q2 + p2.qs.len()).map(|s| s.1).sum::<usize>(), 100);
        assert!(part_spans(&[(&p, 0, 256)], 0).is_empty());
    }

    /// The hint for a job is the parts of the job that followed it last time.
    #[test]
    fn next_parts_replay_the_order_of_the_last_token() {
        // Run on a thread of its own: the trace is per thread.
        std::thread::spawn(|| {
            k3_kernels::threads::set_idle_prefetch_bytes(1 << 20);
            let (a, b, c) = (packed(32, 256, 3), packed(32, 256, 4), packed(32, 256, 5));
            let half = |p: &Packed| (part_spans(&[(p, 0, 16)], 1 << 20), part_spans(&[(p, 16, 32)], 1 << 20));
            let run = |p: &Packed| next_parts(p, &[(p, 0, 16)], &[(p, 16, 32)]);
            // First token: nothing known yet.
            for p in [&a, &b, &c] {
                assert_eq!(run(p), Default::default());
            }
            // Second token: each job gets the next one's parts (c's next is a, the next token).
            assert_eq!(run(&a), half(&b));
            assert_eq!(run(&b), half(&c));
            assert_eq!(run(&c), half(&a));
            k3_kernels::threads::set_idle_prefetch_bytes(0);
            assert_eq!(run(&a), Default::default(), "off");
        })
        .join()
        .expect("trace thread");
    }
}
