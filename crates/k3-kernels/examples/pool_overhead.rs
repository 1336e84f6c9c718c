//! The cost of one `Pool::run` hand-off (what every parallel matvec of a decode step pays):
//! empty jobs of 2..8 tasks at 1 and 2 threads, and empty `run_pair`s both ways, median of 7
//! batches.
//!
//!   cargo run --release -p k3-kernels --example pool_overhead
use std::hint::black_box;
use std::time::Instant;

use k3_kernels::threads::Pool;

fn main() {
    for threads in [1, 2] {
        for tasks in [2, 8] {
            let mut per = Vec::new();
            for _ in 0..7 {
                let n = 20_000;
                let t0 = Instant::now();
                for _ in 0..n {
                    Pool::global().run(threads, tasks, &|i| {
                        black_box(i);
                    });
                }
                per.push(t0.elapsed().as_secs_f64() / n as f64 * 1e6);
            }
            per.sort_by(f64::total_cmp);
            println!("{threads} thread(s), {tasks} empty tasks: {:.2} us per run", per[3]);
        }
    }
    // Two-task decode jobs (`Pool::run_pair`), through the lean hand-off and through the slot.
    let bal = k3_kernels::threads::PairBalance::new();
    for lean in [true, false] {
        k3_kernels::threads::set_lean_pairs(lean);
        let mut per = Vec::new();
        for _ in 0..7 {
            let n = 20_000;
            let t0 = Instant::now();
            for _ in 0..n {
                Pool::global().run_pair(&bal, 0.5, &|i| {
                    black_box(i);
                });
            }
            per.push(t0.elapsed().as_secs_f64() / n as f64 * 1e6);
        }
        per.sort_by(f64::total_cmp);
        let how = if lean { "lean hand-off" } else { "job slot" };
        println!("2 threads, an empty run_pair ({how}): {:.2} us per pair", per[3]);
    }
}
