//! ggml tensor types and their block layouts, byte-compatible with ggml (interop.md §5).
//!
//! Each block format has a reference quantizer (bit-identical to ggml's `quantize_row_*_ref`) and
//! dequantizer. Rows are stored as raw little-endian bytes exactly as in a GGUF file.

pub mod dot;
pub mod float;
pub mod iq4;
pub mod k_quants;
pub mod k_quants_low;
pub mod k_quants_simd;
pub mod q4_0;
pub mod q4_1;
pub mod q5_0;
pub mod q5_1;
pub mod q8_0;

/// The largest |x| and the signed value that has it (the first, on ties), as ggml's quantizers
/// find them.
pub(crate) fn abs_max(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    (amax, max)
}

/// The ggml tensor types K3-Mini reads and writes. Ids are ggml's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)] // ggml's names
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ4_NL,
    IQ4_XS,
}

impl GgmlType {
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q8_1 => 9,
            GgmlType::Q2_K => 10,
            GgmlType::Q3_K => 11,
            GgmlType::Q4_K => 12,
            GgmlType::Q5_K => 13,
            GgmlType::Q6_K => 14,
            GgmlType::Q8_K => 15,
            GgmlType::IQ4_NL => 20,
            GgmlType::IQ4_XS => 23,
            GgmlType::BF16 => 30,
        }
    }

    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            9 => GgmlType::Q8_1,
            10 => GgmlType::Q2_K,
            11 => GgmlType::Q3_K,
            12 => GgmlType::Q4_K,
            13 => GgmlType::Q5_K,
            14 => GgmlType::Q6_K,
            15 => GgmlType::Q8_K,
            20 => GgmlType::IQ4_NL,
            23 => GgmlType::IQ4_XS,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }

    /// ggml's name for an id, including the types we cannot read (for error messages).
    pub fn name_of_id(id: u32) -> &'static str {
        match id {
            0 => "F32",
            1 => "F16",
            2 => "Q4_0",
            3 => "Q4_1",
            6 => "Q5_0",
            7 => "Q5_1",
            8 => "Q8_0",
            9 => "Q8_1",
            10 => "Q2_K",
            11 => "Q3_K",
            12 => "Q4_K",
            13 => "Q5_K",
            14 => "Q6_K",
            15 => "Q8_K",
            16 => "IQ2_XXS",
            17 => "IQ2_XS",
            18 => "IQ3_XXS",
            19 => "IQ1_S",
            20 => "IQ4_NL",
            21 => "IQ3_S",
            22 => "IQ2_S",
            23 => "IQ4_XS",
            29 => "IQ1_M",
            30 => "BF16",
            39 => "MXFP4",
            _ => "unknown",
        }
    }

    /// The names of every type [`GgmlType::from_id`] reads, for error messages.
    pub fn readable_names() -> Vec<&'static str> {
        (0..64).filter_map(Self::from_id).map(Self::name).collect()
    }

    pub fn name(self) -> &'static str {
        Self::name_of_id(self.id())
    }

    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q2_K
            | GgmlType::Q3_K
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
            | GgmlType::Q8_K
            | GgmlType::IQ4_XS => k_quants::QK,
            _ => 32,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => q5_0::BYTES,
            GgmlType::Q5_1 => q5_1::BYTES,
            GgmlType::Q8_0 => 34,
            GgmlType::Q8_1 => 36,
            GgmlType::Q2_K => k_quants_low::Q2K_BYTES,
            GgmlType::Q3_K => k_quants_low::Q3K_BYTES,
            GgmlType::Q4_K => k_quants::Q4K_BYTES,
            GgmlType::Q5_K => k_quants::Q5K_BYTES,
            GgmlType::Q6_K => k_quants::Q6K_BYTES,
            GgmlType::Q8_K => k_quants::Q8K_BYTES,
            GgmlType::IQ4_NL => iq4::NL_BYTES,
            GgmlType::IQ4_XS => iq4::XS_BYTES,
        }
    }

    pub fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// Bytes of a row of `n` elements (`n` must be a multiple of the block size).
    pub fn row_bytes(self, n: usize) -> usize {
        n / self.block_elems() * self.block_bytes()
    }

    /// Encode a row (length a multiple of [`GgmlType::block_elems`]) with the reference quantizer.
    pub fn quantize_row(self, x: &[f32]) -> Vec<u8> {
        match self {
            GgmlType::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
            GgmlType::F16 => float::f32_to_f16_bytes(x),
            GgmlType::BF16 => float::f32_to_bf16_bytes(x),
            GgmlType::Q4_0 => q4_0::quantize_ref(x),
            GgmlType::Q4_1 => q4_1::quantize_ref(x),
            GgmlType::Q5_0 => q5_0::quantize_ref(x),
            GgmlType::Q5_1 => q5_1::quantize_ref(x),
            GgmlType::Q8_0 => q8_0::quantize_ref(x),
            GgmlType::Q8_1 => q8_0::quantize_q8_1_ref(x),
            GgmlType::Q2_K => k_quants_low::quantize_q2_k(x),
            GgmlType::Q3_K => k_quants_low::quantize_q3_k(x),
            GgmlType::Q4_K => k_quants::quantize_q4_k(x),
            GgmlType::Q5_K => k_quants::quantize_q5_k(x),
            GgmlType::Q6_K => k_quants::quantize_q6_k(x),
            GgmlType::Q8_K => k_quants::quantize_q8_k(x),
            GgmlType::IQ4_NL => iq4::quantize_nl(x),
            GgmlType::IQ4_XS => iq4::quantize_xs(x),
        }
    }

    /// Decode a row into `out` (length = elements in `bytes`).
    pub fn dequantize_row(self, bytes: &[u8], out: &mut [f32]) {
        match self {
            GgmlType::F32 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            GgmlType::F16 => float::f16_bytes_to_f32(bytes, out),
            GgmlType::BF16 => float::bf16_bytes_to_f32(bytes, out),
            GgmlType::Q4_0 => q4_0::dequantize_ref(bytes, out),
            GgmlType::Q4_1 => q4_1::dequantize_ref(bytes, out),
            GgmlType::Q5_0 => q5_0::dequantize_ref(bytes, out),
            GgmlType::Q5_1 => q5_1::dequantize_ref(bytes, out),
            GgmlType::Q8_0 | GgmlType::Q8_1 => q8_0::dequantize_ref(self, bytes, out),
            GgmlType::Q2_K => k_quants_low::dequantize_q2_k(bytes, out),
            GgmlType::Q3_K => k_quants_low::dequantize_q3_k(bytes, out),
            GgmlType::Q4_K => k_quants::dequantize_q4_k(bytes, out),
            GgmlType::Q5_K => k_quants::dequantize_q5_k(bytes, out),
            GgmlType::Q6_K => k_quants::dequantize_q6_k(bytes, out),
            GgmlType::Q8_K => k_quants::dequantize_q8_k(bytes, out),
            GgmlType::IQ4_NL => iq4::dequantize_nl(bytes, out),
            GgmlType::IQ4_XS => iq4::dequantize_xs(bytes, out),
        }
    }

    /// Reference dot product of a stored row with an f32 vector: dequantize, then dot.
    pub fn dot_ref(self, row: &[u8], x: &[f32]) -> f32 {
        let mut w = vec![0f32; x.len()];
        self.dequantize_row(row, &mut w);
        crate::ops::dot(&w, x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ggml's tests/test-quantize-fns.cpp data and error metric (`sqrt(Σ d²) / n`).
    fn ggml_data(offset: f32, n: usize) -> Vec<f32> {
        (0..n).map(|i| 0.1 + 2.0 * (i as f32 + offset).cos()).collect()
    }

    fn ggml_rmse(a: &[f32], b: &[f32]) -> f32 {
        let s: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
        (s.sqrt() / a.len() as f64) as f32
    }

    #[test]
    fn round_trips_within_ggml_budgets() {
        let n = 32 * 128;
        let x = ggml_data(0.0, n);
        let y = ggml_data(1.0, n);
        let dot_true: f64 = x.iter().zip(&y).map(|(a, b)| *a as f64 * *b as f64).sum();
        // (type, MAX_QUANTIZATION_TOTAL_ERROR, dot budget per element)
        for (ty, q_budget, dot_budget) in [
            // ggml's budget is 0.02 per element for every type; these are ours as measured on
            // ggml's data (Q4_0 measures 0.00125; candle quotes 0.001143 on its own data).
            (GgmlType::Q4_0, 0.002, 0.0015),
            (GgmlType::Q4_1, 0.002, 0.02),
            (GgmlType::Q5_0, 0.001, 0.02),
            (GgmlType::Q8_0, 0.002, 0.02),
            (GgmlType::Q8_1, 0.002, 0.02),
            (GgmlType::F16, 0.0001, 0.0001),
            (GgmlType::BF16, 0.0001, 0.001),
            // ggml's own budgets for 2 and 3 bits (MAX_QUANTIZATION_TOTAL_ERROR_2BITS / _3BITS).
            (GgmlType::Q2_K, 0.0075, 0.02),
            (GgmlType::Q3_K, 0.0040, 0.02),
            (GgmlType::Q4_K, 0.002, 0.02),
            (GgmlType::Q6_K, 0.002, 0.02),
            (GgmlType::Q8_K, 0.002, 0.02),
            (GgmlType::IQ4_NL, 0.002, 0.02),
            (GgmlType::IQ4_XS, 0.002, 0.02),
        ] {
            let bytes = ty.quantize_row(&x);
            assert_eq!(bytes.len(), ty.row_bytes(n), "{}", ty.name());
            let mut back = vec![0f32; n];
            ty.dequantize_row(&bytes, &mut back);
            let err = ggml_rmse(&x, &back);
            assert!(err < q_budget, "{}: quantization error {err} ≥ {q_budget}", ty.name());
            let dot = ty.dot_ref(&bytes, &y) as f64;
            let per = ((dot - dot_true).abs() / n as f64) as f32;
            assert!(per < dot_budget, "{}: dot error {per} ≥ {dot_budget}", ty.name());
            if ty == GgmlType::Q8_1 || ty == GgmlType::Q8_K {
                continue; // activation-only formats: nothing is stored as Q8_1 / Q8_K
            }
            // ggml's test-quantize-fns path: the activation quantized to vec_dot_type, integer dot.
            let yq = ty.quantize_activation(&y);
            let per = ((ty.vec_dot(&bytes, &yq) as f64 - dot_true).abs() / n as f64) as f32;
            assert!(per < 0.02, "{}: quantized-activation dot error {per}", ty.name());
        }
    }

    #[test]
    fn zero_blocks_and_f32_are_exact() {
        let z = vec![0f32; 64];
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q8_0] {
            let mut back = vec![1f32; 64];
            ty.dequantize_row(&ty.quantize_row(&z), &mut back);
            assert!(back.iter().all(|&v| v == 0.0), "{}", ty.name());
        }
        let x = vec![1.5f32, -2.25, 3.0e-8, f32::MAX];
        let mut back = vec![0f32; 4];
        GgmlType::F32.dequantize_row(&GgmlType::F32.quantize_row(&x), &mut back);
        assert_eq!(x, back);
    }
}
