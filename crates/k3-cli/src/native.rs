//! Commands on the pure-Rust engine: `logits --engine native`, `generate`, `quantize`.

use std::collections::HashMap;
use std::io::Write;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use k3_format::safetensors_io::{write_safetensors, OwnedData};
use k3_infer::tokenizer::Tokenizer;
use k3_infer::{Engine, Logits, Model, SamplerConfig};

pub(crate) fn load(path: &Path, threads: usize, exact: bool) -> Result<Model> {
    let (mut model, warnings) = Model::load(path).with_context(|| format!("loading {}", path.display()))?;
    for w in warnings {
        eprintln!("warning: {w}");
    }
    model.compute = k3_infer::linear::Compute { threads: threads.max(1), exact };
    k3_kernels::ops::set_reference_arithmetic(exact);
    Ok(model)
}

/// Continue `prompt` with up to `max_new` tokens drawn by `sampling` (temperature 0: greedy),
/// ending early after `stop` (kept).
pub fn continue_ids(
    model: &Model,
    prompt: &[u32],
    max_new: usize,
    sampling: SamplerConfig,
    stop: Option<u32>,
) -> k3_infer::Result<Vec<u32>> {
    let mut st = model.new_state();
    let mut logits = model.forward(prompt, &mut st, Logits::Last)?;
    let mut sampler = k3_infer::Sampler::new(sampling);
    let mut history = prompt.to_vec();
    let mut out = Vec::with_capacity(max_new);
    while out.len() < max_new {
        let x = sampler.sample(&logits, &history);
        out.push(x);
        history.push(x);
        if Some(x) == stop || out.len() == max_new {
            break;
        }
        logits = model.forward(&[x], &mut st, Logits::Last)?;
    }
    Ok(out)
}

pub fn logits(path: &Path, ids: &[i64], out: &Path, threads: usize, exact: bool) -> Result<()> {
    let model = load(path, threads, exact)?;
    let toks: Vec<u32> = ids.iter().map(|&x| x as u32).collect();
    let mut st = model.new_state();
    let l = model.forward(&toks, &mut st, Logits::All)?;
    let v = model.vocab_size();
    let meta = HashMap::from([("engine".to_string(), "native".to_string()), ("ids".to_string(), format!("{ids:?}"))]);
    let last = &l[(toks.len() - 1) * v..];
    let mut top: Vec<(usize, f32)> = last.iter().copied().enumerate().collect();
    top.sort_by(|a, b| b.1.total_cmp(&a.1));
    write_safetensors(out, &[("logits".into(), vec![toks.len(), v], OwnedData::F32(l))], Some(meta))
        .with_context(|| format!("writing {}", out.display()))?;
    let top: Vec<String> = top.iter().take(5).map(|(i, x)| format!("{i} ({x:.3})")).collect();
    println!(
        "wrote logits [{}, {v}] to {}; top-5 next ids after the last position: {}",
        toks.len(),
        out.display(),
        top.join(", ")
    );
    Ok(())
}

#[derive(clap::Args)]
pub struct GenerateArgs {
    /// A checkpoint directory (with tokenizer.json) or a GGUF with an embedded vocabulary.
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    prompt: String,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Reference numerics: f32 activations against dequantized weights, f32 caches and
    /// transformers' epsilons. The default follows llama.cpp (activations quantized per row to
    /// the weight's activation type, f16 attention caches, rms_norm_eps everywhere).
    #[arg(long)]
    exact: bool,
    /// Wrap the prompt in the model's chat template (as one user turn).
    #[arg(long)]
    chat: bool,
    /// System prompt for --chat.
    #[arg(long)]
    system: Option<String>,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop when the output contains this string (repeatable; not printed).
    #[arg(long)]
    stop: Vec<String>,
}

pub fn generate(a: &GenerateArgs) -> Result<()> {
    let model = load(&a.model, a.threads, a.exact)?;
    let tok = Tokenizer::for_model(&a.model)
        .with_context(|| format!("reading the tokenizer of {}", a.model.display()))?
        .with_context(|| {
            format!("{} has no tokenizer (no tokenizer.json, or a GGUF without vocabulary)", a.model.display())
        })?;
    let text = if a.chat { tok.apply_chat(a.system.as_deref(), &a.prompt)? } else { a.prompt.clone() };
    let prompt = tok.encode(&text)?;
    if prompt.is_empty() {
        bail!("the prompt encodes to no tokens");
    }
    if prompt.len() > model.n_ctx {
        bail!("the prompt has {} tokens, more than the model's context of {}", prompt.len(), model.n_ctx);
    }
    let mut engine = Engine::new(model);
    let seq = engine.add_sequence();
    let sampler = SamplerConfig {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repetition_penalty: a.repeat_penalty,
        seed: a.seed,
        ..Default::default()
    };
    let stop_tokens: Vec<u32> = tok.eos.into_iter().collect();
    let (mut ids, mut printed) = (Vec::new(), 0usize);
    let mut out = std::io::stdout().lock();
    let t0 = Instant::now();
    let mut t_first = None;
    let mut err = None;
    let generated = engine.generate(seq, &prompt, a.max_tokens, sampler, &stop_tokens, |id| {
        t_first.get_or_insert_with(Instant::now);
        ids.push(id);
        let s = match tok.decode(&ids) {
            Ok(s) => s,
            Err(e) => {
                err = Some(e);
                return ControlFlow::Break(());
            }
        };
        if let Some(cut) = a.stop.iter().filter_map(|st| s.find(st.as_str())).min() {
            let _ = out.write_all(&s.as_bytes()[printed.min(cut)..cut]);
            return ControlFlow::Break(());
        }
        // Hold back a trailing partial UTF-8 character (decoded as U+FFFD) until it completes.
        let end = if s.ends_with('\u{FFFD}') { s.len() - '\u{FFFD}'.len_utf8() } else { s.len() };
        if end > printed {
            let _ = out.write_all(&s.as_bytes()[printed..end]);
            let _ = out.flush();
            printed = end;
        }
        ControlFlow::Continue(())
    })?;
    if let Some(e) = err {
        return Err(e.into());
    }
    let _ = writeln!(out);
    let total = t0.elapsed().as_secs_f64();
    let prefill = t_first.map_or(total, |t| (t - t0).as_secs_f64());
    let n = generated.tokens.len();
    eprintln!(
        "[{} prompt tokens, prefill {:.1} tok/s; {n} generated, decode {:.1} tok/s; stop: {:?}]",
        prompt.len(),
        prompt.len() as f64 / prefill.max(1e-9),
        n.saturating_sub(1) as f64 / (total - prefill).max(1e-9),
        generated.reason
    );
    Ok(())
}

pub fn quantize(
    model: &Path,
    ty: &str,
    out: &Path,
    importance: Option<&std::collections::BTreeMap<String, Vec<f32>>>,
) -> Result<()> {
    let qt = k3_quant::QuantType::parse(ty)?;
    let r = if model.is_file() {
        k3_quant::requantize_gguf(model, qt, out)
    } else {
        k3_quant::export_gguf_calibrated(model, qt, out, importance)
    }
    .with_context(|| format!("quantizing {}", model.display()))?;
    for f in &r.fallbacks {
        eprintln!("fallback: {f}");
    }
    for n in &r.notes {
        eprintln!("note: {n}");
    }
    println!(
        "wrote {} (llama.cpp arch `{}`, {} tensors, {:.2} MiB of tensor data; {} kept in F32 as llama-quantize does, {} fell back)",
        out.display(),
        r.arch.name(),
        r.tensors,
        r.bytes as f64 / (1 << 20) as f64,
        r.kept_f32,
        r.fallbacks.len()
    );
    Ok(())
}
