//! Calibration for importance-weighted quantization (llama.cpp's imatrix): the mean squared
//! activation that each input column of every named weight matrix meets while calibration is on.
//! Process-wide, as a quantizer uses it: [`start`], run the f32 model over calibration text,
//! [`finish`]. When off, a matmul pays one relaxed atomic load.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

static ON: AtomicBool = AtomicBool::new(false);
/// GGUF tensor name → (Σ x² per column, rows seen).
static SUMS: Mutex<BTreeMap<String, (Vec<f64>, u64)>> = Mutex::new(BTreeMap::new());

/// Clear the sums and start recording.
pub fn start() {
    SUMS.lock().unwrap_or_else(|p| p.into_inner()).clear();
    ON.store(true, Ordering::Relaxed);
}

/// Stop recording; the mean x² per input column of every matrix seen, by GGUF tensor name
/// (routed experts as `NAME#e`).
pub fn finish() -> BTreeMap<String, Vec<f32>> {
    ON.store(false, Ordering::Relaxed);
    let sums = std::mem::take(&mut *SUMS.lock().unwrap_or_else(|p| p.into_inner()));
    sums.into_iter().map(|(k, (s, n))| (k, s.iter().map(|v| (v / n.max(1) as f64) as f32).collect())).collect()
}

/// Whether inputs are being recorded (a path that skips [`record`] must not run then).
pub(crate) fn recording() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Fold `t` rows of `cols` inputs of matrix `name` in, when recording.
pub(crate) fn record(name: &str, x: &[f32], t: usize, cols: usize) {
    if !ON.load(Ordering::Relaxed) {
        return;
    }
    let mut g = SUMS.lock().unwrap_or_else(|p| p.into_inner());
    let e = g.entry(name.to_string()).or_insert_with(|| (vec![0.0; cols], 0));
    if e.0.len() != cols {
        return; // a different matrix under the same name: never mix them
    }
    for row in x.chunks_exact(cols).take(t) {
        for (s, &v) in e.0.iter_mut().zip(row) {
            *s += (v as f64) * (v as f64);
        }
    }
    e.1 += t as u64;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_mean_squares_only_while_on() {
        record("a", &[1.0, 2.0], 1, 2);
        start();
        record("a", &[1.0, 2.0, 3.0, 0.0], 2, 2);
        let m = finish();
        record("a", &[9.0, 9.0], 1, 2);
        assert_eq!(m["a"], vec![5.0, 2.0]);
        assert!(finish().is_empty(), "nothing recorded after finish");
    }
}
