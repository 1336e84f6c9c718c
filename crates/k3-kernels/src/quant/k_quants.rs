//! K-quants (super-blocks of 256, ggml `block_q4_K` / `block_q5_K` / `block_q6_K` / `block_q8_K`),
//! byte-compatible with ggml. Q4_K: `f16 d; f16 dmin; u8 scales[12]; u8 qs[128]`: eight sub-blocks
//! of 32, each with a 6-bit scale and min, value `d·sc·q − dmin·m`. Q5_K: the same with 5-bit
//! codes, `f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]` (the fifth bits in `qh`). Q6_K: `u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d`:
//! sixteen sub-blocks of 16, value `d·sc·(q − 32)` with q six bits. Q8_K (the activation format
//! for all three): `f32 d; i8 qs[256]; i16 bsums[16]`. The quantizers follow ggml's `*_ref` ones
//! (`make_qkx2_quants` for Q4_K and Q5_K, `make_qx_quants` for Q6_K).

use super::float::{f16_at, f16_le};

pub const QK: usize = 256;
pub const Q4K_BYTES: usize = 144;
pub const Q5K_BYTES: usize = 176;
pub const Q6K_BYTES: usize = 210;
pub const Q8K_BYTES: usize = 292;

/// ggml's `nearest_int`: round half to even.
pub(super) fn nearest(x: f32) -> i32 {
    x.round_ties_even() as i32
}

/// Scale and min of Q4_K sub-block `j` from the 12 packed bytes (ggml `get_scale_min_k4`).
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Pack eight 6-bit (scale, min) pairs into Q4_K's 12 bytes (the inverse of [`scale_min_k4`]).
pub fn pack_scale_min_k4(pairs: &[(u8, u8)]) -> [u8; 12] {
    let mut sc = [0u8; 12];
    for (j, &(ls, lm)) in pairs.iter().enumerate().take(8) {
        if j < 4 {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            sc[j - 4] |= (ls >> 4) << 6;
            sc[j] |= (lm >> 4) << 6;
        }
    }
    sc
}

/// ggml `make_qkx2_quants`: codes in [0, nmax] with a scale and a (non-positive) min chosen by a
/// weighted least-squares search, each candidate judged by its weighted squared error or, with
/// `mad` (Q2_K), its weighted absolute error; returns (scale, −min).
#[allow(clippy::too_many_arguments)]
pub(super) fn make_qkx2(
    x: &[f32],
    w: &[f32],
    nmax: i32,
    l: &mut [u8],
    (rmin, rdelta, nstep): (f32, f32, i32),
    mad: bool,
) -> (f32, f32) {
    let cost = |diff: f32| if mad { diff.abs() } else { diff * diff };
    let n = x.len();
    let (mut min, mut max) = (x[0], x[0]);
    let (mut sum_w, mut sum_x) = (w[0], w[0] * x[0]);
    for i in 1..n {
        min = min.min(x[i]);
        max = max.max(x[i]);
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.iter_mut().for_each(|v| *v = 0);
        return (0.0, -min);
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best = 0f32;
    for i in 0..n {
        l[i] = nearest(iscale * (x[i] - min)).clamp(0, nmax) as u8;
        best += w[i] * cost(scale * l[i] as f32 + min - x[i]);
    }
    let mut aux = vec![0u8; n];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let q = nearest(iscale * (x[i] - min)).clamp(0, nmax);
            aux[i] = q as u8;
            let lf = q as f32;
            sum_l += w[i] * lf;
            sum_l2 += w[i] * lf * lf;
            sum_xl += w[i] * lf * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let err: f32 = (0..n).map(|i| w[i] * cost(this_scale * aux[i] as f32 + this_min - x[i])).sum();
            if err < best {
                l.copy_from_slice(&aux);
                best = err;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// The part of ggml's `quantize_row_q4_K_ref` / `quantize_row_q5_K_ref` after the per-sub-block
/// search: the eight (scale, min) pairs quantized to 6 bits against the super-block's d and dmin,
/// then every code recomputed against its quantized scale and min, clamped to [0, nmax]. Returns
/// the f16 bytes of d and dmin and the 12 packed scale bytes.
fn k4_super_block(
    blk: &[f32],
    scales: &[f32; 8],
    mins: &[f32; 8],
    nmax: i32,
    l: &mut [u8; QK],
) -> ([u8; 2], [u8; 2], [u8; 12]) {
    let max_scale = scales.iter().fold(0f32, |a, &b| a.max(b));
    let max_min = mins.iter().fold(0f32, |a, &b| a.max(b));
    let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let six: Vec<(u8, u8)> = (0..8)
        .map(|j| (nearest(inv_scale * scales[j]).min(63) as u8, nearest(inv_min * mins[j]).min(63) as u8))
        .collect();
    let sc = pack_scale_min_k4(&six);
    let (d, dmin) = (f16_le(max_scale / 63.0), f16_le(max_min / 63.0));
    let (df, dminf) = (f16_at(&d), f16_at(&dmin));
    for j in 0..8 {
        let (s, m) = scale_min_k4(j, &sc);
        let dd = df * s as f32;
        if dd == 0.0 {
            continue;
        }
        let dm = dminf * m as f32;
        for ii in 0..32 {
            l[32 * j + ii] = nearest((blk[32 * j + ii] + dm) / dd).clamp(0, nmax) as u8;
        }
    }
    (d, dmin, sc)
}

/// The weighted scale-and-min search of each sub-block of 32 (ggml's `make_qkx2_quants` with
/// weights `rms + |x|`), codes in [0, nmax].
fn k4_search(blk: &[f32], nmax: i32, rmin: f32, nstep: i32, l: &mut [u8; QK]) -> ([f32; 8], [f32; 8]) {
    let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
    for j in 0..8 {
        let xs = &blk[32 * j..32 * (j + 1)];
        let av = (xs.iter().map(|v| v * v).sum::<f32>() / 32.0).sqrt();
        let w: Vec<f32> = xs.iter().map(|v| av + v.abs()).collect();
        (scales[j], mins[j]) = make_qkx2(xs, &w, nmax, &mut l[32 * j..32 * (j + 1)], (rmin, 0.1, nstep), false);
    }
    (scales, mins)
}

/// ggml `quantize_row_q4_K_ref`.
pub fn quantize_q4_k(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / QK * Q4K_BYTES);
    for blk in x.chunks_exact(QK) {
        let mut l = [0u8; QK];
        let (scales, mins) = k4_search(blk, 15, -1.0, 20, &mut l);
        let (d, dmin, sc) = k4_super_block(blk, &scales, &mins, 15, &mut l);
        out.extend_from_slice(&d);
        out.extend_from_slice(&dmin);
        out.extend_from_slice(&sc);
        for j in (0..QK).step_by(64) {
            for i in 0..32 {
                out.push(l[j + i] | (l[j + i + 32] << 4));
            }
        }
    }
    out
}

/// The Q4_K codes of one block (0..15, element order: sub-block 2p is the low nibbles of
/// `qs[32p..32p + 32]`, 2p + 1 the high ones) and its d, dmin and packed scales.
pub fn q4_k_codes(blk: &[u8]) -> ([u8; QK], f32, f32, &[u8]) {
    let qs = &blk[16..Q4K_BYTES];
    let q = std::array::from_fn(|e| {
        let (sub, i) = (e / 32, e % 32);
        let byte = qs[32 * (sub / 2) + i];
        if sub % 2 == 0 {
            byte & 0x0F
        } else {
            byte >> 4
        }
    });
    (q, f16_at(&blk[0..2]), f16_at(&blk[2..4]), &blk[4..16])
}

pub fn dequantize_q4_k(b: &[u8], out: &mut [f32]) {
    for (blk, o) in b.chunks_exact(Q4K_BYTES).zip(out.chunks_exact_mut(QK)) {
        let (q, d, dmin, sc) = q4_k_codes(blk);
        for (j, o) in o.chunks_exact_mut(32).enumerate() {
            let (s, m) = scale_min_k4(j, sc);
            for (v, &c) in o.iter_mut().zip(&q[32 * j..32 * (j + 1)]) {
                *v = d * s as f32 * c as f32 - dmin * m as f32;
            }
        }
    }
}

/// Q4_K rows as Q4_1 blocks, for the integer tiles (which have Q4_1 kernels and no Q4_K ones): a
/// Q4_K sub-block of 32 is a Q4_1 block with the same codes, scale `d·sc` and min `−dmin·m`.
/// Those products are rounded to f16 (Q4_1 stores f16), a relative error of at most 2⁻¹¹ on a
/// block's scale and min, well under the 4-bit codes' own step; 20 bytes per 32 weights instead
/// of 18.
pub fn q4_k_as_q4_1(b: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(b.len() / Q4K_BYTES * 8 * 20);
    for blk in b.chunks_exact(Q4K_BYTES) {
        let (q, d, dmin, sc) = q4_k_codes(blk);
        for (sub, code) in q.chunks_exact(32).enumerate() {
            let (ls, lm) = scale_min_k4(sub, sc);
            out.extend_from_slice(&f16_le(d * ls as f32));
            out.extend_from_slice(&f16_le(-dmin * lm as f32));
            // Q4_1 byte j: element j in the low nibble, element j + 16 in the high one.
            out.extend((0..16).map(|j| code[j] | (code[j + 16] << 4)));
        }
    }
    out
}

/// One Q6_K super-block as the 16-row tiles take it ([`crate::qgemm::Kind::Q6K`]): its 256
/// codes q − 32 in element order and, per sub-block of 16, the scale `d·sc` rounded to f16 (the
/// tiles' scale type; a relative error of at most 2⁻¹¹, as [`q4_k_as_q4_1`]'s). `None` when a
/// product overflows f16.
pub fn q6_k_halves(blk: &[u8]) -> Option<([i8; QK], [u16; 16])> {
    let d = f16_at(&blk[208..210]);
    let (q, sc) = q6_k_codes(blk);
    let mut scales = [0u16; 16];
    for (o, &s) in scales.iter_mut().zip(sc) {
        let h = half::f16::from_f32(d * s as i8 as f32);
        if !h.is_finite() {
            return None;
        }
        *o = h.to_bits();
    }
    Some((q, scales))
}

/// ggml `quantize_row_q5_K_ref`: Q4_K's search with codes in [0, 31] (rmin −0.5, 15 steps).
pub fn quantize_q5_k(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / QK * Q5K_BYTES);
    for blk in x.chunks_exact(QK) {
        let mut l = [0u8; QK];
        let (scales, mins) = k4_search(blk, 31, -0.5, 15, &mut l);
        let (d, dmin, sc) = k4_super_block(blk, &scales, &mins, 31, &mut l);
        let (mut qh, mut ql) = ([0u8; 32], [0u8; 128]);
        for (g, n) in (0..QK).step_by(64).enumerate() {
            for j in 0..32 {
                let (l1, l2) = (l[n + j], l[n + j + 32]);
                qh[j] |= ((l1 >> 4) << (2 * g)) | ((l2 >> 4) << (2 * g + 1));
                ql[32 * g + j] = (l1 & 0xF) | ((l2 & 0xF) << 4);
            }
        }
        out.extend_from_slice(&d);
        out.extend_from_slice(&dmin);
        out.extend_from_slice(&sc);
        out.extend_from_slice(&qh);
        out.extend_from_slice(&ql);
    }
    out
}

/// The Q5_K codes of one block (0..31, element order) and its d, dmin and packed scales.
fn q5_k_codes(blk: &[u8]) -> ([u8; QK], f32, f32, &[u8]) {
    let (d, dmin, sc, qh, ql) = (f16_at(&blk[0..2]), f16_at(&blk[2..4]), &blk[4..16], &blk[16..48], &blk[48..176]);
    let mut q = [0u8; QK];
    for g in 0..4 {
        for j in 0..32 {
            let byte = ql[32 * g + j];
            q[64 * g + j] = (byte & 0xF) | (((qh[j] >> (2 * g)) & 1) << 4);
            q[64 * g + 32 + j] = (byte >> 4) | (((qh[j] >> (2 * g + 1)) & 1) << 4);
        }
    }
    (q, d, dmin, sc)
}

pub fn dequantize_q5_k(b: &[u8], out: &mut [f32]) {
    for (blk, o) in b.chunks_exact(Q5K_BYTES).zip(out.chunks_exact_mut(QK)) {
        let (q, d, dmin, sc) = q5_k_codes(blk);
        for (j, o) in o.chunks_exact_mut(32).enumerate() {
            let (s, m) = scale_min_k4(j, sc);
            for (v, &c) in o.iter_mut().zip(&q[32 * j..32 * (j + 1)]) {
                *v = d * s as f32 * c as f32 - dmin * m as f32;
            }
        }
    }
}

/// One Q5_K super-block as the 16-row tiles take it ([`crate::qgemm::Kind::Q5K`]): its 256 codes
/// (0..31) and, per sub-block of 32, the scale `d·sc` and the min `−dmin·m` rounded to f16 (as
/// [`q4_k_as_q4_1`] rounds Q4_K's). `None` when one overflows f16.
pub fn q5_k_blocks(blk: &[u8]) -> Option<([u8; QK], [u16; 8], [u16; 8])> {
    let (q, d, dmin, sc) = q5_k_codes(blk);
    let (mut scale, mut min) = ([0u16; 8], [0u16; 8]);
    for j in 0..8 {
        let (s, m) = scale_min_k4(j, sc);
        let (hs, hm) = (half::f16::from_f32(d * s as f32), half::f16::from_f32(-dmin * m as f32));
        if !hs.is_finite() || !hm.is_finite() {
            return None;
        }
        (scale[j], min[j]) = (hs.to_bits(), hm.to_bits());
    }
    Some((q, scale, min))
}

/// ggml `make_qx_quants` with rmse_type 1 (weights x²): signed codes in [−nmax, nmax − 1] stored
/// offset by nmax; returns the scale.
fn make_qx(x: &[f32], nmax: i32, l: &mut [u8]) -> f32 {
    let (amax, max) = super::abs_max(x);
    if amax < 1e-15 {
        l.iter_mut().for_each(|v| *v = 0);
        return 0.0;
    }
    let fit = |iscale: f32| -> (f32, f32) {
        let (mut sumlx, mut suml2) = (0f32, 0f32);
        for &v in x {
            let q = nearest(iscale * v).clamp(-nmax, nmax - 1) as f32;
            let w = v * v;
            sumlx += w * v * q;
            suml2 += w * q * q;
        }
        (sumlx, suml2)
    };
    let mut iscale = -(nmax as f32) / max;
    let (sumlx, suml2) = fit(iscale);
    let mut scale = if suml2 > 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        let cand = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = fit(cand);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            iscale = cand;
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    for (li, &v) in l.iter_mut().zip(x) {
        *li = (nmax + nearest(iscale * v).clamp(-nmax, nmax - 1)) as u8;
    }
    scale
}

/// ggml `quantize_row_q6_K_ref`.
pub fn quantize_q6_k(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / QK * Q6K_BYTES);
    for blk in x.chunks_exact(QK) {
        let mut l = [0u8; QK];
        let mut scales = [0f32; 16];
        for ib in 0..16 {
            scales[ib] = make_qx(&blk[16 * ib..16 * (ib + 1)], 32, &mut l[16 * ib..16 * (ib + 1)]);
        }
        let (max_abs, max_scale) = super::abs_max(&scales);
        let mut ql = [0u8; 128];
        let mut qh = [0u8; 64];
        let mut sc = [0i8; 16];
        let mut d = f16_le(0.0);
        if max_abs >= 1e-15 {
            let iscale = -128.0 / max_scale;
            d = f16_le(1.0 / iscale);
            for ib in 0..16 {
                sc[ib] = nearest(iscale * scales[ib]).min(127) as i8;
            }
            let df = f16_at(&d);
            for j in 0..16 {
                let dd = df * sc[j] as f32;
                if dd == 0.0 {
                    continue;
                }
                for ii in 0..16 {
                    l[16 * j + ii] = (nearest(blk[16 * j + ii] / dd).clamp(-32, 31) + 32) as u8;
                }
            }
            for (h, j) in (0..QK).step_by(128).enumerate() {
                for i in 0..32 {
                    let q = [l[j + i], l[j + i + 32], l[j + i + 64], l[j + i + 96]];
                    ql[64 * h + i] = (q[0] & 0xF) | ((q[2] & 0xF) << 4);
                    ql[64 * h + i + 32] = (q[1] & 0xF) | ((q[3] & 0xF) << 4);
                    qh[32 * h + i] = (q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6);
                }
            }
        }
        out.extend_from_slice(&ql);
        out.extend_from_slice(&qh);
        out.extend(sc.iter().map(|&s| s as u8));
        out.extend_from_slice(&d);
    }
    out
}

/// The Q6_K codes of one block, q − 32 in element order, and its 16 scales.
fn q6_k_codes(blk: &[u8]) -> ([i8; QK], &[u8]) {
    let (ql, qh, sc) = (&blk[0..128], &blk[128..192], &blk[192..208]);
    let mut q = [0i8; QK];
    for h in 0..2 {
        for i in 0..32 {
            let (a, b, hb) = (ql[64 * h + i], ql[64 * h + i + 32], qh[32 * h + i]);
            let base = 128 * h + i;
            q[base] = ((a & 0xF) | ((hb & 3) << 4)) as i8 - 32;
            q[base + 32] = ((b & 0xF) | (((hb >> 2) & 3) << 4)) as i8 - 32;
            q[base + 64] = ((a >> 4) | (((hb >> 4) & 3) << 4)) as i8 - 32;
            q[base + 96] = ((b >> 4) | (((hb >> 6) & 3) << 4)) as i8 - 32;
        }
    }
    (q, sc)
}

pub fn dequantize_q6_k(b: &[u8], out: &mut [f32]) {
    for (blk, o) in b.chunks_exact(Q6K_BYTES).zip(out.chunks_exact_mut(QK)) {
        let d = f16_at(&blk[208..210]);
        let (q, sc) = q6_k_codes(blk);
        for (e, v) in o.iter_mut().enumerate() {
            *v = d * sc[e / 16] as i8 as f32 * q[e] as f32;
        }
    }
}

/// ggml `quantize_row_q8_K_ref`: d = max/−127 by the largest |x|, q = nearest(x/d) ≤ 127, and
/// the sums of every 16 codes.
pub fn quantize_q8_k(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / QK * Q8K_BYTES);
    for blk in x.chunks_exact(QK) {
        let (amax, max) = super::abs_max(blk);
        let mut qs = [0i8; QK];
        let mut d = 0f32;
        if amax != 0.0 {
            let iscale = -127.0 / max;
            for (q, &v) in qs.iter_mut().zip(blk) {
                *q = nearest(iscale * v).min(127) as i8;
            }
            d = 1.0 / iscale;
        }
        out.extend_from_slice(&d.to_le_bytes());
        out.extend(qs.iter().map(|&q| q as u8));
        for g in qs.chunks_exact(16) {
            out.extend_from_slice(&(g.iter().map(|&q| q as i16).sum::<i16>()).to_le_bytes());
        }
    }
    out
}

pub fn dequantize_q8_k(b: &[u8], out: &mut [f32]) {
    for (blk, o) in b.chunks_exact(Q8K_BYTES).zip(out.chunks_exact_mut(QK)) {
        let d = f32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]);
        for (v, &q) in o.iter_mut().zip(&blk[4..4 + QK]) {
            *v = d * q as i8 as f32;
        }
    }
}

/// A Q8_K block's scale, 256 codes and 16 little-endian i16 block sums (as bytes).
pub(crate) fn q8k_parts(blk: &[u8]) -> (f32, &[u8], &[u8]) {
    (f32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]), &blk[4..4 + QK], &blk[4 + QK..])
}

/// ggml `vec_dot_q4_K_q8_K`: per sub-block j, d·sc_j·Σ q4·q8 − dmin·m_j·Σ q8, times d8.
pub fn vec_dot_q4_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (wb, xb) in w.chunks_exact(Q4K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
        let (d, dmin, sc, qs) = (f16_at(&wb[0..2]), f16_at(&wb[2..4]), &wb[4..16], &wb[16..]);
        let (d8, q8, bsums) = q8k_parts(xb);
        let bsum = |g: usize| i16::from_le_bytes([bsums[2 * g], bsums[2 * g + 1]]) as i32;
        let (mut sumi, mut mins) = (0i32, 0i32);
        for j in 0..8 {
            let (s, m) = scale_min_k4(j, sc);
            let q = &qs[32 * (j / 2)..32 * (j / 2 + 1)];
            let shift = if j % 2 == 0 { 0 } else { 4 };
            let isum: i32 = (0..32).map(|i| ((q[i] >> shift) & 0xF) as i32 * q8[32 * j + i] as i8 as i32).sum();
            sumi += s as i32 * isum;
            mins += m as i32 * (bsum(2 * j) + bsum(2 * j + 1));
        }
        sum += d8 * (d * sumi as f32 - dmin * mins as f32);
    }
    sum
}

/// ggml `vec_dot_q5_K_q8_K`: per sub-block j, d·sc_j·Σ q5·q8 − dmin·m_j·Σ q8, times d8.
pub fn vec_dot_q5_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (wb, xb) in w.chunks_exact(Q5K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
        let (q, d, dmin, sc) = q5_k_codes(wb);
        let (d8, q8, bsums) = q8k_parts(xb);
        let bsum = |g: usize| i16::from_le_bytes([bsums[2 * g], bsums[2 * g + 1]]) as i32;
        let (mut sumi, mut mins) = (0i32, 0i32);
        for j in 0..8 {
            let (s, m) = scale_min_k4(j, sc);
            let isum: i32 = (0..32).map(|i| q[32 * j + i] as i32 * q8[32 * j + i] as i8 as i32).sum();
            sumi += s as i32 * isum;
            mins += m as i32 * (bsum(2 * j) + bsum(2 * j + 1));
        }
        sum += d8 * (d * sumi as f32 - dmin * mins as f32);
    }
    sum
}

/// ggml `vec_dot_q6_K_q8_K`: Σ over sub-blocks of 16 of d·sc·Σ (q6 − 32)·q8, times d8.
pub fn vec_dot_q6_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (wb, xb) in w.chunks_exact(Q6K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
        let d = f16_at(&wb[208..210]);
        let (q, sc) = q6_k_codes(wb);
        let (d8, q8, _) = q8k_parts(xb);
        let mut sumi = 0i32;
        for g in 0..16 {
            let isum: i32 = (0..16).map(|i| q[16 * g + i] as i32 * q8[16 * g + i] as i8 as i32).sum();
            sumi += sc[g] as i8 as i32 * isum;
        }
        sum += d * d8 * sumi as f32;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Q4_K rows read as Q4_1 blocks dequantize to the same values, up to the f16 rounding of
    /// each sub-block's scale and min (exactly where those products are f16 values).
    #[test]
    fn q4_k_reads_as_q4_1_blocks() {
        let mut rng = crate::testing::Rng::new(31);
        let x = rng.normals(QK * 5, 1.0);
        let k = quantize_q4_k(&x);
        let q41 = q4_k_as_q4_1(&k);
        assert_eq!(q41.len(), x.len() / 32 * 20);
        let (mut want, mut got) = (vec![0f32; x.len()], vec![0f32; x.len()]);
        dequantize_q4_k(&k, &mut want);
        super::super::GgmlType::Q4_1.dequantize_row(&q41, &mut got);
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 2e-3 * amax, "element {i}: {g} vs {w}");
        }
        // Scales 1.0 (d) times small integers and dmin 0 are exact in f16: then bit for bit.
        let mut exact = k.clone();
        for blk in exact.chunks_exact_mut(Q4K_BYTES) {
            blk[0..2].copy_from_slice(&f16_le(1.0));
            blk[2..4].copy_from_slice(&f16_le(0.0));
        }
        dequantize_q4_k(&exact, &mut want);
        super::super::GgmlType::Q4_1.dequantize_row(&q4_k_as_q4_1(&exact), &mut got);
        assert_eq!(got, want);
    }

    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|i| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let u = ((s >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0;
                // Rows with uneven sub-block magnitudes, as real weights have.
                u * (1.0 + (i / 32 % 5) as f32)
            })
            .collect()
    }

    #[test]
    fn six_bit_scales_and_mins_round_trip_through_the_packing() {
        for trial in 0..64u32 {
            let vals: Vec<(u8, u8)> =
                (0..8).map(|j| (((trial * 7 + j * 13) % 64) as u8, ((trial * 11 + j * 5) % 64) as u8)).collect();
            let sc = pack_scale_min_k4(&vals);
            for (j, &v) in vals.iter().enumerate() {
                assert_eq!(scale_min_k4(j, &sc), v, "sub-block {j}");
            }
        }
    }

    #[test]
    fn integer_dots_equal_the_dot_of_the_dequantized_rows() {
        let (w, y) = (data(4 * QK, 1), data(4 * QK, 2));
        let yq = quantize_q8_k(&y);
        let mut yd = vec![0f32; y.len()];
        dequantize_q8_k(&yq, &mut yd);
        for (enc, dot, deq) in [
            (quantize_q4_k(&w), vec_dot_q4_k_q8_k as fn(&[u8], &[u8]) -> f32, dequantize_q4_k as fn(&[u8], &mut [f32])),
            (quantize_q5_k(&w), vec_dot_q5_k_q8_k, dequantize_q5_k),
            (quantize_q6_k(&w), vec_dot_q6_k_q8_k, dequantize_q6_k),
        ] {
            let mut wd = vec![0f32; w.len()];
            deq(&enc, &mut wd);
            let want: f64 = wd.iter().zip(&yd).map(|(a, b)| *a as f64 * *b as f64).sum();
            let got = dot(&enc, &yq) as f64;
            assert!((got - want).abs() <= 1e-4 * want.abs().max(1.0), "{got} vs {want}");
        }
    }

    #[test]
    fn q6_k_beats_q5_k_beats_q4_k_and_all_track_the_data() {
        let x = data(8 * QK, 3);
        let err = |enc: &[u8], deq: fn(&[u8], &mut [f32])| {
            let mut y = vec![0f32; x.len()];
            deq(enc, &mut y);
            (x.iter().zip(&y).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>() / x.len() as f64).sqrt()
        };
        let (e4, e6) = (err(&quantize_q4_k(&x), dequantize_q4_k), err(&quantize_q6_k(&x), dequantize_q6_k));
        let e5 = err(&quantize_q5_k(&x), dequantize_q5_k);
        let rms = (x.iter().map(|a| (*a as f64).powi(2)).sum::<f64>() / x.len() as f64).sqrt();
        assert!(e6 < e4 / 3.0 && e4 < 0.1 * rms, "rmse Q4_K {e4}, Q6_K {e6}, data rms {rms}");
        // One more bit than Q4_K: about half its error, and above Q6_K's.
        assert!(e5 < 0.6 * e4 && e5 > e6, "rmse Q4_K {e4}, Q5_K {e5}, Q6_K {e6}");
    }
}
