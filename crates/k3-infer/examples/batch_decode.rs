//! Batched decode against one sequence at a time, in one process: B sequences each decode
//! BLOCK tokens, either through one `Model::forward_batch` per step or through B separate
//! `Model::forward` calls per step, alternating every round. Prints aggregate tokens/s.
//!
//!   cargo run --release -p k3-infer --example batch_decode MODEL [THREADS] [BATCHES] [BLOCK] [ROUNDS]
use std::path::PathBuf;
use std::time::Instant;

use k3_infer::linear::Compute;
use k3_infer::{Logits, Model};

#[global_allocator]
static ALLOC: k3_infer::alloc::ThreadCache = k3_infer::alloc::ThreadCache;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let Some(path) = a.first().map(PathBuf::from) else {
        eprintln!("usage: batch_decode MODEL [THREADS] [BATCHES] [BLOCK] [ROUNDS]");
        std::process::exit(2);
    };
    let threads: usize = a.get(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    let batches: Vec<usize> =
        a.get(2).map_or("1,2,4,8".into(), String::clone).split(',').filter_map(|s| s.parse().ok()).collect();
    let block: usize = a.get(3).and_then(|s| s.parse().ok()).unwrap_or(16);
    let rounds: usize = a.get(4).and_then(|s| s.parse().ok()).unwrap_or(5);
    let (mut model, _) = Model::load(&path).expect("load");
    model.compute = Compute { threads, exact: false };
    let v = model.vocab_size() as u32;
    for &b in &batches {
        let mut sts: Vec<_> = (0..b).map(|_| model.new_state()).collect();
        let mut tok = 1u32;
        let mut next = || {
            tok = (tok.wrapping_mul(1_103_515_245).wrapping_add(12_345)) % v;
            tok
        };
        let (mut batched, mut single) = (Vec::new(), Vec::new());
        for r in 0..=rounds {
            for k in 0..2 {
                let use_batch = (k + r) % 2 == 0;
                let t0 = Instant::now();
                for _ in 0..block {
                    let toks: Vec<u32> = (0..b).map(|_| next()).collect();
                    if use_batch {
                        let mut refs: Vec<_> = sts.iter_mut().collect();
                        model.forward_batch(&toks, &mut refs).expect("batch");
                    } else {
                        for (st, &t) in sts.iter_mut().zip(&toks) {
                            model.forward(&[t], st, Logits::Last).expect("one");
                        }
                    }
                }
                let rate = (b * block) as f64 / t0.elapsed().as_secs_f64();
                if r > 0 {
                    if use_batch {
                        batched.push(rate)
                    } else {
                        single.push(rate)
                    }
                }
            }
        }
        let (mb, ms) = (median(batched), median(single));
        println!("B={b}: batched {mb:.1} tok/s, one at a time {ms:.1} tok/s, {:.2}x", mb / ms);
    }
}
