//! Elementwise and row ops: RMSNorm, L2 norm, softmax, SiLU, SiTU, dot/axpy, f32 matmul.
//! These are already the reference form; the speed issue adds SIMD versions beside them.

/// Mean of squares as ggml computes it: f32 squares summed in f64, the mean rounded to f32. Under
/// reference arithmetic the sum runs in ggml's order; else in eight f64 lanes (so it vectorises;
/// a decode token takes ~100 of these over 1–3K values, on the serial path between products),
/// which moves the f64 sum by at most ~n·2⁻⁵³ of itself, n·2⁻³⁰ of the f32 rounding step of the
/// mean: the f32 result differs only when the sum lies that close to a rounding boundary.
fn mean_square(x: &[f32]) -> f32 {
    if reference() {
        return (x.iter().map(|&v| (v * v) as f64).sum::<f64>() / x.len() as f64) as f32;
    }
    let mut lanes = [0f64; 8];
    let blocks = x.chunks_exact(8);
    let tail = blocks.remainder();
    for b in blocks {
        for (l, &v) in lanes.iter_mut().zip(b) {
            *l += (v * v) as f64;
        }
    }
    let sum = tail.iter().fold(lanes.iter().sum::<f64>(), |s, &v| s + (v * v) as f64);
    (sum / x.len() as f64) as f32
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

/// [`softmax_inplace`] of `scale · x` (scale > 0), for the attention fast paths: [`exp_fast`]
/// and the sum in 16 f32 lanes, so the loops vectorise.
pub fn softmax_scaled_fast(x: &mut [f32], scale: f32) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) * scale;
    let inv = 1.0 / exp_shifted_sum(x, scale, m);
    x.iter_mut().for_each(|v| *v *= inv);
}

/// `x_j ← e^(scale·x_j − m)` in place with [`exp_fast`], returning their sum (the unnormalised
/// half of a softmax, for softmaxes split over several pieces). On AVX-512 in 16-lane vectors
/// with fused multiply-adds (`simd::x86::exp_shifted_sum512`); [`exp_shifted_sum_ref`] is its
/// reference.
pub fn exp_shifted_sum(x: &mut [f32], scale: f32, m: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::qgemm::Isa::best() >= crate::qgemm::Isa::Avx512 {
        // SAFETY: AVX-512F and FMA are present (Isa::best checks them).
        return unsafe { crate::simd::x86::exp_shifted_sum512(x, scale, m) };
    }
    exp_shifted_sum_ref(x, scale, m)
}

/// [`exp_shifted_sum`] in plain Rust: [`exp_fast`] per value, the sum in 16 lanes.
pub fn exp_shifted_sum_ref(x: &mut [f32], scale: f32, m: f32) -> f32 {
    let mut lanes = [0f32; 16];
    let mut chunks = x.chunks_exact_mut(16);
    for c in &mut chunks {
        for (v, l) in c.iter_mut().zip(lanes.iter_mut()) {
            *v = exp_fast(*v * scale - m);
            *l += *v;
        }
    }
    let mut sum: f32 = lanes.iter().sum();
    for v in chunks.into_remainder() {
        *v = exp_fast(*v * scale - m);
        sum += *v;
    }
    sum
}

/// `x ← log_softmax(x / temperature)` in place: the maximum, then Σ e^(x/τ − m) by
/// [`exp_shifted_sum`] over copies of 1024-value pieces (its vector path where the CPU has one),
/// the pieces' sums added in f64, then each value less the log of the sum. Over a vocabulary-wide
/// row (a teacher's 49,152 logits a position) it replaces the libm loop of
/// [`log_softmax_inplace_ref`], its reference, which was most of the capture's row reduction.
///
/// # Shapes
/// x: [V], one row.
pub fn log_softmax_inplace(x: &mut [f32], temperature: f32) {
    let inv = 1.0 / temperature;
    let mut lanes = [f32::NEG_INFINITY; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l = l.max(v);
        }
    }
    let m = chunks.remainder().iter().chain(&lanes).fold(f32::NEG_INFINITY, |a, &v| a.max(v)) * inv;
    let mut piece = [0f32; 1024];
    let mut z = 0f64;
    for c in x.chunks(piece.len()) {
        let p = &mut piece[..c.len()];
        p.copy_from_slice(c);
        z += exp_shifted_sum(p, inv, m) as f64;
    }
    let lz = m + z.ln() as f32;
    x.iter_mut().for_each(|v| *v = *v * inv - lz);
}

/// [`log_softmax_inplace`] with libm's exponential in f64, one value at a time.
pub fn log_softmax_inplace_ref(x: &mut [f32], temperature: f32) {
    let inv = 1.0 / temperature;
    let m = x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v)) * inv;
    let z: f64 = x.iter().map(|&v| ((v * inv - m) as f64).exp()).sum();
    let lz = m + z.ln() as f32;
    x.iter_mut().for_each(|v| *v = *v * inv - lz);
}

/// e^x without a libm call: Cephes' expf (2^n · p(r), r = x − n·ln 2, |r| ≤ ln2/2, degree-6
/// polynomial), branch-free so loops over it vectorise. Relative error ≤ 2e-7 on [−87, 88]; the
/// input is clamped there, so it never returns inf or 0 (below e^−87 it gives ~1.2e-38), and a
/// NaN input, as the 16-lane form's `max` takes it, gives that same ~1.2e-38 (a clamp would keep
/// the NaN, and its conversion to an integer below would be undefined).
/// [`exp_ref`] (libm) is its reference.
#[inline(always)]
pub fn exp_fast(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Not `clamp`: it keeps a NaN, whose conversion below would be undefined.
    #[allow(clippy::manual_clamp)]
    let x = x.max(-87.3).min(88.3);
    let n = (x * LOG2E + 12_582_912.0) - 12_582_912.0; // round to nearest (|x·log2 e| < 2²²)
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // SAFETY: n is an integer in [−126, 128] (x was clamped), so the conversion is exact; unlike
    // `as`, it needs no saturation code and vectorises to one instruction.
    let n = unsafe { n.to_int_unchecked::<i32>() };
    y * f32::from_bits(((n + 127) as u32) << 23)
}

/// The reference for [`exp_fast`].
pub fn exp_ref(x: f32) -> f32 {
    x.exp()
}

/// σ(x) = 1 / (1 + e^−x), on [`exp_fast`] (libm's exp under [`set_reference_arithmetic`]).
pub fn sigmoid(x: f32) -> f32 {
    if reference() {
        1.0 / (1.0 + exp_ref(-x))
    } else {
        sigmoid_fast(x)
    }
}

/// [`sigmoid`] on [`exp_fast`] always, inlined so loops over it vectorise (check
/// [`reference_arithmetic`] once outside the loop).
#[inline(always)]
pub fn sigmoid_fast(x: f32) -> f32 {
    1.0 / (1.0 + exp_fast(-x))
}

pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// transformers' thresholded softplus: x if x > 20 else log(1 + exp(x)) (libm; the reference for
/// [`softplus_fast`]).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        (1.0 + x.exp()).ln()
    }
}

/// Softplus without libm calls: `max(x, 0) + ln(1 + e^−|x|)`, the same function (exactly x past
/// 20, as the reference), with [`exp_fast`] and [`ln_fast`]. Branch-free, so loops vectorise.
#[inline(always)]
pub fn softplus_fast(x: f32) -> f32 {
    let y = x.max(0.0) + ln_fast(1.0 + exp_fast(-x.abs()));
    if x > 20.0 {
        x
    } else {
        y
    }
}

/// ln x for finite x > 0 without a libm call: Cephes' logf (x = 2^e · m, m in [√½, √2), a degree-8
/// polynomial in m − 1). Relative error ≤ 3e-7 away from x = 1, absolute ≤ 1e-7 near it.
#[inline(always)]
pub fn ln_fast(x: f32) -> f32 {
    let bits = x.to_bits();
    let mut e = ((bits >> 23) & 0xff) as i32 - 126;
    let mut m = f32::from_bits((bits & 0x007f_ffff) | 0x3f00_0000); // [0.5, 1)
    let small = m < std::f32::consts::FRAC_1_SQRT_2;
    e -= small as i32;
    m = if small { m + m } else { m } - 1.0;
    let z = m * m;
    let mut p = 7.037_683_6e-2f32;
    p = p * m - 1.151_461e-1;
    p = p * m + 1.167_699_9e-1;
    p = p * m - 1.242_014_1e-1;
    p = p * m + 1.424_932_3e-1;
    p = p * m - 1.666_805_8e-1;
    p = p * m + 2.000_071_4e-1;
    p = p * m - 2.499_999_4e-1;
    p = p * m + 3.333_333e-1;
    let ef = e as f32;
    let y = p * m * z - 2.121_944_4e-4 * ef - 0.5 * z;
    m + y + 0.693_359_4 * ef
}

/// SwiGLU in place: `g ← silu(g) · u`.
pub fn swiglu_inplace(g: &mut [f32], u: &[f32]) {
    if reference() {
        for (a, &b) in g.iter_mut().zip(u) {
            *a = *a / (1.0 + exp_ref(-*a)) * b;
        }
        return;
    }
    for (a, &b) in g.iter_mut().zip(u) {
        *a = *a / (1.0 + exp_fast(-*a)) * b;
    }
}

/// SiLU in place (vectorised on [`exp_fast`]; libm's exp under [`set_reference_arithmetic`]).
pub fn silu_inplace(x: &mut [f32]) {
    if reference() {
        x.iter_mut().for_each(|a| *a /= 1.0 + exp_ref(-*a));
        return;
    }
    x.iter_mut().for_each(|a| *a /= 1.0 + exp_fast(-*a));
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

/// Whether [`set_reference_arithmetic`] is on (for loops that pick their form once).
pub fn reference_arithmetic() -> bool {
    reference()
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

/// `C[m×n] += A[m×k] · B[k×n]` (row-major), SIMD-dispatched (see `simd`).
pub fn matmul_acc(c: &mut [f32], a: &[f32], b: &[f32], m: usize, k: usize, n: usize) {
    if reference() {
        return matmul_acc_ref(c, n, a, k, b, n, m, k, n);
    }
    crate::simd::matmul_acc(c, a, b, m, k, n)
}

/// The reference for [`crate::simd::matmul_acc_strided`]: one sequential sum per element.
#[allow(clippy::too_many_arguments)]
pub fn matmul_acc_ref(
    c: &mut [f32],
    ldc: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    m: usize,
    k: usize,
    n: usize,
) {
    for i in 0..m {
        for j in 0..n {
            let mut s = c[i * ldc + j];
            for kk in 0..k {
                s += a[i * lda + kk] * b[kk * ldb + j];
            }
            c[i * ldc + j] = s;
        }
    }
}

/// The reference for [`crate::simd::matmul_nt_acc`]: C += A·Bᵀ, one sequential sum per element.
#[allow(clippy::too_many_arguments)]
pub fn matmul_nt_acc_ref(
    c: &mut [f32],
    ldc: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    m: usize,
    k: usize,
    n: usize,
) {
    for i in 0..m {
        for j in 0..n {
            c[i * ldc + j] += dot_ref(&a[i * lda..i * lda + k], &b[j * ldb..j * ldb + k]);
        }
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
    /// The vector exponentials and their sum against the plain loop, on lengths around the
    /// vector steps (the masked tail), values that reach the clamp at both ends.
    #[test]
    fn exp_shifted_sum_matches_its_reference() {
        let mut rng = crate::testing::Rng::new(41);
        for n in [0, 1, 15, 16, 17, 31, 32, 33, 100, 257] {
            let x: Vec<f32> = rng.normals(n, 30.0);
            let (mut got, mut want) = (x.clone(), x.clone());
            let (sg, sw) =
                (super::exp_shifted_sum(&mut got, 0.7, 3.0), super::exp_shifted_sum_ref(&mut want, 0.7, 3.0));
            for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                assert!((g - w).abs() <= 4e-7 * w.abs() + f32::MIN_POSITIVE, "n {n}, value {i}: {g} against {w}");
            }
            assert!((sg - sw).abs() <= 1e-6 * sw.abs() + f32::MIN_POSITIVE, "n {n}: sum {sg} against {sw}");
        }
    }

    /// The fast log-softmax against the libm one: rows around the vector and piece lengths, wide
    /// and narrow spreads, a temperature, and a row whose tokens mostly carry ~0 probability.
    #[test]
    fn log_softmax_matches_its_reference() {
        let mut rng = crate::testing::Rng::new(43);
        for (n, spread, temp) in [(1, 1.0, 1.0), (17, 3.0, 1.0), (1024, 5.0, 1.0), (1025, 5.0, 2.0), (49_152, 8.0, 1.0)]
        {
            let mut x: Vec<f32> = rng.normals(n, spread);
            if n > 100 {
                x[7] = -1e4; // a token the model all but rules out
                x[9] = f32::NEG_INFINITY; // and one it rules out
            }
            let (mut got, mut want) = (x.clone(), x.clone());
            super::log_softmax_inplace(&mut got, temp);
            super::log_softmax_inplace_ref(&mut want, temp);
            for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                assert!(g == w || (g - w).abs() <= 2e-6 * (1.0 + w.abs()), "n {n}, value {i}: {g} against {w}");
            }
            let mass: f64 = got.iter().map(|&v| (v as f64).exp()).sum();
            assert!((mass - 1.0).abs() < 1e-5, "n {n}: the probabilities sum to {mass}");
        }
    }

    /// A NaN into the exponential comes out as e^−87.3, as the 16-lane form's `max` makes it,
    /// not as a NaN converted to an integer (undefined), on either path.
    #[test]
    fn exp_takes_nan_as_its_clamp_floor() {
        let floor = super::exp_fast(-87.3);
        assert_eq!(super::exp_fast(f32::NAN).to_bits(), floor.to_bits());
        let mut x = [f32::NAN; 20];
        let sum = super::exp_shifted_sum(&mut x, 1.0, 0.0);
        assert!(x.iter().all(|&v| v.is_finite() && v <= 2.0 * floor), "{x:?}");
        assert!(sum.is_finite(), "{sum}");
    }

    /// The 16-lane exponential against libm over the range the softmaxes feed it and past its
    /// clamp at both ends, where the machine has AVX-512.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn exp16_matches_libm() {
        use std::arch::x86_64::{_mm512_loadu_ps, _mm512_storeu_ps};
        if crate::qgemm::Isa::best() < crate::qgemm::Isa::Avx512 {
            return;
        }
        let xs: Vec<f32> = (0..4000).map(|i| -100.0 + i as f32 * 0.047).collect();
        for c in xs.chunks_exact(16) {
            let mut got = [0f32; 16];
            // SAFETY: AVX-512 is present (checked above); got holds 16 lanes.
            unsafe { _mm512_storeu_ps(got.as_mut_ptr(), crate::simd::x86::exp16(_mm512_loadu_ps(c.as_ptr()))) };
            for (&x, &g) in c.iter().zip(&got) {
                let want = super::exp_ref(x.clamp(-87.3, 88.3));
                assert!((g - want).abs() <= 4e-7 * want, "exp16({x}) = {g}, libm {want}");
            }
        }
    }

    use super::*;
    use crate::testing::Rng;

    #[test]
    fn fast_softmax_matches_the_reference() {
        let mut rng = Rng::new(5);
        for n in [1, 7, 16, 33, 1000] {
            let x = rng.normals(n, 4.0);
            let mut want: Vec<f32> = x.iter().map(|v| v * 0.3).collect();
            softmax_inplace(&mut want);
            let mut got = x.clone();
            softmax_scaled_fast(&mut got, 0.3);
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() <= 1e-5 * w.abs() + 1e-9, "n {n}: {g} vs {w}");
            }
        }
    }

    #[test]
    fn fast_exp_matches_libm() {
        let mut worst = 0f64;
        for i in -87_000..=88_000 {
            let x = i as f32 * 1e-3 + 1.7e-4;
            let (f, r) = (exp_fast(x) as f64, (x as f64).exp());
            worst = worst.max((f - r).abs() / r);
        }
        assert!(worst < 2.5e-7, "worst relative error {worst}");
        assert!(exp_fast(-1000.0) > 0.0 && exp_fast(-1000.0) < 1.3e-38 && exp_fast(1000.0).is_finite());
        assert_eq!(exp_fast(0.0), 1.0);
    }

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

    #[test]
    fn fast_ln_and_softplus_match_libm() {
        // ln over 12 decades, relative to libm; softplus through the 20 threshold and deep
        // negatives. Both softplus forms round 1 + e^x first, so their difference is absolute
        // (a few 1e-8), not relative, where e^x is small.
        let mut x = 1e-6f32;
        while x < 1e6 {
            let (a, b) = (ln_fast(x) as f64, (x as f64).ln());
            assert!((a - b).abs() <= 3e-7 * b.abs().max(1.0), "ln({x}): {a} vs {b}");
            x *= 1.013;
        }
        for i in -4000..=4000 {
            let x = i as f32 * 0.01;
            let (a, b) = (softplus_fast(x) as f64, softplus(x) as f64);
            assert!((a - b).abs() <= 1e-6 * b.abs() + 2e-7, "softplus({x}): {a} vs {b}");
        }
        assert_eq!(softplus_fast(25.0), 25.0);
    }
}
