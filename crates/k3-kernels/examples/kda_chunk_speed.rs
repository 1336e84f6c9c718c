//! The engine's chunked KDA prefill (`kda_chunk_parallel`) at the 370M bench shape (8 heads of
//! 128, chunks of 64) over T tokens: median of 7 rounds, against the token recurrence timed in
//! the same run.
//!
//!   cargo run --release -p k3-kernels --example kda_chunk_speed [T] [THREADS]
use k3_kernels::kda::{kda_chunk_parallel, kda_recurrent_ref};

fn main() {
    let arg = |i: usize, d: usize| std::env::args().nth(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (t, threads) = (arg(1, 512), arg(2, 1));
    let (h, kd, vd, chunk) = (8, 128, 128, 64);
    let mut rng = k3_kernels::testing::Rng::new(5);
    let q = rng.normals(t * h * kd, 1.0);
    let mut k = rng.normals(t * h * kd, 1.0);
    k3_kernels::ops::l2norm_inplace(&mut k, kd, 1e-6);
    let v = rng.normals(t * h * vd, 1.0);
    let g: Vec<f32> = (0..t * h * kd).map(|_| -0.05 * rng.uniform()).collect();
    let beta: Vec<f32> = (0..t * h).map(|_| rng.uniform()).collect();
    let mut o = vec![0f32; t * h * vd];
    let time = |f: &mut dyn FnMut()| k3_kernels::testing::median_secs(7, f);
    let chunked = time(&mut || {
        let mut s = vec![0f32; h * kd * vd];
        kda_chunk_parallel(&mut o, &q, &k, &v, &g, &beta, &mut s, h, kd, vd, chunk, threads);
    });
    let recurrent = time(&mut || {
        let mut s = vec![0f32; h * kd * vd];
        kda_recurrent_ref(&mut o, &q, &k, &v, &g, &beta, &mut s, h, kd, vd);
    });
    println!(
        "T={t} H={h} K={kd} V={vd} chunk={chunk}, {threads} thread(s): chunked {:.2} ms ({:.1} µs a token), \
         recurrence (reference) {:.2} ms, ratio {:.1}x",
        chunked * 1e3,
        chunked * 1e6 / t as f64,
        recurrent * 1e3,
        recurrent / chunked
    );
}
