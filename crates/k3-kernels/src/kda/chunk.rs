//! The chunked WY form of the KDA delta rule (prefill): [`kda_chunk`], the equations as they
//! read, and [`kda_chunk_parallel`], the engine's form (decay-weighted products as SIMD dots of
//! pre-decayed rows, heads in parallel). Layouts as in the parent module.

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
    w: Vec<f32>,   // [L, K] −K ⊙ e^G
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
        // V' = U − W S with U = (I+A)⁻¹(β⊙V), W = (I+A)⁻¹(β⊙K⊙e^G) is (I+A)⁻¹ X with
        // X = β ⊙ (V − (K⊙e^G) S): one product with S over the chunk, then a single forward
        // substitution (row c gets −β_c · A[c, :c] times the rows already solved), which never
        // forms W.
        for i in 0..l * kd {
            let e = exp_fast(z.gc[i]);
            z.qg[i] = z.qs[i] * e;
            z.w[i] = -z.ks[i] * e;
        }
        for c in 0..l {
            z.u[c * vd..(c + 1) * vd].copy_from_slice(&v[row(start + c, vd)]);
        }
        matmul_acc(&mut z.u[..l * vd], &z.w[..l * kd], st, l, kd, vd);
        for c in 0..l {
            let b = beta[(start + c) * h + hh];
            z.u[c * vd..(c + 1) * vd].iter_mut().for_each(|x| *x *= b);
            for i in 0..c {
                z.e[i] = -b * z.akk[c * n + i];
            }
            let (u_done, u_c) = z.u.split_at_mut(c * vd);
            matmul_acc(&mut u_c[..vd], &z.e[..c], u_done, 1, c, vd);
        }
        // O = (Q ⊙ e^G) S + Aqk V'
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
