//! One query token against a long cache with its positions split over the threads, as
//! flash-decoding does, each share in one pass over its positions (online softmax, tiles that
//! stay in L2 between scores and values): a share's pass and the combination of the shares'
//! outputs into the unsplit softmax's, used by MLA's latent cache ([`super::mla`]) and here by
//! GQA's. A share's rows are every query head (MLA: all heads against the one latent cache; GQA:
//! each KV head's G query heads in turn), its statistics laid out [share, row].

use super::gqa_run::{self, RUN};
use super::{Heads, OutPtr, Rows};
use std::ops::Range;

/// Fewest visible positions at which a one-token step splits them over the threads.
pub(crate) const SPLIT_MIN: usize = 1024;

/// Fewest visible positions at which a GQA one-token step takes [`gqa_decode_split`] (its
/// runs, prefetches and shares) rather than `attend_blocked`'s pass a KV head over the cache.
/// SmolLM2 Q4_1 decode at contexts 200–920 in one process (`examples/decode_ab … 8 30 … 200`,
/// a temporary switch, 30 rounds): 1.080× at 1 thread, 1.106× at 2 against the split from 1,024
/// positions; 0–250 positions 1.013× / 1.020×. Splitting over one thread below 1,024 positions
/// and over all from there was 0.966× at 2 threads.
pub(crate) const GQA_SPLIT_MIN: usize = 64;

/// Positions per tile of a share's single pass: a tile's cache rows (at MLA's bench shape 256 ×
/// 640 bytes in f16, 160 KB) stay in L2 between its scores and its values, so the share streams
/// from memory once.
pub(crate) const TILE: usize = 256;

/// A share's scores against a tile of positions: adds `rows` rows of scores for the positions
/// into a zeroed [rows, |positions|] block.
pub(super) type ScoresFn<'a> = dyn Fn(&mut [f32], Range<usize>) + 'a;
/// A share's values for a tile: `acc [rows, w] += p [rows, n] · V[positions]`, n = |positions|
/// (the row stride of p).
pub(super) type ValuesFn<'a> = dyn Fn(&mut [f32], &[f32], Range<usize>) + 'a;

/// One share's single pass over its positions `js`, in tiles of [`TILE`] positions (online
/// softmax, as flash-decoding does): a tile's scores, each row's running maximum m grown to
/// the tile's, the running sum of e^(scale·x − m) and the outputs `acc` ([rows, w]) rescaled by
/// e^(m_old − m_new) when it grows, then the tile's exponentials times its values. The share
/// ends with `acc` = Σ_j e^(scale·x_j − m)·v_j, its `maxes` m and its `sums`, which
/// [`combine_shares`] turns into the unsplit softmax. With `f16_kq` the exponentials are rounded
/// to f16 before the values product, as llama.cpp rounds its probabilities against an f16 cache
/// (there after normalising; the same relative rounding).
#[allow(clippy::too_many_arguments)]
pub(super) fn online_share(
    js: Range<usize>,
    scale: f32,
    f16_kq: bool,
    scores: &ScoresFn,
    values: &ValuesFn,
    acc: &mut [f32],
    maxes: &mut [f32],
    sums: &mut [f32],
) {
    let rows = maxes.len();
    let w = acc.len() / rows;
    maxes.fill(f32::NEG_INFINITY);
    sums.fill(0.0);
    acc.fill(0.0);
    let mut block = vec![0f32; rows * TILE.min(js.len())];
    for t0 in js.clone().step_by(TILE) {
        let tile = t0..(t0 + TILE).min(js.end);
        let n = tile.len();
        let block = &mut block[..rows * n];
        block.fill(0.0);
        scores(block, tile.clone());
        for (i, row) in block.chunks_exact_mut(n).enumerate() {
            let m = maxes[i].max(row.iter().copied().fold(f32::NEG_INFINITY, f32::max) * scale);
            if maxes[i] != m && maxes[i] != f32::NEG_INFINITY {
                let grow = crate::ops::exp_fast(maxes[i] - m);
                sums[i] *= grow;
                acc[i * w..(i + 1) * w].iter_mut().for_each(|a| *a *= grow);
            }
            maxes[i] = m;
            sums[i] += crate::ops::exp_shifted_sum(row, scale, m);
            if f16_kq {
                crate::simd::round_f16_inplace(row);
            }
        }
        values(acc, block, tile);
    }
}

/// The shares' outputs combined into the unsplit softmax's: per row, with m = max_k m_k,
/// out = Σ_k e^(m_k − m)·partial_k / Σ_k e^(m_k − m)·sum_k.
///
/// # Shapes
/// maxes, sums: [shares, rows]; partial: [shares, rows, w]; out: [rows, w]
pub(super) fn combine_shares(out: &mut [f32], maxes: &[f32], sums: &[f32], partial: &[f32], w: usize) {
    let rows = out.len() / w;
    let shares = maxes.len() / rows;
    for (i, dst) in out.chunks_exact_mut(w).enumerate() {
        let at = |k: usize| k * rows + i;
        let m = (0..shares).map(|k| maxes[at(k)]).fold(f32::NEG_INFINITY, f32::max);
        let factor: Vec<f32> = (0..shares).map(|k| crate::ops::exp_fast(maxes[at(k)] - m)).collect();
        let l: f32 = (0..shares).map(|k| factor[k] * sums[at(k)]).sum();
        dst.fill(0.0);
        for (k, f) in factor.iter().enumerate() {
            crate::ops::axpy(dst, f / l, &partial[at(k) * w..(at(k) + 1) * w]);
        }
    }
}

/// The shares of `s` positions over `threads`: (positions per share, shares).
pub(super) fn shares_of(s: usize, threads: usize) -> (usize, usize) {
    let per = s.div_ceil(threads.max(1));
    (per, s.div_ceil(per))
}

/// q: [Hq, dk] (one token), attending to the first `s` rows of kc [·, Hkv, dk] and vc
/// [·, Hkv, dv]; out: [Hq, dv]. One task per share of positions: every query head's single pass
/// over the share ([`online_share`]), each tile taking the KV heads one after another, so a task
/// reads its share's cache rows whole and in order (one task per KV head read a third of every
/// row at a 384-byte stride at SmolLM2's shape, ~3 GB/s); the shares' maxima and sums give every
/// row's softmax, and their outputs are summed with those weights. With `fused` (where
/// [`fused_fits`]), each share walks runs of 16 positions through [`gqa_run`] instead of the
/// tiles of [`online_share`]: SmolLM2 Q4_1 decode @4096 in one process (`examples/decode_ab …
/// 4096`, 30 rounds) 1.215× as fast at 1 thread (28 of 30 rounds) and 1.245× at 2 (30 of 30);
/// at 300–540 positions 1.056× and 1.029×.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gqa_decode_split(
    out: &mut [f32],
    q: &[f32],
    kc: Rows,
    vc: Rows,
    heads: Heads,
    s: usize,
    f16_kq: bool,
    threads: usize,
    fused: bool,
) {
    let Heads { hq, hkv, dk, dv } = heads;
    let g = hq / hkv;
    assert!(
        hq == g * hkv && q.len() >= hq * dk && kc.len() >= s * hkv * dk && vc.len() >= s * hkv * dv,
        "gqa decode: {hq} query heads over {hkv} KV heads, {s} positions of keys {dk} and values {dv} wide, \
         but q holds {} values, the caches {} and {}",
        q.len(),
        kc.len(),
        vc.len()
    );
    let scale = 1.0 / (dk as f32).sqrt();
    let (per, shares) = shares_of(s, threads);
    let mut a = q[..hq * dk].to_vec();
    if f16_kq {
        crate::simd::round_f16_inplace(&mut a);
    }
    // Rows are the query heads, KV head kvh's G of them at kvh·G.
    let (mut maxes, mut sums, mut partial) =
        (vec![0f32; shares * hq], vec![0f32; shares * hq], vec![0f32; shares * hq * dv]);
    let (mx, sm, po) = (OutPtr(maxes.as_mut_ptr()), OutPtr(sums.as_mut_ptr()), OutPtr(partial.as_mut_ptr()));
    #[cfg(not(target_arch = "x86_64"))]
    let _ = fused;
    #[cfg(target_arch = "x86_64")]
    if fused && fused_fits(dv) {
        crate::threads::Pool::global().run(threads, shares, &|k| {
            // SAFETY: share k alone writes its rows of `maxes`, `sums` and `partial`.
            let (mk, sk, ok) = unsafe { (mx.slice(k * hq, hq), sm.slice(k * hq, hq), po.slice(k * hq * dv, hq * dv)) };
            // SAFETY: AVX-512 is present (fused_fits), and the rows lie within the caches
            // (`s` positions of hkv heads each).
            unsafe { fused_share(k * per..((k + 1) * per).min(s), &a, kc, vc, heads, scale, f16_kq, ok, mk, sk) };
        });
        combine_shares(&mut out[..hq * dv], &maxes, &sums, &partial, dv);
        return;
    }
    crate::threads::Pool::global().run(threads, shares, &|k| {
        // The scores walk a tile in runs of RUN positions, every KV head's part of a run before
        // the next run, so that the key rows come from memory in order, whole (a pass a KV head
        // over the tile read a third of every row at a stride). Before each KV head's part of a
        // run, a third of the keys two runs ahead and of the run's values are sent on their way
        // into L2. SmolLM2 Q4_1 decode @4096 against a pass a KV head without the prefetches, in
        // one process (`examples/decode_ab … 4096`, 30 rounds): 1.14× at 2 threads, 1.15× at 1
        // with the whole next run prefetched at the start of a run; runs of 32 or 64 measured
        // the same or slower. That burst (192 lines at once) held up the core while the cache's
        // miss buffers drained: a KV head's share of it before each product ran 1.097× (2
        // threads) and 1.159× (1 thread) as fast (30 of 30 rounds each), and the keys two runs
        // ahead instead of one 1.021–1.026× more (24 and 26 of 30). The values product, after
        // the tile's softmax, finds the tile's value rows in L2 and takes each KV head over the
        // whole tile in one product, its G × dv accumulators in registers throughout. Against
        // the values in runs too (one product a run and KV head, reloading them every 16
        // positions), SmolLM2's decode @4096 ran 1.157× as fast at 2 threads and 1.185× at 1 in
        // one process (30 rounds); the sums are the same, in the same order.
        let pf = crate::simd_keys::cache_prefetch();
        let scores = |block: &mut [f32], js: Range<usize>| {
            let n = js.len();
            for j0 in (0..n).step_by(RUN) {
                let m = RUN.min(n - j0);
                // The keys two runs ahead and this run's values, a KV head's share of them
                // before each product.
                let (p0, p1) = (js.start + j0, js.start + j0 + m);
                let ks = ((p1 + RUN) * hkv * dk).min(s * hkv * dk)..((p1 + RUN + m) * hkv * dk).min(s * hkv * dk);
                let vs = p0 * hkv * dv..p1 * hkv * dv;
                for kvh in 0..hkv {
                    if pf {
                        kc.prefetch(head_share(&ks, kvh, hkv));
                        vc.prefetch(head_share(&vs, kvh, hkv));
                    }
                    let (rows, first) = (&a[kvh * g * dk..(kvh + 1) * g * dk], ((js.start + j0) * hkv + kvh) * dk);
                    let b = &mut block[kvh * g * n + j0..(kvh + 1) * g * n];
                    match kc {
                        Rows::F32(c) => crate::simd::matmul_nt_acc(b, n, rows, dk, &c[first..], hkv * dk, g, dk, m),
                        Rows::F16(c) => crate::simd::matmul_nt_acc(b, n, rows, dk, &c[first..], hkv * dk, g, dk, m),
                    }
                }
            }
        };
        let values = |acc: &mut [f32], p: &[f32], js: Range<usize>| {
            let n = js.len();
            for kvh in 0..hkv {
                let (o, pk, first) =
                    (&mut acc[kvh * g * dv..(kvh + 1) * g * dv], &p[kvh * g * n..], (js.start * hkv + kvh) * dv);
                match vc {
                    Rows::F32(c) => crate::simd::matmul_acc_strided(o, dv, pk, n, &c[first..], hkv * dv, g, n, dv),
                    Rows::F16(c) => crate::simd::matmul_acc_strided(o, dv, pk, n, &c[first..], hkv * dv, g, n, dv),
                }
            }
        };
        // SAFETY: share k alone writes its rows of `maxes`, `sums` and `partial`.
        let (mk, sk, ok) = unsafe { (mx.slice(k * hq, hq), sm.slice(k * hq, hq), po.slice(k * hq * dv, hq * dv)) };
        online_share(k * per..((k + 1) * per).min(s), scale, f16_kq, &scores, &values, ok, mk, sk);
    });
    combine_shares(&mut out[..hq * dv], &maxes, &sums, &partial, dv);
}

/// KV head kvh's share (of hkv, in order) of the cache range `r`, for its part of a run's
/// prefetches.
fn head_share(r: &Range<usize>, kvh: usize, hkv: usize) -> Range<usize> {
    let len = r.len().div_ceil(hkv);
    (r.start + kvh * len).min(r.end)..(r.start + (kvh + 1) * len).min(r.end)
}

/// Whether [`fused_share`] can take a GQA decode step: AVX-512 present, values no wider than
/// [`gqa_run::MAX_DV`] in 16-lane steps.
pub(super) fn fused_fits(dv: usize) -> bool {
    cfg!(target_arch = "x86_64")
        && crate::qgemm::Isa::best() >= crate::qgemm::Isa::Avx512
        && dv.is_multiple_of(16)
        && dv <= gqa_run::MAX_DV
}

/// Whether GQA decode steps take the fused runs where they fit ([`FUSED`]).
pub(super) fn fused_on() -> bool {
    FUSED.on()
}

/// Whether GQA decode steps take the fused runs ([`gqa_run`]) where they fit;
/// `K3MINI_GQA_FUSED=0` turns them off (the unfused tiles of [`online_share`]).
static FUSED: crate::switch::Switch = crate::switch::Switch::new("K3MINI_GQA_FUSED", "0");

/// Set [`FUSED`] for the rest of the process (in-process A/B measurements).
pub fn set_gqa_fused(on: bool) {
    FUSED.set(on);
}

/// One share's pass over positions `js` in runs of [`RUN`], every KV head's part of a
/// run before the next run (the run's key and value rows come from memory whole and in order),
/// each KV head's query heads in groups of at most three, two past 64 values
/// ([`gqa_run::rows_at_once`], [`gqa_run::run`]), their outputs,
/// maxima and sums in `acc` [hq, dv], `maxes`, `sums` [hq] as [`online_share`] leaves them.
/// During each KV head's part, its share of the keys and values two runs ahead is sent on its
/// way into L2, a few lines with each position's values.
///
/// # Safety
/// AVX-512 F/BW/VL, FMA and F16C must be present; the caches must hold `js.end` positions of
/// `heads.hkv` rows each, `a` [hq, dk], and `dv` ≤ [`gqa_run::MAX_DV`] a multiple of 16.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn fused_share(
    js: Range<usize>,
    a: &[f32],
    kc: Rows,
    vc: Rows,
    heads: Heads,
    scale: f32,
    f16_kq: bool,
    acc: &mut [f32],
    maxes: &mut [f32],
    sums: &mut [f32],
) {
    let Heads { hq, hkv, dk, dv } = heads;
    let g = hq / hkv;
    maxes.fill(f32::NEG_INFINITY);
    sums.fill(0.0);
    acc.fill(0.0);
    let pf = crate::simd_keys::cache_prefetch();
    let (kp, vp, f16) = match (kc, vc) {
        (Rows::F16(k), Rows::F16(v)) => (k.as_ptr() as *const u8, v.as_ptr() as *const u8, true),
        (Rows::F32(k), Rows::F32(v)) => (k.as_ptr() as *const u8, v.as_ptr() as *const u8, false),
        _ => panic!("gqa decode: keys and values of one cache share a type"),
    };
    let elem = if f16 { 2 } else { 4 };
    let at_once = gqa_run::rows_at_once(dv);
    let mut lanes = vec![0f32; hq * 16];
    for j0 in js.clone().step_by(RUN) {
        let n = RUN.min(js.end - j0);
        let ahead = |w: usize| {
            let at = |j: usize| j.min(js.end) * hkv * w;
            at(j0 + 2 * RUN)..at(j0 + 3 * RUN)
        };
        let (ks, vs) = (ahead(dk), ahead(dv));
        for kvh in 0..hkv {
            // This KV head's share of the keys and values two runs ahead, in bytes, issued by
            // the run of its first group of query heads.
            let part = |r: &Range<usize>, base: *const u8| {
                let r = head_share(r, kvh, hkv);
                if pf {
                    (base.add(r.start * elem), r.len() * elem)
                } else {
                    (base, 0)
                }
            };
            let ahead = [part(&ks, kp), part(&vs, vp)];
            for r0 in (0..g).step_by(at_once) {
                let ahead = if r0 == 0 { ahead } else { [(kp, 0), (vp, 0)] };
                let row = kvh * g + r0;
                let h = gqa_run::Operands {
                    q: a.as_ptr().add(row * dk),
                    dk,
                    keys: kp.add((j0 * hkv + kvh) * dk * elem),
                    ldk: hkv * dk,
                    values: vp.add((j0 * hkv + kvh) * dv * elem),
                    ldv: hkv * dv,
                    acc: acc.as_mut_ptr().add(row * dv),
                    m: maxes.as_mut_ptr().add(row),
                    l: lanes.as_mut_ptr().add(row * 16),
                    ahead,
                };
                let rows = (g - r0).min(at_once);
                macro_rules! run {
                    ($g:literal, $dv16:literal) => {
                        if f16 {
                            gqa_run::run::<$g, $dv16, true>(h, n, scale, f16_kq, pf)
                        } else {
                            gqa_run::run::<$g, $dv16, false>(h, n, scale, f16_kq, pf)
                        }
                    };
                }
                match (rows, dv / 16) {
                    (1, 1) => run!(1, 1),
                    (1, 2) => run!(1, 2),
                    (1, 3) => run!(1, 3),
                    (1, 4) => run!(1, 4),
                    (2, 1) => run!(2, 1),
                    (2, 2) => run!(2, 2),
                    (2, 3) => run!(2, 3),
                    (2, 4) => run!(2, 4),
                    (3, 1) => run!(3, 1),
                    (3, 2) => run!(3, 2),
                    (3, 3) => run!(3, 3),
                    (3, 4) => run!(3, 4),
                    (1, 5) => run!(1, 5),
                    (1, 6) => run!(1, 6),
                    (1, 7) => run!(1, 7),
                    (1, 8) => run!(1, 8),
                    (2, 5) => run!(2, 5),
                    (2, 6) => run!(2, 6),
                    (2, 7) => run!(2, 7),
                    (2, 8) => run!(2, 8),
                    (rows, dv16) => unreachable!("gqa decode: no fused run for {rows} heads of {dv16} × 16 values"),
                }
            }
        }
    }
    for (sum, l) in sums.iter_mut().zip(lanes.chunks_exact(16)) {
        *sum = l.iter().sum();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_close_abs, Rng};

    /// The decode step, fused runs (where the machine has them) and unfused tiles, against the
    /// reference, for every group size the runs take whole (1–3) or in parts (4, 7), values 16
    /// to 128 wide (the fused widths, in groups of three heads to 64, two beyond) and 144
    /// (unfused only), positions that end mid-run and
    /// shares of 1–3 threads, over f32 and f16 caches, with and without f16 probabilities.
    #[test]
    fn decode_steps_fused_and_unfused_match_the_reference() {
        let mut rng = Rng::new(31);
        for (hq, hkv) in [(3, 3), (4, 2), (9, 3), (8, 2), (7, 1)] {
            for d in [16, 48, 64, 80, 128, 144] {
                for s in [64, 77, 300] {
                    let q = rng.normals(hq * d, 1.0);
                    let mut f16_values = || {
                        let mut v = rng.normals(s * hkv * d, 1.0);
                        crate::simd::round_f16_inplace(&mut v);
                        v
                    };
                    let (kc, vc) = (f16_values(), f16_values());
                    let bits = |v: &[f32]| v.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect::<Vec<u16>>();
                    let (kh, vh) = (bits(&kc), bits(&vc));
                    for f16_kq in [false, true] {
                        let mut want = vec![0f32; hq * d];
                        super::super::gqa_attend_ref(&mut want, &q, &kc, &vc, hq, hkv, d, s - 1, f16_kq);
                        for (threads, fused) in [(1, true), (2, true), (3, true), (1, false), (2, false)] {
                            for (name, k, v) in
                                [("f32", Rows::F32(&kc), Rows::F32(&vc)), ("f16", Rows::F16(&kh), Rows::F16(&vh))]
                            {
                                let mut got = vec![0f32; hq * d];
                                let heads = Heads { hq, hkv, dk: d, dv: d };
                                gqa_decode_split(&mut got, &q, k, v, heads, s, f16_kq, threads, fused);
                                let tol = if f16_kq { 2e-3 } else { 1e-5 };
                                let what = format!("{hq}/{hkv} heads of {d}, {s} positions, {name} cache, f16 p {f16_kq}, x{threads}, fused {fused}");
                                assert_close_abs(&what, &got, &want, tol);
                            }
                        }
                    }
                }
            }
        }
    }

    /// Three shares of one pass each against the plain softmax, on scores whose maximum grows
    /// tile after tile (row 0: every tile's rescaling is taken), shrinks (row 1: none is) and
    /// wanders (row 2), with and without the f16 rounding of the exponentials.
    #[test]
    fn shares_of_one_pass_make_the_plain_softmax() {
        let (rows, s, w, scale) = (3, 1700, 5, 0.5);
        let mut rng = Rng::new(7);
        let noise = rng.normals(s, 1.0);
        let x: Vec<f32> = (0..rows * s)
            .map(|i| {
                let (row, j) = (i / s, (i % s) as f32);
                [j * 0.01, -j * 0.01, 3.0 * noise[i % s]][row]
            })
            .collect();
        let v = rng.normals(s * w, 1.0);
        let mut want = vec![0f32; rows * w];
        for (i, o) in want.chunks_exact_mut(w).enumerate() {
            let mut p: Vec<f32> = x[i * s..(i + 1) * s].iter().map(|&xj| xj * scale).collect();
            crate::ops::softmax_inplace(&mut p);
            for (j, &pj) in p.iter().enumerate() {
                crate::ops::axpy(o, pj, &v[j * w..(j + 1) * w]);
            }
        }
        let scores = |block: &mut [f32], js: Range<usize>| {
            for (i, row) in block.chunks_exact_mut(js.len()).enumerate() {
                for (b, j) in row.iter_mut().zip(js.clone()) {
                    *b += x[i * s + j];
                }
            }
        };
        let values = |acc: &mut [f32], p: &[f32], js: Range<usize>| {
            let n = js.len();
            crate::ops::matmul_acc_ref(acc, w, p, n, &v[js.start * w..], w, rows, n, w);
        };
        for f16_kq in [false, true] {
            let (per, shares) = shares_of(s, 3);
            let (mut maxes, mut sums) = (vec![0f32; shares * rows], vec![0f32; shares * rows]);
            let mut partial = vec![0f32; shares * rows * w];
            for k in 0..shares {
                let (mk, sk) = (&mut maxes[k * rows..(k + 1) * rows], &mut sums[k * rows..(k + 1) * rows]);
                let ok = &mut partial[k * rows * w..(k + 1) * rows * w];
                online_share(k * per..((k + 1) * per).min(s), scale, f16_kq, &scores, &values, ok, mk, sk);
            }
            let mut got = vec![0f32; rows * w];
            combine_shares(&mut got, &maxes, &sums, &partial, w);
            let tol = if f16_kq { 2e-3 } else { 1e-5 };
            assert_close_abs(&format!("one pass, f16_kq {f16_kq}"), &got, &want, tol);
        }
    }
}
