//! The 2- and 3-bit K-quants (super-blocks of 256, ggml `block_q2_K` / `block_q3_K`),
//! byte-compatible with ggml. Both have sixteen sub-blocks of 16 codes, and both store the codes'
//! low two bits four to a byte: element `128n + 32j + l` (n < 2, j < 4, l < 32) is bits 2j..2j+2
//! of `qs[32n + l]`.
//! - Q2_K: `u8 scales[16]; u8 qs[64]; f16 d; f16 dmin` (84 bytes, 2.625 bits a weight): sub-block
//!   s has a 4-bit scale (low nibble of `scales[s]`) and a 4-bit min (high nibble), value
//!   `d·sc·q − dmin·m`, q in 0..3.
//! - Q3_K: `u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d` (110 bytes, 3.4375 bits a weight): the
//!   third bit of element e is bit e / 32 of `hmask[e % 32]`, and q = low + 4·bit in 0..7 has the
//!   value `d·(sc − 32)·(q − 4)`, sc a 6-bit scale per sub-block (its low nibble in `scales[s % 8]`,
//!   low or high half by s / 8; its top two bits in `scales[8 + s % 4]` at bit 2·(s / 4)).
//!
//! The quantizers are ggml's `quantize_row_q2_K_ref` (`make_qkx2_quants` with absolute error) and
//! `quantize_row_q3_K_ref` (`make_q3_quants`), the activation format of both is Q8_K.

use super::float::{f16_at, f16_le};
use super::k_quants::{make_qkx2, nearest, q8k_parts, QK};

pub const Q2K_BYTES: usize = 84;
pub const Q3K_BYTES: usize = 110;

/// ggml's `GROUP_MAX_EPS`: a sub-block whose largest |x| is below it quantizes to zeros.
const GROUP_MAX_EPS: f32 = 1e-15;

/// The 2-bit fields of 256 codes (0..3, element order) packed as both types store them.
fn pack_low_bits(l: &[u8; QK]) -> [u8; 64] {
    let mut qs = [0u8; 64];
    for n in 0..2 {
        for i in 0..32 {
            let e = 128 * n + i;
            qs[32 * n + i] = l[e] | (l[e + 32] << 2) | (l[e + 64] << 4) | (l[e + 96] << 6);
        }
    }
    qs
}

/// The low two bits of every code, in element order.
fn low_bits(qs: &[u8]) -> [u8; QK] {
    std::array::from_fn(|e| (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3)
}

// ---------------------------------------------------------------------------------------------
// Q2_K

/// ggml `quantize_row_q2_K_ref`.
pub fn quantize_q2_k(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / QK * Q2K_BYTES);
    for blk in x.chunks_exact(QK) {
        let mut l = [0u8; QK];
        let (mut scales, mut mins) = ([0f32; 16], [0f32; 16]);
        for s in 0..16 {
            let xs = &blk[16 * s..16 * (s + 1)];
            let w: [f32; 16] = std::array::from_fn(|i| xs[i].abs());
            (scales[s], mins[s]) = make_qkx2(xs, &w, 3, &mut l[16 * s..16 * (s + 1)], (-0.5, 0.1, 15), true);
        }
        let max_scale = scales.iter().fold(0f32, |a, &b| if b > a { b } else { a });
        let max_min = mins.iter().fold(0f32, |a, &b| if b > a { b } else { a });
        let mut sc = [0u8; 16];
        let mut d = f16_le(0.0);
        if max_scale > 0.0 {
            let iscale = 15.0 / max_scale;
            for (o, &v) in sc.iter_mut().zip(&scales) {
                *o = nearest(iscale * v) as u8;
            }
            d = f16_le(max_scale / 15.0);
        }
        let mut dmin = f16_le(0.0);
        if max_min > 0.0 {
            let iscale = 15.0 / max_min;
            for (o, &v) in sc.iter_mut().zip(&mins) {
                *o |= (nearest(iscale * v) << 4) as u8;
            }
            dmin = f16_le(max_min / 15.0);
        }
        let (df, dminf) = (f16_at(&d), f16_at(&dmin));
        for s in 0..16 {
            let dd = df * (sc[s] & 0xF) as f32;
            if dd == 0.0 {
                continue;
            }
            let dm = dminf * (sc[s] >> 4) as f32;
            for i in 16 * s..16 * (s + 1) {
                l[i] = nearest((blk[i] + dm) / dd).clamp(0, 3) as u8;
            }
        }
        out.extend_from_slice(&sc);
        out.extend_from_slice(&pack_low_bits(&l));
        out.extend_from_slice(&d);
        out.extend_from_slice(&dmin);
    }
    out
}

/// One Q2_K block's codes (0..3, element order), d, dmin and 16 scale-and-min bytes.
pub fn q2_k_codes(blk: &[u8]) -> ([u8; QK], f32, f32, &[u8]) {
    let [d, dmin] = q2_k_d_dmin_bits(blk).map(|b| half::f16::from_bits(b).to_f32());
    (low_bits(&blk[16..80]), d, dmin, &blk[0..16])
}

/// One Q2_K block's f16 `d` and `dmin`, as stored.
pub fn q2_k_d_dmin_bits(blk: &[u8]) -> [u16; 2] {
    [u16::from_le_bytes([blk[80], blk[81]]), u16::from_le_bytes([blk[82], blk[83]])]
}

pub fn dequantize_q2_k(b: &[u8], out: &mut [f32]) {
    for (blk, o) in b.chunks_exact(Q2K_BYTES).zip(out.chunks_exact_mut(QK)) {
        let (q, d, dmin, sc) = q2_k_codes(blk);
        for (e, v) in o.iter_mut().enumerate() {
            let s = sc[e / 16];
            *v = d * (s & 0xF) as f32 * q[e] as f32 - dmin * (s >> 4) as f32;
        }
    }
}

/// ggml `vec_dot_q2_K_q8_K`: per sub-block s, d·sc_s·Σ q2·q8 − dmin·m_s·Σ q8, times d8.
pub fn vec_dot_q2_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (wb, xb) in w.chunks_exact(Q2K_BYTES).zip(x.chunks_exact(super::k_quants::Q8K_BYTES)) {
        let (q, d, dmin, sc) = q2_k_codes(wb);
        let (d8, q8, bsums) = q8k_parts(xb);
        let (mut sumi, mut mins) = (0i32, 0i32);
        for s in 0..16 {
            let isum: i32 = (16 * s..16 * (s + 1)).map(|i| q[i] as i32 * q8[i] as i8 as i32).sum();
            sumi += (sc[s] & 0xF) as i32 * isum;
            mins += (sc[s] >> 4) as i32 * i16::from_le_bytes([bsums[2 * s], bsums[2 * s + 1]]) as i32;
        }
        sum += d8 * d * sumi as f32 - d8 * dmin * mins as f32;
    }
    sum
}

// ---------------------------------------------------------------------------------------------
// Q3_K

/// ggml `make_q3_quants` with its least-squares refinement: codes `l + nmax` in [0, 2·nmax)
/// for l in [−nmax, nmax), weighted by x²; returns the scale.
fn make_q3(x: &[f32], nmax: i32, l: &mut [i8]) -> f32 {
    let (amax, max) = super::abs_max(x);
    if amax < GROUP_MAX_EPS {
        l.iter_mut().for_each(|v| *v = 0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for (li, &v) in l.iter_mut().zip(x) {
        let q = nearest(iscale * v).clamp(-nmax, nmax - 1);
        *li = q as i8;
        let w = v * v;
        sumlx += w * v * q as f32;
        suml2 += w * q as f32 * q as f32; // (w·l)·l, ggml's order
    }
    for _ in 0..5 {
        let mut changed = 0;
        for (li, &v) in l.iter_mut().zip(x) {
            let w = v * v;
            let cur = *li as f32;
            let mut slx = sumlx - w * v * cur;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * cur * cur;
                let new = nearest(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new != *li as i32 {
                    slx += w * v * new as f32;
                    sl2 += w * new as f32 * new as f32;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        *li = new as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        changed += 1;
                    }
                }
            }
        }
        if changed == 0 {
            break;
        }
    }
    for li in l.iter_mut() {
        *li += nmax as i8;
    }
    sumlx / suml2
}

/// Sub-block s's 6-bit scale from Q3_K's 12 packed bytes, minus 32.
fn q3_k_scale(sc: &[u8], s: usize) -> i8 {
    let low = if s < 8 { sc[s] & 0xF } else { sc[s - 8] >> 4 };
    (low | (((sc[8 + s % 4] >> (2 * (s / 4))) & 3) << 4)) as i8 - 32
}

/// ggml `quantize_row_q3_K_ref`.
pub fn quantize_q3_k(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / QK * Q3K_BYTES);
    for blk in x.chunks_exact(QK) {
        let mut l = [0i8; QK];
        let mut scales = [0f32; 16];
        for s in 0..16 {
            scales[s] = make_q3(&blk[16 * s..16 * (s + 1)], 4, &mut l[16 * s..16 * (s + 1)]);
        }
        let (_, max_scale) = super::abs_max(&scales);
        let mut sc = [0u8; 12];
        let mut d = f16_le(0.0);
        if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            for (s, &v) in scales.iter().enumerate() {
                let q = ((nearest(iscale * v) as i8).clamp(-32, 31) + 32) as u8;
                if s < 8 {
                    sc[s] = q & 0xF;
                } else {
                    sc[s - 8] |= (q & 0xF) << 4;
                }
                sc[8 + s % 4] |= (q >> 4) << (2 * (s / 4));
            }
            d = f16_le(1.0 / iscale);
        }
        let df = f16_at(&d);
        for s in 0..16 {
            let dd = df * q3_k_scale(&sc, s) as f32;
            if dd == 0.0 {
                continue;
            }
            for i in 16 * s..16 * (s + 1) {
                l[i] = nearest(blk[i] / dd).clamp(-4, 3) as i8 + 4;
            }
        }
        let mut hmask = [0u8; 32];
        let mut low = [0u8; QK];
        for (e, (&q, lo)) in l.iter().zip(low.iter_mut()).enumerate() {
            let q = q as u8;
            if q > 3 {
                hmask[e % 32] |= 1 << (e / 32);
            }
            *lo = q & 3;
        }
        out.extend_from_slice(&hmask);
        out.extend_from_slice(&pack_low_bits(&low));
        out.extend_from_slice(&sc);
        out.extend_from_slice(&d);
    }
    out
}

/// One Q3_K block's codes q (0..7, element order; value (q − 4)·scale), d and its 16 scales
/// (sc − 32).
pub fn q3_k_codes(blk: &[u8]) -> ([u8; QK], f32, [i8; 16]) {
    let (hmask, sc) = (&blk[0..32], &blk[96..108]);
    let mut q = low_bits(&blk[32..96]);
    for (e, v) in q.iter_mut().enumerate() {
        *v |= ((hmask[e % 32] >> (e / 32)) & 1) << 2;
    }
    (q, f16_at(&blk[108..110]), std::array::from_fn(|s| q3_k_scale(sc, s)))
}

pub fn dequantize_q3_k(b: &[u8], out: &mut [f32]) {
    for (blk, o) in b.chunks_exact(Q3K_BYTES).zip(out.chunks_exact_mut(QK)) {
        let (q, d, sc) = q3_k_codes(blk);
        for (e, v) in o.iter_mut().enumerate() {
            *v = d * sc[e / 16] as f32 * (q[e] as i32 - 4) as f32;
        }
    }
}

/// ggml `vec_dot_q3_K_q8_K`: Σ over sub-blocks of 16 of d·(sc − 32)·Σ (q3 − 4)·q8, times d8.
pub fn vec_dot_q3_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (wb, xb) in w.chunks_exact(Q3K_BYTES).zip(x.chunks_exact(super::k_quants::Q8K_BYTES)) {
        let (q, d, sc) = q3_k_codes(wb);
        let (d8, q8, _) = q8k_parts(xb);
        let mut sumi = 0i32;
        for s in 0..16 {
            let isum: i32 = (16 * s..16 * (s + 1)).map(|i| (q[i] as i32 - 4) * q8[i] as i8 as i32).sum();
            sumi += sc[s] as i32 * isum;
        }
        sum += d * d8 * sumi as f32;
    }
    sum
}

/// One Q3_K super-block as the 16-row tiles take it ([`crate::qgemm::Kind::Q3K`]): its codes
/// (0..7) and, per sub-block of 16, the scale `d·(sc − 32)` rounded to f16 (at most 2⁻¹¹
/// relative, as Q6_K's). `None` when a product overflows f16.
pub fn q3_k_halves(blk: &[u8]) -> Option<([u8; QK], [u16; 16])> {
    let (q, d, sc) = q3_k_codes(blk);
    let mut scales = [0u16; 16];
    for (o, &s) in scales.iter_mut().zip(&sc) {
        let h = half::f16::from_f32(d * s as f32);
        if !h.is_finite() {
            return None;
        }
        *o = h.to_bits();
    }
    Some((q, scales))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::GgmlType;

    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = crate::testing::Rng::new(seed);
        let mut x = rng.normals(n, 1.0);
        // Some sub-blocks all positive, one all zero, a few outliers: the quantizers' branches.
        x[..16].iter_mut().for_each(|v| *v = v.abs() + 0.5);
        x[16..32].iter_mut().for_each(|v| *v = 0.0);
        x[300] = 9.0;
        x
    }

    #[test]
    fn integer_dots_equal_the_dot_of_the_dequantized_rows() {
        let n = 4 * QK;
        for (ty, dot) in
            [(GgmlType::Q2_K, vec_dot_q2_k_q8_k as fn(&[u8], &[u8]) -> f32), (GgmlType::Q3_K, vec_dot_q3_k_q8_k)]
        {
            let w = ty.quantize_row(&data(n, 1));
            let x = GgmlType::Q8_K.quantize_row(&data(n, 2));
            let (mut wf, mut xf) = (vec![0f32; n], vec![0f32; n]);
            ty.dequantize_row(&w, &mut wf);
            GgmlType::Q8_K.dequantize_row(&x, &mut xf);
            let want: f64 = wf.iter().zip(&xf).map(|(a, b)| *a as f64 * *b as f64).sum();
            let got = dot(&w, &x) as f64;
            assert!((got - want).abs() < 1e-4 * want.abs().max(1.0), "{}: {got} vs {want}", ty.name());
        }
    }

    #[test]
    fn codes_and_scales_round_trip_through_the_packing() {
        let x = data(2 * QK, 3);
        let b3 = quantize_q3_k(&x);
        for (blk, xs) in b3.chunks_exact(Q3K_BYTES).zip(x.chunks_exact(QK)) {
            let (q, d, sc) = q3_k_codes(blk);
            assert!(q.iter().all(|&v| v < 8) && sc.iter().all(|&s| (-32..32).contains(&s)));
            // Every code is the nearest to its value under its quantized scale (clamped).
            for e in 0..QK {
                let dd = d * sc[e / 16] as f32;
                if dd != 0.0 {
                    assert_eq!(q[e] as i32, nearest(xs[e] / dd).clamp(-4, 3) + 4, "Q3_K element {e}");
                }
            }
        }
        let b2 = quantize_q2_k(&x);
        for (blk, xs) in b2.chunks_exact(Q2K_BYTES).zip(x.chunks_exact(QK)) {
            let (q, d, dmin, sc) = q2_k_codes(blk);
            for e in 0..QK {
                let dd = d * (sc[e / 16] & 0xF) as f32;
                if dd != 0.0 {
                    let m = dmin * (sc[e / 16] >> 4) as f32;
                    assert_eq!(q[e] as i32, nearest((xs[e] + m) / dd).clamp(0, 3), "Q2_K element {e}");
                }
            }
        }
    }

    #[test]
    fn more_bits_track_the_data_better() {
        let x = data(8 * QK, 4);
        let err = |ty: GgmlType| {
            let mut back = vec![0f32; x.len()];
            ty.dequantize_row(&ty.quantize_row(&x), &mut back);
            (x.iter().zip(&back).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>() / x.len() as f64).sqrt()
        };
        let (e2, e3, e4) = (err(GgmlType::Q2_K), err(GgmlType::Q3_K), err(GgmlType::Q4_K));
        assert!(e4 < e3 && e3 < e2 && e2 < 0.5, "rms errors Q2_K {e2}, Q3_K {e3}, Q4_K {e4}");
    }
}
