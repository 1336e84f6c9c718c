//! Llama (GQA + RoPE + SwiGLU): the baseline Transformer and the SmolLM2 teacher. Q/K are held in
//! HF row order (a GGUF's llama.cpp permutation is undone at load), so RoPE is HF rotate-half.
//! Dims: T tokens, C hidden, Hq/Hkv heads, D head dim, S cached positions.

use k3_config::{Activation, LlamaConfig};
use k3_kernels::{attention, ops};

use crate::ffn::Mlp;
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

/// One layer's cached keys or values: f16, llama.cpp's cache type and the default (a decode step
/// streams half the bytes of f32), or f32 under the exact mode (transformers' numerics).
#[derive(Debug, Clone)]
pub enum KvRows {
    F16(Vec<u16>),
    F32(Vec<f32>),
}

impl Default for KvRows {
    fn default() -> Self {
        KvRows::F16(Vec::new())
    }
}

impl KvRows {
    /// Values held (positions × Hkv × D).
    pub fn len(&self) -> usize {
        self.rows().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn bytes(&self) -> usize {
        match self {
            KvRows::F16(v) => 2 * v.len(),
            KvRows::F32(v) => 4 * v.len(),
        }
    }

    pub fn rows(&self) -> attention::Rows<'_> {
        match self {
            KvRows::F16(v) => attention::Rows::F16(v),
            KvRows::F32(v) => attention::Rows::F32(v),
        }
    }

    /// Append rows, as f16 (rounded to nearest) or f32. A cache of the other type is converted
    /// first: f16 → f32 exactly, f32 → f16 rounding as the f16 mode rounds everything it stores.
    fn push(&mut self, x: &[f32], f16: bool) {
        match (&mut *self, f16) {
            (KvRows::F16(v), true) => {
                let at = v.len();
                v.resize(at + x.len(), 0);
                k3_kernels::simd::f32_to_f16(&mut v[at..], x);
            }
            (KvRows::F32(v), false) => v.extend_from_slice(x),
            (KvRows::F16(v), false) => {
                let mut wide = vec![0f32; v.len()];
                k3_kernels::simd::f16_to_f32(&mut wide, v);
                wide.extend_from_slice(x);
                *self = KvRows::F32(wide);
            }
            (KvRows::F32(v), true) => {
                let mut narrow = vec![0u16; v.len() + x.len()];
                k3_kernels::simd::f32_to_f16(&mut narrow[..v.len()], v);
                k3_kernels::simd::f32_to_f16(&mut narrow[v.len()..], x);
                *self = KvRows::F16(narrow);
            }
        }
    }
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
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            layers.push(Layer {
                q: src.llama_attn(i, "q", hq * hd, d, hq)?,
                k: src.llama_attn(i, "k", hkv * hd, d, hkv)?,
                v: src.llama_attn(i, "v", hkv * hd, d, hkv)?,
                o: src.llama_attn(i, "o", d, hq * hd, hq)?,
                mlp: Mlp::load(src, &format!("{p}.mlp"), d, cfg.intermediate_size, Activation::Silu)?,
                norm_in: src.vector(&format!("{p}.input_layernorm.weight"), d)?,
                norm_post: src.vector(&format!("{p}.post_attention_layernorm.weight"), d)?,
            });
        }
        let inv_freq = (0..hd / 2).map(|i| (cfg.rope_theta as f32).powf(-2.0 * i as f32 / hd as f32)).collect();
        Ok(Self {
            cfg: cfg.clone(),
            embed: src.embedding(cfg.vocab_size, d)?,
            layers,
            norm: src.vector("model.norm.weight", d)?,
            lm_head: src.lm_head(cfg.vocab_size, d)?,
            inv_freq,
        })
    }

    pub fn new_state(&self) -> Vec<KvCache> {
        vec![KvCache::default(); self.layers.len()]
    }

    /// Rotate-half RoPE in place on rows [T, H, D] at positions `pos0..pos0+T`.
    fn rope(&self, x: &mut [f32], heads: usize, pos0: usize) {
        let d = self.cfg.head_dim;
        let half = d / 2;
        for (r, row) in x.chunks_exact_mut(heads * d).enumerate() {
            let pos = (pos0 + r) as f32;
            for hv in row.chunks_exact_mut(d) {
                for i in 0..half {
                    let (s, c) = (pos * self.inv_freq[i]).sin_cos();
                    let (a, b) = (hv[i], hv[i + half]);
                    hv[i] = a * c - b * s;
                    hv[i + half] = b * c + a * s;
                }
            }
        }
    }

    /// Final-norm hidden states [T, C] for `tokens`, advancing the cache.
    pub fn hidden(&self, tokens: &[u32], state: &mut [KvCache], cx: Compute) -> Vec<f32> {
        let c = &self.cfg;
        let (d, hd, hq, hkv) = (c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads);
        let eps = c.rms_norm_eps as f32;
        let t = tokens.len();
        let mut x = vec![0f32; t * d];
        for (r, &tok) in tokens.iter().enumerate() {
            self.embed.row_into(tok as usize, &mut x[r * d..(r + 1) * d]);
        }
        let mut h = vec![0f32; t * d];
        for (l, cache) in self.layers.iter().zip(state.iter_mut()) {
            threads::rmsnorm(&mut h, &x, &l.norm_in, eps, cx.threads);
            let past = cache.k.len() / (hkv * hd);
            let [mut q, mut k, v]: [Vec<f32>; 3] =
                Matrix::apply_many(&[&l.q, &l.k, &l.v], &h, t, cx).try_into().expect("three products");
            self.rope(&mut q, hq, past);
            self.rope(&mut k, hkv, past);
            // llama.cpp's K/V cache is f16; outside exact mode hold the same.
            cache.k.push(&k, !cx.exact);
            cache.v.push(&v, !cx.exact);
            let mut att = vec![0f32; t * hq * hd];
            attention::gqa_attend(
                &mut att,
                &q,
                cache.k.rows(),
                cache.v.rows(),
                hq,
                hkv,
                hd,
                past,
                !cx.exact,
                cx.threads,
            );
            let o = l.o.apply(&att, t, cx);
            ops::axpy(&mut x, 1.0, &o);
            threads::rmsnorm(&mut h, &x, &l.norm_post, eps, cx.threads);
            let m = l.mlp.forward(&h, t, cx);
            ops::axpy(&mut x, 1.0, &m);
        }
        threads::rmsnorm(&mut h, &x, &self.norm, eps, cx.threads);
        h
    }

    pub fn lm_head(&self) -> &Matrix {
        &self.lm_head
    }
}

#[cfg(test)]
mod tests {
    use super::KvRows;

    #[test]
    fn kv_rows_keep_their_values_across_both_types() {
        let x = [1.0f32, -2.5, 3.3333, 1e-3, 70000.0];
        let f16 = k3_kernels::attention::round_f16;
        // f16 (the default): rounded to nearest on the way in.
        let mut r = KvRows::default();
        r.push(&x[..3], true);
        assert!(matches!(r, KvRows::F16(_)) && r.bytes() == 6);
        // An exact-mode push widens what is held (exactly) and keeps the new rows as they are.
        r.push(&x[3..], false);
        let want: Vec<f32> = x[..3].iter().map(|&v| f16(v)).chain(x[3..].iter().copied()).collect();
        assert_eq!(r.rows().to_f32().to_vec(), want);
        // Back to f16: everything rounded, as the f16 mode stores it (70000 overflows to +inf,
        // as in llama.cpp's f16 cache).
        r.push(&x[..1], true);
        let want: Vec<f32> = want.iter().chain(&x[..1]).map(|&v| f16(v)).collect();
        assert_eq!(r.rows().to_f32().to_vec(), want);
        assert_eq!(r.len(), 6);
    }
}
