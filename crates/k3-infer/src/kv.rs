//! Attention caches: rows held as f16 (llama.cpp's cache type) or f32 (the exact mode).

use crate::hugepages::HUGE;
use k3_kernels::attention;

/// One layer's cached rows (Llama's keys or values, MLA's latent rows): f16, llama.cpp's cache
/// type and the default (a decode step streams half the bytes of f32), or f32 under the exact
/// mode (transformers' numerics).
#[derive(Debug, Clone)]
pub enum KvRows {
    F16(Vec<u16>),
    F32(Vec<f32>),
}

impl Default for KvRows {
    fn default() -> Self {
        KvRows::F16(Vec::new())
    }
}

impl KvRows {
    /// Values held (positions × row width).
    pub fn len(&self) -> usize {
        self.rows().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn bytes(&self) -> usize {
        match self {
            KvRows::F16(v) => 2 * v.len(),
            KvRows::F32(v) => 4 * v.len(),
        }
    }

    pub fn rows(&self) -> attention::Rows<'_> {
        match self {
            KvRows::F16(v) => attention::Rows::F16(v),
            KvRows::F32(v) => attention::Rows::F32(v),
        }
    }

    /// Append rows, as f16 (rounded to nearest) or f32. A cache of the other type is converted
    /// first: f16 → f32 exactly, f32 → f16 rounding as the f16 mode rounds everything it stores.
    pub fn push(&mut self, x: &[f32], f16: bool) {
        match (&mut *self, f16) {
            (KvRows::F16(v), true) => {
                grow(v, x.len());
                let at = v.len();
                v.resize(at + x.len(), 0);
                k3_kernels::simd::f32_to_f16(&mut v[at..], x);
            }
            (KvRows::F32(v), false) => {
                grow(v, x.len());
                v.extend_from_slice(x)
            }
            (KvRows::F16(v), false) => {
                let mut wide = vec![0f32; v.len()];
                k3_kernels::simd::f16_to_f32(&mut wide, v);
                wide.extend_from_slice(x);
                *self = KvRows::F32(wide);
            }
            (KvRows::F32(v), true) => {
                let mut narrow = vec![0u16; v.len() + x.len()];
                k3_kernels::simd::f32_to_f16(&mut narrow[..v.len()], v);
                k3_kernels::simd::f32_to_f16(&mut narrow[v.len()..], x);
                *self = KvRows::F16(narrow);
            }
        }
    }
}

/// Bytes from which a cache grows onto huge pages ([`grow`]).
const HUGE_FROM: usize = 2 * HUGE;

/// Whether caches grow onto huge pages ([`grow`]; with huge pages on at all,
/// `k3_kernels::hugebuf::enabled`); `K3MINI_KV_HUGEPAGES=0` keeps them on the allocator's pages.
static KV_HUGEPAGES: k3_kernels::threads::Switch = k3_kernels::threads::Switch::new("K3MINI_KV_HUGEPAGES", "0");

/// Set [`KV_HUGEPAGES`] for the rest of the process (in-process A/B measurements: it applies to
/// the caches that grow from then on).
pub fn set_kv_hugepages(on: bool) {
    KV_HUGEPAGES.set(on);
}

/// Room for `extra` more values in `v`. Once a cache passes [`HUGE_FROM`] bytes, each growth
/// (to twice the capacity, or what is needed) goes to a fresh buffer, a huge page more than
/// that (whole huge pages then hold all of it but at most a huge page at its ends), advised onto huge pages before
/// anything is written to it ([`crate::hugepages::advise`]), and the rows are copied over. A
/// decode step streams each layer's cache once: from a cache of 4 KiB pages it took a TLB miss
/// every 4 KiB and the hardware prefetchers stopped at each page; the allocator's buffers are
/// fresh mappings of 4 KiB pages (THP `madvise`), never advised.
fn grow<T: Copy>(v: &mut Vec<T>, extra: usize) {
    let need = v.len() + extra;
    let size = std::mem::size_of::<T>();
    if need <= v.capacity() || need * size < HUGE_FROM || !KV_HUGEPAGES.on() || !crate::hugepages::enabled() {
        return;
    }
    let cap = need.max(2 * v.capacity()) + HUGE / size;
    let mut w: Vec<T> = Vec::with_capacity(cap);
    crate::hugepages::advise(w.as_ptr() as *const u8, cap * size, false);
    w.extend_from_slice(v);
    *v = w;
}

#[cfg(test)]
mod tests {
    use super::KvRows;

    #[test]
    fn kv_rows_keep_their_values_across_both_types() {
        let x = [1.0f32, -2.5, 3.3333, 1e-3, 70000.0];
        let f16 = k3_kernels::attention::round_f16;
        // f16 (the default): rounded to nearest on the way in.
        let mut r = KvRows::default();
        r.push(&x[..3], true);
        assert!(matches!(r, KvRows::F16(_)) && r.bytes() == 6);
        // An exact-mode push widens what is held (exactly) and keeps the new rows as they are.
        r.push(&x[3..], false);
        let want: Vec<f32> = x[..3].iter().map(|&v| f16(v)).chain(x[3..].iter().copied()).collect();
        assert_eq!(r.rows().to_f32().to_vec(), want);
        // Back to f16: everything rounded, as the f16 mode stores it (70000 overflows to +inf,
        // as in llama.cpp's f16 cache).
        r.push(&x[..1], true);
        let want: Vec<f32> = want.iter().chain(&x[..1]).map(|&v| f16(v)).collect();
        assert_eq!(r.rows().to_f32().to_vec(), want);
        assert_eq!(r.len(), 6);
    }

    #[test]
    fn caches_past_the_huge_page_threshold_keep_every_row() {
        // Rows of 1024 values pushed past HUGE_FROM (4 MiB as f16, 8 MiB as f32), once moving to
        // fresh huge-page-advised buffers and once growing as the allocator does: same rows.
        let row = |i: usize| -> Vec<f32> { (0..1024).map(|j| ((i * 7 + j) % 2048) as f32 - 1024.0).collect() };
        let rows = 2 * super::HUGE_FROM / (1024 * 2) + 3;
        let mut held = Vec::new();
        for huge in [true, false] {
            super::set_kv_hugepages(huge);
            let (mut a, mut b) = (KvRows::default(), KvRows::default());
            for i in 0..rows {
                a.push(&row(i), true);
                b.push(&row(i), false);
            }
            assert_eq!(a.len(), rows * 1024);
            assert_eq!(a.bytes(), rows * 1024 * 2);
            let want: Vec<f32> = (0..rows).flat_map(row).collect();
            assert_eq!(a.rows().to_f32().to_vec(), want, "f16 rows (all exact in f16), huge pages {huge}");
            assert_eq!(b.rows().to_f32().to_vec(), want, "f32 rows, huge pages {huge}");
            held.push(a.rows().to_f32().to_vec());
        }
        super::set_kv_hugepages(true);
        assert_eq!(held[0], held[1]);
    }
}
