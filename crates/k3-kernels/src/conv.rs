//! Causal depthwise short convolution with a carried tail (KDA's q/k/v conv, architecture.md §1(d)).

/// The taps `w` [Ch, Kc] (HF's depthwise conv weight) as [Kc, Ch], the layout
/// [`short_conv_silu`] reads: each output row is then Kc elementwise multiply-adds over channels.
pub fn taps_by_offset(w: &[f32], ch: usize, kc: usize) -> Vec<f32> {
    debug_assert_eq!(w.len(), ch * kc);
    (0..kc).flat_map(|j| (0..ch).map(move |c| w[c * kc + j])).collect()
}

/// `y[t, c] = Σ_j w[c, j] · xin[t + j, c]` over `xin = [tail ; x]`, then SiLU; the tail becomes the
/// last `Kc − 1` rows of `xin` (the pre-conv inputs a decode step needs).
///
/// # Shapes
/// x, y: [T, Ch] row-major; wt: [Kc, Ch] ([`taps_by_offset`]); tail: [Kc − 1, Ch] (updated in
/// place). Output rows are independent given `xin`, so they are split over `threads`; `xin` is
/// never built, its rows are read from the tail or from x. Nothing is allocated (a decode step
/// calls this three times per KDA layer).
pub fn short_conv_silu(y: &mut [f32], x: &[f32], wt: &[f32], tail: &mut [f32], ch: usize, kc: usize, threads: usize) {
    let t = x.len() / ch;
    let hist = kc - 1;
    debug_assert_eq!(wt.len(), ch * kc);
    debug_assert_eq!(tail.len(), hist * ch);
    let old: &[f32] = tail;
    crate::threads::par_rows(&mut y[..t * ch], ch, threads, |r0, block| {
        for (i, yr) in block.chunks_exact_mut(ch).enumerate() {
            yr.fill(0.0);
            for j in 0..kc {
                let src = xin_row(r0 + i + j, hist, ch, old, x);
                for ((o, &a), &b) in yr.iter_mut().zip(&wt[j * ch..(j + 1) * ch]).zip(src) {
                    *o += a * b;
                }
            }
        }
        crate::ops::silu_inplace(block);
    });
    // New tail = rows t..t+hist of xin: the old tail's last hist − t rows (if any), then x's last
    // min(t, hist) rows.
    let keep = hist.saturating_sub(t);
    tail.copy_within((hist - keep) * ch..hist * ch, 0);
    let from_x = hist - keep;
    tail[keep * ch..].copy_from_slice(&x[(t - from_x) * ch..t * ch]);
}

/// [`short_conv_silu`] for one token over channels `c0..c0 + y.len()` only (the engine's fused
/// KDA decode runs it per head, in parallel): the same sums in the same order, so the same bits;
/// those channels of the tail advance by one token.
///
/// # Shapes
/// y: [n]; x: [Ch] (the token's pre-conv input); wt: [Kc, Ch]; tail: [Kc − 1, Ch]
///
/// # Safety
/// `tail` must be valid for reads and writes of `(Kc − 1)·Ch` floats, nothing else may access
/// channels c0..c0 + n of them during the call, and `y`, `x`, `wt` must not overlap them.
pub unsafe fn short_conv_silu_step(
    y: &mut [f32],
    x: &[f32],
    wt: &[f32],
    tail: *mut f32,
    ch: usize,
    kc: usize,
    c0: usize,
) {
    let (n, hist) = (y.len(), kc - 1);
    assert!(c0 + n <= ch && x.len() == ch && wt.len() == kc * ch);
    // SAFETY: row r's channels c0..c0 + n lie inside the tail (r < hist, c0 + n ≤ Ch), and the
    // caller gives this call sole access to them.
    let row = |r: usize| unsafe { std::slice::from_raw_parts_mut(tail.add(r * ch + c0), n) };
    y.fill(0.0);
    for j in 0..kc {
        let src: &[f32] = if j < hist { row(j) } else { &x[c0..c0 + n] };
        for ((o, &a), &b) in y.iter_mut().zip(&wt[j * ch + c0..j * ch + c0 + n]).zip(src) {
            *o += a * b;
        }
    }
    crate::ops::silu_inplace(y);
    for r in 1..hist {
        row(r - 1).copy_from_slice(row(r));
    }
    if hist > 0 {
        row(hist - 1).copy_from_slice(&x[c0..c0 + n]);
    }
}

/// Row `i` of `xin = [tail ; x]` (tail: `hist` rows of `ch`).
#[inline]
fn xin_row<'a>(i: usize, hist: usize, ch: usize, tail: &'a [f32], x: &'a [f32]) -> &'a [f32] {
    if i < hist {
        &tail[i * ch..(i + 1) * ch]
    } else {
        &x[(i - hist) * ch..(i - hist + 1) * ch]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;

    /// The per-channel-range step gives short_conv_silu's bits for one token, tail included,
    /// whatever ranges the channels are cut into.
    #[test]
    fn step_over_channel_ranges_matches_the_full_conv() {
        let mut rng = Rng::new(5);
        for (ch, kc, cut) in [(64, 4, 16), (48, 2, 48), (40, 3, 7)] {
            let wt = taps_by_offset(&rng.normals(ch * kc, 0.5), ch, kc);
            let tail0 = rng.normals((kc - 1) * ch, 1.0);
            let (mut tail_full, mut tail_step) = (tail0.clone(), tail0);
            for _ in 0..3 {
                let x = rng.normals(ch, 1.0);
                let mut want = vec![0f32; ch];
                short_conv_silu(&mut want, &x, &wt, &mut tail_full, ch, kc, 1);
                let mut got = vec![0f32; ch];
                for c0 in (0..ch).step_by(cut) {
                    let n = cut.min(ch - c0);
                    // SAFETY: tail_step holds [Kc − 1, Ch]; this call alone touches it.
                    unsafe { short_conv_silu_step(&mut got[c0..c0 + n], &x, &wt, tail_step.as_mut_ptr(), ch, kc, c0) };
                }
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "ch {ch} kc {kc} cut {cut}");
                assert_eq!(bits(&tail_step), bits(&tail_full), "tail, ch {ch} kc {kc} cut {cut}");
            }
        }
    }
}
