//! Elementwise and row ops: RMSNorm, L2 norm, softmax, SiLU, SiTU, dot/axpy, f32 matmul.
//! These are already the reference form; the speed issue adds SIMD versions beside them.

/// Mean of squares as ggml computes it: f32 squares summed in f64, the mean rounded to f32.
fn mean_square(x: &[f32]) -> f32 {
    (x.iter().map(|&v| (v * v) as f64).sum::<f64>() / x.len() as f64) as f32
}

/// `y[n, :] = x[n, :] / sqrt(mean(x[n, :]²) + eps) ⊙ w`, rows of width `w.len()`.
pub fn rmsnorm(y: &mut [f32], x: &[f32], w: &[f32], eps: f32) {
    let c = w.len();
    for (yr, xr) in y.chunks_exact_mut(c).zip(x.chunks_exact(c)) {
        let r = 1.0 / (mean_square(xr) + eps).sqrt();
        for ((o, &v), &g) in yr.iter_mut().zip(xr).zip(w) {
            *o = v * r * g;
        }
    }
}

/// In place: each row of width `c` scaled to `x / sqrt(mean(x²) + eps)` (no weight).
pub fn rms_normalize_inplace(x: &mut [f32], c: usize, eps: f32) {
    for r in x.chunks_exact_mut(c) {
        let s = 1.0 / (mean_square(r) + eps).sqrt();
        r.iter_mut().for_each(|v| *v *= s);
    }
}

/// In place: each row of width `c` divided by `sqrt(Σx² + eps)` (fla/transformers `l2norm`).
pub fn l2norm_inplace(x: &mut [f32], c: usize, eps: f32) {
    for r in x.chunks_exact_mut(c) {
        let s = 1.0 / ((r.iter().map(|&v| (v * v) as f64).sum::<f64>() as f32) + eps).sqrt();
        r.iter_mut().for_each(|v| *v *= s);
    }
}

/// The same L2 norm as llama.cpp builds it: `rms_norm(x, eps/c) · 1/sqrt(c)` (equal in exact
/// arithmetic, rounded differently).
pub fn l2norm_ggml_inplace(x: &mut [f32], c: usize, eps: f32) {
    let n = c as f32;
    let post = 1.0 / n.sqrt();
    for r in x.chunks_exact_mut(c) {
        let s = 1.0 / (mean_square(r) + eps / n).sqrt();
        r.iter_mut().for_each(|v| *v = (*v * s) * post);
    }
}

/// Numerically stable softmax in place.
pub fn softmax_inplace(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f64; // ggml sums the exponentials in double
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    x.iter_mut().for_each(|v| *v *= inv);
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// transformers' thresholded softplus: x if x > 20 else log(1 + exp(x)).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        (1.0 + x.exp()).ln()
    }
}

/// SwiGLU in place: `g ← silu(g) · u`.
pub fn swiglu_inplace(g: &mut [f32], u: &[f32]) {
    for (a, &b) in g.iter_mut().zip(u) {
        *a = silu(*a) * b;
    }
}

/// SiTU-GLU in place (architecture.md §5(d)): `g ← β·tanh(g/β)·σ(g) · β_lin·tanh(u/β_lin)`;
/// `β_lin ≤ 0` leaves the up branch uncapped.
pub fn situ_glu_inplace(g: &mut [f32], u: &[f32], beta: f32, linear_beta: f32) {
    for (a, &b) in g.iter_mut().zip(u) {
        let gate = beta * (*a / beta).tanh() * sigmoid(*a);
        let up = if linear_beta > 0.0 { linear_beta * (b / linear_beta).tanh() } else { b };
        *a = gate * up;
    }
}

/// Reference arithmetic (the engine's `--exact` mode): [`dot`] and [`axpy`] use the sequential
/// references instead of the SIMD kernels, whose reassociated sums differ in the last bits. On
/// ill-conditioned random models that difference is amplified enough to matter for 1e-4 parity.
static REFERENCE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Switch [`dot`] / [`axpy`] to their sequential references for the whole process.
pub fn set_reference_arithmetic(on: bool) {
    REFERENCE.store(on, std::sync::atomic::Ordering::Relaxed);
}

fn reference() -> bool {
    REFERENCE.load(std::sync::atomic::Ordering::Relaxed)
}

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    if reference() {
        return dot_ref(a, b);
    }
    crate::simd::dot(a, b)
}

/// The reference for [`dot`]: one sequential sum.
pub fn dot_ref(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `y += a · x` (SIMD-dispatched, see `simd`).
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    if reference() {
        return axpy_ref(y, a, x);
    }
    crate::simd::axpy(y, a, x)
}

/// The reference for [`axpy`].
pub fn axpy_ref(y: &mut [f32], a: f32, x: &[f32]) {
    for (o, &v) in y.iter_mut().zip(x) {
        *o += a * v;
    }
}

/// `Y[t, o] = Σ_i X[t, i] · W[o, i]` for W [out, in] row-major (the HF layout).
pub fn matmul_f32_ref(y: &mut [f32], x: &[f32], w: &[f32], t: usize, inp: usize, out: usize) {
    debug_assert_eq!(x.len(), t * inp);
    debug_assert_eq!(w.len(), out * inp);
    for r in 0..t {
        let xr = &x[r * inp..(r + 1) * inp];
        for o in 0..out {
            y[r * out + o] = dot(xr, &w[o * inp..(o + 1) * inp]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;

    #[test]
    fn ops_match_f64_math() {
        let mut rng = Rng::new(1);
        let x = rng.normals(4 * 33, 2.0);
        let w = rng.normals(33, 1.0);
        let mut y = vec![0.0; x.len()];
        rmsnorm(&mut y, &x, &w, 1e-5);
        for r in 0..4 {
            let row = &x[r * 33..(r + 1) * 33];
            let ms: f64 = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / 33.0;
            for c in 0..33 {
                let want = row[c] as f64 / (ms + 1e-5).sqrt() * w[c] as f64;
                assert!((y[r * 33 + c] as f64 - want).abs() < 1e-5);
            }
        }
        let mut s = vec![1000.0, 1001.0, 999.0];
        softmax_inplace(&mut s);
        let e: Vec<f64> = [0.0f64, 1.0, -1.0].iter().map(|v| v.exp()).collect();
        let z: f64 = e.iter().sum();
        for (a, b) in s.iter().zip(&e) {
            assert!((*a as f64 - b / z).abs() < 1e-6);
        }
        let mut g = vec![3.0f32, -2.0, 0.5];
        situ_glu_inplace(&mut g, &[1.0, 2.0, -4.0], 1e9, 1e9);
        for (a, (gv, uv)) in g.iter().zip([(3.0f64, 1.0f64), (-2.0, 2.0), (0.5, -4.0)]) {
            assert!((*a as f64 - gv / (1.0 + (-gv).exp()) * uv).abs() < 1e-5, "SiTU at huge β must be SwiGLU");
        }
    }
}
