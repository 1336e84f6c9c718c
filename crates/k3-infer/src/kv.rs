//! Attention caches: rows held as f16 (llama.cpp's cache type) or f32 (the exact mode).

use k3_kernels::attention;

/// One layer's cached rows (Llama's keys or values, MLA's latent rows): f16, llama.cpp's cache
/// type and the default (a decode step streams half the bytes of f32), or f32 under the exact
/// mode (transformers' numerics).
#[derive(Debug, Clone)]
pub enum KvRows {
    F16(Vec<u16>),
    F32(Vec<f32>),
}

impl Default for KvRows {
    fn default() -> Self {
        KvRows::F16(Vec::new())
    }
}

impl KvRows {
    /// Values held (positions × row width).
    pub fn len(&self) -> usize {
        self.rows().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn bytes(&self) -> usize {
        match self {
            KvRows::F16(v) => 2 * v.len(),
            KvRows::F32(v) => 4 * v.len(),
        }
    }

    pub fn rows(&self) -> attention::Rows<'_> {
        match self {
            KvRows::F16(v) => attention::Rows::F16(v),
            KvRows::F32(v) => attention::Rows::F32(v),
        }
    }

    /// Append rows, as f16 (rounded to nearest) or f32. A cache of the other type is converted
    /// first: f16 → f32 exactly, f32 → f16 rounding as the f16 mode rounds everything it stores.
    pub fn push(&mut self, x: &[f32], f16: bool) {
        match (&mut *self, f16) {
            (KvRows::F16(v), true) => {
                let at = v.len();
                v.resize(at + x.len(), 0);
                k3_kernels::simd::f32_to_f16(&mut v[at..], x);
            }
            (KvRows::F32(v), false) => v.extend_from_slice(x),
            (KvRows::F16(v), false) => {
                let mut wide = vec![0f32; v.len()];
                k3_kernels::simd::f16_to_f32(&mut wide, v);
                wide.extend_from_slice(x);
                *self = KvRows::F32(wide);
            }
            (KvRows::F32(v), true) => {
                let mut narrow = vec![0u16; v.len() + x.len()];
                k3_kernels::simd::f32_to_f16(&mut narrow[..v.len()], v);
                k3_kernels::simd::f32_to_f16(&mut narrow[v.len()..], x);
                *self = KvRows::F16(narrow);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::KvRows;

    #[test]
    fn kv_rows_keep_their_values_across_both_types() {
        let x = [1.0f32, -2.5, 3.3333, 1e-3, 70000.0];
        let f16 = k3_kernels::attention::round_f16;
        // f16 (the default): rounded to nearest on the way in.
        let mut r = KvRows::default();
        r.push(&x[..3], true);
        assert!(matches!(r, KvRows::F16(_)) && r.bytes() == 6);
        // An exact-mode push widens what is held (exactly) and keeps the new rows as they are.
        r.push(&x[3..], false);
        let want: Vec<f32> = x[..3].iter().map(|&v| f16(v)).chain(x[3..].iter().copied()).collect();
        assert_eq!(r.rows().to_f32().to_vec(), want);
        // Back to f16: everything rounded, as the f16 mode stores it (70000 overflows to +inf,
        // as in llama.cpp's f16 cache).
        r.push(&x[..1], true);
        let want: Vec<f32> = want.iter().chain(&x[..1]).map(|&v| f16(v)).collect();
        assert_eq!(r.rows().to_f32().to_vec(), want);
        assert_eq!(r.len(), 6);
    }
}
