//! Kimi Delta Attention layer. Paper: arXiv:2510.26692 §3 (KL-TR). References: transformers 5.24
//! `KimiLinearDeltaAttention`, fla `fla/layers/kda.py`; K3 gate and full-rank output gate from
//! llama.cpp `kimi-k3` (architecture.md §1).
//! Dims: B batch, T time, C hidden, H heads, K = V head dim (= gate rank), W = H·K, Kc conv kernel.

use k3_config::{KdaConfig, KdaDecay, KdaOutGate};
use tch::nn::{Init, Path};
use tch::{Kind, Tensor};

use crate::kda_ops::{kda_chunk, kda_step};
use crate::nn::{l2norm, rms_norm, set_param, softplus_thresholded, Linear};

/// Chunk size of the WY form (fla and transformers use 64).
pub const CHUNK: i64 = 64;

/// Per-sequence decode state of one KDA layer.
#[derive(Debug)]
pub struct KdaState {
    /// The last Kc−1 **pre-conv** inputs of q | k | v: [B, 3W, Kc−1].
    pub conv: Tensor,
    /// The delta-rule state: [B, H, K, V], f32.
    pub s: Tensor,
}

/// KDA output gate: Kimi Linear's low-rank pair or K3's full-rank projection.
#[derive(Debug)]
pub enum OutGate {
    LowRank { a: Linear, b: Linear },
    Full(Linear),
}

/// The forget gate from the raw low-rank projection f (architecture.md §1(b)):
/// softplus `g = −exp(A_log[h])·softplus(f + dt_bias)` or lower-bound `g = lb·σ(exp(A_log[h])·(f + dt_bias))`.
///
/// # Shapes
/// f: [..., H, K]; a_log: H elements (any shape); dt_bias: [H·K] → g: [..., H, K]
pub fn kda_gate(f: &Tensor, a_log: &Tensor, dt_bias: &Tensor, decay: KdaDecay) -> Tensor {
    let sz = f.size();
    let (h, k) = (sz[sz.len() - 2], sz[sz.len() - 1]);
    let f = f + dt_bias.view([h, k]);
    let a = a_log.reshape([h, 1]).exp();
    match decay {
        KdaDecay::Softplus => -a * softplus_thresholded(&f),
        KdaDecay::LowerBound(lb) => (a * f).sigmoid() * lb as f64,
    }
}

#[derive(Debug)]
pub struct Kda {
    q: Linear,
    k: Linear,
    v: Linear,
    q_conv: Tensor, // [W, 1, Kc]
    k_conv: Tensor,
    v_conv: Tensor,
    f_a: Linear,     // C → K
    f_b: Linear,     // K → W
    a_log: Tensor,   // [1,1,H,1] (Kimi Linear) or [H] (K3)
    dt_bias: Tensor, // [W]
    b: Linear,       // C → H (β logits)
    gate: OutGate,
    o_norm: Tensor, // [V], shared by all heads
    o: Linear,      // W → C
    decay: KdaDecay,
    heads: i64,
    head_dim: i64,
    eps: f64,
}

impl Kda {
    /// Create the layer's parameters under `p` (= `model.layers.{i}.self_attn`), initialised as the
    /// references do: normal(0.02) matrices, conv kernels U(±1/√Kc), A_log = log U(1,16) for the
    /// softplus gate (0 for the lower-bound gate, fla's `safe_gate`), dt_bias inverse-softplus.
    pub fn new(p: &Path, hidden: usize, cfg: &KdaConfig, k3_shapes: bool, eps: f64) -> Self {
        let (h, kd, kc) = (cfg.num_heads as i64, cfg.head_dim as i64, cfg.conv_kernel as i64);
        let w = (h * kd) as usize;
        let bound = 1.0 / (kc as f64).sqrt();
        let conv = |name: &str| p.sub(name).var("weight", &[h * kd, 1, kc], Init::Uniform { lo: -bound, up: bound });
        let a_log_shape: Vec<i64> = if k3_shapes { vec![h] } else { vec![1, 1, h, 1] };
        let a_log = p.var("A_log", &a_log_shape, Init::Const(0.0));
        if cfg.decay == KdaDecay::Softplus {
            set_param(&a_log, &(Tensor::rand(&a_log_shape, (Kind::Float, p.device())) * 15.0 + 1.0).log());
        }
        let dt_bias = p.var("dt_bias", &[h * kd], Init::Const(0.0));
        let (lo, hi) = (1e-3f64.ln(), 1e-1f64.ln());
        let dt = (Tensor::rand([h * kd], (Kind::Float, p.device())) * (hi - lo) + lo).exp().clamp_min(1e-4);
        set_param(&dt_bias, &(&dt + (-(-&dt).expm1()).log())); // inverse softplus: dt + log(−expm1(−dt))
        let gate = match cfg.out_gate {
            KdaOutGate::LowRank => OutGate::LowRank {
                a: Linear::new(p, "g_a_proj", hidden, kd as usize, false),
                b: Linear::new(p, "g_b_proj", kd as usize, w, false),
            },
            KdaOutGate::FullRank => OutGate::Full(Linear::new(p, "g_proj", hidden, w, false)),
        };
        Self {
            q: Linear::new(p, "q_proj", hidden, w, false),
            k: Linear::new(p, "k_proj", hidden, w, false),
            v: Linear::new(p, "v_proj", hidden, w, false),
            q_conv: conv("q_conv1d"),
            k_conv: conv("k_conv1d"),
            v_conv: conv("v_conv1d"),
            f_a: Linear::new(p, "f_a_proj", hidden, kd as usize, false),
            f_b: Linear::new(p, "f_b_proj", kd as usize, w, false),
            a_log,
            dt_bias,
            b: Linear::new(p, "b_proj", hidden, h as usize, false),
            gate,
            o_norm: crate::nn::norm_weight(p, "o_norm", kd as usize),
            o: Linear::new(p, "o_proj", w, hidden, false),
            decay: cfg.decay,
            heads: h,
            head_dim: kd,
            eps,
        }
    }

    /// A fresh (zero) decode state for a batch of `b` sequences.
    pub fn new_state(&self, b: i64) -> KdaState {
        let (w, kc) = (self.heads * self.head_dim, self.q_conv.size()[2]);
        let dev = self.q_conv.device();
        KdaState {
            conv: Tensor::zeros([b, 3 * w, kc - 1], (self.q_conv.kind(), dev)),
            s: Tensor::zeros(
                [b, self.heads, self.head_dim, self.head_dim],
                (crate::nn::compute_kind(self.q_conv.kind()), dev),
            ),
        }
    }

    /// The per-channel log-space decay g ≤ 0 (architecture.md §1(b)).
    ///
    /// # Shapes
    /// x: [B,T,C] → g: [B,T,H,K]
    pub fn decay(&self, x: &Tensor) -> Tensor {
        let (b, t, _) = x.size3().expect("x must be [B,T,C]");
        let f = self.f_b.forward(&self.f_a.forward(x)).view([b, t, self.heads, self.head_dim]);
        kda_gate(&f, &self.a_log, &self.dt_bias, self.decay)
    }

    /// # Shapes
    /// x: [B,T,C] (already `input_layernorm`ed) → [B,T,C]. With a state, T = 1 takes the recurrent
    /// step and T > 1 continues the chunked form from the stored state; the state is updated.
    pub fn forward(&self, x: &Tensor, mut state: Option<&mut KdaState>) -> Tensor {
        let (b, t, _) = x.size3().expect("x must be [B,T,C]");
        let (h, kd) = (self.heads, self.head_dim);
        let w = h * kd;
        let kc = self.q_conv.size()[2];

        // Short causal depthwise convolution over [q | k | v] with the cached pre-conv tail (or
        // zeros): y[t] = SiLU(Σ_i w[i] ⊙ x[t − (Kc−1) + i]), as Kc shifted multiply-adds in
        // [B,T,3W] layout (cheaper than conv1d and its transposes, forward and backward).
        let qkv = Tensor::cat(&[self.q.forward(x), self.k.forward(x), self.v.forward(x)], -1); // [B,T,3W]
        let tail = match state.as_deref() {
            Some(st) => st.conv.transpose(1, 2), // [B,Kc−1,3W]
            None => Tensor::zeros([b, kc - 1, 3 * w], (qkv.kind(), qkv.device())),
        };
        let xin = Tensor::cat(&[tail, qkv], 1); // [B,T+Kc−1,3W]
        if let Some(st) = state.as_deref_mut() {
            st.conv = xin.narrow(1, t, kc - 1).transpose(1, 2).contiguous();
        }
        let kernel = Tensor::cat(&[&self.q_conv, &self.k_conv, &self.v_conv], 0).squeeze_dim(1).transpose(0, 1); // [Kc,3W]
        let mut y = xin.narrow(1, 0, t) * kernel.get(0);
        for i in 1..kc {
            y = y + xin.narrow(1, i, t) * kernel.get(i);
        }
        let y = y.silu(); // [B,T,3W]
        let parts = y.split(w, -1);
        let q = l2norm(&parts[0].reshape([b, t, h, kd]), 1e-6); // [B,T,H,K]
        let k = l2norm(&parts[1].reshape([b, t, h, kd]), 1e-6);
        let v = parts[2].reshape([b, t, h, kd]); // [B,T,H,V]

        let g = self.decay(x); // [B,T,H,K]
        let beta = self.b.forward(x).sigmoid(); // [B,T,H]
        let o = match state {
            Some(st) if t == 1 => {
                let (o, s) = kda_step(
                    &q.squeeze_dim(1),
                    &k.squeeze_dim(1),
                    &v.squeeze_dim(1),
                    &g.squeeze_dim(1),
                    &beta.squeeze_dim(1),
                    &st.s,
                );
                st.s = s;
                o.unsqueeze(1)
            }
            Some(st) => {
                let (o, s) = kda_chunk(&q, &k, &v, &g, &beta, Some(&st.s), CHUNK);
                st.s = s;
                o
            }
            None => kda_chunk(&q, &k, &v, &g, &beta, None, CHUNK).0,
        }; // [B,T,H,V]

        // Gated per-head RMSNorm: normalise first, gate second (sigmoid).
        let gate = match &self.gate {
            OutGate::LowRank { a, b: bb } => bb.forward(&a.forward(x)),
            OutGate::Full(g) => g.forward(x),
        }
        .view([b, t, h, kd]);
        let o = rms_norm(&o, &self.o_norm, self.eps) * gate.sigmoid();
        self.o.forward(&o.reshape([b, t, w]))
    }
}
