//! A loaded model of either family, on token ids, with one [`SeqState`] per sequence.

use std::path::Path;

use k3_config::ModelConfig;

use crate::kimi::{KimiModel, LayerState};
use crate::linear::Compute;
use crate::llama::{KvCache, LlamaModel};
use crate::source::Source;
use crate::{Error, Result};

pub enum Net {
    Kimi(KimiModel),
    Llama(LlamaModel),
}

/// Everything one sequence carries between calls.
#[derive(Debug, Clone)]
pub enum SeqLayers {
    Kimi(Vec<LayerState>),
    Llama(Vec<KvCache>),
}

#[derive(Debug, Clone)]
pub struct SeqState {
    /// Tokens consumed so far (the next token's position).
    pub pos: usize,
    pub layers: SeqLayers,
}

impl SeqState {
    /// Bytes of inference state held (KDA state and conv tail in f32, the MLA latent cache and the
    /// KV cache in their own type).
    pub fn bytes(&self) -> usize {
        match &self.layers {
            SeqLayers::Kimi(ls) => ls
                .iter()
                .map(|l| match l {
                    LayerState::Kda(k) => 4 * (k.conv.len() + k.s.len()),
                    LayerState::Mla(c) => c.bytes(),
                })
                .sum::<usize>(),
            SeqLayers::Llama(ls) => ls.iter().map(|c| c.k.bytes() + c.v.bytes()).sum(),
        }
    }
}

/// Which rows of logits to compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position's [V] (prefill before sampling, decode).
    Last,
    /// Every position's [T, V].
    All,
}

pub struct Model {
    pub net: Net,
    pub config: ModelConfig,
    /// Maximum positions per sequence (from the config; the engine refuses longer inputs).
    pub n_ctx: usize,
    /// Threads and activation precision for every matmul.
    pub compute: Compute,
}

impl Model {
    /// Load a checkpoint directory (safetensors + config.json) or a GGUF file.
    pub fn load(path: &Path) -> Result<(Self, Vec<String>)> {
        let (src, warnings) = Source::open(path)?;
        let config = src.config().clone();
        let net = match &config {
            ModelConfig::Kimi(c) => Net::Kimi(KimiModel::load(&src, c)?),
            ModelConfig::Llama(c) => Net::Llama(LlamaModel::load(&src, c)?),
        };
        let n_ctx = match &config {
            ModelConfig::Kimi(c) => c.max_position_embeddings,
            ModelConfig::Llama(c) => c.max_position_embeddings,
        };
        Ok((Self { net, config, n_ctx, compute: Compute::default() }, warnings))
    }

    /// Attach a routing tap to every MoE layer; errors when the model has none.
    pub fn set_routing_tap(&mut self, tap: std::sync::Arc<dyn crate::routing::RoutingTap>) -> Result<usize> {
        match &mut self.net {
            Net::Kimi(m) => match m.set_routing_tap(Some(tap)) {
                0 => Err(Error::Invalid("the model has no MoE layers (every FFN is dense); routing statistics need a mixture-of-experts checkpoint".into())),
                n => Ok(n),
            },
            Net::Llama(_) => Err(Error::Invalid("a Llama model has no experts; routing statistics need a Kimi / K3 MoE checkpoint".into())),
        }
    }

    pub fn vocab_size(&self) -> usize {
        self.config.vocab_size()
    }

    pub fn new_state(&self) -> SeqState {
        let layers = match &self.net {
            Net::Kimi(m) => SeqLayers::Kimi(m.new_state()),
            Net::Llama(m) => SeqLayers::Llama(m.new_state()),
        };
        SeqState { pos: 0, layers }
    }

    /// Feed `tokens` to a sequence and return logits ([V] for `Last`, [T, V] for `All`).
    /// Errors (and leaves the state untouched) on an out-of-vocabulary id or when the sequence
    /// would exceed the context.
    pub fn forward(&self, tokens: &[u32], st: &mut SeqState, which: Logits) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(Error::Invalid("no tokens to process".into()));
        }
        let v = self.vocab_size();
        if let Some(bad) = tokens.iter().find(|&&x| x as usize >= v) {
            return Err(Error::Invalid(format!("token id {bad} is outside the vocabulary (vocab_size {v})")));
        }
        if st.pos + tokens.len() > self.n_ctx {
            return Err(Error::Invalid(format!(
                "the sequence would hold {} tokens, more than the model's context of {} (max_position_embeddings); shorten the prompt",
                st.pos + tokens.len(),
                self.n_ctx
            )));
        }
        let t = tokens.len();
        let (hidden, head) = match (&self.net, &mut st.layers) {
            (Net::Kimi(m), SeqLayers::Kimi(ls)) => (m.hidden(tokens, ls, self.compute), m.lm_head()),
            (Net::Llama(m), SeqLayers::Llama(ls)) => (m.hidden(tokens, ls, self.compute), m.lm_head()),
            _ => return Err(Error::Invalid("a sequence state from another model was passed".into())),
        };
        st.pos += t;
        let d = self.config.hidden_size();
        Ok(match which {
            Logits::All => head.apply(&hidden, t, self.compute),
            Logits::Last => head.apply(&hidden[(t - 1) * d..], 1, self.compute),
        })
    }
}
