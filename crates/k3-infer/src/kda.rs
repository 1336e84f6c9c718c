//! Kimi Delta Attention layer (architecture.md §1). Mirrors k3-train's `kda.rs`; the delta rule
//! itself is in `k3_kernels::kda` (chunked for prefill, one step for decode).
//! Dims: T tokens, C hidden, H heads, K = V head dim, W = H·K, Kc conv kernel.

use k3_config::{KdaConfig, KdaDecay, KdaOutGate};
use k3_kernels::{conv, kda as core, ops};

use crate::linear::{Compute, Matrix};
use crate::source::Source;
use crate::threads;
use crate::Result;

/// Chunk size of the prefill WY form.
pub const CHUNK: usize = 64;

/// One sequence's KDA state: the pre-conv tail and the delta-rule state.
#[derive(Debug, Clone)]
pub struct KdaState {
    pub conv: Vec<f32>, // [3 (q, k, v), Kc − 1, W]
    pub s: Vec<f32>,    // [H, K, V]
}

pub enum OutGate {
    LowRank { a: Matrix, b: Matrix },
    Full(Matrix),
}

pub struct Kda {
    q: Matrix,
    k: Matrix,
    v: Matrix,
    conv_w: Vec<f32>, // 3 × [Kc, W]: q | k | v taps, by offset (conv::taps_by_offset)
    f_a: Matrix,
    f_b: Matrix,
    a: Vec<f32>,       // exp(A_log) per head [H]
    dt_bias: Vec<f32>, // [W]
    b: Matrix,
    gate: OutGate,
    o_norm: Vec<f32>, // [V]
    o: Matrix,
    decay: KdaDecay,
    h: usize,
    kd: usize,
    kc: usize,
    eps: f32,
}

impl Kda {
    pub fn load(src: &Source, i: usize, hidden: usize, cfg: &KdaConfig, eps: f64) -> Result<Self> {
        let p = format!("model.layers.{i}.self_attn");
        let (h, kd, kc) = (cfg.num_heads, cfg.head_dim, cfg.conv_kernel);
        let w = h * kd;
        let mut conv_w = Vec::with_capacity(3 * w * kc);
        for n in ["q", "k", "v"] {
            conv_w.extend(conv::taps_by_offset(&src.vector(&format!("{p}.{n}_conv1d.weight"), w * kc)?, w, kc));
        }
        let gate = match cfg.out_gate {
            KdaOutGate::LowRank => OutGate::LowRank {
                a: src.matrix(&format!("{p}.g_a_proj.weight"), kd, hidden)?,
                b: src.matrix(&format!("{p}.g_b_proj.weight"), w, kd)?,
            },
            KdaOutGate::FullRank => OutGate::Full(src.matrix(&format!("{p}.g_proj.weight"), w, hidden)?),
        };
        Ok(Self {
            q: src.matrix(&format!("{p}.q_proj.weight"), w, hidden)?,
            k: src.matrix(&format!("{p}.k_proj.weight"), w, hidden)?,
            v: src.matrix(&format!("{p}.v_proj.weight"), w, hidden)?,
            conv_w,
            f_a: src.matrix(&format!("{p}.f_a_proj.weight"), kd, hidden)?,
            f_b: src.matrix(&format!("{p}.f_b_proj.weight"), w, kd)?,
            a: src.kda_decay_rate(i, h)?,
            dt_bias: src.vector(&format!("{p}.dt_bias"), w)?,
            b: src.matrix(&format!("{p}.b_proj.weight"), h, hidden)?,
            gate,
            o_norm: src.vector(&format!("{p}.o_norm.weight"), kd)?,
            o: src.matrix(&format!("{p}.o_proj.weight"), hidden, w)?,
            decay: cfg.decay,
            h,
            kd,
            kc,
            eps: eps as f32,
        })
    }

    pub fn new_state(&self) -> KdaState {
        let w = self.h * self.kd;
        KdaState { conv: vec![0.0; 3 * (self.kc - 1) * w], s: vec![0.0; self.h * self.kd * self.kd] }
    }

    /// # Shapes
    /// x: [T, C] (after `input_layernorm`) → [T, C]; the state is advanced by T tokens.
    pub fn forward(&self, x: &[f32], t: usize, st: &mut KdaState, cx: Compute) -> Vec<f32> {
        let (h, kd) = (self.h, self.kd);
        let w = h * kd;
        // Every projection of x at once (one activation quantization, one pool job).
        let gate_in = match &self.gate {
            OutGate::LowRank { a, .. } => a,
            OutGate::Full(gm) => gm,
        };
        let [q, k, v, fa, mut beta, gate_a]: [Vec<f32>; 6] =
            Matrix::apply_many(&[&self.q, &self.k, &self.v, &self.f_a, &self.b, gate_in], x, t, cx)
                .try_into()
                .expect("six products");
        // The short conv per part (q, k, v), each with its own tail and its W channels' taps.
        let hist = (self.kc - 1) * w;
        let mut conv_part = |p: usize, x: &[f32]| {
            let mut y = vec![0f32; t * w];
            let taps = &self.conv_w[p * w * self.kc..(p + 1) * w * self.kc];
            conv::short_conv_silu(&mut y, x, taps, &mut st.conv[p * hist..(p + 1) * hist], w, self.kc, cx.threads);
            y
        };
        let (mut q, mut k, v) = (conv_part(0, &q), conv_part(1, &k), conv_part(2, &v));
        // transformers / fla use eps 1e-6 here, llama.cpp rms_norm_eps: follow the mode's reference.
        for m in [&mut q, &mut k] {
            threads::par_rows(m, w, cx.threads, |_, blk| {
                if cx.exact {
                    ops::l2norm_inplace(blk, kd, 1e-6);
                } else {
                    ops::l2norm_ggml_inplace(blk, kd, self.eps);
                }
            });
        }

        // Forget gate g (log-space, ≤ 0) and β.
        // The libm forms only under reference arithmetic; else the inlined ones, which vectorise.
        let reference = ops::reference_arithmetic();
        let mut g = self.f_b.apply(&fa, t, cx); // [T, W]
        threads::par_rows(&mut g, w, cx.threads, |_, blk| {
            for row in blk.chunks_exact_mut(w) {
                for (hh, gh) in row.chunks_exact_mut(kd).enumerate() {
                    let (a, bias) = (self.a[hh], &self.dt_bias[hh * kd..(hh + 1) * kd]);
                    let pairs = gh.iter_mut().zip(bias);
                    match (self.decay, reference) {
                        (KdaDecay::Softplus, false) => {
                            pairs.for_each(|(gv, &bv)| *gv = -a * ops::softplus_fast(*gv + bv))
                        }
                        (KdaDecay::Softplus, true) => pairs.for_each(|(gv, &bv)| *gv = -a * ops::softplus(*gv + bv)),
                        (KdaDecay::LowerBound(lb), _) => {
                            pairs.for_each(|(gv, &bv)| *gv = lb * ops::sigmoid(a * (*gv + bv)))
                        }
                    }
                }
            }
        });
        beta.iter_mut().for_each(|b| *b = ops::sigmoid(*b));

        let mut o = vec![0f32; t * w];
        if t == 1 {
            core::kda_step_fused(&mut o, &q, &k, &v, &g, &beta, &mut st.s, kd, kd, cx.threads);
        } else {
            core::kda_chunk_parallel(&mut o, &q, &k, &v, &g, &beta, &mut st.s, h, kd, kd, CHUNK, cx.threads);
        }

        // Gated per-head RMSNorm: normalise first, gate second (sigmoid).
        let gate = match &self.gate {
            OutGate::LowRank { b, .. } => b.apply(&gate_a, t, cx),
            OutGate::Full(_) => gate_a,
        };
        let mut normed = vec![0f32; t * w];
        threads::par_rows(&mut normed, w, cx.threads, |r0, blk| {
            let at = r0 * w..r0 * w + blk.len();
            ops::rmsnorm(blk, &o[at.clone()], &self.o_norm, self.eps);
            let pairs = blk.iter_mut().zip(&gate[at]);
            if reference {
                pairs.for_each(|(n, gv)| *n *= ops::sigmoid(*gv));
            } else {
                pairs.for_each(|(n, gv)| *n *= ops::sigmoid_fast(*gv));
            }
        });
        self.o.apply(&normed, t, cx)
    }
}
