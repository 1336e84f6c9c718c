//! The trainer: `k3mini train --config FILE --out RUN`.
//!
//! One optimiser step: `grad_accum` micro-batches (deterministic in the seed and the step, see
//! [`batches`]), each forward + cross-entropy + backward; then gradient clipping, the optimiser
//! ([`optim`]: Muon + AdamW, or AdamW), the MoE bias update ([`balance`]). Every `log_every` steps a
//! line goes to `metrics.jsonl`; every `eval_every` the validation loss ([`eval`]) and `loss.png`;
//! every `checkpoint_every` an atomic checkpoint ([`checkpoint`]). `--resume` continues from the
//! newest checkpoint with identical results.

pub mod balance;
pub mod batches;
pub mod checkpoint;
pub mod config;
pub mod distill;
pub mod eval;
pub mod optim;
pub mod report;
pub mod schedule;

use std::path::{Path, PathBuf};
use std::time::Instant;

use k3_config::ModelConfig;
use k3_data::dataset::Dataset;
use serde_json::{json, Value};
use tch::Device;

use crate::model::Model;
use crate::{Error, Result};
use balance::LoadStats;
use checkpoint::TrainerState;
use config::TrainConfig;
use eval::EvalResult;
use optim::Optimizer;
use report::{log_line, num, Metrics, Progress};

pub struct RunOptions {
    /// The run directory.
    pub out: PathBuf,
    /// Continue from the newest checkpoint in `out`.
    pub resume: bool,
    /// Stop (with a checkpoint) after this many optimiser steps in total, e.g. to pause a long run.
    pub stop_at: Option<u64>,
}

#[derive(Debug)]
pub struct Summary {
    pub step: u64,
    pub tokens: u64,
    pub train_loss: f64,
    pub val: Option<EvalResult>,
    pub checkpoint: PathBuf,
    /// Training tokens per second of pure step time (excluding evaluation and saving).
    pub tokens_per_s: f64,
}

/// The model config a run starts from: the preset at the dataset's vocabulary, with
/// `model.config` laid over its `config.json` fields.
pub fn model_config(cfg: &TrainConfig, vocab: usize) -> Result<ModelConfig> {
    let name = cfg.model.preset.as_deref().ok_or_else(|| Error::Invalid("model.preset is not set".into()))?;
    let base = k3_config::presets::preset(name, Some(vocab))?;
    if cfg.model.config.is_empty() {
        return Ok(base);
    }
    let mut json: Value = serde_json::from_str(&k3_config::hf::to_json_string(&base))
        .map_err(|e| Error::Invalid(format!("preset {name}: {e}")))?;
    let over = serde_json::to_value(&cfg.model.config).map_err(|e| Error::Invalid(format!("model.config: {e}")))?;
    if let (Some(dst), Value::Object(src)) = (json.as_object_mut(), over) {
        for (k, v) in src {
            dst.insert(k, v);
        }
    }
    let parsed = k3_config::hf::parse_config(&json.to_string())
        .map_err(|e| Error::Invalid(format!("model.config over preset {name}: {e}")))?;
    if let Some(w) = parsed.warnings.first() {
        return Err(Error::Invalid(format!("model.config: {w}")));
    }
    Ok(parsed.config)
}

/// Where a forward pass first goes non-finite: "the input of layer i" or "the final norm's output".
fn first_non_finite(model: &Model, inputs: &tch::Tensor) -> String {
    let out = tch::no_grad(|| model.forward(inputs, None, true));
    let finite = |t: &tch::Tensor| bool::try_from(t.isfinite().all()).unwrap_or(false);
    let n = out.hidden_states.len();
    for (i, h) in out.hidden_states.iter().enumerate() {
        if !finite(h) {
            return if i == 0 {
                "the embeddings".into()
            } else if i + 1 == n {
                format!("the final norm's output (layer {} output is finite)", i - 1)
            } else {
                format!("the output of layer {} ({:?})", i - 1, model.layer_kind(i - 1))
            };
        }
    }
    if finite(&out.logits) {
        "nowhere in a replay of the forward pass (the loss or backward overflowed)".into()
    } else {
        "the logits".into()
    }
}

fn nan_error(what: &str, step: u64, run: &Path) -> Error {
    nan_error_at(what, step, run, None)
}

fn nan_error_at(what: &str, step: u64, run: &Path, place: Option<String>) -> Error {
    let last = checkpoint::list(run).last().map(|(s, p)| format!("{} (step {s})", p.display()));
    let place = place.map(|p| format!(" It first appears in {p}.")).unwrap_or_default();
    Error::Invalid(format!(
        "step {}: the {what} is not finite (NaN or inf); the run stopped without applying this update.{place} \
         The last good checkpoint is {}. Lower optim.lr or lengthen schedule.warmup_steps, then continue with \
         `k3mini train --out {} --resume --set optim.lr=...`",
        step + 1,
        last.unwrap_or_else(|| "none yet (the run had not saved one)".into()),
        run.display()
    ))
}

/// Train (or continue training) a model as `cfg` says, in `opts.out`.
pub fn run(cfg: &TrainConfig, opts: &RunOptions) -> Result<Summary> {
    run_with_teacher(cfg, opts, None, None)
}

/// [`run`], with the in-process teacher that `[distill] teacher = ...` (online distillation) uses
/// and, on-policy, the student's sampler.
pub fn run_with_teacher(
    cfg: &TrainConfig,
    opts: &RunOptions,
    teacher: Option<Box<dyn distill::Teacher>>,
    policy: Option<Box<dyn distill::Policy>>,
) -> Result<Summary> {
    let run = opts.out.as_path();
    std::fs::create_dir_all(run).map_err(|e| Error::Invalid(format!("{}: {e}", run.display())))?;
    checkpoint::clean_partial(run);
    let newest = checkpoint::list(run).pop();
    if !opts.resume {
        if let Some((s, _)) = &newest {
            return Err(Error::Invalid(format!(
                "{} already holds checkpoints (newest: step {s}); continue it with --resume, or pick a new --out",
                run.display()
            )));
        }
    }
    let threads = match cfg.train.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    crate::nn::flush_denormals();
    tch::set_num_threads(threads as i32);

    let ds = Dataset::open(&cfg.data.dataset)
        .map_err(|e| Error::Invalid(format!("data.dataset {}: {e}", cfg.data.dataset.display())))?;
    let tokenizer_json = ds.dir.join("tokenizer.json");

    // Model, optimiser and counters: from the newest checkpoint, or fresh.
    let (model, mut opt, mut st) = match (&newest, opts.resume) {
        (Some((_, ckpt)), true) => {
            let st = checkpoint::read_state(ckpt)?;
            let stored =
                TrainConfig::from_toml(&st.config_toml, &[], &ckpt.join("trainer.json").display().to_string())?;
            if stored.model != cfg.model
                || stored.data != cfg.data
                || stored.optim.kind != cfg.optim.kind
                || stored.distill != cfg.distill
            {
                return Err(Error::Invalid(format!(
                    "--resume: the [model], [data], [distill] or optim.kind settings differ from the run's ({}); resume with the \
                     run's own train.toml (omit --config) and change only schedule, train or optimiser rates",
                    ckpt.display()
                )));
            }
            if st.tokenizer_hash != ds.meta.tokenizer_hash {
                return Err(Error::Invalid(format!(
                    "data.dataset {}: its tokenizer differs from the one this run was trained with (checkpoint {})",
                    ds.dir.display(),
                    ckpt.display()
                )));
            }
            let (model, _) = Model::load(ckpt, Device::Cpu)?;
            let mut opt = Optimizer::new(&model, &cfg.optim);
            opt.load(&ckpt.join("optimizer.safetensors"))?;
            eprintln!("resuming {} from {} (step {}, {} tokens)", run.display(), ckpt.display(), st.step, st.tokens);
            (model, opt, st)
        }
        _ => {
            let model = match &cfg.model.checkpoint {
                Some(dir) => Model::load(dir, Device::Cpu)?.0,
                None => Model::init(&model_config(cfg, ds.meta.vocab_size)?, cfg.model.seed, Device::Cpu)?,
            };
            let opt = Optimizer::new(&model, &cfg.optim);
            let st = TrainerState {
                step: 0,
                tokens: 0,
                tokenizer_hash: ds.meta.tokenizer_hash.clone(),
                config_toml: String::new(),
                train_seconds: 0.0,
                loss_sum: 0.0,
                loss_count: 0,
            };
            (model, opt, st)
        }
    };
    if model.config.vocab_size() < ds.meta.vocab_size {
        return Err(Error::Invalid(format!(
            "the model's vocab_size {} is smaller than the dataset's tokenizer ({} tokens); use a matching model",
            model.config.vocab_size(),
            ds.meta.vocab_size
        )));
    }
    st.config_toml = cfg.to_toml();
    k3_format::safetensors_io::write_atomic(&run.join("train.toml"), st.config_toml.as_bytes())?;

    let mut distiller =
        cfg.distill.as_ref().map(|d| distill::Distiller::new(d, &ds, cfg.data.seq_len, teacher, policy)).transpose()?;
    let val_signals = match &cfg.train.val_signals {
        Some(p) => {
            let what = |e: k3_data::Error| Error::Invalid(format!("train.val_signals {}: {e}", p.display()));
            let s = k3_data::signals::SignalStore::open(p).map_err(what)?;
            s.check_tokenizer(&ds.meta.tokenizer_hash, s.header.vocab_size).map_err(what)?;
            Some(s)
        }
        None => None,
    };
    let total = cfg.train.steps;
    let stop = opts.stop_at.map_or(total, |s| s.min(total));
    let (b, t, accum) = (cfg.data.batch_size, cfg.data.seq_len, cfg.data.grad_accum);
    let tps = cfg.tokens_per_step();
    let vocab = model.config.vocab_size() as i64;
    let mut metrics = Metrics::open(run, if st.step == 0 { None } else { Some(st.step) })?;
    let title = format!("{} ({} params)", cfg.model.preset.as_deref().unwrap_or("checkpoint"), model.num_params());
    eprintln!(
        "training {} parameters on {} ({} train tokens): {} steps x {} tokens = {:.2}M tokens, {} threads",
        model.num_params(),
        ds.dir.display(),
        ds.meta.train_tokens,
        total,
        tps,
        (total * tps) as f64 / 1e6,
        threads
    );
    let muon = opt.rules().iter().filter(|(_, r)| *r == optim::Rule::Muon).count();
    eprintln!("optimizer {:?}: {muon} matrices by Muon, {} tensors by AdamW", cfg.optim.kind, opt.rules().len() - muon);

    let progress = Progress::new(st.step, total);
    let mut last_val = None;
    let evaluate = |model: &Model| eval::evaluate(model, &ds.val, t, cfg.train.eval_windows, b);
    let teacher_fields = |model: &Model| -> Result<Vec<(&'static str, Value)>> {
        Ok(match &val_signals {
            Some(s) => {
                let e = distill::evaluate_teacher(model, s, cfg.train.eval_windows, b)?;
                vec![("val_teacher_kl", num(e.kl)), ("val_teacher_top1", num(e.top1))]
            }
            None => vec![],
        })
    };
    if st.step == 0 {
        let v = evaluate(&model)?;
        let mut fields =
            vec![("step", json!(0)), ("tokens", json!(0)), ("val_loss", num(v.loss)), ("val_ppl", num(v.perplexity()))];
        fields.extend(teacher_fields(&model)?);
        metrics.write(&log_line(fields))?;
        progress.say(&format!("step 0: validation loss {:.4} (ppl {:.1})", v.loss, v.perplexity()));
        last_val = Some(v);
    }
    let mut step_seconds = 0.0;
    let mut steps_here = 0u64;
    let mut last_loss = f64::NAN;
    let mut ckpt_path = newest.map(|(_, p)| p).unwrap_or_default();
    while st.step < stop {
        let t0 = Instant::now();
        let lr = schedule::lr_at(&cfg.schedule, cfg.optim.lr, st.step, total);
        let mut stats = LoadStats::default();
        let mut step_loss = 0.0;
        let mut kd_parts = [0.0f64; 3]; // KD, CE, top-1 agreement (distillation only)
        if let Some(d) = distiller.as_mut() {
            d.prepare(&model, run, st.step)?;
        }
        for micro in 0..accum as u64 {
            let (batch, out, loss) = match distiller.as_mut() {
                Some(d) => {
                    let kb = d.batch(&ds, cfg.data.seed, st.step, micro, b, t)?;
                    let out = model.forward(&kb.batch.inputs, None, false);
                    let l = d.losses(&out.logits, &kb);
                    for (acc, x) in kd_parts.iter_mut().zip([l.kd, l.ce, l.top1]) {
                        *acc += x / accum as f64;
                    }
                    (kb.batch, out, l.total)
                }
                None => {
                    let batch = batches::train_batch(&ds.train, cfg.data.seed, st.step, micro, b, t)?;
                    let out = model.forward(&batch.inputs, None, false);
                    let loss = out.logits.view([-1, vocab]).cross_entropy_for_logits(&batch.targets.reshape([-1]));
                    (batch, out, loss)
                }
            };
            let lv = loss.double_value(&[]);
            if !lv.is_finite() {
                let mut place = first_non_finite(&model, &batch.inputs);
                let dbg = run.join("nan-debug");
                let ids = Vec::<i64>::try_from(&batch.inputs.reshape([-1])).unwrap_or_default();
                let saved = model.save(&dbg).and_then(|_| {
                    let t = vec![("inputs".to_string(), vec![b, t], k3_format::safetensors_io::OwnedData::I64(ids))];
                    Ok(k3_format::write_safetensors(&dbg.join("batch.safetensors"), &t, None)?)
                });
                if saved.is_ok() {
                    place += &format!("; the weights and the batch are in {} for inspection", dbg.display());
                }
                return Err(nan_error_at("training loss", st.step, run, Some(place)));
            }
            (loss / accum as f64).backward();
            stats.add(&model, &out.routing);
            step_loss += lv / accum as f64;
        }
        let grad_norm = opt.clip_grad_norm(cfg.optim.clip);
        if !grad_norm.is_finite() {
            return Err(nan_error("gradient norm", st.step, run));
        }
        opt.step(lr);
        opt.zero_grad();
        stats.update_biases(&model, &cfg.moe);
        st.step += 1;
        st.tokens += tps;
        st.loss_sum += step_loss;
        st.loss_count += 1;
        last_loss = step_loss;
        let dt = t0.elapsed().as_secs_f64();
        step_seconds += dt;
        st.train_seconds += dt;
        steps_here += 1;

        if st.step % cfg.train.log_every == 0 || st.step == stop {
            let mut fields = vec![
                ("step", json!(st.step)),
                ("tokens", json!(st.tokens)),
                ("loss", num(step_loss)),
                ("loss_avg", num(st.loss_sum / st.loss_count.max(1) as f64)),
                ("lr", num(lr)),
                ("grad_norm", num(grad_norm)),
                ("tok_per_s", num((steps_here * tps) as f64 / step_seconds.max(1e-9))),
            ];
            if distiller.is_some() {
                fields.push(("kd", num(kd_parts[0])));
                fields.push(("ce", num(kd_parts[1])));
                fields.push(("teacher_top1", num(kd_parts[2])));
            }
            let loads = stats.loads();
            if !loads.is_empty() {
                let worst = loads
                    .iter()
                    .map(|(_, l)| l.iter().cloned().fold(0.0, f64::max) * l.len() as f64)
                    .fold(0.0, f64::max);
                let per_layer: serde_json::Map<String, Value> =
                    loads.into_iter().map(|(li, l)| (li.to_string(), json!(l))).collect();
                fields.push(("expert_load", Value::Object(per_layer)));
                fields.push(("expert_load_max_over_mean", num(worst)));
            }
            metrics.write(&log_line(fields))?;
            st.loss_sum = 0.0;
            st.loss_count = 0;
            progress.update(st.step, step_loss, lr, tps);
        }
        if st.step % cfg.train.eval_every == 0 || st.step == stop {
            let v = evaluate(&model)?;
            if !v.loss.is_finite() {
                return Err(nan_error("validation loss", st.step - 1, run));
            }
            let mut fields = vec![
                ("step", json!(st.step)),
                ("tokens", json!(st.tokens)),
                ("val_loss", num(v.loss)),
                ("val_ppl", num(v.perplexity())),
            ];
            fields.extend(teacher_fields(&model)?);
            metrics.write(&log_line(fields))?;
            metrics.plot(run, &title);
            progress.say(&format!("step {}: validation loss {:.4} (ppl {:.1})", st.step, v.loss, v.perplexity()));
            last_val = Some(v);
        }
        if st.step % cfg.train.checkpoint_every == 0 || st.step == stop {
            ckpt_path = checkpoint::save(run, &model, &opt, &st, &tokenizer_json, cfg.train.keep_checkpoints)?;
        }
    }
    metrics.plot(run, &title);
    Ok(Summary {
        step: st.step,
        tokens: st.tokens,
        train_loss: last_loss,
        val: last_val,
        checkpoint: ckpt_path,
        tokens_per_s: (steps_here * tps) as f64 / step_seconds.max(1e-9),
    })
}
