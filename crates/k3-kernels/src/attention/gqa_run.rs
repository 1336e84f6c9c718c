//! One decode token's GQA attention over a run of up to 16 cached positions of one KV head, in
//! one pass through the registers: the scores of the G ≤ 3 query heads that share the KV head,
//! their online softmax (running maximum m, running sum l, the outputs rescaled by e^(m_old −
//! m_new) when m grows) and the values product,
//!
//!   s_j = q · k_j,  m' = max(m, scale·max_j s_j),  p_j = e^(scale·s_j − m'),
//!   l' = e^(m − m')·l + Σ_j p_j,  acc' = e^(m − m')·acc + Σ_j p_j·v_j.
//!
//! [`super::split::gqa_decode_split`]'s unfused form writes each 256-position tile's scores to
//! memory, takes their maximum, exponentials and f16 rounding in passes over it, then reads them
//! back for the values: at SmolLM2's shape perf put a third of the step outside the two
//! products. Here the scores of a run never leave the registers except as the 16 probabilities
//! the values product broadcasts, and each head's G × dv outputs stay in registers over the run.
//! The unfused form is this kernel's reference (the same sums in another order).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Positions per run: one 16-lane vector of scores per query head. The unfused form's scores
/// walk their tiles in runs of as many, every KV head's part of a run before the next run, so
/// that the cache rows come from memory whole and in order.
pub(super) const RUN: usize = 16;

/// Widest values the fused form holds in registers: G · dv / 16 ≤ 16 accumulators, so up to
/// three query heads at a time to dv = 64 ([`rows_at_once`]), two to 128.
pub(super) const MAX_DV: usize = 128;

/// Query heads a run takes at once with values `dv` wide.
pub(super) fn rows_at_once(dv: usize) -> usize {
    if dv > 64 {
        2
    } else {
        crate::simd_keys::MAX_ROWS
    }
}

/// What a run reads and updates: G query rows, the run's key and value rows, and the KV head's
/// share state for those heads: outputs [G, dv], running maxima [G] and sums [G, 16] (16 lanes a
/// head, summed when the share ends).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(super) struct Operands {
    /// The G query rows (rounded to f16 when the probabilities are), [G, dk].
    pub q: *const f32,
    pub dk: usize,
    /// Position 0 of the run: its key row (this KV head's dk values) and value row (dv), f32 or
    /// f16 bits; `ldk`, `ldv` elements from one position to the next.
    pub keys: *const u8,
    pub ldk: usize,
    pub values: *const u8,
    pub ldv: usize,
    pub acc: *mut f32,
    pub m: *mut f32,
    pub l: *mut f32,
    /// Cache bytes to start on their way into L2 during the run (start, length; two regions:
    /// keys and values further on), a few lines with each position's values.
    pub ahead: [(*const u8, usize); 2],
}

/// The fused run for G heads and dv = 16·DV16 values, F16 caches or f32; `n` ≤ [`RUN`]
/// positions; with `f16_p` the probabilities are rounded to f16 before the values product (as
/// llama.cpp's against an f16 cache), after they join the sum.
///
/// # Safety
/// AVX-512 F/BW/VL and F16C must be present; q [G, dk], acc [G, dv], m [G], l [G, 16], and n key and
/// value rows at their strides must be valid.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
pub(super) unsafe fn run<const G: usize, const DV16: usize, const F16: bool>(
    h: Operands,
    n: usize,
    scale: f32,
    f16_p: bool,
    pf: bool,
) {
    let keys = crate::simd_keys::Keys {
        pc: std::ptr::null_mut(),
        ldc: 0,
        pa: h.q,
        lda: h.dk,
        pb: h.keys,
        ldb: h.ldk,
        k: h.dk,
    };
    let elem = if F16 { 2 } else { 4 };
    let mut p = [[0f32; RUN]; G];
    // Each head's factor e^(m_old − m_new) where its maximum grew, applied to its outputs once
    // they are loaded, after the scores (whose accumulators would otherwise share the registers
    // with them: at dv = 128, 16 outputs and 16 score accumulators for two heads).
    let mut grew = [None; G];
    // s [G] × 16 lanes: positions 0..8 and 8..16 (lanes n.. zero, masked off below).
    let lo = crate::simd_keys::scores8_n::<G, F16>(keys, pf, n.min(8));
    let hi_at = crate::simd_keys::Keys { pb: h.keys.add(8 * h.ldk * elem), ..keys };
    let hi = crate::simd_keys::scores8_n::<G, F16>(hi_at, pf, n.saturating_sub(8));
    let valid: __mmask16 = ((1u32 << n) - 1) as u16;
    for r in 0..G {
        let s = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
            _mm512_castpd256_pd512(_mm256_castps_pd(lo[r])),
            _mm256_castps_pd(hi[r]),
        ));
        let x = _mm512_mul_ps(s, _mm512_set1_ps(scale));
        // The maximum is reduced only when some score passes it (most runs after the first
        // few pass none); the sum stays 16 lanes wide until the share ends.
        let (m_r, l_r) = (h.m.add(r), h.l.add(16 * r));
        let mut lanes = _mm512_loadu_ps(l_r);
        if _mm512_mask_cmp_ps_mask::<_CMP_GT_OQ>(valid, x, _mm512_set1_ps(*m_r)) != 0 {
            let top = _mm512_mask_reduce_max_ps(valid, x);
            // The first run's m = −∞ gives factor ~0 on zero outputs and sums.
            let grow = _mm512_set1_ps(crate::ops::exp_fast(*m_r - top));
            grew[r] = Some(grow);
            lanes = _mm512_mul_ps(lanes, grow);
            *m_r = top;
        }
        let e = _mm512_maskz_mov_ps(valid, crate::simd::x86::exp16(_mm512_sub_ps(x, _mm512_set1_ps(*m_r))));
        _mm512_storeu_ps(l_r, _mm512_add_ps(lanes, e));
        let e = if f16_p {
            _mm512_cvtph_ps(_mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(e))
        } else {
            e
        };
        _mm512_storeu_ps(p[r].as_mut_ptr(), e);
    }
    let mut acc = [[_mm512_setzero_ps(); DV16]; G];
    for (r, acc) in acc.iter_mut().enumerate() {
        for (q, a) in acc.iter_mut().enumerate() {
            *a = _mm512_loadu_ps(h.acc.add(r * DV16 * 16 + 16 * q));
            if let Some(grow) = grew[r] {
                *a = _mm512_mul_ps(*a, grow);
            }
        }
    }
    // Lines a position (of RUN) of each region; the last position's may reach a line or two
    // past its region (harmless: a prefetch never faults).
    let per = h.ahead.map(|(_, len)| len.div_ceil(64 * RUN));
    for j in 0..RUN {
        for (&(at, _), &per) in h.ahead.iter().zip(&per) {
            for i in 0..per {
                _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(64 * (j * per + i)) as *const i8);
            }
        }
        if j >= n {
            continue;
        }
        let v: [__m512; DV16] =
            std::array::from_fn(|q| crate::simd::x86::load_b::<F16>(h.values, j * h.ldv + 16 * q, 0xFFFF));
        for r in 0..G {
            let pj = _mm512_set1_ps(p[r][j]);
            for q in 0..DV16 {
                acc[r][q] = _mm512_fmadd_ps(pj, v[q], acc[r][q]);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for (q, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(h.acc.add(r * DV16 * 16 + 16 * q), *a);
        }
    }
}
