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
    /// The prompt; repeat it to generate several completions together (one batched decode step
    /// for all of them, printed in order once all have finished).
    #[arg(long, required = true)]
    prompt: Vec<String>,
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
    let mut prompts = Vec::with_capacity(a.prompt.len());
    for (i, p) in a.prompt.iter().enumerate() {
        let which = if a.prompt.len() > 1 { format!("prompt {}", i + 1) } else { "the prompt".to_string() };
        let text = if a.chat { tok.apply_chat(a.system.as_deref(), p)? } else { p.clone() };
        let ids = tok.encode(&text)?;
        if ids.is_empty() {
            bail!("{which} encodes to no tokens");
        }
        if ids.len() > model.n_ctx {
            bail!("{which} has {} tokens, more than the model's context of {}", ids.len(), model.n_ctx);
        }
        prompts.push(ids);
    }
    let mut engine = Engine::new(model);
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
    let jobs: Vec<_> = prompts.iter().map(|p| (engine.add_sequence(), p.as_slice())).collect();
    // One prompt streams to stdout as it is generated; several are printed once all are done.
    let stream = jobs.len() == 1;
    // Per job: the ids so far, the bytes of their text already final (printed when streaming),
    // and where a --stop string cut it.
    let mut texts: Vec<(Vec<u32>, usize, Option<usize>)> = vec![(Vec::new(), 0, None); jobs.len()];
    let mut out = std::io::stdout().lock();
    let t0 = Instant::now();
    let mut t_first = None;
    let mut err = None;
    let generated = engine.generate_many(&jobs, a.max_tokens, sampler, &stop_tokens, |j, id| {
        t_first.get_or_insert_with(Instant::now);
        let (ids, done, cut) = &mut texts[j];
        ids.push(id);
        let s = match tok.decode(ids) {
            Ok(s) => s,
            Err(e) => {
                err = Some(e);
                return ControlFlow::Break(());
            }
        };
        if let Some(c) = a.stop.iter().filter_map(|st| s.find(st.as_str())).min() {
            if stream {
                let _ = out.write_all(&s.as_bytes()[(*done).min(c)..c]);
            }
            *cut = Some(c);
            return ControlFlow::Break(());
        }
        // Hold back a trailing partial UTF-8 character (decoded as U+FFFD) until it completes.
        let end = if s.ends_with('\u{FFFD}') { s.len() - '\u{FFFD}'.len_utf8() } else { s.len() };
        if end > *done {
            if stream {
                let _ = out.write_all(&s.as_bytes()[*done..end]);
                let _ = out.flush();
            }
            *done = end;
        }
        ControlFlow::Continue(())
    })?;
    if let Some(e) = err {
        return Err(e.into());
    }
    let total = t0.elapsed().as_secs_f64();
    if stream {
        let _ = writeln!(out);
    } else {
        // What streaming would have printed: up to a --stop cut, else the text's final part.
        for (i, (ids, done, cut)) in texts.iter().enumerate() {
            let s = tok.decode(ids)?;
            let _ = writeln!(out, "=== {} ===\n{}", i + 1, s.get(..cut.unwrap_or(*done)).unwrap_or(&s));
        }
    }
    let prefill = t_first.map_or(total, |t| (t - t0).as_secs_f64());
    let n: usize = generated.iter().map(|g| g.tokens.len()).sum();
    let (n_prompt, decoded) = (prompts.iter().map(Vec::len).sum::<usize>(), n.saturating_sub(generated.len()));
    let reasons: Vec<String> = generated.iter().map(|g| format!("{:?}", g.reason)).collect();
    eprintln!(
        "[{n_prompt} prompt tokens, prefill {:.1} tok/s; {n} generated, decode {:.1} tok/s{}; stop: {}]",
        n_prompt as f64 / prefill.max(1e-9),
        decoded as f64 / (total - prefill).max(1e-9),
        if stream { String::new() } else { format!(" (all {} sequences together)", generated.len()) },
        reasons.join(", ")
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
