//! `k3mini`: the K3-Mini command-line tool.
//!
//! Pure-Rust commands (always available): `info`, `presets`, `logits` (native engine),
//! `generate`, `quantize`. With the `train` feature (libtorch through tch): `init`,
//! `logits --engine torch`.

mod bench_infer;
mod bench_llama;
mod bench_load;
#[cfg(feature = "train")]
mod bench_train;
mod capture;
mod info;
mod native;
mod openai;
mod plot;
mod prompts;
mod quant_eval;
mod routing_report;
mod routing_stats;
#[cfg(feature = "train")]
mod teacher;
#[cfg(feature = "train")]
mod torch_cmds;
mod trajectories;

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "k3mini",
    version,
    about = "K3-Mini: small K3-architecture models, distilled, quantized and run on CPUs"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print a model's parameters, layer kinds and inference-state memory (pure Rust).
    Info {
        /// A checkpoint directory (config.json + safetensors) or a .gguf file (then also its
        /// tensor types, sizes and the weight bytes a decoded token reads).
        #[arg(long, conflicts_with = "preset")]
        model: Option<PathBuf>,
        /// Or a named preset (see `k3mini presets`).
        #[arg(long)]
        preset: Option<String>,
    },
    /// List the model presets and the export profile each targets.
    Presets,
    /// Initialise a model from a preset and write a Kimi checkpoint (needs the `train` feature).
    Init {
        #[arg(long)]
        preset: String,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 0)]
        seed: i64,
        /// Override the preset's vocabulary size (e.g. to match a tokenizer; with --embed-from,
        /// the teacher's by default).
        #[arg(long)]
        vocab: Option<usize>,
        /// Start the embedding and LM head from this teacher's (a GGUF or checkpoint with the
        /// same vocabulary), projected onto their top principal directions.
        #[arg(long)]
        embed_from: Option<PathBuf>,
        /// With --embed-from (a Llama-family teacher): also start every dense FFN from a teacher
        /// layer spread over its depth, narrowed to the student's width (k3_train::inherit).
        #[arg(long, requires = "embed_from")]
        inherit_ffn: bool,
    },
    /// Run a forward pass on token ids and write `logits` [T, vocab] (f32) to a safetensors file.
    Logits {
        /// A checkpoint directory or a GGUF file.
        #[arg(long)]
        model: PathBuf,
        /// Comma-separated token ids, e.g. 1,2,3.
        #[arg(long)]
        ids: String,
        #[arg(long)]
        out: PathBuf,
        /// `native` (the pure-Rust engine) or `torch` (the tch training model; needs the `train` feature).
        #[arg(long, default_value = "native")]
        engine: String,
        /// Compute threads.
        #[arg(long)]
        threads: Option<usize>,
        /// Native engine: reference numerics (f32 activations and caches, transformers'
        /// epsilons) instead of llama.cpp's (per-row quantized activations, f16 caches).
        #[arg(long)]
        exact: bool,
    },
    /// Train a model on a dataset (needs the `train` feature): `--config FILE --out RUN`.
    Train(TrainArgs),
    /// Distil a teacher into a student (needs the `train` feature): a training config with a
    /// `[distill]` section, offline from a `k3mini capture` store or online with the teacher in
    /// process. Checkpoints, `--resume` and progress as `train`.
    Distill(TrainArgs),
    /// Validation loss and perplexity of a checkpoint on a dataset, at one or more context lengths.
    Eval {
        #[arg(long)]
        model: PathBuf,
        /// A dataset directory built by `k3mini data build` (its validation split is used).
        #[arg(long)]
        data: PathBuf,
        /// Context lengths, comma-separated (e.g. 256,1024).
        #[arg(long, default_value = "256")]
        context: String,
        /// Windows per context length.
        #[arg(long, default_value_t = 32)]
        windows: usize,
        /// Windows per forward pass.
        #[arg(long, default_value_t = 4)]
        batch: usize,
        #[arg(long)]
        threads: Option<usize>,
        /// Also write the results as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
        /// A teacher-signal store over held-out windows (`k3mini capture --split val`): also report
        /// KL to the teacher and top-1 agreement with it.
        #[arg(long)]
        signals: Option<PathBuf>,
    },
    /// Run a teacher over a dataset's windows and store its top-k log-probabilities (resumable).
    Capture(capture::CaptureArgs),
    /// Probe an OpenAI-compatible teacher endpoint: which log-probability features it really
    /// returns, and whether echoed prompt log-probs are aligned, shifted by one, or unusable.
    Probe {
        /// e.g. http://127.0.0.1:8000/v1
        #[arg(long)]
        endpoint: String,
        #[arg(long)]
        model: Option<String>,
        #[arg(long, default_value = "OPENAI_API_KEY")]
        api_key_env: String,
        /// Also write the report as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Draw one metric of several training runs against tokens, as a PNG.
    Plot(plot::PlotArgs),
    /// Benchmarks that print ratios against anchors measured in the same run.
    #[command(subcommand)]
    Bench(BenchCmd),
    /// Generate text from a prompt, streaming it to stdout (pure-Rust engine).
    Generate(native::GenerateArgs),
    /// A MoE model's routing per layer and domain against uniform baselines (JSON + heatmaps),
    /// and a student MoE layout for a target domain (pure Rust, streamed).
    RoutingStats(routing_stats::RoutingStatsArgs),
    /// Code-task prompt sets (docstring -> body, signature -> implementation) from a dataset's
    /// own Python sources, train or held-out split.
    Prompts(prompts::PromptsArgs),
    /// Greedy continuations of prompts by a model, scored by a teacher (log-prob/token, top-1
    /// agreement), and the model's loss on each prompt's reference body (pure Rust).
    Score(prompts::ScoreArgs),
    /// Training data: build a tokenized dataset from offline sources.
    #[command(subcommand)]
    Data(DataCmd),
    /// Write a GGUF (f32, f16, q8_0, q4_0, q4_1, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl, iq4_xs) that llama.cpp and `k3mini` load.
    Quantize {
        /// A checkpoint directory (config.json + safetensors, optionally tokenizer.json), or a
        /// GGUF to re-quantize.
        #[arg(long)]
        model: PathBuf,
        #[arg(long = "type", value_name = "TYPE")]
        ty: String,
        #[arg(long)]
        out: PathBuf,
        /// Importance-weighted quantization (Q4_0, IQ4_NL, IQ4_XS): calibrate on this dataset's
        /// train split (built with the model's tokenizer) and choose each block's scale by the
        /// activations it meets.
        #[arg(long)]
        calib: Option<PathBuf>,
        #[arg(long, default_value_t = 32)]
        calib_windows: usize,
        #[arg(long, default_value_t = 256)]
        calib_context: usize,
        #[arg(long, default_value_t = 1)]
        threads: usize,
    },
    /// KL divergence to the f32 model, top-1 agreement and perplexity of quantized GGUFs on
    /// held-out windows (pure Rust).
    QuantEval(quant_eval::QuantEvalArgs),
}

#[derive(clap::Args)]
pub struct TrainArgs {
    /// The training config (TOML); with --resume, defaults to RUN/train.toml.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The run directory (metrics.jsonl, loss.png, checkpoints/).
    #[arg(long)]
    pub out: PathBuf,
    /// Override a config field: --set optim.lr=1e-3 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Continue from the newest checkpoint in --out, exactly where it stopped.
    #[arg(long)]
    pub resume: bool,
    /// Stop (with a checkpoint) after this many optimiser steps in total; resume later.
    #[arg(long)]
    pub stop_at: Option<u64>,
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Inference speed: our engine vs llama.cpp on the same GGUF, ids and threads, with ratios.
    Infer(Box<bench_infer::BenchInferArgs>),
    /// Read bandwidth of this machine (GB/s) at a thread count: the probe `bench infer` divides
    /// weight bytes by (it runs it in a child process next to each decode measurement). Prints
    /// the bound's bandwidth, then a 512 MiB read's and a read of `--bytes` (the weights' size).
    Bandwidth {
        #[arg(long, default_value_t = 1)]
        threads: usize,
        /// Bytes of the second buffer (the weights one decoded token reads)
        #[arg(long, default_value_t = bench_infer::PROBE_BYTES)]
        bytes: usize,
    },
    /// One load of MODEL in this process, timed: prints its seconds, then the seconds after it
    /// returned until the weights were on huge pages (the fresh-process loads of `bench infer`).
    #[command(hide = true)]
    Load {
        #[arg(long)]
        model: PathBuf,
    },
    /// Training-step speed: ours vs transformers' KimiLinear vs a PyTorch Llama (needs `train`).
    #[cfg(feature = "train")]
    Train(bench_train::BenchTrainArgs),
    /// (built without the `train` feature: unavailable)
    #[cfg(not(feature = "train"))]
    Train,
}

#[derive(Subcommand)]
enum DataCmd {
    /// Collect, deduplicate, split (by document) and tokenize sources into memory-mapped shards.
    Build {
        /// stdlib | english | pip:NAME==VERSION | dir:PATH (repeatable).
        #[arg(long = "source", required = true)]
        sources: Vec<String>,
        /// bpe:N (train a byte-level BPE of N tokens) | tokenizer.json | model.gguf (its vocabulary).
        #[arg(long)]
        tokenizer: String,
        #[arg(long)]
        out: PathBuf,
        /// Documents per 1000 (by content hash) that go to validation.
        #[arg(long, default_value_t = 50)]
        val_permille: u32,
    },
}

/// Parse `1,2,3` into ids, naming the bad entry.
pub fn parse_ids(s: &str) -> Result<Vec<i64>> {
    let ids: Vec<i64> = s
        .split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(|x| x.parse::<i64>().with_context(|| format!("--ids: `{x}` is not a token id (expected e.g. 1,2,3)")))
        .collect::<Result<_>>()?;
    if ids.is_empty() {
        bail!("--ids is empty: give at least one token id, e.g. --ids 1,2,3");
    }
    if let Some(bad) = ids.iter().find(|&&x| x < 0) {
        bail!("--ids: {bad} is negative; token ids are >= 0");
    }
    Ok(ids)
}

/// Small blocks freed and taken again within a decode step stay with their thread
/// (k3_infer::alloc; `K3MINI_ALLOC_CACHE=0` hands each back to glibc at once).
#[global_allocator]
static ALLOC: k3_infer::alloc::ThreadCache = k3_infer::alloc::ThreadCache;

fn main() {
    k3_infer::keep_freed_buffers();
    if std::env::var("K3MINI_ALLOC_CACHE").is_ok_and(|v| v.trim() == "0") {
        k3_infer::alloc::set_enabled(false);
    }
    if let Err(e) = run() {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Info { model, preset } => info::run(model.as_deref(), preset.as_deref()),
        Cmd::Presets => {
            for (name, profile, desc) in k3_config::presets::PRESETS {
                println!("{name:<11} {profile:<12} {desc}");
            }
            Ok(())
        }
        #[cfg(feature = "train")]
        Cmd::Init { preset, out, seed, vocab, embed_from, inherit_ffn } => {
            torch_cmds::init(&preset, &out, seed, vocab, embed_from.as_deref(), inherit_ffn)
        }
        Cmd::Logits { model, ids, out, engine, threads, exact } if engine == "native" => {
            native::logits(&model, &parse_ids(&ids)?, &out, threads.unwrap_or(1), exact)
        }
        #[cfg(feature = "train")]
        Cmd::Logits { model, ids, out, engine, threads, .. } => torch_cmds::logits(&model, &parse_ids(&ids)?, &out, &engine, threads),
        #[cfg(feature = "train")]
        Cmd::Train(args) => torch_cmds::train(&args, false),
        #[cfg(feature = "train")]
        Cmd::Distill(args) => torch_cmds::train(&args, true),
        #[cfg(feature = "train")]
        Cmd::Eval { model, data, context, windows, batch, threads, json, signals } => {
            torch_cmds::eval(&model, &data, &context, windows, batch, threads, json.as_deref(), signals.as_deref())
        }
        Cmd::Bench(BenchCmd::Infer(a)) => bench_infer::run(&a),
        Cmd::Bench(BenchCmd::Bandwidth { threads, bytes }) => {
            let (bound, mem, same) = bench_infer::probe(threads.max(1), bytes);
            println!("{bound:.3} {mem:.3} {same:.3}");
            Ok(())
        }
        Cmd::Bench(BenchCmd::Load { model }) => {
            let (load, promoted) = bench_load::timed_load(&model)?;
            println!("{load:.6} {promoted:.6}");
            Ok(())
        }
        #[cfg(feature = "train")]
        Cmd::Bench(BenchCmd::Train(a)) => bench_train::run(&a),
        #[cfg(not(feature = "train"))]
        Cmd::Bench(BenchCmd::Train) => bail!("bench train needs the `train` feature (libtorch)"),
        Cmd::Plot(a) => plot::run(&a),
        Cmd::Capture(a) => capture::run(&a),
        Cmd::Probe { endpoint, model, api_key_env, json } => {
            let mut e = openai::Endpoint::connect(&endpoint, model.as_deref(), std::env::var(&api_key_env).ok(), 0.0)?;
            let p = openai::probe(&mut e)?;
            let text = serde_json::to_string_pretty(&p)?;
            println!("{text}");
            if let Some(path) = json {
                k3_format::safetensors_io::write_atomic(&path, text.as_bytes())?;
            }
            Ok(())
        }
        Cmd::Generate(args) => native::generate(&args),
        Cmd::RoutingStats(a) => routing_stats::run(&a),
        Cmd::Prompts(a) => prompts::prompts(&a),
        Cmd::Score(a) => prompts::score(&a),
        Cmd::Data(DataCmd::Build { sources, tokenizer, out, val_permille }) => {
            data_build(sources, tokenizer, out, val_permille)
        }
        Cmd::Quantize { model, ty, out, calib, calib_windows, calib_context, threads } => {
            let imp = match &calib {
                Some(_) if !k3_quant::QuantType::parse(&ty)?.calibrates() => {
                    bail!("--calib: importance-weighted quantization is built for --type q4_0, iq4_nl and iq4_xs only")
                }
                Some(d) => Some(quant_eval::calibrate(&model, d, calib_windows, calib_context, threads)?),
                None => None,
            };
            native::quantize(&model, &ty, &out, imp.as_ref())
        }
        Cmd::QuantEval(a) => quant_eval::quant_eval(&a),
        #[cfg(not(feature = "train"))]
        Cmd::Logits { engine, .. } => bail!(
            "--engine `{engine}`: this k3mini was built without the `train` feature (libtorch); allowed here: native"
        ),
        #[cfg(not(feature = "train"))]
        Cmd::Init { .. } | Cmd::Train(_) | Cmd::Distill(_) | Cmd::Eval { .. } => bail!(
            "this k3mini was built without the `train` feature (libtorch); use the binary that scripts/quickstart builds, \
             or build with `cargo build -p k3-cli --features train` inside the project venv (see README)"
        ),
    }
}

fn cache_dir() -> PathBuf {
    let home = std::env::var_os("K3MINI_HOME").map(PathBuf::from).unwrap_or_else(|| {
        let base = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache"));
        base.join("k3mini")
    });
    home.join("corpus")
}

fn data_build(sources: Vec<String>, tokenizer: String, out: PathBuf, val_permille: u32) -> Result<()> {
    let t0 = std::time::Instant::now();
    let opts =
        k3_data::dataset::BuildOptions { sources, tokenizer, out: out.clone(), val_permille, cache: cache_dir() };
    let m = k3_data::dataset::build(&opts).with_context(|| format!("building the dataset in {}", out.display()))?;
    println!(
        "documents  {} train + {} val ({} duplicates dropped; skipped: {} binary, {} invalid UTF-8, {} too large)",
        m.train_docs, m.val_docs, m.duplicates, m.skipped_binary, m.skipped_invalid_utf8, m.skipped_too_large
    );
    println!("bytes      {} train + {} val", m.train_bytes, m.val_bytes);
    println!(
        "tokens     {} train + {} val (vocab {}, separator id {})",
        m.train_tokens, m.val_tokens, m.vocab_size, m.separator
    );
    println!("bytes/tok  {:.3}", m.bytes_per_token());
    println!("tokenizer  sha256 {}", m.tokenizer_hash);
    println!("wrote {} in {:.1}s", out.display(), t0.elapsed().as_secs_f64());
    Ok(())
}
