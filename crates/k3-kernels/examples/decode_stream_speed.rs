//! What a decode step's matvecs can reach against the read bandwidth, with nothing else in the
//! step: the 370M bench model's Q4_0 projection matrices (24 layers of q, k, v, o, gate, up,
//! down; ~190 MB), one token through every matrix in turn, one pool job per matrix cut into
//! `tasks` bands per thread, at 1 and 2 threads; beside it the bandwidth probe of
//! `k3mini bench infer` (two-thread streaming read). Median of 7 passes.
//!
//!   cargo run --release -p k3-kernels --example decode_stream_speed
use std::time::Instant;

use k3_kernels::qgemm::{gemm_rows, Isa, Packed, QActs};
use k3_kernels::quant::GgmlType;
use k3_kernels::threads::{par_chunks, Pool, SendPtr};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut rng = k3_kernels::testing::Rng::new(1);
    let (d, f, layers) = (1024, 2816, 24);
    let shapes: Vec<(usize, usize)> =
        (0..layers).flat_map(|_| [(d, d), (d, d), (d, d), (d, d), (f, d), (f, d), (d, f)]).collect();
    // One random matrix per distinct shape, copied: the bytes streamed are what matter.
    let proto = |rows: usize, cols: usize, rng: &mut k3_kernels::testing::Rng| {
        let w = rng.normals(rows * cols, 0.4);
        let data: Vec<u8> = w.chunks(cols).flat_map(|r| GgmlType::Q4_0.quantize_row(r)).collect();
        data
    };
    let (dd, fd, df) = (proto(d, d, &mut rng), proto(f, d, &mut rng), proto(d, f, &mut rng));
    let mats: Vec<Packed> = shapes
        .iter()
        .map(|&(r, c)| {
            let data = if (r, c) == (d, d) {
                &dd
            } else if r == f {
                &fd
            } else {
                &df
            };
            Packed::pack(GgmlType::Q4_0, r, c, data).expect("Q4_0 packs")
        })
        .collect();
    let bytes: usize = mats.iter().map(|p| p.nbytes()).sum();
    let xs = [rng.normals(d, 1.0), rng.normals(f, 1.0)];
    let acts = [QActs::quantize(&xs[0], 1, d), QActs::quantize(&xs[1], 1, f)];
    let isa = Isa::best().for_tokens(1);
    println!("{} matrices, {:.1} MB of Q4_0, kernel {}", mats.len(), bytes as f64 / 1e6, isa.name());

    let words: Vec<u64> = (0..(512u64 << 20) / 8).collect();
    for threads in [1usize, 2] {
        let per = words.len().div_ceil(threads);
        let probe = median(
            (0..5)
                .map(|_| {
                    let t0 = Instant::now();
                    let s = par_chunks(threads, threads, |lo, hi| {
                        k3_kernels::simd::xor_fold(&words[lo * per..(hi * per).min(words.len())])
                    });
                    std::hint::black_box(s);
                    (words.len() * 8) as f64 / t0.elapsed().as_secs_f64() / 1e9
                })
                .collect(),
        );
        println!("{threads} thread(s): probe {probe:.1} GB/s");
        for tasks in [1usize, 4, 8, 16] {
            let mut outs: Vec<Vec<f32>> = mats.iter().map(|p| vec![0f32; p.rows]).collect();
            let gbs = median(
                (0..7)
                    .map(|_| {
                        let t0 = Instant::now();
                        for (p, y) in mats.iter().zip(outs.iter_mut()) {
                            let a = &acts[usize::from(p.cols == f)];
                            let align = p.row_align();
                            let n = (threads * tasks).min(p.rows / align).max(1);
                            let per = p.rows.div_ceil(n).next_multiple_of(align);
                            let out = SendPtr(y.as_mut_ptr());
                            Pool::global().run(threads, p.rows.div_ceil(per), &|i| {
                                let (lo, hi) = (i * per, ((i + 1) * per).min(p.rows));
                                // SAFETY: band i alone writes rows lo..hi of y.
                                let band = unsafe { std::slice::from_raw_parts_mut(out.get().add(lo), hi - lo) };
                                gemm_rows(isa, p, a, lo, hi, band);
                            });
                        }
                        bytes as f64 / t0.elapsed().as_secs_f64() / 1e9
                    })
                    .collect(),
            );
            println!("  {tasks:>2} band(s) per thread: {gbs:5.1} GB/s ({:.0}% of the probe)", 100.0 * gbs / probe);
        }
    }
}
