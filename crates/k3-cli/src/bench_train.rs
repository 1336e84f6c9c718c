//! `k3mini bench train`: the training step (forward + backward + optimiser) of three
//! implementations timed side by side in one run, with ratios:
//! ours (tch), transformers' `KimiLinearForCausalLM` on the same config through its pure-PyTorch
//! path, and a same-size `LlamaForCausalLM` in PyTorch (plus our own Llama for reference).

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use k3_config::{presets, ModelConfig};
use k3_train::trainer::config::{OptimKind, OptimSection};
use k3_train::trainer::optim::Optimizer;
use k3_train::Model;
use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};

#[derive(clap::Args)]
pub struct BenchTrainArgs {
    #[arg(long, default_value_t = 256)]
    pub hidden: usize,
    #[arg(long, default_value_t = 8)]
    pub layers: usize,
    #[arg(long, default_value_t = 256)]
    pub seq: usize,
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Timed steps per implementation (the median is reported), after one warm-up step.
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// Skip the PyTorch anchors (ours only).
    #[arg(long)]
    pub no_python: bool,
}

/// The benchmark configs: the hybrid (3 KDA : 1 MLA, heads of 64) and a GQA Llama of the same
/// width, depth and FFN (architecture.md §8 config A scaled to `hidden`).
fn configs(a: &BenchTrainArgs) -> Result<(ModelConfig, ModelConfig, ModelConfig)> {
    let heads = (a.hidden / 64).max(1);
    let mut k = presets::tiny();
    k.hidden_size = a.hidden;
    k.intermediate_size = a.hidden * 11 / 4;
    k.layers = k3_config::KimiConfig::hybrid_layout(a.layers, |_| k3_config::FfnKind::Dense);
    k.kda.num_heads = heads;
    k.mla.num_heads = heads;
    let mut l = presets::tiny_llama();
    l.hidden_size = a.hidden;
    l.intermediate_size = k.intermediate_size;
    l.num_hidden_layers = a.layers;
    l.num_attention_heads = heads;
    l.num_key_value_heads = (heads / 2).max(1);
    let mut all_kda = k.clone();
    all_kda.layers = (0..a.layers)
        .map(|_| k3_config::LayerKind { mixer: k3_config::Mixer::Kda, ffn: k3_config::FfnKind::Dense })
        .collect();
    let (k, l, kda) = (ModelConfig::Kimi(k), ModelConfig::Llama(l), ModelConfig::Kimi(all_kda));
    k.validate()?;
    l.validate()?;
    kda.validate()?;
    Ok((k, l, kda))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median seconds per training step of our model.
fn time_ours(cfg: &ModelConfig, a: &BenchTrainArgs, kind: OptimKind) -> Result<(i64, Vec<f64>)> {
    let model = Model::init(cfg, 0, Device::Cpu)?;
    let mut sec: OptimSection = toml::from_str("").context("default optimiser section")?;
    sec.kind = kind;
    sec.lr = 1e-3;
    let mut opt = Optimizer::new(&model, &sec);
    let v = cfg.vocab_size() as i64;
    let ids = Tensor::randint(v, [a.batch as i64, a.seq as i64 + 1], (Kind::Int64, Device::Cpu));
    let (x, y) = (ids.narrow(1, 0, a.seq as i64), ids.narrow(1, 1, a.seq as i64));
    let mut times = Vec::new();
    for i in 0..a.steps + 1 {
        let t0 = Instant::now();
        let out = model.forward(&x, None, false);
        out.logits.view([-1, v]).cross_entropy_for_logits(&y.reshape([-1])).backward();
        opt.step(1e-3);
        opt.zero_grad();
        if i > 0 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok((model.num_params(), times))
}

pub fn run(a: &BenchTrainArgs) -> Result<()> {
    k3_train::nn::flush_denormals();
    tch::set_num_threads(a.threads as i32);
    let (kimi, llama, all_kda) = configs(a)?;
    let dir = std::env::temp_dir().join(format!("k3mini-bench-train-{}", std::process::id()));
    for (name, c) in [("kimi", &kimi), ("llama", &llama)] {
        std::fs::create_dir_all(dir.join(name))?;
        std::fs::write(dir.join(name).join("config.json"), k3_config::hf::to_json_string(c))?;
    }
    let tokens = (a.batch * a.seq) as f64;
    println!(
        "training step, d {} x {} layers, batch {} x seq {} = {tokens} tokens, {} threads, median of {} steps",
        a.hidden, a.layers, a.batch, a.seq, a.threads, a.steps
    );
    let mut rows: Vec<(String, i64, f64)> = Vec::new();
    for (label, cfg, kind) in [
        ("ours: K3-Mini hybrid (tch), AdamW", &kimi, OptimKind::AdamW),
        ("ours: K3-Mini hybrid (tch), Muon", &kimi, OptimKind::Muon),
        ("ours: all-KDA (tch), AdamW", &all_kda, OptimKind::AdamW),
        ("ours: Llama (tch), AdamW", &llama, OptimKind::AdamW),
    ] {
        let (params, mut t) = time_ours(cfg, a, kind)?;
        let m = median(&mut t);
        println!("  {label:<44} {params:>9} params  {m:8.3} s/step  {:8.0} tokens/s", tokens / m);
        rows.push((label.into(), params, m));
    }
    let mut anchors = Vec::new();
    if !a.no_python {
        let py = std::env::var("K3MINI_PYTHON").unwrap_or_else(|_| "python3".into());
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/bench/train_step.py");
        let out = Command::new(&py)
            .arg(&script)
            .args(["--config", &dir.join("kimi").display().to_string()])
            .args(["--config", &dir.join("llama").display().to_string()])
            .args(["--batch", &a.batch.to_string(), "--seq", &a.seq.to_string()])
            .args(["--threads", &a.threads.to_string(), "--steps", &a.steps.to_string()])
            .output()
            .with_context(|| format!("running {} {} (run scripts/setup first)", py, script.display()))?;
        if !out.status.success() {
            bail!("{} failed:\n{}", script.display(), String::from_utf8_lossy(&out.stderr));
        }
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let v: Value = serde_json::from_str(line).with_context(|| format!("bad line from the script: {line}"))?;
            let label = match v["model_type"].as_str() {
                Some("llama") => "PyTorch: transformers Llama, AdamW",
                _ => "PyTorch: transformers KimiLinear, AdamW",
            };
            let m = v["median_s"].as_f64().unwrap_or(f64::NAN);
            let params = v["params"].as_i64().unwrap_or(0);
            println!("  {label:<44} {params:>9} params  {m:8.3} s/step  {:8.0} tokens/s", tokens / m);
            anchors.push((label.to_string(), params, m));
            rows.push((label.into(), params, m));
        }
        let ours = rows[0].2;
        if let [(_, _, kimi_t), (_, _, llama_t)] = anchors.as_slice() {
            println!("ratios (tokens/s, ours with AdamW over the anchor, measured in this run):");
            println!("  ours / transformers KimiLinear = {:6.2}x   (target >= 5x)", kimi_t / ours);
            println!("  ours / PyTorch Llama           = {:6.2}x   (target >= 0.5x)", llama_t / ours);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    if let Some(p) = &a.json {
        let j = json!({
            "hidden": a.hidden, "layers": a.layers, "batch": a.batch, "seq": a.seq, "threads": a.threads,
            "rows": rows.iter().map(|(l, p, m)| json!({"impl": l, "params": p, "median_s": m, "tokens_per_s": tokens / m})).collect::<Vec<_>>(),
        });
        k3_format::safetensors_io::write_atomic(p, serde_json::to_string_pretty(&j)?.as_bytes())?;
    }
    Ok(())
}
