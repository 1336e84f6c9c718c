//! The KDA delta rule in pure Rust (architecture.md §1(a), §1(e)), mirroring fla's trio:
//! - [`kda_recurrent_ref`]: the specification, a per-token loop;
//! - [`kda_step`]: one token, in place on the state (decode), written as the equations read;
//! - [`kda_step_fused`]: the same step in two passes over the state (one read-only), SIMD,
//!   heads in parallel (the engine's decode path);
//! - [`kda_chunk`]: the chunked WY form, written as the equations read (exp of every G_c − G_j);
//! - [`kda_chunk_parallel`]: the same chunked form as the engine's prefill runs it: decay-weighted
//!   products as SIMD dots of pre-decayed rows (`kda/chunk.rs`), heads in parallel.
//!
//! Layouts: q, k, g: [T, H, K]; v, o: [T, H, V]; beta: [T, H]; state: [H, K, V] (row = key
//! channel), f32. `scale = K^-0.5` is applied to q inside.

/// One token for every head, in place on `s`.
///
/// # Shapes
/// q, k, g: [H, K]; v: [H, V]; beta: [H]; s: [H, K, V]; o: [H, V]
pub fn kda_step(
    o: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    s: &mut [f32],
    kd: usize,
    vd: usize,
) {
    let h = beta.len();
    let scale = 1.0 / (kd as f32).sqrt();
    for hh in 0..h {
        let st = &mut s[hh * kd * vd..(hh + 1) * kd * vd];
        let (qh, kh, gh) = (&q[hh * kd..(hh + 1) * kd], &k[hh * kd..(hh + 1) * kd], &g[hh * kd..(hh + 1) * kd]);
        let vh = &v[hh * vd..(hh + 1) * vd];
        // S ← S ⊙ exp(g)[:, None]
        for i in 0..kd {
            let a = gh[i].exp();
            st[i * vd..(i + 1) * vd].iter_mut().for_each(|x| *x *= a);
        }
        // delta = β (v − Sᵀk);  S ← S + k ⊗ delta
        let mut delta = vh.to_vec();
        for i in 0..kd {
            let ki = kh[i];
            for (d, &sv) in delta.iter_mut().zip(&st[i * vd..(i + 1) * vd]) {
                *d -= sv * ki;
            }
        }
        delta.iter_mut().for_each(|d| *d *= beta[hh]);
        for i in 0..kd {
            crate::ops::axpy(&mut st[i * vd..(i + 1) * vd], kh[i], &delta);
        }
        // o = Sᵀ (scale q)
        let oh = &mut o[hh * vd..(hh + 1) * vd];
        oh.iter_mut().for_each(|x| *x = 0.0);
        for i in 0..kd {
            crate::ops::axpy(oh, qh[i] * scale, &st[i * vd..(i + 1) * vd]);
        }
    }
}

/// [`kda_step`] fused: per head, pass 1 only reads the state, u = Σ_i (k_i e^{g_i}) S_i (= the
/// decayed Sᵀk); then δ = β(v − u); pass 2 rewrites each row once, S_i ← e^{g_i} S_i + k_i δ, and
/// accumulates o += (scale q_i) S_i while the row is in L1. One read of the state from the outer
/// caches and one write (the 18 KDA layers of the 370M model hold 9.4 MB of state, more than L2).
/// Heads run on `threads` pool threads.
///
/// # Shapes
/// q, k, g: [H, K]; v: [H, V]; beta: [H]; s: [H, K, V]; o: [H, V]
#[allow(clippy::too_many_arguments)]
pub fn kda_step_fused(
    o: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    s: &mut [f32],
    kd: usize,
    vd: usize,
    threads: usize,
) {
    let h = beta.len();
    let threads = if h * kd * vd < 1 << 14 { 1 } else { threads };
    let (sp, op) = (crate::attention::OutPtr(s.as_mut_ptr()), crate::attention::OutPtr(o.as_mut_ptr()));
    let isa = crate::qgemm::Isa::best();
    crate::threads::Pool::global().run(threads, h, &|hh| {
        // SAFETY: head hh owns state rows [hh·K·V, (hh+1)·K·V) and outputs [hh·V, (hh+1)·V).
        let st = unsafe { sp.slice(hh * kd * vd, kd * vd) };
        let oh = unsafe { op.slice(hh * vd, vd) };
        let (qh, kh, gh) = (&q[hh * kd..(hh + 1) * kd], &k[hh * kd..(hh + 1) * kd], &g[hh * kd..(hh + 1) * kd]);
        kda_step_head(isa, oh, qh, kh, &v[hh * vd..(hh + 1) * vd], gh, beta[hh], st);
    });
}

/// One head of [`kda_step_fused`] (the engine's fused decode layer calls it per head): the SIMD
/// register step where `isa` and the shape allow, else the two-pass loop. `scale = K^-0.5`.
///
/// # Shapes
/// q, k, g: [K]; v, o: [V]; st: [K, V]
#[allow(clippy::too_many_arguments)]
pub fn kda_step_head(
    isa: crate::qgemm::Isa,
    o: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: f32,
    st: &mut [f32],
) {
    let (kd, vd) = (k.len(), v.len());
    let scale = 1.0 / (kd as f32).sqrt();
    let decay: Vec<f32> = g.iter().map(|g| g.exp()).collect(); // [K]
    if !crate::ops::reference_arithmetic() && step_head_simd(isa, st, k, &decay, q, scale, v, beta, o) {
        return;
    }
    let mut u = vec![0f32; vd];
    for (i, row) in st.chunks_exact(vd).enumerate() {
        crate::ops::axpy(&mut u, k[i] * decay[i], row);
    }
    for (uj, &vj) in u.iter_mut().zip(v) {
        *uj = beta * (vj - *uj);
    }
    o.iter_mut().for_each(|x| *x = 0.0);
    for (i, row) in st.chunks_exact_mut(vd).enumerate() {
        let a = decay[i];
        row.iter_mut().for_each(|x| *x *= a);
        crate::ops::axpy(row, k[i], &u);
        crate::ops::axpy(o, q[i] * scale, row);
    }
}

/// One head of [`kda_step_fused`] with u and o held in registers (V a multiple of 16): the value
/// columns in blocks (AVX-512F: 128, then 16; AVX2 + FMA: 32, then 16), each block's pass 1
/// (u = Σ_i k_i e^{g_i} S_i) and pass 2 (S_i ← e^{g_i} S_i + k_i δ, o += scale q_i S_i) over
/// every row before the next block; columns never mix, so the blocks are independent. Returns
/// false (nothing done) where the CPU or the shape has no such path.
///
/// # Shapes
/// st: [K, V]; k, decay, q: [K]; v, o: [V]
#[allow(clippy::too_many_arguments)]
fn step_head_simd(
    isa: crate::qgemm::Isa,
    st: &mut [f32],
    k: &[f32],
    decay: &[f32],
    q: &[f32],
    scale: f32,
    v: &[f32],
    beta: f32,
    o: &mut [f32],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::qgemm::Isa;
        let vd = v.len();
        let avx512 = isa >= Isa::Avx512 && Isa::Avx512.supported();
        let avx2 = isa >= Isa::Avx2 && Isa::Avx2.supported();
        if vd.is_multiple_of(16) && (avx512 || avx2) {
            let kd = k.len();
            assert!(st.len() == kd * vd && decay.len() == kd && q.len() == kd && o.len() == vd);
            let rows = Rows { st: st.as_mut_ptr(), vd, k, decay, q, scale, beta };
            let mut j = 0;
            // SAFETY: the ISA of each branch is present (checked above); every block lies inside
            // its row (j + width ≤ V) and st, v, o have the lengths asserted above.
            unsafe {
                if !avx512 {
                    while j + 32 <= vd {
                        x86::step_block256::<4>(&rows, j, v.as_ptr().add(j), o.as_mut_ptr().add(j));
                        j += 32;
                    }
                    if j < vd {
                        x86::step_block256::<2>(&rows, j, v.as_ptr().add(j), o.as_mut_ptr().add(j));
                    }
                    return true;
                }
                while j + 128 <= vd {
                    x86::step_block::<8>(&rows, j, v.as_ptr().add(j), o.as_mut_ptr().add(j));
                    j += 128;
                }
                while j < vd {
                    x86::step_block::<1>(&rows, j, v.as_ptr().add(j), o.as_mut_ptr().add(j));
                    j += 16;
                }
            }
            return true;
        }
    }
    let _ = (isa, st, k, decay, q, scale, v, beta, o);
    false
}

/// One head's state and per-row factors for [`x86::step_block`].
#[cfg(target_arch = "x86_64")]
struct Rows<'a> {
    st: *mut f32,
    vd: usize,
    k: &'a [f32],
    /// e^{g_i}
    decay: &'a [f32],
    q: &'a [f32],
    scale: f32,
    beta: f32,
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Columns j..j + 16·NV of one head's step (see `step_head_simd`).
    ///
    /// # Safety
    /// AVX-512F; columns j..j + 16·NV lie inside every row of `r.st`; v and o hold 16·NV values.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn step_block<const NV: usize>(r: &super::Rows, j: usize, v: *const f32, o: *mut f32) {
        let row = |i: usize| r.st.add(i * r.vd + j);
        let mut u = [_mm512_setzero_ps(); NV];
        for (i, (&k, &a)) in r.k.iter().zip(r.decay).enumerate() {
            let (p, c) = (row(i), _mm512_set1_ps(k * a));
            for (n, un) in u.iter_mut().enumerate() {
                *un = _mm512_fmadd_ps(c, _mm512_loadu_ps(p.add(16 * n)), *un);
            }
        }
        let b = _mm512_set1_ps(r.beta);
        // δ = β (v − u)
        for (n, un) in u.iter_mut().enumerate() {
            *un = _mm512_mul_ps(b, _mm512_sub_ps(_mm512_loadu_ps(v.add(16 * n)), *un));
        }
        let mut acc = [_mm512_setzero_ps(); NV];
        for i in 0..r.k.len() {
            let p = row(i);
            let (a, k, q) = (_mm512_set1_ps(r.decay[i]), _mm512_set1_ps(r.k[i]), _mm512_set1_ps(r.scale * r.q[i]));
            for n in 0..NV {
                let s = _mm512_fmadd_ps(a, _mm512_loadu_ps(p.add(16 * n)), _mm512_mul_ps(k, u[n]));
                _mm512_storeu_ps(p.add(16 * n), s);
                acc[n] = _mm512_fmadd_ps(q, s, acc[n]);
            }
        }
        for (n, an) in acc.iter().enumerate() {
            _mm512_storeu_ps(o.add(16 * n), *an);
        }
    }

    /// [`step_block`] in AVX2 + FMA: columns j..j + 8·NV (NV = 4, u and o in eight of the 16
    /// registers; a 16-column tail with NV = 2).
    ///
    /// # Safety
    /// AVX2 and FMA; columns j..j + 8·NV lie inside every row of `r.st`; v and o hold 8·NV values.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn step_block256<const NV: usize>(r: &super::Rows, j: usize, v: *const f32, o: *mut f32) {
        let row = |i: usize| r.st.add(i * r.vd + j);
        let mut u = [_mm256_setzero_ps(); NV];
        for (i, (&k, &a)) in r.k.iter().zip(r.decay).enumerate() {
            let (p, c) = (row(i), _mm256_set1_ps(k * a));
            for (n, un) in u.iter_mut().enumerate() {
                *un = _mm256_fmadd_ps(c, _mm256_loadu_ps(p.add(8 * n)), *un);
            }
        }
        let b = _mm256_set1_ps(r.beta);
        // δ = β (v − u)
        for (n, un) in u.iter_mut().enumerate() {
            *un = _mm256_mul_ps(b, _mm256_sub_ps(_mm256_loadu_ps(v.add(8 * n)), *un));
        }
        let mut acc = [_mm256_setzero_ps(); NV];
        for i in 0..r.k.len() {
            let p = row(i);
            let (a, k, q) = (_mm256_set1_ps(r.decay[i]), _mm256_set1_ps(r.k[i]), _mm256_set1_ps(r.scale * r.q[i]));
            for n in 0..NV {
                let s = _mm256_fmadd_ps(a, _mm256_loadu_ps(p.add(8 * n)), _mm256_mul_ps(k, u[n]));
                _mm256_storeu_ps(p.add(8 * n), s);
                acc[n] = _mm256_fmadd_ps(q, s, acc[n]);
            }
        }
        for (n, an) in acc.iter().enumerate() {
            _mm256_storeu_ps(o.add(8 * n), *an);
        }
    }
}

/// The token-by-token reference over T tokens.
pub fn kda_recurrent_ref(
    o: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    s: &mut [f32],
    h: usize,
    kd: usize,
    vd: usize,
) {
    let t = beta.len() / h;
    for r in 0..t {
        let (a, b) = (r * h * kd, (r + 1) * h * kd);
        let (c, d) = (r * h * vd, (r + 1) * h * vd);
        kda_step(&mut o[c..d], &q[a..b], &k[a..b], &v[c..d], &g[a..b], &beta[r * h..(r + 1) * h], s, kd, vd);
    }
}

mod chunk;
pub use chunk::{kda_chunk, kda_chunk_parallel};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_close_ratio, Rng, Tol};

    fn inputs(t: usize, h: usize, kd: usize, vd: usize, decay: f32, seed: u64) -> [Vec<f32>; 6] {
        let mut r = Rng::new(seed);
        let q = r.normals(t * h * kd, 1.0);
        let mut k = r.normals(t * h * kd, 1.0);
        crate::ops::l2norm_inplace(&mut k, kd, 1e-6);
        let v = r.normals(t * h * vd, 1.0);
        let g: Vec<f32> = (0..t * h * kd).map(|_| -r.uniform() * decay).collect();
        let beta: Vec<f32> = (0..t * h).map(|_| r.uniform()).collect();
        let s0 = r.normals(h * kd * vd, 0.1);
        [q, k, v, g, beta, s0]
    }

    #[test]
    fn fused_step_matches_the_reference_step() {
        for &(h, kd, vd, threads) in &[(2, 16, 24, 1), (3, 64, 64, 2), (8, 128, 128, 2), (2, 32, 144, 2)] {
            let t = 6;
            let [q, k, v, g, beta, s0] = inputs(t, h, kd, vd, 0.5, (h * kd) as u64);
            let (mut s1, mut s2) = (s0.clone(), s0);
            for r in 0..t {
                let (a, b) = (r * h * kd, (r + 1) * h * kd);
                let (c, d) = (r * h * vd, (r + 1) * h * vd);
                let (mut o1, mut o2) = (vec![0.0; h * vd], vec![1.0; h * vd]);
                let bt = &beta[r * h..(r + 1) * h];
                kda_step(&mut o1, &q[a..b], &k[a..b], &v[c..d], &g[a..b], bt, &mut s1, kd, vd);
                kda_step_fused(&mut o2, &q[a..b], &k[a..b], &v[c..d], &g[a..b], bt, &mut s2, kd, vd, threads);
                assert_close_ratio(&format!("o H={h} K={kd} step {r}"), &o2, &o1, Tol::KDA_CHUNK);
            }
            assert_close_ratio(&format!("S H={h} K={kd}"), &s2, &s1, Tol::KDA_CHUNK);
        }
    }

    #[test]
    fn head_step_matches_the_reference_on_every_simd_path() {
        use crate::qgemm::Isa;
        for &(kd, vd) in &[(128, 128), (32, 144), (16, 48)] {
            let [q, k, v, g, beta, s0] = inputs(1, 1, kd, vd, 0.5, vd as u64);
            let (mut o1, mut s1) = (vec![0.0; vd], s0.clone());
            kda_step(&mut o1, &q, &k, &v, &g, &beta, &mut s1, kd, vd);
            let decay: Vec<f32> = g.iter().map(|x| x.exp()).collect();
            let scale = 1.0 / (kd as f32).sqrt();
            for isa in Isa::available() {
                let (mut o2, mut s2) = (vec![f32::NAN; vd], s0.clone());
                if step_head_simd(isa, &mut s2, &k, &decay, &q, scale, &v, beta[0], &mut o2) {
                    assert_close_ratio(&format!("o {} K={kd} V={vd}", isa.name()), &o2, &o1, Tol::KDA_CHUNK);
                    assert_close_ratio(&format!("S {} K={kd} V={vd}", isa.name()), &s2, &s1, Tol::KDA_CHUNK);
                } else {
                    assert!(isa < Isa::Avx2, "{} has a register-held step", isa.name());
                }
            }
        }
    }

    #[test]
    fn chunk_matches_recurrent() {
        for &(t, chunk, decay) in &[(1, 64, 0.5), (50, 64, 0.5), (130, 64, 0.5), (97, 16, 0.5), (128, 64, 10.0)] {
            let (h, kd, vd) = (2, 16, 24);
            let [q, k, v, g, beta, s0] = inputs(t, h, kd, vd, decay, t as u64);
            let (mut o1, mut s1) = (vec![0.0; t * h * vd], s0.clone());
            let (mut o2, mut s2) = (vec![0.0; t * h * vd], s0);
            kda_recurrent_ref(&mut o1, &q, &k, &v, &g, &beta, &mut s1, h, kd, vd);
            kda_chunk(&mut o2, &q, &k, &v, &g, &beta, &mut s2, h, kd, vd, chunk);
            assert!(o2.iter().all(|x| x.is_finite()));
            assert_close_ratio(&format!("o T={t} C={chunk}"), &o2, &o1, Tol::KDA_CHUNK);
            assert_close_ratio(&format!("S T={t} C={chunk}"), &s2, &s1, Tol::KDA_CHUNK);
        }
    }

    #[test]
    fn fast_chunk_matches_the_reference_chunk_and_the_recurrence() {
        // decay 5: the per-channel midpoint split; decay 25: sub-chunk spans (≈ 15 × 12.5) past
        // 150, where a block falls back to an exp per pair, and chunks decay below f32's range.
        for &(t, h, kd, vd, chunk, decay) in &[
            (1, 2, 16, 24, 64, 0.5),
            (50, 2, 16, 24, 64, 0.5),
            (130, 2, 16, 24, 64, 0.5),
            (97, 3, 16, 24, 16, 0.5),
            (200, 2, 128, 128, 64, 0.5),
            (128, 2, 16, 24, 64, 5.0),
            (128, 2, 16, 24, 64, 25.0),
        ] {
            let [q, k, v, g, beta, s0] = inputs(t, h, kd, vd, decay, 31 + t as u64);
            let (mut o1, mut s1) = (vec![0.0; t * h * vd], s0.clone());
            let (mut o2, mut s2) = (vec![0.0; t * h * vd], s0.clone());
            let (mut o3, mut s3) = (vec![0.0; t * h * vd], s0);
            kda_chunk(&mut o1, &q, &k, &v, &g, &beta, &mut s1, h, kd, vd, chunk);
            kda_chunk_parallel(&mut o2, &q, &k, &v, &g, &beta, &mut s2, h, kd, vd, chunk, 1);
            kda_recurrent_ref(&mut o3, &q, &k, &v, &g, &beta, &mut s3, h, kd, vd);
            assert!(o2.iter().chain(&s2).all(|x| x.is_finite()), "T={t} decay {decay}");
            let what = format!("T={t} K={kd} C={chunk} decay {decay}");
            assert_close_ratio(&format!("o vs chunk ref, {what}"), &o2, &o1, Tol::KDA_CHUNK);
            assert_close_ratio(&format!("S vs chunk ref, {what}"), &s2, &s1, Tol::KDA_CHUNK);
            assert_close_ratio(&format!("o vs recurrence, {what}"), &o2, &o3, Tol::KDA_CHUNK);
            assert_close_ratio(&format!("S vs recurrence, {what}"), &s2, &s3, Tol::KDA_CHUNK);
        }
    }

    #[test]
    fn parallel_chunked_prefill_gives_the_same_bits_at_every_thread_count() {
        for &(t, h, threads) in &[(70, 4, 2), (33, 3, 4), (5, 1, 2)] {
            let (kd, vd) = (16, 24);
            let [q, k, v, g, beta, s0] = inputs(t, h, kd, vd, 0.5, 9 + t as u64);
            let (mut o1, mut s1) = (vec![0.0; t * h * vd], s0.clone());
            let (mut o2, mut s2) = (vec![0.0; t * h * vd], s0);
            kda_chunk_parallel(&mut o1, &q, &k, &v, &g, &beta, &mut s1, h, kd, vd, 16, 1);
            kda_chunk_parallel(&mut o2, &q, &k, &v, &g, &beta, &mut s2, h, kd, vd, 16, threads);
            assert_eq!(o1, o2, "outputs, T={t} H={h}");
            assert_eq!(s1, s2, "states, T={t} H={h}");
        }
    }
}
