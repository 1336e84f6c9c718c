//! Activation rows quantized on the fly for the integer kernels ([`QActs`]): ggml's x86
//! quantizer, its reference, and the layout the kernels read.

#[cfg(target_arch = "x86_64")]
use super::x86;
use super::{Isa, Kind, AMX_MIN_TOKENS, BLOCK};
use crate::threads::SendPtr;

/// Activation rows quantized for the kernels: ggml's x86 quantizer (d = amax/127 stored as f16,
/// q = round-half-even(x·127/amax)), laid out contiguously.
#[derive(Debug, Clone)]
pub struct QActs {
    pub t: usize,
    pub nbp: usize,
    /// [T, nbp, 32] codes (then, from AMX_MIN_TOKENS rows on, zero rows up to a multiple of 16).
    pub qs: Vec<i8>,
    /// [T, nbp] scales (f16-rounded, as ggml stores them).
    pub d: Vec<f32>,
    /// [T, nbp] d·Σq, exact (Q4_0, Q8_0) ...
    pub s: Vec<f32>,
    /// ... and rounded to f16 (Q4_1's Q8_1 `s`).
    pub s16: Vec<f32>,
    /// [T, nbp, 2] d·Σq over each 16-code half of a block, exact (the Q6_K tiles' offsets,
    /// whose scales change every 16 codes).
    pub hs: Vec<f32>,
    /// [T, nbp, 2] the weight codes' offset terms in the integer sums' units: −8·Σq (Q4_0, its
    /// codes stored q + 8) and −128·Σq (Q8_0 and IQ4_NL, whose tiles take code + 128). The
    /// VNNI tiles start each block's sums from them instead of adding `k·s` in f32 (two fewer
    /// vector operations a block and row group; the same bits, see `rows16`).
    pub offs: Vec<i32>,
}

/// The code offsets k whose terms −k·Σq [`QActs::offs`] holds per block, in order: Q4_0's
/// (codes stored q + 8), and that of the kinds whose tiles take code + 128 (Q8_0, IQ4_NL).
pub(super) const OFFSET_TERMS: [i32; 2] = [8, 128];

/// Where one activation row's blocks go (a [`QActs`] row, or a range of its whole blocks): nb
/// blocks' codes (`qs`: nb·32) and, per block, `d`, `s`, `s16`, two `hs` and two `offs`.
pub struct RowOut<'a> {
    pub qs: &'a mut [i8],
    pub d: &'a mut [f32],
    pub s: &'a mut [f32],
    pub s16: &'a mut [f32],
    pub hs: &'a mut [f32],
    pub offs: &'a mut [i32],
}

impl RowOut<'_> {
    /// Blocks b0..b1 of row r of the activations at `a`.
    ///
    /// # Safety
    /// `a` must point to a live [`QActs`] with row r and blocks b0..b1 ≤ nbp, whose arrays are
    /// not resized meanwhile, and nothing else may access those blocks while the result lives.
    pub unsafe fn blocks<'a>(a: *mut QActs, r: usize, b0: usize, b1: usize) -> RowOut<'a> {
        let (nbp, n, at) = ((*a).nbp, b1 - b0, r * (*a).nbp + b0);
        debug_assert!(b0 <= b1 && b1 <= nbp && r < (*a).qs.len() / (nbp * BLOCK).max(1));
        use std::slice::from_raw_parts_mut as part;
        RowOut {
            qs: part((*a).qs.as_mut_ptr().add(at * BLOCK), n * BLOCK),
            d: part((*a).d.as_mut_ptr().add(at), n),
            s: part((*a).s.as_mut_ptr().add(at), n),
            s16: part((*a).s16.as_mut_ptr().add(at), n),
            hs: part((*a).hs.as_mut_ptr().add(2 * at), 2 * n),
            offs: part((*a).offs.as_mut_ptr().add(2 * at), 2 * n),
        }
    }

    /// Blocks in this row: `d`'s length.
    pub fn blocks_len(&self) -> usize {
        self.d.len()
    }

    /// Whether every array holds `d`'s blocks.
    pub(super) fn fits(&self, nb: usize) -> bool {
        self.qs.len() >= nb * BLOCK
            && self.d.len() >= nb
            && self.s.len() >= nb
            && self.s16.len() >= nb
            && self.hs.len() >= 2 * nb
            && self.offs.len() >= 2 * nb
    }
}

/// `x.round_ties_even()` for |x| ≤ 2²²: adding and removing 1.5·2²³ leaves no fraction bits, so
/// the FPU's round-to-nearest-even does the rounding. Unlike `round_ties_even` (a libm `rintf`
/// call without SSE4.1) it vectorises.
#[inline(always)]
pub(super) fn round_even_small(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (x + MAGIC) - MAGIC
}

/// One activation row of nb blocks: ggml's x86 quantizer (id = 127/amax, round half to even),
/// d rounded to f16, s = d·Σq exact and rounded to f16, and `hs` = d·Σq per 16-code half (2 a
/// block). Blocks are independent, so a row may be quantized a range of whole blocks at a time
/// (the engine's fused FFN decode does).
pub fn quantize_row(x: &[f32], out: RowOut) {
    #[cfg(target_arch = "x86_64")]
    // No `--exact` branch: the SIMD quantizer gives the reference's bits (tested).
    if Isa::best() >= Isa::Avx512 {
        // SAFETY: AVX-512F/BW is present (Isa::best checks it).
        unsafe { x86::quantize_row512(x, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if Isa::best() == Isa::Avx2 {
        // SAFETY: AVX2 is present (Isa::best checks it).
        unsafe { x86::quantize_row256(x, out) };
        return;
    }
    quantize_row_ref(x, out)
}

/// The reference for the quantizer: the plain loops.
pub fn quantize_row_ref(x: &[f32], mut out: RowOut) {
    let nb = out.blocks_len();
    assert!(x.len() >= nb * BLOCK && out.fits(nb), "activation row shorter than its {nb} blocks");
    for b in 0..nb {
        let blk = &x[b * BLOCK..(b + 1) * BLOCK];
        let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let db = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut half = [0i32; 2]; // Σq over codes 0..16 and 16..32
        for (i, (o, &v)) in out.qs[b * BLOCK..(b + 1) * BLOCK].iter_mut().zip(blk).enumerate() {
            *o = round_even_small(v * id) as i8;
            half[i / 16] += *o as i32;
        }
        block_scales(b, db, half, &mut out);
    }
}

/// Block b's scale and sums from its unrounded scale `db` and the code sums of its two halves:
/// d = f16(db), s = d·Σq, s16 = f16(db·Σq) (Q8_1's), hs = d·Σq per half, offs = −8·Σq and
/// −128·Σq. Every quantizer's tail.
#[inline(always)]
pub(super) fn block_scales(b: usize, db: f32, half: [i32; 2], out: &mut RowOut) {
    let sum = half[0] + half[1];
    let dh = half::f16::from_f32(db).to_f32();
    out.d[b] = dh;
    out.s[b] = dh * sum as f32;
    out.s16[b] = half::f16::from_f32(db * sum as f32).to_f32();
    out.hs[2 * b] = dh * half[0] as f32;
    out.hs[2 * b + 1] = dh * half[1] as f32;
    for (i, k) in OFFSET_TERMS.iter().enumerate() {
        out.offs[2 * b + i] = -k * sum;
    }
}

impl QActs {
    /// Quantize x [T, cols] (cols a multiple of 32).
    pub fn quantize(x: &[f32], t: usize, cols: usize) -> QActs {
        Self::quantize_threads(x, t, cols, 1)
    }

    /// All-zero activations of T rows of `cols` (a multiple of 32), for a caller that fills the
    /// blocks itself with [`quantize_row`]; padding blocks and rows stay zero, as `quantize` leaves
    /// them.
    pub fn zeros(t: usize, cols: usize) -> QActs {
        let nb = cols / BLOCK;
        let nbp = nb + nb % 2;
        // Rows padded to whole 16-token tiles, which the AMX path loads; it runs from
        // AMX_MIN_TOKENS on, so decode's one row is not padded (and zeroed) to sixteen.
        let tp = if t >= AMX_MIN_TOKENS { t.next_multiple_of(16) } else { t };
        QActs {
            t,
            nbp,
            qs: vec![0; tp * nbp * BLOCK],
            d: vec![0.0; tp * nbp],
            s: vec![0.0; tp * nbp],
            s16: vec![0.0; tp * nbp],
            hs: vec![0.0; tp * nbp * 2],
            offs: vec![0; tp * nbp * 2],
        }
    }

    /// [`QActs::quantize`] with the rows spread over `threads` pool threads (AVX-512 per row when
    /// the CPU has it, else [`quantize_row_ref`]; the same bits either way).
    pub fn quantize_threads(x: &[f32], t: usize, cols: usize, threads: usize) -> QActs {
        debug_assert_eq!(x.len(), t * cols);
        let mut a = QActs::zeros(t, cols); // padding blocks and AMX tile rows stay zero
        let nb = cols / BLOCK;
        let ptr = SendPtr(&mut a as *mut QActs);
        let threads = if t * cols < 1 << 16 { 1 } else { threads };
        let per = t.div_ceil(threads.max(1) * 4).max(1);
        crate::threads::Pool::global().run(threads, t.div_ceil(per), &|i| {
            for r in i * per..((i + 1) * per).min(t) {
                // SAFETY: `a` outlives the job and is not resized; row r's blocks are this task's
                // alone.
                quantize_row(&x[r * cols..r * cols + nb * BLOCK], unsafe { RowOut::blocks(ptr.get(), r, 0, nb) });
            }
        });
        a
    }

    /// The rows `rows` (in that order) as activations of their own: the bits of quantizing
    /// those rows of the input, since every row is quantized alone (a mixture's experts take
    /// their tokens' rows of one quantized input).
    pub fn select_rows(&self, rows: &[usize]) -> QActs {
        let (nbp, n) = (self.nbp, rows.len());
        let mut a = QActs::zeros(n, nbp * BLOCK); // nbp is even: the same blocks a row
        debug_assert_eq!(a.nbp, nbp);
        for (i, &r) in rows.iter().enumerate() {
            assert!(r < self.t, "select_rows: row {r} of {}", self.t);
            let (src, dst) = (r * nbp, i * nbp);
            a.qs[dst * BLOCK..(dst + nbp) * BLOCK].copy_from_slice(&self.qs[src * BLOCK..(src + nbp) * BLOCK]);
            a.d[dst..dst + nbp].copy_from_slice(&self.d[src..src + nbp]);
            a.s[dst..dst + nbp].copy_from_slice(&self.s[src..src + nbp]);
            a.s16[dst..dst + nbp].copy_from_slice(&self.s16[src..src + nbp]);
            a.hs[2 * dst..2 * (dst + nbp)].copy_from_slice(&self.hs[2 * src..2 * (src + nbp)]);
            a.offs[2 * dst..2 * (dst + nbp)].copy_from_slice(&self.offs[2 * src..2 * (src + nbp)]);
        }
        a
    }

    /// Start loading the activations into this core's caches, every line at once: a worker's
    /// task reads what another core just wrote, and the kernel's in-order first reads would
    /// otherwise wait for those lines one after another. Small inputs only (decode's few rows).
    pub fn warm(&self) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let n = self.t * self.nbp;
            if n * BLOCK > 64 << 10 {
                return;
            }
            let lines = |p: *const i8, bytes: usize| {
                for off in (0..bytes).step_by(64) {
                    // SAFETY: a prefetch never faults; every address is inside the array.
                    unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off)) };
                }
            };
            lines(self.qs.as_ptr(), n * BLOCK);
            lines(self.d.as_ptr() as *const i8, n * 4);
            lines(self.s.as_ptr() as *const i8, n * 4);
            lines(self.s16.as_ptr() as *const i8, n * 4);
            lines(self.hs.as_ptr() as *const i8, n * 8);
            lines(self.offs.as_ptr() as *const i8, n * 8);
        }
    }

    pub(crate) fn row(&self, t: usize) -> (&[i8], &[f32]) {
        (&self.qs[t * self.nbp * BLOCK..(t + 1) * self.nbp * BLOCK], &self.d[t * self.nbp..(t + 1) * self.nbp])
    }

    /// Where `offs` holds the terms of weights of `kind`, if it holds those of its code offset k
    /// ([`OFFSET_TERMS`]): −k·Σq of row t's block b at `offs[2·(t·nbp + b) + slot]`.
    #[inline(always)]
    pub(crate) fn offset_slot(kind: Kind) -> Option<usize> {
        let k = kind.code_offset()?;
        OFFSET_TERMS.iter().position(|&o| o as f32 == k)
    }

    /// The s array a weight kind pairs with, row t: per block (`nbp`), or for Q6_K per half
    /// block (`2·nbp`). Inlined: every tile asks once per token.
    #[inline(always)]
    pub(crate) fn s_for(&self, kind: Kind, t: usize) -> &[f32] {
        match kind {
            Kind::Q4_1 | Kind::Q5_1 => &self.s16[t * self.nbp..(t + 1) * self.nbp],
            Kind::Q6K | Kind::Q3K | Kind::Q2K => &self.hs[2 * t * self.nbp..2 * (t + 1) * self.nbp],
            Kind::Q4_0 | Kind::Q5_0 | Kind::Q8_0 | Kind::Q5K | Kind::Q4K | Kind::IQ4NL => {
                &self.s[t * self.nbp..(t + 1) * self.nbp]
            }
        }
    }
}
