//! The engine's worker pool lives with the kernels (`k3_kernels::threads`); re-exported here,
//! with the row-parallel forms of the ops the layers apply to [T, C] activations.

use k3_kernels::ops;
pub use k3_kernels::threads::{par_chunks, par_rows, Pool};

/// [`ops::rmsnorm`] over the rows of x [T, C], spread over `threads` (one block when small).
pub fn rmsnorm(y: &mut [f32], x: &[f32], w: &[f32], eps: f32, threads: usize) {
    let c = w.len();
    par_rows(y, c, threads, |r0, blk| ops::rmsnorm(blk, &x[r0 * c..r0 * c + blk.len()], w, eps));
}
