//! Llama (GQA + RoPE + SwiGLU): the baseline Transformer and the SmolLM2 teacher. Q/K are held in
//! HF row order (a GGUF's llama.cpp permutation is undone at load), so RoPE is HF rotate-half.
//! Dims: T tokens, C hidden, Hq/Hkv heads, D head dim, S cached positions.

use k3_config::{Activation, LlamaConfig};
use k3_kernels::{attention, ops};

use crate::ffn::Mlp;
use crate::kv::KvRows;
use crate::linear::{Compute, Matrix};
use crate::source::Source;
use crate::threads;
use crate::Result;

struct Layer {
    q: Matrix,
    k: Matrix,
    v: Matrix,
    o: Matrix,
    mlp: Mlp,
    norm_in: Vec<f32>,
    norm_post: Vec<f32>,
}

/// One sequence's K/V cache for one layer: [S, Hkv, D] each.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    pub k: KvRows,
    pub v: KvRows,
}

pub struct LlamaModel {
    pub cfg: LlamaConfig,
    embed: Matrix,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: Matrix,
    inv_freq: Vec<f32>,
}

impl LlamaModel {
    pub fn load(src: &Source, cfg: &LlamaConfig) -> Result<Self> {
        if cfg.attention_bias || cfg.mlp_bias {
            return Err(crate::Error::Invalid(
                "Llama checkpoints with attention/MLP biases are not supported by the native engine yet".into(),
            ));
        }
        let (d, hd) = (cfg.hidden_size, cfg.head_dim);
        let (hq, hkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let layers = crate::threads::load_in_parallel(cfg.num_hidden_layers, |i| {
            let p = format!("model.layers.{i}");
            Ok(Layer {
                q: src.llama_attn(i, "q", hq * hd, d, hq)?,
                k: src.llama_attn(i, "k", hkv * hd, d, hkv)?,
                v: src.llama_attn(i, "v", hkv * hd, d, hkv)?,
                o: src.llama_attn(i, "o", d, hq * hd, hq)?,
                mlp: Mlp::load(src, &format!("{p}.mlp"), d, cfg.intermediate_size, Activation::Silu)?,
                norm_in: src.vector(&format!("{p}.input_layernorm.weight"), d)?,
                norm_post: src.vector(&format!("{p}.post_attention_layernorm.weight"), d)?,
            })
        })?;
        let inv_freq = (0..hd / 2).map(|i| (cfg.rope_theta as f32).powf(-2.0 * i as f32 / hd as f32)).collect();
        let embed = src.embedding(cfg.vocab_size, d)?;
        Ok(Self {
            cfg: cfg.clone(),
            lm_head: src.lm_head(cfg.vocab_size, d, &embed)?,
            embed,
            layers,
            norm: src.vector("model.norm.weight", d)?,
            inv_freq,
        })
    }

    pub fn new_state(&self) -> Vec<KvCache> {
        vec![KvCache::default(); self.layers.len()]
    }

    /// Rotate-half RoPE in place on rows [T, H, D] at positions `pos0..pos0+T`. Each row's
    /// angles are taken once for all its heads (the same sin and cos as per head: SmolLM2's 9
    /// query and 3 key heads had made sin_cos ~1.5% of a prefill).
    fn rope(&self, x: &mut [f32], heads: usize, pos0: usize) {
        let d = self.cfg.head_dim;
        let half = d / 2;
        let mut sc = vec![(0f32, 0f32); half];
        for (r, row) in x.chunks_exact_mut(heads * d).enumerate() {
            let pos = (pos0 + r) as f32;
            for (i, e) in sc.iter_mut().enumerate() {
                *e = (pos * self.inv_freq[i]).sin_cos();
            }
            for hv in row.chunks_exact_mut(d) {
                let (lo, hi) = hv.split_at_mut(half);
                for ((a, b), &(s, c)) in lo.iter_mut().zip(hi.iter_mut()).zip(&sc) {
                    let (x0, x1) = (*a, *b);
                    *a = x0 * c - x1 * s;
                    *b = x1 * c + x0 * s;
                }
            }
        }
    }

    /// Whether `state` is a state of this model: a cache a layer, of whole rows.
    pub fn state_fits(&self, state: &[KvCache]) -> bool {
        let w = self.cfg.num_key_value_heads * self.cfg.head_dim;
        state.len() == self.layers.len() && state.iter().all(|c| c.k.len() % w == 0 && c.k.len() == c.v.len())
    }

    /// Final-norm hidden states [T, C] for `tokens`, advancing the cache.
    pub fn hidden(&self, tokens: &[u32], state: &mut [KvCache], cx: Compute) -> Vec<f32> {
        self.run(tokens, &mut [state], cx)
    }

    /// One decode step of B sequences at once: token b goes to sequence b (`states[b]`, its
    /// layers' caches). The products read their weights once for the batch; each row attends
    /// to its own sequence's cache. Returns the final-norm hidden states [B, C].
    pub fn hidden_batch(&self, tokens: &[u32], states: &mut [&mut [KvCache]], cx: Compute) -> Vec<f32> {
        assert_eq!(tokens.len(), states.len(), "one token per sequence");
        self.run(tokens, states, cx)
    }

    /// The stack over rows [T, C]: T tokens of the one sequence `seqs[0]`, or with several
    /// sequences token b of sequence `seqs[b]` (one sequence with one token is both).
    fn run(&self, tokens: &[u32], seqs: &mut [&mut [KvCache]], cx: Compute) -> Vec<f32> {
        let c = &self.cfg;
        let (d, hd, hq, hkv) = (c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads);
        let eps = c.rms_norm_eps as f32;
        let t = tokens.len();
        let mut x = vec![0f32; t * d];
        for (r, &tok) in tokens.iter().enumerate() {
            self.embed.row_into(tok as usize, &mut x[r * d..(r + 1) * d]);
        }
        let mut h = vec![0f32; t * d];
        for (i, l) in self.layers.iter().enumerate() {
            threads::rmsnorm(&mut h, &x, &l.norm_in, eps, cx.threads);
            let [mut q, mut k, v]: [Vec<f32>; 3] =
                Matrix::apply_many(&[&l.q, &l.k, &l.v], &h, t, cx).try_into().expect("three products");
            let att = if seqs.len() > 1 {
                let (qw, kw) = (hq * hd, hkv * hd);
                let mut att = Vec::with_capacity(t * qw);
                for (b, seq) in seqs.iter_mut().enumerate() {
                    let (qb, kb) = (&mut q[b * qw..(b + 1) * qw], &mut k[b * kw..(b + 1) * kw]);
                    att.extend(self.attend(qb, kb, &v[b * kw..(b + 1) * kw], 1, &mut seq[i], cx));
                }
                att
            } else {
                self.attend(&mut q, &mut k, &v, t, &mut seqs[0][i], cx)
            };
            let o = l.o.apply(&att, t, cx);
            ops::axpy(&mut x, 1.0, &o);
            threads::rmsnorm(&mut h, &x, &l.norm_post, eps, cx.threads);
            let m = l.mlp.forward(&h, t, cx);
            ops::axpy(&mut x, 1.0, &m);
        }
        threads::rmsnorm(&mut h, &x, &self.norm, eps, cx.threads);
        h
    }

    /// RoPE on T new rows of one sequence at its next positions, appended to its cache, then
    /// attended (causal).
    ///
    /// # Shapes
    /// q: [T, Hq·D], k, v: [T, Hkv·D] → [T, Hq·D]
    fn attend(&self, q: &mut [f32], k: &mut [f32], v: &[f32], t: usize, cache: &mut KvCache, cx: Compute) -> Vec<f32> {
        let c = &self.cfg;
        let (hd, hq, hkv) = (c.head_dim, c.num_attention_heads, c.num_key_value_heads);
        let past = cache.k.len() / (hkv * hd);
        self.rope(q, hq, past);
        self.rope(k, hkv, past);
        // llama.cpp's K/V cache is f16; outside exact mode hold the same.
        cache.k.push(k, !cx.exact);
        cache.v.push(v, !cx.exact);
        let mut att = vec![0f32; t * hq * hd];
        attention::gqa_attend(&mut att, q, cache.k.rows(), cache.v.rows(), hq, hkv, hd, past, !cx.exact, cx.threads);
        att
    }

    pub fn lm_head(&self) -> &Matrix {
        &self.lm_head
    }
}
