//! Q8_0 (`f16 d; i8 qs[32]`, value d·q) and Q8_1 (`f16 d; f16 s; i8 qs[32]`, s = d·Σq, the
//! activation format paired with Q4_1).

use super::float::{f16_at, f16_le};
use super::GgmlType;

pub const BLOCK: usize = 32;

/// ggml `quantize_row_q8_0_ref`: d = amax/127, q = roundf(x/d).
pub fn quantize_ref(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / BLOCK * 34);
    for blk in x.chunks_exact(BLOCK) {
        let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16_le(d));
        out.extend(blk.iter().map(|&v| (v * id).round() as i8 as u8));
    }
    out
}

/// ggml `quantize_row_q8_1_ref`: as Q8_0 plus s = d · Σ q.
pub fn quantize_q8_1_ref(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / BLOCK * 36);
    for blk in x.chunks_exact(BLOCK) {
        let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let qs: Vec<i8> = blk.iter().map(|&v| (v * id).round() as i8).collect();
        let sum: i32 = qs.iter().map(|&q| q as i32).sum();
        out.extend_from_slice(&f16_le(d));
        out.extend_from_slice(&f16_le(sum as f32 * d));
        out.extend(qs.iter().map(|&q| q as u8));
    }
    out
}

/// ggml's CPU activation quantizer (x86 `quantize_row_q8_0` / `quantize_row_q8_1`): as the
/// reference, but the multiplier is `127 / amax` and rounding is to nearest-even. Weights are
/// quantized with the reference; activations with this, so our integer dots see llama.cpp's bytes.
pub fn quantize_act(x: &[f32], with_sum: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / BLOCK * if with_sum { 36 } else { 34 });
    for blk in x.chunks_exact(BLOCK) {
        let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let qs: Vec<i8> = blk.iter().map(|&v| (v * id).round_ties_even() as i8).collect();
        out.extend_from_slice(&f16_le(d));
        if with_sum {
            let sum: i32 = qs.iter().map(|&q| q as i32).sum();
            out.extend_from_slice(&f16_le(d * sum as f32));
        }
        out.extend(qs.iter().map(|&q| q as u8));
    }
    out
}

pub fn dequantize_ref(ty: GgmlType, b: &[u8], out: &mut [f32]) {
    let (bytes, off) = if ty == GgmlType::Q8_1 { (36, 4) } else { (34, 2) };
    for (blk, o) in b.chunks_exact(bytes).zip(out.chunks_exact_mut(BLOCK)) {
        let d = f16_at(blk);
        for (v, &q) in o.iter_mut().zip(&blk[off..]) {
            *v = q as i8 as f32 * d;
        }
    }
}
