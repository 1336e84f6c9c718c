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

/// The spans of a part to prefetch: each matrix's scales (and second scales) for the rows it
/// takes, then its codes, until `budget` bytes of codes.
pub fn part_spans(part: &Part, budget: usize) -> Spans {
    let mut out = Vec::with_capacity(3 * part.len());
    let mut left = budget;
    for &(p, lo, hi) in part {
        if left == 0 {
            break;
        }
        let [qs, d, m] = p.row_spans(lo, hi);
        let take = qs.1.min(left);
        // The scales of the rows whose codes are taken (rows are in the same order in each).
        let scaled = |s: (usize, usize)| (s.0, (s.1 * take).checked_div(qs.1).unwrap_or(0));
        out.extend([scaled(d), scaled(m), (qs.0, take)].into_iter().filter(|s| s.1 > 0));
        left -= take;
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

    /// Spans lie inside the matrix's arrays, cover its rows in order, and stop at the budget.
    #[test]
    fn part_spans_cover_the_rows_within_the_budget() {
        let p = packed(64, 256, 1);
        let (qs, d) = (p.qs.as_ptr() as usize, p.d.as_ptr() as usize);
        let (nq, nd) = (p.qs.len(), 2 * p.d.len());
        // All rows, no limit: the whole of the scales and codes.
        assert_eq!(part_spans(&[(&p, 0, 64)], usize::MAX), vec![(d, nd), (qs, nq)]);
        // The second half of the rows: the second half of each array.
        assert_eq!(part_spans(&[(&p, 32, 64)], usize::MAX), vec![(d + nd / 2, nd / 2), (qs + nq / 2, nq / 2)]);
        // A budget of a quarter of the codes: the first quarter of each, from the rows' start.
        assert_eq!(part_spans(&[(&p, 0, 64)], nq / 4), vec![(d, nd / 4), (qs, nq / 4)]);
        // Two matrices: the budget runs over into the second, then stops.
        let p2 = packed(32, 256, 2);
        let spans = part_spans(&[(&p, 0, 64), (&p2, 0, 32)], nq + p2.qs.len() / 2);
        assert_eq!(spans[2..], [(p2.d.as_ptr() as usize, p2.d.len()), (p2.qs.as_ptr() as usize, p2.qs.len() / 2)]);
        assert!(part_spans(&[(&p, 0, 64)], 0).is_empty());
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
