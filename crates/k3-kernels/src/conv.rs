//! Causal depthwise short convolution with a carried tail (KDA's q/k/v conv, architecture.md §1(d)).

/// `y[t, c] = Σ_j w[c, j] · xin[t + j, c]` over `xin = [tail ; x]`, then SiLU; the tail becomes the
/// last `Kc − 1` rows of `xin` (the pre-conv inputs a decode step needs).
///
/// # Shapes
/// x, y: [T, Ch] row-major; w: [Ch, Kc]; tail: [Kc − 1, Ch] (updated in place). Output rows are
/// independent given `xin`, so they are split over `threads`.
pub fn short_conv_silu(y: &mut [f32], x: &[f32], w: &[f32], tail: &mut [f32], ch: usize, kc: usize, threads: usize) {
    let t = x.len() / ch;
    debug_assert_eq!(w.len(), ch * kc);
    debug_assert_eq!(tail.len(), (kc - 1) * ch);
    let mut xin = Vec::with_capacity((t + kc - 1) * ch);
    xin.extend_from_slice(tail);
    xin.extend_from_slice(x);
    // Taps as [Kc, Ch] so that each output row is Kc elementwise multiply-adds over channels
    // (vectorised), summed in the same order j = 0..Kc as before.
    let wt: Vec<f32> = (0..kc).flat_map(|j| (0..ch).map(move |c| w[c * kc + j])).collect();
    crate::threads::par_rows(&mut y[..t * ch], ch, threads, |r0, block| {
        for (i, yr) in block.chunks_exact_mut(ch).enumerate() {
            let r = r0 + i;
            yr.fill(0.0);
            for j in 0..kc {
                let (xr, wj) = (&xin[(r + j) * ch..(r + j + 1) * ch], &wt[j * ch..(j + 1) * ch]);
                for ((o, &a), &b) in yr.iter_mut().zip(wj).zip(xr) {
                    *o += a * b;
                }
            }
        }
        crate::ops::silu_inplace(block);
    });
    let start = t * ch; // rows t .. t + kc − 1 of xin
    tail.copy_from_slice(&xin[start..start + (kc - 1) * ch]);
}
