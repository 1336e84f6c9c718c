//! Absorbed MLA attention for one decode token at the 370M bench shape (8 heads, kv_lora 256,
//! rope 64): the per-head reference loop (`mla_attend`) against the block form the engine runs
//! (`mla_attend_block`) over an f32 cache and over an f16 one (the engine's default), at several
//! cache lengths, all timed in the same run (median of 7). With `cold`, 64 MB are streamed
//! through the caches before each timed call, as a decode step's weights do in the engine, so the
//! attention cache comes from memory rather than from L2/L3.
//!
//!   cargo run --release -p k3-kernels --example mla_attend_speed [THREADS] [cold]
use k3_kernels::attention::{mla_attend, mla_attend_block, Rows};
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let threads: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(1);
    let cold = std::env::args().nth(2).is_some_and(|a| a == "cold");
    let flush = vec![1u64; if cold { 8 << 20 } else { 0 }]; // 64 MB, read (clean lines, as weights are)
    let (h, r, dr) = (8, 256, 64);
    let mut rng = k3_kernels::testing::Rng::new(5);
    for s in [512, 4096, 32768] {
        let cache = rng.normals(s * (r + dr), 1.0);
        let qb = rng.normals(h * (r + dr), 1.0);
        let (mut qa, mut qr) = (vec![0f32; h * r], vec![0f32; h * dr]);
        for hh in 0..h {
            qa[hh * r..(hh + 1) * r].copy_from_slice(&qb[hh * (r + dr)..hh * (r + dr) + r]);
            qr[hh * dr..(hh + 1) * dr].copy_from_slice(&qb[hh * (r + dr) + r..(hh + 1) * (r + dr)]);
        }
        let mut out = vec![0f32; h * r];
        let mut time = |f: &mut dyn FnMut(&mut [f32])| {
            median(
                (0..7)
                    .map(|i| {
                        std::hint::black_box(k3_kernels::simd::xor_fold(&flush) ^ i as u64);
                        let t0 = Instant::now();
                        f(&mut out);
                        t0.elapsed().as_secs_f64() * 1e3
                    })
                    .collect(),
            )
        };
        let per_head = time(&mut |o| mla_attend(o, &qa, &qr, &cache, r, dr, 0.1, true, threads));
        let block = time(&mut |o| mla_attend_block(o, &qb, Rows::F32(&cache), h, r, dr, s - 1, 0.1, true, threads));
        let bits: Vec<u16> = cache.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect();
        let half = time(&mut |o| mla_attend_block(o, &qb, Rows::F16(&bits), h, r, dr, s - 1, 0.1, true, threads));
        let mb = (s * (r + dr) * 4) as f64 / 1e6;
        println!(
            "S = {s:>6}: per-head {per_head:8.3} ms, block f32 {block:8.3} ms ({:.2}x), block f16 {half:8.3} ms ({:.2}x); \
             cache {mb:.0} MB in f32",
            per_head / block,
            per_head / half,
        );
    }
}
