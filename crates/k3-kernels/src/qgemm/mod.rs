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
//! Paths: [`Isa::Amx`] (AMX-INT8 tile products, 16 rows × 16 tokens × one block per instruction;
//! prefill only, see [`Isa::for_tokens`]), [`Isa::Avx512Vnni`] (vpdpbusd on 512-bit registers, two
//! blocks per instruction), [`Isa::Avx512`] (the same tiles with vpmaddubsw / vpmaddwd, for AVX-512
//! CPUs without VNNI), [`Isa::Avx2`] (vpmaddubsw / vpmaddwd on 256 bits), [`Isa::Scalar`] (the
//! plain loops, always available).
//! Dims: R weight rows, T activation rows (tokens), nb blocks of 32 per row (padded to even).

mod acts;
#[cfg(target_arch = "x86_64")]
mod amx;
mod pack;
pub mod rows16;
mod scalar;
pub use acts::{quantize_row, quantize_row_ref, QActs, RowOut};
#[cfg(target_arch = "x86_64")]
mod x86;

use std::sync::OnceLock;

use crate::hugebuf::{Buf, Place};
use crate::quant::GgmlType;

pub const BLOCK: usize = 32;

/// An instruction set the kernels can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Scalar,
    Avx2,
    /// AVX-512 F/BW/VL without VNNI (Skylake-SP and the Cascade Lake parts without it).
    Avx512,
    Avx512Vnni,
    Amx,
}

/// Fewest tokens for which [`Isa::Amx`] runs; fewer take the AVX-512 VNNI path. Below 16 a
/// 16-token tile is part padding, and each row group's codes are unpacked into tile form for few
/// tokens, while the VNNI tiles take 8 tokens a weight load at full width. It was 8 until
/// 2026-12-06; on the Emerald Rapids class host a batched decode of 8 sequences (8 tokens a
/// product, AMX) then read 266 tok/s against 349 for 4 (VNNI). Placed at 16 by that reasoning,
/// not yet by a measurement on an AMX host (`examples/batch_decode MODEL 2 4,8,12,16,32`).
pub const AMX_MIN_TOKENS: usize = 16;

impl Isa {
    /// Every path this CPU supports, slowest first.
    pub fn available() -> Vec<Isa> {
        Self::detected().to_vec()
    }

    /// [`Isa::available`], detected once per process.
    fn detected() -> &'static [Isa] {
        static AVAIL: OnceLock<Vec<Isa>> = OnceLock::new();
        AVAIL.get_or_init(|| {
            let mut v = vec![Isa::Scalar];
            #[cfg(target_arch = "x86_64")]
            {
                if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                    v.push(Isa::Avx2);
                }
                if is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("f16c")
                    && is_x86_feature_detected!("fma")
                {
                    v.push(Isa::Avx512);
                    if is_x86_feature_detected!("avx512vnni") {
                        v.push(Isa::Avx512Vnni);
                        if amx::available() {
                            v.push(Isa::Amx);
                        }
                    }
                }
            }
            v
        })
    }

    /// Whether this CPU has `self`.
    pub fn supported(self) -> bool {
        Self::detected().contains(&self)
    }

    /// The fastest available path, or the one `K3MINI_ISA` (scalar | avx2 | avx512 | amx) names if the
    /// CPU has it. Decided once per process.
    pub fn best() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            let avail = Isa::detected();
            let want = match std::env::var("K3MINI_ISA").ok().as_deref() {
                Some("scalar") => Some(Isa::Scalar),
                Some("avx2") => Some(Isa::Avx2),
                Some("avx512bw") => Some(Isa::Avx512),
                Some("avx512") => Some(Isa::Avx512Vnni),
                Some("amx") => Some(Isa::Amx),
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
            Isa::Avx512 => "avx512bw",
            Isa::Avx512Vnni => "avx512-vnni",
            Isa::Amx => "amx-int8",
        }
    }

    /// The path for a product over `t` tokens: AMX only from [`AMX_MIN_TOKENS`] on.
    pub fn for_tokens(self, t: usize) -> Isa {
        if self == Isa::Amx && t < AMX_MIN_TOKENS {
            Isa::Avx512Vnni
        } else {
            self
        }
    }
}

/// Which weight format a packed matrix came from (decides μ).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Q4_0,
    Q4_1,
    Q8_0,
    /// Q5_0's 5-bit codes (0..31, as stored) with Q4_0's arithmetic: value `(u − 16)·d`. Only in
    /// [`Layout::Rows16`] (elsewhere Q5_0 rows enter as the Q8_0 blocks they equal).
    Q5_0,
    /// Q6_K's 6-bit codes (0..63, as stored) with a scale per 16 codes: `d` holds each block's
    /// first-half scale and `m` its second-half one (f16 of Q6_K's d·sc), value `(u − 32)·scale`.
    /// Only in [`Layout::Rows16`]; its offsets pair with the activations' half sums.
    Q6K,
    /// Q5_K's 5-bit codes (0..31, as stored) with Q4_1's arithmetic: value `u·d + m`, `d` and `m`
    /// f16 of the sub-block's d·sc and −dmin·m, offsets from the exact activation sums (ggml's
    /// Q8_K sums are exact). Only in [`Layout::Rows16`].
    Q5K,
    /// Q5_1 as [`Kind::Q5K`], exactly (its own f16 scale and min), the offsets from the
    /// f16-rounded activation sums as its Q8_1 partner rounds them.
    Q5_1,
    /// Q4_K at its own precision: the nibbles as Q4_1's, `d` holding each sub-block's 6-bit scale
    /// and min as two bytes (`sc | mn << 8`), `m` each super-block's f16 `d` and `dmin`
    /// ([`Kind::m_per_row`]); value `u·(d·sc) − dmin·mn`, Q4_1's arithmetic with the scale and min
    /// formed in f32. Only in [`Layout::Rows16`] (in row pairs Q4_K enters as Q4_1 blocks).
    Q4K,
    /// Q3_K's 3-bit codes (0..7, the low bits and the hmask bit) at a nibble each, with Q6_K's
    /// arithmetic: a scale per 16 codes (`d` first half, `m` second half, f16 of d·(sc − 32)),
    /// value `(u − 4)·scale`. Only in [`Layout::Rows16`].
    Q3K,
    /// Q2_K's 2-bit codes (0..3) at a nibble each, with a 4-bit scale and min per 16 codes: `d`
    /// holds each block's two sub-block bytes (`sc | mn << 4`, first half in the low byte), `m`
    /// each super-block's f16 `d` and `dmin` as [`Kind::Q4K`]'s; value `u·(d·sc) − dmin·mn`.
    /// Only in [`Layout::Rows16`].
    Q2K,
    /// IQ4_NL's 4-bit indices at a nibble each (Q4_0's layout) into [`NL_CODES`], ggml's
    /// non-linear table as Q8_0 stores its codes (value + 128), with Q8_0's arithmetic: value
    /// `(NL_CODES[u] − 128)·d`. The tiles look each index up with one byte shuffle. Only in
    /// [`Layout::Rows16`] (in row pairs, on CPUs without the 16-row kernels, IQ4_NL rows enter as
    /// the Q8_0 blocks they equal).
    IQ4NL,
}

/// [`Kind::IQ4NL`]'s table: ggml's `kvalues_iq4nl` + 128, as Q8_0's stored codes.
pub const NL_CODES: [u8; 16] = {
    let mut t = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = (crate::quant::iq4::KVALUES[i] as i32 + 128) as u8;
        i += 1;
    }
    t
};

impl Kind {
    /// A byte a code (Q8_0), not a nibble plus high-bit planes.
    pub(crate) fn byte_codes(self) -> bool {
        self == Kind::Q8_0
    }

    /// Bits of each code beyond its low nibble, stored as bit planes in the 16-row layout.
    pub(crate) fn planes(self) -> usize {
        match self {
            Kind::Q4_0 | Kind::Q4_1 | Kind::Q8_0 | Kind::Q4K | Kind::Q3K | Kind::Q2K | Kind::IQ4NL => 0,
            Kind::Q5_0 | Kind::Q5K | Kind::Q5_1 => 1,
            Kind::Q6K => 2,
        }
    }

    /// Whether `m` holds a second array (Q4_1's and Q5's mins, Q6_K's second-half scales,
    /// Q4_K's super-block scales).
    pub(crate) fn has_m(self) -> bool {
        matches!(self, Kind::Q4_1 | Kind::Q6K | Kind::Q5K | Kind::Q5_1 | Kind::Q4K | Kind::Q3K | Kind::Q2K)
    }

    /// Whether `m` holds per-super-block scales (Q4_K's and Q2_K's `d` and `dmin`) instead of an
    /// entry per block.
    pub(crate) fn super_scales(self) -> bool {
        matches!(self, Kind::Q4K | Kind::Q2K)
    }

    /// Whether the scales change every 16 codes (Q6_K, Q3_K, Q2_K): offsets pair with the
    /// activations' half sums.
    pub(crate) fn per_half(self) -> bool {
        matches!(self, Kind::Q6K | Kind::Q3K | Kind::Q2K)
    }

    /// The code the value is zero at, for the kinds whose value is `(u − offset)·scale` (μ =
    /// −offset·scale); `None` for the kinds with a min.
    pub(crate) fn code_offset(self) -> Option<f32> {
        match self {
            Kind::Q4_0 => Some(8.0),
            Kind::Q5_0 => Some(16.0),
            Kind::Q8_0 | Kind::IQ4NL => Some(128.0),
            Kind::Q6K => Some(32.0),
            Kind::Q3K => Some(4.0),
            Kind::Q4_1 | Kind::Q5K | Kind::Q5_1 | Kind::Q4K | Kind::Q2K => None,
        }
    }

    /// Entries of `m` per row: one a block, or for the [`Kind::super_scales`] kinds two (`d`,
    /// `dmin`) a super-block of 8.
    pub(crate) fn m_per_row(self, nbp: usize) -> usize {
        if self.super_scales() {
            nbp / 4
        } else {
            nbp
        }
    }

    /// The kinds that exist only in [`Layout::Rows16`].
    pub(crate) fn rows16_only(self) -> bool {
        self.planes() > 0 || matches!(self, Kind::Q4K | Kind::Q3K | Kind::Q2K | Kind::IQ4NL)
    }

    /// The table a stored code indexes (the codes the arithmetic takes are `table[u]`), if any.
    pub(crate) fn code_table(self) -> Option<&'static [u8; 16]> {
        (self == Kind::IQ4NL).then_some(&NL_CODES)
    }
}

/// How a [`Packed`] matrix's codes and scales are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Row-major. Q4: for every pair of blocks (2p, 2p+1) 32 bytes, byte j holding code j of
    /// block 2p in its low nibble and code j of block 2p+1 in its high nibble, so one AND and one
    /// shift give both blocks' codes in element order. Q8: 32 bytes per block of `code + 128`.
    /// Scales [rows, nbp]. The layout where no 16-row SIMD path runs; every x86 path has kernels
    /// for it (`K3MINI_LAYOUT=rowpairs` takes it anywhere, to compare).
    RowPairs,
    /// 16 rows interleaved in 4-code groups per block ([`rows16`]; Q4 at a nibble a code, Q8 at a
    /// byte), scales [rows/16, nbp, 16]; rows padded to a multiple of 16. The AVX-512 kernels'
    /// (with VNNI and without), the AMX prefill tiles' ([`rows16::gemm_amx`]) and the AVX2 ones.
    Rows16,
}

impl Layout {
    /// The layout the fastest kernels on this CPU ([`Isa::best`]) read, for every kind: 16-row
    /// groups for AMX, AVX-512 (VNNI or not) and AVX2 with F16C, else row pairs.
    /// `K3MINI_LAYOUT=rowpairs|rows16` overrides it where the CPU has a kernel for that layout
    /// (row pairs: always; 16-row groups: AVX-512, AVX2 with F16C, or the scalar loops), to
    /// compare the two.
    pub fn best() -> Layout {
        static BEST: OnceLock<Layout> = OnceLock::new();
        *BEST.get_or_init(|| match std::env::var("K3MINI_LAYOUT").ok().as_deref() {
            Some("rowpairs") => Layout::RowPairs,
            Some("rows16") => Layout::Rows16,
            _ if Isa::best() >= Isa::Avx512 => Layout::Rows16,
            _ if Isa::best() == Isa::Avx2 && rows16_avx2() => Layout::Rows16,
            _ => Layout::RowPairs,
        })
    }
}

/// Whether a SIMD kernel for the 16-row layout runs on this CPU under the chosen ISA (AVX-512, or
/// AVX2 with F16C); else only the scalar loops read it.
pub fn rows16_simd() -> bool {
    Isa::best() >= Isa::Avx512 || (Isa::best() == Isa::Avx2 && rows16_avx2())
}

/// Whether the 16-row AVX2 kernels can run: AVX2 + FMA ([`Isa::Avx2`]) and F16C for the scales.
fn rows16_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    return Isa::Avx2.supported() && is_x86_feature_detected!("f16c");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// A weight matrix [rows, cols] repacked for the kernels, in one [`Layout`]. Scales stay f16
/// (ggml's bytes per weight); `m` holds Q4_1's and the Q5 types' mins (Q6_K's second-half
/// scales, Q4_K's super-block scales, whose `d` holds 6-bit scale-and-min byte pairs).
#[derive(Debug, Clone)]
pub struct Packed {
    pub kind: Kind,
    pub layout: Layout,
    pub rows: usize,
    pub cols: usize,
    /// Blocks per row, padded to even with zero blocks.
    pub nbp: usize,
    pub qs: Buf<u8>,
    pub d: Buf<u16>,
    pub m: Buf<u16>,
    /// The caller's share of this matrix's two-thread decode jobs (it leads them), learned
    /// from when the two sides finish ([`crate::threads::pair_balance`]).
    pub pair: crate::threads::PairBalance,
}

impl Packed {
    /// Row r's unsigned codes (`nbp·32`; Q8_0 as code + 128), in element order, from any layout.
    pub(crate) fn row_codes(&self, r: usize, codes: &mut [u8]) {
        match self.layout {
            Layout::Rows16 => rows16::load_codes(self, r, codes),
            Layout::RowPairs => {
                let q = &self.qs[r * self.row_qs()..(r + 1) * self.row_qs()];
                if self.kind.byte_codes() {
                    codes.copy_from_slice(q);
                } else {
                    for p in 0..self.nbp / 2 {
                        for j in 0..BLOCK {
                            let byte = q[p * 32 + j];
                            codes[2 * p * BLOCK + j] = byte & 0x0F;
                            codes[(2 * p + 1) * BLOCK + j] = byte >> 4;
                        }
                    }
                }
            }
        }
    }

    /// Row r's codes as the arithmetic takes them: [`Packed::row_codes`] looked up in the kind's
    /// [`Kind::code_table`] where it has one.
    pub(crate) fn row_code_values(&self, r: usize, codes: &mut [u8]) {
        self.row_codes(r, codes);
        if let Some(t) = self.kind.code_table() {
            codes.iter_mut().for_each(|c| *c = t[*c as usize]);
        }
    }

    /// Index of row r's block b scale in `d` (and min in `m`).
    #[inline]
    pub(crate) fn scale_at(&self, r: usize, b: usize) -> usize {
        match self.layout {
            Layout::RowPairs => r * self.nbp + b,
            Layout::Rows16 => rows16::scale_at(self.nbp, r, b),
        }
    }

    /// Row r dequantized to f32 (`cols` values): the weight values, as ggml's dequantizer gives
    /// them (for Q6_K with its scales rounded to f16).
    pub fn dequant_row(&self, r: usize, out: &mut [f32]) {
        let n = self.nbp;
        let (mut dw, mut mu) = (vec![0f32; 2 * n], vec![0f32; 2 * n]);
        self.half_scales(r, &mut dw, &mut mu);
        let mut codes = vec![0u8; n * BLOCK];
        self.row_code_values(r, &mut codes);
        for (i, o) in out.iter_mut().enumerate().take(self.cols) {
            *o = codes[i] as f32 * dw[i / 16] + mu[i / 16];
        }
    }

    /// A new matrix of the rows `idx` (in that order), in the same layout, in `place`.
    pub fn select_rows(&self, idx: &[usize], place: Place) -> Packed {
        Self::from_rows(self.kind, self.layout, idx.len(), self.cols, place, |i, c, d, m| {
            let r = idx[i];
            self.row_codes(r, c);
            for b in 0..self.nbp {
                d[b] = self.d[self.scale_at(r, b)];
                if self.kind.has_m() && !self.kind.super_scales() {
                    m[b] = self.m[self.scale_at(r, b)];
                }
            }
            if self.kind.super_scales() {
                for (e, v) in m[..self.nbp / 4].iter_mut().enumerate() {
                    *v = self.m[rows16::k4_at(self.nbp, r, e / 2, e % 2)];
                }
            }
        })
    }

    /// Bytes the kernels stream per product (for bandwidth figures).
    pub fn nbytes(&self) -> usize {
        self.qs.len() + 2 * (self.d.len() + self.m.len())
    }

    /// Rows a band of a product must start at a multiple of (the kernels' row tile).
    pub fn row_align(&self) -> usize {
        match self.layout {
            Layout::RowPairs => 4,
            Layout::Rows16 => rows16::ROWS,
        }
    }

    /// Bytes of codes (and high-bit planes) per row.
    pub(crate) fn row_qs(&self) -> usize {
        if self.kind.byte_codes() {
            self.nbp * 32
        } else {
            self.nbp * (16 + 4 * self.kind.planes())
        }
    }

    /// Row r's scales as f32 (`dw`) and offsets μ (`mu`), `nbp` each.
    pub(crate) fn row_scales(&self, r: usize, dw: &mut [f32], mu: &mut [f32]) {
        assert!(!self.kind.per_half(), "{:?}: scales that change every 16 codes: half_scales", self.kind);
        if self.kind == Kind::Q4K {
            for b in 0..self.nbp {
                let pair = self.d[self.scale_at(r, b)];
                let (sd, smin) = self.super_d_dmin(r, b / 8);
                dw[b] = sd * (pair & 0xFF) as f32;
                mu[b] = -smin * (pair >> 8) as f32;
            }
            return;
        }
        for b in 0..self.nbp {
            let i = self.scale_at(r, b);
            let d = half::f16::from_bits(self.d[i]).to_f32();
            dw[b] = d;
            mu[b] = match self.kind.code_offset() {
                Some(k) => -k * d,
                None => half::f16::from_bits(self.m[i]).to_f32(),
            };
        }
    }

    /// Row r's super-block sb `d` and `dmin` as f32 ([`Kind::super_scales`] kinds).
    fn super_d_dmin(&self, r: usize, sb: usize) -> (f32, f32) {
        let f = |which: usize| half::f16::from_bits(self.m[rows16::k4_at(self.nbp, r, sb, which)]).to_f32();
        (f(0), f(1))
    }

    /// [`Packed::row_scales`] per half block (`2·nbp` each): the same scale and offset twice for
    /// the kinds with one scale a block, Q6_K's two.
    pub(crate) fn half_scales(&self, r: usize, dw: &mut [f32], mu: &mut [f32]) {
        if self.kind == Kind::Q2K {
            for b in 0..self.nbp {
                let pair = self.d[self.scale_at(r, b)];
                let (sd, smin) = self.super_d_dmin(r, b / 8);
                for h in 0..2 {
                    let byte = (pair >> (8 * h)) & 0xFF;
                    dw[2 * b + h] = sd * (byte & 0xF) as f32;
                    mu[2 * b + h] = -smin * (byte >> 4) as f32;
                }
            }
            return;
        }
        if !self.kind.per_half() {
            let n = self.nbp;
            let (mut d1, mut m1) = (vec![0f32; n], vec![0f32; n]);
            self.row_scales(r, &mut d1, &mut m1);
            for b in 0..n {
                dw[2 * b..2 * b + 2].fill(d1[b]);
                mu[2 * b..2 * b + 2].fill(m1[b]);
            }
            return;
        }
        for b in 0..self.nbp {
            let i = self.scale_at(r, b);
            for (h, bits) in [self.d[i], self.m[i]].into_iter().enumerate() {
                dw[2 * b + h] = half::f16::from_bits(bits).to_f32();
                mu[2 * b + h] = -self.kind.code_offset().expect("Q6_K and Q3_K have an offset") * dw[2 * b + h];
            }
        }
    }
}

/// Where element (o − lo, t) of a product over weight rows lo..hi goes: `ptr[(o − lo)·rs + t·cs]`.
/// Row-major [hi − lo, T] for the tests, token-major [T, rows] (the engine's `Y`) for the engine,
/// so that no band has to be transposed afterwards.
#[derive(Debug, Clone, Copy)]
pub struct OutMat {
    pub ptr: *mut f32,
    pub rs: usize,
    pub cs: usize,
}

impl OutMat {
    /// Token-major: element (o − lo, t) at `y[t·ld + o]`, for a `y` of T rows of `ld` floats.
    ///
    /// # Safety
    /// `y` must hold T·ld floats, and no one else may write columns lo..hi while the product runs.
    pub unsafe fn token_major(y: *mut f32, lo: usize, ld: usize) -> OutMat {
        OutMat { ptr: y.add(lo), rs: 1, cs: ld }
    }

    #[inline(always)]
    pub(crate) unsafe fn at(self, r: usize, t: usize) -> *mut f32 {
        self.ptr.add(r * self.rs + t * self.cs)
    }

    #[inline(always)]
    pub(crate) unsafe fn put(self, r: usize, t: usize, v: f32) {
        *self.at(r, t) = v;
    }
}

/// Walk `lo..hi` × tokens `tokens` in tiles of at most `R × C`, calling `tile(o0, r, t0, c)`.
pub(crate) fn tiles(
    lo: usize,
    hi: usize,
    tokens: std::ops::Range<usize>,
    rmax: usize,
    cmax: usize,
    mut tile: impl FnMut(usize, usize, usize, usize),
) {
    let mut o0 = lo;
    while o0 < hi {
        let r = rmax.min(hi - o0);
        let mut t0 = tokens.start;
        while t0 < tokens.end {
            let c = cmax.min(tokens.end - t0);
            tile(o0, r, t0, c);
            t0 += c;
        }
        o0 += r;
    }
}

/// `out[(o − lo)·T + t] = Σ w[o]·x[t]` for weight rows `lo..hi` and every activation row, on `isa`.
///
/// # Shapes
/// w: [rows, cols] packed, a: [T, cols] → out: [hi − lo, T]
pub fn gemm_rows(isa: Isa, w: &Packed, a: &QActs, lo: usize, hi: usize, out: &mut [f32]) {
    assert!(hi <= w.rows && lo <= hi && out.len() >= (hi - lo) * a.t);
    // SAFETY: `out` holds [hi − lo, T] (checked) and is borrowed exclusively.
    unsafe { gemm_rows_out(isa, w, a, lo, hi, OutMat { ptr: out.as_mut_ptr(), rs: a.t, cs: 1 }) }
}

/// Whether IQ4_NL's VNNI tiles look their codes up with vpermb ([`rows16::gemm_avx512vbmi`]):
/// where the CPU has AVX-512 VBMI (Ice Lake and later, Zen 4), unless `K3MINI_VBMI=0`.
static VBMI: crate::switch::Switch = crate::switch::Switch::by_default("K3MINI_VBMI", "0", vbmi_detected);

#[cfg(target_arch = "x86_64")]
fn vbmi_detected() -> bool {
    std::arch::is_x86_feature_detected!("avx512vbmi")
}

#[cfg(not(target_arch = "x86_64"))]
fn vbmi_detected() -> bool {
    false
}

/// Whether [`VBMI`] is on; never where the CPU lacks AVX-512 VBMI.
pub fn vbmi() -> bool {
    VBMI.on() && vbmi_detected()
}

/// Set [`VBMI`] for the rest of the process (tests, in-process A/B measurements).
pub fn set_vbmi(on: bool) {
    VBMI.set(on);
}

/// Whether decode tasks start each next band on its way ([`prefetch_next_band`]);
/// `K3MINI_BAND_PREFETCH=0` turns it off.
static BAND_PREFETCH: crate::switch::Switch = crate::switch::Switch::new("K3MINI_BAND_PREFETCH", "0");

/// Set [`prefetch_next_band`]'s switch for the rest of the process (in-process A/B measurements).
pub fn set_band_prefetch(on: bool) {
    BAND_PREFETCH.set(on);
}

/// Whether a decode-sized product also prefetches its codes [`rows16`]'s far distance ahead
/// into L2, besides the near prefetch into L1 that every product issues. Always where its job
/// is spread over several threads ([`crate::threads::in_shared_job`]); where one thread runs
/// the whole product, on Intel CPUs but not on AMD's ([`FAR_PREFETCH_ALONE`]).
#[inline]
pub fn far_prefetch() -> bool {
    FAR_PREFETCH_ALONE.on() || crate::threads::in_shared_job()
}

/// [`far_prefetch`] for a product that one thread runs alone: on by default on Intel CPUs,
/// where the far prefetch was measured to pay at 1 thread (`rows16`'s `FAR_BYTES`), off on
/// AMD's, whose own L2 prefetcher it got in the way of there (Zen 4: the 370M's decode at 1
/// thread 1.02–1.07× without it in four in-process A/Bs, while at 2 threads it made no
/// difference outside the noise; Zen 3, AVX2 only, is taken to be alike, not measured).
/// `K3MINI_FAR_PREFETCH_ALONE=1` or `=0` sets it on any CPU.
static FAR_PREFETCH_ALONE: crate::switch::Switch =
    crate::switch::Switch::by_default("K3MINI_FAR_PREFETCH_ALONE", "0", || !amd_cpu());

/// Whether [`FAR_PREFETCH_ALONE`] is on.
pub fn far_prefetch_alone() -> bool {
    FAR_PREFETCH_ALONE.on()
}

/// Set [`FAR_PREFETCH_ALONE`] for the rest of the process (in-process A/B measurements).
pub fn set_far_prefetch_alone(on: bool) {
    FAR_PREFETCH_ALONE.set(on);
}

/// Whether the CPU's vendor string (CPUID leaf 0) is AMD's.
pub fn amd_cpu() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let id = std::arch::x86_64::__cpuid(0);
        // The vendor string's 12 bytes are in EBX, EDX, ECX, in that order.
        [id.ebx, id.edx, id.ecx].iter().flat_map(|r| r.to_le_bytes()).eq(*b"AuthenticAMD")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Before a task of a product over `t` tokens runs one band, the band it runs next: for
/// products that stream their weights once (decode, a few sequences), that band's first codes
/// and scales into L2 ([`rows16::prefetch_band`]); else nothing.
pub fn prefetch_next_band(w: &Packed, lo: usize, hi: usize, t: usize) {
    if BAND_PREFETCH.on() {
        rows16::prefetch_band(w, lo, hi, t);
    }
}

/// [`gemm_rows`] into any [`OutMat`] layout.
///
/// # Safety
/// `out` must be valid for writes at every (o − lo, t), o in lo..hi, t < T, and nothing else may
/// access those elements meanwhile.
pub unsafe fn gemm_rows_out(isa: Isa, w: &Packed, a: &QActs, lo: usize, hi: usize, out: OutMat) {
    let isa = isa.for_tokens(a.t); // AMX only over activations padded to its tiles
    let rows = if isa == Isa::Amx { a.t.next_multiple_of(16) } else { a.t };
    assert!(
        a.qs.len() >= rows * a.nbp * BLOCK && a.d.len() >= a.t * a.nbp && a.s.len() >= a.t * a.nbp,
        "activations shorter than their T × nbp blocks"
    );
    assert_eq!(w.nbp, a.nbp, "weight and activation widths differ");
    assert!(!w.kind.rows16_only() || w.layout == Layout::Rows16, "{:?} tiles exist only in 16-row groups", w.kind);
    assert!(hi <= w.rows && lo <= hi);
    assert!(
        lo.is_multiple_of(w.row_align()) || lo == hi,
        "a band starts at row {lo}, not a multiple of {}",
        w.row_align()
    );
    if w.layout == Layout::Rows16 {
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Amx && Isa::Amx.supported() {
            // SAFETY: AMX-INT8 with the tile state granted, AVX-512 with VNNI (checked just
            // above); `a` padded to whole token tiles (T ≥ AMX_MIN_TOKENS, asserted above).
            return unsafe { rows16::gemm_amx(w, a, lo, hi, out) };
        }
        #[cfg(target_arch = "x86_64")]
        if isa >= Isa::Avx512Vnni && Isa::Avx512Vnni.supported() {
            if w.kind == Kind::IQ4NL && vbmi() {
                // SAFETY: as below, and AVX-512 VBMI (checked by `vbmi`).
                return unsafe { rows16::gemm_avx512vbmi(w, a, lo, hi, out) };
            }
            // SAFETY: AVX-512 F/BW/VL + VNNI + FMA + F16C (checked just above); `out` as the caller promises.
            return unsafe { rows16::gemm_avx512vnni(w, a, lo, hi, out) };
        }
        #[cfg(target_arch = "x86_64")]
        if isa >= Isa::Avx512 && Isa::Avx512.supported() {
            // SAFETY: AVX-512 F/BW/VL + FMA + F16C (checked just above); `out` as the caller promises.
            return unsafe { rows16::gemm_avx512bw(w, a, lo, hi, out) };
        }
        #[cfg(target_arch = "x86_64")]
        if isa >= Isa::Avx2 && rows16_avx2() {
            // SAFETY: AVX2 + FMA (Isa::Avx2) and F16C (checked just above); `out` as the caller promises.
            return unsafe { rows16::gemm_avx2(w, a, lo, hi, out) };
        }
        return unsafe { scalar::gemm(w, a, lo, hi, out) };
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Amx if Isa::Amx.supported() => {
            // SAFETY: AMX-INT8 with the tile state granted, and AVX-512 (checked just above).
            unsafe { amx::gemm_amx(w, a, lo, hi, out) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Amx | Isa::Avx512Vnni if Isa::Avx512Vnni.supported() => {
            // SAFETY: the CPU supports every feature the kernel enables (checked just above).
            unsafe { x86::gemm_avx512(w, a, lo, hi, out) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Amx | Isa::Avx512Vnni | Isa::Avx512 if Isa::Avx512.supported() => {
            // SAFETY: as above, for AVX-512 F/BW/VL + FMA + F16C.
            unsafe { x86::gemm_avx512bw(w, a, lo, hi, out) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 | Isa::Avx512Vnni | Isa::Amx if Isa::Avx2.supported() => {
            // SAFETY: as above, for AVX2 + FMA.
            unsafe { x86::gemm_avx2(w, a, lo, hi, out) }
        }
        _ => unsafe { scalar::gemm(w, a, lo, hi, out) },
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

/// `[f(0), …, f(N − 1)]`, built in a plain loop that inlines into the SIMD kernels.
///
/// `std::array::from_fn` and `<[T; N]>::map` go through core's generic adapters, which are
/// compiled without the kernels' target features and so cannot take a kernel's closure inline:
/// in the 16-row AVX-512 tiles each was an out-of-line call in the block loop, with every vector
/// register spilled around it (Q4_0 one-token tiles in L2: 53 → 79 GMAC/s once gone).
#[inline(always)]
pub(crate) fn array_from<T: Copy, const N: usize>(mut f: impl FnMut(usize) -> T) -> [T; N] {
    let mut a = [std::mem::MaybeUninit::<T>::uninit(); N];
    for (i, v) in a.iter_mut().enumerate() {
        v.write(f(i));
    }
    // SAFETY: every element was written just above; MaybeUninit<T> has T's layout.
    unsafe { (a.as_ptr() as *const [T; N]).read() }
}

/// Σ_b μ[b]·s[b]: the offset term every path adds per (row, token).
#[inline]
pub(crate) fn offset_term(mu: &[f32], s: &[f32]) -> f32 {
    mu.iter().zip(s).map(|(a, b)| a * b).sum()
}

#[cfg(test)]
mod tests;
