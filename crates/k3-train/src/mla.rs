//! Gated multi-head latent attention, NoPE (architecture.md §2). References: transformers 5.24
//! `KimiLinearAttention` (optional q LoRA, attention biases), K3 / llama.cpp `kimi-k3` for the
//! sigmoid output gate computed from the mixer input.
//! Dims: B batch, T new tokens, P cached tokens, S = P + T, C hidden, H heads, Dn/Dr/Dv the
//! nope/rope/value head dims, R = kv_lora_rank, Rq = q_lora_rank.

use k3_config::MlaConfig;
use tch::{Kind, Tensor};

use crate::nn::{norm_weight, rms_norm, Linear};

/// Moonshot code and transformers use eps 1e-6 in the two latent RMSNorms (not rms_norm_eps).
const LATENT_NORM_EPS: f64 = 1e-6;

/// The compressed cache: the normalised latent and the shared k_r slice of every past token.
#[derive(Debug, Default)]
pub struct MlaCache {
    pub c_kv: Option<Tensor>, // [B, P, R]
    pub k_r: Option<Tensor>,  // [B, P, Dr]
}

impl MlaCache {
    pub fn len(&self) -> i64 {
        self.c_kv.as_ref().map_or(0, |t| t.size()[1])
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Debug)]
pub enum QProj {
    Plain(Linear),
    Lora { a: Linear, norm: Tensor, b: Linear },
}

#[derive(Debug)]
pub struct Mla {
    q: QProj,
    kv_a: Linear,         // C → R + Dr
    kv_norm: Tensor,      // [R]
    kv_b: Linear,         // R → H·(Dn + Dv), rows grouped per head [k_nope^h ; v^h]
    o: Linear,            // H·Dv → C
    gate: Option<Linear>, // K3: C → H·Dv
    heads: i64,
    dn: i64,
    dr: i64,
    dv: i64,
    rank: i64,
}

impl Mla {
    pub fn new(p: &tch::nn::Path, hidden: usize, cfg: &MlaConfig) -> Self {
        let (h, qk) = (cfg.num_heads, cfg.qk_head_dim());
        let bias = cfg.attention_bias;
        let q = match cfg.q_lora_rank {
            None => QProj::Plain(Linear::new(p, "q_proj", hidden, h * qk, false)),
            Some(rq) => QProj::Lora {
                a: Linear::new(p, "q_a_proj", hidden, rq, bias),
                norm: norm_weight(p, "q_a_layernorm", rq),
                b: Linear::new(p, "q_b_proj", rq, h * qk, false),
            },
        };
        Self {
            q,
            kv_a: Linear::new(p, "kv_a_proj_with_mqa", hidden, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias),
            kv_norm: norm_weight(p, "kv_a_layernorm", cfg.kv_lora_rank),
            kv_b: Linear::new(p, "kv_b_proj", cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), false),
            o: Linear::new(p, "o_proj", h * cfg.v_head_dim, hidden, bias),
            gate: cfg.output_gate.then(|| Linear::new(p, "g_proj", hidden, h * cfg.v_head_dim, false)),
            heads: h as i64,
            dn: cfg.qk_nope_head_dim as i64,
            dr: cfg.qk_rope_head_dim as i64,
            dv: cfg.v_head_dim as i64,
            rank: cfg.kv_lora_rank as i64,
        }
    }

    /// # Shapes
    /// x: [B,T,C] (already `input_layernorm`ed) → [B,T,C]. With a cache, the T new tokens attend
    /// to the P cached ones and to themselves causally, and are appended to the cache.
    pub fn forward(&self, x: &Tensor, cache: Option<&mut MlaCache>) -> Tensor {
        let (b, t, _) = x.size3().expect("x must be [B,T,C]");
        let (h, dn, dr, dv) = (self.heads, self.dn, self.dr, self.dv);
        let q = match &self.q {
            QProj::Plain(l) => l.forward(x),
            QProj::Lora { a, norm, b: qb } => qb.forward(&rms_norm(&a.forward(x), norm, LATENT_NORM_EPS)),
        }
        .view([b, t, h, dn + dr])
        .transpose(1, 2); // [B,H,T,Dn+Dr]

        let ckv = self.kv_a.forward(x); // [B,T,R+Dr]
        let c_kv = rms_norm(&ckv.narrow(-1, 0, self.rank), &self.kv_norm, LATENT_NORM_EPS); // [B,T,R]
        let k_r = ckv.narrow(-1, self.rank, dr); // [B,T,Dr], shared by all heads, no rotary (NoPE)
        let past = cache.as_ref().map_or(0, |c| c.len());
        let (c_all, k_r_all) = match cache {
            Some(c) => {
                let (ca, ka) = match (&c.c_kv, &c.k_r) {
                    (Some(pc), Some(pk)) => (Tensor::cat(&[pc, &c_kv], 1), Tensor::cat(&[pk, &k_r], 1)),
                    _ => (c_kv, k_r),
                };
                c.c_kv = Some(ca.shallow_clone());
                c.k_r = Some(ka.shallow_clone());
                (ca, ka)
            }
            None => (c_kv, k_r),
        }; // [B,S,R], [B,S,Dr]
        let s = past + t;
        let kv = self.kv_b.forward(&c_all).view([b, s, h, dn + dv]).transpose(1, 2); // [B,H,S,Dn+Dv]
        let k_nope = kv.narrow(-1, 0, dn);
        let v = kv.narrow(-1, dn, dv); // [B,H,S,Dv]
        let k = Tensor::cat(&[k_nope, k_r_all.unsqueeze(1).expand([b, h, s, dr], false)], -1); // [B,H,S,Dn+Dr]

        // softmax((q·kᵀ)/√(Dn+Dr) + causal) in f32; query t sits at absolute position P + t.
        let scale = ((dn + dr) as f64).powf(-0.5);
        let scores = q.matmul(&k.transpose(-1, -2)) * scale; // [B,H,T,S]
        let qpos = Tensor::arange(t, (Kind::Int64, x.device())) + past;
        let kpos = Tensor::arange(s, (Kind::Int64, x.device()));
        let future = kpos.unsqueeze(0).gt_tensor(&qpos.unsqueeze(1)); // [T,S]
        let attn = scores
            .masked_fill(&future, f64::NEG_INFINITY)
            .softmax(-1, crate::nn::compute_kind(q.kind()))
            .to_kind(q.kind());
        let o = attn.matmul(&v).transpose(1, 2).reshape([b, t, h * dv]); // [B,T,H·Dv]
        let o = match &self.gate {
            Some(g) => o * g.forward(x).sigmoid(), // K3: gate from the mixer input, before o_proj
            None => o,
        };
        self.o.forward(&o)
    }
}
