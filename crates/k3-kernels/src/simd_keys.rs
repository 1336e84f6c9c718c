//! `C += A · Bᵀ` for a few rows of A against many rows of B, the shape of a decode step's scores:
//! the G ≤ 3 query heads that share a KV head against its cached keys (SmolLM2: G = 3, keys of 64).
//! [`crate::simd::matmul_nt_acc`]'s tiles reduce each (row, key) accumulator horizontally, about
//! as many instructions as a 64-wide key's multiply-adds; here each row keeps eight keys'
//! accumulators and one transposing tree sums all eight into one vector of eight scores
//! (~3.4 instructions a key instead of ~10). The same products, summed in another order.
//! Also the general A·Bᵀ tiles ([`matmul_nt_acc512`]), which hand such few-row products here.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// The operands: C [R, n] and A [R, k] at their first row, B [n, k] (f32, or f16 bits) at its
/// first key; strides in elements; k the shared dimension.
#[derive(Clone, Copy)]
pub struct Keys {
    pub pc: *mut f32,
    pub ldc: usize,
    pub pa: *const f32,
    pub lda: usize,
    pub pb: *const u8,
    pub ldb: usize,
    pub k: usize,
}

/// Rows of A this form takes (more would spill the 8·R accumulators out of the 32 registers).
pub const MAX_ROWS: usize = 3;

/// `C[r, j] += Σ_kk A[r, kk] · B[j, kk]` for r < R (R ≤ [`MAX_ROWS`]), j < n; B in f32 or f16 bits
/// (`F16`) at `pb`, row stride `ldb` elements.
///
/// # Safety
/// AVX-512 F/BW/VL and F16C must be present; A ([R, k], stride `lda`), B ([n, k], stride `ldb`)
/// and C ([R, n], stride `ldc`) must lie within their allocations.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
pub unsafe fn nt_few_rows<const R: usize, const F16: bool>(ops: Keys, n: usize) {
    let Keys { pc, ldc, pb, ldb, .. } = ops;
    let pf = CACHE_PREFETCH.on();
    let mut j0 = 0;
    while j0 < n {
        // Up to eight keys a tile; the missing keys' lanes are zero and not stored.
        let keys = (n - j0).min(8);
        let at = Keys { pb: pb.add(j0 * ldb * if F16 { 2 } else { 4 }), ..ops };
        let sums = scores8_n::<R, F16>(at, pf, keys);
        let store: __mmask8 = ((1u32 << keys) - 1) as u8;
        for (r, sums) in sums.iter().enumerate() {
            let p = pc.add(r * ldc + j0);
            _mm256_mask_storeu_ps(p, store, _mm256_add_ps(_mm256_maskz_loadu_ps(store, p), *sums));
        }
        j0 += keys;
    }
}

/// [`scores8`] for n ≤ 8 keys known only at run time (lanes n.. zero).
///
/// # Safety
/// As [`nt_few_rows`], for R rows of A and n keys (`pc`, `ldc` unused).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn scores8_n<const R: usize, const F16: bool>(at: Keys, pf: bool, n: usize) -> [__m256; R] {
    match n {
        8.. => scores8::<R, F16, 8>(at, pf),
        7 => scores8::<R, F16, 7>(at, pf),
        6 => scores8::<R, F16, 6>(at, pf),
        5 => scores8::<R, F16, 5>(at, pf),
        4 => scores8::<R, F16, 4>(at, pf),
        3 => scores8::<R, F16, 3>(at, pf),
        2 => scores8::<R, F16, 2>(at, pf),
        1 => scores8::<R, F16, 1>(at, pf),
        0 => [_mm256_setzero_ps(); R],
    }
}

/// R rows of A against keys 0..N (N ≤ 8): lane j of row r's vector is A[r] · B[j] (lanes N..
/// zero), each row's eight accumulators summed by one transposing tree ([`sum8`]), the keys
/// prefetched ahead when `pf` ([`CACHE_PREFETCH`]).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn scores8<const R: usize, const F16: bool, const N: usize>(at: Keys, pf: bool) -> [__m256; R] {
    let Keys { pa, lda, pb, ldb, k, .. } = at;
    let mut acc = [[_mm512_setzero_ps(); 8]; R];
    let mut kk = 0;
    while kk < k {
        let mk = ((1u32 << (k - kk).min(16)) - 1) as __mmask16;
        let av: [__m512; R] = std::array::from_fn(|r| crate::simd::x86::load_ps(mk, pa.add(r * lda + kk)));
        for q in 0..N {
            prefetch_key::<F16>(pf, pb, (q + AHEAD_KEYS) * ldb + kk, kk);
            let bv = crate::simd::x86::load_b::<F16>(pb, q * ldb + kk, mk);
            for r in 0..R {
                acc[r][q] = _mm512_fmadd_ps(av[r], bv, acc[r][q]);
            }
        }
        kk += 16;
    }
    std::array::from_fn(|r| sum8(&acc[r]))
}

/// Keys ahead of the ones being multiplied whose rows the tiles prefetch into L1. A decode
/// step's keys (an MLA layer's latent cache, a GQA layer's keys) come from L3 or memory: the
/// weights read since the layer last ran have evicted them. With only the cores' own
/// prefetchers the tiles waited on each new key row (perf put most of the scores' samples on
/// the key loads). `examples/mla_attend_speed 1 cold`, f16 cache (Zen 4, twenty-seventh
/// session, alternating runs): 512 keys 0.095 → 0.070 ms, 4096 0.716 → 0.515, 32768
/// 5.6–5.8 → 4.1 (the block form's whole step, values included); 4, 16 and 32 keys ahead
/// measured the same as 8, and a second prefetch into L2 further ahead gained nothing on f16.
#[cfg(target_arch = "x86_64")]
const AHEAD_KEYS: usize = 8;

/// Whether the attention kernels prefetch a decode step's cache: the score tiles their keys
/// ([`AHEAD_KEYS`]), GQA's runs the next run's keys and their values
/// (`attention::split::gqa_decode_split`); `K3MINI_CACHE_PREFETCH=0` turns it off.
static CACHE_PREFETCH: crate::switch::Switch = crate::switch::Switch::new("K3MINI_CACHE_PREFETCH", "0");

/// Set [`CACHE_PREFETCH`] for the rest of the process (in-process A/B measurements).
pub fn set_cache_prefetch(on: bool) {
    CACHE_PREFETCH.set(on);
}

pub(crate) fn cache_prefetch() -> bool {
    CACHE_PREFETCH.on()
}

/// When `on`, the line of B holding element `idx` on its way into L1, once per 64 bytes a row
/// walks (an f16 row's 16-value step `kk` is 32 bytes, so every other step).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch_key<const F16: bool>(on: bool, pb: *const u8, idx: usize, kk: usize) {
    if on && (!F16 || kk.is_multiple_of(32)) {
        _mm_prefetch::<_MM_HINT_T0>(pb.wrapping_add(if F16 { 2 * idx } else { 4 * idx }) as *const i8);
    }
}

/// Lane i of the result = the sum of the 16 lanes of `v[i]`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn sum8(v: &[__m512; 8]) -> __m256 {
    // Blocks (128 bits) of x and y → (x0 + x2, x1 + x3, y0 + y2, y1 + y3).
    let halve =
        |x: __m512, y: __m512| _mm512_add_ps(_mm512_shuffle_f32x4::<0x44>(x, y), _mm512_shuffle_f32x4::<0xEE>(x, y));
    // Two of those → block i holds four partial sums of key i of four keys.
    let quarter =
        |s: __m512, t: __m512| _mm512_add_ps(_mm512_shuffle_f32x4::<0x88>(s, t), _mm512_shuffle_f32x4::<0xDD>(s, t));
    let lo = quarter(halve(v[0], v[1]), halve(v[2], v[3])); // keys 0..4, one per block
    let hi = quarter(halve(v[4], v[5]), halve(v[6], v[7])); // keys 4..8
                                                            // Within each block i: (key i: p0 + p2, p1 + p3, key 4 + i: p0 + p2, p1 + p3), then adjacent
                                                            // lanes added: (key i, key i, key 4 + i, key 4 + i).
    let pairs = _mm512_add_ps(_mm512_shuffle_ps::<0x44>(lo, hi), _mm512_shuffle_ps::<0xEE>(lo, hi));
    let whole = _mm512_add_ps(pairs, _mm512_permute_ps::<0xB1>(pairs));
    let order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_castps512_ps256(_mm512_permutexvar_ps(order, whole))
}

/// See [`crate::simd::matmul_nt_acc`].
///
/// # Safety
/// AVX-512 F/BW/VL and F16C must be present; the caller has checked the operands' extents.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
pub(crate) unsafe fn matmul_nt_acc512<B: crate::simd::Elem>(
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
    let pb = b.as_ptr() as *const u8;
    // A decode step's few query heads per KV head: eight keys per tile, reduced together.
    let ops = Keys { pc: c.as_mut_ptr(), ldc, pa: a.as_ptr(), lda, pb, ldb, k };
    match (m, B::F16) {
        (1, false) => return nt_few_rows::<1, false>(ops, n),
        (2, false) => return nt_few_rows::<2, false>(ops, n),
        (3, false) => return nt_few_rows::<3, false>(ops, n),
        (1, true) => return nt_few_rows::<1, true>(ops, n),
        (2, true) => return nt_few_rows::<2, true>(ops, n),
        (3, true) => return nt_few_rows::<3, true>(ops, n),
        _ => {}
    }
    if B::F16 {
        nt_acc512::<true>(c, ldc, a, lda, pb, ldb, m, k, n)
    } else {
        nt_acc512::<false>(c, ldc, a, lda, pb, ldb, m, k, n)
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
unsafe fn nt_acc512<const F16: bool>(
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
    // B in panels of NB rows, each pulled from memory once and re-read from L2 by every
    // 8-row tile of A (a long B, e.g. a 32K-row attention cache, would otherwise be streamed
    // once per tile).
    const NB: usize = 128;
    let mut p0 = 0;
    while p0 < n {
        let nb = NB.min(n - p0);
        nt_panel512::<F16>(&mut c[p0..], ldc, a, lda, pb.add(p0 * ldb * if F16 { 2 } else { 4 }), ldb, m, k, nb);
        p0 += nb;
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
unsafe fn nt_panel512<const F16: bool>(
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
    let (pc, pa) = (c.as_mut_ptr(), a.as_ptr());
    let pf = CACHE_PREFETCH.on();
    let mut i0 = 0;
    while i0 < m {
        let rows = (m - i0).min(8);
        let mut j0 = 0;
        while j0 < n {
            let cols = (n - j0).min(2);
            macro_rules! tile {
                ($r:literal, $c:literal) => {{
                    let mut acc = [[_mm512_setzero_ps(); $c]; $r];
                    let mut kk = 0;
                    while kk < k {
                        let left = (k - kk).min(16);
                        let mk: __mmask16 = ((1u32 << left) - 1) as u16;
                        let bv: [__m512; $c] = std::array::from_fn(|q| {
                            prefetch_key::<F16>(pf, pb, (j0 + q + AHEAD_KEYS) * ldb + kk, kk);
                            crate::simd::x86::load_b::<F16>(pb, (j0 + q) * ldb + kk, mk)
                        });
                        for r in 0..$r {
                            let av = crate::simd::x86::load_ps(mk, pa.add((i0 + r) * lda + kk));
                            for q in 0..$c {
                                acc[r][q] = _mm512_fmadd_ps(av, bv[q], acc[r][q]);
                            }
                        }
                        kk += 16;
                    }
                    for r in 0..$r {
                        for q in 0..$c {
                            *pc.add((i0 + r) * ldc + j0 + q) += _mm512_reduce_add_ps(acc[r][q]);
                        }
                    }
                }};
            }
            match (rows, cols) {
                (8, 2) => tile!(8, 2),
                (8, _) => tile!(8, 1),
                (4..=7, 2) => tile!(4, 2),
                (4..=7, _) => tile!(4, 1),
                (3, 2) => tile!(3, 2),
                (3, _) => tile!(3, 1),
                (2, 2) => tile!(2, 2),
                (2, _) => tile!(2, 1),
                (_, 2) => tile!(1, 2),
                _ => tile!(1, 1),
            }
            j0 += cols;
        }
        // Tiles of 2 and 3 rows: a decode step's G query heads per KV head (SmolLM2: 3)
        // share each key's load and f16 widening.
        i0 += match rows {
            8 => 8,
            4..=7 => 4,
            r => r,
        };
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use crate::testing::Rng;

    /// Against the plain loops, every row count, tails of 1–7 keys, keys not a multiple of 16,
    /// f32 and f16 keys (f16: the same sums as on the widened keys, bit for bit).
    #[test]
    fn few_rows_match_the_loops() {
        if !crate::qgemm::Isa::Avx512.supported() {
            eprintln!("skipped: no AVX-512");
            return;
        }
        let mut rng = Rng::new(5);
        for &(m, k, n) in &[(1, 64, 8), (2, 64, 37), (3, 64, 100), (3, 5, 17), (1, 20, 3), (2, 130, 15), (3, 128, 64)] {
            let (lda, ldb, ldc) = (k + 3, k + 5, n + 2);
            let a = rng.normals(m * lda, 1.0);
            let b = rng.normals(n * ldb, 1.0);
            let c0 = rng.normals(m * ldc, 1.0);
            let bh: Vec<u16> = b.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect();
            let bw: Vec<f32> = bh.iter().map(|&h| half::f16::from_bits(h).to_f32()).collect();
            let (mut want, mut got, mut got_h, mut got_w) = (c0.clone(), c0.clone(), c0.clone(), c0.clone());
            crate::ops::matmul_nt_acc_ref(&mut want, ldc, &a, lda, &b, ldb, m, k, n);
            // SAFETY: AVX-512 present (checked); the operands hold [m, k], [n, k], [m, n] at their strides.
            unsafe {
                let ops = |c: &mut [f32], pb: *const u8| super::Keys {
                    pc: c.as_mut_ptr(),
                    ldc,
                    pa: a.as_ptr(),
                    lda,
                    pb,
                    ldb,
                    k,
                };
                let run = |c: &mut [f32], pb: *const u8, f16: bool| match (m, f16) {
                    (1, false) => super::nt_few_rows::<1, false>(ops(c, pb), n),
                    (2, false) => super::nt_few_rows::<2, false>(ops(c, pb), n),
                    (_, false) => super::nt_few_rows::<3, false>(ops(c, pb), n),
                    (1, true) => super::nt_few_rows::<1, true>(ops(c, pb), n),
                    (2, true) => super::nt_few_rows::<2, true>(ops(c, pb), n),
                    (_, true) => super::nt_few_rows::<3, true>(ops(c, pb), n),
                };
                run(&mut got, b.as_ptr() as *const u8, false);
                run(&mut got_h, bh.as_ptr() as *const u8, true);
                run(&mut got_w, bw.as_ptr() as *const u8, false);
            }
            for r in 0..m {
                for j in 0..ldc {
                    let i = r * ldc + j;
                    if j >= n {
                        assert_eq!(got[i].to_bits(), c0[i].to_bits(), "[{m}x{k}x{n}] padding ({r},{j}) touched");
                        continue;
                    }
                    let tol = 1e-5 * (k as f32).sqrt() * (1.0 + want[i].abs());
                    assert!((got[i] - want[i]).abs() <= tol, "[{m}x{k}x{n}] ({r},{j}): {} vs {}", got[i], want[i]);
                }
            }
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got_h), bits(&got_w), "f16 keys [{m}x{k}x{n}]");
        }
    }
}
