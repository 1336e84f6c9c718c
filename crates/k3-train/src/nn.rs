//! Small building blocks shared by the layers: linear maps, RMSNorm, parameter initialisation.
//!
//! Parameters are created on a `tch::nn::Path` whose dotted path is the HF checkpoint name
//! (style principle 5: nothing renames in model code).

use tch::nn::{Init, Path};
use tch::{Kind, Tensor};

/// Std of the normal init for matrices and embeddings (transformers' `initializer_range`).
pub const INIT_STD: f64 = 0.02;

/// `y = x Wᵀ (+ b)`, W: [out, in] as in HF checkpoints.
#[derive(Debug)]
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
}

impl Linear {
    /// A new `name.weight` [out, in] (normal 0.02) and, if `bias`, `name.bias` [out] (zeros).
    pub fn new(p: &Path, name: &str, inp: usize, out: usize, bias: bool) -> Self {
        let q = p.sub(name);
        let weight = q.var("weight", &[out as i64, inp as i64], Init::Randn { mean: 0.0, stdev: INIT_STD });
        let bias = bias.then(|| q.var("bias", &[out as i64], Init::Const(0.0)));
        Self { weight, bias }
    }

    /// # Shapes
    /// x: [..., in] → [..., out]
    pub fn forward(&self, x: &Tensor) -> Tensor {
        x.linear(&self.weight, self.bias.as_ref())
    }
}

/// An RMSNorm weight `name.weight` [n], initialised to ones.
pub fn norm_weight(p: &Path, name: &str, n: usize) -> Tensor {
    p.sub(name).var("weight", &[n as i64], Init::Const(1.0))
}

/// `y = x / sqrt(mean(x²) + eps) · w` over the last dim, computed in f32 (transformers' `KimiLinearRMSNorm`).
///
/// # Shapes
/// x: [..., n], w: [n] → [..., n]
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    let kind = x.kind();
    let xf = x.to_kind(compute_kind(kind));
    let y = &xf * (xf.square().mean_dim(-1, true, None) + eps).rsqrt();
    y.to_kind(kind) * w
}

/// RMSNorm without a weight.
pub fn rms_normalize(x: &Tensor, eps: f64) -> Tensor {
    x * (x.square().mean_dim(-1, true, None) + eps).rsqrt()
}

/// `x / sqrt(Σx² + eps)` over the last dim (fla / transformers `l2norm`, eps inside the sqrt).
pub fn l2norm(x: &Tensor, eps: f64) -> Tensor {
    x / (x.square().sum_dim_intlist(-1, true, None) + eps).sqrt()
}

/// transformers' thresholded softplus: `x` where `x > 20`, else `log(1 + exp(x))`.
/// The clamp keeps the unused branch finite, so its zero gradient never meets an `inf` (0·inf = NaN).
pub fn softplus_thresholded(x: &Tensor) -> Tensor {
    let sp = (x.clamp_max(20.0).exp() + 1.0).log();
    sp.where_self(&x.le(20.0), x)
}

/// The kind numerically sensitive steps (norms, softmax, router) run in: f32, or f64 when the
/// model runs in f64 (gradient and reference checks).
pub fn compute_kind(k: Kind) -> Kind {
    if k == Kind::Double {
        Kind::Double
    } else {
        Kind::Float
    }
}

/// Overwrite a parameter's values in place, outside autograd.
pub fn set_param(param: &Tensor, value: &Tensor) {
    tch::no_grad(|| {
        let mut p = param.shallow_clone();
        p.copy_(&value.to_kind(param.kind()).reshape(param.size()));
    });
}

/// Flush subnormal floats to zero (x86 MXCSR FTZ + DAZ) on this thread and on threads it starts
/// afterwards (they inherit the floating-point environment), as `torch.set_flush_denormal(True)`.
///
/// Call before the first parallel libtorch op. Subnormals arise naturally here (decays
/// `exp(Σg)` over a chunk, softmax tails in the cross-entropy gradient) and make every matmul
/// that touches them ~100× slower on x86; flushing changes values below 1.2e-38 only.
pub fn flush_denormals() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: reading and writing MXCSR only changes how this thread rounds subnormal results.
    #[allow(deprecated)]
    unsafe {
        use std::arch::x86_64::{_mm_getcsr, _mm_setcsr};
        _mm_setcsr(_mm_getcsr() | 0x8040);
    }
}
