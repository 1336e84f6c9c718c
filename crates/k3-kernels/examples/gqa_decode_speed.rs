//! GQA attention for one decode token at SmolLM2-135M's shape (9 query heads sharing 3 KV heads of
//! 64) over an f16 cache (the engine's default), at several cache lengths, timed per layer
//! (median of 15): the fused runs (`attention::gqa_run`, where the machine has AVX-512) and the
//! unfused tiles alternating in one process, with their ratio. With `cold`, 64 MB are streamed
//! through the caches before each timed call, as a decode step's weights do in the engine. Prints
//! the cache bytes read per second as well. The caches lie on huge pages, as the engine's do from
//! 1 MiB (`kv::Held`); with `small`, on 4 KiB pages. `wide` takes Llama-3.2-3B's shape instead
//! (24 query heads over 8 KV heads of 128).
//!
//!   cargo run --release -p k3-kernels --example gqa_decode_speed [THREADS] [cold|warm] [small|huge] [wide]
use k3_kernels::attention::{gqa_attend, set_gqa_fused, Rows};
use std::time::Instant;

fn main() {
    let arg = |i: usize| std::env::args().nth(i);
    let threads: usize = arg(1).and_then(|a| a.parse().ok()).unwrap_or(1);
    let cold = arg(2).is_some_and(|a| a == "cold");
    let huge = arg(3).is_none_or(|a| a != "small");
    let flush = vec![1u64; if cold { 8 << 20 } else { 0 }]; // 64 MB, read (clean lines, as weights are)
    let (hq, hkv, d) = if arg(4).is_some_and(|a| a == "wide") { (24, 8, 128) } else { (9, 3, 64) };
    let reps = 15;
    let mut rng = k3_kernels::testing::Rng::new(9);
    for s in [1024, 4096, 16384] {
        let bits = |v: Vec<f32>| {
            let mut b = k3_kernels::hugebuf::Buf::<u16>::mapped(v.len(), huge);
            for (o, &x) in b.iter_mut().zip(&v) {
                *o = half::f16::from_f32(x).to_bits();
            }
            b
        };
        let (kc, vc) = (bits(rng.normals(s * hkv * d, 1.0)), bits(rng.normals(s * hkv * d, 1.0)));
        let q = rng.normals(hq * d, 1.0);
        let mut out = vec![0f32; hq * d];
        // [unfused, fused] milliseconds per call.
        let mut ms = [Vec::new(), Vec::new()];
        for i in 0..reps {
            for (fused, ms) in ms.iter_mut().enumerate() {
                set_gqa_fused(fused == 1);
                std::hint::black_box(k3_kernels::simd::xor_fold(&flush) ^ i as u64);
                let t0 = Instant::now();
                gqa_attend(&mut out, &q, Rows::F16(&kc), Rows::F16(&vc), hq, hkv, d, s - 1, true, threads);
                ms.push(t0.elapsed().as_secs_f64() * 1e3);
            }
        }
        let [unfused, fused] = ms.map(|mut v| {
            v.sort_by(f64::total_cmp);
            v[reps / 2]
        });
        let mb = (2 * s * hkv * d * 2) as f64 / 1e6;
        println!(
            "S = {s:>6}: fused {fused:7.3} ms per layer ({:.1} GB/s), unfused {unfused:7.3} ms ({:.1} GB/s): {:.3}x; cache {mb:.1} MB in f16",
            mb / fused,
            mb / unfused,
            unfused / fused
        );
    }
}
