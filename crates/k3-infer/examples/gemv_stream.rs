//! Decode-shaped streaming: a 370M-sized set of Q4_0 matrices (24 layers of the bench model's
//! projections) multiplied by one token each, through `Matrix::matvec` (activation quantizer and
//! pool dispatch included), against the read bandwidth of a plain streaming loop at the same
//! thread count. Shows how close the integer GEMV alone gets to the memory bound.
//!
//!   cargo run --release -p k3-infer --example gemv_stream [THREADS] [LAYERS] [TYPE] [one]
//!
//! TYPE (q4_0 default, q4_1, q8_0) is the matrices' storage type (the 370M's head is Q8_0).
//! `one` streams the same bytes as one tall matrix of 1024 columns in a single matvec, which
//! separates the kernel's own streaming from what each of the 168 products' pool jobs costs.
//!
//! `jobs:3,1,2,1` (or any list summing to 7) runs each layer's seven matrices as pool jobs of
//! that many matrices in turn, one activation quantization each: in each job, task i multiplies
//! its share of every one of the job's matrices' rows, one after the other, with no barrier
//! between them (`jobs:3,1,2,1` is the engine's grouping: q / k / v, o, gate / up, down;
//! `jobs:7` one job a layer). `jobs:3,1,3@4` cuts each job into 4 tasks (default: one a thread).
//!
//! `engine` groups them as the engine's decode does (`Matrix::apply_many` over q / k / v, o,
//! apply_many over gate / up, down: four jobs a layer, tasks that may span matrices);
//! `stacked` holds the same bytes as four matrices a layer (q / k / v stacked into one of 3072
//! rows, gate / up into one of 5632, o, down), one matvec each, so each thread starts fewer
//! streams.
//!
//! LAYERS (default 24) shrinks the set: at 1 (~7 MiB) it stays in cache, which shows whether
//! the kernel itself, not memory, is the limit.
//!
//! `engine jobs-ab` (fourth and fifth arguments) times the activation quantizer and compares, in
//! one process, the engine's jobs with bare pool jobs and with one job a pass (see `jobs_ab`).
//!
//! A fifth argument `evict` reads 1 GiB of other memory before every pass and alternates the
//! GEMV with the prefetching read (5 of each): on a host whose last-level cache holds a good part
//! of the set, repeated passes over one buffer otherwise hit that cache, and the read more than
//! the GEMV (on the Sapphire Rapids class host of 2026-12-03, 1 thread: ~75% without, ~88% with).
use std::time::Instant;

use k3_infer::linear::{Compute, Matrix};
use k3_kernels::qgemm::QActs;
use k3_kernels::quant::GgmlType;
use k3_kernels::threads::Pool;

/// The fourth argument's `jobs:3,1,2,1[@TASKS]`: the matrices per job (empty: one matvec each)
/// and tasks per job.
#[global_allocator]
static ALLOC: k3_infer::alloc::ThreadCache = k3_infer::alloc::ThreadCache;

fn jobs_arg(threads: usize) -> (Vec<usize>, usize) {
    let arg = std::env::args().nth(4).unwrap_or_default();
    let Some(spec) = arg.strip_prefix("jobs:") else { return (Vec::new(), threads) };
    let (list, tasks) = spec.split_once('@').unwrap_or((spec, ""));
    let groups: Option<Vec<usize>> = list.split(',').map(|g| g.parse().ok()).collect();
    match (groups, tasks.parse().ok().or((tasks.is_empty()).then_some(threads))) {
        (Some(g), Some(t)) if g.iter().sum::<usize>() == 7 && !g.contains(&0) && t > 0 => (g, t),
        _ => {
            eprintln!("gemv_stream: `{arg}` is not jobs:LIST[@TASKS] with LIST summing to 7 (e.g. jobs:3,1,2,1@4)");
            std::process::exit(2);
        }
    }
}

fn main() {
    let threads: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    let layers: usize = std::env::args().nth(2).and_then(|s| s.parse().ok()).unwrap_or(24);
    let ty = match std::env::args().nth(3).as_deref() {
        None | Some("q4_0") => GgmlType::Q4_0,
        Some("q4_1") => GgmlType::Q4_1,
        Some("q8_0") => GgmlType::Q8_0,
        Some(other) => {
            eprintln!("gemv_stream: TYPE {other:?} is not one of q4_0, q4_1, q8_0");
            std::process::exit(2);
        }
    };
    let mut rng = k3_kernels::testing::Rng::new(3);
    // One layer: q, k, v, o (1024 x 1024), gate, up (2816 x 1024), down (1024 x 2816).
    let shapes = [(1024, 1024), (1024, 1024), (1024, 1024), (1024, 1024), (2816, 1024), (2816, 1024), (1024, 2816)];
    let proto: Vec<Matrix> = shapes
        .iter()
        .map(|&(r, c)| {
            let w = rng.normals(r * c, 0.4);
            let data: Vec<u8> = w.chunks(c).flat_map(|row| ty.quantize_row(row)).collect();
            Matrix::new(r, c, ty, data)
        })
        .collect();
    // Distinct copies (a clone would share the packed weights through their Arc).
    let one = std::env::args().nth(4).as_deref() == Some("one");
    let mats: Vec<Matrix> = if one {
        let rows = (layers * shapes.iter().map(|&(r, c)| r * c).sum::<usize>() / 1024).next_multiple_of(16);
        let w = rng.normals(rows * 1024, 0.4);
        let data: Vec<u8> = w.chunks(1024).flat_map(|row| ty.quantize_row(row)).collect();
        vec![Matrix::new(rows, 1024, ty, data)]
    } else if std::env::args().nth(4).as_deref() == Some("stacked") {
        (0..layers)
            .flat_map(|_| {
                [(3072, 1024), (1024, 1024), (5632, 1024), (1024, 2816)].map(|(r, c)| {
                    let w = rng.normals(r * c, 0.4);
                    Matrix::new(r, c, ty, w.chunks(c).flat_map(|row| ty.quantize_row(row)).collect())
                })
            })
            .collect()
    } else {
        (0..layers)
            .flat_map(|_| {
                proto.iter().map(|m| {
                    let mut c = m.clone();
                    c.packed = m.packed.as_ref().map(|p| std::sync::Arc::new((**p).clone()));
                    c
                })
            })
            .collect()
    };
    let bytes: usize = mats.iter().map(|m| m.nbytes()).sum();
    let cx = Compute { threads, exact: false };
    let x = rng.normals(2816, 1.0);
    let mut y = vec![0f32; mats.iter().map(|m| m.rows).max().unwrap_or(0)];
    // Streaming reads of a buffer of the same size: the plain loop and the wide, prefetching
    // one (the benchmark's bandwidth probe takes the faster). The matrices and the buffer on
    // huge pages alike, as the engine and the benchmark's probe have them, before any pass.
    k3_infer::hugepages::collapse_anonymous();
    let n = bytes / 8;
    let buf = k3_infer::hugepages::counting_words(n);
    // One pass of each, in GB/s.
    let (groups, tasks) = jobs_arg(threads);
    let isa = k3_kernels::qgemm::Isa::best().for_tokens(1);
    let mut gemv_pass = || {
        let t0 = Instant::now();
        if std::env::args().nth(4).as_deref() == Some("engine") {
            for l in mats.chunks(7) {
                std::hint::black_box(Matrix::apply_many(&[&l[0], &l[1], &l[2]], &x[..1024], 1, cx));
                std::hint::black_box(l[3].apply(&x[..1024], 1, cx));
                std::hint::black_box(Matrix::apply_many(&[&l[4], &l[5]], &x[..1024], 1, cx));
                std::hint::black_box(l[6].apply(&x[..2816], 1, cx));
            }
        } else if groups.is_empty() {
            for m in &mats {
                m.matvec(&x[..m.cols], &mut y[..m.rows], cx);
            }
        } else {
            for layer in mats.chunks(7) {
                let mut first = 0;
                for &size in &groups {
                    let job = &layer[first..first + size];
                    first += size;
                    // An activation quantization a job, as the engine has (the values are x's).
                    let (a1, a2) = (QActs::quantize(&x[..1024], 1, 1024), QActs::quantize(&x[..2816], 1, 2816));
                    Pool::global().run(threads, tasks, &|i| {
                        let mut out = vec![0f32; 4096];
                        for m in job {
                            let p = m.packed.as_deref().expect("Q4_0 / Q4_1 / Q8_0 matrices are packed");
                            let a = if m.cols == 1024 { &a1 } else { &a2 };
                            let lo = (m.rows * i / tasks).next_multiple_of(16).min(m.rows);
                            let hi = (m.rows * (i + 1) / tasks).next_multiple_of(16).min(m.rows);
                            k3_kernels::qgemm::gemm_rows(isa, p, a, lo, hi, &mut out[..hi - lo]);
                        }
                        std::hint::black_box(&out);
                    });
                }
            }
        }
        bytes as f64 / t0.elapsed().as_secs_f64() / 1e9
    };
    let read_pass = |fold: fn(&[u64]) -> u64| {
        let t0 = Instant::now();
        std::hint::black_box(k3_infer::threads::par_chunks(n, threads, |lo, hi| fold(&buf[lo..hi])));
        bytes as f64 / t0.elapsed().as_secs_f64() / 1e9
    };
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    if std::env::args().nth(5).as_deref() == Some("jobs-ab") {
        jobs_ab(&mats, &x, bytes, threads);
        return;
    }
    if std::env::args().nth(5).as_deref() == Some("evict") {
        let other: Vec<u64> = (0..(1u64 << 27)).collect();
        let evict = || std::hint::black_box(k3_kernels::simd::xor_fold(&other));
        let (mut gemv, mut read) = (Vec::new(), Vec::new());
        for _ in 0..5 {
            evict();
            gemv.push(gemv_pass());
            evict();
            read.push(read_pass(k3_kernels::simd::xor_fold));
        }
        let (gemv, read) = (median(gemv), median(read));
        println!(
            "{threads} thread(s), 1 GiB read before every pass: GEMV {gemv:.1} GB/s, prefetching read {read:.1} GB/s \
             ({:.0}%)",
            100.0 * gemv / read
        );
        return;
    }
    let gemv = median((0..7).map(|_| gemv_pass()).collect());
    let stream = |fold: fn(&[u64]) -> u64| median((0..7).map(|_| read_pass(fold)).collect());
    let (plain, wide) = (stream(k3_kernels::simd::xor_fold_ref), stream(k3_kernels::simd::xor_fold));
    println!(
        "{threads} thread(s), {:.0} MiB of {} per pass, {} matvecs: GEMV {:.1} GB/s; plain read {plain:.1} GB/s \
         ({:.0}%), prefetching read {wide:.1} GB/s ({:.0}%)",
        bytes as f64 / (1 << 20) as f64,
        ty.name(),
        mats.len(),
        gemv,
        100.0 * gemv / plain,
        100.0 * gemv / wide
    );
}

/// `engine jobs-ab`: what the pool jobs of a decode-shaped pass cost, in one process. Times the
/// activation quantizer alone, then alternates (21 rounds, the order rotated) four ways of
/// running the same products: the engine's jobs (`apply_many` / `apply`, four a layer, each
/// quantizing its input first), the same four jobs a layer with the inputs quantized once
/// before the pass and then with one quantization before each job (each task half of every
/// matrix of its job), and one job for the whole pass (each thread half of every matrix, no
/// barrier between them). Prints each one's median GB/s and median ratio to the engine's.
fn jobs_ab(mats: &[Matrix], x: &[f32], bytes: usize, threads: usize) {
    for cols in [128usize, 1024, 2816] {
        let mut us: Vec<f64> = (0..2000)
            .map(|_| {
                let t0 = Instant::now();
                std::hint::black_box(QActs::quantize(&x[..cols], 1, cols));
                t0.elapsed().as_secs_f64() * 1e6
            })
            .collect();
        us.sort_by(f64::total_cmp);
        println!("quantizing one activation row of {cols}: {:.3} us (median of 2000)", us[1000]);
    }
    let cx = Compute { threads, exact: false };
    let isa = k3_kernels::qgemm::Isa::best().for_tokens(1);
    let (a1, a2) = (QActs::quantize(&x[..1024], 1, 1024), QActs::quantize(&x[..2816], 1, 2816));
    // Task i of `threads`: its half of every matrix in `job`.
    let halves = |job: &[Matrix], acts: [&QActs; 2], i: usize| {
        let mut out = [0f32; 4096];
        for m in job {
            let p = m.packed.as_deref().expect("Q4_0 / Q4_1 / Q8_0 matrices are packed");
            let a = if m.cols == 1024 { acts[0] } else { acts[1] };
            let lo = (m.rows * i / threads).next_multiple_of(16).min(m.rows);
            let hi = (m.rows * (i + 1) / threads).next_multiple_of(16).min(m.rows);
            k3_kernels::qgemm::gemm_rows(isa, p, a, lo, hi, &mut out[..hi - lo]);
        }
        std::hint::black_box(&out);
    };
    let timed = |f: &dyn Fn()| {
        let t0 = Instant::now();
        f();
        bytes as f64 / t0.elapsed().as_secs_f64() / 1e9
    };
    let engine = || {
        for l in mats.chunks(7) {
            std::hint::black_box(Matrix::apply_many(&[&l[0], &l[1], &l[2]], &x[..1024], 1, cx));
            std::hint::black_box(l[3].apply(&x[..1024], 1, cx));
            std::hint::black_box(Matrix::apply_many(&[&l[4], &l[5]], &x[..1024], 1, cx));
            std::hint::black_box(l[6].apply(&x[..2816], 1, cx));
        }
    };
    let four_jobs = |quantize_each: bool| {
        for l in mats.chunks(7) {
            for job in [&l[0..3], &l[3..4], &l[4..6], &l[6..7]] {
                let own = quantize_each.then(|| QActs::quantize(&x[..job[0].cols], 1, job[0].cols));
                let acts = own.as_ref().map_or([&a1, &a2], |q| [q, q]);
                Pool::global().run(threads, threads, &|i| halves(job, acts, i));
            }
        }
    };
    let one_job = || Pool::global().run(threads, threads, &|i| halves(mats, [&a1, &a2], i));
    let names = [
        "the engine's jobs",
        "4 jobs a layer, inputs quantized once",
        "4 jobs a layer, a quantization each",
        "one job a pass",
    ];
    let mut rates = vec![Vec::new(); names.len()];
    for round in 0..21 {
        for k in 0..names.len() {
            let v = (k + round) % names.len();
            rates[v].push(match v {
                0 => timed(&engine),
                1 => timed(&|| four_jobs(false)),
                2 => timed(&|| four_jobs(true)),
                _ => timed(&one_job),
            });
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    for (v, name) in names.iter().enumerate() {
        let ratios: Vec<f64> = rates[v].iter().zip(&rates[0]).map(|(a, b)| a / b).collect();
        println!(
            "{name}: {:.1} GB/s, {:.3} of the engine's jobs (median of 21)",
            median(rates[v].clone()),
            median(ratios)
        );
    }
}
