//! Block Attention Residuals (AttnRes), K3's replacement for the plain residual stream
//! (architecture.md §4; arXiv 2603.15031; K3 `_apply_attn_res`, llama.cpp `kimi-k3` `res_mix`).
//! Dims: B batch, T time, C hidden, N banked sources (block sums, embedding first).

use tch::Tensor;

/// One mixing point: an RMSNorm weight and a d→1 pseudo-query, initialised to ones and zeros,
/// so that at step 0 every mix is a uniform average of its sources.
#[derive(Debug)]
pub struct AttnResPoint {
    pub norm: Tensor, // [C]
    pub proj: Tensor, // [1, C]
}

impl AttnResPoint {
    /// Parameters `{name}_norm.weight` [C] and `{name}_proj.weight` [1, C] under `p`.
    pub fn new(p: &tch::nn::Path, name: &str, hidden: usize) -> Self {
        let norm = crate::nn::norm_weight(p, &format!("{name}_norm"), hidden);
        let proj = p.sub(format!("{name}_proj")).var("weight", &[1, hidden as i64], tch::nn::Init::Const(0.0));
        Self { norm, proj }
    }

    /// `Σ_n softmax_n(w · RMSNorm(V_n)) · V_n` over V = [bank…, prefix]: keys are normalised
    /// (no weight; the norm weight folds into the query), values are raw.
    ///
    /// # Shapes
    /// prefix: [B,T,C]; bank: N × [B,T,C] → [B,T,C]
    pub fn mix(&self, prefix: &Tensor, bank: &[Tensor], eps: f64) -> Tensor {
        let mut srcs: Vec<&Tensor> = bank.iter().collect();
        srcs.push(prefix);
        let v = Tensor::stack(&srcs, 2); // [B,T,N+1,C]
        let k = crate::nn::rms_normalize(&v, eps);
        let query = (&self.norm * self.proj.squeeze_dim(0)).to_kind(v.kind()); // [C]
        let score = (k * query).sum_dim_intlist(-1, false, None); // [B,T,N+1]
        let p = score.softmax(-1, crate::nn::compute_kind(v.kind())).to_kind(v.kind());
        (p.unsqueeze(-1) * v).sum_dim_intlist(2, false, None)
    }
}
