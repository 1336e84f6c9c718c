//! Repacking ggml rows into the kernels' layouts ([`Packed`]): per type, the codes as the tiles
//! store them and the scales (and mins, second scales, super-block scales) they read.

use super::{rows16, rows16_simd, Kind, Layout, Packed, BLOCK};
use crate::hugebuf::{Buf, Place};
use crate::quant::k_quants::{q4_k_codes, q5_k_blocks, q6_k_halves, scale_min_k4, Q4K_BYTES, Q5K_BYTES, Q6K_BYTES, QK};
use crate::quant::k_quants_low::{q2_k_codes, q2_k_d_dmin_bits, q3_k_halves, Q2K_BYTES, Q3K_BYTES};
use crate::quant::{iq4, GgmlType};

/// One K-quant super-block as the 16-row tiles take it: 256 codes as stored, its eight 32-code
/// blocks' `d` and its `m` (f16 bits; the first [`Kind::m_per_row`]`(8)` of them are used).
type SuperBlock = ([u8; QK], [u16; 8], [u16; 8]);

/// A Q4_K super-block for [`Kind::Q4K`]: codes as stored (0..15), each block's 6-bit scale and
/// min as a byte pair in `d`, the super-block's f16 `d` and `dmin` in `m[0]`, `m[1]`.
fn q4_k_super_block(blk: &[u8]) -> Option<SuperBlock> {
    let (q, _, _, sc) = q4_k_codes(blk);
    let pairs = std::array::from_fn(|j| {
        let (ls, lm) = scale_min_k4(j, sc);
        ls as u16 | (lm as u16) << 8
    });
    let mut m = [0u16; 8];
    m[0] = u16::from_le_bytes([blk[0], blk[1]]);
    m[1] = u16::from_le_bytes([blk[2], blk[3]]);
    Some((q, pairs, m))
}

/// A Q6_K super-block for [`Kind::Q6K`]: codes as stored (0..63), each block's first-half scale
/// in `d` and second-half one in `m`.
fn q6_k_super_block(blk: &[u8]) -> Option<SuperBlock> {
    let (q, sc) = q6_k_halves(blk)?;
    Some((q.map(|q| (q as i32 + 32) as u8), std::array::from_fn(|j| sc[2 * j]), std::array::from_fn(|j| sc[2 * j + 1])))
}

/// A Q3_K super-block for [`Kind::Q3K`]: codes 0..7 (value `(u − 4)·scale`), each block's
/// first-half scale in `d` and second-half one in `m` (f16 of d·(sc − 32)).
fn q3_k_super_block(blk: &[u8]) -> Option<SuperBlock> {
    let (q, sc) = q3_k_halves(blk)?;
    Some((q, std::array::from_fn(|j| sc[2 * j]), std::array::from_fn(|j| sc[2 * j + 1])))
}

/// A Q2_K super-block for [`Kind::Q2K`]: codes 0..3, each block's two scale-and-min bytes as a
/// pair in `d` (first half low), the super-block's f16 `d` and `dmin` in `m[0]`, `m[1]`.
fn q2_k_super_block(blk: &[u8]) -> Option<SuperBlock> {
    let (q, _, _, sc) = q2_k_codes(blk);
    let mut m = [0u16; 8];
    m[..2].copy_from_slice(&q2_k_d_dmin_bits(blk));
    Some((q, std::array::from_fn(|j| u16::from_le_bytes([sc[2 * j], sc[2 * j + 1]])), m))
}

impl Packed {
    /// Repack ggml rows of `ty` (`rows × ty.row_bytes(cols)` bytes) in the layout this CPU's
    /// kernels read. `None` for types the integer kernels do not take. Q4_K rows enter the
    /// 16-row layout as [`Kind::Q4K`] (its 6-bit scales kept, 4.625 bits a weight); Q5_0, Q5_1,
    /// Q5_K and Q6_K rows as nibbles plus one or two high-bit planes ([`Kind::Q5_0`],
    /// [`Kind::Q5_1`], [`Kind::Q5K`], [`Kind::Q6K`]; 6 bits a weight for the Q5 types, 7 for
    /// Q6_K); Q3_K and Q2_K rows as nibbles, [`Kind::Q3K`] with Q6_K's scale per 16 codes (5
    /// bits a weight), [`Kind::Q2K`] with its 4-bit scale and min pairs (4.625). None of these
    /// has a row-pair form: they take the 16-row layout wherever its SIMD kernels run, also when
    /// the other matrices are in row pairs (`K3MINI_LAYOUT=rowpairs`). Elsewhere Q4_K rows enter
    /// as the Q4_1 blocks their sub-blocks are (`k_quants::q4_k_as_q4_1`: scales and mins rounded
    /// to f16, 5 bits a weight), Q5_0 rows as the Q8_0 blocks they equal exactly
    /// (`q5_0::as_q8_0`), and the others stay on row dots (`None`). IQ4_NL rows take
    /// [`Kind::IQ4NL`] in 16-row groups (as stored, 4.5 bits a weight, as the K-quants) and
    /// elsewhere the Q8_0 blocks they equal exactly (8.5 bits); IQ4_XS rows enter as IQ4_NL
    /// blocks with each block's scale rounded to f16 (`iq4::xs_as_nl`).
    pub fn pack(ty: GgmlType, rows: usize, cols: usize, data: &[u8], place: Place) -> Option<Packed> {
        let layout = match ty {
            GgmlType::Q2_K
            | GgmlType::Q3_K
            | GgmlType::Q4_K
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q5_K
            | GgmlType::Q6_K
            | GgmlType::IQ4_NL
            | GgmlType::IQ4_XS
                if rows16_simd() =>
            {
                Layout::Rows16
            }
            _ => Layout::best(),
        };
        Self::pack_as(ty, rows, cols, data, layout, place)
    }

    /// [`Packed::pack`] a band of rows at a time (whole 16-row groups, about `band_bytes` of
    /// `data` each), handing each band's bytes to `done` once it is repacked: a caller reading
    /// the rows from a mapped file can drop their pages as it goes, so the load holds the repacked
    /// matrix and one band of the file's pages at once, not the whole tensor twice. The same
    /// matrix as one `pack` (the layouts are band-contiguous: row-major, or 16-row groups), on
    /// huge pages from the first write ([`Place::Huge`]): a matrix of one band is packed there
    /// directly, a larger one band by band on the heap, each band copied into its place.
    pub fn pack_bands(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &[u8],
        band_bytes: usize,
        mut done: impl FnMut(&[u8]),
    ) -> Option<Packed> {
        let rb = ty.row_bytes(cols);
        let band = (band_bytes / rb.max(1)).max(1).next_multiple_of(rows16::ROWS);
        if rows <= band {
            let whole = Self::pack(ty, rows, cols, data, Place::Huge)?;
            done(data);
            return Some(whole);
        }
        let mut whole: Option<Packed> = None;
        let (mut qs, mut d, mut m) = (0, 0, 0); // where the next band goes
        for r0 in (0..rows).step_by(band) {
            let rows_here = band.min(rows - r0);
            let bytes = &data[r0 * rb..(r0 + rows_here) * rb];
            let part = Self::pack(ty, rows_here, cols, bytes, Place::Heap)?;
            done(bytes);
            let w = whole.get_or_insert_with(|| Self::zeroed(part.kind, part.layout, rows, cols, Place::Huge));
            debug_assert!(
                r0.is_multiple_of(w.row_align()) && (w.kind, w.layout, w.nbp) == (part.kind, part.layout, part.nbp)
            );
            w.qs[qs..qs + part.qs.len()].copy_from_slice(&part.qs);
            w.d[d..d + part.d.len()].copy_from_slice(&part.d);
            w.m[m..m + part.m.len()].copy_from_slice(&part.m);
            (qs, d, m) = (qs + part.qs.len(), d + part.d.len(), m + part.m.len());
        }
        debug_assert!(whole.as_ref().is_none_or(|w| (w.qs.len(), w.d.len(), w.m.len()) == (qs, d, m)));
        whole
    }

    /// The kind a 32-code block type packs as, with its block's bytes and where its codes start.
    fn block_kind(ty: GgmlType) -> Option<(Kind, usize, usize)> {
        match ty {
            GgmlType::Q4_0 => Some((Kind::Q4_0, 18, 2)),
            GgmlType::Q4_1 => Some((Kind::Q4_1, 20, 4)),
            GgmlType::Q8_0 => Some((Kind::Q8_0, 34, 2)),
            GgmlType::IQ4_NL => Some((Kind::IQ4NL, 18, 2)),
            _ => None,
        }
    }

    /// [`Packed::pack`] in a given layout.
    pub fn pack_as(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &[u8],
        layout: Layout,
        place: Place,
    ) -> Option<Packed> {
        match ty {
            GgmlType::Q4_K if layout == Layout::Rows16 => {
                return Self::pack_super_blocks(
                    Kind::Q4K,
                    (rows, cols, data, layout, place),
                    Q4K_BYTES,
                    q4_k_super_block,
                )
            }
            GgmlType::Q4_K => {
                let q41 = crate::quant::k_quants::q4_k_as_q4_1(data);
                return Self::pack_as(GgmlType::Q4_1, rows, cols, &q41, layout, place);
            }
            GgmlType::Q5_0 if layout == Layout::RowPairs => {
                return Self::pack_as(GgmlType::Q8_0, rows, cols, &crate::quant::q5_0::as_q8_0(data), layout, place)
            }
            GgmlType::Q5_0 => return Self::pack_q5(Kind::Q5_0, rows, cols, data, layout, place),
            GgmlType::Q6_K => {
                return Self::pack_super_blocks(
                    Kind::Q6K,
                    (rows, cols, data, layout, place),
                    Q6K_BYTES,
                    q6_k_super_block,
                )
            }
            GgmlType::Q5_K => {
                return Self::pack_super_blocks(Kind::Q5K, (rows, cols, data, layout, place), Q5K_BYTES, q5_k_blocks)
            }
            GgmlType::Q3_K => {
                return Self::pack_super_blocks(
                    Kind::Q3K,
                    (rows, cols, data, layout, place),
                    Q3K_BYTES,
                    q3_k_super_block,
                )
            }
            GgmlType::Q2_K => {
                return Self::pack_super_blocks(
                    Kind::Q2K,
                    (rows, cols, data, layout, place),
                    Q2K_BYTES,
                    q2_k_super_block,
                )
            }
            GgmlType::Q5_1 => return Self::pack_q5(Kind::Q5_1, rows, cols, data, layout, place),
            GgmlType::IQ4_NL if layout == Layout::RowPairs => {
                return Self::pack_as(GgmlType::Q8_0, rows, cols, &iq4::nl_as_q8_0(data), layout, place)
            }
            GgmlType::IQ4_XS if cols.is_multiple_of(QK) => {
                return Self::pack_as(GgmlType::IQ4_NL, rows, cols, &iq4::xs_as_nl(data), layout, place)
            }
            _ => {}
        }
        let (kind, bb, off) = Self::block_kind(ty)?;
        if !cols.is_multiple_of(BLOCK) {
            return None;
        }
        if layout == Layout::Rows16 {
            return Some(Self::stored_rows16(kind, rows, cols, data, bb, off, place));
        }
        Some(Self::blocks_by_codes(kind, layout, rows, cols, data, bb, off, place))
    }

    /// Q4_0, Q4_1, IQ4_NL or Q8_0 rows (`kind`; blocks of `bb` bytes, codes from byte `off`) in
    /// the 16-row layout, copied as stored: ggml's code byte j of a block holds codes j and j + 16,
    /// which is the tiles' byte for row r's lane of 4-code group j / 4 (`rows16::code_at`), so
    /// each block is four 4-byte copies and its scale (and min), with no code taken apart. The
    /// same matrix as [`Packed::blocks_by_codes`] (test). With it and `store_row`'s lanes,
    /// `k3mini logits` on the 370M Q4_0 (start, load, one token) went from 0.88–0.90 s to
    /// 0.39–0.41 s on the Emerald Rapids class host. Q8_0 rows likewise (since 2026-12-06): its
    /// code bytes 4g..4g + 4 are row r's lane of group g, each stored as code + 128 (the sign bit
    /// flipped), and a pad block's codes are 128.
    fn stored_rows16(kind: Kind, rows: usize, cols: usize, data: &[u8], bb: usize, off: usize, place: Place) -> Packed {
        let mut p = Self::zeroed(kind, Layout::Rows16, rows, cols, place);
        let (nb, nbp) = (cols / BLOCK, p.nbp);
        let gb = rows16::ROWS * p.row_qs() / nbp; // bytes of a group's block
        let byte = kind.byte_codes();
        let code_bytes = if byte { BLOCK } else { BLOCK / 2 }; // a block's code bytes
        debug_assert_eq!(data.len(), rows * nb * bb);
        for (r, row) in data.chunks_exact(nb * bb).enumerate() {
            let lane = (r % rows16::ROWS) * 4;
            let group = (r / rows16::ROWS) * nbp * gb;
            for (b, blk) in row.chunks_exact(bb).enumerate() {
                let out = &mut p.qs[group + b * gb..group + (b + 1) * gb];
                for (g, four) in blk[off..off + code_bytes].chunks_exact(4).enumerate() {
                    let lanes = &mut out[g * 64 + lane..g * 64 + lane + 4];
                    match byte {
                        true => lanes.iter_mut().zip(four).for_each(|(o, &c)| *o = c ^ 0x80),
                        false => lanes.copy_from_slice(four),
                    }
                }
                let i = rows16::scale_at(nbp, r, b);
                p.d[i] = u16::from_le_bytes([blk[0], blk[1]]);
                if kind.has_m() {
                    p.m[i] = u16::from_le_bytes([blk[2], blk[3]]);
                }
            }
            if byte && nb < nbp {
                // The pad block's codes stand for 0.
                let out = &mut p.qs[group + nb * gb..group + (nb + 1) * gb];
                for g in 0..BLOCK / 4 {
                    out[g * 64 + lane..g * 64 + lane + 4].fill(128);
                }
            }
        }
        p
    }

    /// Q4_0, Q4_1, Q8_0 or IQ4_NL rows through their codes ([`Packed::from_rows`]): every
    /// layout.
    fn blocks_by_codes(
        kind: Kind,
        layout: Layout,
        rows: usize,
        cols: usize,
        data: &[u8],
        bb: usize,
        off: usize,
        place: Place,
    ) -> Packed {
        let nb = cols / BLOCK;
        let row_bytes = nb * bb;
        debug_assert_eq!(data.len(), rows * row_bytes);
        Self::from_rows(kind, layout, rows, cols, place, |r, codes, d, m| {
            let row = &data[r * row_bytes..(r + 1) * row_bytes];
            for b in 0..nb {
                let blk = &row[b * bb..(b + 1) * bb];
                d[b] = u16::from_le_bytes([blk[0], blk[1]]);
                if kind == Kind::Q4_1 {
                    m[b] = u16::from_le_bytes([blk[2], blk[3]]);
                }
                let c = &mut codes[b * BLOCK..(b + 1) * BLOCK];
                match kind {
                    Kind::Q8_0 => {
                        for j in 0..BLOCK {
                            c[j] = (blk[off + j] as i8 as i32 + 128) as u8;
                        }
                    }
                    _ => {
                        for j in 0..16 {
                            c[j] = blk[off + j] & 0x0F;
                            c[j + 16] = blk[off + j] >> 4;
                        }
                    }
                }
            }
        })
    }

    /// K-quant rows (`cols` a multiple of 256, `bytes` a super-block) as `kind` in the 16-row
    /// layout, each super-block decoded once by `block` into its 256 codes as the tiles store
    /// them, its eight blocks' `d` and its `m` entries; `None` in row pairs, or when `block`
    /// refuses one (a scale past f16's range: the caller keeps ggml's row dots).
    fn pack_super_blocks(
        kind: Kind,
        (rows, cols, data, layout, place): (usize, usize, &[u8], Layout, Place),
        bytes: usize,
        block: fn(&[u8]) -> Option<SuperBlock>,
    ) -> Option<Packed> {
        if layout != Layout::Rows16 || !cols.is_multiple_of(QK) {
            return None;
        }
        debug_assert_eq!(data.len(), rows * cols / QK * bytes);
        let refused = std::cell::Cell::new(false);
        let mk = kind.m_per_row(8); // `m` entries per super-block
        let p = Self::from_rows(kind, layout, rows, cols, place, |r, codes, d, m| {
            let row = &data[r * cols / QK * bytes..(r + 1) * cols / QK * bytes];
            for (k, blk) in row.chunks_exact(bytes).enumerate() {
                let Some((q, sc, mn)) = block(blk) else { return refused.set(true) };
                codes[k * QK..(k + 1) * QK].copy_from_slice(&q);
                d[k * 8..(k + 1) * 8].copy_from_slice(&sc);
                m[k * mk..(k + 1) * mk].copy_from_slice(&mn[..mk]);
            }
        });
        (!refused.get()).then_some(p)
    }

    /// Q5_0 or Q5_1 rows (`kind`) in the 16-row layout, exactly (their f16 scale and, for Q5_1,
    /// min; codes 0..31); `None` in row pairs.
    fn pack_q5(kind: Kind, rows: usize, cols: usize, data: &[u8], layout: Layout, place: Place) -> Option<Packed> {
        use crate::quant::q5_0::unpack_five_bits;
        if layout != Layout::Rows16 || !cols.is_multiple_of(BLOCK) {
            return None;
        }
        // f16 d (and for Q5_1 f16 m), then `u8 qh[4]; u8 qs[16]`.
        let head = if kind == Kind::Q5_1 { 4 } else { 2 };
        let (nb, bytes) = (cols / BLOCK, head + 20);
        debug_assert_eq!(data.len(), rows * nb * bytes);
        Some(Self::from_rows(kind, layout, rows, cols, place, |r, c, d, m| {
            for (b, blk) in data[r * nb * bytes..(r + 1) * nb * bytes].chunks_exact(bytes).enumerate() {
                c[b * BLOCK..(b + 1) * BLOCK].copy_from_slice(&unpack_five_bits(&blk[head..]));
                d[b] = u16::from_le_bytes([blk[0], blk[1]]);
                if kind == Kind::Q5_1 {
                    m[b] = u16::from_le_bytes([blk[2], blk[3]]);
                }
            }
        }))
    }

    /// An all-zero matrix of `rows` × `cols` (a multiple of 32) in `layout`: blocks padded to an
    /// even count, rows (Rows16) to whole 16-row groups.
    fn zeroed(kind: Kind, layout: Layout, rows: usize, cols: usize, place: Place) -> Packed {
        let nb = cols / BLOCK;
        let nbp = nb + nb % 2;
        let stored_rows = if layout == Layout::Rows16 { rows.next_multiple_of(rows16::ROWS) } else { rows };
        let mut p = Packed {
            kind,
            layout,
            rows,
            cols,
            nbp,
            qs: Buf::default(),
            d: Buf::zeroed(stored_rows * nbp, place),
            m: Buf::zeroed(if kind.has_m() { stored_rows * kind.m_per_row(nbp) } else { 0 }, place),
            pair: Default::default(),
        };
        p.qs = Buf::zeroed(stored_rows * p.row_qs(), place);
        p
    }

    /// Build from rows given as unsigned codes (`nbp·32`; Q8_0 as code + 128, the others as
    /// stored), f16 scales and mins or second-half scales (`nbp` each; Q4_K: its scale-min byte
    /// pairs and super-block scales, [`Kind::Q4K`]); `row` fills them for row r (pad blocks are
    /// left zero, byte codes 128).
    pub(super) fn from_rows(
        kind: Kind,
        layout: Layout,
        rows: usize,
        cols: usize,
        place: Place,
        mut row: impl FnMut(usize, &mut [u8], &mut [u16], &mut [u16]),
    ) -> Packed {
        let mut p = Self::zeroed(kind, layout, rows, cols, place);
        let (nbp, per_row) = (p.nbp, p.row_qs());
        let mut codes = vec![0u8; nbp * BLOCK];
        let (mut d, mut m) = (vec![0u16; nbp], vec![0u16; nbp]);
        for r in 0..rows {
            codes.iter_mut().for_each(|c| *c = if kind.byte_codes() { 128 } else { 0 });
            d.iter_mut().for_each(|x| *x = 0);
            m.iter_mut().for_each(|x| *x = 0);
            row(r, &mut codes, &mut d, &mut m);
            match layout {
                Layout::Rows16 => rows16::store_row(&mut p, r, &codes, &d, &m),
                Layout::RowPairs => {
                    assert!(!kind.rows16_only(), "{kind:?} has no row-pair layout");
                    let out = &mut p.qs[r * per_row..(r + 1) * per_row];
                    if kind.byte_codes() {
                        out.copy_from_slice(&codes);
                    } else {
                        for q in 0..nbp / 2 {
                            for j in 0..BLOCK {
                                out[q * 32 + j] = codes[2 * q * BLOCK + j] | (codes[(2 * q + 1) * BLOCK + j] << 4);
                            }
                        }
                    }
                    p.d[r * nbp..(r + 1) * nbp].copy_from_slice(&d);
                    if kind.has_m() {
                        p.m[r * nbp..(r + 1) * nbp].copy_from_slice(&m);
                    }
                }
            }
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;

    /// `store_row` writes what its one-code-at-a-time reference writes, for every kind: byte
    /// codes, nibbles, one and two planes, super-block scales; 37 rows (three groups, the last
    /// partial), 8 blocks.
    #[test]
    fn rows_stored_a_lane_at_a_time_equal_the_reference() {
        let mut rng = Rng::new(9);
        let kinds = [
            Kind::Q4_0,
            Kind::Q4_1,
            Kind::Q8_0,
            Kind::IQ4NL,
            Kind::Q4K,
            Kind::Q5_0,
            Kind::Q5_1,
            Kind::Q5K,
            Kind::Q6K,
            Kind::Q3K,
            Kind::Q2K,
        ];
        let (rows, cols) = (37, 256);
        for kind in kinds {
            let top = if kind.byte_codes() { 256 } else { 16 << kind.planes() };
            let nbp = cols / BLOCK;
            let per_row: Vec<(Vec<u8>, Vec<u16>, Vec<u16>)> = (0..rows)
                .map(|_| {
                    let codes = (0..nbp * BLOCK).map(|_| (rng.uniform() * top as f32) as u8).collect();
                    let d = (0..nbp).map(|_| (rng.uniform() * 65535.0) as u16).collect();
                    let m = (0..nbp).map(|_| (rng.uniform() * 65535.0) as u16).collect();
                    (codes, d, m)
                })
                .collect();
            let fast = Packed::from_rows(kind, Layout::Rows16, rows, cols, Place::Heap, |r, c, d, m| {
                c.copy_from_slice(&per_row[r].0);
                d.copy_from_slice(&per_row[r].1);
                m.copy_from_slice(&per_row[r].2);
            });
            let mut slow = fast.clone();
            slow.qs.fill(0);
            slow.d.fill(0);
            slow.m.fill(0);
            for (r, (c, d, m)) in per_row.iter().enumerate() {
                rows16::store_row_ref(&mut slow, r, c, d, m);
            }
            assert!(fast.qs == slow.qs && fast.d == slow.d && fast.m == slow.m, "{kind:?}");
        }
    }

    /// The 16-row 32-code kinds copied as stored are the matrix their codes give, byte for byte:
    /// rows not a multiple of 16, an odd number of blocks (a pad block), every such kind.
    #[test]
    fn blocks_copied_as_stored_equal_the_codes_path() {
        let mut rng = Rng::new(5);
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::IQ4_NL, GgmlType::Q8_0] {
            for (rows, cols) in [(37, 96), (16, 64), (5, 32)] {
                let w = rng.normals(rows * cols, 1.0);
                let data: Vec<u8> = w.chunks(cols).flat_map(|r| ty.quantize_row(r)).collect();
                let (kind, bb, off) = Packed::block_kind(ty).expect("a 32-code block type");
                let fast = Packed::stored_rows16(kind, rows, cols, &data, bb, off, Place::Huge);
                let slow = Packed::blocks_by_codes(kind, Layout::Rows16, rows, cols, &data, bb, off, Place::Heap);
                assert_eq!((fast.rows, fast.cols, fast.nbp), (slow.rows, slow.cols, slow.nbp), "{ty:?} {rows}x{cols}");
                assert!(fast.qs == slow.qs && fast.d == slow.d && fast.m == slow.m, "{ty:?} {rows}x{cols}");
            }
        }
    }
}
