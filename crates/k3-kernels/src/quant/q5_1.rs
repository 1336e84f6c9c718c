//! Q5_1: blocks of 32 as `f16 d; f16 m; u8 qh[4]; u8 qs[16]`, value `d·q + m` with q's low four
//! bits in `qs` (elements j and j + 16 in the low and high nibble of byte j) and its fifth bit in
//! bit j of the little-endian u32 `qh` (ggml `block_q5_1`). llama.cpp's quantizer writes it for
//! tensors whose rows are not a multiple of 256 when asked for Q5_K (the fallback in Q5_K_S / _M
//! files). Its activation type is Q8_1.

use super::float::{f16_at, f16_le};

pub const BLOCK: usize = 32;
pub const BYTES: usize = 24;

/// ggml `quantize_row_q5_1_ref`: d = (max − min)/31, m = min, q = (u8)((x − min)/d + 0.5).
pub fn quantize_ref(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / BLOCK * BYTES);
    for blk in x.chunks_exact(BLOCK) {
        let (min, max) = blk.iter().fold((blk[0], blk[0]), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        let d = (max - min) / 31.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16_le(d));
        out.extend_from_slice(&f16_le(min));
        let q: [u8; BLOCK] = std::array::from_fn(|i| ((blk[i] - min) * id + 0.5) as u8);
        out.extend_from_slice(&super::q5_0::pack_five_bits(&q));
    }
    out
}

/// Block `blk`'s 32 codes q (0..32) in element order.
pub fn codes(blk: &[u8]) -> [u8; BLOCK] {
    super::q5_0::unpack_five_bits(&blk[4..])
}

pub fn dequantize_ref(b: &[u8], out: &mut [f32]) {
    for (blk, o) in b.chunks_exact(BYTES).zip(out.chunks_exact_mut(BLOCK)) {
        let (d, m) = (f16_at(&blk[0..2]), f16_at(&blk[2..4]));
        for (o, q) in o.iter_mut().zip(codes(blk)) {
            *o = q as f32 * d + m;
        }
    }
}

/// ggml `vec_dot_q5_1_q8_1` (its generic form): Σ_blocks d_w·d_x·Σ q·q8 + m_w·s_x (s_x: the
/// Q8_1 block's stored d·Σq8).
pub fn vec_dot_q8_1(w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (wb, xb) in w.chunks_exact(BYTES).zip(x.chunks_exact(36)) {
        let s: i32 = codes(wb).iter().zip(&xb[4..]).map(|(&q, &a)| q as i32 * a as i8 as i32).sum();
        sum += s as f32 * (f16_at(&wb[0..2]) * f16_at(&xb[0..2])) + f16_at(&wb[2..4]) * f16_at(&xb[2..4]);
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::super::GgmlType;

    /// Round trip within half a step of each block, and the integer dot equal to the dot of the
    /// dequantized rows (Q8_1 activations).
    #[test]
    fn q5_1_round_trips_and_dots() {
        let mut rng = crate::testing::Rng::new(6);
        let (w, x) = (rng.normals(32 * 9, 1.0), rng.normals(32 * 9, 1.0));
        let q = super::quantize_ref(&w);
        let mut back = vec![0f32; w.len()];
        super::dequantize_ref(&q, &mut back);
        for (blk, (a, b)) in w.chunks(32).zip(back.chunks(32)).enumerate() {
            let (lo, hi) = a.iter().fold((f32::MAX, f32::MIN), |(l, h), &v| (l.min(v), h.max(v)));
            for (u, v) in a.iter().zip(b) {
                assert!((u - v).abs() <= (hi - lo) / 31.0 * 0.5 + 2e-3, "block {blk}: {u} vs {v}");
            }
        }
        let xq = GgmlType::Q8_1.quantize_row(&x);
        let mut xd = vec![0f32; x.len()];
        GgmlType::Q8_1.dequantize_row(&xq, &mut xd);
        let want: f64 = back.iter().zip(&xd).map(|(a, b)| *a as f64 * *b as f64).sum();
        let got = super::vec_dot_q8_1(&q, &xq) as f64;
        // The Q8_1 sum s is stored in f16: the min term carries its rounding.
        assert!((got - want).abs() <= 2e-3 * want.abs().max(1.0) + 1e-2, "{got} vs {want}");
    }
}
