//! The KDA delta rule in pure Rust (architecture.md §1(a), §1(e)), mirroring fla's trio:
//! - [`kda_recurrent_ref`]: the specification, a per-token loop;
//! - [`kda_step`]: one token, in place on the state (decode), written as the equations read;
//! - [`kda_step_fused`]: the same step in two passes over the state instead of four, SIMD,
//!   heads in parallel (the engine's decode path);
//! - [`kda_chunk`]: the chunked WY form for prefill; exp is only taken of G_c − G_j ≤ 0.
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

/// [`kda_step`] fused: per head, pass 1 decays each state row and accumulates u = Sᵀk in the same
/// sweep; then δ = β(v − u); pass 2 adds k_i δ to each row and accumulates o += (scale q_i) S_i
/// while the row is in cache. Heads run on `threads` pool threads.
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
    let scale = 1.0 / (kd as f32).sqrt();
    let threads = if h * kd * vd < 1 << 14 { 1 } else { threads };
    let (sp, op) = (crate::attention::OutPtr(s.as_mut_ptr()), crate::attention::OutPtr(o.as_mut_ptr()));
    crate::threads::Pool::global().run(threads, h, &|hh| {
        // SAFETY: head hh owns state rows [hh·K·V, (hh+1)·K·V) and outputs [hh·V, (hh+1)·V).
        let st = unsafe { sp.slice(hh * kd * vd, kd * vd) };
        let oh = unsafe { op.slice(hh * vd, vd) };
        let (qh, kh, gh) = (&q[hh * kd..(hh + 1) * kd], &k[hh * kd..(hh + 1) * kd], &g[hh * kd..(hh + 1) * kd]);
        let mut u = vec![0f32; vd];
        for i in 0..kd {
            let row = &mut st[i * vd..(i + 1) * vd];
            let a = gh[i].exp();
            row.iter_mut().for_each(|x| *x *= a);
            crate::ops::axpy(&mut u, kh[i], row);
        }
        let b = beta[hh];
        for (uj, &vj) in u.iter_mut().zip(&v[hh * vd..(hh + 1) * vd]) {
            *uj = b * (vj - *uj);
        }
        oh.iter_mut().for_each(|x| *x = 0.0);
        for i in 0..kd {
            let row = &mut st[i * vd..(i + 1) * vd];
            crate::ops::axpy(row, kh[i], &u);
            crate::ops::axpy(oh, qh[i] * scale, row);
        }
    });
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
/// Heads one after another (the reference for [`kda_chunk_parallel`]).
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
        chunk_head(
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

/// [`kda_chunk`] with the heads spread over `threads` pool threads (prefill: the heads are
/// independent, each with its own state); the same arithmetic per head, so the same bits.
#[allow(clippy::too_many_arguments)]
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
    if threads <= 1 || h == 1 {
        return kda_chunk(o, q, k, v, g, beta, s, h, kd, vd, chunk);
    }
    let (sp, op) = (crate::attention::OutPtr(s.as_mut_ptr()), crate::attention::OutPtr(o.as_mut_ptr()));
    crate::threads::Pool::global().run(threads, h, &|hh| {
        // SAFETY: head hh owns state rows [hh·K·V, (hh+1)·K·V) and, at every position c, the
        // output row [(c·H + hh)·V, (c·H + hh + 1)·V); no two tasks share an element.
        let st = unsafe { sp.slice(hh * kd * vd, kd * vd) };
        let mut put = |c: usize, row: &[f32]| unsafe { op.slice((c * h + hh) * vd, vd) }.copy_from_slice(row);
        chunk_head(&mut put, q, k, v, g, beta, st, (t, h, hh), kd, vd, chunk);
    });
}

/// One head of the chunked form over all T positions: `put(c, o_c)` receives each output row.
#[allow(clippy::too_many_arguments)]
fn chunk_head(
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
        for &(h, kd, vd, threads) in &[(2, 16, 24, 1), (3, 64, 64, 2), (8, 128, 128, 2)] {
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
    fn parallel_chunked_prefill_equals_the_sequential_heads_bit_for_bit() {
        for &(t, h, threads) in &[(70, 4, 2), (33, 3, 4), (5, 1, 2)] {
            let (kd, vd) = (16, 24);
            let [q, k, v, g, beta, s0] = inputs(t, h, kd, vd, 0.5, 9 + t as u64);
            let (mut o1, mut s1) = (vec![0.0; t * h * vd], s0.clone());
            let (mut o2, mut s2) = (vec![0.0; t * h * vd], s0);
            kda_chunk(&mut o1, &q, &k, &v, &g, &beta, &mut s1, h, kd, vd, 16);
            kda_chunk_parallel(&mut o2, &q, &k, &v, &g, &beta, &mut s2, h, kd, vd, 16, threads);
            assert_eq!(o1, o2, "outputs, T={t} H={h}");
            assert_eq!(s1, s2, "states, T={t} H={h}");
        }
    }
}
