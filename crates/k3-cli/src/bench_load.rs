//! Load times for `k3mini bench infer`: ours and llama.cpp's, in the benchmark's process after a
//! first load, and the first load of fresh processes, the engines alternating.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use k3_infer::Model;

use crate::bench_infer::median;

/// Seconds of one `Model::load` of `model` in this process, and seconds after it returned until
/// its weights were on huge pages (the model then dropped).
pub fn timed_load(model: &Path) -> Result<(f64, f64)> {
    let t0 = Instant::now();
    let loaded = Model::load(model).with_context(|| format!("loading {}", model.display()))?;
    let load = t0.elapsed().as_secs_f64();
    let promoted = k3_infer::hugepages::wait_promoted().as_secs_f64();
    drop(loaded);
    Ok((load, promoted))
}

/// First loads of fresh processes (seconds): ours, ours until on huge pages (after the load
/// returned), llama.cpp's.
#[derive(Default)]
pub struct Fresh {
    pub ours: Vec<f64>,
    pub ours_huge: Vec<f64>,
    pub llama: Vec<f64>,
}

/// `rounds` first loads of `model` in fresh processes: ours (`k3mini bench load`) and, when
/// `with_llama`, llama.cpp's (`llama_cpp_bench.py --time-loads 1`), the order alternating round
/// by round so that neither always finds the other's memory just freed. llama.cpp's list is
/// empty without llama.cpp.
pub fn fresh_loads(model: &Path, threads: usize, rounds: usize, with_llama: bool) -> Result<Fresh> {
    let exe = std::env::current_exe().context("finding this program to start it again")?;
    let ours = |f: &mut Fresh| -> Result<()> {
        let out = Command::new(&exe).args(["bench", "load", "--model"]).arg(model).output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let secs: Vec<f64> = text.split_whitespace().filter_map(|w| w.parse().ok()).collect();
        match (out.status.success(), &secs[..]) {
            (true, &[load, huge]) => {
                f.ours.push(load);
                f.ours_huge.push(huge);
                Ok(())
            }
            _ => bail!(
                "a fresh `k3mini bench load` of {} failed: {}",
                model.display(),
                String::from_utf8_lossy(&out.stderr)
            ),
        }
    };
    let theirs = || -> Result<Option<f64>> {
        Ok(crate::bench_llama::load_times(model, threads, 1)?.and_then(|l| l.first().copied()))
    };
    let mut f = Fresh::default();
    let mut llama = with_llama;
    for round in 0..rounds {
        if round % 2 == 1 {
            ours(&mut f)?;
        }
        if llama {
            match theirs()? {
                Some(s) => f.llama.push(s),
                None => llama = false,
            }
        }
        if round % 2 == 0 {
            ours(&mut f)?;
        }
    }
    Ok(f)
}

/// The fresh-process loads' line (medians and llama.cpp's time over ours).
pub fn print_fresh_loads(f: &Fresh) {
    if f.ours.is_empty() {
        return;
    }
    let (o, h) = (median(f.ours.clone()), median(f.ours_huge.clone()));
    match f.llama.is_empty() {
        true => println!(
            "first load of a fresh process (median of {}): ours {o:.3} s (on huge pages {h:.3} s later)",
            f.ours.len()
        ),
        false => {
            let l = median(f.llama.clone());
            println!(
                "first load of a fresh process (median of {}, the engines alternating): ours {o:.3} s (on huge \
                 pages {h:.3} s later), llama.cpp {l:.3} s: {:.2}x",
                f.ours.len(),
                l / o
            );
        }
    }
}

/// The load times' line: each engine's median (of those it has) and their ratio (llama.cpp's
/// time over ours: above 1 ours loads faster), then each engine's untimed first load.
pub fn print_loads(ours: &[f64], theirs: &[f64], first: (Option<f64>, Option<f64>)) {
    if ours.is_empty() {
        return;
    }
    let (o, n) = (median(ours.to_vec()), ours.len());
    let secs = |x: Option<f64>| x.map_or("-".to_string(), |s| format!("{s:.3} s"));
    match theirs.is_empty() {
        true => println!("load (median of {n}, after a first load): ours {o:.3} s; first load {}", secs(first.0)),
        false => {
            let l = median(theirs.to_vec());
            println!(
                "load (median of {n}, after a first load each): ours {o:.3} s, llama.cpp {l:.3} s: {:.2}x; \
                 first loads {} / {}",
                l / o,
                secs(first.0),
                secs(first.1)
            );
        }
    }
}
