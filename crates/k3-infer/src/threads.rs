//! The engine's worker pool lives with the kernels (`k3_kernels::threads`); re-exported here,
//! with the row-parallel forms of the ops the layers apply to [T, C] activations.

use k3_kernels::ops;

use crate::Result;
pub use k3_kernels::threads::{par_chunks, par_rows, Pool};

/// [`ops::rmsnorm`] over the rows of x [T, C], spread over `threads` (one block when small).
pub fn rmsnorm(y: &mut [f32], x: &[f32], w: &[f32], eps: f32, threads: usize) {
    let c = w.len();
    par_rows(y, c, threads, |r0, blk| ops::rmsnorm(blk, &x[r0 * c..r0 * c + blk.len()], w, eps));
}

/// `load(0..n)` in order, the indices split into one contiguous run per core, each run on its
/// own scoped thread (not the engine's pool, whose jobs a loader may itself start). Repacking
/// is most of a load and each layer's is independent. Returns the first error in index order.
pub fn load_in_parallel<T: Send>(n: usize, load: impl Fn(usize) -> Result<T> + Sync) -> Result<Vec<T>> {
    let threads = std::thread::available_parallelism().map_or(1, |c| c.get()).clamp(1, n.max(1));
    let per = n.div_ceil(threads).max(1);
    let run = |k: usize| (k * per..((k + 1) * per).min(n)).map(&load).collect::<Result<Vec<T>>>();
    let parts: Vec<Result<Vec<T>>> = std::thread::scope(|s| {
        let rest: Vec<_> = (1..threads).map(|k| s.spawn(move || run(k))).collect();
        let first = run(0);
        std::iter::once(first)
            .chain(rest.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))))
            .collect()
    });
    let mut all = Vec::with_capacity(n);
    for part in parts {
        all.extend(part?);
    }
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_load_keeps_the_order_and_returns_the_first_error() {
        let got = load_in_parallel(25, |i| Ok(i * 2)).expect("no error");
        assert_eq!(got, (0..25).map(|i| i * 2).collect::<Vec<_>>());
        let bad = |i: usize| if i == 7 || i == 20 { Err(crate::Error::Invalid(format!("layer {i}"))) } else { Ok(i) };
        let e = load_in_parallel(25, bad).expect_err("two layers fail");
        assert!(e.to_string().contains("layer 7"), "{e}");
        assert!(load_in_parallel(0, Ok).expect("nothing to load").is_empty());
        assert_eq!(load_in_parallel(1, Ok).expect("one"), vec![0]);
    }
}
