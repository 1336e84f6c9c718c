//! AVX-512 VNNI and AVX2 paths of [`super::gemm_rows`]: tiles of R weight rows × C tokens, the
//! weight codes unpacked once per tile and reused for every token, per-block float accumulation
//! as in ggml, the offset term added at the end (see the module doc of `qgemm`).

use std::arch::x86_64::*;

use super::acts::{block_scales, RowOut, OFFSET_TERMS};
use super::{array_from, offset_term, tiles, Kind, OutMat, Packed, QActs, BLOCK};

/// Per-row f32 scales and offsets of a row tile.
struct RowScales {
    dw: Vec<f32>,
    mu: Vec<f32>,
    n: usize,
}

impl RowScales {
    fn new(n: usize, rows: usize) -> Self {
        Self { dw: vec![0.0; n * rows], mu: vec![0.0; n * rows], n }
    }
    fn fill(&mut self, w: &Packed, o0: usize, r: usize) {
        let n = self.n;
        for i in 0..r {
            w.row_scales(o0 + i, &mut self.dw[i * n..(i + 1) * n], &mut self.mu[i * n..(i + 1) * n]);
        }
    }
    fn dw(&self, i: usize) -> &[f32] {
        &self.dw[i * self.n..(i + 1) * self.n]
    }
    fn mu(&self, i: usize) -> &[f32] {
        &self.mu[i * self.n..(i + 1) * self.n]
    }
}

// ---------------------------------------------------------------------------------------------
// AVX-512 VNNI: two blocks (64 codes) per vpdpbusd.

/// [a ×8 | b ×8] from two consecutive floats at `p`.
#[inline(always)]
unsafe fn pair_f32(p: *const f32) -> __m512 {
    let two = _mm_castsi128_ps(_mm_loadl_epi64(p as *const __m128i)); // [a, b, 0, 0]
    _mm512_permutexvar_ps(pair_idx(), _mm512_castps128_ps512(two))
}

/// [a ×8 | b ×8] from two consecutive f16 at `p`.
#[inline(always)]
unsafe fn pair_f16(p: *const u16) -> __m512 {
    let two = _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const i32).read_unaligned())); // [a, b, 0, 0]
    _mm512_permutexvar_ps(pair_idx(), _mm512_castps128_ps512(two))
}

#[inline(always)]
unsafe fn pair_idx() -> __m512i {
    _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
}

/// The 64 unsigned codes of block pair `p` of a row: Q4 nibbles or Q8 bytes. Q4: the pair's 32
/// bytes broadcast to both halves, the upper half shifted down a nibble, both masked (three
/// µops, none on the shuffle port).
#[inline(always)]
unsafe fn codes512(kind: Kind, q: *const u8, p: usize) -> __m512i {
    if kind == Kind::Q8_0 {
        _mm512_loadu_epi8(q.add(p * 64) as *const i8)
    } else {
        let v = _mm512_broadcast_i64x4(_mm256_loadu_si256(q.add(p * 32) as *const __m256i));
        let shifted = _mm512_srlv_epi64(v, _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0));
        _mm512_and_si512(shifted, _mm512_set1_epi8(0x0F))
    }
}

/// Index vectors that spread scales 2k and 2k + 1 of a 16-scale vector over lanes 0–7 and 8–15,
/// one per k < 8 (a table: loading one is a load µop; building it from k took shuffle µops).
static PAIR_IDX: [[i32; 16]; 8] = {
    let mut t = [[0i32; 16]; 8];
    let mut k = 0;
    while k < 8 {
        let mut l = 0;
        while l < 16 {
            t[k][l] = 2 * k as i32 + (l / 8) as i32;
            l += 1;
        }
        k += 1;
    }
    t
};

#[inline(always)]
unsafe fn pair_of(k: usize) -> __m512i {
    _mm512_loadu_si512(PAIR_IDX[k].as_ptr() as *const _)
}

/// Row tiles ahead that [`tile512`] prefetches (2 measured best of 1, 2, 4).
const PF_TILES: usize = 2;

/// A prefetch into all cache levels; `p` may point anywhere (a prefetch never faults).
#[inline(always)]
unsafe fn prefetch(p: *const u8) {
    _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
}

/// 16 lanes of 4-byte dot products `Σ u·x` (u unsigned codes, x signed): one vpdpbusd with
/// VNNI; without it vpmaddubsw + vpmaddwd, exact for u ≤ 15 (Q4 codes: no i16 saturation).
#[inline(always)]
unsafe fn dot4<const VNNI: bool>(u: __m512i, x: __m512i) -> __m512i {
    if VNNI {
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, x)
    } else {
        _mm512_madd_epi16(_mm512_maddubs_epi16(u, x), _mm512_set1_epi16(1))
    }
}

/// One tile. Lanes 0–7 of every vector belong to block 2p, lanes 8–15 to block 2p+1, so the
/// offset term folds into the same accumulator: Q4_0 / Q8_0 (μ = −k·d_w) accumulate
/// `d_w · (dot·d_x − (k/8)·s)` per lane; Q4_1 adds `m · s/8` per lane.
///
/// Without VNNI, Q8 codes (u = w + 128, up to 255) would saturate vpmaddubsw's i16 pairs, so
/// they go back to signed w and take the sign trick (|w| · x·sign(w), as ggml's AVX2 code does):
/// the dot is then Σ w·x itself, with no offset term.
#[inline(always)]
unsafe fn tile512<const R: usize, const C: usize, const VNNI: bool>(
    w: &Packed,
    a: &QActs,
    o0: usize,
    t0: usize,
    lo: usize,
    out: OutMat,
) {
    let (rq, n) = (w.row_qs(), w.nbp);
    let kind = w.kind;
    let signed_q8 = !VNNI && kind == Kind::Q8_0;
    let koff = match kind {
        Kind::Q4_0 => -1.0, // −8/8
        Kind::Q8_0 if signed_q8 => 0.0,
        Kind::Q8_0 => -16.0, // −128/8
        Kind::Q4_1 => 0.125,
        Kind::Q5_0 | Kind::Q6K | Kind::Q5K | Kind::Q5_1 | Kind::Q4K | Kind::Q3K | Kind::Q2K | Kind::IQ4NL => {
            unreachable!("Q5 / Q6_K tiles exist only in 16-row groups (gemm_rows_out checks)")
        }
    };
    let koff = _mm512_set1_ps(koff);
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    let qrow: [*const u8; R] = array_from(|i| w.qs.as_ptr().add((o0 + i) * rq));
    let drow: [*const u16; R] = array_from(|i| w.d.as_ptr().add((o0 + i) * n));
    let mrow: [*const u16; R] =
        array_from(|i| if kind == Kind::Q4_1 { w.m.as_ptr().add((o0 + i) * n) } else { std::ptr::null() });
    let xrow: [*const i8; C] = array_from(|c| a.qs.as_ptr().add((t0 + c) * n * BLOCK));
    let dxrow: [*const f32; C] = array_from(|c| a.d.as_ptr().add((t0 + c) * n));
    let srow: [*const f32; C] = array_from(|c| a.s_for(kind, t0 + c).as_ptr());
    // Decode streams every weight byte once from memory, and the hardware prefetcher alone does
    // not run far enough ahead to hide that behind the arithmetic (measured: 64% of the streaming
    // bandwidth without this, ~100% with it; `examples/gemv_stream`). So fetch the codes, scales
    // and mins of the row tile PF_TILES on, at the offset this one is at.
    let qstep = if kind == Kind::Q8_0 { 64 } else { 32 };
    let (mut d16, mut m16) = ([_mm512_setzero_ps(); R], [_mm512_setzero_ps(); R]);
    for p in 0..n / 2 {
        if (p * qstep) % 64 == 0 {
            for &q in qrow.iter() {
                prefetch(q.wrapping_add(PF_TILES * R * rq + p * qstep));
            }
        }
        if (p * 4) % 64 == 0 {
            for i in 0..R {
                prefetch(drow[i].wrapping_add(PF_TILES * R * n + 2 * p) as *const u8);
                if kind == Kind::Q4_1 {
                    prefetch(mrow[i].wrapping_add(PF_TILES * R * n + 2 * p) as *const u8);
                }
            }
        }
        // The rows' scales (and Q4_1 mins) for 8 pairs converted at once, then spread per pair;
        // a last group of fewer than 8 pairs reads them one pair at a time.
        let whole = (p | 7) < n / 2;
        if whole && p % 8 == 0 {
            for i in 0..R {
                d16[i] = _mm512_cvtph_ps(_mm256_loadu_si256(drow[i].add(2 * p) as *const __m256i));
                if kind == Kind::Q4_1 {
                    m16[i] = _mm512_cvtph_ps(_mm256_loadu_si256(mrow[i].add(2 * p) as *const __m256i));
                }
            }
        }
        let idx = pair_of(p % 8);
        let mut wv = [_mm512_setzero_si512(); R];
        let mut ws = [_mm512_setzero_ps(); R];
        let mut wm = [_mm512_setzero_ps(); R];
        let mut wneg = [0u64; R];
        for i in 0..R {
            wv[i] = codes512(kind, qrow[i], p);
            if signed_q8 {
                let sw = _mm512_xor_si512(wv[i], _mm512_set1_epi8(-128));
                wneg[i] = _mm512_movepi8_mask(sw);
                wv[i] = _mm512_abs_epi8(sw);
            }
            ws[i] = if whole { _mm512_permutexvar_ps(idx, d16[i]) } else { pair_f16(drow[i].add(2 * p)) };
            if kind == Kind::Q4_1 {
                wm[i] = if whole { _mm512_permutexvar_ps(idx, m16[i]) } else { pair_f16(mrow[i].add(2 * p)) };
            }
        }
        for c in 0..C {
            let xv = _mm512_loadu_epi8(xrow[c].add(p * 64));
            let xs = pair_f32(dxrow[c].add(2 * p));
            let sv = _mm512_mul_ps(pair_f32(srow[c].add(2 * p)), koff);
            for i in 0..R {
                let xv = if signed_q8 { _mm512_mask_sub_epi8(xv, wneg[i], _mm512_setzero_si512(), xv) } else { xv };
                let dot = _mm512_cvtepi32_ps(dot4::<VNNI>(wv[i], xv));
                if kind == Kind::Q4_1 {
                    acc[i][c] = _mm512_fmadd_ps(ws[i], _mm512_mul_ps(dot, xs), acc[i][c]);
                    acc[i][c] = _mm512_fmadd_ps(wm[i], sv, acc[i][c]);
                } else {
                    acc[i][c] = _mm512_fmadd_ps(ws[i], _mm512_fmadd_ps(dot, xs, sv), acc[i][c]);
                }
            }
        }
    }
    for i in 0..R {
        for c in 0..C {
            out.put(o0 + i - lo, t0 + c, _mm512_reduce_add_ps(acc[i][c]));
        }
    }
}

/// The `r × c` tile at (o0, t0), `r, c ≤ 4` (inlined into each AVX-512 entry point's walk, which
/// sets the target features).
#[inline(always)]
unsafe fn tile512_any<const VNNI: bool>(
    w: &Packed,
    a: &QActs,
    (o0, r, t0, c): (usize, usize, usize, usize),
    lo: usize,
    out: OutMat,
) {
    macro_rules! go {
        ($($rr:literal, $cc:literal);*) => {
            match (r, c) {
                $(($rr, $cc) => tile512::<$rr, $cc, VNNI>(w, a, o0, t0, lo, out),)*
                _ => unreachable!("tiles are at most 4x4"),
            }
        };
    }
    go!(4,4; 4,3; 4,2; 4,1; 3,4; 3,3; 3,2; 3,1; 2,4; 2,3; 2,2; 2,1; 1,4; 1,3; 1,2; 1,1);
}

/// AVX-512 VNNI: one vpdpbusd per block pair and row.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/VNNI, FMA and F16C; `out` must be valid for rows
/// 0..hi − lo and tokens 0..T.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
pub unsafe fn gemm_avx512(w: &Packed, a: &QActs, lo: usize, hi: usize, out: OutMat) {
    tiles(lo, hi, 0..a.t, 4, 4, |o0, r, t0, c| tile512_any::<true>(w, a, (o0, r, t0, c), lo, out));
}

/// AVX-512 without VNNI (Skylake-SP, Cascade Lake parts without it): vpmaddubsw + vpmaddwd.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL, FMA and F16C; `out` as for [`gemm_avx512`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
pub unsafe fn gemm_avx512bw(w: &Packed, a: &QActs, lo: usize, hi: usize, out: OutMat) {
    tiles(lo, hi, 0..a.t, 4, 4, |o0, r, t0, c| tile512_any::<false>(w, a, (o0, r, t0, c), lo, out));
}

// ---------------------------------------------------------------------------------------------
// AVX2: one block (32 codes) per vpmaddubsw + vpmaddwd.

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum256(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Σ over 32 lanes of u·x as 8 i32 lanes; `u` < 128 (Q4 codes), so vpmaddubsw cannot saturate.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_u4(u: __m256i, x: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1))
}

/// Σ over 32 lanes of w·x with w signed (Q8 codes − 128): the sign trick keeps vpmaddubsw exact.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_i8(w: __m256i, x: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1))
}

#[target_feature(enable = "avx2,fma")]
unsafe fn tile256<const R: usize, const C: usize>(
    w: &Packed,
    a: &QActs,
    sc: &RowScales,
    o0: usize,
    t0: usize,
    lo: usize,
    out: OutMat,
) {
    let rq = w.row_qs();
    let q8 = w.kind == Kind::Q8_0;
    let mut acc = [[_mm256_setzero_ps(); C]; R];
    let qrow: [*const u8; R] = array_from(|i| w.qs.as_ptr().add((o0 + i) * rq));
    let xrow: [*const i8; C] = array_from(|c| a.qs.as_ptr().add((t0 + c) * a.nbp * BLOCK));
    let dxrow: [&[f32]; C] = array_from(|c| &a.d[(t0 + c) * a.nbp..(t0 + c + 1) * a.nbp]);
    let m4 = _mm256_set1_epi8(0x0F);
    let flip = _mm256_set1_epi8(-128);
    // As in tile512: fetch the row tile PF_TILES on (codes and scales) while this one computes.
    let qstep = if q8 { 64 } else { 32 };
    for p in 0..w.nbp / 2 {
        if (p * qstep) % 64 == 0 {
            for &q in qrow.iter() {
                prefetch(q.wrapping_add(PF_TILES * R * rq + p * qstep));
            }
        }
        if (p * 4) % 64 == 0 {
            for i in 0..R {
                prefetch(w.d.as_ptr().wrapping_add((o0 + i + PF_TILES * R) * w.nbp + 2 * p) as *const u8);
            }
        }
        let mut wv = [[_mm256_setzero_si256(); 2]; R];
        for i in 0..R {
            wv[i] = if q8 {
                let b0 = _mm256_loadu_si256(qrow[i].add(p * 64) as *const __m256i);
                let b1 = _mm256_loadu_si256(qrow[i].add(p * 64 + 32) as *const __m256i);
                [_mm256_xor_si256(b0, flip), _mm256_xor_si256(b1, flip)] // back to signed codes
            } else {
                let v = _mm256_loadu_si256(qrow[i].add(p * 32) as *const __m256i);
                [_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4)]
            };
        }
        for c in 0..C {
            for h in 0..2 {
                let b = 2 * p + h;
                let xv = _mm256_loadu_si256(xrow[c].add(b * BLOCK) as *const __m256i);
                let dx = dxrow[c][b];
                for i in 0..R {
                    let dot = if q8 { dot_i8(wv[i][h], xv) } else { dot_u4(wv[i][h], xv) };
                    let s = _mm256_set1_ps(sc.dw(i)[b] * dx);
                    acc[i][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[i][c]);
                }
            }
        }
    }
    for i in 0..R {
        for c in 0..C {
            // Q8 here summed the signed codes directly, so it has no offset term.
            let off = if q8 { 0.0 } else { offset_term(sc.mu(i), a.s_for(w.kind, t0 + c)) };
            out.put(o0 + i - lo, t0 + c, hsum256(acc[i][c]) + off);
        }
    }
}

/// # Safety
/// The CPU must support AVX2 and FMA; `out` as for [`gemm_avx512`].
#[target_feature(enable = "avx2,fma")]
pub unsafe fn gemm_avx2(w: &Packed, a: &QActs, lo: usize, hi: usize, out: OutMat) {
    const R: usize = 2;
    const C: usize = 2;
    let mut sc = RowScales::new(w.nbp, R);
    let mut last_o0 = usize::MAX;
    tiles(lo, hi, 0..a.t, R, C, |o0, r, t0, c| {
        if o0 != last_o0 {
            sc.fill(w, o0, r);
            last_o0 = o0;
        }
        match (r, c) {
            (2, 2) => tile256::<2, 2>(w, a, &sc, o0, t0, lo, out),
            (2, 1) => tile256::<2, 1>(w, a, &sc, o0, t0, lo, out),
            (1, 2) => tile256::<1, 2>(w, a, &sc, o0, t0, lo, out),
            (1, 1) => tile256::<1, 1>(w, a, &sc, o0, t0, lo, out),
            _ => unreachable!("tiles are at most {R}x{C}"),
        }
    });
}

// ---------------------------------------------------------------------------------------------
// The activation quantizer: 16 blocks per step on AVX-512, one block per step on AVX2.

/// See `quantize_row_ref`: the same arithmetic, so the same bits (`vcvtps2dq` rounds half to even
/// under the default MXCSR, like the reference's rounding; `vcvtps2ph` rounds to nearest even,
/// like `half`'s conversion). Sixteen blocks a step, each block's reductions (its largest |x|,
/// its two halves' code sums) one lane of a vector ([`fold_lanes16`]), so the scales, the f16
/// roundings and the sums are sixteen blocks' at once; the last `nb mod 16` blocks one at a time.
/// On the Emerald Rapids class host a row of 1024 went from 0.51 to 0.25–0.27 µs, one of 2816
/// from 1.24 to 0.60–0.67 (`examples/gemv_stream 2 24 q4_0 engine jobs-ab`). A decode token
/// quantizes over a hundred rows, most between its pool jobs while the other thread waits; the
/// 370M's 2-thread decode in one process measured 1.000–1.006× with it (`examples/decode_ab`).
///
/// # Safety
/// The CPU must support AVX-512 F/BW.
#[target_feature(enable = "avx512f,avx512bw")]
pub unsafe fn quantize_row512(x: &[f32], mut out: RowOut) {
    let nb = out.blocks_len();
    assert!(x.len() >= nb * BLOCK && out.fits(nb), "activation row shorter than its {nb} blocks");
    let sign = _mm512_set1_ps(-0.0);
    let full = nb / 16 * 16;
    for b0 in (0..full).step_by(16) {
        let xp = x.as_ptr().add(b0 * BLOCK);
        let load = |k: usize, h: usize| _mm512_loadu_ps(xp.add(k * BLOCK + 16 * h));
        let absmax: [__m512; 16] =
            array_from(|k| _mm512_max_ps(_mm512_andnot_ps(sign, load(k, 0)), _mm512_andnot_ps(sign, load(k, 1))));
        // Lane k: block b0 + k's amax, unrounded scale db = amax/127 and id = 127/amax (0 for
        // an all-zero block).
        let amax = fold_lanes16(absmax, |a, b| _mm512_max_ps(a, b));
        let db = _mm512_div_ps(amax, _mm512_set1_ps(127.0));
        let nonzero = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(amax, _mm512_setzero_ps());
        let mut id = [0f32; 16];
        _mm512_storeu_ps(id.as_mut_ptr(), _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(127.0), amax));
        let mut halves = [[_mm512_setzero_ps(); 16]; 2];
        for (k, &idk) in id.iter().enumerate() {
            let idk = _mm512_set1_ps(idk);
            for h in 0..2 {
                let q = _mm512_cvtps_epi32(_mm512_mul_ps(load(k, h), idk));
                let at = out.qs.as_mut_ptr().add((b0 + k) * BLOCK + 16 * h);
                _mm_storeu_si128(at as *mut __m128i, _mm512_cvtsepi32_epi8(q));
                halves[h][k] = _mm512_castsi512_ps(q);
            }
        }
        let add = |a: __m512, b: __m512| {
            _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)))
        };
        let [h0, h1] = halves.map(|h| _mm512_castps_si512(fold_lanes16(h, add)));
        // block_scales, sixteen blocks at once.
        let f16 = |v: __m512| _mm512_cvtph_ps(_mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v));
        let dh = f16(db);
        let isum = _mm512_add_epi32(h0, h1);
        let sum = _mm512_cvtepi32_ps(isum);
        _mm512_storeu_ps(out.d.as_mut_ptr().add(b0), dh);
        _mm512_storeu_ps(out.s.as_mut_ptr().add(b0), _mm512_mul_ps(dh, sum));
        _mm512_storeu_ps(out.s16.as_mut_ptr().add(b0), f16(_mm512_mul_ps(db, sum)));
        let (hs0, hs1) = (_mm512_mul_ps(dh, _mm512_cvtepi32_ps(h0)), _mm512_mul_ps(dh, _mm512_cvtepi32_ps(h1)));
        let lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        let hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
        _mm512_storeu_ps(out.hs.as_mut_ptr().add(2 * b0), _mm512_permutex2var_ps(hs0, lo, hs1));
        _mm512_storeu_ps(out.hs.as_mut_ptr().add(2 * b0 + 16), _mm512_permutex2var_ps(hs0, hi, hs1));
        let [o0, o1] = OFFSET_TERMS.map(|k| _mm512_mullo_epi32(isum, _mm512_set1_epi32(-k)));
        _mm512_storeu_si512(out.offs.as_mut_ptr().add(2 * b0) as *mut _, _mm512_permutex2var_epi32(o0, lo, o1));
        _mm512_storeu_si512(out.offs.as_mut_ptr().add(2 * b0 + 16) as *mut _, _mm512_permutex2var_epi32(o0, hi, o1));
    }
    for b in full..nb {
        let v0 = _mm512_loadu_ps(x.as_ptr().add(b * BLOCK));
        let v1 = _mm512_loadu_ps(x.as_ptr().add(b * BLOCK + 16));
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
        let db = amax / 127.0;
        let id = _mm512_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
        let q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id));
        let q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
        _mm_storeu_si128(out.qs.as_mut_ptr().add(b * BLOCK) as *mut __m128i, _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128(out.qs.as_mut_ptr().add(b * BLOCK + 16) as *mut __m128i, _mm512_cvtsepi32_epi8(q1));
        let half = [_mm512_reduce_add_epi32(q0), _mm512_reduce_add_epi32(q1)];
        block_scales(b, db, half, &mut out);
    }
}

/// Lane k of the result: `op` (associative and commutative: max, integer add) over the 16 lanes
/// of `v[k]`. Four rounds of shuffles, each halving the vectors: pairs within 128-bit lanes
/// (32-bit, then 64-bit interleaves), then across them (`vshuff32x4`), 45 operations where
/// sixteen separate reductions take ~130.
#[inline(always)]
unsafe fn fold_lanes16(v: [__m512; 16], op: impl Fn(__m512, __m512) -> __m512 + Copy) -> __m512 {
    // Each 128-bit lane of s[i]: [a, b, a, b] for a = v[2i], b = v[2i + 1], each over two of
    // the lane's four elements.
    let s: [__m512; 8] =
        array_from(|i| op(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1])));
    // Each 128-bit lane of u[i]: v[4i..4i + 4], each over the lane's four elements.
    let u: [__m512; 4] = array_from(|i| {
        let (a, b) = (_mm512_castps_pd(s[2 * i]), _mm512_castps_pd(s[2 * i + 1]));
        op(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)))
    });
    // w[i]: v[8i..8i + 4] over lanes 0–1, over lanes 2–3, then v[8i + 4..8i + 8] the same.
    let w: [__m512; 2] = array_from(|i| {
        let (a, b) = (u[2 * i], u[2 * i + 1]);
        op(_mm512_shuffle_f32x4::<0b10_00_10_00>(a, b), _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b))
    });
    op(_mm512_shuffle_f32x4::<0b10_00_10_00>(w[0], w[1]), _mm512_shuffle_f32x4::<0b11_01_11_01>(w[0], w[1]))
}

/// [`quantize_row512`] on 256-bit registers (AVX2 CPUs): the same arithmetic, so the same bits.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn quantize_row256(x: &[f32], mut out: RowOut) {
    let nb = out.blocks_len();
    assert!(x.len() >= nb * BLOCK && out.fits(nb), "activation row shorter than its {nb} blocks");
    let sign = _mm256_set1_ps(-0.0);
    // Lane order after the two saturating packs: 32-bit lanes 0, 4, 1, 5, 2, 6, 3, 7.
    let unpermute = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let hsum = |v: __m256i| {
        let h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let h = _mm_add_epi32(h, _mm_shuffle_epi32::<0b01_00_11_10>(h));
        _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32::<0b10_11_00_01>(h)))
    };
    for b in 0..nb {
        let v: [__m256; 4] = array_from(|i| _mm256_loadu_ps(x.as_ptr().add(b * BLOCK + 8 * i)));
        let m: [__m256; 4] = array_from(|i| _mm256_andnot_ps(sign, v[i]));
        let m = _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3]));
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<0b01>(m, m)));
        let db = amax / 127.0;
        let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
        let q: [__m256i; 4] = array_from(|i| _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id)));
        let bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256(
            out.qs.as_mut_ptr().add(b * BLOCK) as *mut __m256i,
            _mm256_permutevar8x32_epi32(bytes, unpermute),
        );
        let half = [hsum(_mm256_add_epi32(q[0], q[1])), hsum(_mm256_add_epi32(q[2], q[3]))];
        block_scales(b, db, half, &mut out);
    }
}
