//! Attention caches: rows held as f16 (llama.cpp's cache type) or f32 (the exact mode).

use k3_kernels::attention;
use k3_kernels::hugebuf::{Buf, Place, Plain, HUGE, PAGE};

/// One layer's cached rows (Llama's keys or values, MLA's latent rows): f16, llama.cpp's cache
/// type and the default (a decode step streams half the bytes of f32), or f32 under the exact
/// mode (transformers' numerics).
#[derive(Debug, Clone)]
pub enum KvRows {
    F16(Held<u16>),
    F32(Held<f32>),
}

impl Default for KvRows {
    fn default() -> Self {
        KvRows::F16(Held::default())
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
            KvRows::F16(v) => 2 * v.len,
            KvRows::F32(v) => 4 * v.len,
        }
    }

    pub fn rows(&self) -> attention::Rows<'_> {
        match self {
            KvRows::F16(v) => attention::Rows::F16(v.values()),
            KvRows::F32(v) => attention::Rows::F32(v.values()),
        }
    }

    /// Whether the rows are held on huge pages ([`Held`]; false where they are off or refused).
    pub fn on_huge_pages(&self) -> bool {
        match self {
            KvRows::F16(v) => v.buf.is_huge(),
            KvRows::F32(v) => v.buf.is_huge(),
        }
    }

    /// Append rows, as f16 (rounded to nearest) or f32. A cache of the other type is converted
    /// first: f16 → f32 exactly, f32 → f16 rounding as the f16 mode rounds everything it stores.
    pub fn push(&mut self, x: &[f32], f16: bool) {
        match (&mut *self, f16) {
            (KvRows::F16(v), true) => k3_kernels::simd::f32_to_f16(v.append(x.len()), x),
            (KvRows::F32(v), false) => v.append(x.len()).copy_from_slice(x),
            (KvRows::F16(v), false) => {
                let mut wide = Held::default();
                k3_kernels::simd::f16_to_f32(wide.append(v.len), v.values());
                wide.append(x.len()).copy_from_slice(x);
                *self = KvRows::F32(wide);
            }
            (KvRows::F32(v), true) => {
                let mut narrow = Held::default();
                k3_kernels::simd::f32_to_f16(narrow.append(v.len), v.values());
                k3_kernels::simd::f32_to_f16(narrow.append(x.len()), x);
                *self = KvRows::F16(narrow);
            }
        }
    }
}

/// A growing array of cached values: the first `len` of `buf`, the rest room to grow into.
///
/// A decode step streams each layer's cache once, and a cache on 4 KiB pages takes a TLB miss
/// every 4 KiB with the hardware prefetchers stopping at each page; the allocator's large buffers
/// are fresh mappings of 4 KiB pages (THP `madvise`), never advised. So a cache whose room grows
/// to [`HUGE_FROM`] bytes or more moves to a mapping of its own (`hugebuf::Buf::mapped`: aligned
/// to a huge page, whole huge pages, advised before anything is written), and from then on each
/// growth to a larger one; from [`MAP_FROM`] bytes a cache is in a mapping of its own on 4 KiB
/// pages, and the smallest stay on the heap. Each growth doubles the room (or takes what is
/// needed) and copies the values over.
#[derive(Debug, Default)]
pub struct Held<T: Plain> {
    buf: Buf<T>,
    len: usize,
}

/// A copy of the values alone, placed as a cache of that size grows to (a sequence forked from
/// another decodes as fast).
impl<T: Plain> Clone for Held<T> {
    fn clone(&self) -> Self {
        let mut copy = Held::default();
        copy.append(self.len).copy_from_slice(self.values());
        copy
    }
}

impl<T: Plain> Held<T> {
    /// The values held.
    pub fn values(&self) -> &[T] {
        &self.buf[..self.len]
    }

    /// `n` more values (zeros until the caller writes them), as a slice to write.
    fn append(&mut self, n: usize) -> &mut [T] {
        let (at, need) = (self.len, self.len + n);
        if need > self.buf.len() {
            let size = size_of::<T>();
            let room = need.max(2 * self.buf.len());
            let bytes = room * size;
            let mut buf = if bytes >= MAP_FROM && KV_HUGEPAGES.on() {
                // On huge pages, whose whole pages are room too; below, 4 KiB pages, so that
                // the buffers this cache leaves behind go back to the system.
                let huge = bytes >= HUGE_FROM;
                Buf::mapped(room.next_multiple_of(if huge { HUGE } else { PAGE } / size), huge)
            } else {
                Buf::zeroed(room, Place::Heap)
            };
            buf[..at].copy_from_slice(self.values());
            self.buf = buf;
        }
        self.len = need;
        &mut self.buf[at..need]
    }
}

/// Bytes of room from which a cache is held on huge pages ([`Held`]): half a huge page, so a
/// cache on huge pages fills at least a quarter of them (its room is at least half full after a
/// growth), and a model's caches take at most a huge page each more than on the heap.
const HUGE_FROM: usize = HUGE / 2;

/// Bytes of room from which a cache is held in a mapping of its own ([`Held`]; on 4 KiB pages
/// below [`HUGE_FROM`]): what a growing cache leaves behind goes back to the system. From the
/// heap, the blocks a cache left as it grew stayed in the allocator's heap once the cache had
/// moved onto huge pages (SmolLM2 at 4096 tokens: ~45 MiB more peak RSS).
const MAP_FROM: usize = 64 << 10;

/// Whether caches move onto huge pages ([`Held`]; only with huge pages on at all,
/// `K3MINI_HUGEPAGES`); `K3MINI_KV_HUGEPAGES=0` keeps them on the heap.
static KV_HUGEPAGES: k3_kernels::switch::Switch = k3_kernels::switch::Switch::new("K3MINI_KV_HUGEPAGES", "0");

/// Set [`KV_HUGEPAGES`] for the rest of the process (in-process A/B measurements: it applies to
/// the caches that grow from then on).
pub fn set_kv_hugepages(on: bool) {
    KV_HUGEPAGES.set(on);
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
        // Rows of 1024 values pushed past twice HUGE_FROM, once moving onto huge pages and once
        // staying on the heap: the same rows, and on huge pages where they are on.
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
            let on = huge && cfg!(target_os = "linux") && k3_kernels::hugebuf::enabled();
            assert_eq!((a.on_huge_pages(), b.on_huge_pages()), (on, on), "asked for huge pages: {huge}");
            held.push(a.rows().to_f32().to_vec());
            let c = a.clone();
            assert_eq!(c.rows().to_f32().to_vec(), want, "a clone's rows");
            assert_eq!(c.on_huge_pages(), on, "a clone's place");
        }
        super::set_kv_hugepages(true);
        assert_eq!(held[0], held[1]);
    }
}
