//! `k3mini`: the K3-Mini command-line tool.
//!
//! Pure-Rust commands (always available): `info`. With the `train` feature (libtorch through
//! tch): `init`, `logits --engine torch`.

mod info;
#[cfg(feature = "train")]
mod torch_cmds;

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
        /// A checkpoint directory (config.json + safetensors).
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
        /// Override the preset's vocabulary size (e.g. to match a tokenizer).
        #[arg(long)]
        vocab: Option<usize>,
    },
    /// Run a forward pass on token ids and write `logits` [T, vocab] (f32) to a safetensors file.
    Logits {
        #[arg(long)]
        model: PathBuf,
        /// Comma-separated token ids, e.g. 1,2,3.
        #[arg(long)]
        ids: String,
        #[arg(long)]
        out: PathBuf,
        /// `torch` (the tch training model; needs the `train` feature).
        #[arg(long, default_value = "torch")]
        engine: String,
        /// Compute threads (default: libtorch's choice).
        #[arg(long)]
        threads: Option<usize>,
    },
}

/// Parse `1,2,3` into ids, naming the bad entry.
pub fn parse_ids(s: &str) -> Result<Vec<i64>> {
    let ids: Vec<i64> = s
        .split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(|x| {
            x.parse::<i64>()
                .with_context(|| format!("--ids: `{x}` is not a token id (expected e.g. 1,2,3)"))
        })
        .collect::<Result<_>>()?;
    if ids.is_empty() {
        bail!("--ids is empty: give at least one token id, e.g. --ids 1,2,3");
    }
    if let Some(bad) = ids.iter().find(|&&x| x < 0) {
        bail!("--ids: {bad} is negative; token ids are >= 0");
    }
    Ok(ids)
}

fn main() {
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
        Cmd::Init { preset, out, seed, vocab } => torch_cmds::init(&preset, &out, seed, vocab),
        #[cfg(feature = "train")]
        Cmd::Logits { model, ids, out, engine, threads } => torch_cmds::logits(&model, &parse_ids(&ids)?, &out, &engine, threads),
        #[cfg(not(feature = "train"))]
        Cmd::Init { .. } | Cmd::Logits { .. } => bail!(
            "this k3mini was built without the `train` feature (libtorch); use the binary that scripts/quickstart builds, \
             or build with `cargo build -p k3-cli --features train` inside the project venv (see README)"
        ),
    }
}
