//! AMX path of [`super::gemm_rows`] (prefill) over row pairs: Intel AMX-INT8 tile products, one
//! 32-code block at a time, each block's i32 sums scaled in f32 with AVX-512 as ggml does per
//! block. AMX CPUs hold their matrices in 16-row groups ([`super::rows16::gemm_amx`]) since
//! 2026-12-03; this path runs under `K3MINI_LAYOUT=rowpairs`. Also the tile permission and
//! configuration both paths use.
//!
//! Per tile of 16 weight rows × 16 tokens and block b:
//! ```text
//! C_b[m, n] = Σ_{j<32} w[m, 32b + j] · x[n, 32b + j]      (TDPBSSD: i8 × i8 → i32; Q4_1: TDPBUSD, u8 × i8)
//! acc[m, n] += d_w[m, b] · d_x[n, b] · C_b[m, n]  (+ m_w[m, b] · s_x[n, b] for Q4_1)
//! ```
//! Q4_0 and Q8_0 weights enter as signed codes (code − 8, code), so they need no offset term.
//! The weights of a row tile are unpacked once into [block][16 rows][32] bytes and reused for every
//! token tile; the activations are laid out once per product in AMX's B layout ([`AmxActs`]).
//!
//! The instructions are written with `asm!` (stable Rust has no AMX intrinsics). The kernel asks
//! Linux for the tile state once per process (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); when the kernel
//! or hypervisor refuses, [`available`] is false and the AVX-512 path runs instead.

use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::{Kind, OutMat, Packed, QActs, BLOCK};

/// Rows (and tokens) per tile.
const TILE: usize = 16;

/// Whether this CPU has AMX-INT8 and the OS lets this process use the tile registers.
pub fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        // CPUID.(EAX=7, ECX=0):EDX bit 24 AMX-TILE, bit 25 AMX-INT8.
        let leaf = __cpuid_count(7, 0);
        if leaf.edx & (1 << 24) == 0 || leaf.edx & (1 << 25) == 0 {
            return false;
        }
        request_tile_permission()
    })
}

/// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`: Linux grants the tile data state per
/// process, for every thread.
#[cfg(target_os = "linux")]
fn request_tile_permission() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: a plain system call; it reads no memory of ours and only changes this process's
    // permission to use the AMX state.
    unsafe {
        asm!("syscall", inlateout("rax") SYS_ARCH_PRCTL => ret, in("rdi") ARCH_REQ_XCOMP_PERM,
             in("rsi") XFEATURE_XTILEDATA, lateout("rcx") _, lateout("r11") _, options(nostack));
    }
    ret == 0
}

#[cfg(not(target_os = "linux"))]
fn request_tile_permission() -> bool {
    false
}

/// A tile configuration (palette 1): per tile register, its rows and bytes a row.
#[repr(C, align(64))]
pub(crate) struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
    reserved2: [u8; 16],
}

impl TileConfig {
    /// Tiles tmm0, tmm1, ... as `(rows, bytes a row)`; the rest unused.
    pub(crate) const fn new(tiles: &[(u8, u16)]) -> TileConfig {
        let mut c = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
            reserved2: [0; 16],
        };
        let mut i = 0;
        while i < tiles.len() {
            c.rows[i] = tiles[i].0;
            c.colsb[i] = tiles[i].1;
            i += 1;
        }
        c
    }

    /// Load this configuration into the tile registers (zeroing them).
    ///
    /// # Safety
    /// [`available`] must be true.
    #[inline(always)]
    pub(crate) unsafe fn load(&self) {
        asm!("ldtilecfg [{0}]", in(reg) self, options(nostack, readonly));
    }
}

/// Give the tile state back (after a product, so that the OS need not save it).
///
/// # Safety
/// [`available`] must be true.
#[inline(always)]
pub(crate) unsafe fn release() {
    asm!("tilerelease", options(nostack, nomem));
}

/// `C = 0; C += A·B` on tile registers `$c`, `$a`, `$b` (literals) by instruction `$op` (TDPBSSD,
/// TDPBSUD), A loaded from `$x` with row stride `$xs` bytes, B from `$w` in rows of 64 bytes.
macro_rules! tile_product {
    ($op:literal, $c:literal, $a:literal, $b:literal, $x:expr, $xs:expr, $w:expr) => {
        std::arch::asm!(concat!("tilezero ", $c), concat!("tileloadd ", $a, ", [{x} + {xs}*1]"),
             concat!("tileloadd ", $b, ", [{w} + {ws}*1]"), concat!($op, " ", $c, ", ", $a, ", ", $b),
             x = in(reg) $x, xs = in(reg) $xs, w = in(reg) $w, ws = in(reg) 64usize, options(nostack, readonly))
    };
}
pub(crate) use tile_product;

/// Store tile register `$t` (a literal) as 16 rows of 64 bytes at `$p`.
macro_rules! tile_store {
    ($t:literal, $p:expr) => {
        std::arch::asm!(concat!("tilestored [{c} + {cs}*1], ", $t), c = in(reg) $p, cs = in(reg) 64usize,
             options(nostack))
    };
}
pub(crate) use tile_store;

/// Write a token tile's results (`acc[m]`: token t0 + m's 16 row lanes) for `valid` rows from
/// output row `orow` and the first `tokens` tokens: one masked store a token when rows are
/// contiguous in `out` (the engine's token-major Y), else a scatter down the row stride.
///
/// # Safety
/// AVX-512F; `out` valid for those rows and tokens.
#[inline(always)]
pub(crate) unsafe fn store_rows(
    acc: &[__m512; TILE],
    valid: usize,
    orow: usize,
    t0: usize,
    tokens: usize,
    out: OutMat,
) {
    let mask: __mmask16 = if valid == TILE { 0xFFFF } else { (1u16 << valid) - 1 };
    let idx = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(out.rs as i32),
    );
    for (m, &v) in acc.iter().enumerate().take(tokens) {
        let p = out.at(orow, t0 + m);
        if out.rs == 1 {
            _mm512_mask_storeu_ps(p, mask, v);
        } else {
            _mm512_mask_i32scatter_ps::<4>(p, mask, idx, v);
        }
    }
}

/// This kernel's tiles: C tmm0 / tmm3 [16 tokens × 16 rows, i32], A tmm1 / tmm4 [16 tokens × 32
/// codes], B tmm2 / tmm5 [8 groups of 4 codes × 16 rows × 4].
const CONFIG: TileConfig = TileConfig::new(&[(16, 64), (16, 32), (8, 64), (16, 64), (16, 32), (8, 64)]);

/// # Safety
/// [`available`] must be true (AMX-INT8 with the tile state granted, AVX-512 F/BW/VL, F16C);
/// `out` must be valid for rows 0..hi − lo and tokens 0..T.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub unsafe fn gemm_amx(w: &Packed, a: &QActs, lo: usize, hi: usize, out: OutMat) {
    let n = w.nbp;
    let ld = n * BLOCK; // activation row stride, bytes
    debug_assert!(a.qs.len() >= a.t.next_multiple_of(TILE) * ld, "QActs pads to whole token tiles");
    CONFIG.load();
    // One row tile: codes in B layout [nbp, 8, 16, 4], scales and mins [nbp, 16].
    let mut wt = vec![0i8; n * TILE * BLOCK];
    let mut rows_tmp = vec![0i8; TILE * n * BLOCK];
    let mut dw = vec![0f32; n * TILE];
    let mut mw = vec![0f32; n * TILE];
    let mut cbuf = [[0i32; TILE * TILE]; 2];
    let (scale, mu) = (&mut vec![0f32; n], &mut vec![0f32; n]);
    let q41 = w.kind == Kind::Q4_1;
    let mut o0 = lo;
    while o0 < hi {
        let r = TILE.min(hi - o0);
        unpack_rows(w, o0, r, &mut rows_tmp, &mut wt, &mut dw, &mut mw, scale, mu);
        for t0 in (0..a.t).step_by(TILE) {
            let mut acc = [_mm512_setzero_ps(); TILE];
            let xp = |b: usize| a.qs.as_ptr().add(t0 * ld + b * BLOCK);
            let wp = |b: usize| wt.as_ptr().add(b * TILE * BLOCK);
            // Software-pipelined over two C tiles: block b + 1's product is issued, then block b's
            // tile is stored and scaled while b + 1 computes.
            tile_dot(q41, 0, xp(0), ld, wp(0));
            for b in 0..n {
                if b + 1 < n {
                    tile_dot(q41, (b + 1) % 2, xp(b + 1), ld, wp(b + 1));
                }
                store_slot(b % 2, cbuf[b % 2].as_mut_ptr());
                let cb = &cbuf[b % 2];
                let dwv = _mm512_loadu_ps(dw.as_ptr().add(b * TILE));
                for m in 0..TILE {
                    let c = _mm512_cvtepi32_ps(_mm512_loadu_si512(cb.as_ptr().add(m * TILE) as *const _));
                    let s = _mm512_mul_ps(dwv, _mm512_set1_ps(*a.d.get_unchecked((t0 + m) * n + b)));
                    acc[m] = _mm512_fmadd_ps(c, s, acc[m]);
                }
                if q41 {
                    let mwv = _mm512_loadu_ps(mw.as_ptr().add(b * TILE));
                    for m in 0..TILE {
                        let sx = _mm512_set1_ps(*a.s16.get_unchecked((t0 + m) * n + b));
                        acc[m] = _mm512_fmadd_ps(mwv, sx, acc[m]);
                    }
                }
            }
            store_rows(&acc, r, o0 - lo, t0, TILE.min(a.t - t0), out);
        }
        o0 += r;
    }
    release();
}

/// Issue C_slot = A·B for one block: A the 16 token rows × 32 codes at `xp` (row stride `ld`
/// bytes), B the weight tile at `wp`. Slot 0 uses tmm0–2, slot 1 tmm3–5.
#[inline(always)]
unsafe fn tile_dot(q41: bool, slot: usize, xp: *const i8, ld: usize, wp: *const i8) {
    // Q4_1 codes are unsigned (TDPBSUD: signed activations × unsigned weights); Q4_0 and Q8_0
    // enter signed (TDPBSSD).
    match (q41, slot) {
        (false, 0) => tile_product!("tdpbssd", "tmm0", "tmm1", "tmm2", xp, ld, wp),
        (false, _) => tile_product!("tdpbssd", "tmm3", "tmm4", "tmm5", xp, ld, wp),
        (true, 0) => tile_product!("tdpbsud", "tmm0", "tmm1", "tmm2", xp, ld, wp),
        (true, _) => tile_product!("tdpbsud", "tmm3", "tmm4", "tmm5", xp, ld, wp),
    }
}

/// Store C tile `slot` as 16 × 16 i32 at `cp`.
#[inline(always)]
unsafe fn store_slot(slot: usize, cp: *mut i32) {
    if slot == 0 {
        tile_store!("tmm0", cp);
    } else {
        tile_store!("tmm3", cp);
    }
}

/// Rows o0..o0+r of `w` as tile B operands: block b at `wt[b·512..]`, byte (g·16 + row)·4 + i =
/// code 4g + i of that row (signed codes; Q4_1 unsigned), scales and Q4_1 mins [nbp, 16]. Rows
/// past r are zero.
///
/// # Safety
/// The CPU must have AVX2.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2")]
unsafe fn unpack_rows(
    w: &Packed,
    o0: usize,
    r: usize,
    rows_tmp: &mut [i8],
    wt: &mut [i8],
    dw: &mut [f32],
    mw: &mut [f32],
    scale: &mut [f32],
    mu: &mut [f32],
) {
    let (n, rq) = (w.nbp, w.row_qs());
    if r < TILE {
        rows_tmp.fill(0);
        dw.fill(0.0);
        mw.fill(0.0);
    }
    for m in 0..r {
        w.row_scales(o0 + m, scale, mu);
        let q = &w.qs[(o0 + m) * rq..(o0 + m + 1) * rq];
        for b in 0..n {
            dw[b * TILE + m] = scale[b];
            if w.kind == Kind::Q4_1 {
                mw[b * TILE + m] = mu[b];
            }
        }
        // Every load reads 32 bytes of `q`, every store one 32-byte block of row m's codes.
        let base = rows_tmp.as_mut_ptr().add(m * n * BLOCK);
        let dst = |b: usize| base.add(b * BLOCK) as *mut __m256i;
        match w.kind {
            Kind::Q8_0 => {
                for b in 0..n {
                    let v = _mm256_loadu_si256(q.as_ptr().add(b * BLOCK) as *const __m256i);
                    _mm256_storeu_si256(dst(b), _mm256_xor_si256(v, _mm256_set1_epi8(-128)));
                }
            }
            Kind::Q5_0 | Kind::Q6K | Kind::Q5K | Kind::Q5_1 | Kind::Q4K | Kind::Q3K | Kind::Q2K | Kind::IQ4NL => {
                unreachable!("Q5 / Q6_K tiles exist only in 16-row groups (gemm_rows_out checks)")
            }
            Kind::Q4_0 | Kind::Q4_1 => {
                let (m4, off) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(if w.kind == Kind::Q4_0 { 8 } else { 0 }));
                for p in 0..n / 2 {
                    let v = _mm256_loadu_si256(q.as_ptr().add(p * 32) as *const __m256i);
                    let lo = _mm256_sub_epi8(_mm256_and_si256(v, m4), off);
                    let hi = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16::<4>(v), m4), off);
                    _mm256_storeu_si256(dst(2 * p), lo);
                    _mm256_storeu_si256(dst(2 * p + 1), hi);
                }
            }
        }
    }
    // [row][b][g][4] → [b][g][row][4]: groups of 4 codes move as one u32.
    let src = rows_tmp.as_ptr() as *const u32;
    let dst = wt.as_mut_ptr() as *mut u32;
    for b in 0..n {
        for g in 0..8 {
            for m in 0..TILE {
                *dst.add((b * 8 + g) * TILE + m) = src.add((m * n + b) * 8 + g).read_unaligned();
            }
        }
    }
}
