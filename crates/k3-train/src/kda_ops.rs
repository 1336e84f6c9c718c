//! The KDA delta-rule core in three forms that agree (architecture.md §1(a), §1(e)):
//! - [`kda_recurrent`]: the specification, a per-token loop (fla `naive_recurrent_kda`);
//! - [`kda_chunk`]: the chunked WY form for training and prefill, intra-chunk work batched over
//!   all chunks with a triangular solve, only the state hand-off sequential;
//! - [`kda_step`]: one decode token, in place on the state.
//!
//! Dims: B batch, T time, H heads, K key dim, V value dim, C chunk, N chunks, S sub-blocks of s.
//! Conventions (fixtures and fla): q, k [B,T,H,K]; v [B,T,H,V]; g [B,T,H,K] log-space decay ≤ 0;
//! beta [B,T,H]; state [B,H,K,V] (row = key channel). `scale = K^-0.5` is applied to q inside.
//! All math is in the inputs' float kind (f32 in the model, f64 in gradient checks).

use tch::{Kind, Tensor};

/// Size of the sub-blocks used to keep every exponent ≤ 0 inside a chunk.
const SUB: i64 = 16;

/// Largest exponent (nats) the factored form may meet: each factor e^{±(G − G_m)} must stay a
/// normal f32 (|exponent| < 87) with room for |x|, |y| ≤ ~1 and the sum over K.
const SAFE_EXP: f64 = 80.0;

/// The token-recurrent reference. Returns (o [B,T,H,V], final state [B,H,K,V]).
///
/// ```text
/// S ← S ⊙ exp(g_t)[:, None]
/// S ← S + (β_t k_t) ⊗ (v_t − Sᵀ k_t)
/// o_t = Sᵀ (scale · q_t)
/// ```
pub fn kda_recurrent(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    s0: Option<&Tensor>,
) -> (Tensor, Tensor) {
    let (b, t, h, kd) = q.size4().expect("q must be [B,T,H,K]");
    let vd = v.size()[3];
    let scale = (kd as f64).powf(-0.5);
    let mut s = match s0 {
        Some(s) => s.shallow_clone(),
        None => Tensor::zeros([b, h, kd, vd], (q.kind(), q.device())),
    };
    let mut outs = Vec::with_capacity(t as usize);
    for i in 0..t {
        let (qt, kt, vt) = (q.select(1, i) * scale, k.select(1, i), v.select(1, i)); // [B,H,K], [B,H,K], [B,H,V]
        let gt = g.select(1, i).exp().unsqueeze(-1); // [B,H,K,1]
        let bt = beta.select(1, i).unsqueeze(-1); // [B,H,1]
        s = s * gt;
        let kv_mem = (&s * kt.unsqueeze(-1)).sum_dim_intlist(-2, false, None); // Sᵀk: [B,H,V]
        let delta = (vt - kv_mem) * bt; // [B,H,V]
        s = s + kt.unsqueeze(-1) * delta.unsqueeze(-2);
        outs.push((&s * qt.unsqueeze(-1)).sum_dim_intlist(-2, false, None)); // [B,H,V]
    }
    (Tensor::stack(&outs, 1), s)
}

/// One decode step: the recurrence for a single token, returning the new state.
///
/// # Shapes
/// q, k, g: [B,H,K]; v: [B,H,V]; beta: [B,H]; s: [B,H,K,V] → (o [B,H,V], s [B,H,K,V])
pub fn kda_step(q: &Tensor, k: &Tensor, v: &Tensor, g: &Tensor, beta: &Tensor, s: &Tensor) -> (Tensor, Tensor) {
    let (o, s) =
        kda_recurrent(&q.unsqueeze(1), &k.unsqueeze(1), &v.unsqueeze(1), &g.unsqueeze(1), &beta.unsqueeze(1), Some(s));
    (o.squeeze_dim(1), s)
}

/// `Σ_d x_c[d] · y_j[d] · exp(G_c[d] − G_j[d])` for all c, j of a block, factored through the
/// block's middle row m as one matmul: `(x ⊙ e^{G−G_m}) (y ⊙ e^{G_m−G})ᵀ`, then masked to the
/// lower triangle `tri`. Callers check [`max_exponent`] first; entries above the diagonal may
/// still overflow and are replaced (not multiplied) by 0, so no NaN reaches the gradient.
///
/// # Shapes
/// x, y, g: [..., n, K], tri: [n, n] bool → [..., n, n]
fn factored(x: &Tensor, y: &Tensor, g: &Tensor, tri: &Tensor) -> Tensor {
    let n = g.size()[g.dim() - 2];
    let gm = g.select(-2, n / 2).unsqueeze(-2); // [..., 1, K]
    let a = (x * (g - &gm).exp()).matmul(&(y * (gm - g).exp()).transpose(-1, -2));
    a.masked_fill(&tri.logical_not(), 0.0)
}

/// The largest exponent [`factored`] would meet on blocks along dim −2: max over channels of
/// `G_first − G_m` and `G_m − G_last` (G is non-increasing, so these bound every |G − G_m|).
fn max_exponent(g: &Tensor) -> f64 {
    let n = g.size()[g.dim() - 2];
    let m = g.select(-2, n / 2);
    let up = (g.select(-2, 0) - &m).max().double_value(&[]);
    let down = (m - g.select(-2, n - 1)).max().double_value(&[]);
    up.max(down)
}

/// Which exact form [`intra_chunk`] takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntraPath {
    /// One factored matmul per chunk.
    WholeChunk,
    /// Sub-blocks, the diagonal ones factored.
    SubBlocksFactored,
    /// Sub-blocks, the diagonal ones by direct differences.
    SubBlocksDirect,
}

/// The path for within-chunk cumulative decays `gc` [.., C, K].
pub fn intra_path(gc: &Tensor) -> IntraPath {
    let c = gc.size()[gc.dim() - 2];
    if max_exponent(gc) < SAFE_EXP {
        return IntraPath::WholeChunk;
    }
    let s = if c % SUB == 0 { SUB } else { c };
    let sz = gc.size();
    let sub = gc.reshape([&sz[..sz.len() - 2], &[c / s, s, sz[sz.len() - 1]]].concat());
    if max_exponent(&sub) < SAFE_EXP {
        IntraPath::SubBlocksFactored
    } else {
        IntraPath::SubBlocksDirect
    }
}

/// Intra-chunk pair products `A[c, j] = Σ_d x_c[d] · y_j[d] · exp(G_c[d] − G_j[d])` for j < c
/// (or j ≤ c when `inclusive`), 0 elsewhere.
///
/// Three exact forms, the fastest whose exponents stay in f32 range (a product of two f32
/// factors is as exact as the direct exponential while neither over- nor underflows):
/// 1. the whole chunk [`factored`] in one matmul, when its exponents stay under `SAFE_EXP`;
/// 2. else s×s sub-blocks: below the diagonal blocks, factor through the first row r of the row's
///    sub-block, `exp(G_c − G_r) · exp(G_r − G_j)`, both ≤ 1; the diagonal blocks [`factored`]
///    when their exponents stay under `SAFE_EXP`,
/// 3. else direct differences under a triangular mask (exact for any decay, ~10× slower).
///
/// # Shapes
/// x, y, gc: [B,H,N,C,K] (gc = within-chunk cumulative g) → [B,H,N,C,C]
pub fn intra_chunk(x: &Tensor, y: &Tensor, gc: &Tensor, inclusive: bool) -> Tensor {
    let sz = x.size();
    let (c, kd) = (sz[3], sz[4]);
    let opts = (Kind::Bool, x.device());
    let tri = |n: i64| Tensor::ones([n, n], opts).tril(if inclusive { 0 } else { -1 });
    let path = intra_path(gc);
    if path == IntraPath::WholeChunk {
        return factored(x, y, gc, &tri(c));
    }
    // Sub-blocking only bounds exponents (the direct masked form is exact too), so any chunk works.
    let s = if c % SUB == 0 { SUB } else { c };
    let nsub = c / s;
    let lead = &sz[..3];
    let blk = |t: &Tensor| t.reshape([lead, &[nsub, s, kd]].concat()); // [B,H,N,S,s,K]

    // Off-diagonal blocks: rows of sub-block a against every column j < a·s.
    let g_ref = blk(gc).select(-2, 0); // [B,H,N,S,K]
    let x_left = blk(x) * (blk(gc) - g_ref.unsqueeze(-2)).exp(); // [B,H,N,S,s,K]
    let col = Tensor::arange(c, (Kind::Int64, x.device())); // [C]
    let start = Tensor::arange(nsub, (Kind::Int64, x.device())) * s; // [S]
    let earlier = col.unsqueeze(0).lt_tensor(&start.unsqueeze(1)); // [S, C]: j < a·s
    let diff = (g_ref.unsqueeze(-2) - gc.unsqueeze(-3)) // [B,H,N,S,C,K] = G_r(a) − G_j
        .masked_fill(&earlier.logical_not().unsqueeze(-1), f64::NEG_INFINITY);
    let y_right = y.unsqueeze(-3) * diff.exp(); // [B,H,N,S,C,K]
    let off = x_left.matmul(&y_right.transpose(-1, -2)); // [B,H,N,S,s,C]
    let off = off.reshape([lead, &[c, c]].concat());

    // Diagonal blocks.
    let gs = blk(gc); // [B,H,N,S,s,K]
    let diag = if path == IntraPath::SubBlocksFactored {
        factored(&blk(x), &blk(y), &gs, &tri(s))
    } else {
        let d = gs.unsqueeze(-2) - gs.unsqueeze(-3); // [B,H,N,S,s(c),s(j),K] = G_c − G_j
        let d = d.masked_fill(&tri(s).logical_not().unsqueeze(-1), f64::NEG_INFINITY);
        (blk(x).unsqueeze(-2) * blk(y).unsqueeze(-3) * d.exp()).sum_dim_intlist(-1, false, None)
    }; // [B,H,N,S,s,s]
    let eye = Tensor::eye(nsub, (x.kind(), x.device())).view([nsub, 1, nsub, 1]);
    let blockdiag = diag.unsqueeze(-2) * eye; // [B,H,N,S,s,S,s]
    off + blockdiag.reshape([lead, &[c, c]].concat())
}

/// The chunked WY form (KL-TR Eqs. 2–9). Returns (o [B,T,H,V], final state [B,H,K,V]).
///
/// Any T (padded internally to a multiple of `chunk`, with g = 0 and β = 0 so the padding leaves
/// the state untouched) and an optional non-zero initial state.
pub fn kda_chunk(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    s0: Option<&Tensor>,
    chunk: i64,
) -> (Tensor, Tensor) {
    let (b, t, h, kd) = q.size4().expect("q must be [B,T,H,K]");
    let vd = v.size()[3];
    let scale = (kd as f64).powf(-0.5);
    let pad = (chunk - t % chunk) % chunk;
    let n = (t + pad) / chunk;
    // [B,T,H,*] → [B,H,N,C,*], zero-padded in time.
    let prep = |x: &Tensor| {
        let x = x.transpose(1, 2); // [B,H,T,*]
        let x = if pad > 0 { x.constant_pad_nd([0, 0, 0, pad]) } else { x };
        let last = x.size()[3];
        x.reshape([b, h, n, chunk, last])
    };
    let q = prep(q) * scale;
    let k = prep(k);
    let v = prep(v);
    let gc = prep(g).cumsum(-2, None); // within-chunk cumulative log-decay [B,H,N,C,K]
    let beta = prep(&beta.unsqueeze(-1)); // [B,H,N,C,1]

    // 1. Intra-chunk, batched over all chunks: L (strictly lower) and the (I + L)⁻¹ transforms.
    let l = intra_chunk(&(&k * &beta), &k, &gc, false); // L[c,i] = β_c Σ k_c k_i e^{G_c−G_i}
    let e_g = gc.exp(); // [B,H,N,C,K], ≤ 1
                        // U = T (β ⊙ V) and W = T (β ⊙ K ⊙ e^G), T = (I + L)⁻¹, in one triangular solve.
    let uw = l.linalg_solve_triangular(&Tensor::cat(&[&v * &beta, &k * &beta * &e_g], -1), false, true, true);
    let (u, w) = (uw.narrow(-1, 0, vd), uw.narrow(-1, vd, kd)); // [B,H,N,C,V], [B,H,N,C,K]
    let a_qk = intra_chunk(&q, &k, &gc, true); // [B,H,N,C,C], diagonal kept
    let g_last = gc.select(3, chunk - 1); // [B,H,N,K]
    let k_decay = &k * (g_last.unsqueeze(3) - &gc).exp(); // e^{G_last − G} ≤ 1   [B,H,N,C,K]
    let k_decay_t = k_decay.transpose(-1, -2); // [B,H,N,K,C]
    let state_decay = g_last.exp().unsqueeze(-1); // [B,H,N,K,1]

    // 2. Sequential hand-off of the state between chunks (Eq. 8); only matmuls inside.
    let mut s = match s0 {
        Some(s) => s.shallow_clone(),
        None => Tensor::zeros([b, h, kd, vd], (q.kind(), q.device())),
    };
    let (mut states, mut v_news) = (Vec::with_capacity(n as usize), Vec::with_capacity(n as usize));
    for i in 0..n {
        let v_new = u.select(2, i) - w.select(2, i).matmul(&s); // pseudo-values V' = U − W S   [B,H,C,V]
        states.push(s.shallow_clone());
        s = &s * state_decay.select(2, i) + k_decay_t.select(2, i).matmul(&v_new);
        v_news.push(v_new);
    }

    // 3. Outputs of all chunks at once (Eq. 9): o = (q ⊙ e^G) S_before + A_qk V'.
    let s_before = Tensor::stack(&states, 2); // [B,H,N,K,V]
    let v_new = Tensor::stack(&v_news, 2); // [B,H,N,C,V]
    let o = (&q * &e_g).matmul(&s_before) + a_qk.matmul(&v_new); // [B,H,N,C,V]
    let o = o.reshape([b, h, n * chunk, vd]).narrow(2, 0, t); // [B,H,T,V]
    (o.transpose(1, 2).contiguous(), s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn inputs(b: i64, t: i64, h: i64, kd: i64, vd: i64, kind: Kind, seed: i64) -> [Tensor; 6] {
        crate::with_seed(seed, || {
            let o = (kind, Device::Cpu);
            let q = Tensor::randn([b, t, h, kd], o);
            let k = crate::nn::l2norm(&Tensor::randn([b, t, h, kd], o), 1e-6);
            let v = Tensor::randn([b, t, h, vd], o);
            let g = -(Tensor::rand([b, t, h, kd], o) * 0.5);
            let beta = Tensor::rand([b, t, h], o);
            let s0 = Tensor::randn([b, h, kd, vd], o) * 0.1;
            [q, k, v, g, beta, s0]
        })
    }

    fn max_abs(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).abs().max().double_value(&[])
    }

    #[test]
    fn chunk_matches_recurrent_for_any_length_and_chunk() {
        for &(t, chunk) in &[(1, 64), (50, 64), (64, 64), (130, 64), (100, 32), (37, 16), (20, 8)] {
            let [q, k, v, g, beta, s0] = inputs(2, t, 3, 16, 24, Kind::Double, t);
            let (o_r, s_r) = kda_recurrent(&q, &k, &v, &g, &beta, Some(&s0));
            let (o_c, s_c) = kda_chunk(&q, &k, &v, &g, &beta, Some(&s0), chunk);
            assert!(max_abs(&o_r, &o_c) < 1e-10, "T={t} C={chunk}: o {}", max_abs(&o_r, &o_c));
            assert!(max_abs(&s_r, &s_c) < 1e-10, "T={t} C={chunk}: S {}", max_abs(&s_r, &s_c));
        }
    }

    #[test]
    fn chunk_survives_decay_far_below_exp_range() {
        // Per-token log-decay of −5 sums to −320 in a 64-chunk: exp(±320) is out of f32 range.
        let [q, k, v, _, beta, s0] = inputs(1, 128, 2, 16, 16, Kind::Float, 7);
        let g = Tensor::full([1, 128, 2, 16], -5.0, (Kind::Float, Device::Cpu));
        let (o_r, s_r) = kda_recurrent(&q, &k, &v, &g, &beta, Some(&s0));
        let (o_c, s_c) = kda_chunk(&q, &k, &v, &g, &beta, Some(&s0), 64);
        assert!(bool::try_from(o_c.isfinite().all()).expect("bool"));
        assert!(max_abs(&o_r, &o_c) < 1e-5 && max_abs(&s_r, &s_c) < 1e-5);
    }

    #[test]
    fn chunk_direct_fallback_handles_near_total_forgetting() {
        // −12 per token: a 16-token sub-block spans 192 nats, beyond the factorised form's range.
        let [q, k, v, _, beta, s0] = inputs(1, 80, 2, 16, 16, Kind::Float, 8);
        let g = Tensor::full([1, 80, 2, 16], -12.0, (Kind::Float, Device::Cpu));
        let (o_r, s_r) = kda_recurrent(&q, &k, &v, &g, &beta, Some(&s0));
        let (o_c, s_c) = kda_chunk(&q, &k, &v, &g, &beta, Some(&s0), 64);
        assert!(bool::try_from(o_c.isfinite().all()).expect("bool"));
        assert!(max_abs(&o_r, &o_c) < 1e-5 && max_abs(&s_r, &s_c) < 1e-5);
    }

    /// Regression (a real training run): decay concentrated in the first half of a chunk makes
    /// one factor e^{G_0 − G_m} overflow although the chunk's total decay looks safe.
    #[test]
    fn chunk_survives_lopsided_decay() {
        let [q, k, v, _, beta, s0] = inputs(2, 64, 2, 16, 16, Kind::Float, 12);
        let first = Tensor::full([2, 32, 2, 16], -3.5, (Kind::Float, Device::Cpu));
        let rest = Tensor::full([2, 32, 2, 16], -0.01, (Kind::Float, Device::Cpu));
        let g = Tensor::cat(&[first, rest], 1);
        let (o_r, s_r) = kda_recurrent(&q, &k, &v, &g, &beta, Some(&s0));
        let (o_c, s_c) = kda_chunk(&q, &k, &v, &g, &beta, Some(&s0), 64);
        assert!(bool::try_from(o_c.isfinite().all()).expect("bool"));
        assert!(max_abs(&o_r, &o_c) < 1e-5 && max_abs(&s_r, &s_c) < 1e-5);
    }

    #[test]
    fn steps_match_recurrent() {
        let [q, k, v, g, beta, s0] = inputs(2, 9, 2, 8, 8, Kind::Double, 3);
        let (o_r, s_r) = kda_recurrent(&q, &k, &v, &g, &beta, Some(&s0));
        let mut s = s0;
        for i in 0..9 {
            let (o, s2) =
                kda_step(&q.select(1, i), &k.select(1, i), &v.select(1, i), &g.select(1, i), &beta.select(1, i), &s);
            assert!(max_abs(&o, &o_r.select(1, i)) < 1e-12);
            s = s2;
        }
        assert!(max_abs(&s, &s_r) < 1e-12);
    }

    /// Gradients of the chunked form (autograd through the triangular solve) equal central finite
    /// differences of the recurrent form, for every input including the gate and the initial state.
    #[test]
    fn chunk_gradients_match_finite_differences_of_recurrent() {
        // (chunk, decay scale): the whole-chunk factored form, the sub-block form with factored
        // diagonal blocks, and the direct diagonal form.
        for (chunk, scale, path) in [
            (8, 1.0, IntraPath::WholeChunk),
            (32, 30.0, IntraPath::SubBlocksFactored),
            (32, 90.0, IntraPath::SubBlocksDirect),
        ] {
            gradients_match_fd(chunk, scale, path);
        }
    }

    fn gradients_match_fd(chunk: i64, scale: f64, path: IntraPath) {
        let [q, k, v, g, beta, s0] = inputs(1, 21, 2, 4, 3, Kind::Double, 11);
        let g = g * scale;
        let gc = g.transpose(1, 2).constant_pad_nd([0, 0, 0, chunk - 21]).reshape([1, 2, 1, chunk, 4]).cumsum(-2, None);
        assert_eq!(intra_path(&gc), path, "chunk {chunk} decay x{scale}");
        let (w_o, w_s) = crate::with_seed(12, || {
            (
                Tensor::randn([1, 21, 2, 3], (Kind::Double, Device::Cpu)),
                Tensor::randn([1, 2, 4, 3], (Kind::Double, Device::Cpu)),
            )
        });
        let loss_rec = |x: &[Tensor; 6]| {
            let (o, s) = kda_recurrent(&x[0], &x[1], &x[2], &x[3], &x[4], Some(&x[5]));
            ((o * &w_o).sum(Kind::Double) + (s * &w_s).sum(Kind::Double)).double_value(&[])
        };
        let vars: [Tensor; 6] = [q, k, v, g, beta, s0].map(|t| t.set_requires_grad(true));
        let (o, s) = kda_chunk(&vars[0], &vars[1], &vars[2], &vars[3], &vars[4], Some(&vars[5]), chunk);
        let loss = (o * &w_o).sum(Kind::Double) + (s * &w_s).sum(Kind::Double);
        let grads = Tensor::run_backward(&[loss], &vars, false, false);
        let base: [Tensor; 6] = vars.each_ref().map(|t| t.detach().copy());
        let eps = 1e-6;
        for (vi, grad) in grads.iter().enumerate() {
            let numel = base[vi].numel() as i64;
            for idx in [0, numel / 3, numel / 2, numel - 1] {
                let bump = |delta: f64| {
                    let x: [Tensor; 6] = base.each_ref().map(|t| t.copy());
                    let flat = x[vi].view([-1]);
                    let _ = flat.get(idx).f_add_(&Tensor::from(delta)).expect("bump");
                    loss_rec(&x)
                };
                let fd = (bump(eps) - bump(-eps)) / (2.0 * eps);
                let ad = grad.reshape([-1]).double_value(&[idx]);
                assert!(
                    (fd - ad).abs() < 1e-6 * (1.0 + fd.abs()),
                    "chunk {chunk} decay x{scale}: input {vi} elem {idx}: fd {fd} vs autograd {ad}"
                );
            }
        }
    }
}
