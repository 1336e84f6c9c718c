//! `k3mini bench infer`: our engine and llama.cpp (llama-cpp-python) on the same GGUF, the same
//! token ids and the same thread count, in one run: prefill tokens/s, decode tokens/s at several
//! context lengths, peak RSS, and decode against the memory-bandwidth bound measured alongside.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use k3_infer::linear::Compute;
use k3_infer::{Logits, Model};
use serde_json::{json, Value};

#[derive(clap::Args)]
pub struct BenchInferArgs {
    /// A GGUF (or checkpoint directory; llama.cpp only runs GGUFs).
    #[arg(long)]
    pub model: PathBuf,
    /// Thread counts, comma-separated.
    #[arg(long, default_value = "1,2")]
    pub threads: String,
    /// Prefill lengths.
    #[arg(long, default_value = "512,4096")]
    pub prefill: String,
    /// Context lengths to decode at.
    #[arg(long, default_value = "0,4096,32768")]
    pub decode_ctx: String,
    /// Tokens timed per decode measurement.
    #[arg(long, default_value_t = 32)]
    pub decode_tokens: usize,
    /// Repeats per measurement (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Skip llama.cpp (ours only).
    #[arg(long)]
    pub no_llama: bool,
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw decode tokens/s against context for both engines.
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

fn list(s: &str, what: &str) -> Result<Vec<usize>> {
    s.split(',')
        .filter(|x| !x.trim().is_empty())
        .map(|x| x.trim().parse::<usize>().with_context(|| format!("--{what}: `{x}` is not a number")))
        .collect()
}

/// The decode contexts, ascending.
fn decode_contexts(a: &BenchInferArgs) -> Result<Vec<usize>> {
    let mut c = list(&a.decode_ctx, "decode-ctx")?;
    c.sort_unstable();
    c.dedup();
    Ok(c)
}

/// Tokens the benchmark's one id sequence needs: the longest prefill, or the decode walk.
fn ids_needed(a: &BenchInferArgs) -> Result<usize> {
    let ctxs = decode_contexts(a)?;
    let walk = ctxs.last().map_or(0, |&c| c + ctxs.len() * a.repeat * a.decode_tokens);
    Ok(list(&a.prefill, "prefill")?.into_iter().max().unwrap_or(0).max(walk).max(1))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Peak resident set of this process (VmHWM), MiB.
fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// Read bandwidth (GB/s) of `threads` threads streaming a 512 MiB buffer, the median of 5:
/// the wide, prefetching read loop (`simd::xor_fold`), or the plain one when that is faster.
pub fn bandwidth_gbs(threads: usize) -> f64 {
    let n: usize = (512 << 20) >> 3; // u64 words
    let buf: Vec<u64> = (0..n as u64).collect();
    let per = n.div_ceil(threads);
    let rate = |fold: fn(&[u64]) -> u64| {
        let mut rates = Vec::new();
        for _ in 0..5 {
            let t0 = Instant::now();
            let sums =
                k3_infer::threads::par_chunks(threads, threads, |lo, hi| fold(&buf[lo * per..(hi * per).min(n)]));
            std::hint::black_box(sums);
            rates.push((n * 8) as f64 / t0.elapsed().as_secs_f64() / 1e9);
        }
        median(rates)
    };
    rate(k3_kernels::simd::xor_fold).max(rate(k3_kernels::simd::xor_fold_ref))
}

/// Weight bytes one decoded token reads: every tensor except the embedding table (one row) and,
/// for MoE, only the top-k share of the routed experts. GGUF only (else the f32 parameter bytes).
fn weight_bytes_per_token(path: &Path) -> Result<u64> {
    if path.is_dir() {
        let (cfg, _) = k3_format::checkpoint::read_config(path)?;
        let c = k3_format::param_counts(&cfg);
        return Ok(4 * (c.active as u64).saturating_sub(c.embedding as u64 / 2));
    }
    let g = k3_format::gguf::GgufFile::open(path)?;
    let arch = g.arch().unwrap_or("").to_string();
    let num = |k: &str| g.get(&format!("{arch}.{k}")).and_then(|v| v.as_u64());
    let share = match (num("expert_used_count"), num("expert_count")) {
        (Some(k), Some(e)) if e > 0 => k as f64 / e as f64,
        _ => 1.0,
    };
    let tied = g.tensor_info("output.weight").is_none();
    let mut total = 0f64;
    for t in &g.tensors {
        let ty = k3_kernels::quant::GgmlType::from_id(t.type_id)
            .with_context(|| format!("{}: tensor {} has an unknown type", path.display(), t.name))?;
        let bytes = (t.numel() / ty.block_elems() as u64 * ty.block_bytes() as u64) as f64;
        total += if t.name == "token_embd.weight" && !tied {
            0.0
        } else if t.name.contains("_exps") {
            bytes * share
        } else {
            bytes
        };
    }
    Ok(total as u64)
}

struct Ours {
    prefill: Vec<(usize, f64)>,
    decode: Vec<(usize, f64)>,
    /// Each decode @0 repeat's tokens/s with the read bandwidth (GB/s) probed just before it.
    paired: Vec<(f64, f64)>,
}

/// [`bandwidth_gbs`] in a child process (`k3mini bench bandwidth`), so that its 512 MiB buffer
/// stays out of our peak RSS; `None` if it cannot run.
fn bandwidth_child(threads: usize) -> Option<f64> {
    let exe = std::env::current_exe().ok()?;
    let out = Command::new(exe).args(["bench", "bandwidth", "--threads", &threads.to_string()]).output().ok()?;
    if !out.status.success() {
        return None;
    }
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

fn run_ours(model: &mut Model, ids: &[u32], a: &BenchInferArgs, threads: usize) -> Result<Ours> {
    model.compute = Compute { threads, exact: false };
    let feed = |m: &Model, st: &mut k3_infer::SeqState, toks: &[u32]| -> Result<()> {
        for c in toks.chunks(512) {
            m.forward(c, st, Logits::Last)?;
        }
        Ok(())
    };
    let mut prefill = Vec::new();
    for n in list(&a.prefill, "prefill")? {
        let mut rates = Vec::new();
        for _ in 0..a.repeat {
            let mut st = model.new_state();
            let t0 = Instant::now();
            feed(model, &mut st, &ids[..n])?;
            rates.push(n as f64 / t0.elapsed().as_secs_f64());
        }
        prefill.push((n, median(rates)));
    }
    // Decode: one sequence grows through the contexts in ascending order (a 32K context is
    // prefilled once, not once per repeat); at each, `repeat` blocks of `decode_tokens` are timed,
    // the context moving on by one block each time.
    let mut decode = Vec::new();
    let mut paired = Vec::new();
    let mut st = model.new_state();
    let mut pos = 0;
    for c in decode_contexts(a)? {
        if c > pos {
            feed(model, &mut st, &ids[pos..c])?;
            pos = c;
        }
        let mut rates = Vec::new();
        for _ in 0..a.repeat {
            // At context 0 the bandwidth is probed right before each repeat, so that each ratio to
            // the bound pairs a decode and a probe from the same moment of a shared, noisy machine.
            let bw = if c == 0 { bandwidth_child(threads) } else { None };
            let t0 = Instant::now();
            for &tok in &ids[pos..pos + a.decode_tokens] {
                model.forward(&[tok], &mut st, Logits::Last)?;
            }
            let rate = a.decode_tokens as f64 / t0.elapsed().as_secs_f64();
            rates.push(rate);
            if let Some(bw) = bw {
                paired.push((rate, bw));
            }
            pos += a.decode_tokens;
        }
        decode.push((c, median(rates)));
    }
    Ok(Ours { prefill, decode, paired })
}

fn run_llama(path: &Path, ids_file: &Path, a: &BenchInferArgs, threads: usize) -> Result<Option<Value>> {
    let py = std::env::var("K3MINI_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/bench/llama_cpp_bench.py");
    let out = Command::new(&py)
        .arg(&script)
        .arg(path)
        .args(["--threads", &threads.to_string(), "--ids"])
        .arg(ids_file)
        .args(["--prefill", &a.prefill, "--decode-ctx", &a.decode_ctx])
        .args(["--decode-tokens", &a.decode_tokens.to_string(), "--repeat", &a.repeat.to_string()])
        .output()
        .with_context(|| format!("running {py} {}", script.display()))?;
    match out.status.code() {
        Some(0) => {}
        Some(3) => {
            eprintln!("llama.cpp is not installed in {py}; run scripts/setup-llama-cpp (ours only)");
            return Ok(None);
        }
        _ => bail!("{} failed:\n{}", script.display(), String::from_utf8_lossy(&out.stderr)),
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().unwrap_or_default();
    Ok(Some(serde_json::from_str(line).with_context(|| format!("bad output from the script: {line}"))?))
}

pub fn run(a: &BenchInferArgs) -> Result<()> {
    let (mut model, _) = Model::load(&a.model).with_context(|| format!("loading {}", a.model.display()))?;
    let threads = list(&a.threads, "threads")?;
    let longest = ids_needed(a)?;
    if longest > model.n_ctx {
        bail!("the benchmark needs {longest} tokens of context, the model allows {}", model.n_ctx);
    }
    // Deterministic pseudo-random ids (the same for both engines), away from special tokens.
    let v = model.vocab_size() as u64;
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let ids: Vec<u32> = (0..longest)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (100 + x % (v - 200)) as u32
        })
        .collect();
    let ids_file = std::env::temp_dir().join(format!("k3mini-bench-ids-{}.txt", std::process::id()));
    std::fs::write(&ids_file, ids.iter().map(u32::to_string).collect::<Vec<_>>().join(","))?;
    let weight_bytes = weight_bytes_per_token(&a.model)?;
    let isa = k3_kernels::qgemm::Isa::best();
    println!(
        "model {} ({:.1} MiB of weights read per decoded token), ids: {longest} pseudo-random, median of {}; \
         our kernels: {} for prefill, {} for decode (K3MINI_ISA overrides)",
        a.model.display(),
        weight_bytes as f64 / (1 << 20) as f64,
        a.repeat,
        isa.name(),
        isa.for_tokens(1).name()
    );
    // Ours first at every thread count, so that our peak RSS is the engine's own (the bandwidth
    // probe's 512 MiB buffer comes after).
    let ours_all = threads.iter().map(|&n| run_ours(&mut model, &ids, a, n)).collect::<Result<Vec<_>>>()?;
    let rss = peak_rss_mib();
    let mut report = Vec::new();
    let (mut decode_series, mut prefill_series) = (Vec::new(), Vec::new());
    for (&n, ours) in threads.iter().zip(&ours_all) {
        let bw = bandwidth_gbs(n);
        let llama = if a.no_llama || a.model.is_dir() { None } else { run_llama(&a.model, &ids_file, a, n)? };
        let bound = bw * 1e9 / weight_bytes as f64;
        println!("\n{n} thread(s): read bandwidth {bw:.1} GB/s -> decode bound {bound:.1} tok/s");
        println!("  {:<22} {:>10} {:>12} {:>8}", "", "ours", "llama.cpp", "ratio");
        let get = |kind: &str, k: usize| llama.as_ref().and_then(|l| l[kind][k.to_string()].as_f64());
        let mut rows = Vec::new();
        for (k, r) in &ours.prefill {
            rows.push((format!("prefill {k} tok/s"), *r, get("prefill", *k)));
        }
        for (k, r) in &ours.decode {
            rows.push((format!("decode @{k} tok/s"), *r, get("decode", *k)));
        }
        for (label, o, l) in &rows {
            match l {
                Some(l) => println!("  {label:<22} {o:>10.1} {l:>12.1} {:>7.2}x", o / l),
                None => println!("  {label:<22} {o:>10.1} {:>12} {:>8}", "-", "-"),
            }
        }
        if let Some((_, d0)) = ours.decode.iter().find(|(c, _)| *c == 0) {
            let l0 = get("decode", 0).map_or(String::new(), |l| format!(", llama.cpp's {:.0}%", 100.0 * l / bound));
            println!("  decode @0 is {:.0}% of the bandwidth bound{l0}", 100.0 * d0 / bound);
        }
        let fractions: Vec<f64> = ours.paired.iter().map(|&(r, b)| r * weight_bytes as f64 / (b * 1e9)).collect();
        if !fractions.is_empty() {
            let each: Vec<String> = fractions.iter().map(|f| format!("{:.0}%", 100.0 * f)).collect();
            println!(
                "  decode @0 against a probe just before each repeat: {:.0}% of the bound (median; {})",
                100.0 * median(fractions.clone()),
                each.join(", ")
            );
        }
        decode_series.push((format!("ours, {n} thr"), ours.decode.clone()));
        prefill_series.push((format!("ours, {n} thr"), ours.prefill.clone()));
        if llama.is_some() {
            let pick = |kind: &str, pts: &[(usize, f64)]| -> Vec<(usize, f64)> {
                pts.iter().filter_map(|(c, _)| Some((*c, get(kind, *c)?))).collect()
            };
            decode_series.push((format!("llama.cpp, {n} thr"), pick("decode", &ours.decode)));
            prefill_series.push((format!("llama.cpp, {n} thr"), pick("prefill", &ours.prefill)));
        }
        report.push(json!({
            "threads": n,
            "bandwidth_gbs": bw,
            "decode_bound_tok_s": bound,
            "ours": {"prefill": ours.prefill, "decode": ours.decode},
            "decode0_paired": ours.paired.iter().map(|&(r, b)| json!({"tok_s": r, "bandwidth_gbs": b})).collect::<Vec<_>>(),
            "decode0_bound_fraction_paired": (!fractions.is_empty()).then(|| median(fractions.clone())),
            "llama_cpp": llama,
        }));
    }
    println!(
        "\npeak RSS: ours {rss:.0} MiB (the benchmark process before its bandwidth probe; llama.cpp's is in the JSON)"
    );
    let _ = std::fs::remove_file(&ids_file);
    if let Some(p) = &a.json {
        let j = json!({"model": a.model.display().to_string(), "weight_bytes_per_token": weight_bytes,
                       "isa_prefill": isa.name(), "isa_decode": isa.for_tokens(1).name(),
                       "peak_rss_mib_ours": rss, "decode_tokens": a.decode_tokens, "repeat": a.repeat,
                       "runs": report});
        k3_format::safetensors_io::write_atomic(p, serde_json::to_string_pretty(&j)?.as_bytes())?;
    }
    if let Some(p) = &a.plot {
        let name = a.model.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
        k3_plot::write_png(p, &chart(format!("decode speed, {name}"), "context (tokens)", decode_series), 900, 560)?;
        let pp = p.with_file_name(format!(
            "{}-prefill.png",
            p.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
        ));
        k3_plot::write_png(&pp, &chart(format!("prefill speed, {name}"), "prompt (tokens)", prefill_series), 900, 560)?;
    }
    Ok(())
}

fn chart(title: String, x_label: &str, series: Vec<(String, Vec<(usize, f64)>)>) -> k3_plot::Chart {
    k3_plot::Chart {
        title,
        x_label: x_label.into(),
        y_label: "tokens/s".into(),
        series: series
            .into_iter()
            .enumerate()
            .map(|(i, (name, pts))| k3_plot::Series {
                name,
                points: pts.into_iter().map(|(c, r)| (c as f64, r)).collect(),
                color: k3_plot::COLORS[i % k3_plot::COLORS.len()],
            })
            .collect(),
        ..Default::default()
    }
}
