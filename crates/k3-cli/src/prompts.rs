//! `k3mini prompts`: code-task prompt sets cut from a dataset's own sources (docstring → body,
//! signature → implementation), from its train or its held-out split. `k3mini score`: a model's
//! greedy continuations of prompts, scored by a teacher (teacher-forced log-probability per token
//! and top-1 agreement), plus the model's loss on each prompt's reference body.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use k3_data::corpus::{collect, is_validation, CorpusStats, Source};
use k3_data::prompts::{python_functions, PromptKind};
use k3_infer::tokenizer::Tokenizer;
use serde_json::{json, Value};

#[derive(clap::Args)]
pub struct PromptsArgs {
    /// A dataset built by `k3mini data build`: its sources are read again and split the same way.
    #[arg(long)]
    data: PathBuf,
    /// train | val (held out: the documents the dataset's validation split holds).
    #[arg(long, default_value = "val")]
    split: String,
    /// docstring,signature
    #[arg(long, default_value = "docstring,signature")]
    kinds: String,
    /// At most this many prompts, spread evenly over all that were found.
    #[arg(long, default_value_t = 200)]
    max: usize,
    /// Skip functions whose body has more than this many non-blank lines.
    #[arg(long, default_value_t = 30)]
    max_body: usize,
    #[arg(long)]
    out: PathBuf,
}

pub fn prompts(a: &PromptsArgs) -> Result<()> {
    let mp = a.data.join("meta.json");
    let meta: k3_data::dataset::DatasetMeta =
        serde_json::from_str(&std::fs::read_to_string(&mp).with_context(|| {
            format!("{}: is {} a dataset built with `k3mini data build`?", mp.display(), a.data.display())
        })?)
        .with_context(|| mp.display().to_string())?;
    let val = match a.split.as_str() {
        "val" => true,
        "train" => false,
        other => bail!("--split {other}: allowed: train, val"),
    };
    let kinds = a
        .kinds
        .split(',')
        .map(|k| match k.trim() {
            "docstring" => Ok(PromptKind::Docstring),
            "signature" => Ok(PromptKind::Signature),
            other => bail!("--kinds: `{other}` is not a kind; allowed: docstring, signature"),
        })
        .collect::<Result<Vec<_>>>()?;
    let sources = meta.sources.iter().map(|s| Source::parse(s)).collect::<k3_data::Result<Vec<_>>>()?;
    let docs = collect(&sources, &crate::cache_dir(), &mut CorpusStats::default())?;
    let mut all = Vec::new();
    for d in docs.iter().filter(|d| is_validation(d, meta.val_permille) == val && d.origin.ends_with(".py")) {
        all.extend(python_functions(&d.text, &d.origin, &kinds, a.max_body));
    }
    if all.is_empty() {
        bail!(
            "{}: no Python functions in its {} split (the prompt sets need Python sources)",
            a.data.display(),
            a.split
        );
    }
    let n = a.max.min(all.len());
    let mut text = String::new();
    for i in 0..n {
        let p = &all[i * all.len() / n];
        text.push_str(&serde_json::to_string(p)?);
        text.push('\n');
    }
    k3_format::safetensors_io::write_atomic(&a.out, text.as_bytes())?;
    println!("wrote {n} prompts (of {} found in the {} split) to {}", all.len(), a.split, a.out.display());
    Ok(())
}

#[derive(clap::Args)]
pub struct ScoreArgs {
    /// The model whose continuations are scored (checkpoint with tokenizer.json, or GGUF).
    #[arg(long)]
    model: PathBuf,
    /// The judge: a teacher with the same tokenizer.
    #[arg(long)]
    teacher: PathBuf,
    /// Prompts JSONL ("prompt", optionally "reference"), e.g. from `k3mini prompts` or HumanEval.
    #[arg(long)]
    prompts: PathBuf,
    #[arg(long, default_value_t = 64)]
    max_new: usize,
    /// Score only the first N prompts.
    #[arg(long)]
    limit: Option<usize>,
    #[arg(long, default_value_t = 1)]
    threads: usize,
    #[arg(long)]
    json: Option<PathBuf>,
}

fn read_jsonl(path: &Path) -> Result<Vec<Value>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("--prompts {}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(n, l)| {
            let v: Value = serde_json::from_str(l).with_context(|| format!("{}: line {}", path.display(), n + 1))?;
            if !v["prompt"].is_string() {
                bail!("{}: line {}: needs a \"prompt\" string", path.display(), n + 1);
            }
            Ok(v)
        })
        .collect()
}

/// Mean log-probability `lp` [T, V] gives to `tokens[from..]` (row i predicts token i + 1), and
/// the fraction of those that are `lp`'s argmax.
fn score_span(lp: &[f32], v: usize, tokens: &[u32], from: usize) -> (f64, f64, usize) {
    let (mut sum, mut top1, mut n) = (0.0, 0usize, 0usize);
    for i in from.max(1)..tokens.len() {
        let row = &lp[(i - 1) * v..i * v];
        sum += row[tokens[i] as usize] as f64;
        let arg = row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |x| x.0);
        top1 += (arg == tokens[i] as usize) as usize;
        n += 1;
    }
    (sum / n.max(1) as f64, top1 as f64 / n.max(1) as f64, n)
}

pub fn score(a: &ScoreArgs) -> Result<()> {
    let student = crate::native::load(&a.model, a.threads, false)?;
    let teacher = crate::native::load(&a.teacher, a.threads, false)?;
    let tok = Tokenizer::for_model(&a.model)?
        .with_context(|| format!("{}: no tokenizer (tokenizer.json or GGUF vocabulary)", a.model.display()))?;
    if student.vocab_size() > teacher.vocab_size() {
        bail!(
            "{} has a larger vocabulary than the teacher {}; they must share a tokenizer",
            a.model.display(),
            a.teacher.display()
        );
    }
    let mut prompts = read_jsonl(&a.prompts)?;
    prompts.truncate(a.limit.unwrap_or(usize::MAX));
    let stop = tok.eos;
    let (v_s, v_t) = (student.vocab_size(), teacher.vocab_size());
    let mut rows = Vec::new();
    let (mut lp_sum, mut agree_sum, mut ref_sum, mut ref_n) = (0.0, 0.0, 0.0, 0usize);
    let t0 = std::time::Instant::now();
    for (i, p) in prompts.iter().enumerate() {
        let ids = tok.encode(p["prompt"].as_str().unwrap_or_default())?;
        let room = student.n_ctx.min(teacher.n_ctx).saturating_sub(ids.len() + 1);
        if ids.is_empty() || room == 0 {
            continue;
        }
        // Greedy continuation by the model.
        let gen = crate::native::continue_ids(&student, &ids, a.max_new.min(room), Default::default(), stop)?;
        let seq = [&ids[..], &gen[..]].concat();
        let lp = crate::capture::teacher_logprobs(&teacher, &seq, 1.0)?;
        let (tlp, agree, n) = score_span(&lp, v_t, &seq, ids.len());
        lp_sum += tlp;
        agree_sum += agree;
        let mut row = json!({"origin": p["origin"], "generated_tokens": n, "teacher_logprob": tlp, "teacher_top1": agree,
                             "continuation": tok.decode(&gen).unwrap_or_default()});
        if let Some(r) = p["reference"].as_str() {
            let rseq = [ids.clone(), tok.encode(r)?].concat();
            if rseq.len() <= student.n_ctx {
                let own = crate::capture::teacher_logprobs(&student, &rseq, 1.0)?;
                let (rlp, _, _) = score_span(&own, v_s, &rseq, ids.len());
                ref_sum += -rlp;
                ref_n += 1;
                row["reference_nll"] = json!(-rlp);
            }
        }
        rows.push(row);
        eprint!("\rscored {}/{}", i + 1, prompts.len());
    }
    eprintln!();
    if rows.is_empty() {
        bail!("{}: no prompt fits the models' context", a.prompts.display());
    }
    let scored = rows.len();
    let n = scored as f64;
    let summary = json!({
        "model": a.model.display().to_string(), "teacher": a.teacher.display().to_string(),
        "prompts": a.prompts.display().to_string(), "scored": rows.len(), "max_new": a.max_new,
        "teacher_logprob_per_token": lp_sum / n, "teacher_top1_agreement": agree_sum / n,
        "reference_nll_per_token": if ref_n > 0 { json!(ref_sum / ref_n as f64) } else { Value::Null },
        "seconds": t0.elapsed().as_secs_f64(), "rows": rows,
    });
    println!(
        "{} prompts: teacher log-prob/token of greedy continuations {:.3}, teacher top-1 agreement {:.3}, reference NLL/token {}",
        scored,
        lp_sum / n,
        agree_sum / n,
        if ref_n > 0 { format!("{:.3}", ref_sum / ref_n as f64) } else { "n/a".into() }
    );
    if let Some(path) = &a.json {
        let mut f = Vec::new();
        writeln!(f, "{}", serde_json::to_string_pretty(&summary)?)?;
        k3_format::safetensors_io::write_atomic(path, &f)?;
    }
    Ok(())
}
