use k3_kernels::qgemm::*;
use k3_kernels::quant::GgmlType;
use std::time::Instant;
fn main() {
    let mut rng = k3_kernels::testing::Rng::new(1);
    // ROWS COLS [TYPE [ISA [REPEAT [TOKENS]]]] (default 2816 1024, 1.6 MB of Q4_0: streams from L3/memory);
    // 256 1024 stays in L2 and shows the kernel's own speed. TYPE (e.g. q4_0) and ISA (e.g. avx2)
    // keep only that type / path and skip the K-quant row-dot comparison at the end, REPEAT scales
    // the loop counts (for a profiler), TOKENS (default 64) is the prefill product's T.
    let arg = |i: usize, d: usize| std::env::args().nth(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (rows, cols) = (arg(1, 2816), arg(2, 1024));
    let only =
        |i: usize, name: &str| std::env::args().nth(i).is_none_or(|s| s == "all" || s.eq_ignore_ascii_case(name));
    let repeat = arg(5, 1);
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::IQ4_NL,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ] {
        if !only(3, ty.name()) {
            continue;
        }
        let w = rng.normals(rows * cols, 0.4);
        let data: Vec<u8> = w.chunks(cols).flat_map(|r| ty.quantize_row(r)).collect();
        let p = Packed::pack(ty, rows, cols, &data, k3_kernels::hugebuf::Place::Huge).expect("a packable type");
        for t in [1usize, arg(6, 64)] {
            let x = rng.normals(t * cols, 1.0);
            let a = QActs::quantize(&x, t, cols);
            for isa in Isa::available().into_iter().filter(|i| only(4, i.name())) {
                let mut out = vec![0f32; rows * t];
                let n = repeat * if t == 1 { 200 * 2816 / rows.min(2816) } else { (5 * 64 / t).max(1) };
                let t0 = Instant::now();
                for _ in 0..n {
                    gemm_rows(isa, &p, &a, 0, rows, &mut out);
                }
                let s = t0.elapsed().as_secs_f64() / n as f64;
                println!(
                    "{} T={t:<3} {:<12} {:8.3} ms  {:7.1} GMAC/s  {:6.1} GB/s",
                    ty.name(),
                    isa.name(),
                    s * 1e3,
                    (rows * cols * t) as f64 / s / 1e9,
                    p.nbytes() as f64 / s / 1e9
                );
            }
        }
    }
    if std::env::args().nth(3).is_some() {
        return;
    }
    // K-quants (not repacked): one 2816 x 1024 product row by row, scalar reference vs dispatch.
    use k3_kernels::quant::k_quants::{vec_dot_q4_k_q8_k, vec_dot_q6_k_q8_k};
    let x = rng.normals(cols, 1.0);
    let xq = GgmlType::Q8_K.quantize_row(&x);
    for (ty, reference) in
        [(GgmlType::Q4_K, vec_dot_q4_k_q8_k as fn(&[u8], &[u8]) -> f32), (GgmlType::Q6_K, vec_dot_q6_k_q8_k)]
    {
        let w = rng.normals(rows * cols, 0.4);
        let data: Vec<u8> = w.chunks(cols).flat_map(|r| ty.quantize_row(r)).collect();
        let rb = ty.row_bytes(cols);
        for (name, dispatch) in [("scalar ref", false), ("dispatch", true)] {
            let t0 = Instant::now();
            let mut acc = 0f32;
            for _ in 0..20 {
                for r in data.chunks(rb) {
                    acc += if dispatch { ty.vec_dot(r, &xq) } else { reference(r, &xq) };
                }
            }
            let s = t0.elapsed().as_secs_f64() / 20.0;
            println!(
                "{} T=1   {:<12} {:8.3} ms  {:6.1} GB/s  ({acc:.1})",
                ty.name(),
                name,
                s * 1e3,
                data.len() as f64 / s / 1e9
            );
        }
    }
}
