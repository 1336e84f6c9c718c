//! Q5_0: blocks of 32 as `f16 d; u8 qh[4]; u8 qs[16]`, value `d·(q − 16)` with q's low four bits
//! in `qs` (elements j and j + 16 in the low and high nibble of byte j) and its fifth bit in bit j
//! of the little-endian u32 `qh` (ggml `block_q5_0`). llama.cpp's quantizer writes it for tensors
//! whose rows are not a multiple of 256 when asked for Q4_K (the fallback in a Q4_K_M file).

use super::float::{f16_at, f16_le};

pub const BLOCK: usize = 32;
pub const BYTES: usize = 22;

/// ggml `quantize_row_q5_0_ref`: d = max / −16 (max: the element of largest magnitude, with its
/// sign), q = min(31, (i8)(x/d + 16.5)).
pub fn quantize_ref(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / BLOCK * BYTES);
    for blk in x.chunks_exact(BLOCK) {
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in blk {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16_le(d));
        let q: [u8; BLOCK] = std::array::from_fn(|i| ((blk[i] * id + 16.5) as i8).min(31) as u8);
        out.extend_from_slice(&pack_five_bits(&q));
    }
    out
}

/// 32 five-bit codes as Q5_0 / Q5_1 store them, `u8 qh[4]; u8 qs[16]`: the low four bits of codes
/// j and j + 16 in the low and high nibble of `qs[j]`, the fifth bit of code i in bit i of `qh`.
pub(crate) fn pack_five_bits(q: &[u8; BLOCK]) -> [u8; 20] {
    let mut out = [0u8; 20];
    let qh = q.iter().enumerate().fold(0u32, |h, (i, &c)| h | (((c >> 4) & 1) as u32) << i);
    out[..4].copy_from_slice(&qh.to_le_bytes());
    for j in 0..BLOCK / 2 {
        out[4 + j] = (q[j] & 0x0F) | ((q[j + 16] & 0x0F) << 4);
    }
    out
}

/// The inverse of [`pack_five_bits`]: the 32 codes (0..32) of `qh[4] qs[16]`, in element order.
pub(crate) fn unpack_five_bits(b: &[u8]) -> [u8; BLOCK] {
    let qh = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    std::array::from_fn(|i| {
        let byte = b[4 + i % 16];
        let low = if i < 16 { byte & 0x0F } else { byte >> 4 };
        low | ((((qh >> i) & 1) as u8) << 4)
    })
}

/// Block `blk`'s 32 codes q (0..32) in element order.
fn codes(blk: &[u8]) -> [i32; BLOCK] {
    unpack_five_bits(&blk[2..]).map(|q| q as i32)
}

pub fn dequantize_ref(b: &[u8], out: &mut [f32]) {
    for (blk, o) in b.chunks_exact(BYTES).zip(out.chunks_exact_mut(BLOCK)) {
        let d = f16_at(blk);
        for (o, q) in o.iter_mut().zip(codes(blk)) {
            *o = (q - 16) as f32 * d;
        }
    }
}

/// ggml `vec_dot_q5_0_q8_0` (its generic form): Σ_blocks d_w·d_x·Σ (q − 16)·q8.
pub fn vec_dot_q8_0(w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (wb, xb) in w.chunks_exact(BYTES).zip(x.chunks_exact(34)) {
        let s: i32 = codes(wb).iter().zip(&xb[2..]).map(|(&q, &a)| (q - 16) * a as i8 as i32).sum();
        sum += s as f32 * (f16_at(wb) * f16_at(xb));
    }
    sum
}

/// Q5_0 rows as Q8_0 blocks, exactly: the same f16 scale and the codes q − 16 (−16..15) as i8, so
/// Q5_0 tensors take the Q8_0 integer tiles (34 bytes per 32 weights instead of 22).
pub fn as_q8_0(b: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(b.len() / BYTES * 34);
    for blk in b.chunks_exact(BYTES) {
        out.extend_from_slice(&blk[0..2]);
        out.extend(codes(blk).iter().map(|&q| (q - 16) as i8 as u8));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::GgmlType;

    #[test]
    fn q5_0_rows_are_q8_0_rows_exactly() {
        let x = crate::testing::Rng::new(5).normals(32 * 9, 1.0);
        let q5 = super::quantize_ref(&x);
        let (mut a, mut b) = (vec![0f32; x.len()], vec![0f32; x.len()]);
        super::dequantize_ref(&q5, &mut a);
        GgmlType::Q8_0.dequantize_row(&super::as_q8_0(&q5), &mut b);
        assert_eq!(a, b);
    }
}
