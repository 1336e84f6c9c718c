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
            if isa >= crate::qgemm::Isa::Avx512 {
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

/// `C[m×n] += A[m×k] · B[k×n]`, all row-major and contiguous (the chunked KDA's state products).
pub fn matmul_acc(c: &mut [f32], a: &[f32], b: &[f32], m: usize, k: usize, n: usize) {
    matmul_acc_strided(c, n, a, k, b, n, m, k, n)
}

/// The B operand's element in [`matmul_acc_strided`] / [`matmul_nt_acc`]: f32, or f16 bits (an
/// f16 attention cache's rows), widened in registers as it is loaded, so the products are the
/// same, in the same order, as on the widened B.
pub trait Elem: Copy {
    const F16: bool;
    /// The values as f32 (the fallback paths' operand).
    fn widened(x: &[Self]) -> std::borrow::Cow<'_, [f32]>;
}

impl Elem for f32 {
    const F16: bool = false;
    fn widened(x: &[f32]) -> std::borrow::Cow<'_, [f32]> {
        std::borrow::Cow::Borrowed(x)
    }
}

impl Elem for u16 {
    const F16: bool = true;
    fn widened(x: &[u16]) -> std::borrow::Cow<'_, [f32]> {
        let mut wide = vec![0f32; x.len()];
        f16_to_f32(&mut wide, x);
        std::borrow::Cow::Owned(wide)
    }
}

/// [`matmul_acc`] with row strides: `C[i, j] (= c[i·ldc + j]) += Σ_kk a[i·lda + kk] · b[kk·ldb + j]`,
/// B in f32 or f16 bits ([`Elem`]).
/// AVX-512: tiles of 8 rows × 32 columns held in registers across k, so B is streamed once per
/// 8 rows of A; AVX2: 6 × 16 tiles ([`crate::simd_avx2`]); else the plain loops.
#[allow(clippy::too_many_arguments)]
pub fn matmul_acc_strided<B: Elem>(
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
    check("matmul_acc", c, ldc, m, n);
    check("matmul_acc A", a, lda, m, k);
    check("matmul_acc B", b, ldb, k, n);
    #[cfg(target_arch = "x86_64")]
    if crate::qgemm::Isa::best() >= crate::qgemm::Isa::Avx512 {
        // SAFETY: AVX-512F/BW/VL and F16C are present (Isa::best checks them); extents checked above.
        unsafe { x86::matmul_acc512(c, ldc, a, lda, b, ldb, m, k, n) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if avx2_f32() {
        // SAFETY: AVX2, FMA and F16C are present (avx2_f32); extents checked above.
        unsafe { crate::simd_avx2::matmul_acc256(c, ldc, a, lda, b, ldb, m, k, n) };
        return;
    }
    crate::ops::matmul_acc_ref(c, ldc, a, lda, &B::widened(&b[..extent(ldb, k, n)]), ldb, m, k, n)
}

/// `C[i, j] (= c[i·ldc + j]) += Σ_kk a[i·lda + kk] · b[j·ldb + kk]`: A times B transposed, B's rows
/// being the other operand's rows (attention scores against cache rows), in f32 or f16 bits
/// ([`Elem`]). AVX-512: 8 rows of A against 2 rows of B per tile, so B is streamed once per 8
/// rows of A; else the plain loops.
#[allow(clippy::too_many_arguments)]
pub fn matmul_nt_acc<B: Elem>(
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
    check("matmul_nt_acc", c, ldc, m, n);
    check("matmul_nt_acc A", a, lda, m, k);
    check("matmul_nt_acc B", b, ldb, n, k);
    #[cfg(target_arch = "x86_64")]
    if crate::qgemm::Isa::best() >= crate::qgemm::Isa::Avx512 {
        // SAFETY: as in `matmul_acc_strided`.
        unsafe { crate::simd_keys::matmul_nt_acc512(c, ldc, a, lda, b, ldb, m, k, n) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if avx2_f32() {
        // SAFETY: as in `matmul_acc_strided`.
        unsafe { crate::simd_avx2::matmul_nt_acc256(c, ldc, a, lda, b, ldb, m, k, n) };
        return;
    }
    crate::ops::matmul_nt_acc_ref(c, ldc, a, lda, &B::widened(&b[..extent(ldb, n, k)]), ldb, m, k, n)
}

/// Whether the f32 products take their AVX2 forms ([`crate::simd_avx2`]): the chosen ISA is AVX2
/// (no AVX-512, or `K3MINI_ISA=avx2`) and the CPU converts f16 (F16C).
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx2_f32() -> bool {
    crate::qgemm::Isa::best() >= crate::qgemm::Isa::Avx2 && is_x86_feature_detected!("f16c")
}

/// The lines of `x` on their way into L2 (a hint: nothing else changes; no-op off x86-64).
pub fn prefetch_l2<T>(x: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        let (p, bytes) = (x.as_ptr() as *const u8, std::mem::size_of_val(x));
        for off in (0..bytes).step_by(64) {
            // SAFETY: none needed: a prefetch never faults, and these addresses lie within x.
            unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(p.add(off) as *const i8) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

/// Values a strided [rows × cols] operand spans.
fn extent(ld: usize, rows: usize, cols: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * ld + cols
    }
}

/// A strided [rows × cols] operand must fit its slice.
fn check<T>(what: &str, x: &[T], ld: usize, rows: usize, cols: usize) {
    assert!(cols <= ld || rows <= 1, "{what}: {cols} columns exceed the stride {ld}");
    assert!(x.len() >= extent(ld, rows, cols), "{what}: operand too short");
}

/// Round every value to the nearest f16 (ties to even), in place: F16C 16 at a time when the
/// CPU has AVX-512, 8 at a time with AVX2 (and F16C), else `half`'s conversion.
pub fn round_f16_inplace(v: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::qgemm::Isa::best() >= crate::qgemm::Isa::Avx512 {
        // SAFETY: AVX-512F and F16C are present (Isa::best checks both).
        unsafe { x86::round_f16_512(v) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if avx2_f32() {
        // SAFETY: AVX2 and F16C are present (avx2_f32 checks both).
        unsafe { crate::simd_avx2::round_f16_256(v) };
        return;
    }
    v.iter_mut().for_each(|x| *x = half::f16::from_f32(*x).to_f32());
}

/// f32 → f16 bits (round to nearest, ties to even), `dst[i] = f16(src[i])`: F16C 16 at a time
/// when the CPU has AVX-512, 8 with AVX2, else `half`'s conversion. The attention caches' store.
pub fn f32_to_f16(dst: &mut [u16], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "f32_to_f16: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if crate::qgemm::Isa::best() >= crate::qgemm::Isa::Avx512 {
        // SAFETY: AVX-512F and F16C are present (Isa::best checks both); lengths are equal.
        unsafe { x86::f32_to_f16_512(dst, src) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if avx2_f32() {
        // SAFETY: AVX2 and F16C are present (avx2_f32 checks both); lengths are equal.
        unsafe { crate::simd_avx2::f32_to_f16_256(dst, src) };
        return;
    }
    dst.iter_mut().zip(src).for_each(|(d, &x)| *d = half::f16::from_f32(x).to_bits());
}

/// f16 bits → f32 (exact), `dst[i] = src[i]` widened: F16C 16 at a time when the CPU has
/// AVX-512, 8 with AVX2, else `half`'s conversion. The attention caches' load.
pub fn f16_to_f32(dst: &mut [f32], src: &[u16]) {
    assert_eq!(dst.len(), src.len(), "f16_to_f32: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if crate::qgemm::Isa::best() >= crate::qgemm::Isa::Avx512 {
        // SAFETY: as in `f32_to_f16`.
        unsafe { x86::f16_to_f32_512(dst, src) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if avx2_f32() {
        // SAFETY: as above.
        unsafe { crate::simd_avx2::f16_to_f32_256(dst, src) };
        return;
    }
    dst.iter_mut().zip(src).for_each(|(d, &h)| *d = half::f16::from_bits(h).to_f32());
}

/// XOR of every word: the memory-bandwidth probe's read loop (benchmarks divide bytes by its
/// time). AVX-512: four independent 64-byte accumulators and a software prefetch 2 KiB ahead,
/// so the probe streams as fast as the prefetching GEMV it is the bound for; else the plain fold.
pub fn xor_fold(words: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if crate::qgemm::Isa::best() >= crate::qgemm::Isa::Avx512 {
        // SAFETY: AVX-512F is present (Isa::best checks it).
        return unsafe { x86::xor_fold512(words) };
    }
    xor_fold_ref(words)
}

/// [`xor_fold`]'s reference: one word at a time.
pub fn xor_fold_ref(words: &[u64]) -> u64 {
    words.iter().fold(0, |a, &b| a ^ b)
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub unsafe fn xor_fold512(words: &[u64]) -> u64 {
        const STEP: usize = 32; // words per iteration: four 64-byte lines
        const AHEAD: usize = 256; // words (2 KiB) prefetched ahead
        let p = words.as_ptr();
        let mut acc = [_mm512_setzero_si512(); 4];
        let mut i = 0;
        while i + STEP <= words.len() {
            if i + AHEAD + STEP <= words.len() {
                for l in 0..4 {
                    _mm_prefetch::<_MM_HINT_T0>(p.add(i + AHEAD + 8 * l) as *const i8);
                }
            }
            for (l, a) in acc.iter_mut().enumerate() {
                *a = _mm512_xor_si512(*a, _mm512_loadu_si512(p.add(i + 8 * l) as *const _));
            }
            i += STEP;
        }
        let all = _mm512_xor_si512(_mm512_xor_si512(acc[0], acc[1]), _mm512_xor_si512(acc[2], acc[3]));
        let mut lanes = [0u64; 8];
        _mm512_storeu_si512(lanes.as_mut_ptr() as *mut _, all);
        lanes.iter().fold(super::xor_fold_ref(&words[i..]), |a, &b| a ^ b)
    }

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

    /// 16 values of B at element `idx` (lanes outside `mask` zero): f32, or f16 bits widened.
    /// A whole step takes a plain load, as A's rows do in the score products ([`load_ps`]). On
    /// the Zen 4 host the zero-masked loads held MLA's decode scores back (8 heads against f16
    /// latent rows, in L1/L2, `examples/mla_products_speed`): 39 GMAC/s masked, 43 with the f16
    /// rows alone plain, 48 with A's f32 rows plain too (A's alone: no gain). The branch follows
    /// the loop's steps, so it predicts.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    pub(crate) unsafe fn load_b<const F16: bool>(pb: *const u8, idx: usize, mask: __mmask16) -> __m512 {
        match (mask, F16) {
            (0xFFFF, true) => _mm512_cvtph_ps(_mm256_loadu_si256(pb.add(2 * idx) as *const __m256i)),
            (0xFFFF, false) => _mm512_loadu_ps(pb.add(4 * idx) as *const f32),
            _ => load_b_masked::<F16>(pb, idx, mask),
        }
    }

    /// [`load_b`] with a masked load always, whole mask or not: the values product's B
    /// ([`tile512`]). With plain loads there, GQA's unfused decode step, whose values rows come
    /// from L2/L3 into that product, ran 10–20% slower cold on the Zen 4 host (perf put the loss
    /// in this product), while the values of MLA's decode tile, whose rows the scores have just
    /// read, gained only 2%.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    pub(crate) unsafe fn load_b_masked<const F16: bool>(pb: *const u8, idx: usize, mask: __mmask16) -> __m512 {
        if F16 {
            _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, pb.add(2 * idx) as *const i16))
        } else {
            _mm512_maskz_loadu_ps(mask, pb.add(4 * idx) as *const f32)
        }
    }

    /// 16 f32 at `p`, lanes outside `mask` zero; a whole mask takes a plain load, as in
    /// [`load_b`].
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn load_ps(mask: __mmask16, p: *const f32) -> __m512 {
        if mask == 0xFFFF {
            _mm512_loadu_ps(p)
        } else {
            _mm512_maskz_loadu_ps(mask, p)
        }
    }

    /// See [`super::matmul_acc_strided`]. Extents are checked by the caller.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    pub unsafe fn matmul_acc512<B: super::Elem>(
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
        if B::F16 {
            acc512::<true>(c, ldc, a, lda, pb, ldb, m, k, n)
        } else {
            acc512::<false>(c, ldc, a, lda, pb, ldb, m, k, n)
        }
    }

    /// B (f32, or f16 bits with `F16`) at `pb`, element strides.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    unsafe fn acc512<const F16: bool>(
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
        // k in panels of KC rows of B, so that a panel is pulled from memory once and re-read
        // from L2 by every 32-column block (a long B, e.g. a 32K-row attention cache, would
        // otherwise be streamed once per column block).
        const KC: usize = 256;
        // B's packed column block (see `panel512`), allocated once for every panel.
        let mut buf = if m > 8 { vec![0f32; KC.min(k) * 32] } else { Vec::new() };
        let mut k0 = 0;
        while k0 < k {
            let kc = KC.min(k - k0);
            let b0 = pb.add(k0 * ldb * if F16 { 2 } else { 4 });
            panel512::<F16>(c, ldc, &a[k0..], lda, b0, ldb, m, kc, n, &mut buf);
            k0 += kc;
        }
    }

    /// One k-panel (k ≤ KC) of [`acc512`]: 32-column blocks of B, each against every 8-row tile
    /// of A. With more than one row tile the block is first copied, widened, into a contiguous
    /// [k, 32] buffer (`buf`, then at least k·32 values), so the tiles read B at a 128-byte
    /// stride instead of `ldb` (a power-of-two stride such as a 4096-key cache's maps every row
    /// of the block onto the same few L1 sets: the long-prefill scores ran at ~15 GMAC/s,
    /// examples/matmul_acc_speed.rs).
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    unsafe fn panel512<const F16: bool>(
        c: &mut [f32],
        ldc: usize,
        a: &[f32],
        lda: usize,
        pb: *const u8,
        ldb: usize,
        m: usize,
        k: usize,
        n: usize,
        buf: &mut [f32],
    ) {
        let (pc, pa) = (c.as_mut_ptr(), a.as_ptr());
        let pack = m > 8;
        let mut j0 = 0;
        while j0 < n {
            let mask: [__mmask16; 2] = std::array::from_fn(|q| {
                let left = n.saturating_sub(j0 + 16 * q).min(16);
                ((1u32 << left) - 1) as u16
            });
            if pack {
                for kk in 0..k {
                    for q in 0..2 {
                        let v = load_b::<F16>(pb, kk * ldb + j0 + 16 * q, mask[q]);
                        _mm512_storeu_ps(buf.as_mut_ptr().add(kk * 32 + 16 * q), v);
                    }
                }
            }
            let mut i0 = 0;
            while i0 < m {
                let at = Tile { pc: pc.add(i0 * ldc + j0), ldc, pa: pa.add(i0 * lda), lda, k, mask };
                macro_rules! tile {
                    ($r:literal) => {
                        if pack {
                            tile512::<$r, false>(at, buf.as_ptr() as *const u8, 32)
                        } else {
                            tile512::<$r, F16>(at, pb.add(j0 * if F16 { 2 } else { 4 }), ldb)
                        }
                    };
                }
                match (m - i0).min(8) {
                    1 => tile!(1),
                    2 => tile!(2),
                    3 => tile!(3),
                    4 => tile!(4),
                    5 => tile!(5),
                    6 => tile!(6),
                    7 => tile!(7),
                    _ => tile!(8),
                }
                i0 += 8;
            }
            j0 += 32;
        }
    }

    /// An R × 32 tile of C (at `pc`, row stride `ldc`; columns outside `mask` untouched) plus
    /// A's R rows (at `pa`, stride `lda`) times k rows of B's 32-column block.
    #[derive(Clone, Copy)]
    struct Tile {
        pc: *mut f32,
        ldc: usize,
        pa: *const f32,
        lda: usize,
        k: usize,
        mask: [__mmask16; 2],
    }

    /// [`Tile`] against B's block at `pb` (f32, or f16 bits with `F16`), row stride `ldb`
    /// elements: the accumulators stay in registers across k.
    #[inline(always)]
    unsafe fn tile512<const R: usize, const F16: bool>(t: Tile, pb: *const u8, ldb: usize) {
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        for (r, acc) in acc.iter_mut().enumerate() {
            for (q, acc) in acc.iter_mut().enumerate() {
                *acc = _mm512_maskz_loadu_ps(t.mask[q], t.pc.add(r * t.ldc + 16 * q));
            }
        }
        for kk in 0..t.k {
            let bv: [__m512; 2] = std::array::from_fn(|q| load_b_masked::<F16>(pb, kk * ldb + 16 * q, t.mask[q]));
            for (r, acc) in acc.iter_mut().enumerate() {
                let av = _mm512_set1_ps(*t.pa.add(r * t.lda + kk));
                acc[0] = _mm512_fmadd_ps(av, bv[0], acc[0]);
                acc[1] = _mm512_fmadd_ps(av, bv[1], acc[1]);
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (q, acc) in acc.iter().enumerate() {
                _mm512_mask_storeu_ps(t.pc.add(r * t.ldc + 16 * q), t.mask[q], *acc);
            }
        }
    }

    /// [`crate::ops::exp_fast`] on 16 lanes (the same clamp, reduction and polynomial, with
    /// fused multiply-adds).
    #[inline]
    #[target_feature(enable = "avx512f,fma")]
    pub(crate) unsafe fn exp16(x: __m512) -> __m512 {
        let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3)), _mm512_set1_ps(88.3));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
            x,
            _mm512_set1_ps(std::f32::consts::LOG2_E),
        ));
        let r =
            _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x));
        let mut p = _mm512_set1_ps(1.987_569_1e-4);
        for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        let y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0));
        let two_n = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
            _mm512_cvtps_epi32(n),
            _mm512_set1_epi32(127),
        )));
        _mm512_mul_ps(y, two_n)
    }

    /// See [`crate::ops::exp_shifted_sum`]: [`exp16`] on 32 values a step, two sums in flight,
    /// the tail under a mask; `scale·x − m` rounded twice, as the plain loop has it.
    #[target_feature(enable = "avx512f,fma")]
    pub unsafe fn exp_shifted_sum512(x: &mut [f32], scale: f32, m: f32) -> f32 {
        let (n, p) = (x.len(), x.as_mut_ptr());
        let (sc, mv) = (_mm512_set1_ps(scale), _mm512_set1_ps(m));
        let mut sums = [_mm512_setzero_ps(); 2];
        let mut i = 0;
        while i + 32 <= n {
            for (k, sum) in sums.iter_mut().enumerate() {
                let e = exp16(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(p.add(i + 16 * k)), sc), mv));
                _mm512_storeu_ps(p.add(i + 16 * k), e);
                *sum = _mm512_add_ps(*sum, e);
            }
            i += 32;
        }
        while i < n {
            let mask = ((1u32 << (n - i).min(16)) - 1) as __mmask16;
            let e = exp16(_mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(mask, p.add(i)), sc), mv));
            _mm512_mask_storeu_ps(p.add(i), mask, e);
            sums[0] = _mm512_add_ps(sums[0], _mm512_maskz_mov_ps(mask, e));
            i += 16;
        }
        _mm512_reduce_add_ps(_mm512_add_ps(sums[0], sums[1]))
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

    #[target_feature(enable = "avx512f,f16c")]
    pub unsafe fn f32_to_f16_512(dst: &mut [u16], src: &[f32]) {
        let n = src.len();
        let (d, s) = (dst.as_mut_ptr(), src.as_ptr());
        let mut i = 0;
        while i + 16 <= n {
            let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_loadu_ps(s.add(i)));
            _mm256_storeu_si256(d.add(i) as *mut __m256i, h);
            i += 16;
        }
        while i < n {
            *d.add(i) = half::f16::from_f32(*s.add(i)).to_bits();
            i += 1;
        }
    }

    #[target_feature(enable = "avx512f,f16c")]
    pub unsafe fn f16_to_f32_512(dst: &mut [f32], src: &[u16]) {
        let n = src.len();
        let (d, s) = (dst.as_mut_ptr(), src.as_ptr());
        let mut i = 0;
        while i + 16 <= n {
            _mm512_storeu_ps(d.add(i), _mm512_cvtph_ps(_mm256_loadu_si256(s.add(i) as *const __m256i)));
            i += 16;
        }
        while i < n {
            *d.add(i) = half::f16::from_bits(*s.add(i)).to_f32();
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
        fn xor_fold_matches_the_reference() {
            let words: Vec<u64> = (0..1000u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).collect();
            for n in [0, 7, 32, 33, 300, 1000] {
                assert_eq!(super::super::xor_fold(&words[..n]), super::super::xor_fold_ref(&words[..n]), "n = {n}");
            }
        }

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
        fn f16_conversions_match_half() {
            let mut rng = Rng::new(9);
            let mut v = rng.normals(83, 3.0);
            v.extend([65520.0, 1e-8, -0.0, 6.1e-5, 2049.0, 2051.0, f32::INFINITY]);
            let want: Vec<u16> = v.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect();
            let mut bits = vec![0u16; v.len()];
            super::super::f32_to_f16(&mut bits, &v);
            assert_eq!(bits, want);
            let mut back = vec![0f32; v.len()];
            super::super::f16_to_f32(&mut back, &bits);
            let exact: Vec<u32> = want.iter().map(|&h| half::f16::from_bits(h).to_f32().to_bits()).collect();
            assert_eq!(back.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), exact);
        }

        #[test]
        fn matmul_acc_matches_the_loops() {
            let mut rng = Rng::new(12);
            let close = |g: f32, w: f32, k: usize| (g - w).abs() <= 1e-5 * (1.0 + w.abs()) * (k as f32).sqrt();
            let halves = |x: &[f32]| x.iter().map(|&v| half::f16::from_f32(v).to_bits()).collect::<Vec<u16>>();
            let widen = |x: &[u16]| x.iter().map(|&h| half::f16::from_bits(h).to_f32()).collect::<Vec<f32>>();
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
            for &(m, k, n) in
                &[(1, 1, 1), (3, 5, 17), (4, 128, 128), (7, 33, 70), (64, 64, 128), (9, 16, 200), (13, 320, 37)]
            {
                let (a, b, c0) = (rng.normals(m * k, 1.0), rng.normals(k * n, 1.0), rng.normals(m * n, 1.0));
                let (mut want, mut got) = (c0.clone(), c0.clone());
                crate::ops::matmul_acc_ref(&mut want, n, &a, k, &b, n, m, k, n);
                super::super::matmul_acc(&mut got, &a, &b, m, k, n);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(close(*g, *w, k), "[{m}x{k}x{n}] {i}: {g} vs {w}");
                }
                // Strides wider than the operands (padding must stay untouched), and A · Bᵀ with B
                // given as [n × k] rows.
                let (lda, ldb, ldbt, ldc) = (k + 3, n + 1, k + 5, n + 2);
                let pad = |x: &[f32], rows: usize, cols: usize, ld: usize| -> Vec<f32> {
                    let mut v = vec![7.0; rows * ld];
                    for r in 0..rows {
                        v[r * ld..r * ld + cols].copy_from_slice(&x[r * cols..(r + 1) * cols]);
                    }
                    v
                };
                let bt: Vec<f32> = (0..n).flat_map(|j| (0..k).map(|kk| b[kk * n + j]).collect::<Vec<_>>()).collect();
                let (ap, bp, btp) = (pad(&a, m, k, lda), pad(&b, k, n, ldb), pad(&bt, n, k, ldbt));
                let (mut s1, mut s2) = (pad(&c0, m, n, ldc), pad(&c0, m, n, ldc));
                super::super::matmul_acc_strided(&mut s1, ldc, &ap, lda, &bp, ldb, m, k, n);
                super::super::matmul_nt_acc(&mut s2, ldc, &ap, lda, &btp, ldbt, m, k, n);
                let mut w2 = pad(&c0, m, n, ldc);
                crate::ops::matmul_nt_acc_ref(&mut w2, ldc, &ap, lda, &btp, ldbt, m, k, n);
                // B in f16: the same products, in the same order, as on the widened B.
                let (bh, bth) = (halves(&bp), halves(&btp));
                let (bw, btw) = (widen(&bh), widen(&bth));
                let (mut h1, mut h2, mut f1, mut f2) =
                    (pad(&c0, m, n, ldc), pad(&c0, m, n, ldc), pad(&c0, m, n, ldc), pad(&c0, m, n, ldc));
                super::super::matmul_acc_strided(&mut h1, ldc, &ap, lda, &bh, ldb, m, k, n);
                super::super::matmul_nt_acc(&mut h2, ldc, &ap, lda, &bth, ldbt, m, k, n);
                super::super::matmul_acc_strided(&mut f1, ldc, &ap, lda, &bw, ldb, m, k, n);
                super::super::matmul_nt_acc(&mut f2, ldc, &ap, lda, &btw, ldbt, m, k, n);
                assert_eq!(bits(&h1), bits(&f1), "f16 B [{m}x{k}x{n}]");
                assert_eq!(bits(&h2), bits(&f2), "f16 Bt [{m}x{k}x{n}]");
                let mut w3 = pad(&c0, m, n, ldc);
                crate::ops::matmul_nt_acc_ref(&mut w3, ldc, &ap, lda, &btw, ldbt, m, k, n);
                for (i, (g, w)) in h2.iter().zip(&w3).enumerate() {
                    assert!(close(*g, *w, k), "f16 Bt vs loops [{m}x{k}x{n}] {i}: {g} vs {w}");
                }
                for r in 0..m {
                    for j in 0..ldc {
                        let i = r * ldc + j;
                        let w = if j < n { want[r * n + j] } else { 7.0 };
                        assert!(close(s1[i], w, k), "strided [{m}x{k}x{n}] ({r},{j}): {} vs {w}", s1[i]);
                        assert!(close(s2[i], w2[i], k), "nt [{m}x{k}x{n}] ({r},{j}): {} vs {}", s2[i], w2[i]);
                        assert!(close(s2[i], w, k), "nt vs nn [{m}x{k}x{n}] ({r},{j})");
                    }
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
                if isas.contains(&crate::qgemm::Isa::Avx512) {
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
