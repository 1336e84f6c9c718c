//! A checkpoint directory: `config.json` + `model.safetensors` (or shards with
//! `model.safetensors.index.json`), read against the weight-name contract.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use k3_config::{hf, ModelConfig};

use crate::safetensors_io::{write_atomic, write_safetensors, OwnedData, SafetensorsFile, TensorRef};
use crate::weights::{tensor_specs, TensorKind, TensorSpec};
use crate::{io_err, Error, Result};

pub struct Checkpoint {
    pub dir: PathBuf,
    pub config: ModelConfig,
    /// Config-parser and loader warnings (unknown fields, unused tensors, …).
    pub warnings: Vec<String>,
    files: Vec<SafetensorsFile>,
    index: HashMap<String, usize>,
}

/// Read and parse `dir/config.json`.
pub fn read_config(dir: &Path) -> Result<(ModelConfig, Vec<String>)> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
    let parsed = hf::parse_config(&text).map_err(|source| Error::Config { path: path.clone(), source })?;
    Ok((parsed.config, parsed.warnings))
}

impl Checkpoint {
    /// Open a checkpoint directory (config + every safetensors shard, memory-mapped).
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(Error::Invalid(format!(
                "{}: not a checkpoint directory (expected config.json + model.safetensors inside)",
                dir.display()
            )));
        }
        let (config, warnings) = read_config(dir)?;
        let index_path = dir.join("model.safetensors.index.json");
        let shard_names: Vec<String> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(io_err(&index_path))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::Invalid(format!("{}: not valid JSON: {e}", index_path.display())))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::Invalid(format!("{}: missing the `weight_map` object", index_path.display())))?;
            let mut names: Vec<String> = map.values().filter_map(|f| f.as_str().map(str::to_string)).collect();
            names.sort();
            names.dedup();
            names
        } else {
            vec!["model.safetensors".to_string()]
        };
        let mut files = Vec::new();
        let mut index = HashMap::new();
        for name in &shard_names {
            let f = SafetensorsFile::open(&dir.join(name))?;
            for t in f.names() {
                index.insert(t, files.len());
            }
            files.push(f);
        }
        let mut ck = Self { dir: dir.to_path_buf(), config, warnings, files, index };
        let expected: std::collections::HashSet<String> =
            tensor_specs(&ck.config).into_iter().flat_map(|s| std::iter::once(s.name).chain(s.alt_name)).collect();
        let mut unused: Vec<&String> = ck.index.keys().filter(|n| !expected.contains(*n)).collect();
        unused.sort();
        if !unused.is_empty() {
            let list: Vec<&str> = unused.iter().take(5).map(|s| s.as_str()).collect();
            ck.warnings.push(format!(
                "{} tensor(s) in the checkpoint are not used by this config, e.g. {}",
                unused.len(),
                list.join(", ")
            ));
        }
        Ok(ck)
    }

    /// The raw tensor stored under `name`, if any.
    pub fn tensor<'a>(&'a self, name: &'a str) -> Option<TensorRef<'a>> {
        let f = self.files.get(*self.index.get(name)?)?;
        f.tensor(name)
    }

    /// A path to name in errors about `name` (its shard, or the main file).
    fn path_of(&self, name: &str) -> PathBuf {
        match self.index.get(name) {
            Some(&i) => self.files[i].path.clone(),
            None => self.files.first().map(|f| f.path.clone()).unwrap_or_else(|| self.dir.clone()),
        }
    }

    /// Read one tensor of the contract as f32 in its canonical shape, resolving alternative names
    /// and the shape variants real checkpoints use (conv kernels as [C, K]; A_log as [H] or
    /// [1,1,H,1], or K3's [dk] of which llama.cpp keeps the first H).
    pub fn read(&self, spec: &TensorSpec) -> Result<Vec<f32>> {
        let name = match (&spec.alt_name, self.tensor(&spec.name)) {
            (_, Some(_)) => spec.name.as_str(),
            (Some(alt), None) if self.tensor(alt).is_some() => alt.as_str(),
            _ => {
                return Err(Error::MissingTensor {
                    name: spec.name.clone(),
                    path: self.path_of(&spec.name),
                    hint: format!(
                        " (config.json implies it, shape {:?}); was the checkpoint saved with a different config?",
                        spec.shape
                    ),
                })
            }
        };
        let t = self.tensor(name).ok_or_else(|| Error::Invalid(format!("tensor `{name}` vanished")))?;
        let data = t.to_f32()?;
        let n = spec.numel();
        let is_a_log = spec.name.ends_with(".A_log");
        let ok = t.shape == spec.shape.as_slice()
            || (spec.kind == TensorKind::Conv && t.numel() == n && t.shape.len() >= 2)
            || (is_a_log && t.numel() == n)
            || spec.shape.iter().product::<usize>() == t.numel()
                && t.shape.iter().filter(|&&x| x != 1).eq(spec.shape.iter().filter(|&&x| x != 1));
        if ok {
            return Ok(data);
        }
        if is_a_log && t.numel() > n {
            // A real K3 checkpoint ships A_log as [dk]; llama.cpp and sglang take the first H entries.
            return Ok(data[..n].to_vec());
        }
        Err(Error::Shape {
            name: name.to_string(),
            path: t.path.to_path_buf(),
            expected: spec.shape.clone(),
            got: t.shape.to_vec(),
            hint: " (from config.json); was the checkpoint saved with a different config?".into(),
        })
    }

    /// Read every tensor of the contract, in spec order.
    pub fn read_all(&self) -> Result<Vec<(TensorSpec, Vec<f32>)>> {
        tensor_specs(&self.config)
            .into_iter()
            .map(|s| {
                let d = self.read(&s)?;
                Ok((s, d))
            })
            .collect()
    }
}

/// Write a checkpoint: every tensor of `cfg`'s contract must be given, under its canonical name
/// and shape. Writes `model.safetensors` then `config.json`, each atomically.
pub fn save_checkpoint(dir: &Path, cfg: &ModelConfig, tensors: HashMap<String, Vec<f32>>) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let specs = tensor_specs(cfg);
    let mut tensors = tensors;
    let mut out = Vec::with_capacity(specs.len());
    for s in &specs {
        let data = tensors
            .remove(&s.name)
            .ok_or_else(|| Error::Invalid(format!("save_checkpoint: tensor `{}` was not provided", s.name)))?;
        if data.len() != s.numel() {
            return Err(Error::Invalid(format!(
                "save_checkpoint: tensor `{}` has {} values, shape {:?} needs {}",
                s.name,
                data.len(),
                s.shape,
                s.numel()
            )));
        }
        out.push((s.name.clone(), s.shape.clone(), OwnedData::F32(data)));
    }
    if let Some(extra) = tensors.keys().next() {
        return Err(Error::Invalid(format!("save_checkpoint: tensor `{extra}` is not part of this config")));
    }
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    write_safetensors(&dir.join("model.safetensors"), &out, Some(meta))?;
    write_atomic(&dir.join("config.json"), hf::to_json_string(cfg).as_bytes())
}
