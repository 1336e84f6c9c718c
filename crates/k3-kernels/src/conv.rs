//! Causal depthwise short convolution with a carried tail (KDA's q/k/v conv, architecture.md §1(d)).

/// `y[t, c] = Σ_j w[c, j] · xin[t + j, c]` over `xin = [tail ; x]`, then SiLU; the tail becomes the
/// last `Kc − 1` rows of `xin` (the pre-conv inputs a decode step needs).
///
/// # Shapes
/// x, y: [T, Ch] row-major; w: [Ch, Kc]; tail: [Kc − 1, Ch] (updated in place)
pub fn short_conv_silu(y: &mut [f32], x: &[f32], w: &[f32], tail: &mut [f32], ch: usize, kc: usize) {
    let t = x.len() / ch;
    debug_assert_eq!(w.len(), ch * kc);
    debug_assert_eq!(tail.len(), (kc - 1) * ch);
    let mut xin = Vec::with_capacity((t + kc - 1) * ch);
    xin.extend_from_slice(tail);
    xin.extend_from_slice(x);
    for r in 0..t {
        for c in 0..ch {
            let mut acc = 0.0f32;
            for j in 0..kc {
                acc += w[c * kc + j] * xin[(r + j) * ch + c];
            }
            y[r * ch + c] = crate::ops::silu(acc);
        }
    }
    let start = t * ch; // rows t .. t + kc − 1 of xin
    tail.copy_from_slice(&xin[start..start + (kc - 1) * ch]);
}
