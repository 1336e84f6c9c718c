//! The baseline "ordinary Transformer": HF Llama (GQA + RoPE + SwiGLU), with llama tensor names.
//! Dims: B batch, T new tokens, P cached, S = P + T, C hidden, Hq/Hkv heads, D head dim.

use k3_config::{Activation, LlamaConfig};
use tch::nn::Path;
use tch::{Kind, Tensor};

use crate::ffn::Mlp;
use crate::nn::{norm_weight, rms_norm, Linear, INIT_STD};

#[derive(Debug)]
struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
}

#[derive(Debug)]
struct Layer {
    attn: Attention,
    mlp: Mlp,
    norm_in: Tensor,
    norm_post: Tensor,
}

/// Per-layer K/V cache: [B, Hkv, P, D] each.
#[derive(Debug, Default)]
pub struct KvCache {
    pub k: Option<Tensor>,
    pub v: Option<Tensor>,
}

#[derive(Debug)]
pub struct LlamaModel {
    pub cfg: LlamaConfig,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Option<Linear>,
}

/// HF "rotate-half" RoPE applied to x: [B,H,T,D] at absolute positions `pos` [T].
fn rope(x: &Tensor, pos: &Tensor, theta: f64) -> Tensor {
    let d = x.size()[3];
    let half = d / 2;
    let inv = (Tensor::arange(half, (Kind::Float, x.device())) * (-2.0 * theta.ln() / d as f64)).exp(); // θ^(−2i/D)
    let freqs = pos.to_kind(Kind::Float).unsqueeze(1) * inv.unsqueeze(0); // [T, D/2]
    let emb = Tensor::cat(&[&freqs, &freqs], -1); // [T, D]
    let (cos, sin) = (emb.cos().to_kind(x.kind()), emb.sin().to_kind(x.kind()));
    let x1 = x.narrow(-1, 0, half);
    let x2 = x.narrow(-1, half, half);
    let rot = Tensor::cat(&[-x2, x1], -1);
    x * cos + rot * sin
}

impl LlamaModel {
    pub fn new(root: &Path, cfg: &LlamaConfig) -> Self {
        let (d, hd) = (cfg.hidden_size, cfg.head_dim);
        let m = root.sub("model");
        let embed = m.sub("embed_tokens").var(
            "weight",
            &[cfg.vocab_size as i64, d as i64],
            tch::nn::Init::Randn { mean: 0.0, stdev: INIT_STD },
        );
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let p = m.sub("layers").sub(i);
                let a = p.sub("self_attn");
                let b = cfg.attention_bias;
                Layer {
                    attn: Attention {
                        q: Linear::new(&a, "q_proj", d, cfg.num_attention_heads * hd, b),
                        k: Linear::new(&a, "k_proj", d, cfg.num_key_value_heads * hd, b),
                        v: Linear::new(&a, "v_proj", d, cfg.num_key_value_heads * hd, b),
                        o: Linear::new(&a, "o_proj", cfg.num_attention_heads * hd, d, b),
                    },
                    mlp: Mlp::new_with_bias(&p.sub("mlp"), d, cfg.intermediate_size, Activation::Silu, cfg.mlp_bias),
                    norm_in: norm_weight(&p, "input_layernorm", d),
                    norm_post: norm_weight(&p, "post_attention_layernorm", d),
                }
            })
            .collect();
        let lm_head = (!cfg.tie_word_embeddings).then(|| Linear::new(root, "lm_head", d, cfg.vocab_size, false));
        Self { cfg: cfg.clone(), embed, layers, norm: norm_weight(&m, "norm", d), lm_head }
    }

    pub fn new_state(&self) -> Vec<KvCache> {
        (0..self.layers.len()).map(|_| KvCache::default()).collect()
    }

    fn attention(&self, a: &Attention, x: &Tensor, cache: Option<&mut KvCache>) -> Tensor {
        let (b, t, _) = x.size3().expect("x must be [B,T,C]");
        let c = &self.cfg;
        let (hq, hkv, d) = (c.num_attention_heads as i64, c.num_key_value_heads as i64, c.head_dim as i64);
        let past = cache.as_ref().and_then(|c| c.k.as_ref()).map_or(0, |k| k.size()[2]);
        let pos = Tensor::arange(t, (Kind::Int64, x.device())) + past;
        let q = rope(&a.q.forward(x).view([b, t, hq, d]).transpose(1, 2), &pos, c.rope_theta); // [B,Hq,T,D]
        let k = rope(&a.k.forward(x).view([b, t, hkv, d]).transpose(1, 2), &pos, c.rope_theta); // [B,Hkv,T,D]
        let v = a.v.forward(x).view([b, t, hkv, d]).transpose(1, 2);
        let (k, v) = match cache {
            Some(cache) => {
                let k = match &cache.k {
                    Some(pk) => Tensor::cat(&[pk, &k], 2),
                    None => k,
                };
                let v = match &cache.v {
                    Some(pv) => Tensor::cat(&[pv, &v], 2),
                    None => v,
                };
                cache.k = Some(k.shallow_clone());
                cache.v = Some(v.shallow_clone());
                (k, v)
            }
            None => (k, v),
        }; // [B,Hkv,S,D]
        let s = past + t;
        let rep = hq / hkv;
        let expand = |x: &Tensor| x.unsqueeze(2).expand([b, hkv, rep, s, d], false).reshape([b, hq, s, d]);
        let (k, v) = (expand(&k), expand(&v));
        let scores = q.matmul(&k.transpose(-1, -2)) * (d as f64).powf(-0.5); // [B,Hq,T,S]
        let kpos = Tensor::arange(s, (Kind::Int64, x.device()));
        let future = kpos.unsqueeze(0).gt_tensor(&pos.unsqueeze(1));
        let p = scores
            .masked_fill(&future, f64::NEG_INFINITY)
            .softmax(-1, crate::nn::compute_kind(q.kind()))
            .to_kind(q.kind());
        a.o.forward(&p.matmul(&v).transpose(1, 2).reshape([b, t, hq * d]))
    }

    /// # Shapes
    /// ids: [B,T] → (logits [B,T,V], hidden states in transformers' convention if requested)
    pub fn forward(
        &self,
        ids: &Tensor,
        mut state: Option<&mut Vec<KvCache>>,
        want_hidden: bool,
    ) -> (Tensor, Vec<Tensor>) {
        let eps = self.cfg.rms_norm_eps;
        let mut h = Tensor::embedding(&self.embed, ids, -1, false, false);
        let mut hidden = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            if want_hidden {
                hidden.push(h.shallow_clone());
            }
            let st = state.as_deref_mut().map(|s| &mut s[i]);
            h = &h + self.attention(&l.attn, &rms_norm(&h, &l.norm_in, eps), st);
            h = &h + l.mlp.forward(&rms_norm(&h, &l.norm_post, eps));
        }
        let h = rms_norm(&h, &self.norm, eps);
        if want_hidden {
            hidden.push(h.shallow_clone());
        }
        let logits = match &self.lm_head {
            Some(l) => l.forward(&h),
            None => h.linear(&self.embed, None::<Tensor>),
        };
        (logits, hidden)
    }
}
