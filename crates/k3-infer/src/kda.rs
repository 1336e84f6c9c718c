//! Kimi Delta Attention layer (architecture.md §1). Mirrors k3-train's `kda.rs`; the delta rule
//! itself is in `k3_kernels::kda` (chunked for prefill, one step for decode).
//! Dims: T tokens, C hidden, H heads, K = V head dim, W = H·K, Kc conv kernel.

use k3_config::{KdaConfig, KdaDecay, KdaOutGate};
use k3_kernels::{conv, kda as core, ops};

use crate::linear::{Compute, Matrix};
use crate::source::Source;
use crate::threads;
use crate::Result;
use k3_kernels::qgemm::{gemm_rows_out, Isa, OutMat, QActs};
use k3_kernels::threads::SendPtr;

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
        let (conv, s) = self.state_lens();
        KdaState { conv: vec![0.0; conv], s: vec![0.0; s] }
    }

    /// Values of a state's conv tails and delta-rule state.
    pub fn state_lens(&self) -> (usize, usize) {
        (3 * (self.kc - 1) * self.h * self.kd, self.h * self.kd * self.kd)
    }

    /// # Shapes
    /// x: [T, C] (after `input_layernorm`) → [T, C]; the state is advanced by T tokens.
    pub fn forward(&self, x: &[f32], t: usize, st: &mut KdaState, cx: Compute) -> Vec<f32> {
        if t == 1 {
            return self.decode(x, st, cx);
        }
        self.forward_tokens(x, t, st, cx)
    }

    /// The T-token form: each step over all heads in turn (prefill; also decode's reference).
    fn forward_tokens(&self, x: &[f32], t: usize, st: &mut KdaState, cx: Compute) -> Vec<f32> {
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
        let reference = ops::reference_arithmetic();
        let mut g = self.f_b.apply(&fa, t, cx); // [T, W]
        threads::par_rows(&mut g, w, cx.threads, |_, blk| {
            for row in blk.chunks_exact_mut(w) {
                for (hh, gh) in row.chunks_exact_mut(kd).enumerate() {
                    self.decay_gate(hh, gh, reference);
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
            self.gated_norm(blk, &o[at.clone()], &gate[at], reference);
        });
        self.o.apply(&normed, t, cx)
    }

    /// One token. The six input products in one pool job, then one job over heads that runs, per
    /// head, everything between them and o_proj: f_b and the low-rank gate's second factor on the
    /// head's rows (when both are packed, outside the exact mode and K is whole row tiles; else
    /// they run before, one product each, as f_b always does with a full-rank gate), short
    /// conv + SiLU of its q / k / v channels, L2 norms, decay gate and β, the delta-rule step,
    /// gated output norm.
    /// Per element the arithmetic of [`Self::forward_tokens`] (the same bits), but no serial
    /// pass over W between the products.
    ///
    /// # Shapes
    /// x: [1, C] → [1, C]
    fn decode(&self, x: &[f32], st: &mut KdaState, cx: Compute) -> Vec<f32> {
        self.decode_batch(x, &mut [st], cx)
    }

    /// One token for each of B sequences (a batched decode step): [`Self::decode`] with the
    /// products taken over all B rows at once, so each weight is read once for the batch, and
    /// one heads job over every (sequence, head) pair, each against its own sequence's state.
    /// Row b is the arithmetic of [`Self::decode`] on that row alone, but for the products'
    /// accumulation order when B > 1 (the multi-token kernels).
    ///
    /// # Shapes
    /// x: [B, C] → [B, C]; states: B, state b advanced by row b
    pub fn decode_batch(&self, x: &[f32], states: &mut [&mut KdaState], cx: Compute) -> Vec<f32> {
        let (h, kd, kc, nb) = (self.h, self.kd, self.kc, states.len());
        let w = h * kd;
        let gate_in = match &self.gate {
            OutGate::LowRank { a, .. } => a,
            OutGate::Full(gm) => gm,
        };
        let [q, k, v, fa, beta, gate_a]: [Vec<f32>; 6] =
            Matrix::apply_many(&[&self.q, &self.k, &self.v, &self.f_a, &self.b, gate_in], x, nb, cx)
                .try_into()
                .expect("six products");
        // f_b and the low-rank gate's b: their rows c are head hh's channels, so when both take
        // the integer kernels each head's task multiplies its own rows (no job of their own, and
        // their small products ride with the state update); else they run before the heads.
        // (K is whole 32-blocks for any quantized f_b, so the tile check fails only for layouts
        // with tiles of more than 32 rows.)
        let in_heads = match (&self.gate, cx.exact) {
            (OutGate::LowRank { b, .. }, false) => self
                .f_b
                .packed
                .as_deref()
                .zip(b.packed.as_deref())
                .filter(|(f, g)| kd % f.row_align() == 0 && kd % g.row_align() == 0),
            _ => None,
        };
        let (g, gate, acts) = match (in_heads, &self.gate) {
            (Some(_), OutGate::LowRank { b, .. }) => {
                for (m, x) in [(&self.f_b, &fa), (b, &gate_a)] {
                    if let Some(n) = &m.name {
                        crate::calib::record(n, x, nb, kd);
                    }
                }
                // Each sequence's rows quantized on their own (a row's blocks are its own).
                let rows =
                    |m: &[f32]| -> Vec<QActs> { m.chunks_exact(kd).map(|r| QActs::quantize(r, 1, kd)).collect() };
                (Vec::new(), Vec::new(), Some((rows(&fa), rows(&gate_a))))
            }
            (_, OutGate::LowRank { b, .. }) => (self.f_b.apply(&fa, nb, cx), b.apply(&gate_a, nb, cx), None),
            (_, OutGate::Full(_)) => (self.f_b.apply(&fa, nb, cx), gate_a, None),
        };
        let reference = ops::reference_arithmetic();
        let isa = Isa::best();
        let hist = (kc - 1) * w;
        let mut normed = vec![0f32; nb * w];
        let tails: Vec<SendPtr<f32>> = states.iter_mut().map(|st| SendPtr(st.conv.as_mut_ptr())).collect();
        let ss: Vec<SendPtr<f32>> = states.iter_mut().map(|st| SendPtr(st.s.as_mut_ptr())).collect();
        let out = SendPtr(normed.as_mut_ptr());
        let threads = if nb * h * kd * kd < 1 << 14 { 1 } else { cx.threads };
        // Unit u is head u % H of sequence u / H.
        let head = |u: usize| {
            let (b, hh) = (u / h, u % h);
            let c = hh * kd..(hh + 1) * kd;
            let row = b * w..(b + 1) * w;
            // SAFETY: unit (b, hh) alone touches channels c of sequence b's three conv tails
            // ([Kc − 1, W] each), its state rows [hh·K·K, (hh+1)·K·K) and outputs b·W + c.
            let (sh, nh) = unsafe {
                (
                    std::slice::from_raw_parts_mut(ss[b].get().add(hh * kd * kd), kd * kd),
                    std::slice::from_raw_parts_mut(out.get().add(b * w + c.start), kd),
                )
            };
            let mut buf = vec![0f32; 6 * kd];
            let (qkv, rest) = buf.split_at_mut(3 * kd);
            let (gh, rest) = rest.split_at_mut(kd);
            let (oh, gate_h) = rest.split_at_mut(kd);
            for (p, (part, xin)) in qkv.chunks_exact_mut(kd).zip([&q, &k, &v]).enumerate() {
                let taps = &self.conv_w[p * w * kc..(p + 1) * w * kc];
                // SAFETY: tail part p is [Kc − 1, W] at p·hist; channels c are this unit's.
                unsafe {
                    conv::short_conv_silu_step(
                        part,
                        &xin[row.clone()],
                        taps,
                        tails[b].get().add(p * hist),
                        w,
                        kc,
                        c.start,
                    )
                };
            }
            let (qh, rest) = qkv.split_at_mut(kd);
            let (kh, vh) = rest.split_at_mut(kd);
            for m in [&mut *qh, &mut *kh] {
                if cx.exact {
                    ops::l2norm_inplace(m, kd, 1e-6);
                } else {
                    ops::l2norm_ggml_inplace(m, kd, self.eps);
                }
            }
            if let (Some((fp, gp)), Some((fq, gq))) = (in_heads, &acts) {
                for (p, a, y) in [(fp, &fq[b], &mut *gh), (gp, &gq[b], &mut *gate_h)] {
                    // SAFETY: y holds the K outputs of rows c (one token); p's rows c exist.
                    let out = OutMat { ptr: y.as_mut_ptr(), rs: 1, cs: kd };
                    unsafe { gemm_rows_out(isa, p, a, c.start, c.end, out) };
                }
            } else {
                gh.copy_from_slice(&g[b * w + c.start..b * w + c.end]);
                gate_h.copy_from_slice(&gate[b * w + c.start..b * w + c.end]);
            }
            self.decay_gate(hh, gh, reference);
            core::kda_step_head(isa, oh, qh, kh, vh, gh, ops::sigmoid(beta[b * h + hh]), sh);
            self.gated_norm(nh, oh, gate_h, reference);
        };
        // One task a thread over consecutive units: each thread's states (and conv taps and
        // tails) are then one run of memory, which its prefetchers follow from head to head.
        // With a task a head from the shared counter, the two threads took alternate heads: on
        // the Zen 4 host, decode in one process alternating the two every 16 tokens was 2–8%
        // slower that way (scripts/experiments/decode-phases, fifteenth session).
        let units = nb * h;
        let tasks = threads.clamp(1, units);
        threads::Pool::global().run(threads, tasks, &|i| (i * units / tasks..(i + 1) * units / tasks).for_each(&head));
        self.o.apply(&normed, nb, cx)
    }

    /// Head hh's forget gate in place, from `f_b`'s output: `−a·softplus(g + dt_bias)` (or the
    /// lower-bound sigmoid form). The libm forms only under reference arithmetic; else the
    /// inlined ones, which vectorise.
    fn decay_gate(&self, hh: usize, gh: &mut [f32], reference: bool) {
        let (a, bias) = (self.a[hh], &self.dt_bias[hh * self.kd..(hh + 1) * self.kd]);
        let pairs = gh.iter_mut().zip(bias);
        match (self.decay, reference) {
            (KdaDecay::Softplus, false) => pairs.for_each(|(gv, &bv)| *gv = -a * ops::softplus_fast(*gv + bv)),
            (KdaDecay::Softplus, true) => pairs.for_each(|(gv, &bv)| *gv = -a * ops::softplus(*gv + bv)),
            (KdaDecay::LowerBound(lb), _) => pairs.for_each(|(gv, &bv)| *gv = lb * ops::sigmoid(a * (*gv + bv))),
        }
    }

    /// Gated per-head RMSNorm: `y = rmsnorm(o) · σ(gate)` (normalise first, gate second).
    fn gated_norm(&self, y: &mut [f32], o: &[f32], gate: &[f32], reference: bool) {
        ops::rmsnorm(y, o, &self.o_norm, self.eps);
        let pairs = y.iter_mut().zip(gate);
        if reference {
            pairs.for_each(|(n, gv)| *n *= ops::sigmoid(*gv));
        } else {
            pairs.for_each(|(n, gv)| *n *= ops::sigmoid_fast(*gv));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_kernels::quant::GgmlType;
    use k3_kernels::testing::Rng;

    fn matrix(rng: &mut Rng, rows: usize, cols: usize, ty: GgmlType) -> Matrix {
        let w = rng.normals(rows * cols, 0.3);
        Matrix::new(rows, cols, ty, w.chunks(cols).flat_map(|r| ty.quantize_row(r)).collect())
    }

    fn layer(rng: &mut Rng, ty: GgmlType, low_rank: bool, decay: KdaDecay) -> Kda {
        let (h, kd, kc, c) = (8, 64, 4, 96);
        let w = h * kd;
        let gate = if low_rank {
            OutGate::LowRank { a: matrix(rng, kd, c, ty), b: matrix(rng, w, kd, ty) }
        } else {
            OutGate::Full(matrix(rng, w, c, ty))
        };
        Kda {
            q: matrix(rng, w, c, ty),
            k: matrix(rng, w, c, ty),
            v: matrix(rng, w, c, ty),
            conv_w: rng.normals(3 * w * kc, 0.5),
            f_a: matrix(rng, kd, c, ty),
            f_b: matrix(rng, w, kd, ty),
            a: rng.normals(h, 0.5).iter().map(|v| v.exp()).collect(),
            dt_bias: rng.normals(w, 0.5),
            b: matrix(rng, h, c, ty),
            gate,
            o_norm: rng.normals(kd, 0.2).iter().map(|v| 1.0 + v).collect(),
            o: matrix(rng, c, w, ty),
            decay,
            h,
            kd,
            kc,
            eps: 1e-6,
        }
    }

    /// The fused one-token path gives the T-token path's bits (output and both states), for
    /// packed (f_b and the gate's b then multiplied inside the head tasks) and f32 weights, both
    /// gates and decays, quantized and exact activations, 1 and 2
    /// threads.
    #[test]
    fn fused_decode_matches_the_token_path_bit_for_bit() {
        let mut rng = Rng::new(11);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for (ty, low_rank, decay) in [
            (GgmlType::Q4_0, true, KdaDecay::Softplus),
            (GgmlType::Q8_0, true, KdaDecay::LowerBound(-5.0)),
            (GgmlType::Q4_1, false, KdaDecay::Softplus),
            (GgmlType::F32, true, KdaDecay::Softplus),
        ] {
            let kda = layer(&mut rng, ty, low_rank, decay);
            for (threads, exact) in [(1, false), (2, false), (2, true)] {
                let cx = Compute { threads, exact };
                let (mut fused, mut tokens) = (kda.new_state(), kda.new_state());
                for step in 0..3 {
                    let x = rng.normals(96, 1.0);
                    let (a, b) = (kda.decode(&x, &mut fused, cx), kda.forward_tokens(&x, 1, &mut tokens, cx));
                    let what = format!("{ty:?} low_rank {low_rank} {decay:?} {cx:?} step {step}");
                    assert!(a.iter().all(|v| v.is_finite()), "{what}: non-finite output");
                    assert_eq!(bits(&a), bits(&b), "{what}: output");
                    assert_eq!(bits(&fused.s), bits(&tokens.s), "{what}: delta-rule state");
                    assert_eq!(bits(&fused.conv), bits(&tokens.conv), "{what}: conv tails");
                }
            }
        }
    }
}
