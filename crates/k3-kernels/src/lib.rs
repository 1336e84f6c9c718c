//! Pure-Rust CPU kernels on slices. Every kernel that is more than a loop has a `_ref` beside it
//! (the documentation) and a test comparing the two; tolerances live in [`testing`].
//!
//! Dims (docs/SHAPES.md): T tokens, C width, H heads, K key dim, V value dim, R latent rank.

// Kernels take many slices and dimensions, and index loops mirror the equations they implement.
#![allow(clippy::too_many_arguments, clippy::needless_range_loop)]

pub mod attention;
pub mod conv;
pub mod hugebuf;
pub mod kda;
pub mod ops;
pub mod qgemm;
pub mod quant;
pub mod simd;
pub mod simd_avx2;
pub mod simd_keys;
pub mod switch;
pub mod testing;
pub mod threads;
