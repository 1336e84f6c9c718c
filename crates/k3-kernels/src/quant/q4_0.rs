//! Q4_0: blocks of 32 as `f16 d; u8 qs[16]`, value `d·(q − 8)`; element j < 16 is the low nibble
//! of qs[j], element j + 16 the high nibble (ggml `block_q4_0`).

use super::float::{f16_at, f16_le};

pub const BLOCK: usize = 32;
pub const BYTES: usize = 18;

/// ggml `quantize_row_q4_0_ref`: d = (value of largest |x|) / −8, q = min(15, (i8)(x/d + 8.5)).
pub fn quantize_ref(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / BLOCK * BYTES);
    for blk in x.chunks_exact(BLOCK) {
        let (_, max) = super::abs_max(blk);
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16_le(d));
        for j in 0..BLOCK / 2 {
            let x0 = blk[j] * id;
            let x1 = blk[BLOCK / 2 + j] * id;
            let q0 = ((x0 + 8.5) as i8).min(15) as u8;
            let q1 = ((x1 + 8.5) as i8).min(15) as u8;
            out.push(q0 | (q1 << 4));
        }
    }
    out
}

pub fn dequantize_ref(b: &[u8], out: &mut [f32]) {
    for (blk, o) in b.chunks_exact(BYTES).zip(out.chunks_exact_mut(BLOCK)) {
        let d = f16_at(blk);
        for j in 0..BLOCK / 2 {
            let q = blk[2 + j];
            o[j] = ((q & 0x0F) as i32 - 8) as f32 * d;
            o[j + BLOCK / 2] = ((q >> 4) as i32 - 8) as f32 * d;
        }
    }
}

/// Importance-weighted Q4_0 (in the spirit of llama.cpp's imatrix): the same block layout, with
/// each block's scale chosen to minimise Σ_j w_j (x_j − d·(q_j − 8))², where `w` (one weight per
/// element of `x`) says how much each element's error costs (e.g. the mean squared activation its
/// input column meets). Candidates are the scales
/// max/(−8 + δ) for δ ∈ [−1, 1] in steps of 0.1 (δ = 0 is [`quantize_ref`]'s), each followed by one
/// least-squares refit of d to its codes; the best by weighted error wins, so the result is never
/// worse than the reference under `w`.
pub fn quantize_weighted(x: &[f32], w: &[f32]) -> Vec<u8> {
    assert_eq!(x.len(), w.len(), "one weight per element");
    let mut out = Vec::with_capacity(x.len() / BLOCK * BYTES);
    for (blk, wb) in x.chunks_exact(BLOCK).zip(w.chunks_exact(BLOCK)) {
        let (d, q) = best_block(blk, wb);
        out.extend_from_slice(&f16_le(d));
        for j in 0..BLOCK / 2 {
            out.push(q[j] | (q[BLOCK / 2 + j] << 4));
        }
    }
    out
}

/// Codes for `blk` at scale `d`, as the reference rounds them.
fn codes(blk: &[f32], d: f32) -> [u8; BLOCK] {
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut q = [0u8; BLOCK];
    for (qj, &v) in q.iter_mut().zip(blk) {
        *qj = ((v * id + 8.5) as i8).clamp(0, 15) as u8;
    }
    q
}

/// Weighted squared error of `blk` coded as `q` at the f16-rounded scale `d`.
fn werr(blk: &[f32], w: &[f32], d: f32, q: &[u8; BLOCK]) -> f64 {
    let d = half_round(d);
    blk.iter().zip(w).zip(q).map(|((&v, &wj), &qj)| wj as f64 * ((v - d * (qj as f32 - 8.0)) as f64).powi(2)).sum()
}

fn half_round(d: f32) -> f32 {
    f16_at(&f16_le(d))
}

fn best_block(blk: &[f32], w: &[f32]) -> (f32, [u8; BLOCK]) {
    let (amax, max) = super::abs_max(blk);
    let d0 = max / -8.0;
    let q0 = codes(blk, d0);
    let mut best = (werr(blk, w, d0, &q0), d0, q0);
    if amax == 0.0 {
        return (best.1, best.2);
    }
    for step in -10..=10 {
        let d = max / (-8.0 + 0.1 * step as f32);
        let q = codes(blk, d);
        // Least-squares scale for these codes: d* = Σ w x (q−8) / Σ w (q−8)².
        let (mut num, mut den) = (0f64, 0f64);
        for ((&v, &wj), &qj) in blk.iter().zip(w).zip(&q) {
            let l = qj as f64 - 8.0;
            num += wj as f64 * v as f64 * l;
            den += wj as f64 * l * l;
        }
        for cand in [d, if den > 0.0 { (num / den) as f32 } else { d }] {
            let q = codes(blk, cand);
            let e = werr(blk, w, cand, &q);
            if e < best.0 {
                best = (e, cand, q);
            }
        }
    }
    (best.1, best.2)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }

    #[test]
    fn weighted_never_loses_to_the_reference_under_its_weights_and_wins_on_average() {
        let mut s = 7u64;
        let cols = 128;
        let x: Vec<f32> = (0..cols * 16).map(|_| lcg(&mut s) * 0.1).collect();
        // Heavy-tailed importance, as activations have: a few columns dominate.
        let w: Vec<f32> = (0..cols).map(|i| if i % 17 == 0 { 50.0 } else { 0.5 + lcg(&mut s).abs() }).collect();
        let tiled: Vec<f32> = (0..x.len()).map(|i| w[i % cols]).collect();
        let (reference, weighted) = (quantize_ref(&x), quantize_weighted(&x, &tiled));
        assert_eq!(reference.len(), weighted.len(), "the same bytes per block");
        let (mut a, mut b) = (vec![0f32; x.len()], vec![0f32; x.len()]);
        dequantize_ref(&reference, &mut a);
        dequantize_ref(&weighted, &mut b);
        let err = |y: &[f32], blk: usize| -> f64 {
            (0..BLOCK)
                .map(|j| {
                    let i = blk * BLOCK + j;
                    w[i % cols] as f64 * ((x[i] - y[i]) as f64).powi(2)
                })
                .sum()
        };
        let blocks = x.len() / BLOCK;
        let (mut ea, mut eb) = (0.0, 0.0);
        for blk in 0..blocks {
            let (r, q) = (err(&a, blk), err(&b, blk));
            assert!(q <= r * (1.0 + 1e-6) + 1e-12, "block {blk}: weighted {q} > reference {r}");
            ea += r;
            eb += q;
        }
        assert!(eb < 0.8 * ea, "the search pays on the whole: {eb} vs {ea}");
        // Uniform weights: still no worse than the reference in plain squared error.
        let u = vec![1.0; x.len()];
        let mut c = vec![0f32; x.len()];
        dequantize_ref(&quantize_weighted(&x, &u), &mut c);
        let se = |y: &[f32]| x.iter().zip(y).map(|(p, q)| ((p - q) as f64).powi(2)).sum::<f64>();
        assert!(se(&c) <= se(&a) * (1.0 + 1e-6));
    }
}
