//! Weight matrices in any ggml storage type, with reference matmuls that dequantize one row at
//! a time (the speed issue adds integer dot products beside these).
//! A [`Matrix`] is `[rows = out, cols = in]`, row-major, the HF layout (= ggml `ne = [in, out]`).

use k3_kernels::quant::GgmlType;

use crate::threads::par_chunks;

#[derive(Debug, Clone)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub ty: GgmlType,
    /// Raw rows in `ty`'s encoding, `rows × ty.row_bytes(cols)` bytes.
    pub data: Vec<u8>,
}

impl Matrix {
    /// An f32 matrix from values in row-major order.
    pub fn from_f32(rows: usize, cols: usize, v: &[f32]) -> Self {
        debug_assert_eq!(v.len(), rows * cols);
        Self {
            rows,
            cols,
            ty: GgmlType::F32,
            data: GgmlType::F32.quantize_row(v),
        }
    }

    pub fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.cols)
    }

    fn row_raw(&self, r: usize) -> &[u8] {
        let b = self.row_bytes();
        &self.data[r * b..(r + 1) * b]
    }

    /// Dequantize row `r` into `out` [cols].
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        self.ty.dequantize_row(self.row_raw(r), out);
    }

    /// Rows `start..start+n` as a new matrix (e.g. one head's block of an absorbed MLA matrix).
    pub fn slice_rows(&self, start: usize, n: usize) -> Matrix {
        let b = self.row_bytes();
        Matrix {
            rows: n,
            cols: self.cols,
            ty: self.ty,
            data: self.data[start * b..(start + n) * b].to_vec(),
        }
    }

    /// Reorder rows: `out[i] = self[perm[i]]` (Llama's Q/K un-permutation).
    pub fn permute_rows(&self, perm: &[usize]) -> Matrix {
        let b = self.row_bytes();
        let mut data = Vec::with_capacity(self.data.len());
        for &p in perm {
            data.extend_from_slice(&self.data[p * b..(p + 1) * b]);
        }
        Matrix {
            rows: self.rows,
            cols: self.cols,
            ty: self.ty,
            data,
        }
    }

    /// Bytes of weight data (for bandwidth figures).
    pub fn nbytes(&self) -> usize {
        self.data.len()
    }

    /// `Y[t, o] = Σ_i X[t, i] · W[o, i]` over `t` rows of x, on `threads` threads.
    ///
    /// # Shapes
    /// x: [T, cols] → y: [T, rows]
    pub fn matmul(&self, x: &[f32], t: usize, y: &mut [f32], threads: usize) {
        debug_assert_eq!(x.len(), t * self.cols);
        debug_assert_eq!(y.len(), t * self.rows);
        let (rows, cols) = (self.rows, self.cols);
        // Work split over output rows; each worker owns a column band of Y (strided writes are
        // gathered per worker, then scattered, to keep the borrow simple).
        let work = rows * cols * t;
        let threads = if work < 1 << 16 { 1 } else { threads.max(1) };
        let parts = par_chunks(rows, threads, |lo, hi| {
            let mut band = vec![0f32; (hi - lo) * t];
            let mut w = vec![0f32; cols];
            for o in lo..hi {
                let wr: &[f32] = if self.ty == GgmlType::F32 {
                    bytemuck_f32(self.row_raw(o), &mut w)
                } else {
                    self.row_into(o, &mut w);
                    &w
                };
                for r in 0..t {
                    band[(o - lo) * t + r] = k3_kernels::ops::dot(&x[r * cols..(r + 1) * cols], wr);
                }
            }
            band
        });
        for (lo, hi, band) in parts {
            for o in lo..hi {
                for r in 0..t {
                    y[r * rows + o] = band[(o - lo) * t + r];
                }
            }
        }
    }

    /// `y = W x` for one vector.
    pub fn matvec(&self, x: &[f32], y: &mut [f32], threads: usize) {
        self.matmul(x, 1, y, threads)
    }

    /// Convenience: a freshly allocated `[T, rows]` output.
    pub fn apply(&self, x: &[f32], t: usize, threads: usize) -> Vec<f32> {
        let mut y = vec![0f32; t * self.rows];
        self.matmul(x, t, &mut y, threads);
        y
    }
}

/// View little-endian f32 bytes as floats (copies into `buf` when unaligned).
fn bytemuck_f32<'a>(b: &'a [u8], buf: &'a mut [f32]) -> &'a [f32] {
    for (o, c) in buf.iter_mut().zip(b.chunks_exact(4)) {
        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
    buf
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_kernels::testing::{assert_close_abs, Rng};

    #[test]
    fn matmul_matches_f64_for_every_type() {
        let mut rng = Rng::new(3);
        let (rows, cols, t) = (37, 64, 5);
        let w = rng.normals(rows * cols, 0.5);
        let x = rng.normals(t * cols, 1.0);
        for ty in [
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::BF16,
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
        ] {
            let m = Matrix {
                rows,
                cols,
                ty,
                data: w.chunks(cols).flat_map(|r| ty.quantize_row(r)).collect(),
            };
            let mut deq = vec![0f32; cols];
            let mut want = vec![0f32; t * rows];
            for o in 0..rows {
                m.row_into(o, &mut deq);
                for r in 0..t {
                    want[r * rows + o] = (0..cols)
                        .map(|i| x[r * cols + i] as f64 * deq[i] as f64)
                        .sum::<f64>() as f32;
                }
            }
            for threads in [1, 3] {
                let got = m.apply(&x, t, threads);
                assert_close_abs(&format!("{} x{threads}", ty.name()), &got, &want, 1e-4);
            }
        }
    }
}
