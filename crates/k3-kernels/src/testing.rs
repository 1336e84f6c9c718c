//! Named tolerances and comparison helpers shared by every test in the workspace.

/// Bounds from docs/style (architecture.md §10): tighten once measured, loosen only with a reason.
pub struct Tol;

impl Tol {
    /// Fast vs reference kernel in f32 (reordered sums): RMS-error ratio.
    pub const F32_REORDER: f64 = 1e-5;
    /// Chunked vs recurrent KDA in f32: RMS-error ratio.
    pub const KDA_CHUNK: f64 = 1e-4;
    /// Pure-Rust op vs PyTorch golden (KDA core), f32: max abs.
    pub const GOLDEN_OP: f64 = 1e-5;
    /// Pure-Rust layer / model vs PyTorch golden, f32: max abs on logits.
    pub const GOLDEN_MODEL: f64 = 1e-4;
}

/// Max absolute difference and fla's RMS-error ratio `RMS(a − b) / RMS(b)`.
pub fn diff_stats(got: &[f32], want: &[f32]) -> (f64, f64) {
    assert_eq!(got.len(), want.len(), "length mismatch");
    let (mut max, mut se, mut sw) = (0f64, 0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        let d = (g as f64 - w as f64).abs();
        max = max.max(d);
        se += d * d;
        sw += (w as f64) * (w as f64);
    }
    let n = got.len().max(1) as f64;
    (max, (se / n).sqrt() / ((sw / n).sqrt()).max(1e-30))
}

/// Panic unless `max |got − want| ≤ tol`, naming the tensor and printing both metrics.
pub fn assert_close_abs(name: &str, got: &[f32], want: &[f32], tol: f64) {
    let (max, ratio) = diff_stats(got, want);
    assert!(max <= tol, "{name}: max abs {max:.3e} > {tol:.0e} (rms ratio {ratio:.3e})");
}

/// Panic unless the RMS-error ratio is below `tol` (fla's metric), or max abs ≤ 1e-6.
pub fn assert_close_ratio(name: &str, got: &[f32], want: &[f32], tol: f64) {
    let (max, ratio) = diff_stats(got, want);
    assert!(max <= 1e-6 || ratio < tol, "{name}: rms ratio {ratio:.3e} ≥ {tol:.0e} (max abs {max:.3e})");
}

/// A tiny deterministic generator (SplitMix64) so tests need no `rand` dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = self.uniform().max(1e-7);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
    }
    pub fn normals(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal() * scale).collect()
    }
}

/// Median wall time of `rounds` calls of `f`, in seconds (the speed examples' timer).
pub fn median_secs(rounds: usize, f: &mut dyn FnMut()) -> f64 {
    let mut v: Vec<f64> = (0..rounds.max(1))
        .map(|_| {
            let t0 = std::time::Instant::now();
            f();
            t0.elapsed().as_secs_f64()
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
