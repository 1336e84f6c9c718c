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

/// Row `i` of `xin = [tail ; x]` (tail: `hist` rows of `ch`).
#[inline]
fn xin_row<'a>(i: usize, hist: usize, ch: usize, tail: &'a [f32], x: &'a [f32]) -> &'a [f32] {
    if i < hist {
        &tail[i * ch..(i + 1) * ch]
    } else {
        &x[(i - hist) * ch..(i - hist + 1) * ch]
    }
}
