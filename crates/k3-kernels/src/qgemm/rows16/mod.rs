//! The 16-row interleaved layout of Q4 and Q8_0 weights ([`Layout::Rows16`]) and its AVX-512
//! kernels, with VNNI (vpdpbusd) and without (vpmaddubsw / vpmaddwd).
//!
//! Per group of 16 rows and block of 32 codes, 256 bytes: byte `j·64 + r·4 + e` (j < 4, r < 16,
//! e < 4) holds code `4j + e` of row r in its low nibble and code `16 + 4j + e` in its high one.
//! One 64-byte load, an AND and a shift give, in each 32-bit lane r, four consecutive codes of
//! row r; vpmaddubsw against the four matching activation codes broadcast to every lane, then
//! vpmaddwd, is a 4-term dot product for 16 rows at once. Unlike the row-pair tiles (which keep
//! one vector per row and reduce it at the end), every lane here is a different row: the eight
//! group products of a block are summed in 16-bit lanes (|Σ| ≤ 8·2·15·127 = 30,480, no
//! saturation) and converted and scaled once per block for 16 rows, about a third of the row-pair
//! tile's instructions per weight. A group's blocks are contiguous, so decode streams each band
//! of rows as one sequential read. Scales are [rows/16, nbp, 16]. With VNNI, one vpdpbusd takes
//! the place of vpmaddubsw and the 16-bit add, summing straight into 32-bit lanes (two
//! accumulators per token, so the vpdpbusd chain is half as long), and the per-block vpmaddwd goes.
//!
//! Q8_0 in the same arrangement at a byte a code, 512 bytes per group and block: byte
//! `j·64 + r·4 + e` (j < 8) holds code `4j + e` of row r (stored as code + 128, as in the row-pair
//! layout). The kernel flips it back to signed and takes each 4-term product by the sign trick
//! (|w| · x·sign(w): vpmaddubsw's pairs stay ≤ 2·128·127), widened to 32 bits per group; with
//! VNNI, vpdpbusd takes the unsigned code + 128 as it is and the block's `128·s` comes off after.
//!
//! The 5- and 6-bit kinds keep Q4's 256 nibble bytes and add their high bits as bit planes, 64
//! bytes a plane per group and block (Q5_0, Q5_1, Q5_K: one plane, 320 bytes, 6 bits a weight
//! with the scales; Q6_K: two, 384 bytes, 7 bits a weight with its two scales a block). For each
//! 4-code group g (codes 4g..4g + 4, g < 8) and plane p, 8 bytes at `256 + (g·P + p)·8` are a
//! 64-bit mask whose bit `r·4 + e` is bit 4 + p of code 4g + e of row r: exactly the byte lanes
//! of the group's nibble vector, so one masked byte add (`vpaddb` under the mask) per plane puts
//! the bit in place. The codes are then unsigned (Q5: 0..31, Q6_K: 0..63) and take vpdpbusd as
//! they are. Q5_0 has Q4_0's arithmetic (offset −16 instead of −8), Q5_1 and Q5_K Q4_1's (a min
//! a block), Q6_K a scale per 16 codes (`d` for codes 0..16 of a block, `m` for 16..32: the two
//! accumulator sets, offset −32 against the activations' half sums). Q4_K has no plane: Q4_1's
//! nibbles, with each block's 6-bit scale and min as a byte pair in `d` and each super-block's
//! f16 `d` and `dmin` in `m`, from which the tile forms the block's scale and min in f32. Q3_K
//! and Q2_K have no plane either (codes 0..7 and 0..3 as nibbles): Q3_K takes Q6_K's scale per
//! half block (offset −4), Q2_K a scale and min per half block formed as Q4_K's from its 4-bit
//! pairs (in `d`, one byte a half) and the super-block's f16 `d` and `dmin` (in `m`).
//! Dims: nbp blocks per row (even), R = 16 rows per group, C tokens per tile.

use super::{array_from, Kind, Layout, OutMat, Packed, QActs, BLOCK};

/// Rows per interleaved group.
pub const ROWS: usize = 16;
/// Bytes of Q4 codes per group and block.
const GROUP_BLOCK: usize = ROWS * BLOCK / 2;
/// Bytes of Q8 codes per group and block.
const GROUP_BLOCK_Q8: usize = ROWS * BLOCK;
/// Bytes of one high-bit plane per group and block (a bit a code).
const PLANE: usize = ROWS * BLOCK / 8;

/// Bytes of codes per group and block for `kind`.
fn group_block(kind: Kind) -> usize {
    if kind.byte_codes() {
        GROUP_BLOCK_Q8
    } else {
        GROUP_BLOCK + kind.planes() * PLANE
    }
}

/// Byte offset and nibble shift (0 or 4; always 0 for Q8) of code k (< 32) of row r (< 16)
/// within a group-block.
#[inline]
fn code_at(kind: Kind, r: usize, k: usize) -> (usize, u32) {
    let (g, e) = (k / 4, k % 4);
    if kind.byte_codes() {
        (g * 64 + r * 4 + e, 0)
    } else {
        ((g % 4) * 64 + r * 4 + e, 4 * (g / 4) as u32)
    }
}

/// Byte offset and bit of plane p's bit of code k (< 32) of row r (< 16) within a group-block:
/// the planes follow the nibbles, a 64-bit lane mask per 4-code group and plane.
#[inline]
fn plane_at(planes: usize, r: usize, k: usize, p: usize) -> (usize, u32) {
    let bit = r * 4 + k % 4;
    (GROUP_BLOCK + ((k / 4) * planes + p) * 8 + bit / 8, (bit % 8) as u32)
}

/// Index of row r's super-block sb `d` (which 0) or `dmin` (1) in a [`Kind::Q4K`] matrix's `m`:
/// [rows/16, nbp/8, 2, 16].
#[inline]
pub(crate) fn k4_at(nbp: usize, r: usize, sb: usize, which: usize) -> usize {
    (((r / ROWS) * (nbp / 8) + sb) * 2 + which) * ROWS + r % ROWS
}

/// Index of row r's block b scale in `d` / `m`.
#[inline]
pub(crate) fn scale_at(nbp: usize, r: usize, b: usize) -> usize {
    ((r / ROWS) * nbp + b) * ROWS + r % ROWS
}

/// Store row r's codes (Q4: < 16; Q5: < 32; Q6_K: < 64; Q8: code + 128), scales and mins or
/// second scales (`nbp` each; `m` only where the kind has it), into a matrix whose rows are
/// stored in order (its bytes still zero where this row's plane bits go). A 4-code group's lane
/// at a time: the row's code bytes are its own, written whole; each plane's four bits of a group
/// are one nibble of the group's 64-bit mask. (One code and one offset at a time,
/// [`store_row_ref`], took half of a 370M Q4_0 load.)
pub(crate) fn store_row(p: &mut Packed, r: usize, codes: &[u8], d: &[u16], m: &[u16]) {
    debug_assert_eq!(p.layout, Layout::Rows16);
    let (nbp, gb, planes, kind) = (p.nbp, group_block(p.kind), p.kind.planes(), p.kind);
    let (base, lane) = ((r / ROWS) * nbp * gb, (r % ROWS) * 4);
    // Row r's bits of a plane mask: bits 4r..4r + 4, a nibble of byte r / 2.
    let (mask_byte, mask_shift) = ((r % ROWS) / 2, 4 * (r % 2) as u32);
    let group = &mut p.qs[base..base + nbp * gb];
    for (blk, out) in codes.chunks_exact(BLOCK).zip(group.chunks_exact_mut(gb)) {
        if kind.byte_codes() {
            for (g, four) in blk.chunks_exact(4).enumerate() {
                out[g * 64 + lane..g * 64 + lane + 4].copy_from_slice(four);
            }
            continue;
        }
        for g in 0..4 {
            for e in 0..4 {
                out[g * 64 + lane + e] = (blk[4 * g + e] & 0x0F) | (blk[16 + 4 * g + e] & 0x0F) << 4;
            }
        }
        for (g, four) in blk.chunks_exact(4).enumerate() {
            for pl in 0..planes {
                let bits = four.iter().enumerate().fold(0u8, |n, (e, &c)| n | ((c >> (4 + pl)) & 1) << e);
                out[GROUP_BLOCK + (g * planes + pl) * 8 + mask_byte] |= bits << mask_shift;
            }
        }
    }
    for b in 0..nbp {
        let i = scale_at(nbp, r, b);
        p.d[i] = d[b];
        if kind.has_m() && !kind.super_scales() {
            p.m[i] = m[b];
        }
    }
    if kind.super_scales() {
        for (e, &v) in m[..nbp / 4].iter().enumerate() {
            p.m[k4_at(nbp, r, e / 2, e % 2)] = v;
        }
    }
}

/// [`store_row`]'s reference: each code and plane bit put at its place one at a time, ORed in.
#[cfg(test)]
pub(crate) fn store_row_ref(p: &mut Packed, r: usize, codes: &[u8], d: &[u16], m: &[u16]) {
    let (nbp, gb, planes) = (p.nbp, group_block(p.kind), p.kind.planes());
    let mask = if p.kind.byte_codes() { 0xFF } else { 0x0F };
    let base = (r / ROWS) * nbp * gb;
    for b in 0..nbp {
        for k in 0..BLOCK {
            let c = codes[b * BLOCK + k];
            let (at, shift) = code_at(p.kind, r % ROWS, k);
            p.qs[base + b * gb + at] |= (c & mask) << shift;
            for pl in 0..planes {
                let (at, bit) = plane_at(planes, r % ROWS, k, pl);
                p.qs[base + b * gb + at] |= ((c >> (4 + pl)) & 1) << bit;
            }
        }
        let i = scale_at(nbp, r, b);
        p.d[i] = d[b];
        if p.kind.has_m() && !p.kind.super_scales() {
            p.m[i] = m[b];
        }
    }
    if p.kind.super_scales() {
        for (e, &v) in m[..nbp / 4].iter().enumerate() {
            p.m[k4_at(nbp, r, e / 2, e % 2)] = v;
        }
    }
}

/// Row r's codes in element order (`nbp·32`).
pub(crate) fn load_codes(p: &Packed, r: usize, codes: &mut [u8]) {
    let (gb, planes) = (group_block(p.kind), p.kind.planes());
    let mask = if p.kind.byte_codes() { 0xFF } else { 0x0F };
    let base = (r / ROWS) * p.nbp * gb;
    for b in 0..p.nbp {
        let q = &p.qs[base + b * gb..base + (b + 1) * gb];
        for k in 0..BLOCK {
            let (at, shift) = code_at(p.kind, r % ROWS, k);
            let high = (0..planes).fold(0u8, |h, pl| {
                let (at, bit) = plane_at(planes, r % ROWS, k, pl);
                h | ((q[at] >> bit) & 1) << (4 + pl)
            });
            codes[b * BLOCK + k] = ((q[at] >> shift) & mask) | high;
        }
    }
}

/// What a tile of 16 rows × C tokens reads: its group's codes (a block every
/// [`group_block`] bytes), scales and Q4_1 mins (16 a block), and per token the activation codes,
/// scales and sums.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Operands<const C: usize> {
    n: usize,
    q: *const u8,
    d: *const u16,
    m: *const u16,
    xq: [*const i8; C],
    dx: [*const f32; C],
    sx: [*const f32; C],
    /// A product over few tokens ([`FAR_MAX_TOKENS`]): its weights stream from memory once, so
    /// the tile also prefetches [`FAR_BYTES`] ahead into L2 (where [`super::far_prefetch`]).
    far: bool,
}

#[cfg(target_arch = "x86_64")]
impl<const C: usize> Operands<C> {
    /// # Safety
    /// Row group r0 / 16 and tokens t0..t0 + C must exist in `w` and `a`.
    #[inline(always)]
    unsafe fn new(w: &Packed, a: &QActs, r0: usize, t0: usize) -> Self {
        let (n, g) = (w.nbp, r0 / ROWS);
        Self {
            n,
            q: w.qs.as_ptr().add(g * n * group_block(w.kind)),
            d: w.d.as_ptr().add(g * n * ROWS),
            m: if w.kind.has_m() { w.m.as_ptr().add(g * w.kind.m_per_row(n) * ROWS) } else { std::ptr::null() },
            xq: array_from(|c| a.qs.as_ptr().add((t0 + c) * n * BLOCK)),
            dx: array_from(|c| a.d.as_ptr().add((t0 + c) * n)),
            sx: array_from(|c| a.s_for(w.kind, t0 + c).as_ptr()),
            far: a.t <= FAR_MAX_TOKENS && super::far_prefetch(),
        }
    }

    /// Block b's codes (`gb` bytes), once the codes [`PF_BYTES`] on are prefetched into L1 and,
    /// when `far`, those [`FAR_BYTES`] on into L2.
    #[inline(always)]
    unsafe fn block(&self, b: usize, gb: usize) -> *const u8 {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
        let qb = self.q.add(b * gb);
        for line in 0..gb / 64 {
            _mm_prefetch::<_MM_HINT_T0>(qb.wrapping_add(PF_BYTES + line * 64) as *const i8);
        }
        if self.far {
            for line in 0..gb / 64 {
                _mm_prefetch::<_MM_HINT_T1>(qb.wrapping_add(FAR_BYTES + line * 64) as *const i8);
            }
        }
        qb
    }

    /// When `far`, the scales (and, `with_m`, the mins or second scales: an entry a block) of
    /// the block [`FAR_BYTES`] of codes on, into L2; once every other block, as one 64-byte line
    /// holds two blocks' 16 entries. (The nearer prefetch of the scales is each tile's own.)
    #[inline(always)]
    unsafe fn scales_ahead(&self, b: usize, gb: usize, with_m: bool) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        if self.far && b.is_multiple_of(2) {
            let at = (b + FAR_BYTES / gb) * ROWS;
            _mm_prefetch::<_MM_HINT_T1>(self.d.wrapping_add(at) as *const i8);
            if with_m {
                _mm_prefetch::<_MM_HINT_T1>(self.m.wrapping_add(at) as *const i8);
            }
        }
    }
}

/// Per token t0..t0 + C, its offset terms for weights of `w`'s kind ([`QActs::offset_slot`]:
/// −k·Σq of block b at 2·b), from which the VNNI tiles start each block's sums; None where the
/// kind has none stored. (Kept out of [`Operands`], which every row group of a tile copies: there
/// the 8-token tiles ran ~4% slower.)
///
/// # Safety
/// Tokens t0..t0 + C must exist in `a`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn offset_terms<const C: usize>(w: &Packed, a: &QActs, t0: usize) -> Option<[*const i32; C]> {
    let slot = QActs::offset_slot(w.kind)?;
    Some(array_from(|c| a.offs.as_ptr().add(2 * (t0 + c) * a.nbp + slot)))
}

/// Bytes ahead of the current block that the kernel prefetches into L1 (8 blocks of a group).
#[cfg(target_arch = "x86_64")]
const PF_BYTES: usize = 8 * GROUP_BLOCK;

/// Bytes ahead that decode-sized products ([`FAR_MAX_TOKENS`]) also prefetch into L2. The L1
/// prefetch alone holds a line-fill buffer per line until it lands, which caps what one core has
/// in flight; the L2 prefetches queue in the L2's own, deeper miss queue. On the Sapphire
/// Rapids class host of 2026-12-03 (13–15 GB/s a core), the 370M's Q4_0 decode at 1 thread went
/// from 42–47 to 49–59 tok/s with 8 KiB (4 and 6 KiB: 46–50; alternating runs,
/// `examples/prefill_profile MODEL 64 1 2 1`), and `examples/gemv_stream 1` from 72–90% to
/// 79–99% of the prefetching read probe. On the Zen 4 host (2026-12-07) the same prefetch made
/// a product that one thread runs alone slower (`gemv_stream 1 24 q4_0 engine evict`: 72–79%
/// of the probe with it, 80–85% without), so there it is issued only by products spread over
/// several threads ([`super::far_prefetch`]).
#[cfg(target_arch = "x86_64")]
const FAR_BYTES: usize = 32 * GROUP_BLOCK;

/// Most tokens for which a product prefetches [`FAR_BYTES`] ahead: one AVX-512 tile of tokens,
/// so the weights stream from memory once (decode, and a step over a few sequences).
#[cfg(target_arch = "x86_64")]
const FAR_MAX_TOKENS: usize = 8;

/// # Safety
/// The CPU must support AVX-512 F/BW/VL, FMA and F16C; `w` must be in [`Layout::Rows16`] with
/// `lo` a multiple of 16; `out` must be valid for rows 0..hi − lo and tokens 0..T.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
pub unsafe fn gemm_avx512bw(w: &Packed, a: &QActs, lo: usize, hi: usize, out: OutMat) {
    gemm::<false, false>(w, a, lo, hi, out)
}

/// [`gemm_avx512bw`] with vpdpbusd.
///
/// # Safety
/// As [`gemm_avx512bw`], and the CPU must support AVX-512 VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
pub unsafe fn gemm_avx512vnni(w: &Packed, a: &QActs, lo: usize, hi: usize, out: OutMat) {
    gemm::<true, false>(w, a, lo, hi, out)
}

/// [`gemm_avx512vnni`] with IQ4_NL's codes looked up by vpermb (AVX-512 VBMI), whose 64-byte
/// table reads only an index's low six bits: with [`super::NL_CODES`] four times over, a byte's
/// low nibble needs no mask, and its high nibble one shift. Two fewer vector operations per
/// 64-byte load than vpshufb, which needs the index masked to four bits. The other kinds' tiles
/// are [`gemm_avx512vnni`]'s.
///
/// # Safety
/// As [`gemm_avx512vnni`], and the CPU must support AVX-512 VBMI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,fma,f16c")]
pub unsafe fn gemm_avx512vbmi(w: &Packed, a: &QActs, lo: usize, hi: usize, out: OutMat) {
    gemm::<true, true>(w, a, lo, hi, out)
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn gemm<const VNNI: bool, const VBMI: bool>(w: &Packed, a: &QActs, lo: usize, hi: usize, out: OutMat) {
    debug_assert!(w.layout == Layout::Rows16 && (lo.is_multiple_of(ROWS) || lo >= hi));
    // Long prefills walk the tokens in blocks whose activation codes stay in L2 while every row
    // group streams past them (as gemm_avx2 does), in whole 8-token tiles.
    let block = (token_block(a) & !7).max(8);
    for t in (0..a.t).step_by(block) {
        gemm_tokens::<VNNI, VBMI>(w, a, lo, hi, t..(t + block).min(a.t), out);
    }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn gemm_tokens<const VNNI: bool, const VBMI: bool>(
    w: &Packed,
    a: &QActs,
    lo: usize,
    hi: usize,
    tokens: std::ops::Range<usize>,
    out: OutMat,
) {
    // (planes, super-block scales, scales per 16 codes) of each kind, for the tile taking G
    // row groups in lockstep over C tokens.
    macro_rules! each_kind {
        ($c:literal, $g:expr, $gs:expr) => {
            match w.kind {
                Kind::Q8_0 => avx512::tile_q8::<$c, $g, VNNI, false, false>($gs),
                Kind::IQ4NL => avx512::tile_q8::<$c, $g, VNNI, true, VBMI>($gs),
                Kind::Q4_0 | Kind::Q4_1 => avx512::tile::<$c, $g, VNNI, 0, false, false>($gs),
                Kind::Q4K => avx512::tile::<$c, $g, VNNI, 0, true, false>($gs),
                Kind::Q3K => avx512::tile::<$c, $g, VNNI, 0, false, true>($gs),
                Kind::Q2K => avx512::tile::<$c, $g, VNNI, 0, true, true>($gs),
                Kind::Q5_0 | Kind::Q5K | Kind::Q5_1 => avx512::tile::<$c, $g, VNNI, 1, false, false>($gs),
                Kind::Q6K => avx512::tile::<$c, $g, VNNI, 2, false, true>($gs),
            }
        };
    }
    // One token (decode): the band's groups as STREAMS runs of consecutive groups, one group of
    // each run at a time in one tile, so that each core streams from several places at once.
    let groups = (hi - lo).div_ceil(ROWS);
    if tokens.len() == 1 && groups >= STREAMS {
        let run = groups / STREAMS;
        for i in 0..run {
            let r0: [usize; STREAMS] = array_from(|k| lo + (k * run + i) * ROWS);
            let valid: [usize; STREAMS] = array_from(|k| ROWS.min(hi - r0[k]));
            let gs = avx512::Groups { w, a, r0, valid, t0: tokens.start, lo, out };
            each_kind!(1, STREAMS, gs);
        }
        for r in (lo + STREAMS * run * ROWS..hi).step_by(ROWS) {
            let gs = avx512::Groups { w, a, r0: [r], valid: [ROWS.min(hi - r)], t0: tokens.start, lo, out };
            each_kind!(1, 1, gs);
        }
        return;
    }
    super::tiles(lo, hi, tokens, ROWS, 8, |r0, valid, t0, c| {
        let gs = avx512::Groups::one((w, a, r0, t0, valid, r0 - lo, out));
        match c {
            8 => each_kind!(8, 1, gs),
            7 => each_kind!(7, 1, gs),
            6 => each_kind!(6, 1, gs),
            5 => each_kind!(5, 1, gs),
            4 => each_kind!(4, 1, gs),
            3 => each_kind!(3, 1, gs),
            2 => each_kind!(2, 1, gs),
            _ => each_kind!(1, 1, gs),
        }
    });
}

/// Start a product of rows lo..hi over `t` tokens on its way into L2 before it runs, when it
/// streams its weights once ([`FAR_MAX_TOKENS`]; else nothing): the first
/// [`LEAD_BYTES`] of codes of each stream [`gemm_tokens`] will walk, and the first line of
/// their scales (and mins). A task of a decode job runs several bands one after another (a
/// layer's q, k, v, ... in turn; a mixture's experts), and each band's streams otherwise start
/// cold: the kernel's own prefetches run ahead of a stream only once it has begun.
pub fn prefetch_band(w: &Packed, lo: usize, hi: usize, t: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        if t > FAR_MAX_TOKENS || w.layout != Layout::Rows16 || lo >= hi || hi > w.rows {
            return;
        }
        let groups = (hi - lo).div_ceil(ROWS);
        let run = if groups >= STREAMS { groups / STREAMS } else { groups };
        let (n, gb) = (w.nbp, group_block(w.kind));
        let lead = LEAD_BYTES.min(run * n * gb);
        for k in 0..STREAMS.min(groups) {
            let g = lo / ROWS + k * run;
            let q = w.qs.as_ptr().wrapping_add(g * n * gb);
            // SAFETY: none needed: a prefetch never faults (addresses past the band are harmless).
            unsafe {
                for off in (0..lead).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T1>(q.wrapping_add(off) as *const i8);
                }
                _mm_prefetch::<_MM_HINT_T1>(w.d.as_ptr().wrapping_add(g * n * ROWS) as *const i8);
                if w.kind.has_m() {
                    let m = w.m.as_ptr().wrapping_add(g * w.kind.m_per_row(n) * ROWS);
                    _mm_prefetch::<_MM_HINT_T1>(m as *const i8);
                }
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (w, lo, hi, t);
}

/// Bytes of each stream's codes [`prefetch_band`] asks for.
#[cfg(target_arch = "x86_64")]
const LEAD_BYTES: usize = 16 * GROUP_BLOCK;

/// Row groups a one-token product walks at once on AVX-512 ([`gemm_tokens`]). A core reading
/// one stream left memory idle between its prefetches: on the Sapphire Rapids class host of
/// 2026-12-03 (huge pages on), 165 MiB of Q4_0 in one matvec against a read of the same bytes,
/// alternating in one process over 15 rounds, went from 81.5% to 84.8% with two streams and
/// 87.0% with four at 1 thread (88.1% → 92.7% → 95.0% at 2; eight were slower than four); in
/// a second run 83.7% → 90.4% (1 thread), 85.9% → 93.4% (2). Products of ~1 MiB (the 370M's
/// layers as 168 matvecs) gained nothing measurable there, nor did the engine's decode. On the
/// Zen 4 host of 2026-12-04 (1 MiB L2 a core, 32 MiB L3), the engine's decode prefers two: in
/// one process alternating the variants every block of tokens (30 rounds), the 370M Q4_0 at 2
/// threads ran 2.3–5.1% faster with two than with four (24–30 of 30 rounds), as fast with one
/// at 1 thread (one: −4%); SmolLM2 6.8% (2 threads) and 8.0% (1); `tiny` 3.5%; eight streams
/// were 10% slower (scripts/experiments/decode-phases).
#[cfg(target_arch = "x86_64")]
const STREAMS: usize = 2;

/// [`gemm_avx512bw`]'s arithmetic on 256-bit registers, for CPUs with AVX2 and no AVX-512: each
/// 64-byte load of a group-block is read as two 32-byte halves (rows 0–7, rows 8–15), each plane
/// mask as two 32-bit halves. Tiles of 16 rows × up to 2 tokens (AVX2 has 16 vector registers).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; otherwise as [`gemm_avx512bw`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn gemm_avx2(w: &Packed, a: &QActs, lo: usize, hi: usize, out: OutMat) {
    debug_assert!(w.layout == Layout::Rows16 && (lo.is_multiple_of(ROWS) || lo >= hi));
    // (planes, scales per 16 codes)
    let (planes, halves) = match w.kind {
        Kind::Q8_0 => return gemm_avx2_q8::<false>(w, a, lo, hi, out),
        Kind::IQ4NL => return gemm_avx2_q8::<true>(w, a, lo, hi, out),
        Kind::Q4_0 | Kind::Q4_1 | Kind::Q4K => (0, false),
        Kind::Q3K | Kind::Q2K => (0, true),
        Kind::Q5_0 | Kind::Q5K | Kind::Q5_1 => (1, false),
        Kind::Q6K => (2, true),
    };
    macro_rules! run {
        ($p:literal, $h:literal, $u:literal, $codes:expr, $lo:expr, $hi:expr, $tok:expr) => {
            super::tiles($lo, $hi, $tok, ROWS, 2, |r0, valid, t0, c| {
                let args = (w, a, r0, t0, valid, r0 - lo, out);
                if c == 2 {
                    avx2::tile::<2, $p, $h, $u>(args, $codes)
                } else {
                    avx2::tile::<1, $p, $h, $u>(args, $codes)
                }
            })
        };
    }
    macro_rules! each_kind {
        ($u:literal, $codes:expr, $lo:expr, $hi:expr, $tok:expr) => {
            match (planes, halves) {
                (0, false) => run!(0, false, $u, $codes, $lo, $hi, $tok),
                (0, true) => run!(0, true, $u, $codes, $lo, $hi, $tok),
                (1, _) => run!(1, false, $u, $codes, $lo, $hi, $tok),
                _ => run!(2, true, $u, $codes, $lo, $hi, $tok),
            }
        };
    }
    if a.t < UNPACK_MIN_TOKENS {
        return each_kind!(false, std::ptr::null(), lo, hi, 0..a.t);
    }
    // Prefill: each group's codes are unpacked once per block of tokens into bytes (planes
    // included), which every token pair's tile of the block then loads as they are.
    unpacked_groups(
        w,
        a,
        lo,
        hi,
        avx2::UNPACKED_PER_BLOCK,
        |g0, codes| match planes {
            0 => avx2::unpack_group::<0>(w, g0, codes),
            1 => avx2::unpack_group::<1>(w, g0, codes),
            _ => avx2::unpack_group::<2>(w, g0, codes),
        },
        |p, g0, g1, tok| each_kind!(true, p, g0, g1, tok),
    );
}

/// The AVX2 prefill's walk: per block of tokens ([`token_block`], whose activations stay in L2
/// while every row group streams past them) and per row group g0 of lo..hi, `unpack(g0, buf)`
/// (`per_block` registers a block) once, then `tiles(buf, g0, g0 + 16 ∧ hi, tokens)`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn unpacked_groups(
    w: &Packed,
    a: &QActs,
    lo: usize,
    hi: usize,
    per_block: usize,
    mut unpack: impl FnMut(usize, &mut [std::arch::x86_64::__m256i]),
    mut tiles: impl FnMut(*const std::arch::x86_64::__m256i, usize, usize, std::ops::Range<usize>),
) {
    let mut codes = vec![std::arch::x86_64::_mm256_setzero_si256(); w.nbp * per_block];
    let block = token_block(a);
    for t0 in (0..a.t).step_by(block) {
        for g0 in (lo..hi).step_by(ROWS) {
            unpack(g0, &mut codes);
            tiles(codes.as_ptr(), g0, (g0 + ROWS).min(hi), t0..(t0 + block).min(a.t));
        }
    }
}

/// Tokens per block of [`gemm_avx2`]'s unpacked path: as many as keep the block's activation
/// codes within [`ACT_BLOCK_BYTES`], in whole token pairs, at least `UNPACK_MIN_TOKENS`.
#[cfg(target_arch = "x86_64")]
fn token_block(a: &QActs) -> usize {
    (ACT_BLOCK_BYTES / (a.nbp * BLOCK).max(1)).max(UNPACK_MIN_TOKENS) & !1
}

/// Activation bytes a token block of [`gemm_avx2`] and the AVX-512 [`gemm`] streams past each row
/// group. Without blocks, a 4096-token product of 2816 columns (11 MB of codes) ran at 68 GMAC/s
/// on Zen 3, against 84 with 1 MiB blocks (`qgemm_speed 1408 2816 q4_0 avx2 8 4096`); 512 tokens
/// ran at 89–90 either way, 256 KiB blocks cost them ~2%. On Zen 4 (`… avx512-vnni 4 4096`,
/// alternating runs) 88–114 → 111–138 GMAC/s, 512 KiB blocks the same as 1 MiB; 512 tokens 149.
/// Blocking changes no result: each output is the same sum over the same columns.
#[cfg(target_arch = "x86_64")]
const ACT_BLOCK_BYTES: usize = 1 << 20;

/// Tokens from which [`gemm_avx2`] unpacks each row group's codes before its tiles: the unpacking
/// costs about a third of one token pair's pass over the group, and saves a quarter of each.
#[cfg(target_arch = "x86_64")]
const UNPACK_MIN_TOKENS: usize = 4;

/// [`gemm_avx2`] for Q8_0's byte codes, or (`NL`) IQ4_NL's table indices. From
/// [`UNPACK_MIN_TOKENS`] on, as the nibble kinds, each row group's signed codes and their
/// magnitudes are formed once per block of tokens ([`avx2::unpack_group_q8`]) instead of once per
/// token pair.
///
/// # Safety
/// As [`gemm_avx2`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemm_avx2_q8<const NL: bool>(w: &Packed, a: &QActs, lo: usize, hi: usize, out: OutMat) {
    macro_rules! run {
        ($u:literal, $codes:expr, $lo:expr, $hi:expr, $tok:expr) => {
            super::tiles($lo, $hi, $tok, ROWS, 2, |r0, valid, t0, c| {
                let args = (w, a, r0, t0, valid, r0 - lo, out);
                if c == 2 {
                    avx2::tile_q8::<2, NL, $u>(args, $codes)
                } else {
                    avx2::tile_q8::<1, NL, $u>(args, $codes)
                }
            })
        };
    }
    if a.t < UNPACK_MIN_TOKENS {
        return run!(false, std::ptr::null(), lo, hi, 0..a.t);
    }
    unpacked_groups(
        w,
        a,
        lo,
        hi,
        avx2::UNPACKED_Q8_PER_BLOCK,
        |g0, codes| avx2::unpack_group_q8::<NL>(w, g0, codes),
        |p, g0, g1, tok| run!(true, p, g0, g1, tok),
    );
}

/// How a nibble tile turns a block's integer sums into floats, from the weight kind: the offset
/// of Q4_0 / Q5_0 (−8 / −16), a min a block (Q4_1, Q5_1, Q5_K), the same with the scale and min
/// formed from Q4_K's 6-bit pairs and super-block scales (`SuperMin`), a scale per half block
/// with an offset (Q6_K −32, Q3_K −4), or a scale and min per half block formed from Q2_K's
/// 4-bit pairs and super-block scales (`SuperMinHalves`). `Signed` and `SignedHalves` are the
/// offset kinds' when the tile has taken the offset off the codes already (the AMX tiles).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, PartialEq)]
enum Scaling {
    Signed,
    SignedHalves,
    Offset(f32),
    Min,
    SuperMin,
    Halves(f32),
    SuperMinHalves,
}

#[cfg(target_arch = "x86_64")]
impl Scaling {
    /// The kind's scaling; Q8_0 and IQ4_NL (whose codes the tiles take as code + 128) that of an
    /// offset of −128.
    fn of(kind: Kind) -> Scaling {
        match (kind.code_offset(), kind.per_half(), kind.super_scales()) {
            (Some(k), false, _) => Scaling::Offset(-k),
            (Some(k), true, _) => Scaling::Halves(-k),
            (None, false, false) => Scaling::Min,
            (None, false, true) => Scaling::SuperMin,
            (None, true, _) => Scaling::SuperMinHalves,
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
pub use amx::gemm_amx;
#[cfg(target_arch = "x86_64")]
mod avx2;

/// [`super::NL_CODES`] in every 128-bit lane, for vpshufb.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn nl_table_512() -> std::arch::x86_64::__m512i {
    std::arch::x86_64::_mm512_broadcast_i32x4(std::arch::x86_64::_mm_loadu_si128(super::NL_CODES.as_ptr() as *const _))
}

#[cfg(target_arch = "x86_64")]
mod avx512;
