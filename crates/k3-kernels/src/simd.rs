//! f32 vector primitives with runtime dispatch (AVX-512F → AVX2+FMA → plain loops): the dot
//! product and `y += a·x` that attention, norms and reference matmuls are built from. Each has its
//! plain-loop reference in `ops` and a test comparing them.

use std::sync::OnceLock;

type DotFn = fn(&[f32], &[f32]) -> f32;
type AxpyFn = fn(&mut [f32], f32, &[f32]);

struct Table {
    dot: DotFn,
    axpy: AxpyFn,
}

fn table() -> &'static Table {
    static T: OnceLock<Table> = OnceLock::new();
    T.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            let isa = crate::qgemm::Isa::best();
            if isa >= crate::qgemm::Isa::Avx512Vnni {
                return Table { dot: x86::dot512, axpy: x86::axpy512 };
            }
            if isa >= crate::qgemm::Isa::Avx2 {
                return Table { dot: x86::dot256, axpy: x86::axpy256 };
            }
        }
        Table { dot: crate::ops::dot_ref, axpy: crate::ops::axpy_ref }
    })
}

/// `Σ a[i]·b[i]` over the shorter length.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    (table().dot)(a, b)
}

/// `y[i] += a·x[i]` over the shorter length.
#[inline]
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    (table().axpy)(y, a, x)
}

/// `C[m×n] += A[m×k] · B[k×n]`, all row-major (the chunked KDA's state products): AVX-512 tiles of
/// 4 rows × 64 columns held in registers across k, else the plain loops.
pub fn matmul_acc(c: &mut [f32], a: &[f32], b: &[f32], m: usize, k: usize, n: usize) {
    assert!(c.len() >= m * n && a.len() >= m * k && b.len() >= k * n, "matmul_acc: operand too short");
    #[cfg(target_arch = "x86_64")]
    if crate::qgemm::Isa::best() >= crate::qgemm::Isa::Avx512Vnni {
        // SAFETY: AVX-512F is present (Isa::best checks it); lengths checked above.
        unsafe { x86::matmul_acc512(c, a, b, m, k, n) };
        return;
    }
    crate::ops::matmul_acc_ref(c, a, b, m, k, n)
}

/// Round every value to the nearest f16 (ties to even), in place: F16C 16 at a time when the
/// CPU has AVX-512, else `half`'s conversion.
pub fn round_f16_inplace(v: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::qgemm::Isa::best() >= crate::qgemm::Isa::Avx512Vnni {
        // SAFETY: AVX-512F and F16C are present (Isa::best checks both).
        unsafe { x86::round_f16_512(v) };
        return;
    }
    v.iter_mut().for_each(|x| *x = half::f16::from_f32(*x).to_f32());
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    pub fn dot512(a: &[f32], b: &[f32]) -> f32 {
        // SAFETY: selected only when the CPU has AVX-512F (Isa::best).
        unsafe { dot512_impl(a, b) }
    }
    pub fn axpy512(y: &mut [f32], s: f32, x: &[f32]) {
        // SAFETY: as above.
        unsafe { axpy512_impl(y, s, x) }
    }
    pub fn dot256(a: &[f32], b: &[f32]) -> f32 {
        // SAFETY: selected only when the CPU has AVX2 and FMA.
        unsafe { dot256_impl(a, b) }
    }
    pub fn axpy256(y: &mut [f32], s: f32, x: &[f32]) {
        // SAFETY: as above.
        unsafe { axpy256_impl(y, s, x) }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn dot512_impl(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let (mut s0, mut s1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let mut i = 0;
        while i + 32 <= n {
            s0 = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), s0);
            s1 = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i + 16)), _mm512_loadu_ps(pb.add(i + 16)), s1);
            i += 32;
        }
        if i + 16 <= n {
            s0 = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), s0);
            i += 16;
        }
        if i < n {
            let m: __mmask16 = (1u32 << (n - i)) as u16 - 1;
            s1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, pa.add(i)), _mm512_maskz_loadu_ps(m, pb.add(i)), s1);
        }
        _mm512_reduce_add_ps(_mm512_add_ps(s0, s1))
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn axpy512_impl(y: &mut [f32], s: f32, x: &[f32]) {
        let n = y.len().min(x.len());
        let (py, px) = (y.as_mut_ptr(), x.as_ptr());
        let sv = _mm512_set1_ps(s);
        let mut i = 0;
        while i + 16 <= n {
            _mm512_storeu_ps(py.add(i), _mm512_fmadd_ps(sv, _mm512_loadu_ps(px.add(i)), _mm512_loadu_ps(py.add(i))));
            i += 16;
        }
        if i < n {
            let m: __mmask16 = (1u32 << (n - i)) as u16 - 1;
            let v = _mm512_fmadd_ps(sv, _mm512_maskz_loadu_ps(m, px.add(i)), _mm512_maskz_loadu_ps(m, py.add(i)));
            _mm512_mask_storeu_ps(py.add(i), m, v);
        }
    }

    /// See [`super::matmul_acc`]. Operands must be long enough (checked by the caller).
    #[target_feature(enable = "avx512f")]
    pub unsafe fn matmul_acc512(c: &mut [f32], a: &[f32], b: &[f32], m: usize, k: usize, n: usize) {
        let mut i0 = 0;
        while i0 < m {
            match m - i0 {
                1 => rows512::<1>(c, a, b, i0, k, n),
                2 => rows512::<2>(c, a, b, i0, k, n),
                3 => rows512::<3>(c, a, b, i0, k, n),
                _ => rows512::<4>(c, a, b, i0, k, n),
            }
            i0 += 4;
        }
    }

    /// Rows i0..i0+R of C, 64 columns at a time (4 × 16 lanes, the last ones masked).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn rows512<const R: usize>(c: &mut [f32], a: &[f32], b: &[f32], i0: usize, k: usize, n: usize) {
        let (pc, pa, pb) = (c.as_mut_ptr(), a.as_ptr(), b.as_ptr());
        let mut j0 = 0;
        while j0 < n {
            let mask: [__mmask16; 4] = std::array::from_fn(|q| {
                let left = n.saturating_sub(j0 + 16 * q).min(16);
                ((1u32 << left) - 1) as u16
            });
            let mut acc = [[_mm512_setzero_ps(); 4]; R];
            for r in 0..R {
                for q in 0..4 {
                    acc[r][q] = _mm512_maskz_loadu_ps(mask[q], pc.add((i0 + r) * n + j0 + 16 * q));
                }
            }
            for kk in 0..k {
                let bv: [__m512; 4] =
                    std::array::from_fn(|q| _mm512_maskz_loadu_ps(mask[q], pb.add(kk * n + j0 + 16 * q)));
                for r in 0..R {
                    let av = _mm512_set1_ps(*pa.add((i0 + r) * k + kk));
                    for q in 0..4 {
                        acc[r][q] = _mm512_fmadd_ps(av, bv[q], acc[r][q]);
                    }
                }
            }
            for r in 0..R {
                for q in 0..4 {
                    _mm512_mask_storeu_ps(pc.add((i0 + r) * n + j0 + 16 * q), mask[q], acc[r][q]);
                }
            }
            j0 += 64;
        }
    }

    #[target_feature(enable = "avx512f,f16c")]
    pub unsafe fn round_f16_512(v: &mut [f32]) {
        let n = v.len();
        let p = v.as_mut_ptr();
        let mut i = 0;
        while i + 16 <= n {
            let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_loadu_ps(p.add(i)));
            _mm512_storeu_ps(p.add(i), _mm512_cvtph_ps(h));
            i += 16;
        }
        while i < n {
            *p.add(i) = half::f16::from_f32(*p.add(i)).to_f32();
            i += 1;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot256_impl(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i + 16 <= n {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8)), _mm256_loadu_ps(pb.add(i + 8)), s1);
            i += 16;
        }
        let s = _mm256_add_ps(s0, s1);
        let h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
        let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        let h = _mm_add_ss(h, _mm_movehdup_ps(h));
        let mut r = _mm_cvtss_f32(h);
        while i < n {
            r += *pa.add(i) * *pb.add(i);
            i += 1;
        }
        r
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn axpy256_impl(y: &mut [f32], s: f32, x: &[f32]) {
        let n = y.len().min(x.len());
        let (py, px) = (y.as_mut_ptr(), x.as_ptr());
        let sv = _mm256_set1_ps(s);
        let mut i = 0;
        while i + 8 <= n {
            _mm256_storeu_ps(py.add(i), _mm256_fmadd_ps(sv, _mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(py.add(i))));
            i += 8;
        }
        while i < n {
            *py.add(i) += s * *px.add(i);
            i += 1;
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use crate::testing::Rng;

        #[test]
        fn f16_rounding_matches_half() {
            let mut rng = Rng::new(8);
            let mut v = rng.normals(100, 3.0);
            v.extend([65520.0, 1e-8, -0.0, 6.1e-5, 2049.0, 2051.0]);
            let want: Vec<f32> = v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect();
            super::super::round_f16_inplace(&mut v);
            assert_eq!(
                v.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
        }

        #[test]
        fn matmul_acc_matches_the_loops() {
            let mut rng = Rng::new(12);
            for &(m, k, n) in &[(1, 1, 1), (3, 5, 17), (4, 128, 128), (7, 33, 70), (64, 64, 128), (9, 16, 200)] {
                let (a, b, c0) = (rng.normals(m * k, 1.0), rng.normals(k * n, 1.0), rng.normals(m * n, 1.0));
                let (mut want, mut got) = (c0.clone(), c0);
                crate::ops::matmul_acc_ref(&mut want, &a, &b, m, k, n);
                super::super::matmul_acc(&mut got, &a, &b, m, k, n);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-5 * (1.0 + w.abs()) * (k as f32).sqrt(),
                        "[{m}x{k}x{n}] {i}: {g} vs {w}"
                    );
                }
            }
        }

        #[test]
        fn simd_paths_match_the_loops() {
            let mut rng = Rng::new(4);
            let isas = crate::qgemm::Isa::available();
            for n in [0usize, 1, 7, 15, 16, 17, 31, 33, 64, 100, 577] {
                let (a, b) = (rng.normals(n, 1.0), rng.normals(n, 1.0));
                let want = crate::ops::dot_ref(&a, &b);
                let mut paths: Vec<(&str, super::super::DotFn, super::super::AxpyFn)> = Vec::new();
                if isas.contains(&crate::qgemm::Isa::Avx2) {
                    paths.push(("avx2", dot256, axpy256));
                }
                if isas.contains(&crate::qgemm::Isa::Avx512Vnni) {
                    paths.push(("avx512", dot512, axpy512));
                }
                for (name, d, ax) in paths {
                    let got = d(&a, &b);
                    assert!((got - want).abs() <= 1e-5 * (1.0 + n as f32), "{name} dot n={n}: {got} vs {want}");
                    let (mut y1, mut y2) = (b.clone(), b.clone());
                    crate::ops::axpy_ref(&mut y1, 0.7, &a);
                    ax(&mut y2, 0.7, &a);
                    for (p, q) in y1.iter().zip(&y2) {
                        assert!((p - q).abs() <= 1e-6 * (1.0 + p.abs()), "{name} axpy n={n}");
                    }
                }
            }
        }
    }
}
