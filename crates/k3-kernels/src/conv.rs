//! Causal depthwise short convolution with a carried tail (KDA's q/k/v conv, architecture.md §1(d)).

/// `y[t, c] = Σ_j w[c, j] · xin[t + j, c]` over `xin = [tail ; x]`, then SiLU; the tail becomes the
/// last `Kc − 1` rows of `xin` (the pre-conv inputs a decode step needs).
///
/// # Shapes
/// x, y: [T, Ch] row-major; w: [Ch, Kc]; tail: [Kc − 1, Ch] (updated in place). Output rows are
/// independent given `xin`, so they are split over `threads`; `xin` is never built, its rows are
/// read from the tail or from x.
pub fn short_conv_silu(y: &mut [f32], x: &[f32], w: &[f32], tail: &mut [f32], ch: usize, kc: usize, threads: usize) {
    let t = x.len() / ch;
    let hist = kc - 1;
    debug_assert_eq!(w.len(), ch * kc);
    debug_assert_eq!(tail.len(), hist * ch);
    // Taps as [Kc, Ch] so that each output row is Kc elementwise multiply-adds over channels
    // (vectorised), summed in the same order j = 0..Kc as before.
    let wt: Vec<f32> = (0..kc).flat_map(|j| (0..ch).map(move |c| w[c * kc + j])).collect();
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
    let new_tail: Vec<f32> = (t..t + hist).flat_map(|i| xin_row(i, hist, ch, old, x).to_vec()).collect();
    tail.copy_from_slice(&new_tail);
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
