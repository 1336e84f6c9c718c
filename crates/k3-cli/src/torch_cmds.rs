//! Commands that run the tch (libtorch) model: `init`, `train`, `eval`, `logits --engine torch`.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use k3_format::safetensors_io::{write_safetensors, OwnedData};
use k3_train::Model;
use tch::{Device, Kind, Tensor};

pub fn init(
    preset: &str,
    out: &Path,
    seed: i64,
    vocab: Option<usize>,
    embed_from: Option<&Path>,
    inherit_ffn: bool,
) -> Result<()> {
    let teacher = match embed_from {
        Some(path) => {
            let (src, warnings) =
                k3_infer::source::Source::open(path).with_context(|| format!("--embed-from {}", path.display()))?;
            for w in warnings {
                eprintln!("warning: {w}");
            }
            Some((path, src))
        }
        None => None,
    };
    // A student that inherits the teacher's embedding has the teacher's vocabulary unless told otherwise.
    let vocab = vocab.or(teacher.as_ref().map(|(_, src)| src.config().vocab_size()));
    let cfg = k3_config::presets::preset(preset, vocab)?;
    let model = Model::init(&cfg, seed, Device::Cpu)?;
    if let Some((path, src)) = &teacher {
        inherit_from(&model, path, src, inherit_ffn).with_context(|| format!("--embed-from {}", path.display()))?;
    }
    model.save(out).with_context(|| format!("writing the checkpoint to {}", out.display()))?;
    let profile = match &cfg {
        k3_config::ModelConfig::Kimi(c) => c.profile().name(),
        k3_config::ModelConfig::Llama(_) => "llama",
    };
    println!("wrote {} ({} profile, {} parameters, seed {seed})", out.display(), profile, model.num_params());
    Ok(())
}

/// The teacher's embedding and head (and with `ffn` its FFNs), projected into `model`
/// (k3_train::inherit).
fn inherit_from(model: &Model, teacher: &Path, src: &k3_infer::source::Source, ffn: bool) -> Result<()> {
    let tc = src.config();
    let (v, width) = (tc.vocab_size(), tc.hidden_size());
    if v != model.config.vocab_size() {
        bail!(
            "the teacher's vocabulary has {v} tokens, the student's {}: initialise with --vocab {v} (or without \
             --vocab) and train on data built with the teacher's tokenizer",
            model.config.vocab_size()
        );
    }
    let embed = src.vector("model.embed_tokens.weight", v * width)?;
    let tied = matches!(tc, k3_config::ModelConfig::Llama(c) if c.tie_word_embeddings);
    let head = if tied { None } else { Some(src.vector("lm_head.weight", v * width)?) };
    let r = k3_train::inherit::inherit_embeddings(model, &embed, head.as_deref().unwrap_or(&embed), width)?;
    println!(
        "embedding and head from {} (width {width} -> {}): {:.1}% of the embedding's energy kept; rms {:.4} / {:.4} \
         (the head scaled to a fresh head's)",
        teacher.display(),
        model.config.hidden_size(),
        100.0 * r.energy_kept,
        r.embed_rms,
        r.head_rms
    );
    if ffn {
        let k3_config::ModelConfig::Llama(lc) = tc else {
            bail!(
                "--inherit-ffn needs a Llama-family teacher (SwiGLU FFNs in every layer); this teacher is {}",
                tc.arch_name()
            );
        };
        let f = lc.intermediate_size;
        let load = |i: usize| -> k3_train::Result<k3_train::inherit::TeacherFfn> {
            let get = |name: &str, n: usize| {
                src.vector(&format!("model.layers.{i}.{name}"), n)
                    .map_err(|e| k3_train::Error::Invalid(format!("the teacher's {name} of layer {i}: {e}")))
            };
            Ok(k3_train::inherit::TeacherFfn {
                gate: get("mlp.gate_proj.weight", f * width)?,
                up: get("mlp.up_proj.weight", f * width)?,
                down: get("mlp.down_proj.weight", width * f)?,
                norm: get("post_attention_layernorm.weight", width)?,
            })
        };
        let n = k3_train::inherit::inherit_ffns(model, &r, lc.num_hidden_layers, &load)?;
        println!("{n} dense FFNs from the teacher's {} layers (their {f} channels narrowed)", lc.num_hidden_layers);
    }
    Ok(())
}

pub fn logits(model_dir: &Path, ids: &[i64], out: &Path, engine: &str, threads: Option<usize>) -> Result<()> {
    if engine != "torch" {
        bail!("--engine `{engine}` is not available in this build; allowed: torch");
    }
    if let Some(n) = threads {
        tch::set_num_threads(n as i32);
    }
    let (model, warnings) =
        Model::load(model_dir, Device::Cpu).with_context(|| format!("loading {}", model_dir.display()))?;
    for w in warnings {
        eprintln!("warning: {w}");
    }
    let vocab = model.config.vocab_size() as i64;
    if let Some(bad) = ids.iter().find(|&&x| x >= vocab) {
        bail!("--ids: token id {bad} is outside the model's vocabulary (vocab_size {vocab})");
    }
    let t = ids.len();
    let input = Tensor::from_slice(ids).view([1, t as i64]);
    let logits = tch::no_grad(|| model.forward(&input, None, false)).logits.squeeze_dim(0).to_kind(Kind::Float);
    let data = Vec::<f32>::try_from(&logits.flatten(0, -1))?;
    let meta = HashMap::from([("engine".to_string(), "torch".to_string()), ("ids".to_string(), format!("{ids:?}"))]);
    write_safetensors(out, &[("logits".into(), vec![t, vocab as usize], OwnedData::F32(data))], Some(meta))
        .with_context(|| format!("writing {}", out.display()))?;
    let last = logits.get(t as i64 - 1);
    let (vals, idx) = last.topk(5.min(vocab), -1, true, true);
    let top: Vec<String> =
        (0..idx.size()[0]).map(|i| format!("{} ({:.3})", idx.int64_value(&[i]), vals.double_value(&[i]))).collect();
    println!(
        "wrote logits [{t}, {vocab}] to {}; top-5 next ids after the last position: {}",
        out.display(),
        top.join(", ")
    );
    Ok(())
}

pub fn train(a: &crate::TrainArgs, distill: bool) -> Result<()> {
    use k3_train::trainer::{self, config::TrainConfig};
    let path = match (&a.config, a.resume) {
        (Some(p), _) => p.clone(),
        (None, true) => a.out.join("train.toml"),
        (None, false) => {
            bail!("give --config FILE (a training config, see docs/training.md), or --resume an existing --out")
        }
    };
    let cfg = TrainConfig::load(&path, &a.set)?;
    if distill && cfg.distill.is_none() {
        bail!(
            "{}: `k3mini distill` needs a [distill] section (store = \"STORE\" from `k3mini capture`, or teacher = \"TEACHER.gguf\"); see docs/distillation.md",
            path.display()
        );
    }
    let teacher: Option<Box<dyn trainer::distill::Teacher>> =
        match cfg.distill.as_ref().and_then(|d| d.teacher.as_ref()) {
            Some(p) => Some(Box::new(crate::teacher::EngineTeacher::load(p, cfg.train.threads.max(1))?)),
            None => None,
        };
    let policy: Option<Box<dyn trainer::distill::Policy>> = match cfg.distill.as_ref().map(|d| d.mode) {
        Some(trainer::config::DistillMode::OnPolicy) => {
            Some(Box::new(crate::teacher::EnginePolicy::new(cfg.train.threads.max(1))))
        }
        _ => None,
    };
    let opts = trainer::RunOptions { out: a.out.clone(), resume: a.resume, stop_at: a.stop_at };
    let s = trainer::run_with_teacher(&cfg, &opts, teacher, policy)
        .with_context(|| format!("training in {}", a.out.display()))?;
    if s.train_loss.is_nan() && s.val.is_none() {
        // Resumed at the last step: nothing ran in this process.
        println!("step {}: already complete; checkpoint {}", s.step, s.checkpoint.display());
        return Ok(());
    }
    let val = s.val.as_ref().map_or("n/a".to_string(), |v| format!("{:.4} (ppl {:.2})", v.loss, v.perplexity()));
    println!(
        "step {} ({:.2}M tokens): train loss {:.4}, validation loss {val}, {:.0} tokens/s; checkpoint {}",
        s.step,
        s.tokens as f64 / 1e6,
        s.train_loss,
        s.tokens_per_s,
        s.checkpoint.display()
    );
    Ok(())
}

#[allow(clippy::too_many_arguments)] // one per CLI flag
pub fn eval(
    model_dir: &Path,
    data: &Path,
    contexts: &str,
    windows: usize,
    batch: usize,
    threads: Option<usize>,
    json: Option<&Path>,
    signals: Option<&Path>,
) -> Result<()> {
    if let Some(n) = threads {
        tch::set_num_threads(n as i32);
    }
    let ctx: Vec<usize> = contexts
        .split(',')
        .map(|c| c.trim().parse::<usize>().with_context(|| format!("--context: `{c}` is not a length")))
        .collect::<Result<_>>()?;
    let (model, _) = Model::load(model_dir, Device::Cpu).with_context(|| format!("loading {}", model_dir.display()))?;
    let ds = k3_data::dataset::Dataset::open(data)?;
    if model.config.vocab_size() < ds.meta.vocab_size {
        bail!(
            "{}: vocab_size {} < the dataset's {}; wrong dataset?",
            model_dir.display(),
            model.config.vocab_size(),
            ds.meta.vocab_size
        );
    }
    let mut results = Vec::new();
    for c in ctx {
        let r = k3_train::trainer::eval::evaluate(&model, &ds.val, c, windows, batch)?;
        println!(
            "context {:>6}: loss {:.4}  ppl {:8.2}  ({} windows)  by quarter: {:.3} {:.3} {:.3} {:.3}",
            c,
            r.loss,
            r.perplexity(),
            r.windows,
            r.by_quarter[0],
            r.by_quarter[1],
            r.by_quarter[2],
            r.by_quarter[3]
        );
        results.push(r);
    }
    let teacher = match signals {
        Some(p) => {
            let s = k3_data::signals::SignalStore::open(p).with_context(|| format!("--signals {}", p.display()))?;
            s.check_tokenizer(&ds.meta.tokenizer_hash, s.header.vocab_size)?;
            let e = k3_train::trainer::distill::evaluate_teacher(&model, &s, windows, batch)?;
            println!(
                "teacher: KL(teacher || student) {:.4} nats/token, top-1 agreement {:.4} ({} positions of {})",
                e.kl,
                e.top1,
                e.positions,
                p.display()
            );
            Some(e)
        }
        None => None,
    };
    if let Some(p) = json {
        let text = match teacher {
            Some(t) => serde_json::to_string_pretty(&serde_json::json!({"contexts": results, "teacher": t}))?,
            None => serde_json::to_string_pretty(&results)?,
        };
        k3_format::safetensors_io::write_atomic(p, text.as_bytes())?;
    }
    Ok(())
}
