//! The two products of one tile of MLA's decode step at the 370M bench shape (8 heads, latent
//! rows of 256 + 64 in f16, 256 positions), each repeated with its operands in L1/L2, as GMAC/s:
//! the scores (8 absorbed queries against the rows, `matmul_nt_acc`) and the values (the
//! probabilities times the rows' latent part, `matmul_acc_strided`). Shows how close each is to
//! the core's multiply-add rate, apart from the cache's trip from memory (`mla_attend_speed cold`).
//!
//!   cargo run --release -p k3-kernels --example mla_products_speed
use k3_kernels::simd::{matmul_acc_strided, matmul_nt_acc};
use std::time::Instant;

fn main() {
    let mut rng = k3_kernels::testing::Rng::new(3);
    // Heads, row width (latent + rope), latent width, positions in the tile.
    let (m, w, r, n) = (8usize, 320usize, 256usize, 256usize);
    let cache: Vec<u16> = rng.normals(n * w, 1.0).iter().map(|&x| half::f16::from_f32(x).to_bits()).collect();
    let a = rng.normals(m * w, 1.0);
    let p = rng.normals(m * n, 0.1);
    let (mut sc, mut out) = (vec![0f32; m * n], vec![0f32; m * r]);
    let reps = 4000;
    for round in 0..3 {
        let t0 = Instant::now();
        for _ in 0..reps {
            matmul_nt_acc(&mut sc, n, &a, w, &cache, w, m, w, n);
        }
        let ts = t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        for _ in 0..reps {
            matmul_acc_strided(&mut out, r, &p, n, &cache, w, m, n, r);
        }
        let tv = t0.elapsed().as_secs_f64();
        let (gs, gv) = ((reps * m * w * n) as f64 / ts / 1e9, (reps * m * r * n) as f64 / tv / 1e9);
        println!(
            "round {round}: scores {gs:.1} GMAC/s ({:.4} ms a tile), values {gv:.1} GMAC/s ({:.4} ms)",
            ts / reps as f64 * 1e3,
            tv / reps as f64 * 1e3
        );
    }
    std::hint::black_box((&sc, &out));
}
