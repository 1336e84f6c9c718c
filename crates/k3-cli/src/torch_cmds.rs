//! Commands that run the tch (libtorch) model: `init`, `logits --engine torch`.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use k3_format::safetensors_io::{write_safetensors, OwnedData};
use k3_train::Model;
use tch::{Device, Kind, Tensor};

pub fn init(preset: &str, out: &Path, seed: i64, vocab: Option<usize>) -> Result<()> {
    let cfg = k3_config::presets::preset(preset, vocab)?;
    let model = Model::init(&cfg, seed, Device::Cpu)?;
    model.save(out).with_context(|| format!("writing the checkpoint to {}", out.display()))?;
    let profile = match &cfg {
        k3_config::ModelConfig::Kimi(c) => c.profile().name(),
        k3_config::ModelConfig::Llama(_) => "llama",
    };
    println!("wrote {} ({} profile, {} parameters, seed {seed})", out.display(), profile, model.num_params());
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
