//! The 16-row tiles on AVX-512, with VNNI (vpdpbusd) and without (vpmaddubsw / vpmaddwd).

use std::arch::x86_64::*;

use super::super::array_from;
use super::{
    offset_terms, Operands, OutMat, Packed, QActs, Scaling, BLOCK, GROUP_BLOCK, GROUP_BLOCK_Q8, PF_BYTES, PLANE, ROWS,
};

/// (matrix, activations, first row of the group, first token, valid rows, output row of the
/// group's first row, output).
pub(super) type TileArgs<'a> = (&'a Packed, &'a QActs, usize, usize, usize, usize, OutMat);

/// The row groups one tile walks in lockstep, `G` of them (each 16 rows from `r0[g]`, of which
/// `valid[g]` exist), for tokens t0..t0 + C; output row `o − lo` holds weight row o.
#[derive(Clone, Copy)]
pub(super) struct Groups<'a, const G: usize> {
    pub w: &'a Packed,
    pub a: &'a QActs,
    pub r0: [usize; G],
    pub valid: [usize; G],
    pub t0: usize,
    pub lo: usize,
    pub out: OutMat,
}

impl<'a> Groups<'a, 1> {
    /// The one group of a [`TileArgs`].
    #[inline(always)]
    pub(super) fn one((w, a, r0, t0, valid, orow, out): TileArgs<'a>) -> Self {
        Groups { w, a, r0: [r0], valid: [valid], t0, lo: r0 - orow, out }
    }
}

impl<const G: usize> Groups<'_, G> {
    /// Each group's row lanes for each token (`acc[g][c]`) into the output's valid rows.
    #[inline(always)]
    unsafe fn store<const C: usize>(&self, acc: &[[__m512; C]; G]) {
        // Rows one float apart (the engine's token-major outputs): each group's lanes as one
        // masked store instead of sixteen scalar ones, which weigh most in products with short
        // rows (a mixture's down experts: +2–3% on a one-token 1024 × 256 product in L2, Zen 4).
        if self.out.rs == 1 {
            for g in 0..G {
                let mask: __mmask16 = if self.valid[g] >= ROWS { !0 } else { (1u16 << self.valid[g]) - 1 };
                for (c, &v) in acc[g].iter().enumerate() {
                    _mm512_mask_storeu_ps(self.out.at(self.r0[g] - self.lo, self.t0 + c), mask, v);
                }
            }
            return;
        }
        let mut lanes = [0f32; ROWS];
        for g in 0..G {
            for (c, &v) in acc[g].iter().enumerate() {
                _mm512_storeu_ps(lanes.as_mut_ptr(), v);
                for (r, &x) in lanes.iter().enumerate().take(self.valid[g]) {
                    self.out.put(self.r0[g] - self.lo + r, self.t0 + c, x);
                }
            }
        }
    }
}

/// 16 rows × C tokens over every block of a nibble kind with P high-bit planes, for each of G
/// row groups in lockstep (decode walks four: four streams from memory at once, where one
/// left the core's prefetchers idle half the time; one where there are several tokens): per
/// block, the eight 4-code group products, each group's codes completed by one masked byte add
/// per plane; summed (with VNNI) in two sets of 32-bit lanes, codes 0..16 and 16..32; without
/// VNNI, Q4's in 16-bit lanes (with `H`, the kinds whose scales change every 16 codes, in two
/// sets) and the wider codes' widened to 32 bits per product. Then per row lane
/// `d_w·(d_x·dot + k·s)` (Q4_0 k = −8, Q5_0 −16), `d_w·d_x·dot + m·s` (Q4_1, Q5_1, Q5_K;
/// Q4_K with `SUP`, its `d_w = d·sc` and `m = −dmin·mn` formed per block from the byte pairs
/// and the super-block's scales) or, a half block each (`H`),
/// `d·(d_x·dot₀ + k·s₀) + m·(d_x·dot₁ + k·s₁)` (Q6_K k = −32, Q3_K −4) or, with `SUP` too,
/// `Σ_h d_h·d_x·dot_h + m_h·s_h` (Q2_K, each half's scale and min formed as Q4_K's).
#[inline(always)]
pub(super) unsafe fn tile<
    const C: usize,
    const G: usize,
    const VNNI: bool,
    const P: usize,
    const SUP: bool,
    const H: bool,
>(
    gs: Groups<G>,
) {
    let (w, a) = (gs.w, gs.a);
    let ops: [Operands<C>; G] = array_from(
        #[inline(always)]
        |g| Operands::<C>::new(w, a, gs.r0[g], gs.t0),
    );
    let Operands { n, xq, dx, sx, .. } = ops[0];
    // Super-block scales (Q4_K, Q2_K) known at compile time, so the other kinds' tiles carry
    // none of their work.
    let scaling = match (SUP, H) {
        (true, false) => Scaling::SuperMin,
        (true, true) => Scaling::SuperMinHalves,
        _ => Scaling::of(w.kind),
    };
    let has_m = matches!(scaling, Scaling::Min | Scaling::Halves(_));
    // One token, with VNNI and no planes: the high nibbles stay in place (16 × each code, ≤ 240:
    // still an unsigned byte), one AND a group instead of a shift and an AND, and one shift per
    // block of the high codes' sums, which are then exact multiples of 16 (+8% on a hot 7 MiB
    // Q4_0 GEMV, Zen 4). With several tokens a group's shift is shared by all of them while the
    // per-block shift and add are per token, so they take the codes in place instead.
    let x16 = VNNI && P == 0 && C == 1;
    // With VNNI and one scale a block, the low and high codes' products go into one set of
    // 32-bit lanes when there are enough tokens to keep several vpdpbusd chains in flight: no
    // per-block add of the two sets for each token.
    let one_set = VNNI && !H && C >= 4;
    // With VNNI and its offset terms stored (Q4_0), each block's integer sums start from the
    // activations' −8·Σq, so the offset costs no f32 work: d_x·(dot − 8·Σq) is one rounding of
    // the exact value, as the fused multiply-add d_x·dot + (−8·s) it replaces was (s = d_x·Σq
    // exactly): the same bits, and the scaling then that of signed codes. Two fewer vector
    // operations a block and row group (a scalar multiply and its broadcast): +4–8% in L2 on
    // Zen 4 for 1 to 8 tokens.
    let off = if VNNI { offset_terms::<C>(w, a, gs.t0) } else { None };
    let fold = off.is_some();
    let off = off.unwrap_or([std::ptr::null(); C]);
    let scaling = if fold { Scaling::Signed } else { scaling };
    let ones = _mm512_set1_epi16(1);
    let gb = GROUP_BLOCK + P * PLANE;
    let mut acc = [[_mm512_setzero_ps(); C]; G];
    // Q4_K, Q2_K: each group's current super-block d and −dmin per row lane.
    let mut sup = [(_mm512_setzero_ps(), _mm512_setzero_ps()); G];
    for b in 0..n {
        let qb: [*const u8; G] = array_from(|g| {
            let op = &ops[g];
            let qb = op.block(b, gb);
            op.scales_ahead(b, gb, has_m);
            if b % 2 == 0 {
                _mm_prefetch::<_MM_HINT_T0>(op.d.wrapping_add(b * ROWS + PF_BYTES / 8) as *const i8);
                if has_m {
                    _mm_prefetch::<_MM_HINT_T0>(op.m.wrapping_add(b * ROWS + PF_BYTES / 8) as *const i8);
                }
            }
            qb
        });
        let start: [__m512i; C] =
            array_from(|c| if fold { _mm512_set1_epi32(*off[c].add(2 * b)) } else { _mm512_setzero_si512() });
        let (mut isum, mut isum2) = ([start; G], [[_mm512_setzero_si512(); C]; G]);
        for j in 0..4 {
            for g in 0..G {
                let (lo4, hi4) = if x16 { nibble_codes_x16(qb[g], j) } else { nibble_codes(qb[g], j, P) };
                let (isum, isum2) = (&mut isum[g], &mut isum2[g]);
                for c in 0..C {
                    let xa = _mm512_set1_epi32((xq[c].add(b * BLOCK + 4 * j) as *const i32).read_unaligned());
                    let xb = _mm512_set1_epi32((xq[c].add(b * BLOCK + 16 + 4 * j) as *const i32).read_unaligned());
                    if VNNI && one_set {
                        isum[c] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(isum[c], lo4, xa), hi4, xb);
                    } else if VNNI {
                        isum[c] = _mm512_dpbusd_epi32(isum[c], lo4, xa);
                        isum2[c] = _mm512_dpbusd_epi32(isum2[c], hi4, xb);
                    } else if P == 0 && !H {
                        isum[c] = _mm512_add_epi16(isum[c], _mm512_maddubs_epi16(lo4, xa));
                        isum[c] = _mm512_add_epi16(isum[c], _mm512_maddubs_epi16(hi4, xb));
                    } else if P == 0 {
                        // Codes ≤ 7: four groups of two products stay within 16 bits.
                        isum[c] = _mm512_add_epi16(isum[c], _mm512_maddubs_epi16(lo4, xa));
                        isum2[c] = _mm512_add_epi16(isum2[c], _mm512_maddubs_epi16(hi4, xb));
                    } else {
                        isum[c] = _mm512_add_epi32(isum[c], _mm512_madd_epi16(_mm512_maddubs_epi16(lo4, xa), ones));
                        isum2[c] = _mm512_add_epi32(isum2[c], _mm512_madd_epi16(_mm512_maddubs_epi16(hi4, xb), ones));
                    }
                }
            }
        }
        for g in 0..G {
            let sc = block_scales::<SUP, H>(has_m, ops[g].d, ops[g].m, b, &mut sup[g]);
            for c in 0..C {
                let dxb = _mm512_set1_ps(*dx[c].add(b));
                let hi = if x16 { _mm512_srai_epi32::<4>(isum2[g][c]) } else { isum2[g][c] };
                let (dot0, dot1) = if H {
                    let (dot0, dot1) = if VNNI || P > 0 {
                        (isum[g][c], hi)
                    } else {
                        (_mm512_madd_epi16(isum[g][c], ones), _mm512_madd_epi16(isum2[g][c], ones))
                    };
                    (_mm512_cvtepi32_ps(dot0), _mm512_cvtepi32_ps(dot1))
                } else if one_set {
                    (_mm512_cvtepi32_ps(isum[g][c]), _mm512_setzero_ps())
                } else if VNNI || P > 0 {
                    (_mm512_cvtepi32_ps(_mm512_add_epi32(isum[g][c], hi)), _mm512_setzero_ps())
                } else {
                    (_mm512_cvtepi32_ps(_mm512_madd_epi16(isum[g][c], ones)), _mm512_setzero_ps())
                };
                let s = if H { sx[c].add(2 * b) } else { sx[c].add(b) };
                acc[g][c] = accumulate::<H>(scaling, acc[g][c], dot0, dot1, dxb, s, &sc);
            }
        }
    }
    gs.store(&acc);
}

/// Q8_0: 16 rows × C tokens over every block, for each of G row groups in lockstep (as
/// [`tile`]); per block eight 4-code groups, each a sign-trick vpmaddubsw widened by vpmaddwd
/// into 32-bit lanes, then `d_w·d_x·dot` per row lane (the codes are flipped back to signed, so
/// no offset term). With VNNI, vpdpbusd of the stored codes (code + 128) into two sets of 32-bit
/// lanes, the first started from −128·Σq, then `d_w·d_x·dot`. With `NL` (IQ4_NL), each group's
/// codes are its nibbles (Q4's layout: groups j and j + 4 share a 64-byte load) looked up in
/// [`super::super::NL_CODES`] by one vpshufb; the rest as Q8_0.
#[inline(always)]
pub(super) unsafe fn tile_q8<const C: usize, const G: usize, const VNNI: bool, const NL: bool, const VBMI: bool>(
    gs: Groups<G>,
) {
    let (w, a) = (gs.w, gs.a);
    let ops: [Operands<C>; G] = array_from(
        #[inline(always)]
        |g| Operands::<C>::new(w, a, gs.r0[g], gs.t0),
    );
    let Operands { n, xq, dx, .. } = ops[0];
    // (The BW tiles flip the codes back to signed and take no offset.)
    let off = if VNNI {
        offset_terms::<C>(w, a, gs.t0).expect("the byte-code kinds' −128·Σq are stored")
    } else {
        [std::ptr::null(); C]
    };
    let (flip, ones, zero) = (_mm512_set1_epi8(-128), _mm512_set1_epi16(1), _mm512_setzero_si512());
    let (low, table) = (_mm512_set1_epi8(0x0F), super::nl_table_512());
    let gb = if NL { GROUP_BLOCK } else { GROUP_BLOCK_Q8 };
    let mut acc = [[_mm512_setzero_ps(); C]; G];
    for b in 0..n {
        let qb: [*const u8; G] = array_from(|g| {
            let op = &ops[g];
            let qb = op.block(b, gb);
            op.scales_ahead(b, gb, false);
            _mm_prefetch::<_MM_HINT_T0>(op.d.wrapping_add((b + PF_BYTES / gb) * ROWS) as *const i8);
            qb
        });
        // With VNNI the sums start from −128·Σq (`QActs::offs`), which takes the stored codes'
        // +128 back out, as Q4_0's tile does with its −8: the same bits as adding −128·s in f32.
        let start: [__m512i; C] =
            array_from(|c| if VNNI { _mm512_set1_epi32(*off[c].add(2 * b)) } else { _mm512_setzero_si512() });
        let (mut isum, mut isum2) = ([start; G], [[_mm512_setzero_si512(); C]; G]);
        // Group j's 4-code products of row group g for every token, into `sum`.
        let group = |g: usize, j: usize, sum: &mut [__m512i; C]| {
            let u = if NL {
                let v = _mm512_loadu_si512(qb[g].add((j % 4) * 64) as *const _);
                let v = if j < 4 { v } else { _mm512_srli_epi16(v, 4) };
                if VBMI {
                    // Entry i of the 64-byte table is NL_CODES[i mod 16]: bits 4 and 5 of the
                    // index (the other nibble, or the next byte's after the shift) do not matter.
                    _mm512_permutexvar_epi8(v, table)
                } else {
                    _mm512_shuffle_epi8(table, _mm512_and_si512(v, low))
                }
            } else {
                _mm512_loadu_si512(qb[g].add(j * 64) as *const _)
            }; // code + 128
            let x = |c: usize| _mm512_set1_epi32((xq[c].add(b * BLOCK + 4 * j) as *const i32).read_unaligned());
            if VNNI {
                for c in 0..C {
                    sum[c] = _mm512_dpbusd_epi32(sum[c], u, x(c));
                }
            } else {
                let v = _mm512_xor_si512(u, flip); // signed codes
                let (neg, mag) = (_mm512_movepi8_mask(v), _mm512_abs_epi8(v));
                for c in 0..C {
                    let xs = _mm512_mask_sub_epi8(x(c), neg, zero, x(c)); // x·sign(w)
                    sum[c] = _mm512_add_epi32(sum[c], _mm512_madd_epi16(_mm512_maddubs_epi16(mag, xs), ones));
                }
            }
        };
        // Two sets of lanes, alternate groups (shorter dependency chains), added after; each
        // group's set fixed at compile time (a set chosen per group at run time kept the sums
        // in memory: Q8_0 prefill ran at a quarter of its speed).
        for p in 0..4 {
            for g in 0..G {
                group(g, 2 * p, &mut isum[g]);
                group(g, 2 * p + 1, &mut isum2[g]);
            }
        }
        for g in 0..G {
            let wd = _mm512_cvtph_ps(_mm256_loadu_si256(ops[g].d.add(b * ROWS) as *const __m256i));
            for c in 0..C {
                let dxb = _mm512_set1_ps(*dx[c].add(b));
                let dot = _mm512_cvtepi32_ps(_mm512_add_epi32(isum[g][c], isum2[g][c]));
                acc[g][c] = _mm512_fmadd_ps(wd, _mm512_mul_ps(dot, dxb), acc[g][c]);
            }
        }
    }
    gs.store(&acc);
}

/// Group j's (< 4) codes in a 16-row group-block at `qb` of a nibble kind with `planes` high-bit
/// planes: in each row's 32-bit lane, codes 4j..4j + 4 (the low nibbles) and 16 + 4j..20 + 4j
/// (the high ones), each completed by one masked byte add per plane.
#[inline(always)]
pub(super) unsafe fn nibble_codes(qb: *const u8, j: usize, planes: usize) -> (__m512i, __m512i) {
    let nib = _mm512_set1_epi8(0x0F);
    let masks = qb.add(GROUP_BLOCK) as *const u64;
    let v = _mm512_loadu_si512(qb.add(j * 64) as *const _);
    let mut lo4 = _mm512_and_si512(v, nib);
    let mut hi4 = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nib);
    for p in 0..planes {
        let bit = _mm512_set1_epi8(16 << p);
        lo4 = _mm512_mask_add_epi8(lo4, masks.add(j * planes + p).read_unaligned(), lo4, bit);
        hi4 = _mm512_mask_add_epi8(hi4, masks.add((4 + j) * planes + p).read_unaligned(), hi4, bit);
    }
    (lo4, hi4)
}

/// [`nibble_codes`] without planes, the high nibbles left in place: 16 × each code (≤ 240, still
/// an unsigned byte for vpdpbusd), so one AND instead of a shift and an AND; the sums of the high
/// codes are then 16 × theirs, exactly, and one arithmetic shift per block undoes it.
#[inline(always)]
pub(super) unsafe fn nibble_codes_x16(qb: *const u8, j: usize) -> (__m512i, __m512i) {
    let v = _mm512_loadu_si512(qb.add(j * 64) as *const _);
    (_mm512_and_si512(v, _mm512_set1_epi8(0x0F)), _mm512_and_si512(v, _mm512_set1_epi8(0xF0u8 as i8)))
}

/// One block's scales per row lane: `d` the scale (Q6_K, Q3_K: the first half's), `m` the min
/// (Q4_1, the Q5 types, Q4_K: formed from its pair), the second half's scale (Q6_K, Q3_K), or
/// Q2_K's first-half min; `d2` and `m2` Q2_K's second-half scale and min.
#[derive(Clone, Copy)]
pub(super) struct BlockScales {
    pub d: __m512,
    pub m: __m512,
    pub d2: __m512,
    pub m2: __m512,
}

/// Block b's [`BlockScales`] for the 16 rows of a group whose scales start at `d` (and `m`):
/// f16 scales (and, `has_m`, mins or second scales) as stored, or with `SUP` formed from the
/// block's byte pair and the super-block's `d` and −`dmin`, which `sup` carries from the
/// super-block's first block on.
#[inline(always)]
pub(super) unsafe fn block_scales<const SUP: bool, const H: bool>(
    has_m: bool,
    d: *const u16,
    m: *const u16,
    b: usize,
    sup: &mut (__m512, __m512),
) -> BlockScales {
    let zero = _mm512_setzero_ps();
    if !SUP {
        let wd = _mm512_cvtph_ps(_mm256_loadu_si256(d.add(b * ROWS) as *const __m256i));
        let wm = if has_m { _mm512_cvtph_ps(_mm256_loadu_si256(m.add(b * ROWS) as *const __m256i)) } else { wd };
        return BlockScales { d: wd, m: wm, d2: zero, m2: zero };
    }
    if b.is_multiple_of(8) {
        let at = (b / 8) * 2 * ROWS;
        let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(m.add(at + ROWS) as *const __m256i));
        *sup = (_mm512_cvtph_ps(_mm256_loadu_si256(m.add(at) as *const __m256i)), _mm512_sub_ps(zero, dmin));
    }
    let (sup_d, sup_m) = *sup;
    let pair = _mm512_cvtepu16_epi32(_mm256_loadu_si256(d.add(b * ROWS) as *const __m256i));
    let field = |shift: u32, mask: i32| {
        _mm512_cvtepi32_ps(_mm512_and_si512(
            _mm512_srlv_epi32(pair, _mm512_set1_epi32(shift as i32)),
            _mm512_set1_epi32(mask),
        ))
    };
    if H {
        // Q2_K: the two sub-blocks' scale | min << 4, the first half's in the low byte.
        BlockScales {
            d: _mm512_mul_ps(field(0, 0xF), sup_d),
            m: _mm512_mul_ps(field(4, 0xF), sup_m),
            d2: _mm512_mul_ps(field(8, 0xF), sup_d),
            m2: _mm512_mul_ps(field(12, 0xF), sup_m),
        }
    } else {
        // Q4_K: sub-block b's 6-bit scale (low byte) and min (high byte).
        BlockScales {
            d: _mm512_mul_ps(field(0, 0xFF), sup_d),
            m: _mm512_mul_ps(field(8, 0xFF), sup_m),
            d2: zero,
            m2: zero,
        }
    }
}

/// `acc` plus one token's share of a block for 16 row lanes: the block's integer sums `dot0`
/// (with `H` or [`Scaling::SignedHalves`] the first half's, `dot1` the second's) as floats, the
/// token's block scale `dxb` (broadcast) and its sums at `s` (`s[0]`, with `H` also `s[1]`: the
/// halves'; the signed scalings read none), under `scaling`.
#[inline(always)]
pub(super) unsafe fn accumulate<const H: bool>(
    scaling: Scaling,
    acc: __m512,
    dot0: __m512,
    dot1: __m512,
    dxb: __m512,
    s: *const f32,
    sc: &BlockScales,
) -> __m512 {
    match scaling {
        Scaling::Signed => return _mm512_fmadd_ps(sc.d, _mm512_mul_ps(dot0, dxb), acc),
        Scaling::SignedHalves => {
            let acc = _mm512_fmadd_ps(sc.d, _mm512_mul_ps(dot0, dxb), acc);
            return _mm512_fmadd_ps(sc.m, _mm512_mul_ps(dot1, dxb), acc);
        }
        _ => {}
    }
    if H {
        let (s0, s1) = (*s, *s.add(1));
        if let Scaling::Halves(k) = scaling {
            let lo = _mm512_fmadd_ps(dot0, dxb, _mm512_set1_ps(k * s0));
            let hi = _mm512_fmadd_ps(dot1, dxb, _mm512_set1_ps(k * s1));
            return _mm512_fmadd_ps(sc.m, hi, _mm512_fmadd_ps(sc.d, lo, acc));
        }
        let acc = _mm512_fmadd_ps(sc.d, _mm512_mul_ps(dot0, dxb), acc);
        let acc = _mm512_fmadd_ps(sc.d2, _mm512_mul_ps(dot1, dxb), acc);
        let acc = _mm512_fmadd_ps(sc.m, _mm512_set1_ps(s0), acc);
        return _mm512_fmadd_ps(sc.m2, _mm512_set1_ps(s1), acc);
    }
    let sb = *s;
    if let Scaling::Offset(k) = scaling {
        return _mm512_fmadd_ps(sc.d, _mm512_fmadd_ps(dot0, dxb, _mm512_set1_ps(k * sb)), acc);
    }
    let acc = _mm512_fmadd_ps(sc.d, _mm512_mul_ps(dot0, dxb), acc);
    _mm512_fmadd_ps(sc.m, _mm512_set1_ps(sb), acc)
}
