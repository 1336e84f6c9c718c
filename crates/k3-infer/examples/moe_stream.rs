//! Decode-shaped streaming over a mixture's experts: LAYERS layers of E Q4_0 experts (gate and
//! up 256 × 1024, down 1024 × 256, `bench-moe`'s shape), each pass taking K other experts a
//! layer (so they come from memory, as a decoded token's do), through the engine's MoE path
//! (`packed_products_each`: every expert's gate and up in one pool job, then every down),
//! against a prefetching read of the same bytes in the same process, alternating. Shows how
//! close the products of small experts get to the memory bound, apart from the rest of a token.
//!
//!   cargo run --release -p k3-infer --example moe_stream [THREADS] [LAYERS] [E] [K] [ROUNDS] [PREFETCH]
use std::time::Instant;

use k3_infer::linear::{packed_products_each, Matrix};
use k3_kernels::qgemm::{Packed, QActs};
use k3_kernels::quant::GgmlType;

#[global_allocator]
static ALLOC: k3_infer::alloc::ThreadCache = k3_infer::alloc::ThreadCache;

fn main() {
    let arg = |i: usize, d: usize| std::env::args().nth(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (threads, layers, e, k, rounds) = (arg(1, 2), arg(2, 23), arg(3, 64), arg(4, 8), arg(5, 7));
    // A sixth argument `0` turns off each task's prefetch of its next band.
    k3_kernels::qgemm::set_band_prefetch(std::env::args().nth(6).as_deref() != Some("0"));
    let (c, f) = (1024, 256);
    let mut rng = k3_kernels::testing::Rng::new(5);
    let ty = GgmlType::Q4_0;
    let mut mat = |rows: usize, cols: usize| {
        let w = rng.normals(rows * cols, 0.4);
        Matrix::new(rows, cols, ty, w.chunks(cols).flat_map(|r| ty.quantize_row(r)).collect())
    };
    // [layer][expert] = (gate, up, down)
    let experts: Vec<Vec<[Matrix; 3]>> =
        (0..layers).map(|_| (0..e).map(|_| [mat(f, c), mat(f, c), mat(c, f)]).collect()).collect();
    k3_infer::hugepages::collapse_anonymous();
    fn packed(m: &Matrix) -> &Packed {
        m.packed.as_deref().expect("Q4_0 is packed")
    }
    let pass_bytes: usize = layers * k * experts[0][0].iter().map(Matrix::nbytes).sum::<usize>();
    let x = rng.normals(c, 1.0);
    let h = rng.normals(f, 1.0);
    let mut pass = 0usize;
    let mut gemv_pass = || {
        let t0 = Instant::now();
        for layer in &experts {
            let pick: Vec<&[Matrix; 3]> = (0..k).map(|i| &layer[(pass * k + i) % e]).collect();
            let ax = QActs::quantize(&x, 1, c);
            let mut gu = vec![0f32; 2 * k * f];
            let mut jobs: Vec<(&Packed, &QActs, &mut [f32])> = Vec::new();
            for (m, out) in pick.iter().flat_map(|ex| [&ex[0], &ex[1]]).zip(gu.chunks_mut(f)) {
                jobs.push((packed(m), &ax, out));
            }
            packed_products_each(&mut jobs, threads);
            let ah = QActs::quantize(&h, 1, f);
            let mut y = vec![0f32; k * c];
            let mut jobs: Vec<(&Packed, &QActs, &mut [f32])> = Vec::new();
            for (ex, out) in pick.iter().zip(y.chunks_mut(c)) {
                jobs.push((packed(&ex[2]), &ah, out));
            }
            packed_products_each(&mut jobs, threads);
            std::hint::black_box((&gu, &y));
        }
        pass += 1;
        pass_bytes as f64 / t0.elapsed().as_secs_f64() / 1e9
    };
    let n = pass_bytes / 8;
    let buf = k3_infer::hugepages::counting_words(n);
    // A buffer as large as every expert, read before each timed pass, so neither finds the
    // other's bytes in the last-level cache.
    let all_bytes: usize = experts.iter().flatten().flatten().map(Matrix::nbytes).sum();
    let other = k3_infer::hugepages::counting_words(all_bytes / 8);
    let read_pass = || {
        let t0 = Instant::now();
        std::hint::black_box(k3_infer::threads::par_chunks(n, threads, |lo, hi| {
            k3_kernels::simd::xor_fold(&buf[lo..hi])
        }));
        pass_bytes as f64 / t0.elapsed().as_secs_f64() / 1e9
    };
    let evict = || std::hint::black_box(k3_kernels::simd::xor_fold(&other));
    let (mut gemv, mut read) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        evict();
        gemv.push(gemv_pass());
        evict();
        read.push(read_pass());
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (g, r) = (median(gemv), median(read));
    println!(
        "{threads} thread(s), {layers} layers x {k} of {e} experts ({:.1} MiB a pass): experts' GEMV {g:.1} GB/s, \
         prefetching read {r:.1} GB/s ({:.0}%)",
        pass_bytes as f64 / (1 << 20) as f64,
        100.0 * g / r
    );
}
