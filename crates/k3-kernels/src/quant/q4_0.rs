//! Q4_0: blocks of 32 as `f16 d; u8 qs[16]`, value `d·(q − 8)`; element j < 16 is the low nibble
//! of qs[j], element j + 16 the high nibble (ggml `block_q4_0`).

use super::float::{f16_at, f16_le};

pub const BLOCK: usize = 32;
pub const BYTES: usize = 18;

/// ggml `quantize_row_q4_0_ref`: d = (value of largest |x|) / −8, q = min(15, (i8)(x/d + 8.5)).
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
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16_le(d));
        for j in 0..BLOCK / 2 {
            let x0 = blk[j] * id;
            let x1 = blk[BLOCK / 2 + j] * id;
            let q0 = ((x0 + 8.5) as i8).min(15) as u8;
            let q1 = ((x1 + 8.5) as i8).min(15) as u8;
            out.push(q0 | (q1 << 4));
        }
    }
    out
}

pub fn dequantize_ref(b: &[u8], out: &mut [f32]) {
    for (blk, o) in b.chunks_exact(BYTES).zip(out.chunks_exact_mut(BLOCK)) {
        let d = f16_at(blk);
        for j in 0..BLOCK / 2 {
            let q = blk[2 + j];
            o[j] = ((q & 0x0F) as i32 - 8) as f32 * d;
            o[j + BLOCK / 2] = ((q >> 4) as i32 - 8) as f32 * d;
        }
    }
}
