//! The fused KDA decode step against the reference step, at the 370M bench shape (8 heads of
//! 128): median of 9 rounds of 200 steps each, both timed in the same run.
//!
//!   cargo run --release -p k3-kernels --example kda_step_speed
use k3_kernels::kda::{kda_step, kda_step_fused};
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let (h, kd, vd) = (8, 128, 128);
    let mut rng = k3_kernels::testing::Rng::new(3);
    let q = rng.normals(h * kd, 1.0);
    let mut k = rng.normals(h * kd, 1.0);
    k3_kernels::ops::l2norm_inplace(&mut k, kd, 1e-6);
    let v = rng.normals(h * vd, 1.0);
    let g: Vec<f32> = (0..h * kd).map(|_| -0.05 * rng.uniform()).collect();
    let beta: Vec<f32> = (0..h).map(|_| rng.uniform()).collect();
    let mut s = rng.normals(h * kd * vd, 0.1);
    let mut o = vec![0f32; h * vd];
    let n = 200;
    let time = |f: &mut dyn FnMut()| {
        median(
            (0..9)
                .map(|_| {
                    let t0 = Instant::now();
                    for _ in 0..n {
                        f();
                    }
                    t0.elapsed().as_secs_f64() / n as f64
                })
                .collect(),
        )
    };
    let r = time(&mut || kda_step(&mut o, &q, &k, &v, &g, &beta, &mut s, kd, vd));
    let f1 = time(&mut || kda_step_fused(&mut o, &q, &k, &v, &g, &beta, &mut s, kd, vd, 1));
    let f2 = time(&mut || kda_step_fused(&mut o, &q, &k, &v, &g, &beta, &mut s, kd, vd, 2));
    let state_mb = (h * kd * vd * 4) as f64 / 1e6;
    println!("KDA decode step, H={h} K=V={kd} (state {state_mb:.2} MB), median of 9 x {n}:");
    println!("  reference         {:8.1} us", r * 1e6);
    println!("  fused, 1 thread   {:8.1} us  ({:.2}x the reference)", f1 * 1e6, r / f1);
    println!("  fused, 2 threads  {:8.1} us  ({:.2}x the reference)", f2 * 1e6, r / f2);
}
