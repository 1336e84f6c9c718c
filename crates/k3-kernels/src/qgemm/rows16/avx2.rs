//! The 16-row tiles on AVX2 (no AVX-512): the AVX-512 tiles' arithmetic on 256-bit halves, and
//! the unpacking of a row group's codes for prefill.

use std::arch::x86_64::*;

use super::super::array_from;
use super::avx512::TileArgs;
use super::{Operands, Scaling, BLOCK, GROUP_BLOCK, GROUP_BLOCK_Q8, PLANE, ROWS};

/// Row lanes 0..16 of two 8-lane halves, written to the valid rows of token t.
#[inline(always)]
unsafe fn store(acc: &[__m256; 2], valid: usize, orow: usize, t: usize, out: super::OutMat) {
    let mut lanes = [0f32; ROWS];
    _mm256_storeu_ps(lanes.as_mut_ptr(), acc[0]);
    _mm256_storeu_ps(lanes.as_mut_ptr().add(8), acc[1]);
    for (r, &v) in lanes.iter().enumerate().take(valid) {
        out.put(orow + r, t, v);
    }
}

/// 32 bits of a plane mask as 32 bytes: `bit` where the mask bit is set, else 0.
#[inline(always)]
unsafe fn plane_bytes(mask: u32, bit: __m256i) -> __m256i {
    // Byte i takes mask byte i / 8 (each 128-bit lane holds all four), then tests bit i % 8.
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(mask as i32),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0),
    );
    let sel = _mm256_set1_epi64x(0x8040201008040201u64 as i64);
    _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, sel), sel), bit)
}

/// Group j's (and j + 4's) codes of one block as bytes, rows 0–7 and 8–15: codes 4j..4j + 4
/// of each row, and codes 16 + 4j..16 + 4j + 4, their P high bits added from the planes.
#[inline(always)]
unsafe fn codes<const P: usize>(qb: *const u8, j: usize, nib: __m256i) -> ([__m256i; 2], [__m256i; 2]) {
    let planes = qb.add(GROUP_BLOCK) as *const u32;
    let v: [__m256i; 2] = array_from(|h| _mm256_loadu_si256(qb.add(j * 64 + 32 * h) as *const _));
    let mut lo4: [__m256i; 2] = array_from(|h| _mm256_and_si256(v[h], nib));
    let mut hi4: [__m256i; 2] = array_from(|h| _mm256_and_si256(_mm256_srli_epi16::<4>(v[h]), nib));
    for p in 0..P {
        let bit = _mm256_set1_epi8(16 << p);
        for h in 0..2 {
            // Group j's and j + 4's masks, rows 8h..8h + 8.
            let (ml, mh) = (planes.add(2 * (j * P + p) + h), planes.add(2 * ((4 + j) * P + p) + h));
            lo4[h] = _mm256_or_si256(lo4[h], plane_bytes(ml.read_unaligned(), bit));
            hi4[h] = _mm256_or_si256(hi4[h], plane_bytes(mh.read_unaligned(), bit));
        }
    }
    (lo4, hi4)
}

/// Registers a block of one row group takes unpacked: per group j, its [`codes`].
pub(super) const UNPACKED_PER_BLOCK: usize = 16;

/// Row group r0 / 16's codes, every block, unpacked by [`codes`] into `out`
/// ([`UNPACKED_PER_BLOCK`] registers a block), for [`tile`] with `U`.
#[inline(always)]
pub(super) unsafe fn unpack_group<const P: usize>(w: &super::Packed, r0: usize, out: &mut [__m256i]) {
    let q = w.qs.as_ptr().add(r0 / ROWS * w.nbp * super::group_block(w.kind));
    let nib = _mm256_set1_epi8(0x0F);
    for (b, out) in out.chunks_exact_mut(UNPACKED_PER_BLOCK).enumerate().take(w.nbp) {
        let qb = q.add(b * super::group_block(w.kind));
        for j in 0..4 {
            let (lo4, hi4) = codes::<P>(qb, j, nib);
            for (k, v) in [lo4[0], lo4[1], hi4[0], hi4[1]].into_iter().enumerate() {
                _mm256_store_si256(&mut out[4 * j + k], v);
            }
        }
    }
}

/// The nibble kinds with P high-bit planes: [`super::avx512::tile`] without VNNI, on two halves.
/// Q4 sums its eight group products in 16-bit lanes (with `H`, the kinds whose scales change
/// every 16 codes, codes 0..16 and 16..32 in their own sets); with planes the codes reach 63,
/// so each product is widened to 32 bits, codes 0..16 and 16..32 in their own sets. With `U`
/// the codes come unpacked from `unpacked` ([`unpack_group`]'s bytes for this row group).
#[inline(always)]
pub(super) unsafe fn tile<const C: usize, const P: usize, const H: bool, const U: bool>(
    (w, a, r0, t0, valid, orow, out): TileArgs,
    unpacked: *const __m256i,
) {
    let ops = Operands::<C>::new(w, a, r0, t0);
    let Operands { n, d, m, xq, dx, sx, .. } = ops;
    let scaling = Scaling::of(w.kind);
    let (nib, ones) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi16(1));
    let mut acc = [[_mm256_setzero_ps(); 2]; C];
    // Q4_K, Q2_K: the current super-block's d (rows 0–7, 8–15) and −dmin (the same).
    let mut sup = [_mm256_setzero_ps(); 4];
    for b in 0..n {
        let qb = if U {
            std::ptr::null()
        } else {
            ops.scales_ahead(b, GROUP_BLOCK + P * PLANE, matches!(scaling, Scaling::Min | Scaling::Halves(_)));
            ops.block(b, GROUP_BLOCK + P * PLANE)
        };
        let (mut isum, mut isum2) = ([[_mm256_setzero_si256(); 2]; C], [[_mm256_setzero_si256(); 2]; C]);
        for j in 0..4 {
            let (lo4, hi4) = if U {
                let u = unpacked.add((b * 4 + j) * 4);
                (
                    [_mm256_load_si256(u), _mm256_load_si256(u.add(1))],
                    [_mm256_load_si256(u.add(2)), _mm256_load_si256(u.add(3))],
                )
            } else {
                codes::<P>(qb, j, nib)
            };
            for c in 0..C {
                let xa = _mm256_set1_epi32((xq[c].add(b * BLOCK + 4 * j) as *const i32).read_unaligned());
                let xb = _mm256_set1_epi32((xq[c].add(b * BLOCK + 16 + 4 * j) as *const i32).read_unaligned());
                for h in 0..2 {
                    let (pa, pb) = (_mm256_maddubs_epi16(lo4[h], xa), _mm256_maddubs_epi16(hi4[h], xb));
                    if P == 0 && !H {
                        isum[c][h] = _mm256_add_epi16(isum[c][h], _mm256_add_epi16(pa, pb));
                    } else if P == 0 {
                        // Codes ≤ 7: four groups of two products stay within 16 bits.
                        isum[c][h] = _mm256_add_epi16(isum[c][h], pa);
                        isum2[c][h] = _mm256_add_epi16(isum2[c][h], pb);
                    } else {
                        isum[c][h] = _mm256_add_epi32(isum[c][h], _mm256_madd_epi16(pa, ones));
                        isum2[c][h] = _mm256_add_epi32(isum2[c][h], _mm256_madd_epi16(pb, ones));
                    }
                }
            }
        }
        let half =
            |p: *const u16, h: usize| _mm256_cvtph_ps(_mm_loadu_si128(p.add(b * ROWS + 8 * h) as *const __m128i));
        let super_block = matches!(scaling, Scaling::SuperMin | Scaling::SuperMinHalves);
        if super_block && b % 8 == 0 {
            // This super-block's d and −dmin, 16 rows each.
            let at = (b / 8) * 2 * ROWS;
            let f = |o: usize| _mm256_cvtph_ps(_mm_loadu_si128(m.add(o) as *const __m128i));
            sup = [f(at), f(at + 8), f(at + ROWS), f(at + ROWS + 8)];
            sup[2] = _mm256_sub_ps(_mm256_setzero_ps(), sup[2]);
            sup[3] = _mm256_sub_ps(_mm256_setzero_ps(), sup[3]);
        }
        // Each block's scale and min (or offset scale) per row lane; Q2_K's second half's in
        // `wd2`, `wm2`.
        let (mut wd2, mut wm2) = ([_mm256_setzero_ps(); 2], [_mm256_setzero_ps(); 2]);
        let (wd, wm) = if super_block {
            let pair = |h: usize| _mm256_cvtepu16_epi32(_mm_loadu_si128(d.add(b * ROWS + 8 * h) as *const __m128i));
            let (p0, p1) = (pair(0), pair(1));
            let field = |p: __m256i, shift: i32, mask: i32| {
                _mm256_cvtepi32_ps(_mm256_and_si256(
                    _mm256_srlv_epi32(p, _mm256_set1_epi32(shift)),
                    _mm256_set1_epi32(mask),
                ))
            };
            if scaling == Scaling::SuperMin {
                (
                    [_mm256_mul_ps(field(p0, 0, 0xFF), sup[0]), _mm256_mul_ps(field(p1, 0, 0xFF), sup[1])],
                    [_mm256_mul_ps(field(p0, 8, 0xFF), sup[2]), _mm256_mul_ps(field(p1, 8, 0xFF), sup[3])],
                )
            } else {
                // Q2_K: scale | min << 4 of the first half in the low byte, the second's above.
                wd2 = [_mm256_mul_ps(field(p0, 8, 0xF), sup[0]), _mm256_mul_ps(field(p1, 8, 0xF), sup[1])];
                wm2 = [_mm256_mul_ps(field(p0, 12, 0xF), sup[2]), _mm256_mul_ps(field(p1, 12, 0xF), sup[3])];
                (
                    [_mm256_mul_ps(field(p0, 0, 0xF), sup[0]), _mm256_mul_ps(field(p1, 0, 0xF), sup[1])],
                    [_mm256_mul_ps(field(p0, 4, 0xF), sup[2]), _mm256_mul_ps(field(p1, 4, 0xF), sup[3])],
                )
            }
        } else {
            let wd = [half(d, 0), half(d, 1)];
            (wd, if matches!(scaling, Scaling::Min | Scaling::Halves(_)) { [half(m, 0), half(m, 1)] } else { wd })
        };
        for c in 0..C {
            let dxb = _mm256_set1_ps(*dx[c].add(b));
            for h in 0..2 {
                if H {
                    let (dot0, dot1) = if P == 0 {
                        (_mm256_madd_epi16(isum[c][h], ones), _mm256_madd_epi16(isum2[c][h], ones))
                    } else {
                        (isum[c][h], isum2[c][h])
                    };
                    let (dot0, dot1) = (_mm256_cvtepi32_ps(dot0), _mm256_cvtepi32_ps(dot1));
                    let (s0, s1) = (*sx[c].add(2 * b), *sx[c].add(2 * b + 1));
                    if let Scaling::Halves(k) = scaling {
                        let lo = _mm256_fmadd_ps(dot0, dxb, _mm256_set1_ps(k * s0));
                        let hi = _mm256_fmadd_ps(dot1, dxb, _mm256_set1_ps(k * s1));
                        acc[c][h] = _mm256_fmadd_ps(wd[h], lo, acc[c][h]);
                        acc[c][h] = _mm256_fmadd_ps(wm[h], hi, acc[c][h]);
                    } else {
                        acc[c][h] = _mm256_fmadd_ps(wd[h], _mm256_mul_ps(dot0, dxb), acc[c][h]);
                        acc[c][h] = _mm256_fmadd_ps(wd2[h], _mm256_mul_ps(dot1, dxb), acc[c][h]);
                        acc[c][h] = _mm256_fmadd_ps(wm[h], _mm256_set1_ps(s0), acc[c][h]);
                        acc[c][h] = _mm256_fmadd_ps(wm2[h], _mm256_set1_ps(s1), acc[c][h]);
                    }
                    continue;
                }
                let dot = if P == 0 {
                    _mm256_cvtepi32_ps(_mm256_madd_epi16(isum[c][h], ones))
                } else {
                    _mm256_cvtepi32_ps(_mm256_add_epi32(isum[c][h], isum2[c][h]))
                };
                let sb = *sx[c].add(b);
                if let Scaling::Offset(k) = scaling {
                    let t = _mm256_fmadd_ps(dot, dxb, _mm256_set1_ps(k * sb));
                    acc[c][h] = _mm256_fmadd_ps(wd[h], t, acc[c][h]);
                } else {
                    acc[c][h] = _mm256_fmadd_ps(wd[h], _mm256_mul_ps(dot, dxb), acc[c][h]);
                    acc[c][h] = _mm256_fmadd_ps(wm[h], _mm256_set1_ps(sb), acc[c][h]);
                }
            }
        }
    }
    for (c, acc) in acc.iter().enumerate() {
        store(acc, valid, orow, t0 + c, out);
    }
}

/// Group j's (< 8) signed codes of one block, rows 0–7 and 8–15, from a group-block at `qb`: Q8_0's
/// stored bytes, or (`NL`) IQ4_NL's nibbles looked up in the table; both flipped back to signed.
#[inline(always)]
unsafe fn signed_q8<const NL: bool>(qb: *const u8, j: usize) -> [__m256i; 2] {
    let (flip, low) = (_mm256_set1_epi8(-128), _mm256_set1_epi8(0x0F));
    let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(super::super::NL_CODES.as_ptr() as *const _));
    array_from(|h| {
        let u = if NL {
            let v = _mm256_loadu_si256(qb.add((j % 4) * 64 + 32 * h) as *const _);
            let v = if j < 4 { v } else { _mm256_srli_epi16(v, 4) };
            _mm256_shuffle_epi8(table, _mm256_and_si256(v, low))
        } else {
            _mm256_loadu_si256(qb.add(j * 64 + 32 * h) as *const _)
        };
        _mm256_xor_si256(u, flip)
    })
}

/// Registers a block of one row group takes unpacked for [`tile_q8`] with `U`: per 4-code group j
/// and half h, the signed codes and their magnitudes.
pub(super) const UNPACKED_Q8_PER_BLOCK: usize = 32;

/// Row group r0 / 16's byte codes (Q8_0, or with `NL` IQ4_NL's looked up), every block, as
/// [`tile_q8`] with `U` reads them: `[b][j][h][signed, |signed|]`.
#[inline(always)]
pub(super) unsafe fn unpack_group_q8<const NL: bool>(w: &super::Packed, r0: usize, out: &mut [__m256i]) {
    let gb = super::group_block(w.kind);
    let q = w.qs.as_ptr().add(r0 / ROWS * w.nbp * gb);
    for (b, out) in out.chunks_exact_mut(UNPACKED_Q8_PER_BLOCK).enumerate().take(w.nbp) {
        for j in 0..8 {
            for (h, v) in signed_q8::<NL>(q.add(b * gb), j).into_iter().enumerate() {
                _mm256_store_si256(&mut out[j * 4 + 2 * h], v);
                _mm256_store_si256(&mut out[j * 4 + 2 * h + 1], _mm256_abs_epi8(v));
            }
        }
    }
}

/// Q8_0: [`super::avx512::tile_q8`] without VNNI, on two halves (vpsignb for the sign trick); with
/// `NL` (IQ4_NL) the codes are nibbles looked up in the table as there. With `U` the signed codes
/// and their magnitudes come from `unpacked` ([`unpack_group_q8`]'s for this row group).
#[inline(always)]
pub(super) unsafe fn tile_q8<const C: usize, const NL: bool, const U: bool>(
    (w, a, r0, t0, valid, orow, out): TileArgs,
    unpacked: *const __m256i,
) {
    let ops = Operands::<C>::new(w, a, r0, t0);
    let Operands { n, d, xq, dx, .. } = ops;
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); 2]; C];
    for b in 0..n {
        let qb = if U {
            std::ptr::null()
        } else {
            let qb = ops.block(b, if NL { GROUP_BLOCK } else { GROUP_BLOCK_Q8 });
            ops.scales_ahead(b, if NL { GROUP_BLOCK } else { GROUP_BLOCK_Q8 }, false);
            qb
        };
        let mut isum = [[_mm256_setzero_si256(); 2]; C];
        for j in 0..8 {
            // Signed codes; |w| (−128 stays 128 as an unsigned byte) and x·sign(w).
            let (v, mag) = if U {
                let p = unpacked.add(b * UNPACKED_Q8_PER_BLOCK + j * 4);
                (
                    [_mm256_load_si256(p), _mm256_load_si256(p.add(2))],
                    [_mm256_load_si256(p.add(1)), _mm256_load_si256(p.add(3))],
                )
            } else {
                let v = signed_q8::<NL>(qb, j);
                (v, array_from(|h| _mm256_abs_epi8(v[h])))
            };
            for c in 0..C {
                let x = _mm256_set1_epi32((xq[c].add(b * BLOCK + 4 * j) as *const i32).read_unaligned());
                for h in 0..2 {
                    let p = _mm256_maddubs_epi16(mag[h], _mm256_sign_epi8(x, v[h]));
                    isum[c][h] = _mm256_add_epi32(isum[c][h], _mm256_madd_epi16(p, ones));
                }
            }
        }
        let half =
            |p: *const u16, h: usize| _mm256_cvtph_ps(_mm_loadu_si128(p.add(b * ROWS + 8 * h) as *const __m128i));
        let wd = [half(d, 0), half(d, 1)];
        for c in 0..C {
            let dxb = _mm256_set1_ps(*dx[c].add(b));
            for h in 0..2 {
                let t = _mm256_mul_ps(_mm256_cvtepi32_ps(isum[c][h]), dxb);
                acc[c][h] = _mm256_fmadd_ps(wd[h], t, acc[c][h]);
            }
        }
    }
    for (c, acc) in acc.iter().enumerate() {
        store(acc, valid, orow, t0 + c, out);
    }
}
