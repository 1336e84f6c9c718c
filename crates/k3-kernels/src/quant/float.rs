//! f16 and bf16 rows (IEEE half via the `half` crate, round-to-nearest-even like ggml).

pub fn f32_to_f16_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect()
}

pub fn f32_to_bf16_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect()
}

pub fn f16_bytes_to_f32(b: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
        *o = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
    }
}

pub fn bf16_bytes_to_f32(b: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
        *o = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
    }
}

/// Read the f16 stored at `b[0..2]`.
pub fn f16_at(b: &[u8]) -> f32 {
    half::f16::from_le_bytes([b[0], b[1]]).to_f32()
}

pub fn f16_le(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_le_bytes()
}
