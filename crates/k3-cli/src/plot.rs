//! `k3mini plot`: curves of one metric from several runs' `metrics.jsonl`, in one PNG.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

#[derive(clap::Args)]
pub struct PlotArgs {
    /// LABEL=RUN_DIR (repeatable): a run directory written by `k3mini train`.
    #[arg(long = "run", required = true)]
    pub runs: Vec<String>,
    /// The metric to draw against training tokens: val_loss, loss_avg, lr, grad_norm, tok_per_s.
    #[arg(long, default_value = "val_loss")]
    pub metric: String,
    #[arg(long, default_value = "")]
    pub title: String,
    #[arg(long)]
    pub out: PathBuf,
}

/// (tokens, value) of every line of `run/metrics.jsonl` that has `metric`.
pub fn series(run: &Path, metric: &str) -> Result<Vec<(f64, f64)>> {
    let p = run.join("metrics.jsonl");
    let text = std::fs::read_to_string(&p).with_context(|| format!("{}: not a training run?", p.display()))?;
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| Some((v["tokens"].as_f64()?, v[metric].as_f64()?)))
        .collect())
}

pub fn run(a: &PlotArgs) -> Result<()> {
    let mut chart = k3_plot::Chart {
        title: a.title.clone(),
        x_label: "training tokens (M)".into(),
        y_label: a.metric.clone(),
        ..Default::default()
    };
    for (i, spec) in a.runs.iter().enumerate() {
        let Some((label, dir)) = spec.rsplit_once('=') else {
            bail!("--run `{spec}`: expected LABEL=RUN_DIR");
        };
        let pts = series(Path::new(dir), &a.metric)?;
        if pts.is_empty() {
            bail!("{dir}/metrics.jsonl has no `{}` values", a.metric);
        }
        chart.series.push(k3_plot::Series {
            name: label.to_string(),
            points: pts.into_iter().map(|(t, v)| (t / 1e6, v)).collect(),
            color: k3_plot::COLORS[i % k3_plot::COLORS.len()],
        });
    }
    k3_plot::write_png(&a.out, &chart, 900, 560).with_context(|| format!("writing {}", a.out.display()))?;
    println!("wrote {}", a.out.display());
    Ok(())
}
