//! `k3mini bench infer`: our engine and llama.cpp (llama-cpp-python) on the same GGUF, the same
//! token ids and the same thread count, in one run: prefill tokens/s, decode tokens/s at several
//! context lengths, peak RSS, and decode against the memory-bandwidth bound measured alongside.
//! The engines take turns: every repeat of a measurement runs ours and llama.cpp's back to back
//! (llama.cpp kept loaded in `tools/bench/llama_cpp_bench.py`, [`crate::bench_llama`]), and a
//! ratio is the median of the per-repeat ratios, so that a shared machine's drift over minutes
//! meets both engines alike.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use k3_infer::linear::Compute;
use k3_infer::{Logits, Model};
use serde_json::{json, Value};

use crate::bench_llama::Llama;
use crate::bench_load::{fresh_loads, print_fresh_loads, print_loads, timed_load};

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
    /// Batch sizes for batched decode, comma-separated (none by default): for each B, B
    /// sequences decoded together, one token each a step (each weight read once a step for all
    /// of them), `--repeat` blocks of `--decode-tokens` steps; aggregate tokens/s.
    #[arg(long, default_value = "")]
    pub batch: String,
    /// The context each batched sequence holds before its first timed step (its prompt, fed
    /// untimed).
    #[arg(long, default_value_t = 0)]
    pub batch_ctx: usize,
    /// Tokens timed per decode measurement.
    #[arg(long, default_value_t = 32)]
    pub decode_tokens: usize,
    /// Repeats per measurement (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Loads of the model timed in each engine, each then dropped, after one untimed load each
    /// (the median is reported; 0: none). Ours: `Model::load` before the runs (repacking on one
    /// thread a core); llama.cpp: `Llama(...)` with a context of 512 at the first thread count,
    /// in a process of its own.
    #[arg(long, default_value_t = 3)]
    pub load_repeat: usize,
    /// Rounds of first loads in fresh processes: each round one load in a new process of ours
    /// (`k3mini bench load`) and one in a new llama.cpp process, the order alternating round by
    /// round (the median is reported; 0: none). What a user starting either program waits for.
    #[arg(long, default_value_t = 3)]
    pub fresh_loads: usize,
    /// Skip llama.cpp (ours only).
    #[arg(long)]
    pub no_llama: bool,
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw decode tokens/s against context for both engines.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// The unquantized model (f32 checkpoint directory or f32 GGUF) to judge the benchmarked
    /// GGUF against: KL divergence, top-1 agreement and perplexity, after the speed runs.
    #[arg(long)]
    pub reference: Option<PathBuf>,
    /// A dataset built with the model's tokenizer whose validation split is read for the quality
    /// windows (default: the benchmark's pseudo-random ids, where the KL still measures the
    /// quantization error but perplexity is not a language measure).
    #[arg(long, requires = "reference")]
    pub quality_data: Option<PathBuf>,
    /// Quality windows.
    #[arg(long, default_value_t = 8)]
    pub quality_windows: usize,
    /// Tokens per quality window.
    #[arg(long, default_value_t = 256)]
    pub quality_context: usize,
}

fn list(s: &str, what: &str) -> Result<Vec<usize>> {
    s.split(',')
        .filter(|x| !x.trim().is_empty())
        .map(|x| x.trim().parse::<usize>().with_context(|| format!("--{what}: `{x}` is not a number")))
        .collect()
}

/// The batch sizes of `--batch`, each at least 1.
fn batch_sizes(a: &BenchInferArgs) -> Result<Vec<usize>> {
    let b = list(&a.batch, "batch")?;
    if b.contains(&0) {
        bail!("--batch: a batch holds at least one sequence (got 0)");
    }
    Ok(b)
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

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Peak resident set of this process (`VmHWM:`) or its current one (`VmRSS:`), MiB.
fn rss_mib(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with(field)).and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// Bytes of the probe's first buffer: larger than any last-level cache seen on these hosts.
pub const PROBE_BYTES: usize = 512 << 20;

/// Read bandwidth (GB/s) of `threads` threads streaming a buffer of `bytes`, the median of 5: the
/// wide, prefetching read loop (`simd::xor_fold`), or the plain one when that is faster.
pub fn bandwidth_gbs(threads: usize, bytes: usize) -> f64 {
    // u64 words, on huge pages where the system gives them, as the engine's weights are
    // (hugepages): the probe is the best read this machine does, not a read on 4 KiB pages.
    let n: usize = (bytes >> 3).max(threads * 64);
    let buf = k3_infer::hugepages::counting_words(n);
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

/// The bandwidth a decode is held to: the faster of a [`PROBE_BYTES`] read (memory) and a read
/// of a buffer the size of the weights a token reads (`weight_bytes`), which is the faster one
/// when the weights fit, wholly or in part, in the last-level cache (a 92 MiB model on a host
/// with a 480 MiB L3 read 20-50% faster than memory). Returns (bound, memory, same-size), GB/s.
pub fn probe(threads: usize, weight_bytes: usize) -> (f64, f64, f64) {
    let (mem, same) = (bandwidth_gbs(threads, PROBE_BYTES), bandwidth_gbs(threads, weight_bytes));
    (mem.max(same), mem, same)
}

/// Weight bytes one decoded token reads: every tensor except the embedding table (one row) and,
/// for MoE, only the top-k share of the routed experts. GGUF only (else the f32 parameter bytes).
fn weight_bytes_per_token(path: &Path) -> Result<u64> {
    if path.is_dir() {
        let (cfg, _) = k3_format::checkpoint::read_config(path)?;
        let c = k3_format::param_counts(&cfg);
        return Ok(4 * (c.active as u64).saturating_sub(c.embedding as u64 / 2));
    }
    gguf_weight_bytes_per_token(&k3_format::gguf::GgufFile::open(path)?)
}

/// [`weight_bytes_per_token`] of an opened GGUF file.
pub fn gguf_weight_bytes_per_token(g: &k3_format::gguf::GgufFile) -> Result<u64> {
    let arch = g.arch().unwrap_or("").to_string();
    let num = |k: &str| g.get(&format!("{arch}.{k}")).and_then(|v| v.as_u64());
    let share = match (num("expert_used_count"), num("expert_count")) {
        (Some(k), Some(e)) if e > 0 => k as f64 / e as f64,
        _ => 1.0,
    };
    let tied = g.tensor_info("output.weight").is_none();
    let mut total = 0f64;
    for t in &g.tensors {
        let bytes =
            t.nbytes().with_context(|| format!("{}: tensor {} has an unknown type", g.path.display(), t.name))? as f64;
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

/// Repeated rates of one point (a prefill length or a decode context) for both engines, taken in
/// alternating order (ours first on even repeats), so that drift on a shared machine meets both.
#[derive(Default)]
struct Point {
    ours: Vec<f64>,
    llama: Vec<f64>,
}

impl Point {
    /// Time both engines once; `llama` is skipped when there is no llama.cpp.
    fn take(
        &mut self,
        repeat: usize,
        mut ours: impl FnMut() -> Result<f64>,
        llama: Option<&mut dyn FnMut() -> Result<f64>>,
    ) -> Result<()> {
        match llama {
            Some(l) if repeat % 2 == 1 => {
                self.llama.push(l()?);
                self.ours.push(ours()?);
            }
            Some(l) => {
                self.ours.push(ours()?);
                self.llama.push(l()?);
            }
            None => self.ours.push(ours()?),
        }
        Ok(())
    }

    fn ours(&self) -> f64 {
        median(self.ours.clone())
    }

    fn llama(&self) -> Option<f64> {
        (!self.llama.is_empty()).then(|| median(self.llama.clone()))
    }

    /// The median of the per-repeat ratios ours / llama.cpp.
    fn ratio(&self) -> Option<f64> {
        (!self.llama.is_empty()).then(|| median(self.ours.iter().zip(&self.llama).map(|(o, l)| o / l).collect()))
    }
}

/// Everything measured at one thread count.
struct Measured {
    prefill: Vec<(usize, Point)>,
    decode: Vec<(usize, Point)>,
    /// Batched decode by batch size (aggregate tokens/s).
    batch: Vec<(usize, Point)>,
    /// Each decode @0 repeat with the read bandwidth probed just before and just after it.
    paired: Vec<Paired>,
}

/// One decode @0 repeat of ours and the read bandwidth (GB/s) of probes just before and just
/// after it (`after` None where that probe could not run, or was not taken: with llama.cpp in
/// the run, only the repeats whose llama.cpp block came first get one).
#[derive(Debug, Clone, Copy)]
struct Paired {
    tok_s: f64,
    before: f64,
    after: Option<f64>,
}

/// How far apart (relative to their mean) the probes before and after a repeat may read for
/// the repeat to count as steady: this host's read bandwidth switches between states ~1.6× apart
/// within seconds, and a repeat taken across such a switch has no one bound to be held to.
const STEADY_SPREAD: f64 = 0.10;

/// The fraction of the bound (`weight_bytes` a token) that each steady repeat (both probes there
/// and within [`STEADY_SPREAD`] of their mean) reached against the mean of its two probes, in
/// order.
fn bracketed(paired: &[Paired], weight_bytes: usize) -> Vec<f64> {
    paired
        .iter()
        .filter_map(|p| {
            let after = p.after?;
            let mean = 0.5 * (p.before + after);
            ((p.before - after).abs() <= STEADY_SPREAD * mean).then(|| p.tok_s * weight_bytes as f64 / (mean * 1e9))
        })
        .collect()
}

/// [`probe`] in a child process (`k3mini bench bandwidth`), so that its buffers stay out of our
/// peak RSS; `None` if it cannot run.
fn probe_child(threads: usize, weight_bytes: usize) -> Option<(f64, f64, f64)> {
    let exe = std::env::current_exe().ok()?;
    let args = ["bench", "bandwidth", "--threads", &threads.to_string(), "--bytes", &weight_bytes.to_string()];
    let out = Command::new(exe).args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let v: Vec<f64> = String::from_utf8_lossy(&out.stdout).split_whitespace().filter_map(|w| w.parse().ok()).collect();
    match v[..] {
        [bound, mem, same] => Some((bound, mem, same)),
        _ => None,
    }
}

/// Prefill and decode of our engine at `threads` threads, each measurement followed or preceded by
/// llama.cpp's same measurement when `llama` is there.
fn measure(
    model: &mut Model,
    ids: &[u32],
    a: &BenchInferArgs,
    threads: usize,
    weight_bytes: usize,
    batches: &[usize],
    mut llama: Option<&mut Llama>,
) -> Result<Measured> {
    model.compute = Compute { threads, exact: false };
    // A prompt as the engine takes it: one call, which runs passes of up to PREFILL_CHUNK tokens.
    let feed = |m: &Model, st: &mut k3_infer::SeqState, toks: &[u32]| -> Result<()> {
        m.forward(toks, st, Logits::Last)?;
        Ok(())
    };
    let mut prefill = Vec::new();
    for n in list(&a.prefill, "prefill")? {
        let mut p = Point::default();
        for r in 0..a.repeat {
            let ours = || {
                let mut st = model.new_state();
                let t0 = Instant::now();
                feed(model, &mut st, &ids[..n])?;
                Ok(n as f64 / t0.elapsed().as_secs_f64())
            };
            let mut theirs = llama.as_deref_mut().map(|l| move || l.prefill(n));
            p.take(r, ours, theirs.as_mut().map(|f| f as &mut dyn FnMut() -> Result<f64>))?;
        }
        prefill.push((n, p));
    }
    // Decode: one sequence per engine grows through the contexts in ascending order (a 32K
    // context is prefilled once, not once per repeat); at each, `repeat` blocks of
    // `decode_tokens` are timed, the context moving on by one block each time.
    let mut decode = Vec::new();
    let mut paired = Vec::new();
    let mut st = model.new_state();
    let mut pos = 0;
    if let Some(l) = llama.as_deref_mut() {
        l.feed(0, 0)?;
    }
    for c in decode_contexts(a)? {
        if c > pos {
            feed(model, &mut st, &ids[pos..c])?;
            if let Some(l) = llama.as_deref_mut() {
                l.feed(pos, c)?;
            }
            pos = c;
        }
        let mut p = Point::default();
        for r in 0..a.repeat {
            let block = pos..pos + a.decode_tokens;
            let had = paired.len();
            let ours = || {
                // At context 0 the bandwidth is probed right before each of our repeats, so that
                // each ratio to the bound pairs a decode and a probe from the same moment.
                let bw = if c == 0 { probe_child(threads, weight_bytes).map(|p| p.0) } else { None };
                if c == 0 {
                    // The probe kept both cores busy long enough for our worker to go to sleep;
                    // woken by the first job, the scheduler could queue it behind the caller's
                    // core for a tick or more, inside the timed block (2-thread decode @0 of
                    // `tiny` read 2.7-4.3K tok/s after a probe against 7.3-7.7K once the
                    // threads have met; the 370M's blocks dipped to 107-118 tok/s against
                    // 125-148). llama.cpp's blocks never follow the probe directly.
                    k3_infer::threads::Pool::global().rendezvous(threads, std::time::Duration::from_millis(50));
                }
                let t0 = Instant::now();
                for &tok in &ids[block.clone()] {
                    model.forward(&[tok], &mut st, Logits::Last)?;
                }
                let rate = a.decode_tokens as f64 / t0.elapsed().as_secs_f64();
                if let Some(before) = bw {
                    paired.push(Paired { tok_s: rate, before, after: None });
                }
                Ok(rate)
            };
            let mut theirs = llama.as_deref_mut().map(|l| {
                let b = block.clone();
                move || l.decode(b.start, b.end)
            });
            let ours_last = theirs.is_none() || r % 2 == 1; // the order `Point::take` runs them in
            p.take(r, ours, theirs.as_mut().map(|f| f as &mut dyn FnMut() -> Result<f64>))?;
            // And a probe right after our block, so that a repeat across a switch of the host's
            // memory state shows as one (its two probes disagree); only where ours ran last in
            // the pair, so that llama.cpp's blocks still never follow a probe directly.
            if let Some(last) = paired.get_mut(had).filter(|_| ours_last) {
                last.after = probe_child(threads, weight_bytes).map(|p| p.0);
            }
            pos += a.decode_tokens;
        }
        decode.push((c, p));
    }
    // Batched decode: B sequences, each fed `batch_ctx` ids untimed, then `repeat` blocks of
    // steps, the sequences growing; sequence b's id at position p is ids[(p·B + b) mod len] in
    // both engines.
    let mut batch = Vec::new();
    for &nb in batches {
        let (steps, ctx) = (a.decode_tokens, a.batch_ctx);
        let tok = |b: usize, p: usize| ids[(p * nb + b) % ids.len()];
        let mut states: Vec<k3_infer::SeqState> = (0..nb).map(|_| model.new_state()).collect();
        if ctx > 0 {
            for (b, st) in states.iter_mut().enumerate() {
                let prompt: Vec<u32> = (0..ctx).map(|p| tok(b, p)).collect();
                feed(model, st, &prompt)?;
            }
        }
        if let Some(l) = llama.as_deref_mut() {
            l.batch_start(nb, ctx, ctx + a.repeat * steps)?;
        }
        let mut p = Point::default();
        for r in 0..a.repeat {
            let lo = ctx + r * steps;
            let ours = || {
                let t0 = Instant::now();
                for s in lo..lo + steps {
                    let toks: Vec<u32> = (0..nb).map(|b| tok(b, s)).collect();
                    let mut refs: Vec<&mut k3_infer::SeqState> = states.iter_mut().collect();
                    model.forward_batch(&toks, &mut refs)?;
                }
                Ok((nb * steps) as f64 / t0.elapsed().as_secs_f64())
            };
            let mut theirs = llama.as_deref_mut().map(|l| move || l.batch(nb, lo, steps));
            p.take(r, ours, theirs.as_mut().map(|f| f as &mut dyn FnMut() -> Result<f64>))?;
        }
        batch.push((nb, p));
    }
    Ok(Measured { prefill, decode, batch, paired })
}

pub fn run(a: &BenchInferArgs) -> Result<()> {
    // What the process holds before the model: the binary (with libtorch where it was built
    // with `train`), for the peak's share that is the engine's.
    let start_rss = rss_mib("VmRSS:");
    let with_llama = !(a.no_llama || a.model.is_dir());
    // First loads of fresh processes, before this process has loaded anything; then, in this
    // process, one load apart (`first`) and `--load-repeat` more: the first load of a process
    // reads the file into the page cache and faults in fresh memory, and llama.cpp's loads, which
    // come later, would find both warm after ours.
    let threads = list(&a.threads, "threads")?;
    let fresh = fresh_loads(&a.model, threads.first().copied().unwrap_or(1), a.fresh_loads, with_llama)?;
    let ours_first = if a.load_repeat > 0 { Some(timed_load(&a.model)?.0) } else { None };
    let ours_loads = (0..a.load_repeat).map(|_| Ok(timed_load(&a.model)?.0)).collect::<Result<Vec<f64>>>()?;
    let (mut model, _) = Model::load(&a.model).with_context(|| format!("loading {}", a.model.display()))?;
    // Measured with the weights where they stay: on huge pages once their promotion is done.
    let promoted = k3_infer::hugepages::wait_promoted().as_secs_f64();
    // The quality windows up front, so that a wrong --reference or --quality-data fails before
    // the speed runs, not after them.
    let quality_windows = match &a.reference {
        Some(r) => {
            if a.quality_windows == 0 || a.quality_context < 2 {
                bail!("--quality-windows must be at least 1 and --quality-context at least 2");
            }
            if !r.exists() {
                bail!(
                    "--reference {}: no such file or directory (give the f32 checkpoint directory or an f32 GGUF)",
                    r.display()
                );
            }
            let ws = match &a.quality_data {
                Some(d) => crate::quant_eval::val_windows(&model, &a.model, d, a.quality_windows, a.quality_context)
                    .with_context(|| format!("--quality-data {}", d.display()))?,
                None => random_windows(model.vocab_size(), a.quality_windows, a.quality_context.min(model.n_ctx)),
            };
            Some((r, ws))
        }
        None => None,
    };
    let batches = batch_sizes(a)?;
    let batch_len = a.batch_ctx + a.repeat * a.decode_tokens;
    if !batches.is_empty() && batch_len > model.n_ctx {
        bail!(
            "--batch-ctx {} plus {} repeats of {} decode tokens is {batch_len} positions, more than the model's context {}",
            a.batch_ctx,
            a.repeat,
            a.decode_tokens,
            model.n_ctx
        );
    }
    let longest = ids_needed(a)?;
    if longest > model.n_ctx {
        bail!("the benchmark needs {longest} tokens of context, the model allows {}", model.n_ctx);
    }
    // The same ids for both engines.
    let ids = k3_infer::bench_ids(longest, model.vocab_size());
    let ids_file = std::env::temp_dir().join(format!("k3mini-bench-ids-{}.txt", std::process::id()));
    std::fs::write(&ids_file, ids.iter().map(u32::to_string).collect::<Vec<_>>().join(","))?;
    let weight_bytes = weight_bytes_per_token(&a.model)? as usize;
    let huge = k3_infer::hugepages::huge_bytes();
    let isa = k3_kernels::qgemm::Isa::best();
    let far_alone = k3_kernels::qgemm::far_prefetch_alone();
    println!(
        "model {} ({:.1} MiB of weights read per decoded token), ids: {longest} pseudo-random, median of {} \
         repeats, the engines alternating (ratio: the median of the per-repeat ratios); \
         our kernels: {} for prefill, {} for decode (K3MINI_ISA overrides), decode's weights also prefetched \
         into L2 {} (K3MINI_FAR_PREFETCH_ALONE overrides); prompts in passes of up to {} tokens \
         (ours), 512 (llama.cpp's n_ubatch, its default)",
        a.model.display(),
        weight_bytes as f64 / (1 << 20) as f64,
        a.repeat,
        isa.name(),
        isa.for_tokens(1).name(),
        if far_alone { "by every product" } else { "by products shared by several threads" },
        k3_infer::model::PREFILL_CHUNK
    );
    match huge {
        Some(h) => println!(
            "on transparent huge pages after the load: {:.0} MiB, {promoted:.3} s after it returned \
             (K3MINI_HUGEPAGES=0 turns them off, for the engine and the bandwidth probes alike)",
            h as f64 / (1 << 20) as f64
        ),
        None => println!("transparent huge pages: not reported by this system"),
    }
    let mut report = Vec::new();
    let (mut decode_series, mut prefill_series, mut batch_series) = (Vec::new(), Vec::new(), Vec::new());
    let mut llama_rss = Vec::new();
    let (mut llama_loads, mut llama_first): (Vec<f64>, Option<f64>) = (Vec::new(), None);
    for (i, &n) in threads.iter().enumerate() {
        // The probes run in child processes, so this process's peak RSS stays the engine's own.
        let (bw, bw_mem, bw_same) = probe_child(n, weight_bytes).unwrap_or_else(|| probe(n, weight_bytes));
        let mut llama = match with_llama {
            false => None,
            true => Llama::start(&a.model, &ids_file, n, longest + 16)?,
        };
        if i == 0 && a.load_repeat > 0 {
            if llama.is_some() {
                let mut l = crate::bench_llama::load_times(&a.model, n, a.load_repeat + 1)?.unwrap_or_default();
                llama_first = (!l.is_empty()).then(|| l.remove(0));
                llama_loads = l;
            }
            print_loads(&ours_loads, &llama_loads, (ours_first, llama_first));
            print_fresh_loads(&fresh);
        }
        let m = measure(&mut model, &ids, a, n, weight_bytes, &batches, llama.as_mut())?;
        let version = llama.as_ref().map(|l| l.version.clone());
        let rss_llama = llama.map(Llama::quit).transpose()?;
        llama_rss.extend(rss_llama);
        let bound = bw * 1e9 / weight_bytes as f64;
        println!(
            "\n{n} thread(s): read bandwidth {bw:.1} GB/s (512 MiB: {bw_mem:.1}, the weights' size: {bw_same:.1}) \
             -> decode bound {bound:.1} tok/s"
        );
        println!("  {:<22} {:>10} {:>12} {:>8}", "", "ours", "llama.cpp", "ratio");
        let rows = m.prefill.iter().map(|(k, p)| (format!("prefill {k} tok/s"), p));
        let rows = rows.chain(m.decode.iter().map(|(k, p)| (format!("decode @{k} tok/s"), p)));
        let at = if a.batch_ctx > 0 { format!(" @{}", a.batch_ctx) } else { String::new() };
        for (label, p) in rows.chain(m.batch.iter().map(|(k, p)| (format!("batch of {k}{at}, tok/s"), p))) {
            match (p.llama(), p.ratio()) {
                (Some(l), Some(r)) => println!("  {label:<22} {:>10.1} {l:>12.1} {r:>7.2}x", p.ours()),
                _ => println!("  {label:<22} {:>10.1} {:>12} {:>8}", p.ours(), "-", "-"),
            }
        }
        if let Some((_, p)) = m.decode.iter().find(|(c, _)| *c == 0) {
            let l0 = p.llama().map_or(String::new(), |l| format!(", llama.cpp's {:.0}%", 100.0 * l / bound));
            println!("  decode @0 is {:.0}% of the bandwidth bound{l0}", 100.0 * p.ours() / bound);
        }
        let fractions: Vec<f64> = m.paired.iter().map(|p| p.tok_s * weight_bytes as f64 / (p.before * 1e9)).collect();
        let pct = |v: &[f64]| v.iter().map(|f| format!("{:.0}%", 100.0 * f)).collect::<Vec<_>>().join(", ");
        if !fractions.is_empty() {
            println!(
                "  decode @0 against a probe just before each repeat: {:.0}% of the bound (median; {})",
                100.0 * median(fractions.clone()),
                pct(&fractions)
            );
        }
        let steady = bracketed(&m.paired, weight_bytes);
        if !m.paired.is_empty() {
            let spans: Vec<String> = m
                .paired
                .iter()
                .map(|p| p.after.map_or(format!("{:.1}/-", p.before), |a| format!("{:.1}/{a:.1}", p.before)))
                .collect();
            let spread = 100.0 * STEADY_SPREAD;
            let both = m.paired.iter().filter(|p| p.after.is_some()).count();
            let of = format!(
                "{} of {both} repeats probed on both sides whose probes agree within {spread:.0}%",
                steady.len()
            );
            let figure = if steady.is_empty() {
                format!("no figure (none of the {both} repeats probed on both sides agree within {spread:.0}%)")
            } else {
                format!("{:.0}% of the bound (median of the {of}; {})", 100.0 * median(steady.clone()), pct(&steady))
            };
            println!("  decode @0 against the mean of probes just before and after a repeat: {figure}");
            println!(
                "    (GB/s before/after each repeat; with llama.cpp only those where its block came first are probed after: {})",
                spans.join(", ")
            );
        }
        let ours_of = |pts: &[(usize, Point)]| pts.iter().map(|(k, p)| (*k, p.ours())).collect::<Vec<_>>();
        let llama_of =
            |pts: &[(usize, Point)]| pts.iter().filter_map(|(k, p)| Some((*k, p.llama()?))).collect::<Vec<_>>();
        decode_series.push((format!("ours, {n} thr"), ours_of(&m.decode)));
        prefill_series.push((format!("ours, {n} thr"), ours_of(&m.prefill)));
        batch_series.push((format!("ours, {n} thr"), ours_of(&m.batch)));
        let llama_json = version.map(|v| {
            let by_key = |pts: &[(usize, f64)]| {
                pts.iter().map(|(k, r)| (k.to_string(), json!(r))).collect::<serde_json::Map<_, _>>()
            };
            json!({"prefill": by_key(&llama_of(&m.prefill)), "decode": by_key(&llama_of(&m.decode)),
                   "batch": by_key(&llama_of(&m.batch)),
                   "peak_rss_mib": rss_llama.map(|r| r.0), "start_rss_mib": rss_llama.map(|r| r.1),
                   "llama_cpp_python": v})
        });
        if llama_json.is_some() {
            decode_series.push((format!("llama.cpp, {n} thr"), llama_of(&m.decode)));
            prefill_series.push((format!("llama.cpp, {n} thr"), llama_of(&m.prefill)));
            batch_series.push((format!("llama.cpp, {n} thr"), llama_of(&m.batch)));
        }
        let each = |pts: &[(usize, Point)]| -> Value {
            pts.iter()
                .map(|(k, p)| (k.to_string(), json!({"ours": p.ours, "llama_cpp": p.llama, "ratio": p.ratio()})))
                .collect::<serde_json::Map<_, _>>()
                .into()
        };
        report.push(json!({
            "threads": n,
            "bandwidth_gbs": bw,
            "bandwidth_gbs_512mib": bw_mem,
            "bandwidth_gbs_weights_size": bw_same,
            "decode_bound_tok_s": bound,
            "ours": {"prefill": ours_of(&m.prefill), "decode": ours_of(&m.decode), "batch": ours_of(&m.batch)},
            "repeats": {"prefill": each(&m.prefill), "decode": each(&m.decode), "batch": each(&m.batch)},
            "decode0_paired": m.paired.iter().map(|p| json!({"tok_s": p.tok_s, "bandwidth_gbs": p.before,
                "bandwidth_gbs_after": p.after})).collect::<Vec<_>>(),
            "decode0_bound_fraction_paired": (!fractions.is_empty()).then(|| median(fractions.clone())),
            "decode0_steady_repeats": steady.len(),
            "decode0_bound_fraction_bracketed": (!steady.is_empty()).then(|| median(steady.clone())),
            "llama_cpp": llama_json,
        }));
    }
    let rss = rss_mib("VmHWM:");
    let theirs: Vec<String> = llama_rss.iter().map(|r| format!("{:.0}", r.0)).collect();
    let theirs_above: Vec<String> = llama_rss.iter().map(|r| format!("{:.0}", r.0 - r.1)).collect();
    println!("\npeak RSS: ours {rss:.0} MiB ({:.0} above the process before the model loaded)", rss - start_rss);
    if !batches.is_empty() {
        println!("          (both peaks include the batched runs: --batch's sequences and llama.cpp's second context)");
    }
    if !theirs.is_empty() {
        println!(
            "          llama.cpp {} MiB ({} above Python with llama_cpp imported), per thread count",
            theirs.join(" / "),
            theirs_above.join(" / ")
        );
    }
    let _ = std::fs::remove_file(&ids_file);
    // Quality last, once the speed model is dropped and the peak RSS is read: the f32
    // reference is several times the quantized model's size.
    let quality = match quality_windows {
        Some((r, ws)) => {
            drop(model);
            let n = threads.iter().copied().max().unwrap_or(1);
            Some(
                quality(a, r, &ws, n)
                    .with_context(|| format!("judging {} against --reference {}", a.model.display(), r.display()))?,
            )
        }
        None => None,
    };
    if let Some(p) = &a.json {
        let j = json!({"model": a.model.display().to_string(), "weight_bytes_per_token": weight_bytes,
                       "isa_prefill": isa.name(), "isa_decode": isa.for_tokens(1).name(),
                       "far_prefetch_alone": far_alone,
                       "peak_rss_mib_ours": rss, "start_rss_mib_ours": start_rss,
                       "huge_pages_mib_after_load": huge.map(|h| h as f64 / (1 << 20) as f64),
                       "huge_pages_seconds_after_load": promoted,
                       "load_seconds": {"ours": ours_loads, "llama_cpp": llama_loads,
                                        "ours_first": ours_first, "llama_cpp_first": llama_first,
                                        "fresh_process_ours": fresh.ours, "fresh_process_llama_cpp": fresh.llama,
                                        "fresh_process_ours_huge_pages_after": fresh.ours_huge},
                       "decode_tokens": a.decode_tokens, "repeat": a.repeat, "batch_ctx": a.batch_ctx,
                       "prefill_pass_tokens": {"ours": k3_infer::model::PREFILL_CHUNK, "llama_cpp": 512},
                       "runs": report, "quality": quality});
        k3_format::safetensors_io::write_atomic(p, serde_json::to_string_pretty(&j)?.as_bytes())?;
    }
    if let Some(p) = &a.plot {
        let name = a.model.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
        k3_plot::write_png(p, &chart(format!("decode speed, {name}"), "context (tokens)", decode_series), 900, 560)?;
        let stem = p.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        let pp = p.with_file_name(format!("{stem}-prefill.png"));
        k3_plot::write_png(&pp, &chart(format!("prefill speed, {name}"), "prompt (tokens)", prefill_series), 900, 560)?;
        if batch_series.iter().any(|(_, pts)| !pts.is_empty()) {
            let pb = p.with_file_name(format!("{stem}-batch.png"));
            let title = format!("batched decode at context {}, {name} (all sequences' tokens/s)", a.batch_ctx);
            k3_plot::write_png(&pb, &chart(title, "sequences decoded together", batch_series), 900, 560)?;
        }
    }
    Ok(())
}

/// The benchmarked GGUF judged against the f32 `reference` over the windows `ws` (KL, top-1,
/// perplexity), in our engine and, unless `--no-llama`, in llama.cpp on the same file; printed,
/// and returned for the JSON.
fn quality(a: &BenchInferArgs, reference: &Path, ws: &[Vec<u32>], threads: usize) -> Result<Value> {
    use crate::quant_eval::{judge_model, reference_logprobs, reference_ppl, score};
    let (v, ref_lp) = {
        let rm = crate::native::load(reference, threads, true)?;
        (rm.vocab_size(), reference_logprobs(&rm, reference, ws)?)
    };
    let ref_ppl = reference_ppl(&ref_lp, ws, v);
    let j = judge_model(&a.model, &ref_lp, ws, v, threads)?;
    let ours = (j.kl, j.top1, j.ppl);
    let theirs = match a.no_llama || a.model.is_dir() {
        true => None,
        false => match crate::bench_llama::window_logits(&a.model, ws, threads, v)? {
            Some(mut l) => Some(score(&ref_lp, ws, v, |i| Ok(std::mem::take(&mut l[i])))?),
            None => None,
        },
    };
    let source = match &a.quality_data {
        Some(d) => format!("of {} (validation split)", d.display()),
        None => "of pseudo-random ids (KL measures the quantization error; perplexity on random ids is not \
                 a language measure)"
            .to_string(),
    };
    println!(
        "\nquality against {} (f32, perplexity {ref_ppl:.3}): {} windows x {} tokens {source}",
        reference.display(),
        ws.len(),
        ws[0].len()
    );
    println!("  {:<10} {:>12} {:>8} {:>12} {:>8}", "", "KL (nats)", "top-1", "perplexity", "Δppl");
    for (who, q) in [("ours", Some(ours)), ("llama.cpp", theirs)] {
        if let Some((kl, top1, ppl)) = q {
            println!("  {who:<10} {kl:>12.5} {top1:>8.4} {ppl:>12.3} {:>+7.2}%", 100.0 * (ppl / ref_ppl - 1.0));
        }
    }
    let each = |q: (f64, f64, f64)| json!({"kl": q.0, "top1": q.1, "ppl": q.2});
    Ok(json!({"reference": reference.display().to_string(), "reference_ppl": ref_ppl, "windows": ws.len(),
              "context": ws[0].len(), "data": a.quality_data.as_ref().map(|d| d.display().to_string()),
              "kl": ours.0, "top1": ours.1, "ppl": ours.2, "llama_cpp": theirs.map(each)}))
}

/// `n` windows of `ctx` pseudo-random ids (the benchmark's generator, a different stretch per
/// window).
fn random_windows(vocab: usize, n: usize, ctx: usize) -> Vec<Vec<u32>> {
    k3_infer::bench_ids(n * ctx, vocab).chunks_exact(ctx).map(<[u32]>::to_vec).collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bracketed_repeats_count_only_where_the_two_probes_agree() {
        let gb = 1_000_000_000; // a token reads 1 GB: the fraction is tok/s over GB/s
        let p = |tok_s, before, after| Paired { tok_s, before, after };
        let paired = [
            p(40.0, 50.0, Some(50.0)), // steady: 40 / 50
            p(30.0, 50.0, Some(30.0)), // across a switch (50 vs 30): left out
            p(27.0, 30.0, Some(32.0)), // 2 apart, mean 31: within 10%
            p(20.0, 30.0, None),       // no second probe: left out
            p(21.0, 20.0, Some(22.1)), // 2.1 apart, mean 21.05: within 10% (9.98%)
            p(21.0, 20.0, Some(22.3)), // 2.3 apart, mean 21.15: 10.9%, left out
        ];
        let got = bracketed(&paired, gb);
        let want = [0.8, 27.0 / 31.0, 21.0 / 21.05];
        assert_eq!(got.len(), want.len(), "{got:?}");
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-12, "{got:?} against {want:?}");
        }
        assert!(bracketed(&paired[1..2], gb).is_empty());
    }
}
