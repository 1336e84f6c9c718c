//! Integer matrix products for quantized weights: weights repacked once at load time, activations
//! quantized per call to 8 bits (ggml's x86 activation quantizer, so the integers are llama.cpp's),
//! then u8 × i8 block dot products on the widest instruction set the CPU has.
//!
//! Every product, per weight row w and activation row x, is
//! ```text
//! y = Σ_b d_w[b]·d_x[b]·Σ_j u[b,j]·q[b,j]  +  Σ_b μ[b]·s[b]
//! ```
//! with u the weight's unsigned codes, q the activation's i8 codes, s[b] = d_x[b]·Σ_j q[b,j] and
//! μ the offset that turns u back into the weight value: Q4_0 u = code (value (u − 8)·d, μ = −8d),
//! Q4_1 u = code (value u·d + m, μ = m, with s rounded to f16 as ggml's Q8_1 does), Q8_0
//! u = code + 128 (value (u − 128)·d, μ = −128d). This equals ggml's `vec_dot_q4_0_q8_0`,
//! `vec_dot_q4_1_q8_1` and `vec_dot_q8_0_q8_0` up to the order of float additions; the tests
//! compare every instruction-set path with those references.
//!
//! Paths: [`Isa::Avx512Vnni`] (vpdpbusd on 512-bit registers, two blocks per instruction),
//! [`Isa::Avx2`] (vpmaddubsw / vpmaddwd), [`Isa::Scalar`] (the plain loops, always available).
//! Dims: R weight rows, T activation rows (tokens), nb blocks of 32 per row (padded to even).

mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86;

use std::sync::OnceLock;

use crate::quant::GgmlType;

pub const BLOCK: usize = 32;

/// An instruction set the kernels can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Scalar,
    Avx2,
    Avx512Vnni,
}

impl Isa {
    /// Every path this CPU supports, slowest first.
    pub fn available() -> Vec<Isa> {
        let mut v = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                v.push(Isa::Avx2);
            }
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("f16c")
                && is_x86_feature_detected!("fma")
            {
                v.push(Isa::Avx512Vnni);
            }
        }
        v
    }

    /// The fastest available path, or the one `K3MINI_ISA` (scalar | avx2 | avx512) names if the
    /// CPU has it. Decided once per process.
    pub fn best() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            let avail = Isa::available();
            let want = match std::env::var("K3MINI_ISA").ok().as_deref() {
                Some("scalar") => Some(Isa::Scalar),
                Some("avx2") => Some(Isa::Avx2),
                Some("avx512") => Some(Isa::Avx512Vnni),
                _ => None,
            };
            match want {
                Some(w) if avail.contains(&w) => w,
                _ => *avail.last().unwrap_or(&Isa::Scalar),
            }
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512Vnni => "avx512-vnni",
        }
    }
}

/// Which weight format a packed matrix came from (decides μ).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Q4_0,
    Q4_1,
    Q8_0,
}

/// A weight matrix [rows, cols] repacked for the kernels.
///
/// Q4: for every pair of blocks (2p, 2p+1) 32 bytes, byte j holding code j of block 2p in its low
/// nibble and code j of block 2p+1 in its high nibble, so one AND and one shift give both blocks'
/// codes in element order. Q8: 32 bytes per block of `code + 128`. Scales stay f16 (ggml's bytes
/// per weight); `m` holds Q4_1's mins.
#[derive(Debug, Clone)]
pub struct Packed {
    pub kind: Kind,
    pub rows: usize,
    pub cols: usize,
    /// Blocks per row, padded to even with zero blocks.
    pub nbp: usize,
    pub qs: Vec<u8>,
    pub d: Vec<u16>,
    pub m: Vec<u16>,
}

impl Packed {
    /// Repack ggml rows of `ty` (`rows × ty.row_bytes(cols)` bytes). `None` for types the integer
    /// kernels do not take.
    pub fn pack(ty: GgmlType, rows: usize, cols: usize, data: &[u8]) -> Option<Packed> {
        let kind = match ty {
            GgmlType::Q4_0 => Kind::Q4_0,
            GgmlType::Q4_1 => Kind::Q4_1,
            GgmlType::Q8_0 => Kind::Q8_0,
            _ => return None,
        };
        if !cols.is_multiple_of(BLOCK) {
            return None;
        }
        let nb = cols / BLOCK;
        let nbp = nb + nb % 2;
        let (bb, off) = match kind {
            Kind::Q4_0 => (18, 2),
            Kind::Q4_1 => (20, 4),
            Kind::Q8_0 => (34, 2),
        };
        let row_bytes = nb * bb;
        debug_assert_eq!(data.len(), rows * row_bytes);
        let per_row = if kind == Kind::Q8_0 { nbp * 32 } else { nbp * 16 };
        let mut qs = vec![0u8; rows * per_row];
        let mut d = vec![0u16; rows * nbp];
        let mut m = if kind == Kind::Q4_1 { vec![0u16; rows * nbp] } else { Vec::new() };
        let mut codes = vec![0u8; nbp * BLOCK];
        for r in 0..rows {
            let row = &data[r * row_bytes..(r + 1) * row_bytes];
            codes.iter_mut().for_each(|c| *c = if kind == Kind::Q8_0 { 128 } else { 0 });
            for b in 0..nb {
                let blk = &row[b * bb..(b + 1) * bb];
                d[r * nbp + b] = u16::from_le_bytes([blk[0], blk[1]]);
                if kind == Kind::Q4_1 {
                    m[r * nbp + b] = u16::from_le_bytes([blk[2], blk[3]]);
                }
                let c = &mut codes[b * BLOCK..(b + 1) * BLOCK];
                match kind {
                    Kind::Q8_0 => {
                        for j in 0..BLOCK {
                            c[j] = (blk[off + j] as i8 as i32 + 128) as u8;
                        }
                    }
                    _ => {
                        for j in 0..16 {
                            c[j] = blk[off + j] & 0x0F;
                            c[j + 16] = blk[off + j] >> 4;
                        }
                    }
                }
            }
            let out = &mut qs[r * per_row..(r + 1) * per_row];
            match kind {
                Kind::Q8_0 => out.copy_from_slice(&codes),
                _ => {
                    for p in 0..nbp / 2 {
                        for j in 0..BLOCK {
                            out[p * 32 + j] = codes[2 * p * BLOCK + j] | (codes[(2 * p + 1) * BLOCK + j] << 4);
                        }
                    }
                }
            }
        }
        Some(Packed { kind, rows, cols, nbp, qs, d, m })
    }

    /// Row r dequantized to f32 (`cols` values): the weight values, as ggml's dequantizer gives them.
    pub fn dequant_row(&self, r: usize, out: &mut [f32]) {
        let n = self.nbp;
        let (mut dw, mut mu) = (vec![0f32; n], vec![0f32; n]);
        self.row_scales(r, &mut dw, &mut mu);
        let q = &self.qs[r * self.row_qs()..(r + 1) * self.row_qs()];
        for (i, o) in out.iter_mut().enumerate().take(self.cols) {
            let (b, j) = (i / BLOCK, i % BLOCK);
            let u = match self.kind {
                Kind::Q8_0 => q[i],
                _ => {
                    let byte = q[(b / 2) * 32 + j];
                    if b % 2 == 0 {
                        byte & 0x0F
                    } else {
                        byte >> 4
                    }
                }
            };
            *o = u as f32 * dw[b] + mu[b];
        }
    }

    /// A new matrix of the rows `idx` (in that order).
    pub fn select_rows(&self, idx: &[usize]) -> Packed {
        let (rq, n) = (self.row_qs(), self.nbp);
        let mut p = Packed { rows: idx.len(), qs: Vec::new(), d: Vec::new(), m: Vec::new(), ..*self };
        for &r in idx {
            p.qs.extend_from_slice(&self.qs[r * rq..(r + 1) * rq]);
            p.d.extend_from_slice(&self.d[r * n..(r + 1) * n]);
            if self.kind == Kind::Q4_1 {
                p.m.extend_from_slice(&self.m[r * n..(r + 1) * n]);
            }
        }
        p
    }

    /// Bytes the kernels stream per product (for bandwidth figures).
    pub fn nbytes(&self) -> usize {
        self.qs.len() + 2 * (self.d.len() + self.m.len())
    }

    /// Bytes of codes per row.
    pub(crate) fn row_qs(&self) -> usize {
        if self.kind == Kind::Q8_0 {
            self.nbp * 32
        } else {
            self.nbp * 16
        }
    }

    /// Row r's scales as f32 (`dw`) and offsets μ (`mu`), `nbp` each.
    pub(crate) fn row_scales(&self, r: usize, dw: &mut [f32], mu: &mut [f32]) {
        let n = self.nbp;
        for b in 0..n {
            let d = half::f16::from_bits(self.d[r * n + b]).to_f32();
            dw[b] = d;
            mu[b] = match self.kind {
                Kind::Q4_0 => -8.0 * d,
                Kind::Q8_0 => -128.0 * d,
                Kind::Q4_1 => half::f16::from_bits(self.m[r * n + b]).to_f32(),
            };
        }
    }
}

/// Activation rows quantized for the kernels: ggml's x86 quantizer (d = amax/127 stored as f16,
/// q = round-half-even(x·127/amax)), laid out contiguously.
#[derive(Debug, Clone)]
pub struct QActs {
    pub t: usize,
    pub nbp: usize,
    /// [T, nbp, 32] codes.
    pub qs: Vec<i8>,
    /// [T, nbp] scales (f16-rounded, as ggml stores them).
    pub d: Vec<f32>,
    /// [T, nbp] d·Σq, exact (Q4_0, Q8_0) ...
    pub s: Vec<f32>,
    /// ... and rounded to f16 (Q4_1's Q8_1 `s`).
    pub s16: Vec<f32>,
}

impl QActs {
    /// Quantize x [T, cols] (cols a multiple of 32).
    pub fn quantize(x: &[f32], t: usize, cols: usize) -> QActs {
        debug_assert_eq!(x.len(), t * cols);
        let nb = cols / BLOCK;
        let nbp = nb + nb % 2;
        let mut a = QActs {
            t,
            nbp,
            qs: vec![0; t * nbp * BLOCK],
            d: vec![0.0; t * nbp],
            s: vec![0.0; t * nbp],
            s16: vec![0.0; t * nbp],
        };
        for r in 0..t {
            for b in 0..nb {
                let blk = &x[r * cols + b * BLOCK..r * cols + (b + 1) * BLOCK];
                let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
                let q = &mut a.qs[(r * nbp + b) * BLOCK..(r * nbp + b + 1) * BLOCK];
                let mut sum = 0i32;
                for (o, &v) in q.iter_mut().zip(blk) {
                    *o = (v * id).round_ties_even() as i8;
                    sum += *o as i32;
                }
                let dh = half::f16::from_f32(d).to_f32();
                a.d[r * nbp + b] = dh;
                a.s[r * nbp + b] = dh * sum as f32;
                a.s16[r * nbp + b] = half::f16::from_f32(d * sum as f32).to_f32();
            }
        }
        a
    }

    pub(crate) fn row(&self, t: usize) -> (&[i8], &[f32]) {
        (&self.qs[t * self.nbp * BLOCK..(t + 1) * self.nbp * BLOCK], &self.d[t * self.nbp..(t + 1) * self.nbp])
    }

    /// The s array a weight kind pairs with, row t.
    pub(crate) fn s_for(&self, kind: Kind, t: usize) -> &[f32] {
        let s = if kind == Kind::Q4_1 { &self.s16 } else { &self.s };
        &s[t * self.nbp..(t + 1) * self.nbp]
    }
}

/// `out[(o − lo)·T + t] = Σ w[o]·x[t]` for weight rows `lo..hi` and every activation row, on `isa`.
///
/// # Shapes
/// w: [rows, cols] packed, a: [T, cols] → out: [hi − lo, T]
pub fn gemm_rows(isa: Isa, w: &Packed, a: &QActs, lo: usize, hi: usize, out: &mut [f32]) {
    assert_eq!(w.nbp, a.nbp, "weight and activation widths differ");
    assert!(hi <= w.rows && out.len() >= (hi - lo) * a.t);
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni if Isa::available().contains(&Isa::Avx512Vnni) => {
            // SAFETY: the CPU supports every feature the kernel enables (checked just above).
            unsafe { x86::gemm_avx512(w, a, lo, hi, out) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512Vnni if Isa::available().contains(&Isa::Avx2) => {
            // SAFETY: as above, for AVX2 + FMA.
            unsafe { x86::gemm_avx2(w, a, lo, hi, out) }
        }
        _ => scalar::gemm(w, a, lo, hi, out),
    }
}

/// The reference: ggml's scalar `vec_dot` of the original rows with ggml-format activations.
pub fn gemm_ref(ty: GgmlType, data: &[u8], rows: usize, cols: usize, x: &[f32], t: usize) -> Vec<f32> {
    let rb = ty.row_bytes(cols);
    let acts: Vec<Vec<u8>> = (0..t).map(|r| ty.quantize_activation(&x[r * cols..(r + 1) * cols])).collect();
    let mut out = vec![0f32; rows * t];
    for o in 0..rows {
        for (r, xa) in acts.iter().enumerate() {
            out[o * t + r] = ty.vec_dot(&data[o * rb..(o + 1) * rb], xa);
        }
    }
    out
}

/// Σ_b μ[b]·s[b]: the offset term every path adds per (row, token).
#[inline]
pub(crate) fn offset_term(mu: &[f32], s: &[f32]) -> f32 {
    mu.iter().zip(s).map(|(a, b)| a * b).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;

    /// Every path this CPU has, every tile shape remainder, against ggml's scalar references.
    #[test]
    fn every_isa_matches_ggml_vec_dot() {
        let mut rng = Rng::new(17);
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            for &(rows, cols, t) in &[(1, 32, 1), (7, 96, 3), (9, 256, 5), (16, 576, 8), (5, 64, 13)] {
                let w = rng.normals(rows * cols, 0.4);
                let x = rng.normals(t * cols, 1.5);
                let data: Vec<u8> = w.chunks(cols).flat_map(|r| ty.quantize_row(r)).collect();
                let want = gemm_ref(ty, &data, rows, cols, &x, t);
                let p = Packed::pack(ty, rows, cols, &data).expect("packable");
                let a = QActs::quantize(&x, t, cols);
                for isa in Isa::available() {
                    for (lo, hi) in [(0, rows), (rows / 2, rows)] {
                        let mut got = vec![0f32; (hi - lo) * t];
                        gemm_rows(isa, &p, &a, lo, hi, &mut got);
                        for (i, (g, e)) in got.iter().zip(&want[lo * t..hi * t]).enumerate() {
                            let scale = 1.0 + e.abs();
                            assert!(
                                (g - e).abs() <= 2e-5 * scale * (cols as f32 / 32.0).sqrt(),
                                "{} {} [{rows}x{cols}]·[{t}] rows {lo}..{hi} elem {i}: {g} vs {e}",
                                ty.name(),
                                isa.name()
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn packed_rows_dequantize_like_ggml_and_select() {
        let mut rng = Rng::new(5);
        let (rows, cols) = (6, 96);
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let w = rng.normals(rows * cols, 0.4);
            let data: Vec<u8> = w.chunks(cols).flat_map(|r| ty.quantize_row(r)).collect();
            let p = Packed::pack(ty, rows, cols, &data).expect("packable");
            let rb = ty.row_bytes(cols);
            let (mut a, mut b) = (vec![0f32; cols], vec![0f32; cols]);
            let sel = p.select_rows(&[4, 1]);
            for (k, r) in [(0, 4), (1, 1)] {
                ty.dequantize_row(&data[r * rb..(r + 1) * rb], &mut a);
                sel.dequant_row(k, &mut b);
                for (x, y) in a.iter().zip(&b) {
                    assert!((x - y).abs() <= 1e-6 * (1.0 + x.abs()), "{}: {x} vs {y}", ty.name());
                }
            }
        }
    }

    #[test]
    fn scalar_path_is_always_there() {
        assert_eq!(Isa::available()[0], Isa::Scalar);
    }
}
