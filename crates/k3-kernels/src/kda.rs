//! The KDA delta rule in pure Rust (architecture.md §1(a), §1(e)), mirroring fla's trio:
//! - [`kda_recurrent_ref`]: the specification, a per-token loop;
//! - [`kda_step`]: one token, in place on the state (decode), written as the equations read;
//! - [`kda_step_fused`]: the same step in two passes over the state (one read-only), SIMD,
//!   heads in parallel (the engine's decode path);
//! - [`kda_chunk`]: the chunked WY form, written as the equations read (exp of every G_c − G_j);
//! - [`kda_chunk_parallel`]: the same chunked form as the engine's prefill runs it: decay-weighted
//!   products as SIMD dots of pre-decayed rows (`kda_chunk_fast.rs`), heads in parallel.
//!
//! Layouts: q, k, g: [T, H, K]; v, o: [T, H, V]; beta: [T, H]; state: [H, K, V] (row = key
//! channel), f32. `scale = K^-0.5` is applied to q inside.

/// One token for every head, in place on `s`.
///
/// # Shapes
/// q, k, g: [H, K]; v: [H, V]; beta: [H]; s: [H, K, V]; o: [H, V]
pub fn kda_step(
    o: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    s: &mut [f32],
    kd: usize,
    vd: usize,
) {
    let h = beta.len();
    let scale = 1.0 / (kd as f32).sqrt();
    for hh in 0..h {
        let st = &mut s[hh * kd * vd..(hh + 1) * kd * vd];
        let (qh, kh, gh) = (&q[hh * kd..(hh + 1) * kd], &k[hh * kd..(hh + 1) * kd], &g[hh * kd..(hh + 1) * kd]);
        let vh = &v[hh * vd..(hh + 1) * vd];
        // S ← S ⊙ exp(g)[:, None]
        for i in 0..kd {
            let a = gh[i].exp();
            st[i * vd..(i + 1) * vd].iter_mut().for_each(|x| *x *= a);
        }
        // delta = β (v − Sᵀk);  S ← S + k ⊗ delta
        let mut delta = vh.to_vec();
        for i in 0..kd {
            let ki = kh[i];
            for (d, &sv) in delta.iter_mut().zip(&st[i * vd..(i + 1) * vd]) {
                *d -= sv * ki;
            }
        }
        delta.iter_mut().for_each(|d| *d *= beta[hh]);
        for i in 0..kd {
            crate::ops::axpy(&mut st[i * vd..(i + 1) * vd], kh[i], &delta);
        }
        // o = Sᵀ (scale q)
        let oh = &mut o[hh * vd..(hh + 1) * vd];
        oh.iter_mut().for_each(|x| *x = 0.0);
        for i in 0..kd {
            crate::ops::axpy(oh, qh[i] * scale, &st[i * vd..(i + 1) * vd]);
        }
    }
}

/// [`kda_step`] fused: per head, pass 1 only reads the state, u = Σ_i (k_i e^{g_i}) S_i (= the
/// decayed Sᵀk); then δ = β(v − u); pass 2 rewrites each row once, S_i ← e^{g_i} S_i + k_i δ, and
/// accumulates o += (scale q_i) S_i while the row is in L1. One read of the state from the outer
/// caches and one write (the 18 KDA layers of the 370M model hold 9.4 MB of state, more than L2).
/// Heads run on `threads` pool threads.
///
/// # Shapes
/// q, k, g: [H, K]; v: [H, V]; beta: [H]; s: [H, K, V]; o: [H, V]
#[allow(clippy::too_many_arguments)]
pub fn kda_step_fused(
    o: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    s: &mut [f32],
    kd: usize,
    vd: usize,
    threads: usize,
) {
    let h = beta.len();
    let threads = if h * kd * vd < 1 << 14 { 1 } else { threads };
    let (sp, op) = (crate::attention::OutPtr(s.as_mut_ptr()), crate::attention::OutPtr(o.as_mut_ptr()));
    let isa = crate::qgemm::Isa::best();
    crate::threads::Pool::global().run(threads, h, &|hh| {
        // SAFETY: head hh owns state rows [hh·K·V, (hh+1)·K·V) and outputs [hh·V, (hh+1)·V).
        let st = unsafe { sp.slice(hh * kd * vd, kd * vd) };
        let oh = unsafe { op.slice(hh * vd, vd) };
        let (qh, kh, gh) = (&q[hh * kd..(hh + 1) * kd], &k[hh * kd..(hh + 1) * kd], &g[hh * kd..(hh + 1) * kd]);
        kda_step_head(isa, oh, qh, kh, &v[hh * vd..(hh + 1) * vd], gh, beta[hh], st);
    });
}

/// One head of [`kda_step_fused`] (the engine's fused decode layer calls it per head): the SIMD
/// register step where `isa` and the shape allow, else the two-pass loop. `scale = K^-0.5`.
///
/// # Shapes
/// q, k, g: [K]; v, o: [V]; st: [K, V]
#[allow(clippy::too_many_arguments)]
pub fn kda_step_head(
    isa: crate::qgemm::Isa,
    o: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: f32,
    st: &mut [f32],
) {
    let (kd, vd) = (k.len(), v.len());
    let scale = 1.0 / (kd as f32).sqrt();
    let decay: Vec<f32> = g.iter().map(|g| g.exp()).collect(); // [K]
    if !crate::ops::reference_arithmetic() && step_head_simd(isa, st, k, &decay, q, scale, v, beta, o) {
        return;
    }
    let mut u = vec![0f32; vd];
    for (i, row) in st.chunks_exact(vd).enumerate() {
        crate::ops::axpy(&mut u, k[i] * decay[i], row);
    }
    for (uj, &vj) in u.iter_mut().zip(v) {
        *uj = beta * (vj - *uj);
    }
    o.iter_mut().for_each(|x| *x = 0.0);
    for (i, row) in st.chunks_exact_mut(vd).enumerate() {
        let a = decay[i];
        row.iter_mut().for_each(|x| *x *= a);
        crate::ops::axpy(row, k[i], &u);
        crate::ops::axpy(o, q[i] * scale, row);
    }
}

/// One head of [`kda_step_fused`] with u and o held in registers (V a multiple of 16): the value
/// columns in blocks (AVX-512F: 128, then 16; AVX2 + FMA: 32, then 16), each block's pass 1
/// (u = Σ_i k_i e^{g_i} S_i) and pass 2 (S_i ← e^{g_i} S_i + k_i δ, o += scale q_i S_i) over
/// every row before the next block; columns never mix, so the blocks are independent. Returns
/// false (nothing done) where the CPU or the shape has no such path.
///
/// # Shapes
/// st: [K, V]; k, decay, q: [K]; v, o: [V]
#[allow(clippy::too_many_arguments)]
fn step_head_simd(
    isa: crate::qgemm::Isa,
    st: &mut [f32],
    k: &[f32],
    decay: &[f32],
    q: &[f32],
    scale: f32,
    v: &[f32],
    beta: f32,
    o: &mut [f32],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::qgemm::Isa;
        let vd = v.len();
        let avx512 = isa >= Isa::Avx512 && Isa::Avx512.supported();
        let avx2 = isa >= Isa::Avx2 && Isa::Avx2.supported();
        if vd.is_multiple_of(16) && (avx512 || avx2) {
            let kd = k.len();
            assert!(st.len() == kd * vd && decay.len() == kd && q.len() == kd && o.len() == vd);
            let rows = Rows { st: st.as_mut_ptr(), vd, k, decay, q, scale, beta };
            let mut j = 0;
            // SAFETY: the ISA of each branch is present (checked above); every block lies inside
            // its row (j + width ≤ V) and st, v, o have the lengths asserted above.
            unsafe {
                if !avx512 {
                    while j + 32 <= vd {
                        x86::step_block256::<4>(&rows, j, v.as_ptr().add(j), o.as_mut_ptr().add(j));
                        j += 32;
                    }
                    if j < vd {
                        x86::step_block256::<2>(&rows, j, v.as_ptr().add(j), o.as_mut_ptr().add(j));
                    }
                    return true;
                }
                while j + 128 <= vd {
                    x86::step_block::<8>(&rows, j, v.as_ptr().add(j), o.as_mut_ptr().add(j));
                    j += 128;
                }
                while j < vd {
                    x86::step_block::<1>(&rows, j, v.as_ptr().add(j), o.as_mut_ptr().add(j));
                    j += 16;
                }
            }
            return true;
        }
    }
    let _ = (isa, st, k, decay, q, scale, v, beta, o);
    false
}

/// One head's state and per-row factors for [`x86::step_block`].
#[cfg(target_arch = "x86_64")]
struct Rows<'a> {
    st: *mut f32,
    vd: usize,
    k: &'a [f32],
    /// e^{g_i}
    decay: &'a [f32],
    q: &'a [f32],
    scale: f32,
    beta: f32,
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Columns j..j + 16·NV of one head's step (see `step_head_simd`).
    ///
    /// # Safety
    /// AVX-512F; columns j..j + 16·NV lie inside every row of `r.st`; v and o hold 16·NV values.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn step_block<const NV: usize>(r: &super::Rows, j: usize, v: *const f32, o: *mut f32) {
        let row = |i: usize| r.st.add(i * r.vd + j);
        let mut u = [_mm512_setzero_ps(); NV];
        for (i, (&k, &a)) in r.k.iter().zip(r.decay).enumerate() {
            let (p, c) = (row(i), _mm512_set1_ps(k * a));
            for (n, un) in u.iter_mut().enumerate() {
                *un = _mm512_fmadd_ps(c, _mm512_loadu_ps(p.add(16 * n)), *un);
            }
        }
        let b = _mm512_set1_ps(r.beta);
        // δ = β (v − u)
        for (n, un) in u.iter_mut().enumerate() {
            *un = _mm512_mul_ps(b, _mm512_sub_ps(_mm512_loadu_ps(v.add(16 * n)), *un));
        }
        let mut acc = [_mm512_setzero_ps(); NV];
        for i in 0..r.k.len() {
            let p = row(i);
            let (a, k, q) = (_mm512_set1_ps(r.decay[i]), _mm512_set1_ps(r.k[i]), _mm512_set1_ps(r.scale * r.q[i]));
            for n in 0..NV {
                let s = _mm512_fmadd_ps(a, _mm512_loadu_ps(p.add(16 * n)), _mm512_mul_ps(k, u[n]));
                _mm512_storeu_ps(p.add(16 * n), s);
                acc[n] = _mm512_fmadd_ps(q, s, acc[n]);
            }
        }
        for (n, an) in acc.iter().enumerate() {
            _mm512_storeu_ps(o.add(16 * n), *an);
        }
    }

    /// [`step_block`] in AVX2 + FMA: columns j..j + 8·NV (NV = 4, u and o in eight of the 16
    /// registers; a 16-column tail with NV = 2).
    ///
    /// # Safety
    /// AVX2 and FMA; columns j..j + 8·NV lie inside every row of `r.st`; v and o hold 8·NV values.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn step_block256<const NV: usize>(r: &super::Rows, j: usize, v: *const f32, o: *mut f32) {
        let row = |i: usize| r.st.add(i * r.vd + j);
        let mut u = [_mm256_setzero_ps(); NV];
        for (i, (&k, &a)) in r.k.iter().zip(r.decay).enumerate() {
            let (p, c) = (row(i), _mm256_set1_ps(k * a));
            for (n, un) in u.iter_mut().enumerate() {
                *un = _mm256_fmadd_ps(c, _mm256_loadu_ps(p.add(8 * n)), *un);
            }
        }
        let b = _mm256_set1_ps(r.beta);
        // δ = β (v − u)
        for (n, un) in u.iter_mut().enumerate() {
            *un = _mm256_mul_ps(b, _mm256_sub_ps(_mm256_loadu_ps(v.add(8 * n)), *un));
        }
        let mut acc = [_mm256_setzero_ps(); NV];
        for i in 0..r.k.len() {
            let p = row(i);
            let (a, k, q) = (_mm256_set1_ps(r.decay[i]), _mm256_set1_ps(r.k[i]), _mm256_set1_ps(r.scale * r.q[i]));
            for n in 0..NV {
                let s = _mm256_fmadd_ps(a, _mm256_loadu_ps(p.add(8 * n)), _mm256_mul_ps(k, u[n]));
                _mm256_storeu_ps(p.add(8 * n), s);
                acc[n] = _mm256_fmadd_ps(q, s, acc[n]);
            }
        }
        for (n, an) in acc.iter().enumerate() {
            _mm256_storeu_ps(o.add(8 * n), *an);
        }
    }
}

/// The token-by-token reference over T tokens.
pub fn kda_recurrent_ref(
    o: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    s: &mut [f32],
    h: usize,
    kd: usize,
    vd: usize,
) {
    let t = beta.len() / h;
    for r in 0..t {
        let (a, b) = (r * h * kd, (r + 1) * h * kd);
        let (c, d) = (r * h * vd, (r + 1) * h * vd);
        kda_step(&mut o[c..d], &q[a..b], &k[a..b], &v[c..d], &g[a..b], &beta[r * h..(r + 1) * h], s, kd, vd);
    }
}

/// The chunked WY form (KL-TR Eqs. 2–9), chunk size `chunk`, any T (the last chunk may be short).
/// Within a chunk of length L, with G the inclusive cumulative log-decay:
///
/// ```text
/// A[c,i] = β_c Σ_d k_c k_i e^{G_c−G_i} (c > i);  U = (I+A)⁻¹(β⊙V);  W = (I+A)⁻¹(β⊙K⊙e^G)
/// V' = U − W S;  O = (Q⊙e^G) S + Aqk V'  with Aqk[c,j] = Σ_d q_c k_j e^{G_c−G_j} (j ≤ c)
/// S ← e^{G_last} ⊙ S + (K ⊙ e^{G_last − G})ᵀ V'
/// ```
///
/// Heads one after another, every decay weight its own exp (the reference for
/// [`kda_chunk_parallel`]).
///
/// # Shapes
/// q, k, g: [T, H, K]; v: [T, H, V]; beta: [T, H]; s: [H, K, V]; o: [T, H, V]
#[allow(clippy::too_many_arguments)]
pub fn kda_chunk(
    o: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    s: &mut [f32],
    h: usize,
    kd: usize,
    vd: usize,
    chunk: usize,
) {
    let t = beta.len() / h;
    for hh in 0..h {
        let st = &mut s[hh * kd * vd..(hh + 1) * kd * vd];
        chunk_head_ref(
            &mut |c, row: &[f32]| o[(c * h + hh) * vd..(c * h + hh + 1) * vd].copy_from_slice(row),
            q,
            k,
            v,
            g,
            beta,
            st,
            (t, h, hh),
            kd,
            vd,
            chunk,
        );
    }
}

/// The engine's chunked prefill: the same chunked form as [`kda_chunk`] (its reference), with the
/// decay-weighted products computed as dot products of pre-decayed rows, sub-chunk by sub-chunk
/// ([`chunk_head_fast`]), SIMD, and the heads spread over `threads` pool threads. Each head's
/// arithmetic does not depend on the thread count, so every thread count gives the same bits.
///
/// # Shapes
/// q, k, g: [T, H, K]; v: [T, H, V]; beta: [T, H]; s: [H, K, V]; o: [T, H, V]
pub fn kda_chunk_parallel(
    o: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    s: &mut [f32],
    h: usize,
    kd: usize,
    vd: usize,
    chunk: usize,
    threads: usize,
) {
    let t = beta.len() / h;
    let inputs = HeadInputs { q, k, v, g, beta, t, h, kd, vd, chunk };
    let (sp, op) = (crate::attention::OutPtr(s.as_mut_ptr()), crate::attention::OutPtr(o.as_mut_ptr()));
    crate::threads::Pool::global().run(threads.max(1).min(h), h, &|hh| {
        // SAFETY: head hh owns state rows [hh·K·V, (hh+1)·K·V) and, at every position c, the
        // output row [(c·H + hh)·V, (c·H + hh + 1)·V); no two tasks share an element.
        let st = unsafe { sp.slice(hh * kd * vd, kd * vd) };
        let mut put = |c: usize, row: &[f32]| unsafe { op.slice((c * h + hh) * vd, vd) }.copy_from_slice(row);
        chunk_head_fast(&mut put, &inputs, st, hh);
    });
}

/// One head of the chunked form over all T positions: `put(c, o_c)` receives each output row.
#[allow(clippy::too_many_arguments)]
fn chunk_head_ref(
    put: &mut dyn FnMut(usize, &[f32]),
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    st: &mut [f32],
    (t, h, hh): (usize, usize, usize),
    kd: usize,
    vd: usize,
    chunk: usize,
) {
    let scale = 1.0 / (kd as f32).sqrt();
    let mut out = vec![0f32; vd];
    let mut start = 0;
    while start < t {
        let l = chunk.min(t - start);
        // Gather this head's rows of the chunk: [L, K] and [L, V].
        let row_k = |x: &[f32], c: usize| -> Vec<f32> {
            x[((start + c) * h + hh) * kd..((start + c) * h + hh + 1) * kd].to_vec()
        };
        let qs: Vec<Vec<f32>> = (0..l).map(|c| row_k(q, c).iter().map(|x| x * scale).collect()).collect();
        let ks: Vec<Vec<f32>> = (0..l).map(|c| row_k(k, c)).collect();
        let vs: Vec<&[f32]> =
            (0..l).map(|c| &v[((start + c) * h + hh) * vd..((start + c) * h + hh + 1) * vd]).collect();
        let bs: Vec<f32> = (0..l).map(|c| beta[(start + c) * h + hh]).collect();
        let mut gc: Vec<Vec<f32>> = (0..l).map(|c| row_k(g, c)).collect();
        for c in 1..l {
            for d in 0..kd {
                gc[c][d] += gc[c - 1][d];
            }
        }
        let pair = |x: &[f32], c: usize, j: usize| -> f32 {
            (0..kd).map(|d| x[d] * ks[j][d] * (gc[c][d] - gc[j][d]).exp()).sum()
        };
        // U and W by forward substitution with the unit lower (I + A).
        let mut u = vec![vec![0f32; vd]; l];
        let mut w = vec![vec![0f32; kd]; l];
        for c in 0..l {
            u[c] = vs[c].iter().map(|x| x * bs[c]).collect();
            w[c] = (0..kd).map(|d| ks[c][d] * bs[c] * gc[c][d].exp()).collect();
            for i in 0..c {
                let a = bs[c] * pair(&ks[c], c, i);
                let (ui, wi) = (u[i].clone(), w[i].clone());
                crate::ops::axpy(&mut u[c], -a, &ui);
                crate::ops::axpy(&mut w[c], -a, &wi);
            }
        }
        // V' = U − W S
        for c in 0..l {
            for i in 0..kd {
                let wc = w[c][i];
                for x in 0..vd {
                    u[c][x] -= wc * st[i * vd + x];
                }
            }
        }
        // O = (Q ⊙ e^G) S + Aqk V'
        for c in 0..l {
            out.iter_mut().for_each(|x| *x = 0.0);
            for i in 0..kd {
                crate::ops::axpy(&mut out, qs[c][i] * gc[c][i].exp(), &st[i * vd..(i + 1) * vd]);
            }
            for j in 0..=c {
                crate::ops::axpy(&mut out, pair(&qs[c], c, j), &u[j]);
            }
            put(start + c, &out);
        }
        // S ← e^{G_last} ⊙ S + (K ⊙ e^{G_last − G})ᵀ V'
        let gl = &gc[l - 1];
        for i in 0..kd {
            let row = &mut st[i * vd..(i + 1) * vd];
            let a = gl[i].exp();
            row.iter_mut().for_each(|x| *x *= a);
            for c in 0..l {
                crate::ops::axpy(row, ks[c][i] * (gl[i] - gc[c][i]).exp(), &u[c]);
            }
        }
        start += l;
    }
}

/// Sub-chunk length of [`chunk_head_fast`]'s decay factorisation.
const SUB: usize = 16;
/// Largest per-channel span of G inside one sub-chunk for which the midpoint factorisation is
/// used (each factor then stays within e^{±75}, normal f32); wider sub-chunks take an exp per pair.
const MAX_SPAN: f32 = 150.0;

/// Scratch for one head's chunks, allocated once per call.
struct ChunkScratch {
    qs: Vec<f32>,  // [L, K] q · scale
    ks: Vec<f32>,  // [L, K]
    gc: Vec<f32>,  // [L, K] cumulative log-decay within the chunk
    lq: Vec<f32>,  // [SUB, K] q_c ⊙ e^{G_c − ref}
    lk: Vec<f32>,  // [SUB, K] k_c ⊙ e^{G_c − ref}
    rk: Vec<f32>,  // [L, K]   k_j ⊙ e^{ref − G_j}
    akk: Vec<f32>, // [L, L] Σ_d k_c k_j e^{G_c−G_j}, c > j
    aqk: Vec<f32>, // [L, L] Σ_d q_c k_j e^{G_c−G_j}, c ≥ j
    u: Vec<f32>,   // [L, V]
    w: Vec<f32>,   // [L, K]
    e: Vec<f32>,   // [max(K, L)] per-channel midpoints; forward-substitution coefficients
    qg: Vec<f32>,  // [L, K] q ⊙ e^G
    o: Vec<f32>,   // [L, V] outputs
    kdt: Vec<f32>, // [K, L] (k ⊙ e^{G_last − G})ᵀ
}

/// One head of the chunked form, fast: the same equations as [`chunk_head_ref`], but the
/// decay-weighted products A[c,j] and Aqk[c,j] come from dot products of rows decayed once each,
/// never from an exp per (c, j, d). For a query sub-chunk [b0, b1) of 16 positions:
/// ```text
/// j < b0 (earlier sub-chunks), r = b0 − 1:   e^{G_c−G_j} = e^{G_c−G_r} · e^{G_r−G_j}   (both ≤ 1)
/// b0 ≤ j ≤ c (same sub-chunk), z = (G_b0 + G_{b1−1}) / 2 per channel:
///                                            e^{G_c−G_j} = e^{G_c−z} · e^{z−G_j}       (both ≤ e^{span/2})
/// ```
/// The first split cannot overflow, and a factor underflows only where the product is below f32's
/// range anyway. The second is used only while the sub-chunk's span G_b0 − G_{b1−1} ≤ 150 in
/// every channel (always, under a lower-bound gate of −5); past it that block takes exp per pair.
///
/// Its element-wise loops (the decays, gathers and scalings, about half its time) are compiled
/// twice: for the baseline and, taken where the CPU has them, for AVX2 + FMA. Rust never fuses a
/// multiply and an add on its own, so both give the same bits.
fn chunk_head_fast(put: &mut dyn FnMut(usize, &[f32]), x: &HeadInputs, st: &mut [f32], hh: usize) {
    #[cfg(target_arch = "x86_64")]
    if crate::qgemm::Isa::best() >= crate::qgemm::Isa::Avx2 {
        /// # Safety
        /// The CPU must support AVX2 and FMA.
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2(put: &mut dyn FnMut(usize, &[f32]), x: &HeadInputs, st: &mut [f32], hh: usize) {
            chunk_head_body(put, x, st, hh)
        }
        // SAFETY: Isa::Avx2 is only chosen where the CPU has AVX2 and FMA.
        return unsafe { avx2(put, x, st, hh) };
    }
    chunk_head_body(put, x, st, hh)
}

/// What every head of [`kda_chunk_parallel`] reads: q, k, g: [T, H, K]; v: [T, H, V]; beta: [T, H].
#[derive(Clone, Copy)]
struct HeadInputs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    beta: &'a [f32],
    t: usize,
    h: usize,
    kd: usize,
    vd: usize,
    chunk: usize,
}

/// [`chunk_head_fast`]'s body for head hh, inlined into each of its compilations.
#[inline(always)]
fn chunk_head_body(put: &mut dyn FnMut(usize, &[f32]), x: &HeadInputs, st: &mut [f32], hh: usize) {
    let HeadInputs { q, k, v, g, beta, t, h, kd, vd, chunk } = *x;
    use crate::ops::{dot, exp_fast, matmul_acc};
    let scale = 1.0 / (kd as f32).sqrt();
    let n = chunk;
    let mut z = ChunkScratch {
        qs: vec![0.0; n * kd],
        ks: vec![0.0; n * kd],
        gc: vec![0.0; n * kd],
        lq: vec![0.0; SUB * kd],
        lk: vec![0.0; SUB * kd],
        rk: vec![0.0; n * kd],
        akk: vec![0.0; n * n],
        aqk: vec![0.0; n * n],
        u: vec![0.0; n * vd],
        w: vec![0.0; n * kd],
        e: vec![0.0; kd.max(n)],
        qg: vec![0.0; n * kd],
        o: vec![0.0; n * vd],
        kdt: vec![0.0; kd * n],
    };
    let row = |pos: usize, d: usize| (pos * h + hh) * d..(pos * h + hh + 1) * d;
    let mut start = 0;
    while start < t {
        let l = chunk.min(t - start);
        // Gather the chunk's rows; G = cumsum(g) within the chunk.
        for c in 0..l {
            let (dst, src) = (c * kd..(c + 1) * kd, row(start + c, kd));
            z.qs[dst.clone()].iter_mut().zip(&q[src.clone()]).for_each(|(a, b)| *a = b * scale);
            z.ks[dst.clone()].copy_from_slice(&k[src.clone()]);
            z.gc[dst.clone()].copy_from_slice(&g[src]);
            if c > 0 {
                let (prev, cur) = z.gc.split_at_mut(c * kd);
                cur[..kd].iter_mut().zip(&prev[(c - 1) * kd..]).for_each(|(a, b)| *a += b);
            }
        }
        z.aqk[..l * l].fill(0.0); // Aqk [L, L], stride L: zero above the diagonal
                                  // A and Aqk, one query sub-chunk at a time.
        for b0 in (0..l).step_by(SUB) {
            let b1 = (b0 + SUB).min(l);
            // Earlier sub-chunks, through r = b0 − 1.
            if b0 > 0 {
                let r = (b0 - 1) * kd;
                for c in b0..b1 {
                    let lo = c * kd;
                    for d in 0..kd {
                        let f = exp_fast(z.gc[lo + d] - z.gc[r + d]);
                        z.lq[(c - b0) * kd + d] = z.qs[lo + d] * f;
                        z.lk[(c - b0) * kd + d] = z.ks[lo + d] * f;
                    }
                }
                for j in 0..b0 {
                    for d in 0..kd {
                        z.rk[j * kd + d] = z.ks[j * kd + d] * exp_fast(z.gc[r + d] - z.gc[j * kd + d]);
                    }
                }
                for c in b0..b1 {
                    let (lq, lk) = (&z.lq[(c - b0) * kd..(c - b0 + 1) * kd], &z.lk[(c - b0) * kd..(c - b0 + 1) * kd]);
                    for j in 0..b0 {
                        let rj = &z.rk[j * kd..(j + 1) * kd];
                        z.akk[c * n + j] = dot(lk, rj);
                        z.aqk[c * l + j] = dot(lq, rj);
                    }
                }
            }
            // The sub-chunk itself, through the per-channel midpoint z.
            let (first, last) = (b0 * kd, (b1 - 1) * kd);
            let span = (0..kd).map(|d| z.gc[first + d] - z.gc[last + d]).fold(0f32, f32::max);
            if span <= MAX_SPAN {
                for d in 0..kd {
                    z.e[d] = 0.5 * (z.gc[first + d] + z.gc[last + d]);
                }
                for c in b0..b1 {
                    for d in 0..kd {
                        let (f, i) = (exp_fast(z.gc[c * kd + d] - z.e[d]), (c - b0) * kd + d);
                        z.lq[i] = z.qs[c * kd + d] * f;
                        z.lk[i] = z.ks[c * kd + d] * f;
                        z.rk[c * kd + d] = z.ks[c * kd + d] * exp_fast(z.e[d] - z.gc[c * kd + d]);
                    }
                }
                for c in b0..b1 {
                    let (lq, lk) = (&z.lq[(c - b0) * kd..(c - b0 + 1) * kd], &z.lk[(c - b0) * kd..(c - b0 + 1) * kd]);
                    for j in b0..=c {
                        let rj = &z.rk[j * kd..(j + 1) * kd];
                        z.aqk[c * l + j] = dot(lq, rj);
                        if j < c {
                            z.akk[c * n + j] = dot(lk, rj);
                        }
                    }
                }
            } else {
                for c in b0..b1 {
                    for j in b0..=c {
                        let (mut sk, mut sq) = (0f32, 0f32);
                        for d in 0..kd {
                            let kj = z.ks[j * kd + d] * exp_fast(z.gc[c * kd + d] - z.gc[j * kd + d]);
                            sk += z.ks[c * kd + d] * kj;
                            sq += z.qs[c * kd + d] * kj;
                        }
                        z.aqk[c * l + j] = sq;
                        if j < c {
                            z.akk[c * n + j] = sk;
                        }
                    }
                }
            }
        }
        // U = (I+A)⁻¹(β⊙V), W = (I+A)⁻¹(β⊙K⊙e^G) by forward substitution: row c gets
        // −β_c · A[c, :c] times the rows already solved.
        for c in 0..l {
            let b = beta[(start + c) * h + hh];
            z.u[c * vd..(c + 1) * vd].iter_mut().zip(&v[row(start + c, vd)]).for_each(|(a, x)| *a = b * x);
            for d in 0..kd {
                z.w[c * kd + d] = b * z.ks[c * kd + d] * exp_fast(z.gc[c * kd + d]);
            }
            for i in 0..c {
                z.e[i] = -b * z.akk[c * n + i];
            }
            let (u_done, u_c) = z.u.split_at_mut(c * vd);
            let (w_done, w_c) = z.w.split_at_mut(c * kd);
            matmul_acc(&mut u_c[..vd], &z.e[..c], u_done, 1, c, vd);
            matmul_acc(&mut w_c[..kd], &z.e[..c], w_done, 1, c, kd);
        }
        // V' = U − W S
        z.w[..l * kd].iter_mut().for_each(|x| *x = -*x);
        matmul_acc(&mut z.u[..l * vd], &z.w[..l * kd], st, l, kd, vd);
        // O = (Q ⊙ e^G) S + Aqk V'
        for i in 0..l * kd {
            z.qg[i] = z.qs[i] * exp_fast(z.gc[i]);
        }
        z.o[..l * vd].fill(0.0);
        matmul_acc(&mut z.o[..l * vd], &z.qg[..l * kd], st, l, kd, vd);
        matmul_acc(&mut z.o[..l * vd], &z.aqk[..l * l], &z.u[..l * vd], l, l, vd);
        for c in 0..l {
            put(start + c, &z.o[c * vd..(c + 1) * vd]);
        }
        // S ← e^{G_last} ⊙ S + (K ⊙ e^{G_last − G})ᵀ V'
        let gl = (l - 1) * kd;
        // The decayed keys row by row (vectorised), in qg's space, then transposed.
        for c in 0..l {
            for i in 0..kd {
                z.qg[c * kd + i] = z.ks[c * kd + i] * exp_fast(z.gc[gl + i] - z.gc[c * kd + i]);
            }
        }
        for i in 0..kd {
            let a = exp_fast(z.gc[gl + i]);
            st[i * vd..(i + 1) * vd].iter_mut().for_each(|x| *x *= a);
            for c in 0..l {
                z.kdt[i * l + c] = z.qg[c * kd + i];
            }
        }
        matmul_acc(st, &z.kdt[..kd * l], &z.u[..l * vd], kd, l, vd);
        start += l;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_close_ratio, Rng, Tol};

    fn inputs(t: usize, h: usize, kd: usize, vd: usize, decay: f32, seed: u64) -> [Vec<f32>; 6] {
        let mut r = Rng::new(seed);
        let q = r.normals(t * h * kd, 1.0);
        let mut k = r.normals(t * h * kd, 1.0);
        crate::ops::l2norm_inplace(&mut k, kd, 1e-6);
        let v = r.normals(t * h * vd, 1.0);
        let g: Vec<f32> = (0..t * h * kd).map(|_| -r.uniform() * decay).collect();
        let beta: Vec<f32> = (0..t * h).map(|_| r.uniform()).collect();
        let s0 = r.normals(h * kd * vd, 0.1);
        [q, k, v, g, beta, s0]
    }

    #[test]
    fn fused_step_matches_the_reference_step() {
        for &(h, kd, vd, threads) in &[(2, 16, 24, 1), (3, 64, 64, 2), (8, 128, 128, 2), (2, 32, 144, 2)] {
            let t = 6;
            let [q, k, v, g, beta, s0] = inputs(t, h, kd, vd, 0.5, (h * kd) as u64);
            let (mut s1, mut s2) = (s0.clone(), s0);
            for r in 0..t {
                let (a, b) = (r * h * kd, (r + 1) * h * kd);
                let (c, d) = (r * h * vd, (r + 1) * h * vd);
                let (mut o1, mut o2) = (vec![0.0; h * vd], vec![1.0; h * vd]);
                let bt = &beta[r * h..(r + 1) * h];
                kda_step(&mut o1, &q[a..b], &k[a..b], &v[c..d], &g[a..b], bt, &mut s1, kd, vd);
                kda_step_fused(&mut o2, &q[a..b], &k[a..b], &v[c..d], &g[a..b], bt, &mut s2, kd, vd, threads);
                assert_close_ratio(&format!("o H={h} K={kd} step {r}"), &o2, &o1, Tol::KDA_CHUNK);
            }
            assert_close_ratio(&format!("S H={h} K={kd}"), &s2, &s1, Tol::KDA_CHUNK);
        }
    }

    #[test]
    fn head_step_matches_the_reference_on_every_simd_path() {
        use crate::qgemm::Isa;
        for &(kd, vd) in &[(128, 128), (32, 144), (16, 48)] {
            let [q, k, v, g, beta, s0] = inputs(1, 1, kd, vd, 0.5, vd as u64);
            let (mut o1, mut s1) = (vec![0.0; vd], s0.clone());
            kda_step(&mut o1, &q, &k, &v, &g, &beta, &mut s1, kd, vd);
            let decay: Vec<f32> = g.iter().map(|x| x.exp()).collect();
            let scale = 1.0 / (kd as f32).sqrt();
            for isa in Isa::available() {
                let (mut o2, mut s2) = (vec![f32::NAN; vd], s0.clone());
                if step_head_simd(isa, &mut s2, &k, &decay, &q, scale, &v, beta[0], &mut o2) {
                    assert_close_ratio(&format!("o {} K={kd} V={vd}", isa.name()), &o2, &o1, Tol::KDA_CHUNK);
                    assert_close_ratio(&format!("S {} K={kd} V={vd}", isa.name()), &s2, &s1, Tol::KDA_CHUNK);
                } else {
                    assert!(isa < Isa::Avx2, "{} has a register-held step", isa.name());
                }
            }
        }
    }

    #[test]
    fn chunk_matches_recurrent() {
        for &(t, chunk, decay) in &[(1, 64, 0.5), (50, 64, 0.5), (130, 64, 0.5), (97, 16, 0.5), (128, 64, 10.0)] {
            let (h, kd, vd) = (2, 16, 24);
            let [q, k, v, g, beta, s0] = inputs(t, h, kd, vd, decay, t as u64);
            let (mut o1, mut s1) = (vec![0.0; t * h * vd], s0.clone());
            let (mut o2, mut s2) = (vec![0.0; t * h * vd], s0);
            kda_recurrent_ref(&mut o1, &q, &k, &v, &g, &beta, &mut s1, h, kd, vd);
            kda_chunk(&mut o2, &q, &k, &v, &g, &beta, &mut s2, h, kd, vd, chunk);
            assert!(o2.iter().all(|x| x.is_finite()));
            assert_close_ratio(&format!("o T={t} C={chunk}"), &o2, &o1, Tol::KDA_CHUNK);
            assert_close_ratio(&format!("S T={t} C={chunk}"), &s2, &s1, Tol::KDA_CHUNK);
        }
    }

    #[test]
    fn fast_chunk_matches_the_reference_chunk_and_the_recurrence() {
        // decay 5: the per-channel midpoint split; decay 25: sub-chunk spans (≈ 15 × 12.5) past
        // 150, where a block falls back to an exp per pair, and chunks decay below f32's range.
        for &(t, h, kd, vd, chunk, decay) in &[
            (1, 2, 16, 24, 64, 0.5),
            (50, 2, 16, 24, 64, 0.5),
            (130, 2, 16, 24, 64, 0.5),
            (97, 3, 16, 24, 16, 0.5),
            (200, 2, 128, 128, 64, 0.5),
            (128, 2, 16, 24, 64, 5.0),
            (128, 2, 16, 24, 64, 25.0),
        ] {
            let [q, k, v, g, beta, s0] = inputs(t, h, kd, vd, decay, 31 + t as u64);
            let (mut o1, mut s1) = (vec![0.0; t * h * vd], s0.clone());
            let (mut o2, mut s2) = (vec![0.0; t * h * vd], s0.clone());
            let (mut o3, mut s3) = (vec![0.0; t * h * vd], s0);
            kda_chunk(&mut o1, &q, &k, &v, &g, &beta, &mut s1, h, kd, vd, chunk);
            kda_chunk_parallel(&mut o2, &q, &k, &v, &g, &beta, &mut s2, h, kd, vd, chunk, 1);
            kda_recurrent_ref(&mut o3, &q, &k, &v, &g, &beta, &mut s3, h, kd, vd);
            assert!(o2.iter().chain(&s2).all(|x| x.is_finite()), "T={t} decay {decay}");
            let what = format!("T={t} K={kd} C={chunk} decay {decay}");
            assert_close_ratio(&format!("o vs chunk ref, {what}"), &o2, &o1, Tol::KDA_CHUNK);
            assert_close_ratio(&format!("S vs chunk ref, {what}"), &s2, &s1, Tol::KDA_CHUNK);
            assert_close_ratio(&format!("o vs recurrence, {what}"), &o2, &o3, Tol::KDA_CHUNK);
            assert_close_ratio(&format!("S vs recurrence, {what}"), &s2, &s3, Tol::KDA_CHUNK);
        }
    }

    #[test]
    fn parallel_chunked_prefill_gives_the_same_bits_at_every_thread_count() {
        for &(t, h, threads) in &[(70, 4, 2), (33, 3, 4), (5, 1, 2)] {
            let (kd, vd) = (16, 24);
            let [q, k, v, g, beta, s0] = inputs(t, h, kd, vd, 0.5, 9 + t as u64);
            let (mut o1, mut s1) = (vec![0.0; t * h * vd], s0.clone());
            let (mut o2, mut s2) = (vec![0.0; t * h * vd], s0);
            kda_chunk_parallel(&mut o1, &q, &k, &v, &g, &beta, &mut s1, h, kd, vd, 16, 1);
            kda_chunk_parallel(&mut o2, &q, &k, &v, &g, &beta, &mut s2, h, kd, vd, 16, threads);
            assert_eq!(o1, o2, "outputs, T={t} H={h}");
            assert_eq!(s1, s2, "states, T={t} H={h}");
        }
    }
}
