//! A teacher's dense next-token row reduced to what the signal store keeps: the top-k
//! log-probabilities ([`top_k`]) and how far the store's reconstruction of the row is from it
//! ([`reconstruction_kl`]). Both run once per captured position over the whole vocabulary
//! (49,152 values for SmolLM2), so each is one pass without allocation of the vocabulary's size;
//! [`top_k_ref`] and [`reconstruction_kl_ref`] are the plain forms they are tested against.

use k3_kernels::ops::exp_fast;

use crate::signals::TopK;

/// Most k for [`top_k`]'s one-pass form; beyond it each entering value's insertion (O(k)) would
/// cost more than a partial sort of every id.
const SCAN_MAX_K: usize = 256;

/// Top-k of a dense log-probability row, descending (total order; among equal values the lower
/// id first), with the log of the remaining mass. Up to [`SCAN_MAX_K`], one pass keeping the k
/// largest in order: a value enters only when it beats the smallest kept one, so past the first
/// few hundred values almost every one costs a comparison (the partial sort of every id it
/// replaces moved them all). Beyond, that partial sort ([`top_k_ref`]).
pub fn top_k(logprobs: &[f32], k: usize) -> TopK {
    let k = k.min(logprobs.len());
    if k > SCAN_MAX_K {
        return top_k_ref(logprobs, k);
    }
    // (total-order key, id), descending by key.
    let mut top: Vec<(i32, u32)> = Vec::with_capacity(k + 1);
    if k > 0 {
        for (i, &v) in logprobs.iter().enumerate() {
            let key = order_key(v);
            if top.len() == k {
                if key <= top[k - 1].0 {
                    continue;
                }
                top.pop();
            }
            let at = top.partition_point(|&(kk, _)| kk >= key);
            top.insert(at, (key, i as u32));
        }
    }
    let ids: Vec<u32> = top.iter().map(|&(_, i)| i).collect();
    finish(logprobs, ids)
}

/// [`top_k`] by a partial sort of every id, in the same order (descending by value, then
/// ascending by id).
pub fn top_k_ref(logprobs: &[f32], k: usize) -> TopK {
    let k = k.min(logprobs.len());
    let order = |a: &u32, b: &u32| logprobs[*b as usize].total_cmp(&logprobs[*a as usize]).then(a.cmp(b));
    let mut idx: Vec<u32> = (0..logprobs.len() as u32).collect();
    if k > 0 {
        idx.select_nth_unstable_by(k - 1, order);
    }
    idx.truncate(k);
    idx.sort_by(order);
    finish(logprobs, idx)
}

/// The [`TopK`] of the chosen ids, in order: their log-probabilities and the log of the rest.
fn finish(logprobs: &[f32], ids: Vec<u32>) -> TopK {
    let kept: f64 = ids.iter().map(|&i| (logprobs[i as usize] as f64).exp()).sum();
    let tail = (1.0 - kept).max(0.0);
    TopK {
        logprobs: ids.iter().map(|&i| logprobs[i as usize]).collect(),
        ids,
        tail_logmass: if tail > 0.0 { tail.ln() as f32 } else { f32::NEG_INFINITY },
    }
}

/// `f32::total_cmp`'s order as an integer key (the same bit transform).
fn order_key(v: f32) -> i32 {
    let b = v.to_bits() as i32;
    b ^ (((b >> 31) as u32) >> 1) as i32
}

/// KL(p ‖ q̂) in nats of a dense distribution (log-probs) against its stored reconstruction: the
/// decoded top-k, and the tail mass spread uniformly over the other tokens. In closed form,
/// with q̂ = e^l / Z on the kept ids (Z = their mass plus the tail's) and q_rest elsewhere:
/// Σ p·lp − Σ_kept p·(l − ln Z) − ln q_rest · (Σ p − Σ_kept p), so the only pass over the
/// vocabulary sums p·lp and p, with p = e^lp by [`exp_fast`] (tokens under e^−87 add nothing).
pub fn reconstruction_kl(dense: &[f32], t: &TopK) -> f64 {
    let v = dense.len();
    let kept: f64 = t.logprobs.iter().map(|&l| (l as f64).exp()).sum();
    let tail = (t.tail_logmass as f64).exp().max(1e-30);
    let norm = kept + tail;
    let (all_plp, all_p) = mass_sums(dense);
    let (mut kept_plnq, mut kept_p) = (0f64, 0f64);
    for (&i, &l) in t.ids.iter().zip(&t.logprobs) {
        let p = prob(dense[i as usize]) as f64;
        if p > 0.0 {
            kept_plnq += p * (l as f64 - norm.ln());
            kept_p += p;
        }
    }
    // The mass outside the kept ids, at q_rest each (none when every id is kept: there the
    // difference is rounding, which ln q_rest, down to ln 1e-30, would magnify).
    let rest_term = if t.ids.len() >= v {
        0.0
    } else {
        let ln_rest = (tail / norm / (v - t.ids.len()) as f64).ln();
        ln_rest * (all_p - kept_p).max(0.0)
    };
    all_plp - kept_plnq - rest_term
}

/// e^lp, or 0 below e^−87 (and for NaN), where [`exp_fast`] clamps.
#[inline(always)]
fn prob(lp: f32) -> f32 {
    if lp > -87.0 {
        exp_fast(lp)
    } else {
        0.0
    }
}

/// (Σ p·lp, Σ p) over a row, p = [`prob`]: sixteen f32 lanes a piece of 1024 values, the
/// pieces added in f64.
fn mass_sums(dense: &[f32]) -> (f64, f64) {
    let (mut plp, mut p) = (0f64, 0f64);
    for piece in dense.chunks(1024) {
        let (mut a, mut b) = ([0f32; 16], [0f32; 16]);
        let mut c16 = piece.chunks_exact(16);
        for c in &mut c16 {
            for l in 0..16 {
                let e = prob(c[l]);
                a[l] += e * c[l].max(-87.0);
                b[l] += e;
            }
        }
        for &lp in c16.remainder() {
            let e = prob(lp);
            a[0] += e * lp.max(-87.0);
            b[0] += e;
        }
        plp += a.iter().map(|&x| x as f64).sum::<f64>();
        p += b.iter().map(|&x| x as f64).sum::<f64>();
    }
    (plp, p)
}

/// [`reconstruction_kl`] term by term: q̂ of every token, then Σ p·(lp − ln q̂) in f64.
pub fn reconstruction_kl_ref(dense: &[f32], t: &TopK) -> f64 {
    let v = dense.len();
    let mut q = vec![f64::NAN; v];
    let kept: f64 = t.logprobs.iter().map(|&l| (l as f64).exp()).sum();
    let tail = (t.tail_logmass as f64).exp().max(1e-30);
    let norm = kept + tail;
    let rest = tail / norm / (v - t.ids.len()).max(1) as f64;
    for (&i, &l) in t.ids.iter().zip(&t.logprobs) {
        q[i as usize] = (l as f64).exp() / norm;
    }
    dense
        .iter()
        .zip(&q)
        .map(|(&lp, &qi)| {
            let p = (lp as f64).exp();
            let qi = if qi.is_nan() { rest } else { qi };
            if p > 0.0 {
                p * (lp as f64 - qi.ln())
            } else {
                0.0
            }
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log-softmax row of `n` logits spread by `spread`, some ruled out (−1e4, −inf).
    fn row(n: usize, spread: f32, seed: u64) -> Vec<f32> {
        let mut rng = k3_kernels::testing::Rng::new(seed);
        let mut x = rng.normals(n, spread);
        if n > 40 {
            x[3] = -1e4;
            x[n - 2] = f32::NEG_INFINITY;
        }
        let m = x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
        let z: f64 = x.iter().map(|&v| ((v - m) as f64).exp()).sum();
        let lz = m + z.ln() as f32;
        x.iter().map(|&v| v - lz).collect()
    }

    /// The one-pass top-k against the partial sort: the same values in the same order, the same
    /// ids, the same tail, for k from 0 past the row's length (above 256 `top_k` is the partial
    /// sort itself), on distinct values and on values rounded to quarters (many ties).
    #[test]
    fn top_k_matches_its_reference() {
        for (n, k, seed) in
            [(1, 1, 1), (5, 0, 2), (40, 8, 3), (500, 32, 4), (49_152, 32, 5), (300, 300, 6), (64, 99, 7)]
        {
            let lp = row(n, 4.0, seed);
            let tied: Vec<f32> = lp.iter().map(|&x| (x * 4.0).round() / 4.0).collect();
            for lp in [lp, tied] {
                let (got, want) = (top_k(&lp, k), top_k_ref(&lp, k));
                assert_eq!(got.ids, want.ids, "n {n}, k {k}");
                assert_eq!(got.logprobs, want.logprobs, "n {n}, k {k}");
                assert_eq!(got.tail_logmass.to_bits(), want.tail_logmass.to_bits(), "n {n}, k {k}");
            }
        }
    }

    /// Equal values: the lower id first, and at the cut the lower ids kept, in both forms (k up
    /// to [`SCAN_MAX_K`] and beyond it).
    #[test]
    fn top_k_breaks_ties_by_the_lower_id() {
        let lp = [-3.0, -1.0, -2.0, -1.0, -2.0, -2.0, -5.0];
        assert_eq!(top_k(&lp, 4).ids, vec![1, 3, 2, 4]);
        // 600 values in 6 levels, each id's level fixed by id mod 6: the k-th largest id order.
        let lv: Vec<f32> = (0..600).map(|i| -((i % 6) as f32)).collect();
        for k in [7, 100, 250, 300, 599] {
            let mut want: Vec<u32> = (0..600).collect();
            want.sort_by_key(|&i| (i % 6, i));
            want.truncate(k);
            assert_eq!(top_k(&lv, k).ids, want, "k {k}");
        }
        // Ascending values: every one enters and pushes out the smallest.
        let up: Vec<f32> = (0..100).map(|i| -100.0 + i as f32).collect();
        assert_eq!(top_k(&up, 3).ids, vec![99, 98, 97]);
    }

    /// The closed form against the term-by-term sum, on rows with ruled-out tokens, for exact
    /// and quantized top-k (the store's 1/16-nat rounding), small and vocabulary-sized rows.
    #[test]
    fn reconstruction_kl_matches_its_reference() {
        for (n, k, spread, seed) in [(50, 4, 2.0, 11), (500, 32, 4.0, 12), (49_152, 32, 6.0, 13), (64, 64, 3.0, 14)] {
            let lp = row(n, spread, seed);
            let mut t = top_k(&lp, k);
            for quantize in [false, true] {
                if quantize {
                    t.logprobs.iter_mut().for_each(|l| *l = (*l * 16.0).round() / 16.0);
                }
                let (got, want) = (reconstruction_kl(&lp, &t), reconstruction_kl_ref(&lp, &t));
                assert!(got.is_finite() && want.is_finite(), "n {n}, k {k}: {got} against {want}");
                assert!(
                    (got - want).abs() <= 2e-6 + 1e-5 * want.abs(),
                    "n {n}, k {k}, quantized {quantize}: {got} against {want}"
                );
            }
        }
    }
}
