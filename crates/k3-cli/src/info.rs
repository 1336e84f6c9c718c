//! `k3mini info`: parameters, layer kinds and inference-state memory, from the config alone; for
//! a GGUF file also its tensor types and the weight bytes a decoded token reads.

use std::path::Path;

use anyhow::{bail, Context, Result};
use k3_config::count::{gqa_baseline_bytes, human_bytes, kimi_state_bytes, llama_state_bytes, pure_mla_state_bytes};
use k3_config::{FfnKind, Mixer, ModelConfig};
use k3_format::param_counts;
use k3_kernels::quant::GgmlType;

const CONTEXTS: [(u64, &str); 4] = [(4096, "4K"), (32768, "32K"), (131072, "128K"), (1 << 20, "1M")];

fn millions(n: usize) -> String {
    if n >= 1_000_000_000 {
        format!("{:.2}B", n as f64 / 1e9)
    } else {
        format!("{:.2}M", n as f64 / 1e6)
    }
}

pub fn run(model: Option<&Path>, preset: Option<&str>) -> Result<()> {
    if let Some(path) = model.filter(|p| p.is_file()) {
        let f = k3_format::gguf::GgufFile::open(path)?;
        let cfg = k3_format::gguf_map::config_from_gguf(&f)?;
        print!("{}", summary(&cfg, &path.display().to_string()));
        print!("{}", gguf_summary(&f, path)?);
        return Ok(());
    }
    let (cfg, source) = match (model, preset) {
        (Some(dir), _) => {
            let (cfg, warnings) = k3_format::checkpoint::read_config(dir)?;
            for w in warnings {
                eprintln!("warning: {w}");
            }
            (cfg, dir.display().to_string())
        }
        (None, Some(name)) => (k3_config::presets::preset(name, None)?, format!("preset `{name}`")),
        (None, None) => bail!("give --model DIR or --preset NAME"),
    };
    print!("{}", summary(&cfg, &source));
    Ok(())
}

/// What a GGUF file holds beyond its config: version, size, tensors by type, and the weight
/// bytes one decoded token reads (the bandwidth bound's numerator in `bench infer`).
fn gguf_summary(f: &k3_format::gguf::GgufFile, path: &Path) -> Result<String> {
    let mut by_type: Vec<(&'static str, usize, u64)> = Vec::new();
    for t in &f.tensors {
        let name = GgmlType::name_of_id(t.type_id);
        let bytes =
            t.nbytes().with_context(|| format!("{}: tensor {} has an unknown type {name}", path.display(), t.name))?;
        match by_type.iter_mut().find(|(n, _, _)| *n == name) {
            Some(e) => {
                e.1 += 1;
                e.2 += bytes;
            }
            None => by_type.push((name, 1, bytes)),
        }
    }
    by_type.sort_by_key(|e| std::cmp::Reverse(e.2));
    let size = std::fs::metadata(path).with_context(|| format!("{}: cannot read its size", path.display()))?.len();
    let mut s = format!(
        "gguf        version {}, {}, {} tensors, architecture `{}`\n",
        f.version,
        human_bytes(size),
        f.tensors.len(),
        f.arch().unwrap_or("?")
    );
    let types: Vec<String> = by_type.iter().map(|(name, n, b)| format!("{name} {n} ({})", human_bytes(*b))).collect();
    s += &format!("tensors     {}\n", types.join(", "));
    let per_token = crate::bench_infer::gguf_weight_bytes_per_token(f)?;
    s += &format!(
        "decode      {} of weights read per token (every tensor but an untied embedding table, of which a token reads one row; MoE: the routed share)\n",
        human_bytes(per_token)
    );
    Ok(s)
}

/// The model summary printed by `info` (and by the quickstart).
pub fn summary(cfg: &ModelConfig, source: &str) -> String {
    let mut s = String::new();
    let p = param_counts(cfg);
    s += &format!("model       {source}\narch        {}\n", cfg.arch_name());
    s += &format!(
        "params      total {} ({}), active per token {}, embedding + head {}\n",
        millions(p.total),
        p.total,
        millions(p.active),
        millions(p.embedding)
    );
    s +=
        &format!("dims        hidden {}, vocab {}, layers {}\n", cfg.hidden_size(), cfg.vocab_size(), cfg.num_layers());
    match cfg {
        ModelConfig::Kimi(c) => {
            let kinds: String = c
                .layers
                .iter()
                .map(|l| match (l.mixer, l.ffn) {
                    (Mixer::Kda, FfnKind::Dense) => 'K',
                    (Mixer::Kda, FfnKind::Moe) => 'k',
                    (Mixer::Mla, FfnKind::Dense) => 'M',
                    (Mixer::Mla, FfnKind::Moe) => 'm',
                })
                .collect();
            s += &format!(
                "layers      {} KDA + {} MLA; {} dense FFN + {} MoE   [{kinds}]  (K/M = KDA/MLA, upper case dense, lower case MoE)\n",
                c.count_mixer(Mixer::Kda),
                c.count_mixer(Mixer::Mla),
                c.layers.iter().filter(|l| l.ffn == FfnKind::Dense).count(),
                c.layers.iter().filter(|l| l.ffn == FfnKind::Moe).count()
            );
            let heads = (c.hidden_size / 128).max(1);
            let n_kv = (heads / 4).max(1);
            s += "state       per sequence; KDA state + conv tail in f32, MLA/GQA caches in bf16\n";
            s += &format!(
                "            {:>6}  {:>11}  {:>11}  {:>22}\n",
                "ctx",
                "this model",
                "pure MLA",
                format!("GQA ({heads}q/{n_kv}kv × 128)")
            );
            for (t, name) in CONTEXTS {
                s += &format!(
                    "            {:>6}  {:>11}  {:>11}  {:>22}\n",
                    name,
                    human_bytes(kimi_state_bytes(c, t)),
                    human_bytes(pure_mla_state_bytes(c, t)),
                    human_bytes(gqa_baseline_bytes(c.hidden_size, c.layers.len(), t))
                );
            }
        }
        ModelConfig::Llama(c) => {
            s += &format!(
                "attention   {} query / {} KV heads of {}, RoPE θ {}\n",
                c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rope_theta
            );
            s += "state       per sequence, KV cache in bf16\n";
            for (t, name) in CONTEXTS {
                s += &format!("            {:>6}  {:>11}\n", name, human_bytes(llama_state_bytes(c, t)));
            }
        }
    }
    s
}
