//! GQA attention for one decode token at SmolLM2-135M's shape (9 query heads sharing 3 KV heads of
//! 64) over an f16 cache (the engine's default), at several cache lengths, timed per layer
//! (median of 15). With `cold`, 64 MB are streamed through the caches before each timed call, as
//! a decode step's weights do in the engine. Prints the cache bytes read per second as well.
//!
//!   cargo run --release -p k3-kernels --example gqa_decode_speed [THREADS] [cold]
use k3_kernels::attention::{gqa_attend, Rows};
use std::time::Instant;

fn main() {
    let threads: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(1);
    let cold = std::env::args().nth(2).is_some_and(|a| a == "cold");
    let flush = vec![1u64; if cold { 8 << 20 } else { 0 }]; // 64 MB, read (clean lines, as weights are)
    let (hq, hkv, d) = (9, 3, 64);
    let mut rng = k3_kernels::testing::Rng::new(9);
    for s in [1024, 4096, 16384] {
        let bits = |v: Vec<f32>| -> Vec<u16> { v.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect() };
        let (kc, vc) = (bits(rng.normals(s * hkv * d, 1.0)), bits(rng.normals(s * hkv * d, 1.0)));
        let q = rng.normals(hq * d, 1.0);
        let mut out = vec![0f32; hq * d];
        let mut ms: Vec<f64> = (0..15)
            .map(|i| {
                std::hint::black_box(k3_kernels::simd::xor_fold(&flush) ^ i as u64);
                let t0 = Instant::now();
                gqa_attend(&mut out, &q, Rows::F16(&kc), Rows::F16(&vc), hq, hkv, d, s - 1, true, threads);
                t0.elapsed().as_secs_f64() * 1e3
            })
            .collect();
        ms.sort_by(f64::total_cmp);
        let mb = (2 * s * hkv * d * 2) as f64 / 1e6;
        println!("S = {s:>6}: {:8.3} ms per layer, cache {mb:.1} MB in f16, {:.1} GB/s", ms[7], mb / ms[7]);
    }
}
