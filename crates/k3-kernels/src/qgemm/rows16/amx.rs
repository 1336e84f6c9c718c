//! AMX path of the 16-row layout (prefill on AMX CPUs): AMX-INT8 tile products over the same
//! 16-row groups the AVX-512 decode kernels stream, so an AMX CPU holds one layout for both.
//!
//! A group-block of the 16-row layout is already AMX's B operand once its codes are bytes: byte
//! `j·64 + r·4 + e` holds code `4j + e` of row r (low nibble) and `16 + 4j + e` (high nibble),
//! and B's row k of a tile is `[16 columns][4 consecutive codes]`. So per group, each block's
//! nibbles (high-bit planes added, IQ4_NL looked up) are split into 8 rows of 64 bytes once
//! ([`unpack_group`]; Q8_0's bytes only made signed), and per tile of 16 tokens and block b
//! ```text
//! C_b[m, r] = Σ_{j<32} x[m, 32b + j] · u[r, 32b + j]        (TDPBSSD / TDPBSUD → i32)
//! acc[m, r] += d_w[r, b] · d_x[m, b] · C_b[m, r]   (+ min[r, b] · s_x[m, b])
//! ```
//! The kinds whose value is `(u − k)·d` (Q4_0, Q5_0, Q8_0, IQ4_NL, Q6_K, Q3_K) are unpacked as
//! the signed codes u − k (TDPBSSD: i8 × i8), so their sums need no offset term; the kinds with
//! a min (Q4_1, Q5_1, Q5_K, Q4_K, Q2_K) keep their unsigned codes (TDPBSUD: i8 × u8) and add the
//! min times the activations' block sums, as the VNNI tiles do (`super::avx512::accumulate`).
//! The kinds whose scales change every 16 codes (Q6_K, Q3_K, Q2_K) take two products a block,
//! one a half (K = 16). Two sets of C tiles alternate, and each block's sums are scaled one step
//! after they are stored, so that the next blocks' products run meanwhile.
//! Dims: 16 rows a group, 16 tokens a tile, nbp blocks of 32 codes.

use std::arch::x86_64::*;

use super::super::amx::{release, store_rows, tile_product, tile_store, TileConfig};
use super::super::array_from;
use super::avx512::{accumulate, block_scales, nibble_codes, BlockScales};
use super::{group_block, token_block, Kind, OutMat, Packed, QActs, Scaling, BLOCK, ROWS};

/// Tokens per tile.
const TILE: usize = 16;

/// Bytes of one block's unpacked codes (8 B-tile rows of 64).
const UNPACKED: usize = ROWS * BLOCK;

/// One product a block: C tmm0 / tmm3 [16 tokens × 16 rows, i32], A tmm1 / tmm4 [16 tokens × 32
/// codes], B tmm2 / tmm5 [8 rows of 4 codes × 16 rows].
const BLOCKS: TileConfig = TileConfig::new(&[(16, 64), (16, 32), (8, 64), (16, 64), (16, 32), (8, 64)]);

/// Two products a block, a half each: C tmm0 / tmm3 (first set's halves), tmm4 / tmm5 (second
/// set's), A tmm1 / tmm6 [16 tokens × 16 codes], B tmm2 / tmm7 [4 rows of 4 codes × 16 rows].
const HALVES: TileConfig =
    TileConfig::new(&[(16, 64), (16, 16), (4, 64), (16, 64), (16, 64), (16, 64), (16, 16), (4, 64)]);

/// # Safety
/// AMX-INT8 must be usable ([`super::super::amx::available`]) with AVX-512 F/BW/VL/DQ, VNNI,
/// FMA and F16C; `w` in [`super::Layout::Rows16`] with `lo` a multiple of 16; `a` padded to whole
/// 16-token tiles (T ≥ [`super::super::AMX_MIN_TOKENS`]); `out` valid for rows 0..hi − lo and
/// tokens 0..T.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")]
pub unsafe fn gemm_amx(w: &Packed, a: &QActs, lo: usize, hi: usize, out: OutMat) {
    debug_assert!(a.qs.len() >= a.t.next_multiple_of(TILE) * a.nbp * BLOCK, "QActs pads to whole token tiles");
    // (super-block scales, scales per half block, signed codes)
    match (w.kind.super_scales(), w.kind.per_half(), w.kind.code_offset().is_some()) {
        (false, false, true) => gemm::<false, false, true>(w, a, lo, hi, out),
        (false, false, false) => gemm::<false, false, false>(w, a, lo, hi, out),
        (true, false, _) => gemm::<true, false, false>(w, a, lo, hi, out),
        (false, true, _) => gemm::<false, true, true>(w, a, lo, hi, out),
        (true, true, _) => gemm::<true, true, false>(w, a, lo, hi, out),
    }
}

#[inline(always)]
unsafe fn gemm<const SUP: bool, const H: bool, const SIGNED: bool>(
    w: &Packed,
    a: &QActs,
    lo: usize,
    hi: usize,
    out: OutMat,
) {
    let n = w.nbp;
    // The offset kinds' codes unpacked signed (less their offset, wrapping: Q8_0's 128 is a
    // flip of the top bit): their sums are d_w·d_x·dot.
    let offset = w.kind.code_offset().map_or(0, |k| k as u8);
    debug_assert_eq!(SIGNED, offset != 0);
    let scaling = match Scaling::of(w.kind) {
        Scaling::Offset(_) => Scaling::Signed,
        Scaling::Halves(_) => Scaling::SignedHalves,
        s => s,
    };
    let has_m = matches!(scaling, Scaling::Min | Scaling::SignedHalves);
    if H {
        HALVES.load();
    } else {
        BLOCKS.load();
    }
    let mut unpacked = vec![_mm512_setzero_si512(); n * UNPACKED / 64];
    let mut scales: Vec<BlockScales> = Vec::with_capacity(n);
    // The C tiles as stored, [set][half] (each tile is written whole before it is read).
    let mut cbuf = [[[0i32; TILE * TILE]; 2]; 2];
    // Long prefills walk the tokens in blocks whose activation codes stay in L2 while every row
    // group streams past them, as the AVX-512 tiles do.
    let block = token_block(a).next_multiple_of(TILE);
    for tb in (0..a.t).step_by(block) {
        for g0 in (lo..hi).step_by(ROWS) {
            unpack_group(w, g0, offset, &mut unpacked);
            let codes = unpacked.as_ptr() as *const u8;
            let (g, mut sup) = (g0 / ROWS, (_mm512_setzero_ps(), _mm512_setzero_ps()));
            let d = w.d.as_ptr().add(g * n * ROWS);
            let m = if w.kind.has_m() { w.m.as_ptr().add(g * w.kind.m_per_row(n) * ROWS) } else { std::ptr::null() };
            scales.clear();
            scales.extend((0..n).map(|b| block_scales::<SUP, H>(has_m, d, m, b, &mut sup)));
            for t0 in (tb..(tb + block).min(a.t)).step_by(TILE) {
                let acc = tile::<H, SIGNED>(w.kind, scaling, a, t0, codes, &scales, &mut cbuf);
                store_rows(&acc, ROWS.min(hi - g0), g0 - lo, t0, TILE.min(a.t - t0), out);
            }
        }
    }
    release();
}

/// Row group r0 / 16's codes as B operands into `buf`, `UNPACKED` bytes a block: the codes as
/// the arithmetic takes them (IQ4_NL's looked up), less `offset` (the signed codes of the offset
/// kinds; 0 for the kinds with a min).
#[inline(always)]
unsafe fn unpack_group(w: &Packed, r0: usize, offset: u8, buf: &mut [__m512i]) {
    let gb = group_block(w.kind);
    let q = w.qs.as_ptr().add(r0 / ROWS * w.nbp * gb);
    let off = _mm512_set1_epi8(offset as i8);
    if w.kind.byte_codes() {
        for (b, dst) in buf.chunks_exact_mut(UNPACKED / 64).enumerate().take(w.nbp) {
            for (j, v) in dst.iter_mut().enumerate() {
                *v = _mm512_sub_epi8(_mm512_loadu_si512(q.add(b * gb + j * 64) as *const _), off);
            }
        }
        return;
    }
    let (planes, table) = (w.kind.planes(), w.kind.code_table().map(|_| super::nl_table_512()));
    for (b, dst) in buf.chunks_exact_mut(UNPACKED / 64).enumerate().take(w.nbp) {
        for j in 0..4 {
            let (mut lo4, mut hi4) = nibble_codes(q.add(b * gb), j, planes);
            if let Some(t) = table {
                lo4 = _mm512_shuffle_epi8(t, lo4);
                hi4 = _mm512_shuffle_epi8(t, hi4);
            }
            dst[j] = _mm512_sub_epi8(lo4, off);
            dst[4 + j] = _mm512_sub_epi8(hi4, off);
        }
    }
}

/// 16 tokens from t0 × the 16 rows of one group over every block: acc[m] holds token t0 + m's
/// row lanes.
#[inline(always)]
unsafe fn tile<const H: bool, const SIGNED: bool>(
    kind: Kind,
    scaling: Scaling,
    a: &QActs,
    t0: usize,
    codes: *const u8,
    scales: &[BlockScales],
    cbuf: &mut [[[i32; TILE * TILE]; 2]; 2],
) -> [__m512; TILE] {
    let (n, ld) = (a.nbp, a.nbp * BLOCK);
    let xp = |b: usize| a.qs.as_ptr().add(t0 * ld + b * BLOCK);
    let wp = |b: usize| codes.add(b * UNPACKED);
    // Per token: its block scales and block (or half-block) sums.
    let dx: [*const f32; TILE] = array_from(|m| a.d.as_ptr().add((t0 + m) * n));
    let sx: [*const f32; TILE] = array_from(|m| a.s_for(kind, t0 + m).as_ptr());
    let mut acc = [_mm512_setzero_ps(); TILE];
    // Software-pipelined: in step b, block b + 1's products are issued and block b's sums
    // stored while block b − 1's stored sums are scaled, so no load waits on the store before it.
    products::<H, SIGNED>(0, xp(0), ld, wp(0));
    for b in 0..=n {
        if b + 1 < n {
            products::<H, SIGNED>((b + 1) % 2, xp(b + 1), ld, wp(b + 1));
        }
        if b < n {
            store_c::<H>(b % 2, &mut cbuf[b % 2]);
        }
        if b == 0 {
            continue;
        }
        let (pb, c) = (b - 1, &cbuf[(b - 1) % 2]);
        let sc = &scales[pb];
        for m in 0..TILE {
            let row = |h: usize| _mm512_cvtepi32_ps(_mm512_loadu_si512(c[h].as_ptr().add(m * TILE) as *const _));
            let dot1 = if H { row(1) } else { _mm512_setzero_ps() };
            let dxb = _mm512_set1_ps(*dx[m].add(pb));
            let s = if H { sx[m].add(2 * pb) } else { sx[m].add(pb) };
            acc[m] = accumulate::<H>(scaling, acc[m], row(0), dot1, dxb, s, sc);
        }
    }
    acc
}

/// Issue set `slot`'s products for one block: A the 16 token rows at `xp` (row stride `ld`
/// bytes), B the block's unpacked codes at `wp`; one product of 32 codes, or with `H` one per
/// half; with `SIGNED` the codes are signed (TDPBSSD), else unsigned (TDPBSUD).
#[inline(always)]
unsafe fn products<const H: bool, const SIGNED: bool>(slot: usize, xp: *const i8, ld: usize, wp: *const u8) {
    macro_rules! dot {
        ($c:literal, $a:literal, $b:literal, $x:expr, $w:expr) => {
            if SIGNED {
                tile_product!("tdpbssd", $c, $a, $b, $x, ld, $w)
            } else {
                tile_product!("tdpbsud", $c, $a, $b, $x, ld, $w)
            }
        };
    }
    match (H, slot) {
        (false, 0) => dot!("tmm0", "tmm1", "tmm2", xp, wp),
        (false, _) => dot!("tmm3", "tmm4", "tmm5", xp, wp),
        (true, 0) => {
            dot!("tmm0", "tmm1", "tmm2", xp, wp);
            dot!("tmm3", "tmm6", "tmm7", xp.add(16), wp.add(UNPACKED / 2));
        }
        (true, _) => {
            dot!("tmm4", "tmm1", "tmm2", xp, wp);
            dot!("tmm5", "tmm6", "tmm7", xp.add(16), wp.add(UNPACKED / 2));
        }
    }
}

/// Store set `slot`'s C tiles (one, or with `H` two) as 16 × 16 i32 each.
#[inline(always)]
unsafe fn store_c<const H: bool>(slot: usize, c: &mut [[i32; TILE * TILE]; 2]) {
    let (c0, c1) = (c[0].as_mut_ptr(), c[1].as_mut_ptr());
    match (H, slot) {
        (false, 0) => tile_store!("tmm0", c0),
        (false, _) => tile_store!("tmm3", c0),
        (true, 0) => {
            tile_store!("tmm0", c0);
            tile_store!("tmm3", c1);
        }
        (true, _) => {
            tile_store!("tmm4", c0);
            tile_store!("tmm5", c1);
        }
    }
}
