//! The plain-loop path: integer block sums, one float multiply-add per block, then the offset
//! term, on either layout. The SIMD paths compute exactly this, several blocks and rows at a time.

use super::{offset_term, OutMat, Packed, QActs, BLOCK};

/// # Safety
/// `out` must be valid for rows 0..hi − lo and tokens 0..T.
pub unsafe fn gemm(w: &Packed, a: &QActs, lo: usize, hi: usize, out: OutMat) {
    let n = w.nbp;
    let (mut dw, mut mu) = (vec![0f32; n], vec![0f32; n]);
    let mut codes = vec![0u8; n * BLOCK];
    for o in lo..hi {
        w.row_scales(o, &mut dw, &mut mu);
        w.row_codes(o, &mut codes);
        for t in 0..a.t {
            let (xq, dx) = a.row(t);
            let mut acc = 0f32;
            for b in 0..n {
                let s: i32 = codes[b * BLOCK..(b + 1) * BLOCK]
                    .iter()
                    .zip(&xq[b * BLOCK..(b + 1) * BLOCK])
                    .map(|(&u, &x)| u as i32 * x as i32)
                    .sum();
                acc += dw[b] * dx[b] * s as f32;
            }
            out.put(o - lo, t, acc + offset_term(&mu, a.s_for(w.kind, t)));
        }
    }
}
