//! Gated FFN: SwiGLU or K3's SiTU-GLU (architecture.md §5(d)). Dims: T tokens, C width, F inner.

use k3_config::Activation;
use k3_kernels::ops;

use k3_kernels::qgemm::{gemm_rows_out, prefetch_next_band, quantize_row, Isa, OutMat, QActs, RowOut, BLOCK};
use k3_kernels::threads::{pair_balance, Pool, SendPtr};

use crate::linear::{packed_product, Compute, Matrix};
use crate::Result;

pub struct Mlp {
    pub gate: Matrix, // [F, C]
    pub up: Matrix,   // [F, C]
    pub down: Matrix, // [C, F]
    pub act: Activation,
}

/// `g ← act(g) · u` in place.
pub fn glu_inplace(g: &mut [f32], u: &[f32], act: Activation) {
    match act {
        Activation::Silu => ops::swiglu_inplace(g, u),
        Activation::Situ { beta, linear_beta } => ops::situ_glu_inplace(g, u, beta, linear_beta),
    }
}

impl Mlp {
    /// HF names `{prefix}.{gate,up,down}_proj.weight`.
    pub fn load(src: &crate::source::Source, prefix: &str, c: usize, f: usize, act: Activation) -> Result<Self> {
        Ok(Self {
            gate: src.matrix(&format!("{prefix}.gate_proj.weight"), f, c)?,
            up: src.matrix(&format!("{prefix}.up_proj.weight"), f, c)?,
            down: src.matrix(&format!("{prefix}.down_proj.weight"), c, f)?,
            act,
        })
    }

    /// # Shapes
    /// x: [T, C] → [T, C]
    pub fn forward(&self, x: &[f32], t: usize, cx: Compute) -> Vec<f32> {
        if t == 1 {
            if let Some(y) = self.decode_packed(x, cx) {
                return y;
            }
        }
        self.forward_tokens(x, t, cx)
    }

    /// The T-token form (prefill; decode's reference): gate and up, the GLU over [T, F], down.
    fn forward_tokens(&self, x: &[f32], t: usize, cx: Compute) -> Vec<f32> {
        let [mut g, u]: [Vec<f32>; 2] =
            Matrix::apply_many(&[&self.gate, &self.up], x, t, cx).try_into().expect("two products");
        let f = self.gate.rows;
        crate::threads::par_rows(&mut g, f, cx.threads, |r0, blk| {
            glu_inplace(blk, &u[r0 * f..r0 * f + blk.len()], self.act)
        });
        self.down.apply(&g, t, cx)
    }

    /// One token, all three matrices on the integer kernels: gate and up in bands of whole
    /// Q8_0 blocks of rows, each band's task taking the GLU of its rows and quantizing them as
    /// the down projection's input, so no serial pass over F sits between the two products. The
    /// bits of [`Self::forward_tokens`] (the GLU is per element, the quantizer per block). `None`
    /// when a matrix is not packed, in the exact mode, when F is not whole blocks, when a row tile
    /// does not divide a block, or when up's shape is not gate's.
    ///
    /// # Shapes
    /// x: [1, C] → [1, C]
    fn decode_packed(&self, x: &[f32], cx: Compute) -> Option<Vec<f32>> {
        let (gp, upp, dp) = (self.gate.packed.as_deref()?, self.up.packed.as_deref()?, self.down.packed.as_deref()?);
        let (f, c) = (self.gate.rows, self.gate.cols);
        let aligned = BLOCK.is_multiple_of(gp.row_align()) && BLOCK.is_multiple_of(upp.row_align());
        if cx.exact || !f.is_multiple_of(BLOCK) || !aligned || self.up.rows != f || self.up.cols != c {
            return None;
        }
        for m in [&self.gate, &self.up] {
            if let Some(n) = &m.name {
                crate::calib::record(n, x, 1, c);
            }
        }
        let acts = QActs::quantize(x, 1, c);
        let mut down_in = QActs::zeros(1, f);
        let (mut g, mut u) = (vec![0f32; f], vec![0f32; f]);
        let nb = f / BLOCK;
        let threads = if 2 * f * c < 1 << 15 { 1 } else { cx.threads.max(1) };
        let n = threads.min(nb); // a band a thread, as linear::tasks_per_thread has for one token
        let (gptr, uptr) = (SendPtr(g.as_mut_ptr()), SendPtr(u.as_mut_ptr()));
        let down_ptr = SendPtr(&mut down_in as *mut QActs);
        let isa = Isa::best().for_tokens(1);
        // Two bands are a pair: the caller's first, at the share the balance has learned.
        let bal = pair_balance(&gp.pair);
        let cut = if n == 2 { ((nb as f32 * bal.share()).round() as usize).clamp(1, nb - 1) } else { 0 };
        let task = |i: usize| {
            let (b0, b1) = if n == 2 { [(0, cut), (cut, nb)][i] } else { (i * nb / n, (i + 1) * nb / n) };
            let (lo, hi) = (b0 * BLOCK, b1 * BLOCK);
            acts.warm();
            // SAFETY: task i alone writes rows lo..hi of g and u and blocks b0..b1 of the down
            // input (the bands partition 0..F); every pointer outlives the job; the packed rows
            // lo..hi exist (hi ≤ F) and start on their row tiles (BLOCK is a multiple of them).
            let (gb, ub, blocks) = unsafe {
                prefetch_next_band(upp, lo, hi, 1);
                gemm_rows_out(isa, gp, &acts, lo, hi, OutMat { ptr: gptr.get().add(lo), rs: 1, cs: f });
                gemm_rows_out(isa, upp, &acts, lo, hi, OutMat { ptr: uptr.get().add(lo), rs: 1, cs: f });
                (
                    std::slice::from_raw_parts_mut(gptr.get().add(lo), hi - lo),
                    std::slice::from_raw_parts(uptr.get().add(lo), hi - lo),
                    RowOut::blocks(down_ptr.get(), 0, b0, b1),
                )
            };
            glu_inplace(gb, ub, self.act);
            quantize_row(gb, blocks);
        };
        if n == 2 {
            Pool::global().run_pair(bal, cut as f32 / nb as f32, &task);
        } else {
            Pool::global().run(threads, n, &task);
        }
        if let Some(name) = &self.down.name {
            crate::calib::record(name, &g, 1, f);
        }
        Some(packed_product(dp, &down_in, cx.threads))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_kernels::quant::GgmlType;
    use k3_kernels::testing::Rng;

    /// The fused one-token path gives the T-token path's bits, for every packed type (and falls
    /// back for f32), both activations, an odd number of blocks in F, 1 and 2 threads.
    #[test]
    fn fused_decode_matches_the_token_path_bit_for_bit() {
        let mut rng = Rng::new(13);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let c = 128;
        for (ty, f, act) in [
            (GgmlType::Q4_0, 416, Activation::Silu),
            (GgmlType::Q4_1, 96, Activation::Situ { beta: 2.0, linear_beta: 3.0 }),
            (GgmlType::Q8_0, 256, Activation::Silu),
            (GgmlType::F32, 96, Activation::Silu),
        ] {
            let mut m = |rows: usize, cols: usize| {
                let w = rng.normals(rows * cols, 0.3);
                Matrix::new(rows, cols, ty, w.chunks(cols).flat_map(|r| ty.quantize_row(r)).collect())
            };
            let mlp = Mlp { gate: m(f, c), up: m(f, c), down: m(c, f), act };
            assert_eq!(mlp.gate.packed.is_some(), ty != GgmlType::F32);
            for threads in [1, 2] {
                let cx = Compute { threads, exact: false };
                let x = rng.normals(c, 1.0);
                assert_eq!(mlp.decode_packed(&x, cx).is_some(), ty != GgmlType::F32, "{ty:?}: which path ran");
                let fused = mlp.forward(&x, 1, cx);
                assert!(fused.iter().all(|v| v.is_finite()));
                assert_eq!(bits(&fused), bits(&mlp.forward_tokens(&x, 1, cx)), "{ty:?} F {f} {threads} thread(s)");
            }
        }
    }
}
