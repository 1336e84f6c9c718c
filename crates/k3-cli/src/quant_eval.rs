//! Importance-weighted quantization and how quantized models are judged (the llama.cpp rule for
//! a new quant type): `quantize --calib DATASET` gathers the mean squared activation of every
//! weight's input columns over calibration windows of the dataset's train split, and
//! `quant-eval` measures KL divergence to the f32 model and perplexity on held-out windows.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use k3_infer::{Logits, Model};
use serde_json::json;

use k3_kernels::ops::log_softmax_inplace;

/// `n` windows of `ctx` tokens spread evenly over a token set.
fn windows(set: &k3_data::shards::TokenSet, n: usize, ctx: usize) -> Vec<Vec<u32>> {
    let ctx = ctx.min(set.len);
    k3_data::shards::spread_starts(set.len, ctx, n)
        .into_iter()
        .map(|start| {
            let mut out = Vec::with_capacity(ctx);
            set.read(start, ctx, &mut out);
            out
        })
        .collect()
}

fn check_vocab(model: &Model, ds: &k3_data::dataset::Dataset, what: &Path) -> Result<()> {
    if ds.meta.vocab_size > model.vocab_size() {
        bail!(
            "{}: vocabulary {} is smaller than the dataset {}'s ({}); use a dataset built with the model's tokenizer",
            what.display(),
            model.vocab_size(),
            ds.dir.display(),
            ds.meta.vocab_size
        );
    }
    Ok(())
}

/// Mean x² per input column of every weight of the f32 checkpoint `model`, over `n` windows of
/// `ctx` tokens from `data`'s train split.
pub fn calibrate(
    model: &Path,
    data: &Path,
    n: usize,
    ctx: usize,
    threads: usize,
) -> Result<BTreeMap<String, Vec<f32>>> {
    if model.is_file() {
        bail!("--calib needs the f32 checkpoint directory, not a GGUF: calibration measures the unquantized model");
    }
    let m = crate::native::load(model, threads, true)?;
    let ds = k3_data::dataset::Dataset::open(data).with_context(|| format!("--calib {}", data.display()))?;
    check_vocab(&m, &ds, model)?;
    let ws = windows(&ds.train, n, ctx.min(m.n_ctx));
    let t0 = std::time::Instant::now();
    k3_infer::calib::start();
    for w in &ws {
        let mut st = m.new_state();
        if let Err(e) = m.forward(w, &mut st, Logits::Last) {
            k3_infer::calib::finish();
            return Err(e.into());
        }
    }
    let imp = k3_infer::calib::finish();
    eprintln!(
        "calibration: {} windows x {} tokens of {} (train split), {} weight matrices, {:.1}s",
        ws.len(),
        ws.first().map_or(0, Vec::len),
        data.display(),
        imp.len(),
        t0.elapsed().as_secs_f64()
    );
    Ok(imp)
}

#[derive(clap::Args)]
pub struct QuantEvalArgs {
    /// The reference: the f32 checkpoint directory (or an f32 GGUF).
    #[arg(long)]
    reference: PathBuf,
    /// A quantized GGUF to judge (repeatable).
    #[arg(long = "model", required = true)]
    models: Vec<PathBuf>,
    /// A dataset built with the model's tokenizer; its validation split is read.
    #[arg(long)]
    data: PathBuf,
    #[arg(long, default_value_t = 16)]
    windows: usize,
    #[arg(long, default_value_t = 256)]
    context: usize,
    #[arg(long, default_value_t = 1)]
    threads: usize,
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One quantized model judged against the reference.
pub struct Judged {
    pub model: PathBuf,
    pub mib: f64,
    /// Mean KL(reference ‖ model) per position, nats.
    pub kl: f64,
    /// Share of positions whose argmax agrees with the reference's.
    pub top1: f64,
    pub ppl: f64,
}

impl Judged {
    pub fn to_json(&self) -> serde_json::Value {
        json!({"model": self.model.display().to_string(), "mib": self.mib, "kl": self.kl, "top1": self.top1, "ppl": self.ppl})
    }
}

/// The reference's next-token log-probabilities over the windows `ws` (token ids, each ≥ 2
/// long): per window, [T, V]. `rm` is the reference loaded with f32 activations (`exact`), and
/// `what` names it in errors.
pub fn reference_logprobs(rm: &Model, what: &Path, ws: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
    if ws.is_empty() || ws.iter().any(|w| w.len() < 2) {
        bail!("judging needs at least one window of two or more tokens");
    }
    let v = rm.vocab_size();
    if let Some(&t) = ws.iter().flatten().find(|&&t| t as usize >= v) {
        bail!("{}: token id {t} is outside the reference's vocabulary of {v}", what.display());
    }
    let mut ref_lp = Vec::with_capacity(ws.len());
    for w in ws {
        let mut st = rm.new_state();
        let mut l = rm.forward(w, &mut st, Logits::All)?;
        l.chunks_exact_mut(v).for_each(|r| log_softmax_inplace(r, 1.0));
        ref_lp.push(l);
    }
    Ok(ref_lp)
}

/// Mean negative log-likelihood of each window's next tokens under log-probabilities `lp` [T, V].
fn nll(lp: &[f32], w: &[u32], v: usize) -> f64 {
    (0..w.len() - 1).map(|i| -(lp[i * v + w[i + 1] as usize] as f64)).sum::<f64>() / (w.len() - 1) as f64
}

/// The reference's perplexity over the windows.
pub fn reference_ppl(ref_lp: &[Vec<f32>], ws: &[Vec<u32>], v: usize) -> f64 {
    (ws.iter().zip(ref_lp).map(|(w, lp)| nll(lp, w, v)).sum::<f64>() / ws.len() as f64).exp()
}

/// The llama.cpp rule for a quantized model, given its logits for window i ([T, V], from our
/// engine or another; asked for one window at a time): the mean KL(reference ‖ model) per
/// position, top-1 agreement with the reference, and perplexity.
pub fn score(
    ref_lp: &[Vec<f32>],
    ws: &[Vec<u32>],
    v: usize,
    mut logits: impl FnMut(usize) -> Result<Vec<f32>>,
) -> Result<(f64, f64, f64)> {
    let (mut kl, mut top1, mut n, mut q_nll) = (0.0f64, 0usize, 0usize, 0.0f64);
    for (i, (w, rl)) in ws.iter().zip(ref_lp).enumerate() {
        let mut l = logits(i)?;
        if l.len() != rl.len() {
            bail!("logits of {} values for a window of {} tokens x {v}", l.len(), w.len());
        }
        l.chunks_exact_mut(v).for_each(|r| log_softmax_inplace(r, 1.0));
        for (p, q) in rl.chunks_exact(v).zip(l.chunks_exact(v)) {
            kl += p.iter().zip(q).map(|(&lp, &lq)| (lp as f64).exp() * (lp - lq) as f64).sum::<f64>();
            let am = |r: &[f32]| r.iter().enumerate().max_by(|x, y| x.1.total_cmp(y.1)).map_or(0, |x| x.0);
            top1 += usize::from(am(p) == am(q));
            n += 1;
        }
        q_nll += nll(&l, w, v);
    }
    Ok((kl / n as f64, top1 as f64 / n as f64, (q_nll / ws.len() as f64).exp()))
}

/// [`score`] of the quantized model at `path` in our engine (activations quantized as llama.cpp
/// does) against the reference's log-probabilities `ref_lp` over the windows `ws`.
pub fn judge_model(path: &Path, ref_lp: &[Vec<f32>], ws: &[Vec<u32>], v: usize, threads: usize) -> Result<Judged> {
    let m = crate::native::load(path, threads, false)?;
    if m.vocab_size() != v {
        bail!("{}: vocabulary {} differs from the reference's {v}", path.display(), m.vocab_size());
    }
    let (kl, top1, ppl) = score(ref_lp, ws, v, |i| Ok(m.forward(&ws[i], &mut m.new_state(), Logits::All)?))?;
    let mib = std::fs::metadata(path).map_or(0.0, |m| m.len() as f64 / (1 << 20) as f64);
    Ok(Judged { model: path.to_path_buf(), mib, kl, top1, ppl })
}

pub fn quant_eval(a: &QuantEvalArgs) -> Result<()> {
    let ds = k3_data::dataset::Dataset::open(&a.data).with_context(|| format!("--data {}", a.data.display()))?;
    // The reference's log-probabilities once, then each model against them.
    let (ws, v, ref_lp) = {
        let reference = crate::native::load(&a.reference, a.threads, true)?;
        check_vocab(&reference, &ds, &a.reference)?;
        let ws = windows(&ds.val, a.windows, a.context.min(reference.n_ctx));
        let ref_lp = reference_logprobs(&reference, &a.reference, &ws)?;
        (ws, reference.vocab_size(), ref_lp)
    };
    let ref_ppl = reference_ppl(&ref_lp, &ws, v);
    let rows = a.models.iter().map(|m| judge_model(m, &ref_lp, &ws, v, a.threads)).collect::<Result<Vec<_>>>()?;
    println!(
        "reference  {}: ppl {:.3} ({} windows x {} tokens, val split)",
        a.reference.display(),
        ref_ppl,
        ws.len(),
        ws[0].len()
    );
    println!("{:<48} {:>10} {:>12} {:>10} {:>10} {:>8}", "model", "MiB", "KL (nats)", "top-1", "ppl", "Δppl %");
    for r in &rows {
        println!(
            "{:<48} {:>10.2} {:>12.5} {:>10.4} {:>10.3} {:>8.2}",
            r.model.display().to_string(),
            r.mib,
            r.kl,
            r.top1,
            r.ppl,
            100.0 * (r.ppl / ref_ppl - 1.0)
        );
    }
    if let Some(p) = &a.json {
        let text = serde_json::to_string_pretty(&json!({
            "reference": a.reference.display().to_string(), "reference_ppl": ref_ppl,
            "windows": ws.len(), "context": ws[0].len(), "data": a.data.display().to_string(),
            "models": rows.iter().map(Judged::to_json).collect::<Vec<_>>(),
        }))?;
        k3_format::safetensors_io::write_atomic(p, text.as_bytes())?;
    }
    Ok(())
}

/// Windows of held-out text for judging: `n` windows of `ctx` tokens spread over the validation
/// split of `data`, checked against the model's vocabulary.
pub fn val_windows(model: &Model, model_path: &Path, data: &Path, n: usize, ctx: usize) -> Result<Vec<Vec<u32>>> {
    let ds = k3_data::dataset::Dataset::open(data)?;
    check_vocab(model, &ds, model_path)?;
    Ok(windows(&ds.val, n, ctx.min(model.n_ctx)))
}
