//! The engine's worker pool lives with the kernels (`k3_kernels::threads`); re-exported here.

pub use k3_kernels::threads::{par_chunks, Pool};
