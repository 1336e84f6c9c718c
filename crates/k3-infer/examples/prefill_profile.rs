//! Prefill alone, repeated, for a profiler: load a model, then feed the same pseudo-random ids
//! in CHUNK-token forward calls (default: the whole prompt in one, as the engine takes it) REPEAT times on a fresh state each time, printing
//! tokens/s per repeat.
//!
//!   cargo run --release -p k3-infer --example prefill_profile MODEL [TOKENS] [THREADS] [REPEAT] [CHUNK]
//!
//! e.g. `perf record -o /tmp/p.data target/release/examples/prefill_profile runs/z3/370m-q4_0.gguf`
//! then `perf report -i /tmp/p.data --no-children --sort symbol`.
use std::path::PathBuf;
use std::time::Instant;

use k3_infer::linear::Compute;
use k3_infer::{Logits, Model};

fn main() {
    k3_infer::keep_freed_buffers();
    let mut args = std::env::args().skip(1);
    let Some(path) = args.next().map(PathBuf::from) else {
        eprintln!("usage: prefill_profile MODEL [TOKENS] [THREADS] [REPEAT] [CHUNK] [CHUNK]");
        std::process::exit(2);
    };
    let mut num = |d: usize| args.next().and_then(|s| s.parse().ok()).unwrap_or(d);
    let (tokens, threads, repeat, chunk) = (num(512), num(2), num(5), num(usize::MAX));
    let (mut model, _) = match Model::load(&path) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("prefill_profile: cannot load {}: {e:#}", path.display());
            std::process::exit(1);
        }
    };
    model.compute = Compute { threads, exact: false };
    let ids = k3_infer::bench_ids(tokens, model.vocab_size());
    for _ in 0..repeat {
        let mut st = model.new_state();
        let t0 = Instant::now();
        for c in ids.chunks(chunk.max(1)) {
            if let Err(e) = model.forward(c, &mut st, Logits::Last) {
                eprintln!("prefill_profile: forward failed: {e:#}");
                std::process::exit(1);
            }
        }
        println!(
            "{tokens} tokens in calls of {}, {threads} threads: {:.1} tok/s",
            chunk.min(tokens),
            tokens as f64 / t0.elapsed().as_secs_f64()
        );
    }
}
