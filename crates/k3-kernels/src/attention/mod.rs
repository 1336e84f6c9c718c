//! Softmax attention over a cache: GQA for Llama (here) and MLA in its absorbed (latent, MQA)
//! form ([`mla`]).

mod gqa_run;
mod mla;
mod split;
pub use mla::{mla_attend, mla_attend_block, mla_attend_ref};
pub use split::set_gqa_fused;

/// A raw output pointer for tasks that write disjoint rows.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);
// SAFETY: used only for disjoint writes inside one `Pool::run`.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}
impl OutPtr {
    /// # Safety
    /// `off..off + n` must be in bounds and written by this task alone.
    pub(crate) unsafe fn slice<'a>(self, off: usize, n: usize) -> &'a mut [f32] {
        std::slice::from_raw_parts_mut(self.0.add(off), n)
    }
}

/// The rows of an attention cache: f32, or f16 bits (llama.cpp's cache type: a decode step
/// streams half the bytes). The products widen f16 rows in registers as they load them.
#[derive(Debug, Clone, Copy)]
pub enum Rows<'a> {
    F32(&'a [f32]),
    F16(&'a [u16]),
}

impl Rows<'_> {
    /// Values `at` on their way into L2 ([`crate::simd::prefetch_l2`]).
    fn prefetch(&self, at: std::ops::Range<usize>) {
        match self {
            Rows::F32(v) => crate::simd::prefetch_l2(&v[at]),
            Rows::F16(v) => crate::simd::prefetch_l2(&v[at]),
        }
    }

    /// Values held (rows × row width).
    pub fn len(&self) -> usize {
        match self {
            Rows::F32(v) => v.len(),
            Rows::F16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Values `at..at + dst.len()` as f32.
    pub fn widen(&self, at: usize, dst: &mut [f32]) {
        match self {
            Rows::F32(v) => dst.copy_from_slice(&v[at..at + dst.len()]),
            Rows::F16(v) => crate::simd::f16_to_f32(dst, &v[at..at + dst.len()]),
        }
    }

    /// `C += A·Bᵀ`, B being these rows from value `off` on at stride `ldb` (scores against keys);
    /// [`crate::simd::matmul_nt_acc`]'s operands otherwise.
    #[allow(clippy::too_many_arguments)]
    fn matmul_nt_acc(
        &self,
        c: &mut [f32],
        ldc: usize,
        a: &[f32],
        lda: usize,
        off: usize,
        ldb: usize,
        m: usize,
        k: usize,
        n: usize,
    ) {
        match self {
            Rows::F32(v) => crate::simd::matmul_nt_acc(c, ldc, a, lda, &v[off..], ldb, m, k, n),
            Rows::F16(v) => crate::simd::matmul_nt_acc(c, ldc, a, lda, &v[off..], ldb, m, k, n),
        }
    }

    /// `C += A·B`, B being these rows from value `off` on at stride `ldb` (probabilities times
    /// values); [`crate::simd::matmul_acc_strided`]'s operands otherwise.
    #[allow(clippy::too_many_arguments)]
    fn matmul_acc(
        &self,
        c: &mut [f32],
        ldc: usize,
        a: &[f32],
        lda: usize,
        off: usize,
        ldb: usize,
        m: usize,
        k: usize,
        n: usize,
    ) {
        match self {
            Rows::F32(v) => crate::simd::matmul_acc_strided(c, ldc, a, lda, &v[off..], ldb, m, k, n),
            Rows::F16(v) => crate::simd::matmul_acc_strided(c, ldc, a, lda, &v[off..], ldb, m, k, n),
        }
    }

    /// Every value as f32 (borrowed when already f32): the reference paths.
    pub fn to_f32(&self) -> std::borrow::Cow<'_, [f32]> {
        match self {
            Rows::F32(v) => std::borrow::Cow::Borrowed(v),
            Rows::F16(v) => {
                let mut out = vec![0f32; v.len()];
                crate::simd::f16_to_f32(&mut out, v);
                std::borrow::Cow::Owned(out)
            }
        }
    }
}

/// One row of scores → attention probabilities in place: softmax(scale · score) over the first
/// `vis` (causally visible) positions, rounded to f16 with `f16_kq`, zero beyond.
pub(crate) fn causal_probabilities(row: &mut [f32], vis: usize, scale: f32, f16_kq: bool) {
    crate::ops::softmax_scaled_fast(&mut row[..vis], scale);
    if f16_kq {
        crate::simd::round_f16_inplace(&mut row[..vis]);
    }
    row[vis..].fill(0.0);
}

/// [`gqa_attend_ref`] in blocks (see [`attend_blocked`]), a one-token step over 1,024+ positions
/// with the positions split over the threads, one pass over each share (`split::gqa_decode_split`); under reference arithmetic
/// ([`crate::ops::set_reference_arithmetic`]), one (query, head) pair at a time in the reference's
/// summation order.
#[allow(clippy::too_many_arguments)]
pub fn gqa_attend(
    out: &mut [f32],
    q: &[f32],
    kc: Rows,
    vc: Rows,
    hq: usize,
    hkv: usize,
    d: usize,
    past: usize,
    f16_kq: bool,
    threads: usize,
) {
    if crate::ops::reference_arithmetic() {
        let t = q.len() / (hq * d);
        let threads = if (past + t) * t * hq * d < 1 << 15 { 1 } else { threads };
        return gqa_attend_pairs(out, q, &kc.to_f32(), &vc.to_f32(), hq, hkv, d, past, f16_kq, threads);
    }
    let heads = Heads { hq, hkv, dk: d, dv: d };
    if q.len() == hq * d && past + 1 >= split::GQA_SPLIT_MIN {
        return split::gqa_decode_split(out, q, kc, vc, heads, past + 1, f16_kq, threads, split::fused_on());
    }
    attend_blocked(out, q, Keys::Rows(kc), vc, heads, past, f16_kq, threads)
}

/// The keys of [`attend_blocked`]: cache rows [S, Hkv, dk] (GQA's cache), or per head a [dk, n]
/// block whose column j is position j's key (`n` ≥ S; what MLA's prefill expands the latent
/// cache into), so the scores are a plain A·B product.
#[derive(Debug, Clone, Copy)]
pub enum Keys<'a> {
    Rows(Rows<'a>),
    Columns { data: &'a [f32], n: usize },
}

/// Head counts and widths of a causal attention: `hq` query heads sharing `hkv` key/value heads
/// (G = hq / hkv per group), keys `dk` wide (scores scaled by 1/√dk), values `dv` wide.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    pub hq: usize,
    pub hkv: usize,
    pub dk: usize,
    pub dv: usize,
}

/// Causal attention in blocks: for each KV head and block of queries (about 128 rows: 128 / G
/// queries, 16 to 128), the rows of the heads sharing that KV head ([nq·G, dk]) against the cache's keys in one A·Bᵀ product and the
/// probabilities against its values in one A·B product, tasks over (KV head, block) on `threads`
/// pool threads. GQA for Llama (dk = dv) and MLA's prefill over decompressed keys and values
/// (dk = Dn + Dr, dv = Dv). The same arithmetic as [`gqa_attend_ref`] per row, up to the order
/// of the sums.
///
/// # Shapes
/// q: [T, Hq, dk]; keys: see [`Keys`]; vc: [S, Hkv, dv]; out: [T, Hq, dv]; S ≥ past + T
#[allow(clippy::too_many_arguments)]
pub fn attend_blocked(
    out: &mut [f32],
    q: &[f32],
    keys: Keys,
    vc: Rows,
    heads: Heads,
    past: usize,
    f16_kq: bool,
    threads: usize,
) {
    let Heads { hq, hkv, dk, dv } = heads;
    let t = q.len() / (hq * dk);
    let keys_fit = match keys {
        Keys::Rows(kc) => kc.len() >= (past + t) * hkv * dk,
        Keys::Columns { data, n } => n >= past + t && data.len() >= hkv * dk * n,
    };
    assert!(
        keys_fit && vc.len() >= (past + t) * hkv * dv && out.len() >= t * hq * dv,
        "attend_blocked: cache or output too short"
    );
    let threads = if (past + t) * t * hq * dk < 1 << 15 { 1 } else { threads };
    // A prompt's scores against key rows take a horizontal sum per (row, key), about as much
    // work as the multiply-adds at dk = 64; with the keys laid out as columns once (each KV
    // head's [dk, S], widened to f32: S·dk·Hkv copies against t·S·dk·Hq multiply-adds) they are
    // a plain A·B product, as MLA's long prefill has them.
    let columns;
    let keys = match keys {
        Keys::Rows(kc) if f16_kq && t >= COLUMNS_MIN => {
            let n = past + t;
            columns = key_columns(kc, hkv, dk, n);
            Keys::Columns { data: &columns, n }
        }
        keys => keys,
    };
    let group = hq / hkv;
    // Queries per block: about 128 rows against each pass over the cache (the keys and values
    // are re-read once per block).
    let qb = (128 / group).clamp(16, 128);
    let scale = 1.0 / (dk as f32).sqrt();
    let blocks = t.div_ceil(qb);
    let o = OutPtr(out.as_mut_ptr());
    crate::threads::Pool::global().run(threads, hkv * blocks, &|task| {
        let (kvh, b) = (task / blocks, task % blocks);
        let (t0, nq) = (b * qb, qb.min(t - b * qb));
        let rows = nq * group;
        // s: positions the block's last query sees. Row i·G + g of `a`: query t0 + i, head
        // kvh·G + g (contiguous in q for one query).
        let s = past + t0 + nq;
        let mut a = vec![0f32; rows * dk];
        for i in 0..nq {
            let src = ((t0 + i) * hq + kvh * group) * dk;
            a[i * group * dk..(i + 1) * group * dk].copy_from_slice(&q[src..src + group * dk]);
        }
        if f16_kq {
            crate::simd::round_f16_inplace(&mut a);
        } else {
            return online_block(o, &a, keys, vc, heads, OnlineBlock { kvh, t0, nq, past, s, scale });
        }
        let mut sc = vec![0f32; rows * s];
        match keys {
            Keys::Rows(kc) => kc.matmul_nt_acc(&mut sc, s, &a, dk, kvh * dk, hkv * dk, rows, dk, s),
            Keys::Columns { data, n } => {
                // In column blocks whose keys stay in L2 while every row of `a` passes.
                const KB: usize = 512;
                let kt = &data[kvh * dk * n..];
                for j0 in (0..s).step_by(KB) {
                    let nb = KB.min(s - j0);
                    crate::simd::matmul_acc_strided(&mut sc[j0..], s, &a, dk, &kt[j0..], n, rows, dk, nb);
                }
            }
        }
        for (i, row) in sc.chunks_exact_mut(s).enumerate() {
            causal_probabilities(row, past + t0 + i / group + 1, scale, f16_kq);
        }
        let mut ob = vec![0f32; rows * dv];
        vc.matmul_acc(&mut ob, dv, &sc, s, kvh * dv, hkv * dv, rows, s, dv);
        for i in 0..nq {
            // SAFETY: query t0 + i's heads kvh·G.. belong to this task alone.
            let dst = unsafe { o.slice(((t0 + i) * hq + kvh * group) * dv, group * dv) };
            dst.copy_from_slice(&ob[i * group * dv..(i + 1) * group * dv]);
        }
    });
}

/// Fewest new tokens for which [`attend_blocked`]'s two-pass form lays key rows out as columns.
const COLUMNS_MIN: usize = 16;

/// The first `n` positions of key rows [·, Hkv, dk] as each KV head's [dk, n] block of columns
/// (column j position j's key), widened to f32: [Hkv, dk, n].
fn key_columns(kc: Rows, hkv: usize, dk: usize, n: usize) -> Vec<f32> {
    // 16 positions at a time, so that each column is written 64 contiguous bytes at once.
    const J: usize = 16;
    let w = hkv * dk;
    let mut cols = vec![0f32; w * n];
    let mut rows = vec![0f32; J * w];
    for j0 in (0..n).step_by(J) {
        let nb = J.min(n - j0);
        kc.widen(j0 * w, &mut rows[..nb * w]);
        for (c, col) in cols.chunks_exact_mut(n).enumerate() {
            for (jj, x) in col[j0..j0 + nb].iter_mut().enumerate() {
                *x = rows[jj * w + c];
            }
        }
    }
    cols
}

/// Where one task of [`attend_blocked`] works: KV head, first query and query count of its
/// block, cached positions before the prompt, positions the block's last query sees, 1/√dk.
#[derive(Clone, Copy)]
struct OnlineBlock {
    kvh: usize,
    t0: usize,
    nq: usize,
    past: usize,
    s: usize,
    scale: f32,
}

/// Positions per key tile of [`online_block`]: a tile's scores for a 128-row block (128 KiB) stay
/// in L2 between the product that writes them and the one that reads them.
const KEY_TILE: usize = 256;

/// One block of [`attend_blocked`] in one pass over the keys (flash attention's online softmax):
/// per tile of [`KEY_TILE`] positions, the scores `A·Kᵀ` [rows, tile], each row's running
/// maximum m and sum l of `e^(scale·score − m)` (the output and l rescaled by `e^(m_old − m_new)`
/// when m grows), and the tile's probabilities times its values added to the output; divided by
/// l at the end. The same arithmetic as the two-pass softmax up to the rounding of the rescales;
/// never holds a row of all S scores (at 4K positions a 128-row block's was 2 MiB, past L2).
///
/// # Shapes
/// a: [rows = nq·G, dk] (row i·G + g: query t0 + i, head kvh·G + g); out: [T, Hq, dv], of which
/// this block writes queries t0..t0 + nq, heads kvh·G..(kvh + 1)·G
fn online_block(out: OutPtr, a: &[f32], keys: Keys, vc: Rows, heads: Heads, blk: OnlineBlock) {
    let Heads { hq, hkv, dk, dv } = heads;
    let OnlineBlock { kvh, t0, nq, past, s, scale } = blk;
    let group = hq / hkv;
    let rows = nq * group;
    let mut sc = vec![0f32; rows * KEY_TILE];
    let mut ob = vec![0f32; rows * dv];
    let (mut mx, mut l) = (vec![f32::NEG_INFINITY; rows], vec![0f32; rows]);
    for j0 in (0..s).step_by(KEY_TILE) {
        let nb = KEY_TILE.min(s - j0);
        sc.fill(0.0);
        match keys {
            Keys::Rows(kc) => kc.matmul_nt_acc(&mut sc, KEY_TILE, a, dk, (j0 * hkv + kvh) * dk, hkv * dk, rows, dk, nb),
            Keys::Columns { data, n } => {
                crate::simd::matmul_acc_strided(&mut sc, KEY_TILE, a, dk, &data[kvh * dk * n + j0..], n, rows, dk, nb)
            }
        }
        for (i, row) in sc.chunks_exact_mut(KEY_TILE).enumerate() {
            // Positions of this tile that row i's query sees (causal).
            let vis = (past + t0 + i / group + 1).saturating_sub(j0).min(nb);
            if vis == 0 {
                row.fill(0.0);
                continue;
            }
            let m_tile = row[..vis].iter().copied().fold(f32::NEG_INFINITY, f32::max) * scale;
            if m_tile > mx[i] {
                let alpha = crate::ops::exp_fast(mx[i] - m_tile); // 0 on the first tile
                ob[i * dv..(i + 1) * dv].iter_mut().for_each(|x| *x *= alpha);
                l[i] *= alpha;
                mx[i] = m_tile;
            }
            l[i] += crate::ops::exp_shifted_sum(&mut row[..vis], scale, mx[i]);
            row[vis..].fill(0.0);
        }
        vc.matmul_acc(&mut ob, dv, &sc, KEY_TILE, (j0 * hkv + kvh) * dv, hkv * dv, rows, nb, dv);
    }
    for i in 0..nq {
        for g in 0..group {
            let r = i * group + g;
            let inv = 1.0 / l[r];
            // SAFETY: query t0 + i's head kvh·G + g belongs to this block (its caller's task) alone.
            let dst = unsafe { out.slice(((t0 + i) * hq + kvh * group + g) * dv, dv) };
            for (d, &x) in dst.iter_mut().zip(&ob[r * dv..(r + 1) * dv]) {
                *d = x * inv;
            }
        }
    }
}

/// [`gqa_attend_ref`]'s arithmetic with the (query, head) pairs spread over `threads`.
#[allow(clippy::too_many_arguments)]
fn gqa_attend_pairs(
    out: &mut [f32],
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    hq: usize,
    hkv: usize,
    d: usize,
    past: usize,
    f16_kq: bool,
    threads: usize,
) {
    let t = q.len() / (hq * d);
    let o = OutPtr(out.as_mut_ptr());
    crate::threads::Pool::global().run(threads, t * hq, &|i| {
        let (r, hh) = (i / hq, i % hq);
        // SAFETY: task (r, hh) writes only its own [D] slice.
        let oh = unsafe { o.slice((r * hq + hh) * d, d) };
        attend_one(
            oh,
            &q[(r * hq + hh) * d..(r * hq + hh + 1) * d],
            kc,
            vc,
            hh / (hq / hkv),
            hkv,
            d,
            past + r + 1,
            f16_kq,
        );
    });
}

/// One query head against the first `n` cache positions of KV head `kvh`.
#[allow(clippy::too_many_arguments)]
fn attend_one(
    out: &mut [f32],
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    kvh: usize,
    hkv: usize,
    d: usize,
    n: usize,
    f16_kq: bool,
) {
    let scale = 1.0 / (d as f32).sqrt();
    let mut qv = q.to_vec();
    if f16_kq {
        crate::simd::round_f16_inplace(&mut qv);
    }
    let mut scores: Vec<f32> =
        (0..n).map(|j| crate::ops::dot(&qv, &kc[(j * hkv + kvh) * d..(j * hkv + kvh + 1) * d]) * scale).collect();
    crate::ops::softmax_inplace(&mut scores);
    if f16_kq {
        crate::simd::round_f16_inplace(&mut scores);
    }
    out.iter_mut().for_each(|x| *x = 0.0);
    for (j, &p) in scores.iter().enumerate() {
        crate::ops::axpy(out, p, &vc[(j * hkv + kvh) * d..(j * hkv + kvh + 1) * d]);
    }
}

/// Round to the nearest f16 value (ties to even), as an f32.
pub fn round_f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// Causal GQA for T new queries at absolute positions `past..past+T` over a K/V cache holding
/// `past + T` positions.
///
/// `f16_kq` rounds the query and the probabilities to f16 as llama.cpp does against its f16 cache.
///
/// # Shapes
/// q: [T, Hq, D]; kc, vc: [S, Hkv, D]; out: [T, Hq, D]
#[allow(clippy::too_many_arguments)]
pub fn gqa_attend_ref(
    out: &mut [f32],
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    hq: usize,
    hkv: usize,
    d: usize,
    past: usize,
    f16_kq: bool,
) {
    let t = q.len() / (hq * d);
    let scale = 1.0 / (d as f32).sqrt();
    let group = hq / hkv;
    for r in 0..t {
        let n = past + r + 1; // causal: positions 0..=past+r
        let mut scores = vec![0f32; n];
        for hh in 0..hq {
            let kvh = hh / group;
            let qv: Vec<f32> = q[(r * hq + hh) * d..(r * hq + hh + 1) * d]
                .iter()
                .map(|&x| if f16_kq { round_f16(x) } else { x })
                .collect();
            for (j, sc) in scores.iter_mut().enumerate() {
                *sc = crate::ops::dot(&qv, &kc[(j * hkv + kvh) * d..(j * hkv + kvh + 1) * d]) * scale;
            }
            crate::ops::softmax_inplace(&mut scores);
            if f16_kq {
                scores.iter_mut().for_each(|p| *p = round_f16(*p));
            }
            let o = &mut out[(r * hq + hh) * d..(r * hq + hh + 1) * d];
            o.iter_mut().for_each(|x| *x = 0.0);
            for (j, &p) in scores.iter().enumerate() {
                crate::ops::axpy(o, p, &vc[(j * hkv + kvh) * d..(j * hkv + kvh + 1) * d]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_close_abs, Rng};

    #[test]
    fn parallel_attention_matches_the_references() {
        let mut rng = Rng::new(21);
        for f16 in [false, true] {
            // GQA: new queries after cached positions (decode steps, a few, more than one
            // block of queries, more than one kernel panel of keys), 6 query heads over 2 KV heads,
            // blocked and (reference arithmetic) per pair, at 1–3 threads, over an f32 cache and
            // an f16 one holding the same (f16-representable) values.
            let (hq, hkv, d) = (6, 2, 16);
            // Decode steps over 64 positions or more take the split path (one share per thread;
            // 71 positions: shares within one tile), fewer the blocked one; prompts of 16 tokens
            // or more with f16 probabilities lay the keys out as columns.
            for (t, past) in [(1, 30), (1, 70), (3, 40), (37, 5), (24, 700), (2, 1100), (1, 1500), (1, 2600)] {
                let q = rng.normals(t * hq * d, 1.0);
                let f16_values = |rng: &mut Rng| {
                    let mut v = rng.normals((past + t) * hkv * d, 1.0);
                    crate::simd::round_f16_inplace(&mut v);
                    v
                };
                let (kc, vc) = (f16_values(&mut rng), f16_values(&mut rng));
                let bits = |v: &[f32]| v.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect::<Vec<u16>>();
                let (kh, vh) = (bits(&kc), bits(&vc));
                let mut want = vec![0f32; t * hq * d];
                gqa_attend_ref(&mut want, &q, &kc, &vc, hq, hkv, d, past, f16);
                for threads in [1, 2, 3] {
                    for (name, k, v) in
                        [("f32", Rows::F32(&kc), Rows::F32(&vc)), ("f16", Rows::F16(&kh), Rows::F16(&vh))]
                    {
                        let mut got = vec![0f32; t * hq * d];
                        gqa_attend(&mut got, &q, k, v, hq, hkv, d, past, f16, threads);
                        let tol = if f16 { 2e-3 } else { 1e-5 }; // f16 rounding of p may flip on reordered sums
                        assert_close_abs(&format!("gqa {name} T={t} past={past} x{threads}"), &got, &want, tol);
                    }
                    let mut pairs = vec![0f32; t * hq * d];
                    gqa_attend_pairs(&mut pairs, &q, &kc, &vc, hq, hkv, d, past, f16, threads);
                    assert_close_abs(&format!("gqa pairs T={t} x{threads}"), &pairs, &want, 1e-5);
                }
            }
            // Keys wider than values (MLA prefill over decompressed heads): the reference with
            // the values zero-padded to the keys' width, its first dv columns.
            let (hq, hkv, dk, dv) = (4, 4, 24, 16);
            for (t, past) in [(1, 30), (37, 5), (20, 600)] {
                let q = rng.normals(t * hq * dk, 1.0);
                let kc = rng.normals((past + t) * hkv * dk, 1.0);
                let vc = rng.normals((past + t) * hkv * dv, 1.0);
                let mut padded = vec![0f32; (past + t) * hkv * dk];
                for (row, v) in padded.chunks_exact_mut(dk).zip(vc.chunks_exact(dv)) {
                    row[..dv].copy_from_slice(v);
                }
                let mut wide = vec![0f32; t * hq * dk];
                gqa_attend_ref(&mut wide, &q, &kc, &padded, hq, hkv, dk, past, f16);
                let want: Vec<f32> = wide.chunks_exact(dk).flat_map(|r| r[..dv].to_vec()).collect();
                // The same keys as per-head column blocks, two spare columns wide.
                let n = past + t + 2;
                let mut kt = vec![0f32; hkv * dk * n];
                for j in 0..past + t {
                    for kvh in 0..hkv {
                        for c in 0..dk {
                            kt[(kvh * dk + c) * n + j] = kc[(j * hkv + kvh) * dk + c];
                        }
                    }
                }
                for threads in [1, 3] {
                    for (name, keys) in
                        [("rows", Keys::Rows(Rows::F32(&kc))), ("columns", Keys::Columns { data: &kt, n })]
                    {
                        let mut got = vec![0f32; t * hq * dv];
                        attend_blocked(
                            &mut got,
                            &q,
                            keys,
                            Rows::F32(&vc),
                            Heads { hq, hkv, dk, dv },
                            past,
                            f16,
                            threads,
                        );
                        let tol = if f16 { 2e-3 } else { 1e-5 };
                        assert_close_abs(&format!("{name} dk {dk} dv {dv} T={t} x{threads}"), &got, &want, tol);
                    }
                }
            }
        }
    }
}
