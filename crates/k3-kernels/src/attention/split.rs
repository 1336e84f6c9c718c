//! One query token against a long cache with its positions split over the threads, as
//! flash-decoding does: the steps every split shares (a share's exponentials and their sums, the
//! factors that turn them into the unsplit softmax, the sum of the shares' outputs), used by
//! MLA's latent cache ([`super::mla`]) and here by GQA's (with few KV heads, SmolLM2's 3, one
//! task per head left a thread idle, and each task streamed its head's whole cache).
//!
//! Per-share statistics are laid out [group, share, row]: one group for MLA (all heads' rows
//! against the one latent cache), one per KV head for GQA.

use super::{Heads, OutPtr, Rows};

/// Fewest visible positions at which a one-token step splits them over the threads.
pub(crate) const SPLIT_MIN: usize = 1024;

/// Pass 1's end for one share: each row of scores (`block` [rows, n]) becomes
/// e^(scale·x − m) in place, with m = scale·max and the exponentials' sum per row.
pub(super) fn share_exponentials(block: &mut [f32], n: usize, scale: f32, maxes: &mut [f32], sums: &mut [f32]) {
    for (i, row) in block.chunks_exact_mut(n).enumerate() {
        maxes[i] = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) * scale;
        sums[i] = crate::ops::exp_shifted_sum(row, scale, maxes[i]);
    }
}

/// e^(m_k − m) / Σ_k e^(m_k − m)·sum_k for every [group, share, row]: what turns share k's
/// exponentials into the row's probabilities.
pub(super) fn share_factors(maxes: &[f32], sums: &[f32], shares: usize, rows: usize) -> Vec<f32> {
    let mut factor = vec![0f32; maxes.len()];
    for grp in 0..maxes.len() / (shares * rows) {
        for i in 0..rows {
            let at = |k: usize| (grp * shares + k) * rows + i;
            let m = (0..shares).map(|k| maxes[at(k)]).fold(f32::NEG_INFINITY, f32::max);
            for k in 0..shares {
                factor[at(k)] = crate::ops::exp_fast(maxes[at(k)] - m);
            }
            let l: f32 = (0..shares).map(|k| factor[at(k)] * sums[at(k)]).sum();
            for k in 0..shares {
                factor[at(k)] /= l;
            }
        }
    }
    factor
}

/// Pass 2's start for one share: its exponentials ([rows, n]) scaled by the rows' `factors`
/// into probabilities, rounded to f16 after normalising with `f16_kq` (as the unsplit path).
pub(super) fn share_probabilities(block: &mut [f32], n: usize, factors: &[f32], f16_kq: bool) {
    for (row, &f) in block.chunks_exact_mut(n).zip(factors) {
        row.iter_mut().for_each(|p| *p *= f);
        if f16_kq {
            crate::simd::round_f16_inplace(row);
        }
    }
}

/// out [group, row, w] = Σ_k partial [group, share k, row, w].
pub(super) fn sum_shares(out: &mut [f32], partial: &[f32], shares: usize, rows: usize, w: usize) {
    for grp in 0..partial.len() / (shares * rows * w) {
        let dst = &mut out[grp * rows * w..(grp + 1) * rows * w];
        let at = |k: usize| (grp * shares + k) * rows * w;
        dst.copy_from_slice(&partial[at(0)..at(0) + rows * w]);
        for k in 1..shares {
            crate::ops::axpy(dst, 1.0, &partial[at(k)..at(k) + rows * w]);
        }
    }
}

/// q: [Hq, dk] (one token), attending to the first `s` rows of kc [·, Hkv, dk] and vc
/// [·, Hkv, dv]; out: [Hq, dv]. Pass 1 per (KV head, share of positions): the G query heads'
/// scores, e^(score − share max) and their sums. The shares' maxima and sums give every row's
/// softmax, so pass 2 scales a share's exponentials into the probabilities the unsplit path
/// computes (rounded to f16 with `f16_kq` after normalising, as there) and multiplies them by
/// the share's values; the shares' outputs are summed.
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
) {
    let Heads { hq, hkv, dk, dv } = heads;
    let g = hq / hkv;
    let scale = 1.0 / (dk as f32).sqrt();
    let per = s.div_ceil(threads.max(1));
    let shares = s.div_ceil(per);
    let span = |k: usize| k * per..((k + 1) * per).min(s);
    let mut a = q[..hq * dk].to_vec();
    if f16_kq {
        crate::simd::round_f16_inplace(&mut a);
    }
    // Per KV head a [G, S] block of exponentials, share k's [G, |share|] at G·k·per within it.
    let mut ex = vec![0f32; hkv * g * s];
    let stats = hkv * shares * g; // (KV head, share, row)
    let (mut maxes, mut sums) = (vec![0f32; stats], vec![0f32; stats]);
    let (e, mx, sm) = (OutPtr(ex.as_mut_ptr()), OutPtr(maxes.as_mut_ptr()), OutPtr(sums.as_mut_ptr()));
    // Task i: KV head kvh, share k: its positions, its block of `ex` and its first stats row.
    let task_of = |i: usize| {
        let (kvh, k) = (i / shares, i % shares);
        let js = span(k);
        let at = (kvh * s + k * per) * g..(kvh * s + k * per) * g + g * js.len();
        (kvh, js, at, (kvh * shares + k) * g)
    };
    crate::threads::Pool::global().run(threads, hkv * shares, &|task| {
        let (kvh, js, at, st) = task_of(task);
        let n = js.len();
        // SAFETY: task (kvh, k) alone writes its block of `ex` and its rows of `maxes` / `sums`.
        let (block, mk, sk) = unsafe { (e.slice(at.start, at.len()), mx.slice(st, g), sm.slice(st, g)) };
        let rows = &a[kvh * g * dk..(kvh + 1) * g * dk];
        let first = (js.start * hkv + kvh) * dk;
        match kc {
            Rows::F32(c) => crate::simd::matmul_nt_acc(block, n, rows, dk, &c[first..], hkv * dk, g, dk, n),
            Rows::F16(c) => crate::simd::matmul_nt_acc(block, n, rows, dk, &c[first..], hkv * dk, g, dk, n),
        }
        share_exponentials(block, n, scale, mk, sk);
    });
    let factor = share_factors(&maxes, &sums, shares, g);
    let mut partial = vec![0f32; stats * dv];
    let (e, po) = (OutPtr(ex.as_mut_ptr()), OutPtr(partial.as_mut_ptr()));
    crate::threads::Pool::global().run(threads, hkv * shares, &|task| {
        let (kvh, js, at, st) = task_of(task);
        let n = js.len();
        // SAFETY: task (kvh, k) alone reads and writes its block of `ex` and its rows of `partial`.
        let (block, ok) = unsafe { (e.slice(at.start, at.len()), po.slice(st * dv, g * dv)) };
        share_probabilities(block, n, &factor[st..st + g], f16_kq);
        let first = (js.start * hkv + kvh) * dv;
        match vc {
            Rows::F32(c) => crate::simd::matmul_acc_strided(ok, dv, block, n, &c[first..], hkv * dv, g, n, dv),
            Rows::F16(c) => crate::simd::matmul_acc_strided(ok, dv, block, n, &c[first..], hkv * dv, g, n, dv),
        }
    });
    sum_shares(out, &partial, shares, g, dv);
}
