//! Gated FFN: SwiGLU or K3's SiTU-GLU (architecture.md §5(d)). Dims: T tokens, C width, F inner.

use k3_config::Activation;
use k3_kernels::ops;

use crate::linear::{Compute, Matrix};
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
        let [mut g, u]: [Vec<f32>; 2] =
            Matrix::apply_many(&[&self.gate, &self.up], x, t, cx).try_into().expect("two products");
        let f = self.gate.rows;
        crate::threads::par_rows(&mut g, f, cx.threads, |r0, blk| {
            glu_inplace(blk, &u[r0 * f..r0 * f + blk.len()], self.act)
        });
        self.down.apply(&g, t, cx)
    }
}
