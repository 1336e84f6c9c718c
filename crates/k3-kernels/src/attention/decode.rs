//! One query token against a long GQA cache with its positions split over the threads, as
//! flash-decoding does and as [`super::mla`]'s `decode_split` does for the latent cache: with
//! few KV heads (SmolLM2 has 3) one task per head left a thread idle, and each task streamed its
//! head's whole cache.

use super::{Heads, OutPtr, Rows};

/// Fewest visible positions at which a one-token step splits them over the threads.
pub(crate) const SPLIT_MIN: usize = 1024;

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
        for (i, row) in block.chunks_exact_mut(n).enumerate() {
            mk[i] = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) * scale;
            sk[i] = crate::ops::exp_shifted_sum(row, scale, mk[i]);
        }
    });
    // e^(m_k − m) / Σ_k e^(m_k − m)·sum_k: what turns share k's exponentials into probabilities.
    let mut factor = vec![0f32; stats];
    for kvh in 0..hkv {
        for i in 0..g {
            let at = |k: usize| (kvh * shares + k) * g + i;
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
    let mut partial = vec![0f32; stats * dv];
    let (e, po) = (OutPtr(ex.as_mut_ptr()), OutPtr(partial.as_mut_ptr()));
    crate::threads::Pool::global().run(threads, hkv * shares, &|task| {
        let (kvh, js, at, st) = task_of(task);
        let n = js.len();
        // SAFETY: task (kvh, k) alone reads and writes its block of `ex` and its rows of `partial`.
        let (block, ok) = unsafe { (e.slice(at.start, at.len()), po.slice(st * dv, g * dv)) };
        for (i, row) in block.chunks_exact_mut(n).enumerate() {
            let f = factor[st + i];
            row.iter_mut().for_each(|p| *p *= f);
            if f16_kq {
                crate::simd::round_f16_inplace(row);
            }
        }
        let first = (js.start * hkv + kvh) * dv;
        match vc {
            Rows::F32(c) => crate::simd::matmul_acc_strided(ok, dv, block, n, &c[first..], hkv * dv, g, n, dv),
            Rows::F16(c) => crate::simd::matmul_acc_strided(ok, dv, block, n, &c[first..], hkv * dv, g, n, dv),
        }
    });
    for kvh in 0..hkv {
        for i in 0..g {
            let dst = &mut out[(kvh * g + i) * dv..(kvh * g + i + 1) * dv];
            dst.fill(0.0);
            for k in 0..shares {
                let src = ((kvh * shares + k) * g + i) * dv;
                crate::ops::axpy(dst, 1.0, &partial[src..src + dv]);
            }
        }
    }
}
