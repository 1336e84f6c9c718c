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

impl SeqLayers {
    /// A Kimi sequence's layer states (the callers have checked the family: `state_fits`).
    fn kimi(&mut self) -> &mut [LayerState] {
        match self {
            SeqLayers::Kimi(l) => l,
            SeqLayers::Llama(_) => unreachable!("a Kimi model's sequences are checked to be Kimi states"),
        }
    }

    /// A Llama sequence's KV caches.
    fn llama(&mut self) -> &mut [KvCache] {
        match self {
            SeqLayers::Llama(l) => l,
            SeqLayers::Kimi(_) => unreachable!("a Llama model's sequences are checked to be Llama states"),
        }
    }
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

/// Most tokens one pass through the layers takes; [`Model::forward`] cuts longer inputs into
/// passes of this length. At the 370M bench shape, 2048-token passes prefilled 4096 tokens ~8%
/// faster than 512-token ones (docs/benchmarks.md), with ~50 MB of activations a pass.
pub const PREFILL_CHUNK: usize = 2048;

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
            ModelConfig::Kimi(c) => KimiModel::load(&src, c).map(Net::Kimi),
            ModelConfig::Llama(c) => LlamaModel::load(&src, c).map(Net::Llama),
        };
        // This thread's open huge-page chunk is let go, after a failed load too (what was carved
        // from it then goes with the dropped matrices).
        k3_kernels::hugebuf::seal();
        let net = net?;
        let n_ctx = match &config {
            ModelConfig::Kimi(c) => c.max_position_embeddings,
            ModelConfig::Llama(c) => c.max_position_embeddings,
        };
        // The weights onto huge pages, by default on a thread of its own after this returns (a
        // hint; see hugepages).
        crate::hugepages::promote_after_load();
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

    /// Whether `st` is a state of this model (its family, layer count and kinds, and sizes).
    pub fn state_fits(&self, st: &SeqState) -> bool {
        match (&self.net, &st.layers) {
            (Net::Kimi(m), SeqLayers::Kimi(ls)) => m.state_fits(ls),
            (Net::Llama(m), SeqLayers::Llama(ls)) => m.state_fits(ls),
            _ => false,
        }
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
        if !self.state_fits(st) {
            return Err(Error::Invalid("a sequence state from another model was passed".into()));
        }
        // Long inputs go through the layers PREFILL_CHUNK tokens at a time: activations stay
        // bounded (a 32K prompt in one pass would hold ~0.7 GB of FFN intermediates at the bench
        // shape), and the chunks are long enough that MLA rebuilds its keys and values from the
        // latent cache rarely.
        let d = self.config.hidden_size();
        let mut logits = Vec::new();
        for (i, part) in tokens.chunks(PREFILL_CHUNK).enumerate() {
            let t = part.len();
            let (hidden, head) = match &self.net {
                Net::Kimi(m) => (m.hidden(part, st.layers.kimi(), self.compute), m.lm_head()),
                Net::Llama(m) => (m.hidden(part, st.layers.llama(), self.compute), m.lm_head()),
            };
            st.pos += t;
            match which {
                Logits::All => logits.extend(head.apply(&hidden, t, self.compute)),
                Logits::Last if (i + 1) * PREFILL_CHUNK >= tokens.len() => {
                    logits = head.apply(&hidden[(t - 1) * d..], 1, self.compute)
                }
                Logits::Last => {}
            }
        }
        Ok(logits)
    }

    /// One decode step of several sequences at once: `tokens[b]` goes to `states[b]`, and
    /// sequence b's next-token logits [V] come back in place b. Every weight is read once for
    /// the whole batch (the products take the B rows as B tokens), while each sequence's KDA
    /// state, MLA latent cache or KV cache is its own; so B sequences cost little more than one
    /// while decoding is bound by the weights' reads. Each row is what [`Self::forward`] gives
    /// that sequence alone up to the products' accumulation order (the multi-token kernels).
    /// Errors, leaving every state untouched, on an out-of-vocabulary id, a sequence at the
    /// context limit, a state from another model, or a count mismatch.
    pub fn forward_batch(&self, tokens: &[u32], states: &mut [&mut SeqState]) -> Result<Vec<Vec<f32>>> {
        if tokens.len() != states.len() {
            return Err(Error::Invalid(format!(
                "{} tokens for {} sequences: a batched step takes one each",
                tokens.len(),
                states.len()
            )));
        }
        if tokens.is_empty() {
            return Ok(Vec::new());
        }
        if let [st] = states {
            return Ok(vec![self.forward(tokens, st, Logits::Last)?]);
        }
        let v = self.vocab_size();
        for (b, (&tok, st)) in tokens.iter().zip(states.iter()).enumerate() {
            if tok as usize >= v {
                return Err(Error::Invalid(format!(
                    "sequence {b} of the batch: token id {tok} is outside the vocabulary (vocab_size {v})"
                )));
            }
            if st.pos + 1 > self.n_ctx {
                return Err(Error::Invalid(format!(
                    "sequence {b} of the batch already holds {} tokens, the model's context (max_position_embeddings); end it or start a new one",
                    st.pos
                )));
            }
            if !self.state_fits(st) {
                return Err(Error::Invalid(format!(
                    "sequence {b} of the batch: a sequence state from another model was passed"
                )));
            }
        }
        let nb = tokens.len();
        let (hidden, head) = match &self.net {
            Net::Kimi(m) => {
                let mut ls: Vec<&mut [LayerState]> = states.iter_mut().map(|st| st.layers.kimi()).collect();
                (m.hidden_batch(tokens, &mut ls, self.compute), m.lm_head())
            }
            Net::Llama(m) => {
                let mut ls: Vec<&mut [KvCache]> = states.iter_mut().map(|st| st.layers.llama()).collect();
                (m.hidden_batch(tokens, &mut ls, self.compute), m.lm_head())
            }
        };
        for st in states.iter_mut() {
            st.pos += 1;
        }
        let logits = head.apply(&hidden, nb, self.compute);
        Ok(logits.chunks_exact(v).map(<[f32]>::to_vec).collect())
    }
}
