//! Q4_1: blocks of 32 as `f16 d; f16 m; u8 qs[16]`, value `d·q + m` (ggml `block_q4_1`).

use super::float::{f16_at, f16_le};

pub const BLOCK: usize = 32;
pub const BYTES: usize = 20;

/// ggml `quantize_row_q4_1_ref`: d = (max − min)/15, m = min, q = min(15, (i8)((x − min)/d + 0.5)).
pub fn quantize_ref(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / BLOCK * BYTES);
    for blk in x.chunks_exact(BLOCK) {
        let min = blk.iter().copied().fold(f32::MAX, f32::min);
        let max = blk.iter().copied().fold(-f32::MAX, f32::max);
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16_le(d));
        out.extend_from_slice(&f16_le(min));
        for j in 0..BLOCK / 2 {
            let x0 = (blk[j] - min) * id;
            let x1 = (blk[BLOCK / 2 + j] - min) * id;
            let q0 = ((x0 + 0.5) as i8).min(15) as u8;
            let q1 = ((x1 + 0.5) as i8).min(15) as u8;
            out.push(q0 | (q1 << 4));
        }
    }
    out
}

pub fn dequantize_ref(b: &[u8], out: &mut [f32]) {
    for (blk, o) in b.chunks_exact(BYTES).zip(out.chunks_exact_mut(BLOCK)) {
        let (d, m) = (f16_at(blk), f16_at(&blk[2..]));
        for j in 0..BLOCK / 2 {
            let q = blk[4 + j];
            o[j] = (q & 0x0F) as f32 * d + m;
            o[j + BLOCK / 2] = (q >> 4) as f32 * d + m;
        }
    }
}
