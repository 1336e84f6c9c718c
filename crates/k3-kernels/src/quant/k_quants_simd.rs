//! AVX2 forms of the K-quant dots ([`super::k_quants::vec_dot_q4_k_q8_k`],
//! [`super::k_quants::vec_dot_q6_k_q8_k`]): the same integer sums per sub-block and the same float
//! arithmetic per super-block, so they equal the scalar references up to float rounding of the
//! per-block terms. `maddubs` multiplies the unsigned weight codes (Q4_K: 0..15, Q6_K: 0..63)
//! by the signed activation codes and adds pairs into i16 (at most 2·63·128 = 16128, no
//! saturation); `madd` then weights the pairs by the sub-block scales into i32. Q6_K's −32 offset
//! comes from the Q8_K block sums (Σ (q − 32)·x = Σ q·x − 32·Σ x), as in ggml.

use super::float::f16_at;
use super::k_quants::{q8k_parts, scale_min_k4, Q4K_BYTES, Q6K_BYTES, Q8K_BYTES};

/// Dispatch: AVX2 when the CPU has it (and `K3MINI_ISA` allows it), else the scalar reference.
pub fn vec_dot_q4_k(w: &[u8], x: &[u8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::qgemm::Isa::best() >= crate::qgemm::Isa::Avx2 {
        // SAFETY: AVX2 is present (Isa::best checks it).
        return unsafe { x86::q4_k(w, x) };
    }
    super::k_quants::vec_dot_q4_k_q8_k(w, x)
}

/// Dispatch, as [`vec_dot_q4_k`].
pub fn vec_dot_q6_k(w: &[u8], x: &[u8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::qgemm::Isa::best() >= crate::qgemm::Isa::Avx2 {
        // SAFETY: as above.
        return unsafe { x86::q6_k(w, x) };
    }
    super::k_quants::vec_dot_q6_k_q8_k(w, x)
}

/// Q8_K block sum `g` (of 16 codes) from the bytes [`q8k_parts`] returns.
fn bsum(bsums: &[u8], g: usize) -> i32 {
    i16::from_le_bytes([bsums[2 * g], bsums[2 * g + 1]]) as i32
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn hsum_i32(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        _mm_cvtsi128_si32(s)
    }

    /// # Safety
    /// The CPU must support AVX2; `w` and `x` hold the same number of super-blocks.
    #[target_feature(enable = "avx2")]
    pub unsafe fn q4_k(w: &[u8], x: &[u8]) -> f32 {
        let mask = _mm256_set1_epi8(0x0F);
        let mut sum = 0f32;
        for (wb, xb) in w.chunks_exact(Q4K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
            let (d, dmin, sc, qs) = (f16_at(&wb[0..2]), f16_at(&wb[2..4]), &wb[4..16], &wb[16..]);
            let (d8, q8, bs) = q8k_parts(xb);
            let q8 = q8.as_ptr();
            let mut acc = _mm256_setzero_si256();
            let mut mins = 0i32;
            for j2 in 0..4 {
                // 32 bytes: low nibbles are sub-block 2·j2, high nibbles sub-block 2·j2 + 1.
                let (s1, m1) = scale_min_k4(2 * j2, sc);
                let (s2, m2) = scale_min_k4(2 * j2 + 1, sc);
                let q = _mm256_loadu_si256(qs.as_ptr().add(32 * j2) as *const __m256i);
                let lo = _mm256_and_si256(q, mask);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), mask);
                let xa = _mm256_loadu_si256(q8.add(64 * j2) as *const __m256i);
                let xb2 = _mm256_loadu_si256(q8.add(64 * j2 + 32) as *const __m256i);
                let pa = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xa), _mm256_set1_epi16(s1 as i16));
                let pb = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xb2), _mm256_set1_epi16(s2 as i16));
                acc = _mm256_add_epi32(acc, _mm256_add_epi32(pa, pb));
                mins += m1 as i32 * (bsum(bs, 4 * j2) + bsum(bs, 4 * j2 + 1))
                    + m2 as i32 * (bsum(bs, 4 * j2 + 2) + bsum(bs, 4 * j2 + 3));
            }
            sum += d8 * (d * hsum_i32(acc) as f32 - dmin * mins as f32);
        }
        sum
    }

    /// # Safety
    /// As [`q4_k`].
    #[target_feature(enable = "avx2")]
    pub unsafe fn q6_k(w: &[u8], x: &[u8]) -> f32 {
        let (m4, m2) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x03));
        let mut sum = 0f32;
        for (wb, xb) in w.chunks_exact(Q6K_BYTES).zip(x.chunks_exact(Q8K_BYTES)) {
            let (ql, qh, sc) = (wb[0..128].as_ptr(), wb[128..192].as_ptr(), &wb[192..208]);
            let (d8, q8, bs) = q8k_parts(xb);
            let q8 = q8.as_ptr();
            let mut acc = _mm256_setzero_si256();
            for h in 0..2 {
                // 32 positions i of each quarter of this half: codes (6 bits, unsigned).
                let a = _mm256_loadu_si256(ql.add(64 * h) as *const __m256i);
                let b = _mm256_loadu_si256(ql.add(64 * h + 32) as *const __m256i);
                let hb = _mm256_loadu_si256(qh.add(32 * h) as *const __m256i);
                // ((hb >> 2i) & 3) << 4 per byte (16-bit shifts, then the byte mask).
                let high = |v: __m256i| _mm256_slli_epi16::<4>(_mm256_and_si256(v, m2));
                let codes = [
                    _mm256_or_si256(_mm256_and_si256(a, m4), high(hb)),
                    _mm256_or_si256(_mm256_and_si256(b, m4), high(_mm256_srli_epi16::<2>(hb))),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(a), m4), high(_mm256_srli_epi16::<4>(hb))),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(b), m4), high(_mm256_srli_epi16::<6>(hb))),
                ];
                for (quarter, q) in codes.iter().enumerate() {
                    // Elements 128h + 32·quarter .. +32: sub-blocks g and g + 1 of 16.
                    let e0 = 128 * h + 32 * quarter;
                    let g = e0 / 16;
                    let xv = _mm256_loadu_si256(q8.add(e0) as *const __m256i);
                    let (s0, s1) = (sc[g] as i8 as i16, sc[g + 1] as i8 as i16);
                    let scales = _mm256_setr_epi16(s0, s0, s0, s0, s0, s0, s0, s0, s1, s1, s1, s1, s1, s1, s1, s1);
                    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(*q, xv), scales));
                }
            }
            let offset: i32 = (0..16).map(|g| sc[g] as i8 as i32 * bsum(bs, g)).sum::<i32>() * 32;
            sum += f16_at(&wb[208..210]) * d8 * (hsum_i32(acc) - offset) as f32;
        }
        sum
    }
}

#[cfg(test)]
mod tests {
    use super::super::k_quants::*;
    use super::*;
    use crate::testing::Rng;

    #[test]
    fn simd_k_quant_dots_match_the_references() {
        // Every path this CPU has against the scalar reference, on rows with uneven sub-block
        // magnitudes and extreme activations (codes at ±127, all-equal blocks).
        let mut rng = Rng::new(17);
        for blocks in [1, 3, 8] {
            let n = blocks * QK;
            let mut w = rng.normals(n, 1.0);
            w.iter_mut().enumerate().for_each(|(i, v)| *v *= 1.0 + (i / 16 % 7) as f32);
            let mut xs = vec![rng.normals(n, 1.0), vec![0.5; n]];
            xs[1][7] = -40.0;
            for x in &xs {
                let xq = quantize_q8_k(x);
                for (name, wq, reference, fast) in [
                    (
                        "Q4_K",
                        quantize_q4_k(&w),
                        vec_dot_q4_k_q8_k as fn(&[u8], &[u8]) -> f32,
                        vec_dot_q4_k as fn(&[u8], &[u8]) -> f32,
                    ),
                    ("Q6_K", quantize_q6_k(&w), vec_dot_q6_k_q8_k, vec_dot_q6_k),
                ] {
                    let want = reference(&wq, &xq);
                    let got = fast(&wq, &xq);
                    assert!(
                        (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                        "{name} x{blocks}: {got} vs the reference's {want}"
                    );
                    #[cfg(target_arch = "x86_64")]
                    if is_x86_feature_detected!("avx2") {
                        // SAFETY: AVX2 is present.
                        let direct = unsafe {
                            if name == "Q4_K" {
                                x86::q4_k(&wq, &xq)
                            } else {
                                x86::q6_k(&wq, &xq)
                            }
                        };
                        assert!((direct - want).abs() <= 1e-5 * want.abs().max(1.0), "{name} avx2: {direct} vs {want}");
                    }
                }
            }
        }
    }
}
