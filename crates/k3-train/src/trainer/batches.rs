//! Deterministic, random-access training batches and fixed validation windows.
//!
//! Row r of micro-batch m of optimiser step s starts at `hash(seed, s, m, r) mod (len − T)`: the
//! batch order is a pure function of the seed and the step, so a resumed run reads exactly the
//! batches the uninterrupted run would have (no sampler state to save). Windows are T + 1 tokens of
//! the packed stream (documents joined by the separator): inputs are the first T, targets the last T.

use k3_data::shards::TokenSet;
use tch::Tensor;

use crate::{Error, Result};

/// SplitMix64: a stateless, well-mixed 64-bit hash.
fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The random draw behind row `r` of micro-batch `micro` of step `step`: a pure function of the
/// seed and the position, so resumed runs read the same rows (training windows and store windows).
pub(crate) fn row_hash(seed: u64, step: u64, micro: u64, r: u64) -> u64 {
    splitmix64(seed ^ splitmix64(step ^ splitmix64(micro ^ splitmix64(r))))
}

/// (inputs, targets), both [B, T] int64.
pub struct Batch {
    pub inputs: Tensor,
    pub targets: Tensor,
}

/// Stack windows of `t + 1` tokens starting at `starts` into a batch.
fn windows(set: &TokenSet, starts: &[usize], t: usize) -> Batch {
    let mut buf = Vec::new();
    let mut all = Vec::with_capacity(starts.len() * (t + 1));
    for &s in starts {
        set.read(s, t + 1, &mut buf);
        all.extend(buf.iter().map(|&x| x as i64));
    }
    let w = Tensor::from_slice(&all).view([starts.len() as i64, (t + 1) as i64]);
    Batch { inputs: w.narrow(1, 0, t as i64), targets: w.narrow(1, 1, t as i64) }
}

/// Micro-batch `micro` of optimiser step `step`: `b` rows of `t` tokens.
pub fn train_batch(set: &TokenSet, seed: u64, step: u64, micro: u64, b: usize, t: usize) -> Result<Batch> {
    if set.len < t + 2 {
        return Err(Error::Invalid(format!(
            "the training split has {} tokens, fewer than one window of data.seq_len + 1 = {}; use a shorter seq_len or more data",
            set.len,
            t + 1
        )));
    }
    let span = (set.len - t - 1) as u64;
    let starts: Vec<usize> = (0..b as u64).map(|r| (row_hash(seed, step, micro, r) % span) as usize).collect();
    Ok(windows(set, &starts, t))
}

/// `n` validation windows of `t + 1` tokens, evenly spread over the split (the same every call).
/// Fewer when the split is short; errors when it cannot hold one.
pub fn val_starts(set: &TokenSet, n: usize, t: usize) -> Result<Vec<usize>> {
    if set.len < t + 1 {
        return Err(Error::Invalid(format!(
            "the validation split has {} tokens, fewer than one window of {} tokens; build the dataset with a larger \
             --val-permille or evaluate a shorter context",
            set.len,
            t + 1
        )));
    }
    let room = set.len - t - 1;
    let n = n.min(room / t + 1).max(1);
    Ok((0..n).map(|i| if n == 1 { 0 } else { i * room / (n - 1) }).collect())
}

/// The windows at `starts`, as one batch.
pub fn val_batch(set: &TokenSet, starts: &[usize], t: usize) -> Batch {
    windows(set, starts, t)
}
