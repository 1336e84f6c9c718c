//! `k3mini routing-stats`: a MoE model's routing, per layer and per domain, streamed through our
//! engine; each figure beside its uniform baseline (routing_report.rs), JSON plus PNG heatmaps;
//! optionally a student layout for a target domain, or a trained student checked against one.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use k3_config::ModelConfig;
use k3_infer::routing::{Accum, RoutingCollector};
use k3_infer::tokenizer::Tokenizer;
use k3_infer::Logits;
use k3_plot::{write_heatmap, Chart, Heatmap, Series, COLORS};

use crate::routing_report::{
    compare, figures, recommend, specialisation, LayerFigures, LayerView, Recommendation, Specialisation,
};

#[derive(clap::Args)]
pub struct RoutingStatsArgs {
    /// A MoE checkpoint: a Kimi-Linear / K3 directory (config.json + safetensors) or a GGUF.
    #[arg(long)]
    model: PathBuf,
    /// NAME=PATH, once per domain. PATH is a dataset built by `k3mini data build` with the model's
    /// tokenizer (its val split is read), or a text file / directory of text files, tokenized
    /// with the model's own tokenizer.
    #[arg(long = "data", required = true)]
    data: Vec<String>,
    #[arg(long)]
    out: PathBuf,
    /// Windows per domain, spread evenly over it.
    #[arg(long, default_value_t = 32)]
    windows: usize,
    /// Tokens per window.
    #[arg(long, default_value_t = 256)]
    context: usize,
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Recommend a student MoE layout for this domain (one of the --data names).
    #[arg(long)]
    target: Option<String>,
    /// A recommendation.json from an earlier run: treat --model as the student trained from it
    /// and compare its routing on --target with the recommendation.
    #[arg(long, requires = "target")]
    compare: Option<PathBuf>,
}

/// One domain's token stream.
enum Tokens {
    Dataset(k3_data::shards::TokenSet),
    Text(Vec<u32>),
}

impl Tokens {
    fn len(&self) -> usize {
        match self {
            Tokens::Dataset(t) => t.len,
            Tokens::Text(v) => v.len(),
        }
    }
    fn window(&self, start: usize, n: usize) -> Vec<u32> {
        match self {
            Tokens::Dataset(t) => {
                let mut out = Vec::with_capacity(n);
                t.read(start, n, &mut out);
                out
            }
            Tokens::Text(v) => v[start..start + n].to_vec(),
        }
    }
}

fn read_text(path: &Path, out: &mut String) -> Result<()> {
    if path.is_dir() {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(path)
            .with_context(|| format!("reading {}", path.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| !p.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')))
            .collect();
        entries.sort();
        for p in entries {
            read_text(&p, out)?;
        }
    } else if let Ok(s) = std::fs::read_to_string(path) {
        out.push_str(&s);
        out.push_str("\n\n");
    }
    Ok(())
}

fn open_domain(spec: &str, model_path: &Path, vocab: usize) -> Result<(String, Tokens)> {
    let Some((name, path)) = spec.split_once('=') else {
        bail!("--data `{spec}`: expected NAME=PATH, e.g. --data code=runs/data-code")
    };
    let path = PathBuf::from(path);
    if !path.exists() {
        bail!("--data {name}={}: no such file or directory", path.display());
    }
    let model_tok = Tokenizer::for_model(model_path).with_context(|| format!("{}: tokenizer", model_path.display()))?;
    if path.join("meta.json").exists() {
        let ds = k3_data::dataset::Dataset::open(&path)?;
        if ds.meta.vocab_size > vocab {
            bail!(
                "--data {name}={}: the dataset's vocabulary ({}) is larger than the model's ({vocab}); build it with the \
                 model's tokenizer (`k3mini data build --tokenizer MODEL/tokenizer.json`) or pass text files",
                path.display(),
                ds.meta.vocab_size
            );
        }
        if let Some(mt) = &model_tok {
            let probe = "def main(argv):\n    return sum(len(a) for a in argv)  # The quick brown fox.\n";
            if ds.tokenizer()?.encode(probe)? != mt.encode(probe)? {
                bail!(
                    "--data {name}={}: the dataset was tokenized with another tokenizer than the model's; rebuild it \
                     with `k3mini data build --tokenizer {}` or pass text files",
                    path.display(),
                    model_path.display()
                );
            }
        }
        return Ok((name.to_string(), Tokens::Dataset(ds.val)));
    }
    let Some(tok) = model_tok else {
        bail!(
            "--data {name}={}: text needs the model's tokenizer, and {} has none (no tokenizer.json, no GGUF \
             vocabulary); pass a dataset built with the model's tokenizer instead",
            path.display(),
            model_path.display()
        )
    };
    let mut text = String::new();
    read_text(&path, &mut text)?;
    let ids = tok.encode(&text)?;
    if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        bail!("--data {name}: the tokenizer produced id {bad}, outside the model's vocabulary ({vocab})");
    }
    Ok((name.to_string(), Tokens::Text(ids)))
}

fn layer_label(figs: &[&LayerFigures]) -> Vec<String> {
    figs.iter().map(|f| format!("L{}", f.layer)).collect()
}

fn heatmaps(
    out: &Path,
    names: &[String],
    by_domain: &[Vec<LayerFigures>],
    stats: &[(usize, &Vec<Accum>)],
) -> Result<Vec<String>> {
    let mut written = Vec::new();
    let mut put = |file: String, map: Heatmap| -> Result<()> {
        write_heatmap(&out.join(&file), &map).with_context(|| format!("writing {}", out.join(&file).display()))?;
        written.push(file);
        Ok(())
    };
    for (d, figs) in names.iter().zip(by_domain) {
        let refs: Vec<&LayerFigures> = figs.iter().collect();
        put(
            format!("frequency-{d}.png"),
            Heatmap {
                title: format!("{d}: expert frequency / uniform (k/E)"),
                x_label: "expert".into(),
                y_label: "MoE layer".into(),
                values: figs.iter().map(|f| f.frequency.iter().map(|x| x / f.frequency_uniform).collect()).collect(),
                row_labels: layer_label(&refs),
                centre: Some(1.0),
            },
        )?;
        put(
            format!("reap-{d}.png"),
            Heatmap {
                title: format!("{d}: REAP share (gate x |output|) / uniform (1/E)"),
                x_label: "expert".into(),
                y_label: "MoE layer".into(),
                values: figs.iter().map(|f| f.reap_share.iter().map(|x| x / f.share_uniform).collect()).collect(),
                row_labels: layer_label(&refs),
                centre: Some(1.0),
            },
        )?;
    }
    // Co-activation lift for up to four evenly spaced MoE layers, per domain.
    let picks: Vec<usize> = {
        let n = stats.len();
        let mut v: Vec<usize> = (0..n.min(4)).map(|i| i * n / n.clamp(1, 4)).collect();
        v.dedup();
        v
    };
    for &i in &picks {
        let (layer, accs) = stats[i];
        for (d, a) in names.iter().zip(accs.iter()) {
            let e = a.experts();
            let n = a.tokens.max(1) as f64;
            let f: Vec<f64> = a.count.iter().map(|&c| c as f64 / n).collect();
            let values = (0..e)
                .map(|x| {
                    (0..e)
                        .map(|y| {
                            let expect = f[x] * f[y];
                            if x == y || expect * n < 5.0 {
                                f64::NAN
                            } else {
                                a.coactivation(x, y) as f64 / n / expect
                            }
                        })
                        .collect()
                })
                .collect();
            put(
                format!("coactivation-{d}-layer{layer}.png"),
                Heatmap {
                    title: format!("{d}, layer {layer}: co-activation lift (1 = independent)"),
                    x_label: "expert".into(),
                    y_label: "expert".into(),
                    values,
                    row_labels: Vec::new(),
                    centre: Some(1.0),
                },
            )?;
        }
    }
    if by_domain.len() >= 2 {
        let (a, b) = (&by_domain[0], &by_domain[1]);
        let refs: Vec<&LayerFigures> = a.iter().collect();
        let eps = 1e-4;
        put(
            format!("domains-{}-vs-{}.png", names[0], names[1]),
            Heatmap {
                title: format!("log2 frequency {} / {}", names[0], names[1]),
                x_label: "expert".into(),
                y_label: "MoE layer".into(),
                values: a
                    .iter()
                    .zip(b)
                    .map(|(x, y)| {
                        x.frequency.iter().zip(&y.frequency).map(|(p, q)| ((p + eps) / (q + eps)).log2()).collect()
                    })
                    .collect(),
                row_labels: layer_label(&refs),
                centre: Some(0.0),
            },
        )?;
    }
    Ok(written)
}

fn specialisation_plot(out: &Path, spec: &[Specialisation]) -> Result<Option<String>> {
    if spec.is_empty() {
        return Ok(None);
    }
    let (a, b) = (&spec[0].domains.0, &spec[0].domains.1);
    let pick = |f: &dyn Fn(&Specialisation) -> f64| {
        spec.iter().filter(|s| (&s.domains.0, &s.domains.1) == (a, b)).map(|s| (s.layer as f64, f(s))).collect()
    };
    let chart = Chart {
        title: format!("expert-load difference {a} vs {b} (JSD, nats)"),
        x_label: "layer".into(),
        y_label: "JSD".into(),
        series: vec![
            Series { name: format!("{a} vs {b}"), points: pick(&|s| s.between), color: COLORS[1] },
            Series { name: "noise floor (halves)".into(), points: pick(&|s| s.noise_floor), color: COLORS[0] },
        ],
        log_x: false,
        log_y: false,
    };
    let file = "specialisation.png".to_string();
    k3_plot::write_png(&out.join(&file), &chart, 900, 420)?;
    Ok(Some(file))
}

pub fn run(a: &RoutingStatsArgs) -> Result<()> {
    let t0 = Instant::now();
    let mut model = crate::native::load(&a.model, a.threads, false)?;
    let (layers, teacher_shared) = match &model.config {
        ModelConfig::Kimi(c) => (c.layers.len(), c.moe.num_shared_experts),
        ModelConfig::Llama(_) => {
            bail!("{}: a Llama model has no experts; routing-stats needs a Kimi / K3 MoE checkpoint", a.model.display())
        }
    };
    if a.context < 1 || a.windows < 1 {
        bail!("--context and --windows must be at least 1");
    }
    let context = a.context.min(model.n_ctx);
    let vocab = model.vocab_size();
    let domains: Vec<(String, Tokens)> =
        a.data.iter().map(|s| open_domain(s, &a.model, vocab)).collect::<Result<_>>()?;
    let names: Vec<String> = domains.iter().map(|d| d.0.clone()).collect();
    if let Some(t) = &a.target {
        if !names.contains(t) {
            bail!("--target {t}: not one of the --data names ({})", names.join(", "));
        }
    }
    let collector = Arc::new(RoutingCollector::new(domains.len()));
    let moe_layers = model.set_routing_tap(collector.clone()).with_context(|| a.model.display().to_string())?;
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let mut inputs = Vec::new();
    for (d, (name, toks)) in domains.iter().enumerate() {
        let len = toks.len();
        if len < 2 {
            bail!("--data {name}: only {len} tokens");
        }
        let ctx = context.min(len);
        let starts = k3_data::shards::spread_starts(len, ctx, a.windows);
        let n = starts.len();
        let t1 = Instant::now();
        for (w, &start) in starts.iter().enumerate() {
            collector.set_context(d, w);
            let mut st = model.new_state();
            model.forward(&toks.window(start, ctx), &mut st, Logits::Last)?;
            if (w + 1) % (n / 10).max(1) == 0 {
                eprint!("\r{name}: window {}/{n}", w + 1);
            }
        }
        let tps = (n * ctx) as f64 / t1.elapsed().as_secs_f64();
        eprintln!("\r{name}: {n} windows x {ctx} tokens ({tps:.0} tok/s)");
        inputs.push(
            serde_json::json!({"name": name, "windows": n, "context": ctx, "tokens": n * ctx, "available_tokens": len}),
        );
    }
    let stats = collector.snapshot();
    let by_layer: Vec<(usize, &Vec<Accum>)> = stats.iter().map(|(l, v)| (*l, v)).collect();
    let by_domain: Vec<Vec<LayerFigures>> =
        (0..names.len()).map(|d| by_layer.iter().map(|(l, v)| figures(*l, &names[d], &v[d])).collect()).collect();
    let mut spec = Vec::new();
    for i in 0..names.len() {
        for j in i + 1..names.len() {
            for (l, v) in &by_layer {
                spec.push(specialisation(*l, (&names[i], &names[j]), &v[i], &v[j]));
            }
        }
    }
    let mut files = heatmaps(&a.out, &names, &by_domain, &by_layer)?;
    files.extend(specialisation_plot(&a.out, &spec)?);
    let mut report = serde_json::json!({
        "model": a.model.display().to_string(),
        "moe_layers": moe_layers,
        "layers": layers,
        "domains": inputs,
        "figures": by_domain.iter().flatten().collect::<Vec<_>>(),
        "specialisation": spec,
        "plots": files,
    });
    print_summary(&names, &by_domain, &spec);
    let target = a.target.as_ref().and_then(|t| names.iter().position(|n| n == t));
    match (target, &a.compare) {
        (Some(d), None) => {
            let views: Vec<LayerView> = by_domain[d]
                .iter()
                .map(|f| LayerView {
                    target: f,
                    spec_ratio: spec.iter().filter(|s| s.layer == f.layer).map(|s| s.ratio).fold(f64::NAN, f64::max),
                })
                .collect();
            let rec = recommend(&names[d], layers, &views, teacher_shared);
            println!(
                "\nrecommended student for {}: {} experts, top-{}, {} shared, dense layers {:?}",
                rec.target,
                rec.num_experts,
                rec.top_k,
                rec.num_shared_experts,
                rec.dense.iter().enumerate().filter(|x| *x.1).map(|x| x.0).collect::<Vec<_>>()
            );
            for w in &rec.reasoning {
                println!("  - {w}");
            }
            println!("  config: {}", rec.config);
            write_json(&a.out.join("recommendation.json"), &serde_json::to_value(&rec)?)?;
            report["recommendation"] = serde_json::to_value(&rec)?;
        }
        (Some(d), Some(path)) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            let rec: Recommendation = serde_json::from_str(&text).with_context(|| {
                format!("{}: not a recommendation.json written by routing-stats --target", path.display())
            })?;
            let refs: Vec<&LayerFigures> = by_domain[d].iter().collect();
            let cmp = compare(&rec, layers, &refs);
            println!("\nstudent vs recommendation ({} experts, top-{} recommended):", rec.num_experts, rec.top_k);
            for c in &cmp {
                println!("  layer {:>2}: {}", c.layer, c.verdict);
            }
            report["comparison"] = serde_json::to_value(&cmp)?;
        }
        _ => {}
    }
    write_json(&a.out.join("routing.json"), &report)?;
    println!("wrote {} (routing.json, {} plots) in {:.1}s", a.out.display(), files.len(), t0.elapsed().as_secs_f64());
    Ok(())
}

fn write_json(path: &Path, v: &serde_json::Value) -> Result<()> {
    // NaN (e.g. no pair expected often enough) is not JSON; it becomes null.
    let text = serde_json::to_string_pretty(v)?;
    k3_format::safetensors_io::write_atomic(path, text.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

fn print_summary(names: &[String], by_domain: &[Vec<LayerFigures>], spec: &[Specialisation]) {
    println!("figure (value / uniform baseline)  per MoE layer and domain");
    println!(
        "{:<6} {:<10} {:>16} {:>16} {:>14} {:>12} {:>10}",
        "layer", "domain", "router entropy", "load entropy", "experts@90%", "max load", "max lift"
    );
    for (d, figs) in names.iter().zip(by_domain) {
        for f in figs {
            println!(
                "{:<6} {:<10} {:>7.3} / {:<6.3} {:>7.3} / {:<6.3} {:>6} / {:<5} {:>7.2}x / 1 {:>6.2} / 1",
                f.layer,
                d,
                f.router_entropy.value,
                f.router_entropy.uniform,
                f.load_entropy.value,
                f.load_entropy.uniform,
                f.experts_for_90pct_gate.value,
                f.experts_for_90pct_gate.uniform,
                f.max_load_ratio.value,
                f.max_coactivation_lift.value
            );
        }
    }
    for s in spec {
        println!(
            "layer {:>2} {} vs {}: JSD {:.4} vs noise floor {:.4} ({:.1}x){}",
            s.layer,
            s.domains.0,
            s.domains.1,
            s.between,
            s.noise_floor,
            s.ratio,
            if s.ratio >= 2.0 { "" } else { "  within noise" }
        );
    }
}
