//! IQ4_NL and IQ4_XS: 4-bit indices into one non-linear table of 16 int8 values
//! ([`KVALUES`], ggml's `kvalues_iq4nl`), denser near zero than Q4_0's uniform grid.
//!
//! - IQ4_NL: blocks of 32 as `f16 d; u8 qs[16]`, value `d·KVALUES[q]`, indices in Q4_0's nibble
//!   order (elements j and j + 16 in the low and high nibble of byte j). 4.5 bits a weight, Q4_0's
//!   size. Activations as Q8_0.
//! - IQ4_XS: super-blocks of 256 as `f16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128]`, eight
//!   32-element blocks each with a 6-bit scale `ls` (low four bits in `scales_l[b / 2]`, nibble
//!   `b % 2`; high two bits at bit 2b of `scales_h`), value `d·(ls − 32)·KVALUES[q]`, each block's
//!   16 bytes of indices as IQ4_NL's. 4.25 bits a weight. Activations as Q8_K.
//!
//! The quantizers are ours: per block, the scale that minimises the x²-weighted (or
//! importance-weighted) squared error over 1 + 15 candidate scales, each refitted by least
//! squares to its indices, as llama.cpp's search does; then the indices nearest for the stored
//! f16 scale. Their bytes are not llama.cpp's, their format is.

use super::float::{f16_at, f16_le};
use super::k_quants::{nearest, QK};

/// ggml `kvalues_iq4nl`.
pub const KVALUES: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

pub const BLOCK: usize = 32;
pub const NL_BYTES: usize = 18;
pub const XS_BYTES: usize = 136;

/// The index of the table value nearest `x` (the lower one on ties).
fn nearest_index(x: f32) -> u8 {
    let mut best = 0;
    for (i, &v) in KVALUES.iter().enumerate().skip(1) {
        if (x - v as f32).abs() < (x - KVALUES[best] as f32).abs() {
            best = i;
        }
    }
    best as u8
}

/// One block's scale, as llama.cpp searches: candidate inverse scales 127 / max (the element of
/// largest magnitude near the table's top, 113) and (k − 127) / max for k in −7..=7 (near its
/// widest value, −127); each candidate's nearest indices refit d = Σ w·x·v / Σ w·v² (w = x², or
/// the caller's per-element weights); the best fit under those weights is kept.
fn fit_scale(x: &[f32], weights: Option<&[f32]>) -> f32 {
    let (amax, max) = super::abs_max(x);
    if amax < 1e-30 {
        return 0.0;
    }
    // (Σ w·x·v, Σ w·v²) over the indices nearest x·id.
    let fit = |id: f32| -> (f32, f32) {
        let (mut sqx, mut sq2) = (0f32, 0f32);
        for (j, &v) in x.iter().enumerate() {
            let (w, k) = (weights.map_or(v * v, |w| w[j]), KVALUES[nearest_index(v * id) as usize] as f32);
            sqx += w * v * k;
            sq2 += w * k * k;
        }
        (sqx, sq2)
    };
    let (mut best_d, mut best) = (0f32, 0f32);
    let candidates =
        std::iter::once(-(KVALUES[0] as f32) / max).chain((-7..=7).map(|k| (k as f32 + KVALUES[0] as f32) / max));
    for id in candidates {
        let (sqx, sq2) = fit(id);
        // Minimising Σ w (x − d v)² over d leaves −(Σ w x v)² / Σ w v²: keep the largest ratio.
        if sq2 > 0.0 && sqx * sqx > best * sq2 {
            best_d = sqx / sq2;
            best = best_d * sqx;
        }
    }
    best_d
}

/// The nearest index of each element of a block at the stored scale `d`.
fn indices_at(x: &[f32], d: f32) -> [u8; BLOCK] {
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    std::array::from_fn(|j| nearest_index(x[j] * id))
}

/// 32 indices in Q4_0's nibble order.
fn pack_nibbles(q: &[u8; BLOCK]) -> [u8; 16] {
    std::array::from_fn(|j| q[j] | (q[j + 16] << 4))
}

/// The 32 indices of a block's 16 bytes, in element order.
fn indices(qs: &[u8]) -> [u8; BLOCK] {
    std::array::from_fn(|i| if i < 16 { qs[i] & 0x0F } else { qs[i - 16] >> 4 })
}

pub fn quantize_nl(x: &[f32]) -> Vec<u8> {
    nl_with(x, None)
}

/// Importance-weighted IQ4_NL (as [`super::q4_0::quantize_weighted`]): each block's scale and
/// indices chosen to minimise Σ_j w_j (x_j − d·v_j)² for the caller's weights `w`, one per
/// element of `x`.
pub fn quantize_nl_weighted(x: &[f32], w: &[f32]) -> Vec<u8> {
    assert_eq!(x.len(), w.len(), "one weight per element");
    nl_with(x, Some(w))
}

fn nl_with(x: &[f32], w: Option<&[f32]>) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / BLOCK * NL_BYTES);
    for (i, blk) in x.chunks_exact(BLOCK).enumerate() {
        let d = f16_le(fit_scale(blk, w.map(|w| &w[i * BLOCK..(i + 1) * BLOCK])));
        out.extend_from_slice(&d);
        out.extend_from_slice(&pack_nibbles(&indices_at(blk, f16_at(&d))));
    }
    out
}

pub fn dequantize_nl(b: &[u8], out: &mut [f32]) {
    for (blk, o) in b.chunks_exact(NL_BYTES).zip(out.chunks_exact_mut(BLOCK)) {
        let d = f16_at(blk);
        for (o, q) in o.iter_mut().zip(indices(&blk[2..])) {
            *o = d * KVALUES[q as usize] as f32;
        }
    }
}

/// Σ KVALUES[q]·a over one block's indices and 32 int8 activations.
fn block_sum(qs: &[u8], a: &[u8]) -> i32 {
    indices(qs).iter().zip(a).map(|(&q, &a)| KVALUES[q as usize] as i32 * a as i8 as i32).sum()
}

/// ggml `vec_dot_iq4_nl_q8_0`: Σ_blocks d_w·d_x·Σ KVALUES[q]·q8.
pub fn vec_dot_nl_q8_0(w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (wb, xb) in w.chunks_exact(NL_BYTES).zip(x.chunks_exact(34)) {
        sum += (f16_at(wb) * f16_at(xb)) * block_sum(&wb[2..], &xb[2..]) as f32;
    }
    sum
}

/// IQ4_NL rows as Q8_0 blocks, exactly: the same f16 scale and the table values as the int8
/// codes, so IQ4_NL tensors take the Q8_0 integer tiles (34 bytes per 32 weights, not 18).
pub fn nl_as_q8_0(b: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(b.len() / NL_BYTES * 34);
    for blk in b.chunks_exact(NL_BYTES) {
        out.extend_from_slice(&blk[..2]);
        out.extend(indices(&blk[2..]).iter().map(|&q| KVALUES[q as usize] as u8));
    }
    out
}

/// Block b's 6-bit scale ls (the block's scale is d·(ls − 32)).
fn xs_scale(sb: &[u8], b: usize) -> i32 {
    let h = u16::from_le_bytes([sb[2], sb[3]]);
    let low = (sb[4 + b / 2] >> (4 * (b % 2))) & 0x0F;
    (low as i32) | ((((h >> (2 * b)) & 3) as i32) << 4)
}

/// Per super-block: each block's scale and indices fitted as IQ4_NL's, the super-block's d =
/// −(largest-magnitude block scale) / 32, each block's ls = round(scale / d) + 32 clamped to
/// 0..63, then the block's indices refitted to its stored scale d·(ls − 32).
pub fn quantize_xs(x: &[f32]) -> Vec<u8> {
    xs_with(x, None)
}

/// Importance-weighted IQ4_XS: each block's scale fitted as [`quantize_nl_weighted`]'s.
pub fn quantize_xs_weighted(x: &[f32], w: &[f32]) -> Vec<u8> {
    assert_eq!(x.len(), w.len(), "one weight per element");
    xs_with(x, Some(w))
}

fn xs_with(x: &[f32], w: Option<&[f32]>) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / QK * XS_BYTES);
    for (s, sb) in x.chunks_exact(QK).enumerate() {
        let scales: Vec<f32> = sb
            .chunks_exact(BLOCK)
            .enumerate()
            .map(|(b, blk)| fit_scale(blk, w.map(|w| &w[s * QK + b * BLOCK..][..BLOCK])))
            .collect();
        let (_, max_scale) = super::abs_max(&scales);
        let d = -max_scale / 32.0;
        let d16 = f16_at(&f16_le(d));
        let id = if d16 != 0.0 { 1.0 / d16 } else { 0.0 };
        let (mut h, mut low, mut qs) = (0u16, [0u8; 4], Vec::with_capacity(128));
        for (b, blk) in sb.chunks_exact(BLOCK).enumerate() {
            let l = (nearest(id * scales[b]) + 32).clamp(0, 63);
            low[b / 2] |= ((l & 0x0F) as u8) << (4 * (b % 2));
            h |= ((l >> 4) as u16) << (2 * b);
            qs.extend_from_slice(&pack_nibbles(&indices_at(blk, d16 * (l - 32) as f32)));
        }
        out.extend_from_slice(&f16_le(d));
        out.extend_from_slice(&h.to_le_bytes());
        out.extend_from_slice(&low);
        out.extend_from_slice(&qs);
    }
    out
}

pub fn dequantize_xs(b: &[u8], out: &mut [f32]) {
    for (sb, o) in b.chunks_exact(XS_BYTES).zip(out.chunks_exact_mut(QK)) {
        let d = f16_at(sb);
        for (blk, o) in o.chunks_exact_mut(BLOCK).enumerate() {
            let dl = d * (xs_scale(sb, blk) - 32) as f32;
            for (o, q) in o.iter_mut().zip(indices(&sb[8 + 16 * blk..8 + 16 * (blk + 1)])) {
                *o = dl * KVALUES[q as usize] as f32;
            }
        }
    }
}

/// ggml `vec_dot_iq4_xs_q8_K`: Σ_super-blocks Σ_blocks (d_w·d_x)·(ls − 32)·Σ KVALUES[q]·q8.
pub fn vec_dot_xs_q8_k(w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (sb, xb) in w.chunks_exact(XS_BYTES).zip(x.chunks_exact(super::k_quants::Q8K_BYTES)) {
        let dd = f16_at(sb) * f32::from_le_bytes([xb[0], xb[1], xb[2], xb[3]]);
        for b in 0..QK / BLOCK {
            let s = block_sum(&sb[8 + 16 * b..8 + 16 * (b + 1)], &xb[4 + BLOCK * b..4 + BLOCK * (b + 1)]);
            sum += dd * (xs_scale(sb, b) - 32) as f32 * s as f32;
        }
    }
    sum
}

/// IQ4_XS rows as IQ4_NL blocks for the integer tiles: each block's scale d·(ls − 32) rounded
/// to f16 (relative error ≤ 2⁻¹¹, far inside the 4-bit rounding), its 16 bytes of indices as
/// they are (4.5 bits a weight instead of 4.25).
pub fn xs_as_nl(b: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(b.len() / XS_BYTES * 8 * NL_BYTES);
    for sb in b.chunks_exact(XS_BYTES) {
        let d = f16_at(sb);
        for blk in 0..QK / BLOCK {
            out.extend_from_slice(&f16_le(d * (xs_scale(sb, blk) - 32) as f32));
            out.extend_from_slice(&sb[8 + 16 * blk..8 + 16 * (blk + 1)]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::GgmlType;
    use super::*;

    /// Under heavy-tailed column weights (as activations give), the weighted quantizers have a
    /// lower weighted error than the plain ones, summed over the tensor.
    #[test]
    fn weighted_quantizers_lower_the_weighted_error() {
        let cols = 256;
        let x = crate::testing::Rng::new(11).normals(cols * 16, 0.1);
        let imp: Vec<f32> = (0..cols).map(|i| if i % 17 == 0 { 50.0 } else { 0.5 + (i % 5) as f32 * 0.2 }).collect();
        let w: Vec<f32> = (0..x.len()).map(|i| imp[i % cols]).collect();
        let err = |y: &[f32]| -> f64 {
            x.iter().zip(y).zip(&w).map(|((a, b), w)| *w as f64 * ((a - b) as f64).powi(2)).sum()
        };
        let (mut a, mut b) = (vec![0f32; x.len()], vec![0f32; x.len()]);
        dequantize_nl(&quantize_nl(&x), &mut a);
        dequantize_nl(&quantize_nl_weighted(&x, &w), &mut b);
        assert!(err(&b) < 0.9 * err(&a), "IQ4_NL weighted {} vs plain {}", err(&b), err(&a));
        dequantize_xs(&quantize_xs(&x), &mut a);
        dequantize_xs(&quantize_xs_weighted(&x, &w), &mut b);
        assert!(err(&b) < 0.9 * err(&a), "IQ4_XS weighted {} vs plain {}", err(&b), err(&a));
    }

    #[test]
    fn iq4_nl_rows_are_q8_0_rows_exactly() {
        let x = crate::testing::Rng::new(5).normals(32 * 9, 1.0);
        let nl = quantize_nl(&x);
        let (mut a, mut b) = (vec![0f32; x.len()], vec![0f32; x.len()]);
        dequantize_nl(&nl, &mut a);
        GgmlType::Q8_0.dequantize_row(&nl_as_q8_0(&nl), &mut b);
        assert_eq!(a, b);
    }

    #[test]
    fn iq4_xs_rows_as_q8_0_differ_only_by_the_scales_f16_rounding() {
        let x = crate::testing::Rng::new(6).normals(256 * 3, 1.0);
        let xs = quantize_xs(&x);
        let (mut a, mut b) = (vec![0f32; x.len()], vec![0f32; x.len()]);
        dequantize_xs(&xs, &mut a);
        GgmlType::Q8_0.dequantize_row(&nl_as_q8_0(&xs_as_nl(&xs)), &mut b);
        for (i, (p, q)) in a.iter().zip(&b).enumerate() {
            assert!((p - q).abs() <= p.abs() * 1e-3, "element {i}: {p} vs {q}");
        }
        assert_ne!(a, vec![0f32; a.len()]);
    }

    /// The non-linear table fits Gaussian weights better than Q4_0's uniform grid at the same
    /// 4.5 bits (and IQ4_XS at 4.25 still does).
    #[test]
    fn the_table_beats_q4_0_on_gaussian_weights() {
        let x = crate::testing::Rng::new(7).normals(256 * 64, 1.0);
        let err = |ty: GgmlType| -> f64 {
            let mut back = vec![0f32; x.len()];
            ty.dequantize_row(&ty.quantize_row(&x), &mut back);
            x.iter().zip(&back).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>()
        };
        let (q4, nl, xs) = (err(GgmlType::Q4_0), err(GgmlType::IQ4_NL), err(GgmlType::IQ4_XS));
        // Measured: IQ4_NL 0.80, IQ4_XS 0.81 of Q4_0's squared error (seed 7).
        assert!(nl < 0.85 * q4, "IQ4_NL {nl} vs Q4_0 {q4}");
        assert!(xs < 0.9 * q4, "IQ4_XS {xs} vs Q4_0 {q4}");
    }
}
