//! In-process A/B of decode variants: one model, one sequence (first prefilled with CONTEXT
//! tokens, default none), decoded in blocks of BLOCK tokens with the variant switched between
//! blocks and the order rotated every round, so that the host's drift (minutes long here) hits
//! every variant alike. A variant is `C`, `CL`, `CLS`, `CLSP`, `CLSPK`, `CLSPKH`, `CLSPKHF`,
//! `CLSPKHFR` or `CLSPKHFRV`: C the allocator's per-thread cache (`k3_infer::alloc`), L the lean hand-off of
//! two-task jobs (`k3_kernels::threads::set_lean_pairs`), S each job site's own balance, P each
//! decode task's next band prefetched (`k3_kernels::qgemm::set_band_prefetch`), K the attention
//! kernels' cache prefetches (`k3_kernels::simd_keys::set_cache_prefetch`), H the attention
//! caches grown onto huge pages (`k3_infer::kv::set_kv_hugepages`), F GQA decode's fused runs
//! (`k3_kernels::attention::set_gqa_fused`), R the far prefetch into L2 of decode products that
//! one thread runs alone (`k3_kernels::qgemm::set_far_prefetch_alone`), V IQ4_NL's lookups by
//! vpermb where the CPU has AVX-512 VBMI (`k3_kernels::qgemm::set_vbmi`); each 0 (off) or 1
//! (on). L, S, P, K, H, F and V are on when not given, R as the CPU's default
//! (`K3MINI_FAR_PREFETCH_ALONE`). With variants that differ in H, two sequences are decoded, one
//! whose caches grew on huge pages and one whose did not (each prefilled to CONTEXT), each
//! variant advancing its own.
//!
//!   cargo run --release -p k3-infer --example decode_ab MODEL [THREADS] [BLOCK] [ROUNDS] [VARIANTS] [CONTEXT]
//!
//! VARIANTS: comma-separated, the first the baseline (default `0,1`; `10,11` for the hand-off).
use std::path::PathBuf;
use std::time::Instant;

use k3_infer::linear::Compute;
use k3_infer::{Logits, Model};

#[global_allocator]
static ALLOC: k3_infer::alloc::ThreadCache = k3_infer::alloc::ThreadCache;

fn main() {
    k3_infer::keep_freed_buffers();
    let mut args = std::env::args().skip(1);
    let Some(path) = args.next().map(PathBuf::from) else {
        eprintln!("usage: decode_ab MODEL [THREADS] [BLOCK] [ROUNDS] [VARIANTS] [CONTEXT]");
        std::process::exit(2);
    };
    let mut num = |d: usize| args.next().and_then(|s| s.parse().ok()).unwrap_or(d);
    let (threads, block, rounds) = (num(2), num(16), num(30));
    let modes: Vec<String> =
        std::env::args().nth(5).unwrap_or_else(|| "0,1".into()).split(',').map(str::to_string).collect();
    if let Some(bad) = modes.iter().find(|m| m.is_empty() || m.len() > 9 || m.chars().any(|c| c != '0' && c != '1')) {
        eprintln!("decode_ab: unknown variant {bad:?} (C, CL, CLS, CLSP, CLSPK, CLSPKH, CLSPKHF, CLSPKHFR or CLSPKHFRV: C the allocator's cache, L the lean pair hand-off, S each job site's own balance, P each decode task's next band prefetched, K the attention's cache prefetches, H the caches on huge pages, F GQA decode's fused runs, R the far prefetch of products one thread runs alone, V IQ4_NL's lookups by vpermb; 0 off, 1 on)");
        std::process::exit(2);
    }
    let (mut model, _) = Model::load(&path).unwrap_or_else(|e| {
        eprintln!("decode_ab: cannot load {}: {e:#}", path.display());
        std::process::exit(1)
    });
    model.compute = Compute { threads, exact: false };
    let context: usize = std::env::args().nth(6).and_then(|s| s.parse().ok()).unwrap_or(0);
    let huge = |m: &str| m.as_bytes().get(5).is_none_or(|&c| c == b'1');
    // Sequence 0 grows its caches on huge pages, sequence 1 (only when a variant asks) not.
    let seqs = if modes.iter().any(|m| !huge(m)) { 2 } else { 1 };
    let ids = k3_infer::bench_ids(seqs * (context + 1) + (rounds + 1) * modes.len() * block, model.vocab_size());
    let mut next = ids.iter().copied();
    let mut states: Vec<_> = (0..seqs).map(|_| model.new_state()).collect();
    for (i, st) in states.iter_mut().enumerate() {
        k3_infer::kv::set_kv_hugepages(i == 0);
        let prompt: Vec<u32> = next.by_ref().take(context + 1).collect();
        model.forward(&prompt, st, Logits::Last).expect("prefill");
    }
    let mut step = |n: usize, st: usize| {
        let t0 = Instant::now();
        for _ in 0..n {
            let id = next.next().expect("enough ids");
            model.forward(&[id], &mut states[st], Logits::Last).expect("decode step");
        }
        t0.elapsed().as_secs_f64()
    };
    let far_default = k3_kernels::qgemm::far_prefetch_alone();
    let mut secs = vec![Vec::new(); modes.len()];
    for r in 0..=rounds {
        for k in 0..modes.len() {
            let v = (k + r) % modes.len();
            k3_infer::alloc::set_enabled(modes[v].starts_with('1'));
            let on = |i: usize| modes[v].as_bytes().get(i).is_none_or(|&c| c == b'1');
            k3_kernels::threads::set_lean_pairs(on(1));
            k3_kernels::threads::set_site_balance(on(2));
            k3_kernels::qgemm::set_band_prefetch(on(3));
            k3_kernels::simd_keys::set_cache_prefetch(on(4));
            k3_infer::kv::set_kv_hugepages(on(5));
            k3_kernels::attention::set_gqa_fused(on(6));
            k3_kernels::qgemm::set_far_prefetch_alone(modes[v].as_bytes().get(7).map_or(far_default, |&c| c == b'1'));
            k3_kernels::qgemm::set_vbmi(on(8));
            let s = step(block, usize::from(!on(5)));
            if r > 0 {
                secs[v].push(s);
            }
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    for (v, m) in modes.iter().enumerate() {
        let ratios: Vec<f64> = secs[0].iter().zip(&secs[v]).map(|(a, b)| a / b).collect();
        let faster = ratios.iter().filter(|&&x| x > 1.0).count();
        println!(
            "{m}: {:.1} tok/s (median block), speed vs {}: {:.3} (faster in {faster} of {rounds} rounds)",
            block as f64 / median(secs[v].clone()),
            modes[0],
            median(ratios)
        );
    }
}
