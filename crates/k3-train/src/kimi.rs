//! The Kimi-Linear / K3 hybrid decoder (architecture.md §3, §4(b)).
//! Dims: B batch, T time, C hidden, V vocab.

use k3_config::{FfnKind, KimiConfig, Mixer as MixerKind, Profile};
use tch::nn::Path;
use tch::Tensor;

use crate::ffn::Mlp;
use crate::kda::{Kda, KdaState};
use crate::mla::{Mla, MlaCache};
use crate::moe::{Moe, Routing};
use crate::nn::{norm_weight, rms_norm, Linear, INIT_STD};
use crate::residual::AttnResPoint;

#[derive(Debug)]
pub enum Mixer {
    Kda(Kda),
    Mla(Mla),
}

#[derive(Debug)]
pub enum Ffn {
    Dense(Mlp),
    Moe(Moe),
}

/// Per-layer decode state: KDA's fixed state and conv tail, or MLA's growing latent cache.
#[derive(Debug)]
pub enum LayerState {
    Kda(KdaState),
    Mla(MlaCache),
}

#[derive(Debug)]
pub struct Block {
    pub mixer: Mixer,
    pub ffn: Ffn,
    norm_in: Tensor,   // input_layernorm [C]
    norm_post: Tensor, // post_attention_layernorm [C]
    /// AttnRes points before the mixer and before the FFN (K3 only).
    res: Option<(AttnResPoint, AttnResPoint)>,
}

#[derive(Debug)]
pub struct KimiModel {
    pub cfg: KimiConfig,
    pub embed: Tensor, // [V, C]
    pub blocks: Vec<Block>,
    norm: Tensor,
    lm_head: Linear,
    out_res: Option<AttnResPoint>,
}

/// The forward result: logits, optionally the hidden states, and each MoE layer's routing.
#[derive(Debug)]
pub struct Output {
    pub logits: Tensor, // [B,T,V]
    /// transformers' convention: embeddings, the outputs of layers 0..L−2, then the final-norm
    /// output (L + 1 tensors of [B,T,C]). Empty unless requested.
    pub hidden_states: Vec<Tensor>,
    pub routing: Vec<(usize, Routing)>,
}

impl KimiModel {
    pub fn new(root: &Path, cfg: &KimiConfig) -> Self {
        let d = cfg.hidden_size;
        let k3 = cfg.profile() == Profile::K3;
        let eps = cfg.rms_norm_eps;
        let m = root.sub("model");
        let embed = m.sub("embed_tokens").var(
            "weight",
            &[cfg.vocab_size as i64, d as i64],
            tch::nn::Init::Randn { mean: 0.0, stdev: INIT_STD },
        );
        let blocks = cfg
            .layers
            .iter()
            .enumerate()
            .map(|(i, kind)| {
                let p = m.sub("layers").sub(i);
                let a = p.sub("self_attn");
                let mixer = match kind.mixer {
                    MixerKind::Kda => Mixer::Kda(Kda::new(&a, d, &cfg.kda, k3, eps)),
                    MixerKind::Mla => Mixer::Mla(Mla::new(&a, d, &cfg.mla)),
                };
                let ffn = match kind.ffn {
                    FfnKind::Dense => Ffn::Dense(Mlp::new(&p.sub("mlp"), d, cfg.intermediate_size, cfg.activation)),
                    FfnKind::Moe => Ffn::Moe(Moe::new(&p.sub("block_sparse_moe"), d, &cfg.moe, cfg.activation, eps)),
                };
                let res = cfg
                    .attn_res_block_size
                    .map(|_| (AttnResPoint::new(&p, "self_attention_res", d), AttnResPoint::new(&p, "mlp_res", d)));
                Block {
                    mixer,
                    ffn,
                    norm_in: norm_weight(&p, "input_layernorm", d),
                    norm_post: norm_weight(&p, "post_attention_layernorm", d),
                    res,
                }
            })
            .collect();
        let out_res = cfg.attn_res_block_size.map(|_| AttnResPoint::new(&m, "output_attn_res", d));
        Self {
            cfg: cfg.clone(),
            embed,
            blocks,
            norm: norm_weight(&m, "norm", d),
            lm_head: Linear::new(root, "lm_head", d, cfg.vocab_size, false),
            out_res,
        }
    }

    /// A fresh decode state for `b` sequences.
    pub fn new_state(&self, b: i64) -> Vec<LayerState> {
        self.blocks
            .iter()
            .map(|blk| match &blk.mixer {
                Mixer::Kda(k) => LayerState::Kda(k.new_state(b)),
                Mixer::Mla(_) => LayerState::Mla(MlaCache::default()),
            })
            .collect()
    }

    fn mixer(&self, blk: &Block, x: &Tensor, st: Option<&mut LayerState>) -> Tensor {
        let x = rms_norm(x, &blk.norm_in, self.cfg.rms_norm_eps);
        match (&blk.mixer, st) {
            (Mixer::Kda(k), Some(LayerState::Kda(s))) => k.forward(&x, Some(s)),
            (Mixer::Mla(m), Some(LayerState::Mla(c))) => m.forward(&x, Some(c)),
            (Mixer::Kda(k), _) => k.forward(&x, None),
            (Mixer::Mla(m), _) => m.forward(&x, None),
        }
    }

    fn ffn(&self, blk: &Block, x: &Tensor, i: usize, routing: &mut Vec<(usize, Routing)>) -> Tensor {
        let x = rms_norm(x, &blk.norm_post, self.cfg.rms_norm_eps);
        match &blk.ffn {
            Ffn::Dense(m) => m.forward(&x),
            Ffn::Moe(m) => {
                let (y, r) = m.forward(&x);
                routing.push((i, r));
                y
            }
        }
    }

    /// # Shapes
    /// ids: [B,T] int64 → logits [B,T,V]. With `state`, the tokens continue the sequences held in it.
    pub fn forward(&self, ids: &Tensor, mut state: Option<&mut Vec<LayerState>>, want_hidden: bool) -> Output {
        let eps = self.cfg.rms_norm_eps;
        let emb = Tensor::embedding(&self.embed, ids, -1, false, false); // [B,T,C]
        let mut hidden = Vec::new();
        let mut routing = Vec::new();
        let h = match self.cfg.attn_res_block_size {
            None => {
                // Pre-norm residual stream (Kimi Linear).
                let mut h = emb;
                for (i, blk) in self.blocks.iter().enumerate() {
                    if want_hidden {
                        hidden.push(h.shallow_clone());
                    }
                    let st = state.as_deref_mut().map(|s| &mut s[i]);
                    h = &h + self.mixer(blk, &h, st);
                    h = &h + self.ffn(blk, &h, i, &mut routing);
                }
                h
            }
            Some(block) => {
                // Block AttnRes (architecture.md §4(b)): two mixes per layer over the sealed block
                // sums `bank` and the current block's running sum `prefix`.
                let mut bank: Vec<Tensor> = Vec::new();
                let mut prefix = Some(emb);
                for (i, blk) in self.blocks.iter().enumerate() {
                    let (attn_res, mlp_res) = blk.res.as_ref().expect("AttnRes points exist when block size is set");
                    let cur = prefix.take().expect("prefix is set between layers");
                    if want_hidden {
                        hidden.push(cur.shallow_clone());
                    }
                    let x = if bank.is_empty() { cur.shallow_clone() } else { attn_res.mix(&cur, &bank, eps) };
                    let cur = if i % block == 0 {
                        bank.push(cur); // seal the finished block (layer 0 seals the embedding)
                        None
                    } else {
                        Some(cur)
                    };
                    let st = state.as_deref_mut().map(|s| &mut s[i]);
                    let a = self.mixer(blk, &x, st);
                    let cur = match cur {
                        Some(c) => c + a,
                        None => a,
                    };
                    let z = mlp_res.mix(&cur, &bank, eps);
                    let m = self.ffn(blk, &z, i, &mut routing);
                    prefix = Some(cur + m);
                }
                let cur = prefix.expect("prefix after the last layer");
                self.out_res.as_ref().expect("output AttnRes point").mix(&cur, &bank, eps)
            }
        };
        let h = rms_norm(&h, &self.norm, eps);
        if want_hidden {
            hidden.push(h.shallow_clone());
        }
        Output { logits: self.lm_head.forward(&h), hidden_states: hidden, routing }
    }
}
