//! `k3mini capture --prompts FILE`: the teacher's answers to prompts, with its top-k at every
//! generated token, as trajectory records of a teacher-signal store.
//!
//! In process the engine prefills the chat-templated prompt and decodes token by token (greedy, or
//! sampled with `--sample-temperature`), keeping each step's top-k. Through an endpoint it is one
//! `/v1/chat/completions` (or with `--raw-prompts` `/v1/completions`) with `logprobs` +
//! `top_logprobs` per prompt, token strings mapped back to ids. Prompts are done in file order; re-running skips the ones already stored.

use std::io::BufRead;
use std::path::Path;

use anyhow::{bail, Context, Result};
use k3_data::signals::{self, SignalWriter, TopK};
use k3_infer::{Engine, Logits, Model, Sampler, SamplerConfig};
use serde_json::{json, Value};

/// Prompts from a file: JSON lines with a `prompt` string, or plain text lines.
pub fn read_prompts(path: &Path) -> Result<Vec<String>> {
    let f = std::fs::File::open(path).with_context(|| format!("--prompts {}", path.display()))?;
    let mut out = Vec::new();
    for (n, line) in std::io::BufReader::new(f).lines().enumerate() {
        let line = line.with_context(|| format!("{}: line {}", path.display(), n + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<Value>(&line) {
            Ok(Value::Object(o)) if o.get("eval_only") == Some(&Value::Bool(true)) => bail!(
                "{}: line {} is marked \"eval_only\" (e.g. HumanEval): evaluation prompts never become training data",
                path.display(),
                n + 1
            ),
            Ok(Value::Object(o)) => match o.get("prompt").and_then(Value::as_str) {
                Some(p) => out.push(p.to_string()),
                None => bail!("{}: line {}: a JSON line needs a \"prompt\" string", path.display(), n + 1),
            },
            _ => out.push(line),
        }
    }
    if out.is_empty() {
        bail!("--prompts {}: no prompts (JSON lines with \"prompt\", or one prompt per line)", path.display());
    }
    Ok(out)
}

/// The engine's answer to `prompt` (ids): up to `max_new` tokens and each step's top-k.
pub fn generate_engine(
    model: Model,
    prompt: &[u32],
    max_new: usize,
    k: usize,
    sampling: SamplerConfig,
    stop: &[u32],
) -> Result<(Model, Vec<u32>, Vec<TopK>)> {
    let mut engine = Engine::new(model);
    let seq = engine.add_sequence();
    let mut sampler = Sampler::new(sampling);
    let mut logits = engine.feed(seq, prompt, Logits::Last)?;
    let (mut generated, mut tops) = (Vec::new(), Vec::new());
    while generated.len() < max_new && engine.tokens(seq)?.len() < engine.model.n_ctx {
        let mut lp = logits.clone();
        k3_kernels::ops::log_softmax_inplace(&mut lp, 1.0);
        let next = sampler.sample(&logits, engine.tokens(seq)?);
        tops.push(signals::top_k(&lp, k));
        generated.push(next);
        if stop.contains(&next) {
            break;
        }
        logits = engine.feed(seq, &[next], Logits::Last)?;
    }
    Ok((engine.model, generated, tops))
}

/// An endpoint's answer to one prompt, mapped to ids (`None` when a token cannot be mapped): the
/// chat template's answer through `/v1/chat/completions`, with a reasoning model's separate
/// reasoning text (`reasoning_content` or `reasoning`) when present, or with `raw` the prompt
/// continued as plain text through the legacy `/v1/completions`. Either way every generated token
/// comes with its `top_logprobs`, keyed by text. At temperature 0 each greedy token must be the
/// top-1 of its own entry; when most are not, the entries are not aligned with the tokens and the
/// capture stops rather than store them.
pub fn generate_endpoint(
    t: &mut crate::openai::EndpointTeacher,
    prompt: &str,
    raw: bool,
    max_new: usize,
    k: usize,
    temperature: f32,
) -> Result<Option<Answer>> {
    // (token text, its top-k entries) per generated token.
    type Steps = Vec<(Option<String>, Vec<(String, f32)>)>;
    let text = |v: &Value| v.as_str().map(str::to_string);
    let (steps, reasoning): (Steps, Option<String>) = if raw {
        let body = json!({"model": t.endpoint.model, "prompt": prompt, "max_tokens": max_new,
                          "temperature": temperature, "logprobs": k.min(20)});
        let v = t.endpoint.post("/v1/completions", &body)?;
        let lp = &v["choices"][0]["logprobs"];
        let (Some(tokens), Some(tops)) = (lp["tokens"].as_array(), lp["top_logprobs"].as_array()) else {
            bail!(
                "{}: /v1/completions returned no logprobs.tokens / top_logprobs (the endpoint does not return \
                 completion logprobs); capture raw prompts with the teacher in process, or drop --raw-prompts",
                t.endpoint.base
            )
        };
        let steps =
            tokens.iter().zip(tops).map(|(tok, top)| (text(tok), crate::openai::parse_top(top).unwrap_or_default()));
        (steps.collect(), None)
    } else {
        let body = json!({"model": t.endpoint.model, "messages": [{"role": "user", "content": prompt}],
                          "max_tokens": max_new, "temperature": temperature, "logprobs": true,
                          "top_logprobs": k.min(20)});
        let v = t.endpoint.post("/v1/chat/completions", &body)?;
        let Some(content) = v["choices"][0]["logprobs"]["content"].as_array() else {
            bail!(
                "{}: the chat response has no logprobs.content (the endpoint does not return chat logprobs)",
                t.endpoint.base
            )
        };
        let entries = |c: &Value| -> Vec<(String, f32)> {
            c["top_logprobs"]
                .as_array()
                .map(|a| a.iter().filter_map(|e| Some((text(&e["token"])?, e["logprob"].as_f64()? as f32))).collect())
                .unwrap_or_default()
        };
        let steps = content.iter().map(|c| (text(&c["token"]), entries(c))).collect();
        (steps, crate::openai::reasoning(&v["choices"][0]["message"]).map(|(_, r)| r.to_string()))
    };
    let (mut ids, mut tops, mut greedy_first) = (Vec::new(), Vec::new(), 0);
    for (tok, entries) in &steps {
        let Some((tok, id)) = tok.as_deref().and_then(|s| Some((s, t.id_of(s)?))) else { return Ok(None) };
        let best = entries.iter().map(|e| e.1).fold(f32::NEG_INFINITY, f32::max);
        greedy_first += usize::from(entries.iter().any(|(s, l)| s == tok && *l >= best));
        ids.push(id);
        tops.push(t.entries_to_topk(entries, k));
    }
    if temperature == 0.0 && ids.len() >= 4 && greedy_first * 2 < ids.len() {
        bail!(
            "{}: only {greedy_first} of {} greedy tokens are the top-1 of their own top_logprobs entry: the entries are \
             not aligned with the generated tokens; capture with the teacher in process",
            t.endpoint.base,
            ids.len()
        );
    }
    Ok(Some(Answer { prompt: Vec::new(), generated: ids, tops, reasoning }))
}

/// A teacher's answer to one prompt.
pub struct Answer {
    pub prompt: Vec<u32>,
    pub generated: Vec<u32>,
    pub tops: Vec<TopK>,
    pub reasoning: Option<String>,
}

pub struct TrajectoryStats {
    pub done: usize,
    pub skipped: usize,
    pub tokens: usize,
    pub seconds: f64,
}

/// Capture trajectories for `prompts[w.counts[1]..]` into `w`.
pub fn capture(
    w: &mut SignalWriter,
    prompts: &[String],
    mut gen: impl FnMut(&str) -> Result<Option<Answer>>,
) -> Result<TrajectoryStats> {
    let first = w.counts[1];
    let mut st = TrajectoryStats { done: 0, skipped: 0, tokens: 0, seconds: 0.0 };
    if first > 0 {
        eprintln!("continuing after {first} stored trajectories");
    }
    for (i, p) in prompts.iter().enumerate().skip(first) {
        let t0 = std::time::Instant::now();
        match gen(p)? {
            Some(a) => {
                let q: Vec<TopK> = a.tops.iter().map(|t| signals::decode_roundtrip(t, &w.header)).collect();
                w.append_trajectory_with(&a.prompt, &a.generated, &q, a.reasoning.as_deref())?;
                w.sync()?;
                st.done += 1;
                st.tokens += a.generated.len();
            }
            None => {
                // Recorded empty, so a resumed capture still knows this prompt was tried.
                w.append_trajectory(&[], &[], &[])?;
                st.skipped += 1;
                eprintln!("\nprompt {}: the answer's tokens could not be mapped to ids; skipped", i + 1);
            }
        }
        st.seconds += t0.elapsed().as_secs_f64();
        eprint!(
            "\rprompt {}/{}  {:.1} generated tok/s   ",
            i + 1,
            prompts.len(),
            st.tokens as f64 / st.seconds.max(1e-9)
        );
    }
    eprintln!();
    Ok(st)
}
