//! The plain-loop path: integer block sums, one float multiply-add per block (per half block for
//! Q6_K, Q3_K and Q2_K, whose scales change every 16 codes), then the offset term, on either layout. The SIMD
//! paths compute exactly this, several blocks and rows at a time.

use super::{offset_term, OutMat, Packed, QActs, BLOCK};

/// # Safety
/// `out` must be valid for rows 0..hi − lo and tokens 0..T.
pub unsafe fn gemm(w: &Packed, a: &QActs, lo: usize, hi: usize, out: OutMat) {
    let n = w.nbp;
    // Codes per scale: a block, or half a block for the kinds whose scales change every 16 codes.
    let (units, per) = if w.kind.per_half() { (2 * n, BLOCK / 2) } else { (n, BLOCK) };
    let (mut dw, mut mu) = (vec![0f32; units], vec![0f32; units]);
    let mut codes = vec![0u8; n * BLOCK];
    for o in lo..hi {
        if w.kind.per_half() {
            w.half_scales(o, &mut dw, &mut mu);
        } else {
            w.row_scales(o, &mut dw, &mut mu);
        }
        w.row_code_values(o, &mut codes);
        for t in 0..a.t {
            let (xq, dx) = a.row(t);
            let mut acc = 0f32;
            for u in 0..units {
                let s: i32 = codes[u * per..(u + 1) * per]
                    .iter()
                    .zip(&xq[u * per..(u + 1) * per])
                    .map(|(&c, &x)| c as i32 * x as i32)
                    .sum();
                acc += dw[u] * dx[u * per / BLOCK] * s as f32;
            }
            out.put(o - lo, t, acc + offset_term(&mu, a.s_for(w.kind, t)));
        }
    }
}
