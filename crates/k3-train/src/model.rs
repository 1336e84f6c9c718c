//! A whole model on a `VarStore`: construction from a config, checkpoint load/save through
//! k3-format (the only bridge between tch and the pure-Rust side), and the forward pass.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use k3_config::ModelConfig;
use k3_format::{save_checkpoint, tensor_specs, Checkpoint};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::kimi::{KimiModel, LayerState, Output};
use crate::llama::{KvCache, LlamaModel};
use crate::nn::set_param;
use crate::{Error, Result};

#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // one per process; boxing buys nothing
pub enum Net {
    Kimi(KimiModel),
    Llama(LlamaModel),
}

/// Decode state for a batch of sequences.
#[derive(Debug)]
pub enum NetState {
    Kimi(Vec<LayerState>),
    Llama(Vec<KvCache>),
}

pub struct Model {
    pub vs: VarStore,
    pub net: Net,
    pub config: ModelConfig,
}

impl Model {
    /// A freshly initialised model (deterministic for a given `seed`).
    pub fn init(cfg: &ModelConfig, seed: i64, device: Device) -> Result<Self> {
        cfg.validate()?;
        let vs = VarStore::new(device);
        let net = crate::with_seed(seed, || match cfg {
            ModelConfig::Kimi(c) => Net::Kimi(KimiModel::new(&vs.root(), c)),
            ModelConfig::Llama(c) => Net::Llama(LlamaModel::new(&vs.root(), c)),
        });
        let model = Self { vs, net, config: cfg.clone() };
        model.check_contract()?;
        Ok(model)
    }

    /// Every VarStore variable is a contract tensor with the contract's shape, and vice versa.
    fn check_contract(&self) -> Result<()> {
        let vars = self.vs.variables();
        let specs = tensor_specs(&self.config);
        for s in &specs {
            let v = vars.get(&s.name).ok_or_else(|| Error::Invalid(format!("model has no parameter `{}`", s.name)))?;
            if v.size().iter().map(|&x| x as usize).collect::<Vec<_>>() != s.shape {
                return Err(Error::Invalid(format!(
                    "parameter `{}` is {:?}, contract says {:?}",
                    s.name,
                    v.size(),
                    s.shape
                )));
            }
        }
        let names: HashSet<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        if let Some(extra) = vars.keys().find(|k| !names.contains(k.as_str())) {
            return Err(Error::Invalid(format!("parameter `{extra}` is not in the weight-name contract")));
        }
        Ok(())
    }

    /// Load a checkpoint directory (config.json + safetensors). Returns the loader's warnings.
    pub fn load(dir: &Path, device: Device) -> Result<(Self, Vec<String>)> {
        let ck = Checkpoint::open(dir)?;
        let model = Self::init(&ck.config, 0, device)?;
        let vars = model.vs.variables();
        for spec in tensor_specs(&ck.config) {
            let data = ck.read(&spec)?;
            set_param(&vars[&spec.name], &Tensor::from_slice(&data));
        }
        Ok((model, ck.warnings))
    }

    /// Write config.json + model.safetensors (f32) in Moonshot's layout, atomically.
    pub fn save(&self, dir: &Path) -> Result<()> {
        let vars = self.vs.variables();
        let mut out = HashMap::new();
        for spec in tensor_specs(&self.config) {
            let t = vars[&spec.name].to_kind(Kind::Float).to_device(Device::Cpu).flatten(0, -1);
            out.insert(spec.name, Vec::<f32>::try_from(&t)?);
        }
        save_checkpoint(dir, &self.config, out)?;
        Ok(())
    }

    pub fn new_state(&self, batch: i64) -> NetState {
        match &self.net {
            Net::Kimi(m) => NetState::Kimi(m.new_state(batch)),
            Net::Llama(m) => NetState::Llama(m.new_state()),
        }
    }

    /// # Shapes
    /// ids: [B,T] int64 → logits [B,T,V] (+ hidden states and MoE routing, see [`Output`]).
    pub fn forward(&self, ids: &Tensor, state: Option<&mut NetState>, want_hidden: bool) -> Output {
        match (&self.net, state) {
            (Net::Kimi(m), Some(NetState::Kimi(s))) => m.forward(ids, Some(s), want_hidden),
            (Net::Kimi(m), _) => m.forward(ids, None, want_hidden),
            (Net::Llama(m), st) => {
                let s = match st {
                    Some(NetState::Llama(s)) => Some(s),
                    _ => None,
                };
                let (logits, hidden_states) = m.forward(ids, s, want_hidden);
                Output { logits, hidden_states, routing: vec![] }
            }
        }
    }

    /// "KDA" / "MLA" / "attention" for layer i (diagnostics).
    pub fn layer_kind(&self, i: usize) -> String {
        match &self.net {
            Net::Kimi(m) => match m.blocks.get(i).map(|b| &b.mixer) {
                Some(crate::kimi::Mixer::Kda(_)) => "KDA".into(),
                Some(crate::kimi::Mixer::Mla(_)) => "MLA".into(),
                None => "?".into(),
            },
            Net::Llama(_) => "attention".into(),
        }
    }

    /// Number of parameters held (the VarStore's, equal to the contract's).
    pub fn num_params(&self) -> i64 {
        self.vs.variables().values().map(|t| t.numel() as i64).sum()
    }
}
