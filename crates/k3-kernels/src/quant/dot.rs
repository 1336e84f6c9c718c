//! Dot products of a stored weight row with an activation row quantized on the fly to the
//! weight type's `vec_dot_type`, as ggml's CPU backend does (interop.md §5.1): Q4_0·Q8_0,
//! Q4_1·Q8_1, Q5_0·Q8_0, Q5_1·Q8_1, Q8_0·Q8_0, the K-quants·Q8_K, F16·F16, BF16·BF16. These scalar forms follow ggml's `*_generic`
//! references (integer sums per block, one float multiply-add per block); SIMD versions are
//! tested against them.

use super::float::f16_at;
use super::GgmlType;

impl GgmlType {
    /// The activation format ggml pairs with this weight type.
    pub fn vec_dot_type(self) -> GgmlType {
        match self {
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4_NL => GgmlType::Q8_0,
            GgmlType::Q4_1 | GgmlType::Q5_1 => GgmlType::Q8_1,
            GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K | GgmlType::IQ4_XS => {
                GgmlType::Q8_K
            }
            other => other,
        }
    }

    /// Encode an activation row as this weight type's `vec_dot_type`, the way ggml's CPU backend
    /// does (see `q8_0::quantize_act`).
    pub fn quantize_activation(self, x: &[f32]) -> Vec<u8> {
        match self.vec_dot_type() {
            GgmlType::Q8_0 => super::q8_0::quantize_act(x, false),
            GgmlType::Q8_1 => super::q8_0::quantize_act(x, true),
            other => other.quantize_row(x),
        }
    }

    /// `Σ w·x` with `w` a row of this type and `x` the activation row already encoded as
    /// [`GgmlType::vec_dot_type`] (`GgmlType::quantize_row`).
    pub fn vec_dot(self, w: &[u8], x: &[u8]) -> f32 {
        match self {
            GgmlType::Q4_0 => vec_dot_q4_0_q8_0(w, x),
            GgmlType::Q4_1 => vec_dot_q4_1_q8_1(w, x),
            GgmlType::Q5_0 => super::q5_0::vec_dot_q8_0(w, x),
            GgmlType::Q5_1 => super::q5_1::vec_dot_q8_1(w, x),
            GgmlType::Q8_0 => vec_dot_q8_0_q8_0(w, x),
            GgmlType::Q2_K => super::k_quants_low::vec_dot_q2_k_q8_k(w, x),
            GgmlType::Q3_K => super::k_quants_low::vec_dot_q3_k_q8_k(w, x),
            GgmlType::Q4_K => super::k_quants_simd::vec_dot_q4_k(w, x),
            GgmlType::Q5_K => super::k_quants::vec_dot_q5_k_q8_k(w, x),
            GgmlType::Q6_K => super::k_quants_simd::vec_dot_q6_k(w, x),
            GgmlType::IQ4_NL => super::iq4::vec_dot_nl_q8_0(w, x),
            GgmlType::IQ4_XS => super::iq4::vec_dot_xs_q8_k(w, x),
            // Q8_K is an activation format; as a weight (never written by ggml) dot the values.
            GgmlType::Q8_K => {
                let n = w.len() / super::k_quants::Q8K_BYTES * super::k_quants::QK;
                let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
                super::k_quants::dequantize_q8_k(w, &mut a);
                super::k_quants::dequantize_q8_k(x, &mut b);
                a.iter().zip(&b).map(|(p, q)| p * q).sum()
            }
            GgmlType::F16 => vec_dot_half(w, x, f16_at),
            GgmlType::BF16 => vec_dot_half(w, x, |b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
            GgmlType::F32 | GgmlType::Q8_1 => {
                let f = |b: &[u8]| f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                w.chunks_exact(4).zip(x.chunks_exact(4)).map(|(a, b)| f(a) * f(b)).sum()
            }
        }
    }
}

/// ggml `vec_dot_q4_0_q8_0`: Σ_blocks d_w·d_x·Σ (q4 − 8)·q8.
pub fn vec_dot_q4_0_q8_0(w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (wb, xb) in w.chunks_exact(18).zip(x.chunks_exact(34)) {
        let mut s = 0i32;
        for j in 0..16 {
            let q = wb[2 + j];
            s += ((q & 0x0F) as i32 - 8) * xb[2 + j] as i8 as i32 + ((q >> 4) as i32 - 8) * xb[2 + 16 + j] as i8 as i32;
        }
        sum += s as f32 * f16_at(wb) * f16_at(xb);
    }
    sum
}

/// ggml `vec_dot_q4_1_q8_1`: Σ_blocks d_w·d_x·Σ q4·q8 + m_w·s_x (s_x = d_x·Σ q8, precomputed).
pub fn vec_dot_q4_1_q8_1(w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (wb, xb) in w.chunks_exact(20).zip(x.chunks_exact(36)) {
        let mut s = 0i32;
        for j in 0..16 {
            let q = wb[4 + j];
            s += (q & 0x0F) as i32 * xb[4 + j] as i8 as i32 + (q >> 4) as i32 * xb[4 + 16 + j] as i8 as i32;
        }
        sum += (f16_at(wb) * f16_at(xb)) * s as f32 + f16_at(&wb[2..]) * f16_at(&xb[2..]);
    }
    sum
}

/// ggml `vec_dot_q8_0_q8_0`.
pub fn vec_dot_q8_0_q8_0(w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (wb, xb) in w.chunks_exact(34).zip(x.chunks_exact(34)) {
        let s: i32 = wb[2..].iter().zip(&xb[2..]).map(|(&a, &b)| a as i8 as i32 * b as i8 as i32).sum();
        sum += s as f32 * (f16_at(wb) * f16_at(xb));
    }
    sum
}

fn vec_dot_half(w: &[u8], x: &[u8], conv: impl Fn(&[u8]) -> f32) -> f32 {
    w.chunks_exact(2).zip(x.chunks_exact(2)).map(|(a, b)| conv(a) * conv(b)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;

    /// Each integer dot equals the f64 dot of the two *dequantized* rows (exact up to f32 sums).
    #[test]
    fn integer_dots_equal_dequantized_dots() {
        let mut rng = Rng::new(9);
        let n = 32 * 40;
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q8_0,
            GgmlType::F16,
            GgmlType::BF16,
            GgmlType::F32,
        ] {
            for _ in 0..20 {
                let w = rng.normals(n, 0.3);
                let x = rng.normals(n, 2.0);
                let (wq, xq) = (ty.quantize_row(&w), ty.vec_dot_type().quantize_row(&x));
                let (mut wd, mut xd) = (vec![0f32; n], vec![0f32; n]);
                ty.dequantize_row(&wq, &mut wd);
                ty.vec_dot_type().dequantize_row(&xq, &mut xd);
                let want: f64 = wd.iter().zip(&xd).map(|(a, b)| *a as f64 * *b as f64).sum();
                let got = ty.vec_dot(&wq, &xq) as f64;
                // Q4_1's min term uses Q8_1's f16-rounded s = d·Σq, so it is close, not exact.
                let tol = if ty == GgmlType::Q4_1 { 2e-2 } else { 1e-4 };
                assert!((got - want).abs() <= tol * (1.0 + want.abs()), "{}: {got} vs {want}", ty.name());
            }
        }
    }
}
