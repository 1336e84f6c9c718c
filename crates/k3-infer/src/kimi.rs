//! The Kimi-Linear / K3 hybrid stack (architecture.md §3, §4(b)), pure Rust. Mirrors
//! k3-train's `kimi.rs`. Dims: T tokens, C hidden, V vocab.

use k3_config::{FfnKind, KimiConfig, Mixer as MixerKind};
use k3_kernels::ops;

use crate::ffn::Mlp;
use crate::kda::{Kda, KdaState};
use crate::linear::{Compute, Matrix};
use crate::mla::Mla;
use crate::moe::Moe;
use crate::source::Source;
use crate::threads;
use crate::Result;

#[allow(clippy::large_enum_variant)] // one per layer, built once
pub enum Mixer {
    Kda(Kda),
    Mla(Mla),
}

#[allow(clippy::large_enum_variant)] // one per layer, built once
pub enum Ffn {
    Dense(Mlp),
    Moe(Moe),
}

/// The sequences one pass through the stack advances: one sequence (T tokens), or B sequences
/// with one token each (a batched decode step), each as its per-layer states.
enum Seqs<'a, 'b> {
    One(&'a mut [LayerState]),
    Batch(&'a mut [&'b mut [LayerState]]),
}

/// Per-layer state of one sequence.
#[derive(Debug, Clone)]
pub enum LayerState {
    Kda(KdaState),
    /// The absorbed latent cache: [S, R + Dr].
    Mla(crate::kv::KvRows),
}

impl LayerState {
    /// A KDA layer's state (states are made from the layer list, so the kinds always match).
    fn kda(&mut self) -> &mut KdaState {
        match self {
            LayerState::Kda(s) => s,
            LayerState::Mla(_) => unreachable!("state kinds are created from the same layer list"),
        }
    }

    /// An MLA layer's latent cache.
    fn mla(&mut self) -> &mut crate::kv::KvRows {
        match self {
            LayerState::Mla(c) => c,
            LayerState::Kda(_) => unreachable!("state kinds are created from the same layer list"),
        }
    }
}

pub struct Block {
    mixer: Mixer,
    ffn: Ffn,
    norm_in: Vec<f32>,
    norm_post: Vec<f32>,
    /// Fused AttnRes score vectors (norm ⊙ proj) before the mixer and before the FFN.
    res: Option<(Vec<f32>, Vec<f32>)>,
}

pub struct KimiModel {
    pub cfg: KimiConfig,
    embed: Matrix,
    blocks: Vec<Block>,
    norm: Vec<f32>,
    lm_head: Matrix,
    out_res: Option<Vec<f32>>,
}

/// `Σ_n softmax_n(score · RMSNorm(V_n)) · V_n` per token over V = [bank…, prefix].
///
/// # Shapes
/// prefix: [T, C]; bank: N × [T, C]; score: [C] → [T, C]
fn attn_res_mix(prefix: &[f32], bank: &[Vec<f32>], score: &[f32], eps: f32) -> Vec<f32> {
    let c = score.len();
    let t = prefix.len() / c;
    let mut out = vec![0f32; t * c];
    let mut p = vec![0f32; bank.len() + 1];
    for r in 0..t {
        let src = |n: usize| -> &[f32] {
            if n < bank.len() {
                &bank[n][r * c..(r + 1) * c]
            } else {
                &prefix[r * c..(r + 1) * c]
            }
        };
        for (n, pn) in p.iter_mut().enumerate() {
            let v = src(n);
            let inv = 1.0 / (v.iter().map(|x| x * x).sum::<f32>() / c as f32 + eps).sqrt();
            *pn = ops::dot(v, score) * inv;
        }
        ops::softmax_inplace(&mut p);
        for (n, &pn) in p.iter().enumerate() {
            ops::axpy(&mut out[r * c..(r + 1) * c], pn, src(n));
        }
    }
    out
}

impl KimiModel {
    pub fn load(src: &Source, cfg: &KimiConfig) -> Result<Self> {
        let d = cfg.hidden_size;
        let blocks = threads::load_in_parallel(cfg.layers.len(), |i| Self::load_block(src, cfg, i))?;
        let embed = src.embedding(cfg.vocab_size, d)?;
        Ok(Self {
            cfg: cfg.clone(),
            lm_head: src.lm_head(cfg.vocab_size, d, &embed)?,
            embed,
            blocks,
            norm: src.vector("model.norm.weight", d)?,
            out_res: match cfg.attn_res_block_size {
                Some(_) => Some(src.res_score("model.output_attn_res", d)?),
                None => None,
            },
        })
    }

    /// Layer i's weights, repacked for the kernels.
    fn load_block(src: &Source, cfg: &KimiConfig, i: usize) -> Result<Block> {
        let (d, eps, kind) = (cfg.hidden_size, cfg.rms_norm_eps, &cfg.layers[i]);
        let p = format!("model.layers.{i}");
        let mixer = match kind.mixer {
            MixerKind::Kda => Mixer::Kda(Kda::load(src, i, d, &cfg.kda, eps)?),
            MixerKind::Mla => Mixer::Mla(Mla::load(src, i, d, &cfg.mla, eps)?),
        };
        let ffn = match kind.ffn {
            FfnKind::Dense => {
                Ffn::Dense(Mlp::load(src, &format!("{p}.mlp"), d, cfg.intermediate_size, cfg.activation)?)
            }
            FfnKind::Moe => Ffn::Moe(Moe::load(src, i, d, &cfg.moe, cfg.activation, eps)?),
        };
        let res = match cfg.attn_res_block_size {
            Some(_) => Some((
                src.res_score(&format!("{p}.self_attention_res"), d)?,
                src.res_score(&format!("{p}.mlp_res"), d)?,
            )),
            None => None,
        };
        Ok(Block {
            mixer,
            ffn,
            norm_in: src.vector(&format!("{p}.input_layernorm.weight"), d)?,
            norm_post: src.vector(&format!("{p}.post_attention_layernorm.weight"), d)?,
            res,
        })
    }

    /// Attach `tap` to every MoE layer (or detach with `None`); returns how many layers have one.
    pub fn set_routing_tap(&mut self, tap: Option<std::sync::Arc<dyn crate::routing::RoutingTap>>) -> usize {
        let mut n = 0;
        for b in &mut self.blocks {
            if let Ffn::Moe(m) = &mut b.ffn {
                m.set_tap(tap.clone());
                n += 1;
            }
        }
        n
    }

    pub fn new_state(&self) -> Vec<LayerState> {
        self.blocks
            .iter()
            .map(|b| match &b.mixer {
                Mixer::Kda(k) => LayerState::Kda(k.new_state()),
                Mixer::Mla(_) => LayerState::Mla(Default::default()),
            })
            .collect()
    }

    /// Whether `state` is a state of this model: one entry a layer, each of the layer's kind,
    /// KDA states of this model's sizes and MLA caches of whole rows.
    pub fn state_fits(&self, state: &[LayerState]) -> bool {
        state.len() == self.blocks.len()
            && self.blocks.iter().zip(state).all(|(b, st)| match (&b.mixer, st) {
                (Mixer::Kda(k), LayerState::Kda(s)) => (s.conv.len(), s.s.len()) == k.state_lens(),
                (Mixer::Mla(m), LayerState::Mla(c)) => c.len() % m.cache_width() == 0,
                _ => false,
            })
    }

    /// One layer's mixer on its input norm, for one sequence of T tokens or, with
    /// [`Seqs::Batch`], one token of each of B sequences (x: [T or B, C]).
    fn mixer(&self, b: &Block, x: &[f32], t: usize, seqs: &mut Seqs, layer: usize, cx: Compute) -> Vec<f32> {
        let mut h = vec![0f32; x.len()];
        threads::rmsnorm(&mut h, x, &b.norm_in, self.cfg.rms_norm_eps as f32, cx.threads);
        match (&b.mixer, seqs) {
            (Mixer::Kda(k), Seqs::One(st)) => k.forward(&h, t, st[layer].kda(), cx),
            (Mixer::Mla(m), Seqs::One(st)) => m.forward(&h, t, st[layer].mla(), cx),
            (Mixer::Kda(k), Seqs::Batch(sts)) => {
                let mut states: Vec<&mut KdaState> = sts.iter_mut().map(|st| st[layer].kda()).collect();
                k.decode_batch(&h, &mut states, cx)
            }
            (Mixer::Mla(m), Seqs::Batch(sts)) => {
                let mut caches: Vec<&mut crate::kv::KvRows> = sts.iter_mut().map(|st| st[layer].mla()).collect();
                m.decode_batch(&h, &mut caches, cx)
            }
        }
    }

    fn ffn(&self, b: &Block, x: &[f32], t: usize, cx: Compute) -> Vec<f32> {
        let mut h = vec![0f32; x.len()];
        threads::rmsnorm(&mut h, x, &b.norm_post, self.cfg.rms_norm_eps as f32, cx.threads);
        match &b.ffn {
            Ffn::Dense(m) => m.forward(&h, t, cx),
            Ffn::Moe(m) => m.forward(&h, t, cx),
        }
    }

    /// Run `tokens` through the stack, advancing `state`; returns the final-norm hidden states
    /// [T, C] (the caller applies the head to the rows it needs).
    pub fn hidden(&self, tokens: &[u32], state: &mut [LayerState], cx: Compute) -> Vec<f32> {
        self.run(tokens, &mut Seqs::One(state), cx)
    }

    /// One decode step of B sequences at once: token b goes to sequence b (`states[b]`, its
    /// layer states). Every product reads its weights once for the whole batch; the KDA heads
    /// and MLA attention run per sequence on its own state. Returns the final-norm hidden
    /// states [B, C], row b sequence b's.
    pub fn hidden_batch(&self, tokens: &[u32], states: &mut [&mut [LayerState]], cx: Compute) -> Vec<f32> {
        assert_eq!(tokens.len(), states.len(), "one token per sequence");
        self.run(tokens, &mut Seqs::Batch(states), cx)
    }

    /// The stack over rows x [T, C]: T tokens of one sequence, or one token of each of B
    /// sequences. Everything between the mixers is per row (norms, FFN, AttnRes across depth).
    fn run(&self, tokens: &[u32], seqs: &mut Seqs, cx: Compute) -> Vec<f32> {
        let d = self.cfg.hidden_size;
        let t = tokens.len();
        let eps = self.cfg.rms_norm_eps as f32;
        let mut x = vec![0f32; t * d];
        for (r, &tok) in tokens.iter().enumerate() {
            self.embed.row_into(tok as usize, &mut x[r * d..(r + 1) * d]);
        }
        let h = match self.cfg.attn_res_block_size {
            None => {
                for (i, b) in self.blocks.iter().enumerate() {
                    let a = self.mixer(b, &x, t, seqs, i, cx);
                    ops::axpy(&mut x, 1.0, &a);
                    let m = self.ffn(b, &x, t, cx);
                    ops::axpy(&mut x, 1.0, &m);
                }
                x
            }
            Some(block) => {
                let mut bank: Vec<Vec<f32>> = Vec::new();
                let mut prefix = Some(x);
                for (i, b) in self.blocks.iter().enumerate() {
                    let (attn_score, mlp_score) = b.res.as_ref().expect("AttnRes scores loaded with the block size");
                    let cur = prefix.take().expect("prefix between layers");
                    let mixed = if bank.is_empty() { cur.clone() } else { attn_res_mix(&cur, &bank, attn_score, eps) };
                    let cur = if i % block == 0 {
                        bank.push(cur); // seal the finished block (layer 0 seals the embedding)
                        None
                    } else {
                        Some(cur)
                    };
                    let a = self.mixer(b, &mixed, t, seqs, i, cx);
                    let mut cur = match cur {
                        Some(mut c) => {
                            ops::axpy(&mut c, 1.0, &a);
                            c
                        }
                        None => a,
                    };
                    let z = attn_res_mix(&cur, &bank, mlp_score, eps);
                    let m = self.ffn(b, &z, t, cx);
                    ops::axpy(&mut cur, 1.0, &m);
                    prefix = Some(cur);
                }
                let cur = prefix.expect("prefix after the last layer");
                attn_res_mix(&cur, &bank, self.out_res.as_ref().expect("output AttnRes score"), eps)
            }
        };
        let mut out = vec![0f32; h.len()];
        threads::rmsnorm(&mut out, &h, &self.norm, eps, cx.threads);
        out
    }

    pub fn lm_head(&self) -> &Matrix {
        &self.lm_head
    }
}
