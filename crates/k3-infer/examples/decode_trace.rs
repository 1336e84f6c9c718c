//! Each decoded token's time, to tell a slow repeat made of a few stalled tokens (the thread
//! taken off its core, a page fault, a job's end waiting on a late worker) from one whose every
//! token is slower (the memory or the core itself slower that second). REPEATS times, a fresh
//! sequence decodes TOKENS tokens from context 0, as `bench infer`'s decode @0 repeats do; each
//! repeat prints its tokens/s, the median, 90th percentile and largest token time, the tokens over
//! 1.5× the median of the whole run, and the share of the repeat's time those outliers add.
//!
//!   cargo run --release -p k3-infer --example decode_trace MODEL [THREADS] [TOKENS] [REPEATS] [OUT]
//!
//! OUT, when given, receives every token time (µs), a repeat a line.
//!
//! Before each repeat, on x86-64, the core's clock is probed: 20 ms of a chain of dependent
//! 64-bit integer multiplies (three cycles each on Intel cores since Sandy Bridge and AMD's since
//! Zen), its rate in GHz. A repeat slower at the same clock waited on memory; one whose clock
//! fell ran slower itself.
use std::path::PathBuf;
use std::time::Instant;

use k3_infer::linear::Compute;
use k3_infer::model::{Logits, Model};

#[global_allocator]
static ALLOC: k3_infer::alloc::ThreadCache = k3_infer::alloc::ThreadCache;

fn main() {
    k3_infer::keep_freed_buffers();
    let mut args = std::env::args().skip(1);
    let Some(path) = args.next().map(PathBuf::from) else {
        eprintln!("usage: decode_trace MODEL [THREADS] [TOKENS] [REPEATS] [OUT]");
        std::process::exit(2);
    };
    let mut num = |d: usize| args.next().and_then(|s| s.parse().ok()).unwrap_or(d);
    let (threads, tokens, repeats) = (num(2), num(96), num(20));
    if tokens == 0 || repeats == 0 {
        eprintln!("decode_trace: TOKENS and REPEATS must be at least 1");
        std::process::exit(2);
    }
    let out = std::env::args().nth(5).map(PathBuf::from);
    let (mut model, _) = Model::load(&path).unwrap_or_else(|e| {
        eprintln!("decode_trace: cannot load {}: {e:#}", path.display());
        std::process::exit(1)
    });
    model.compute = Compute { threads, exact: false };
    // As `bench infer` does: the weights onto huge pages before anything is timed.
    k3_infer::hugepages::wait_promoted();
    let ids = k3_infer::bench_ids((repeats + 1) * (tokens + 1), model.vocab_size());
    let mut next = ids.iter().copied();
    // Each repeat's token times in µs; the first repeat warms up and is not kept.
    let mut runs: Vec<Vec<f64>> = Vec::new();
    let mut clocks = Vec::new();
    for r in 0..=repeats {
        let ghz = clock_ghz();
        let mut st = model.new_state();
        let first = next.next().expect("enough ids");
        model.forward(&[first], &mut st, Logits::Last).expect("first token");
        let mut times = Vec::with_capacity(tokens);
        for _ in 0..tokens {
            let id = next.next().expect("enough ids");
            let t0 = Instant::now();
            model.forward(&[id], &mut st, Logits::Last).expect("decode step");
            times.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        if r > 0 {
            runs.push(times);
            clocks.push(ghz);
        }
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2], v[v.len() * 9 / 10], v[v.len() - 1])
    };
    let all: Vec<f64> = runs.iter().flatten().copied().collect();
    let (m, _, _) = median(&all);
    println!("{threads} thread(s), {tokens} tokens a repeat; median token of the whole run {m:.0} µs");
    println!("repeat  tok/s   median µs  p90 µs   max µs  over 1.5x  their excess  clock GHz");
    for (i, t) in runs.iter().enumerate() {
        let total: f64 = t.iter().sum();
        let (md, p90, mx) = median(t);
        let slow: Vec<f64> = t.iter().copied().filter(|&x| x > 1.5 * m).collect();
        let excess: f64 = slow.iter().map(|x| x - m).sum();
        println!(
            "{i:>6}  {:>5.1}  {md:>9.0}  {p90:>6.0}  {mx:>7.0}  {:>9}  {:>11.1}%  {:>9.2}",
            tokens as f64 / total * 1e6,
            slow.len(),
            100.0 * excess / total,
            clocks[i]
        );
    }
    if let Some(out) = out {
        let text: String =
            runs.iter().map(|t| t.iter().map(|x| format!("{x:.1}")).collect::<Vec<_>>().join(" ") + "\n").collect();
        if let Err(e) = std::fs::write(&out, text) {
            eprintln!("decode_trace: cannot write {}: {e}", out.display());
            std::process::exit(1);
        }
    }
}

/// The core's clock in GHz: 20 ms of dependent multiplies, eight a loop at three cycles each (the
/// loop's own decrement and branch run beside them); NaN off x86-64.
fn clock_ghz() -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        let (mut best, t0) = (0f64, Instant::now());
        while t0.elapsed().as_secs_f64() < 0.02 {
            let (loops, mut x) = (50_000u64, 3u64);
            let t = Instant::now();
            // SAFETY: registers only.
            unsafe {
                std::arch::asm!(
                    "2:",
                    "imul {x}, {x}", "imul {x}, {x}", "imul {x}, {x}", "imul {x}, {x}",
                    "imul {x}, {x}", "imul {x}, {x}", "imul {x}, {x}", "imul {x}, {x}",
                    "dec {n}",
                    "jnz 2b",
                    x = inout(reg) x,
                    n = inout(reg) loops => _,
                    options(nomem, nostack),
                );
            }
            std::hint::black_box(x);
            best = best.max(24.0 * loops as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
        best
    }
    #[cfg(not(target_arch = "x86_64"))]
    f64::NAN
}
