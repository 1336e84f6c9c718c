//! The f32 products of a long prefill's attention, as `attention::attend_blocked` ran them in its
//! two-pass form (it now makes one pass in 256-key tiles, `online_block`) for one head of the 370M
//! bench model's expanded MLA (128 queries, keys of 192, values of 128):
//! scores Q·Kᵀ over column blocks of 512 keys with the keys stored as columns (stride S), and
//! P·V over S positions; GMAC/s at S = 4096 with the keys' stride 4096 (a power of two) and
//! padded to 4112, and at S = 4000; one thread,
//! median of 7.
//!
//!   cargo run --release -p k3-kernels --example matmul_acc_speed

use k3_kernels::simd::matmul_acc_strided;

fn main() {
    let mut rng = k3_kernels::testing::Rng::new(2);
    let (m, dk, dv) = (128, 192, 128);
    for (s, ld) in [(4096usize, 4096usize), (4096, 4112), (4000, 4000)] {
        let a = rng.normals(m * dk, 1.0);
        let kt = rng.normals(dk * ld, 1.0);
        let v = rng.normals(s * dv, 1.0);
        let p = rng.normals(m * s, 0.1);
        let mut sc = vec![0f32; m * s];
        let mut o = vec![0f32; m * dv];
        let time = |f: &mut dyn FnMut()| k3_kernels::testing::median_secs(7, f);
        let qk = time(&mut || {
            for j0 in (0..s).step_by(512) {
                let nb = 512.min(s - j0);
                matmul_acc_strided(&mut sc[j0..], s, &a, dk, &kt[j0..], ld, m, dk, nb);
            }
        });
        let pv = time(&mut || matmul_acc_strided(&mut o, dv, &p, s, &v, dv, m, s, dv));
        let g = |macs: usize, sec: f64| macs as f64 / sec / 1e9;
        println!(
            "S={s} (key stride {ld}): Q·Kᵀ {:.1} GMAC/s ({:.2} ms), P·V {:.1} GMAC/s ({:.2} ms)",
            g(m * dk * s, qk),
            qk * 1e3,
            g(m * s * dv, pv),
            pv * 1e3
        );
    }
}
