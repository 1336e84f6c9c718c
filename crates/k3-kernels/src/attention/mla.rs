//! Absorbed MLA attention over the latent cache (architecture.md §2(a)): each head's query,
//! absorbed into the latent space, against cache rows `[c_j ; k_r_j]`; the latent part `c_j` is
//! both key and value. The per-head reference, and the block form the engine runs for prefill and
//! decode over an f32 or f16 cache.

use super::{causal_probabilities, split, OutPtr, Rows};

/// Absorbed MLA for one query token (architecture.md §2(a)): for each head,
/// `score_j = (q̃ · c_j + q_r · k_r_j) · scale`, `out = Σ_j softmax(score)_j · c_j` (in latent space).
///
/// With `f16_kq`, the query is rounded to f16 before the scores and the probabilities before the
/// weighted sum, as llama.cpp's (non-flash) attention does against its f16 cache; the cache rows
/// then hold f16-representable values.
///
/// # Shapes
/// q_abs: [H, R]; q_r: [H, Dr]; cache: [S, R + Dr] rows `[c_j ; k_r_j]`; out: [H, R]
#[allow(clippy::too_many_arguments)]
pub fn mla_attend_ref(
    out: &mut [f32],
    q_abs: &[f32],
    q_r: &[f32],
    cache: &[f32],
    r: usize,
    dr: usize,
    scale: f32,
    f16_kq: bool,
) {
    let h = q_abs.len() / r;
    let s = cache.len() / (r + dr);
    let mut scores = vec![0f32; s];
    let round = |v: &[f32]| -> Vec<f32> {
        let mut v = v.to_vec();
        if f16_kq {
            crate::simd::round_f16_inplace(&mut v);
        }
        v
    };
    for hh in 0..h {
        let (qa, qr) = (round(&q_abs[hh * r..(hh + 1) * r]), round(&q_r[hh * dr..(hh + 1) * dr]));
        for (j, sc) in scores.iter_mut().enumerate() {
            let row = &cache[j * (r + dr)..(j + 1) * (r + dr)];
            *sc = (crate::ops::dot(&qa, &row[..r]) + crate::ops::dot(&qr, &row[r..])) * scale;
        }
        crate::ops::softmax_inplace(&mut scores);
        if f16_kq {
            crate::simd::round_f16_inplace(&mut scores);
        }
        let o = &mut out[hh * r..(hh + 1) * r];
        o.iter_mut().for_each(|x| *x = 0.0);
        for (j, &p) in scores.iter().enumerate() {
            crate::ops::axpy(o, p, &cache[j * (r + dr)..j * (r + dr) + r]);
        }
    }
}

/// [`mla_attend_ref`] with the heads spread over `threads` pool threads.
#[allow(clippy::too_many_arguments)]
pub fn mla_attend(
    out: &mut [f32],
    q_abs: &[f32],
    q_r: &[f32],
    cache: &[f32],
    r: usize,
    dr: usize,
    scale: f32,
    f16_kq: bool,
    threads: usize,
) {
    let h = q_abs.len() / r;
    let s = cache.len() / (r + dr);
    let threads = if s * h * (r + dr) < 1 << 15 { 1 } else { threads };
    let o = OutPtr(out.as_mut_ptr());
    crate::threads::Pool::global().run(threads, h, &|hh| {
        // SAFETY: head hh writes only its own [R] slice.
        let oh = unsafe { o.slice(hh * r, r) };
        mla_attend_ref(oh, &q_abs[hh * r..(hh + 1) * r], &q_r[hh * dr..(hh + 1) * dr], cache, r, dr, scale, f16_kq);
    });
}

/// Absorbed MLA for a block of `nq` consecutive queries at positions p0..p0+nq, all heads at once
/// (prefill and decode): scores for every (query, head) row against the cache rows as one A·Bᵀ
/// product, the causal softmax per row, then the probabilities times the latent rows, so the
/// cache is streamed from memory about once per thread, in L2-sized panels, instead of twice per
/// head per query. An f16 cache is widened as the kernels load it. A decode step against a long cache
/// splits the positions over the threads instead and makes one pass over each share
/// ([`decode_split`]), also on one thread.
/// The same arithmetic as [`mla_attend_ref`] per row, up to the order of the sums.
///
/// # Shapes
/// q: [nq, H, R + Dr] rows `[q̃ ; q_r]`; cache: [S, R + Dr] with S ≥ p0 + nq, query i seeing rows
/// 0..=p0 + i; out: [nq, H, R]
#[allow(clippy::too_many_arguments)]
pub fn mla_attend_block(
    out: &mut [f32],
    q: &[f32],
    cache: Rows,
    h: usize,
    r: usize,
    dr: usize,
    p0: usize,
    scale: f32,
    f16_kq: bool,
    threads: usize,
) {
    let w = r + dr;
    let rows = q.len() / w;
    let nq = rows / h;
    let s = p0 + nq;
    assert!(cache.len() >= s * w && out.len() >= rows * r, "mla_attend_block: cache or output too short");
    let mut qv = q.to_vec();
    if f16_kq {
        crate::simd::round_f16_inplace(&mut qv);
    }
    let threads = if s * rows * w < 1 << 15 { 1 } else { threads.max(1) };
    let lat = Latent { cache, r, dr };
    if nq == 1 && s >= split::SPLIT_MIN {
        return decode_split(out, &qv, lat, s, scale, f16_kq, threads);
    }
    // One group of rows per thread: the products block the cache in L2-sized panels, so a
    // bigger group streams it from memory fewer times.
    let per = rows.div_ceil(threads).max(1);
    let o = OutPtr(out.as_mut_ptr());
    crate::threads::Pool::global().run(threads, rows.div_ceil(per), &|g| {
        let (r0, r1) = (g * per, ((g + 1) * per).min(rows));
        let mut sc = vec![0f32; (r1 - r0) * s];
        lat.scores(&mut sc, s, &qv[r0 * w..r1 * w], 0..s);
        for i in r0..r1 {
            let row = &mut sc[(i - r0) * s..(i - r0 + 1) * s];
            causal_probabilities(row, p0 + i / h + 1, scale, f16_kq);
        }
        // SAFETY: rows r0..r1 of the output belong to this task alone.
        let oh = unsafe { o.slice(r0 * r, (r1 - r0) * r) };
        oh.fill(0.0);
        lat.values(oh, &sc, s, 0..s);
    });
}

/// The latent cache as the two products see it.
#[derive(Clone, Copy)]
struct Latent<'a> {
    cache: Rows<'a>,
    r: usize,
    dr: usize,
}

impl Latent<'_> {
    /// `sc[i, j − js.start] += a_i · row_j` for the rows `a` ([m, R + Dr]) and positions `js`;
    /// `sc` has row stride `ld`.
    fn scores(&self, sc: &mut [f32], ld: usize, a: &[f32], js: std::ops::Range<usize>) {
        let w = self.r + self.dr;
        let (m, n) = (a.len() / w, js.len());
        match self.cache {
            Rows::F32(c) => crate::simd::matmul_nt_acc(sc, ld, a, w, &c[js.start * w..], w, m, w, n),
            Rows::F16(c) => crate::simd::matmul_nt_acc(sc, ld, a, w, &c[js.start * w..], w, m, w, n),
        }
    }

    /// `out[i] += Σ_j p[i, j − js.start] · c_j` over the positions `js` (`p` has row stride `ld`;
    /// out: [m, R]).
    fn values(&self, out: &mut [f32], p: &[f32], ld: usize, js: std::ops::Range<usize>) {
        let (r, w) = (self.r, self.r + self.dr);
        let (m, n) = (out.len() / r, js.len());
        match self.cache {
            Rows::F32(c) => crate::simd::matmul_acc_strided(out, r, p, ld, &c[js.start * w..], w, m, n, r),
            Rows::F16(c) => crate::simd::matmul_acc_strided(out, r, p, ld, &c[js.start * w..], w, m, n, r),
        }
    }
}

/// One decode step (every row sees all `s` positions) with the positions split over the threads,
/// as flash-decoding does, so each thread streams only its share of the cache, and only once:
/// each share makes a single pass in L2-sized tiles ([`split::online_share`]); the shares'
/// maxima and sums give each row's softmax, and their outputs are summed with those weights.
fn decode_split(out: &mut [f32], qv: &[f32], lat: Latent, s: usize, scale: f32, f16_kq: bool, threads: usize) {
    let (r, w) = (lat.r, lat.r + lat.dr);
    let rows = qv.len() / w;
    let (per, shares) = split::shares_of(s, threads);
    let (mut maxes, mut sums) = (vec![0f32; shares * rows], vec![0f32; shares * rows]);
    let mut partial = vec![0f32; shares * rows * r];
    let (mx, sm, po) = (OutPtr(maxes.as_mut_ptr()), OutPtr(sums.as_mut_ptr()), OutPtr(partial.as_mut_ptr()));
    crate::threads::Pool::global().run(threads, shares, &|k| {
        let scores = |block: &mut [f32], js: std::ops::Range<usize>| lat.scores(block, js.len(), qv, js);
        let values = |acc: &mut [f32], p: &[f32], js: std::ops::Range<usize>| lat.values(acc, p, js.len(), js);
        // SAFETY: share k alone writes its rows of `maxes`, `sums` and `partial`.
        let (mk, sk, ok) =
            unsafe { (mx.slice(k * rows, rows), sm.slice(k * rows, rows), po.slice(k * rows * r, rows * r)) };
        split::online_share(k * per..((k + 1) * per).min(s), scale, f16_kq, &scores, &values, ok, mk, sk);
    });
    split::combine_shares(&mut out[..rows * r], &maxes, &sums, &partial, r);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_close_abs, Rng};

    #[test]
    fn block_and_split_forms_match_the_reference_over_f32_and_f16_caches() {
        let mut rng = Rng::new(22);
        let (h, r, dr) = (4, 24, 8);
        let w = r + dr;
        for f16 in [false, true] {
            // The per-head form over 50 rows.
            let cache = rng.normals(50 * w, 1.0);
            let qa = rng.normals(h * r, 1.0);
            let qr = rng.normals(h * dr, 1.0);
            let (mut want, mut got) = (vec![0f32; h * r], vec![0f32; h * r]);
            mla_attend_ref(&mut want, &qa, &qr, &cache, r, dr, 0.2, f16);
            mla_attend(&mut got, &qa, &qr, &cache, r, dr, 0.2, f16, 2);
            assert_close_abs("mla per head", &got, &want, 1e-6);
            // The block form: 5 queries after 45 cached rows (rows split over threads); decode
            // steps after 1,499 and 2,500 rows (positions split over threads, across the kernels' panels
            // and shares of unequal length), over an f32 cache and an f16 one holding the same
            // (f16-representable) values.
            for (nq, p0) in [(5, 45), (1, 1499), (1, 2500)] {
                let s = p0 + nq;
                let mut cache = rng.normals(s * w, 1.0);
                crate::simd::round_f16_inplace(&mut cache);
                let bits: Vec<u16> = cache.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect();
                let qb = rng.normals(nq * h * w, 1.0);
                let mut want = vec![0f32; nq * h * r];
                for i in 0..nq {
                    let (mut qa, mut qr) = (vec![0f32; h * r], vec![0f32; h * dr]);
                    for hh in 0..h {
                        let row = &qb[(i * h + hh) * w..(i * h + hh + 1) * w];
                        qa[hh * r..(hh + 1) * r].copy_from_slice(&row[..r]);
                        qr[hh * dr..(hh + 1) * dr].copy_from_slice(&row[r..]);
                    }
                    let visible = &cache[..(p0 + i + 1) * w];
                    mla_attend_ref(&mut want[i * h * r..(i + 1) * h * r], &qa, &qr, visible, r, dr, 0.2, f16);
                }
                for threads in [1, 2, 3] {
                    for (name, rows) in [("f32", Rows::F32(&cache)), ("f16", Rows::F16(&bits))] {
                        let mut got = vec![0f32; nq * h * r];
                        mla_attend_block(&mut got, &qb, rows, h, r, dr, p0, 0.2, f16, threads);
                        let tol = if f16 { 2e-3 } else { 1e-5 }; // f16 rounding of p may flip on reordered sums
                        assert_close_abs(&format!("mla block {name} nq={nq} p0={p0} x{threads}"), &got, &want, tol);
                    }
                }
            }
        }
    }
}
