//! AVX2 + FMA forms of the f32 products in [`crate::simd`] (`matmul_acc_strided`,
//! `matmul_nt_acc`), for CPUs without AVX-512: the attention and KDA-chunk products of prefill;
//! and the F16C forms of its f16 conversions (`round_f16_inplace`, `f32_to_f16`, `f16_to_f32`).
//! Same contracts, B in f32 or f16 bits ([`Elem`]); each compared with the `ops` loops in the
//! tests below. AVX2 has no masked 16-bit loads, so partial vectors go through small zero-padded
//! buffers.

#[cfg(target_arch = "x86_64")]
pub use x86::{f16_to_f32_256, f32_to_f16_256, matmul_acc256, matmul_nt_acc256, round_f16_256};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use crate::simd::Elem;

    /// `round_f16_inplace` 8 at a time (F16C: round to nearest even, as `half`), the tail by `half`.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn round_f16_256(v: &mut [f32]) {
        let mut chunks = v.chunks_exact_mut(8);
        for c in &mut chunks {
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(c.as_ptr()));
            _mm256_storeu_ps(c.as_mut_ptr(), _mm256_cvtph_ps(h));
        }
        for x in chunks.into_remainder() {
            *x = half::f16::from_f32(*x).to_f32();
        }
    }

    /// `f32_to_f16` 8 at a time (F16C), the tail by `half`.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C; `dst` and `src` must have the same length.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn f32_to_f16_256(dst: &mut [u16], src: &[f32]) {
        debug_assert_eq!(dst.len(), src.len());
        let n = src.len() / 8 * 8;
        for (d, s) in dst[..n].chunks_exact_mut(8).zip(src[..n].chunks_exact(8)) {
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(s.as_ptr()));
            _mm_storeu_si128(d.as_mut_ptr() as *mut __m128i, h);
        }
        for (d, &x) in dst[n..].iter_mut().zip(&src[n..]) {
            *d = half::f16::from_f32(x).to_bits();
        }
    }

    /// `f16_to_f32` 8 at a time (F16C, exact), the tail by `half`.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C; `dst` and `src` must have the same length.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn f16_to_f32_256(dst: &mut [f32], src: &[u16]) {
        debug_assert_eq!(dst.len(), src.len());
        let n = src.len() / 8 * 8;
        for (d, s) in dst[..n].chunks_exact_mut(8).zip(src[..n].chunks_exact(8)) {
            _mm256_storeu_ps(d.as_mut_ptr(), _mm256_cvtph_ps(_mm_loadu_si128(s.as_ptr() as *const __m128i)));
        }
        for (d, &h) in dst[n..].iter_mut().zip(&src[n..]) {
            *d = half::f16::from_bits(h).to_f32();
        }
    }

    /// Rows of A per tile of `matmul_acc256` (6 × 16 accumulators: 12 of the 16 registers).
    const MR: usize = 6;
    /// k rows of B per panel: a packed [KC, 16] block is 16 KiB, resident in L1 across the tiles.
    const KC: usize = 256;

    /// 8 values of B at element `idx`, widened from f16 bits with `F16`; `left` < 8 reads only
    /// that many (the rest zero).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8<const F16: bool>(pb: *const u8, idx: usize, left: usize) -> __m256 {
        if F16 {
            let p = pb.add(2 * idx) as *const u16;
            if left >= 8 {
                return _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
            }
            let mut t = [0u16; 8];
            std::ptr::copy_nonoverlapping(p, t.as_mut_ptr(), left);
            _mm256_cvtph_ps(_mm_loadu_si128(t.as_ptr() as *const __m128i))
        } else {
            let p = pb.add(4 * idx) as *const f32;
            if left >= 8 {
                return _mm256_loadu_ps(p);
            }
            let mut t = [0f32; 8];
            std::ptr::copy_nonoverlapping(p, t.as_mut_ptr(), left);
            _mm256_loadu_ps(t.as_ptr())
        }
    }

    /// `C[i, j] += Σ_kk a[i·lda + kk] · b[kk·ldb + j]` (see `simd::matmul_acc_strided`): per k-panel
    /// and 16-column block, B's block copied (widened, zero-padded) into a contiguous [k, 16]
    /// buffer, then 6 × 16 register tiles of C over every row of A.
    ///
    /// # Safety
    /// AVX2, FMA and F16C; extents checked by the caller.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn matmul_acc256<B: Elem>(
        c: &mut [f32],
        ldc: usize,
        a: &[f32],
        lda: usize,
        b: &[B],
        ldb: usize,
        m: usize,
        k: usize,
        n: usize,
    ) {
        let (pc, pa, pb) = (c.as_mut_ptr(), a.as_ptr(), b.as_ptr() as *const u8);
        let esz = if B::F16 { 2 } else { 4 };
        let mut buf = vec![0f32; KC.min(k) * 16];
        let mut k0 = 0;
        while k0 < k {
            let kc = KC.min(k - k0);
            let mut j0 = 0;
            while j0 < n {
                let cols = (n - j0).min(16);
                for kk in 0..kc {
                    let src = pb.add(((k0 + kk) * ldb + j0) * esz);
                    for h in 0..2 {
                        let v = if B::F16 {
                            load8::<true>(src, 8 * h, cols.saturating_sub(8 * h))
                        } else {
                            load8::<false>(src, 8 * h, cols.saturating_sub(8 * h))
                        };
                        _mm256_storeu_ps(buf.as_mut_ptr().add(kk * 16 + 8 * h), v);
                    }
                }
                let mut i0 = 0;
                while i0 < m {
                    let rows = (m - i0).min(MR);
                    let t = Tile { pc: pc.add(i0 * ldc + j0), ldc, pa: pa.add(i0 * lda + k0), lda, k: kc, cols };
                    match rows {
                        1 => tile256::<1>(t, &buf),
                        2 => tile256::<2>(t, &buf),
                        3 => tile256::<3>(t, &buf),
                        4 => tile256::<4>(t, &buf),
                        5 => tile256::<5>(t, &buf),
                        _ => tile256::<6>(t, &buf),
                    }
                    i0 += MR;
                }
                j0 += 16;
            }
            k0 += kc;
        }
    }

    /// R rows × `cols` (≤ 16) columns of C at `pc` (row stride `ldc`), plus A's R rows at `pa`
    /// (stride `lda`) times the packed [k, 16] block.
    #[derive(Clone, Copy)]
    struct Tile {
        pc: *mut f32,
        ldc: usize,
        pa: *const f32,
        lda: usize,
        k: usize,
        cols: usize,
    }

    #[inline(always)]
    unsafe fn tile256<const R: usize>(t: Tile, packed: &[f32]) {
        // A partial block of columns works on a zero-padded copy of its C rows.
        let mut tmp = [[0f32; 16]; R];
        let full = t.cols == 16;
        let row_ptr = |r: usize, tmp: &mut [[f32; 16]; R]| -> *mut f32 {
            if full {
                t.pc.add(r * t.ldc)
            } else {
                tmp[r].as_mut_ptr()
            }
        };
        if !full {
            for (r, row) in tmp.iter_mut().enumerate() {
                std::ptr::copy_nonoverlapping(t.pc.add(r * t.ldc), row.as_mut_ptr(), t.cols);
            }
        }
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for (r, acc) in acc.iter_mut().enumerate() {
            let p = row_ptr(r, &mut tmp);
            acc[0] = _mm256_loadu_ps(p);
            acc[1] = _mm256_loadu_ps(p.add(8));
        }
        let pb = packed.as_ptr();
        for kk in 0..t.k {
            let (b0, b1) = (_mm256_loadu_ps(pb.add(kk * 16)), _mm256_loadu_ps(pb.add(kk * 16 + 8)));
            for (r, acc) in acc.iter_mut().enumerate() {
                let av = _mm256_broadcast_ss(&*t.pa.add(r * t.lda + kk));
                acc[0] = _mm256_fmadd_ps(av, b0, acc[0]);
                acc[1] = _mm256_fmadd_ps(av, b1, acc[1]);
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            let p = row_ptr(r, &mut tmp);
            _mm256_storeu_ps(p, acc[0]);
            _mm256_storeu_ps(p.add(8), acc[1]);
        }
        if !full {
            for (r, row) in tmp.iter().enumerate() {
                std::ptr::copy_nonoverlapping(row.as_ptr(), t.pc.add(r * t.ldc), t.cols);
            }
        }
    }

    /// `C[i, j] += Σ_kk a[i·lda + kk] · b[j·ldb + kk]` (see `simd::matmul_nt_acc`): tiles of up to
    /// 4 rows of A against 2 rows of B, 8-wide partial sums over k reduced at the end, B in panels
    /// of 128 rows re-read from L2 by every tile. The last 1–3 rows take one tile together, so B
    /// is widened once for them (GQA decode: SmolLM2's 3 query heads per KV head; one row at a
    /// time, 0.75–0.92 → 0.37–0.53 ms per layer at 4096 positions in `examples/gqa_decode_speed`,
    /// warm caches).
    ///
    /// # Safety
    /// AVX2, FMA and F16C; extents checked by the caller.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn matmul_nt_acc256<B: Elem>(
        c: &mut [f32],
        ldc: usize,
        a: &[f32],
        lda: usize,
        b: &[B],
        ldb: usize,
        m: usize,
        k: usize,
        n: usize,
    ) {
        if B::F16 {
            nt::<true>(c, ldc, a, lda, b.as_ptr() as *const u8, ldb, m, k, n)
        } else {
            nt::<false>(c, ldc, a, lda, b.as_ptr() as *const u8, ldb, m, k, n)
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn nt<const F16: bool>(
        c: &mut [f32],
        ldc: usize,
        a: &[f32],
        lda: usize,
        pb: *const u8,
        ldb: usize,
        m: usize,
        k: usize,
        n: usize,
    ) {
        const NB: usize = 128;
        let (pc, pa) = (c.as_mut_ptr(), a.as_ptr());
        let mut p0 = 0;
        while p0 < n {
            let nb = NB.min(n - p0);
            let mut i0 = 0;
            while i0 < m {
                let rows = (m - i0).min(4);
                let mut j0 = p0;
                while j0 < p0 + nb {
                    let cols = (p0 + nb - j0).min(2);
                    macro_rules! tile {
                        ($r:literal, $c:literal) => {{
                            let mut acc = [[_mm256_setzero_ps(); $c]; $r];
                            let mut kk = 0;
                            while kk < k {
                                let left = k - kk;
                                let bv: [__m256; $c] =
                                    std::array::from_fn(|q| load8::<F16>(pb, (j0 + q) * ldb + kk, left));
                                for r in 0..$r {
                                    let av = load8::<false>(pa as *const u8, (i0 + r) * lda + kk, left);
                                    for q in 0..$c {
                                        acc[r][q] = _mm256_fmadd_ps(av, bv[q], acc[r][q]);
                                    }
                                }
                                kk += 8;
                            }
                            for r in 0..$r {
                                for q in 0..$c {
                                    *pc.add((i0 + r) * ldc + j0 + q) += hsum(acc[r][q]);
                                }
                            }
                        }};
                    }
                    match (rows, cols) {
                        (4, 2) => tile!(4, 2),
                        (4, _) => tile!(4, 1),
                        (3, 2) => tile!(3, 2),
                        (3, _) => tile!(3, 1),
                        (2, 2) => tile!(2, 2),
                        (2, _) => tile!(2, 1),
                        (_, 2) => tile!(1, 2),
                        _ => tile!(1, 1),
                    }
                    j0 += cols;
                }
                i0 += rows;
            }
            p0 += nb;
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use crate::testing::Rng;

        /// The F16C conversions called directly (on AVX-512 CPUs the dispatch takes the 512-bit
        /// ones), against `half` on odd lengths, ties, subnormals, overflow and infinity.
        #[test]
        fn avx2_f16_conversions_match_half() {
            if !(crate::qgemm::Isa::Avx2.supported() && is_x86_feature_detected!("f16c")) {
                return;
            }
            let mut rng = Rng::new(37);
            let mut v = rng.normals(77, 3.0);
            v.extend([65520.0, 1e-8, -0.0, 6.1e-5, 2049.0, 2051.0, f32::INFINITY, -70000.0, 3e-7]);
            let want: Vec<u16> = v.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect();
            let mut bits = vec![0u16; v.len()];
            unsafe { f32_to_f16_256(&mut bits, &v) };
            assert_eq!(bits, want);
            let mut back = vec![0f32; v.len()];
            unsafe { f16_to_f32_256(&mut back, &bits) };
            let exact: Vec<u32> = want.iter().map(|&h| half::f16::from_bits(h).to_f32().to_bits()).collect();
            assert_eq!(back.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), exact);
            unsafe { round_f16_256(&mut v) };
            assert_eq!(v.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), exact);
        }

        #[test]
        fn avx2_products_match_the_loops() {
            if !(crate::qgemm::Isa::Avx2.supported() && is_x86_feature_detected!("f16c")) {
                return; // the plain loops are what this CPU runs; simd's own tests cover them
            }
            let mut rng = Rng::new(31);
            let close = |g: f32, w: f32, k: usize| (g - w).abs() <= 1e-5 * (1.0 + w.abs()) * (k as f32).sqrt();
            let halves = |x: &[f32]| x.iter().map(|&v| half::f16::from_f32(v).to_bits()).collect::<Vec<u16>>();
            let widen = |x: &[u16]| x.iter().map(|&h| half::f16::from_bits(h).to_f32()).collect::<Vec<f32>>();
            // B in f32 and in f16 bits holding the same values: the two must give the same
            // products, bit for bit, and agree with the loops' `want`.
            let check = |name: &str, want: &[f32], c0: &[f32], k: usize, run: &dyn Fn(&mut [f32], bool)| {
                let (mut g32, mut g16) = (c0.to_vec(), c0.to_vec());
                run(&mut g32, false);
                run(&mut g16, true);
                assert_eq!(g32, g16, "{name}: f16 B gives other products than the widened B");
                for (i, (g, w)) in g32.iter().zip(want).enumerate() {
                    assert!(close(*g, *w, k), "{name} {i}: {g} vs {w}");
                }
                g32
            };
            for &(m, k, n) in &[(1, 1, 1), (3, 5, 17), (7, 33, 70), (13, 300, 37), (6, 8, 16), (64, 64, 128)] {
                let (lda, ldb, ldc) = (k + 3, n + 5, n + 2);
                let a = rng.normals(m * lda, 1.0);
                let c0 = rng.normals(m * ldc, 1.0);
                // A·B with B [k, n] (stride ldb).
                let b = widen(&halves(&rng.normals(k * ldb, 1.0)));
                let bh = halves(&b);
                let mut want = c0.clone();
                crate::ops::matmul_acc_ref(&mut want, ldc, &a, lda, &b, ldb, m, k, n);
                let got = check(&format!("acc [{m}x{k}x{n}]"), &want, &c0, k, &|c, f16| unsafe {
                    if f16 {
                        matmul_acc256(c, ldc, &a, lda, &bh, ldb, m, k, n)
                    } else {
                        matmul_acc256(c, ldc, &a, lda, &b, ldb, m, k, n)
                    }
                });
                for (i, g) in got.iter().enumerate().filter(|(i, _)| i % ldc >= n) {
                    assert_eq!(g, &c0[i], "acc [{m}x{k}x{n}]: padding element {i} touched");
                }
                // A·Bᵀ with B [n, k] (stride k + 1).
                let ldbt = k + 1;
                let bt = widen(&halves(&rng.normals(n * ldbt, 1.0)));
                let bth = halves(&bt);
                let mut want = c0.clone();
                crate::ops::matmul_nt_acc_ref(&mut want, ldc, &a, lda, &bt, ldbt, m, k, n);
                check(&format!("nt [{m}x{k}x{n}]"), &want, &c0, k, &|c, f16| unsafe {
                    if f16 {
                        matmul_nt_acc256(c, ldc, &a, lda, &bth, ldbt, m, k, n)
                    } else {
                        matmul_nt_acc256(c, ldc, &a, lda, &bt, ldbt, m, k, n)
                    }
                });
            }
        }
    }
}
