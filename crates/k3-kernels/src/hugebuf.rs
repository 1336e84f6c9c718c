//! Buffers on transparent huge pages from their first write: where the repacked weights live.
//!
//! Decode streams every weight once a token, and on 4 KiB pages that is a TLB miss every 4 KiB
//! and a hardware prefetcher that stops at each page (k3-infer's `hugepages`). Weights repacked
//! into ordinary heap buffers land on 4 KiB pages, and moving them onto huge pages afterwards
//! (`MADV_COLLAPSE`) copies every byte a second time: on the Zen 4 host ~70 ms of a ~0.25 s load
//! of the 370M Q4_0. A [`Buf`] placed [`Place::Huge`] is instead carved from a *chunk*: one
//! anonymous mapping aligned to 2 MiB. With [`Timing::AtLoad`] it is advised `MADV_HUGEPAGE`
//! before anything is written, so each first write faults in a whole huge page (fresh and zeroed
//! by the kernel) and nothing is copied. By default ([`Timing::After`]) the chunk is filled on
//! 4 KiB pages and collapsed whole after the load, off the load's path (k3-infer's `hugepages`):
//! on a VM that hands free memory back to its host (virtio-balloon free page reporting, which
//! reports free 2 MiB blocks), every fresh huge page is first backed by the host again, and a
//! first load of the 370M Q4_0 took 0.4–0.65 s with huge pages at first write against 0.13–0.15 s
//! on 4 KiB pages (Zen 4 host, after 15–20 s idle).
//!
//! Chunks are [`CHUNK`] bytes (a buffer of more than half that gets a mapping of its own), one
//! open chunk a thread, carved front to back with no reuse: weights are allocated once and live
//! as long as their model. A chunk is unmapped when the last buffer carved from it is dropped and
//! its thread has moved on ([`seal`] lets go of the calling thread's open chunk; a thread's exit
//! does it too). Pages never written are never backed, so a chunk's unused tail costs address
//! space, not memory; the last huge page a chunk's carving ends in is backed whole.
//!
//! Elsewhere (not Linux, `K3MINI_HUGEPAGES=0`, or a mapping the system refuses) a huge buffer is
//! an ordinary heap buffer: the same contents, on whatever pages the allocator gives.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::Arc;

/// Bytes of a huge page (x86-64, aarch64 with 4 KiB base pages).
pub const HUGE: usize = 2 << 20;

/// Bytes of a base page.
pub const PAGE: usize = 4 << 10;

/// Bytes of one chunk of huge buffers (a whole number of huge pages).
pub const CHUNK: usize = 16 * HUGE;

/// When the weights go onto huge pages (`K3MINI_HUGEPAGES`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Timing {
    /// Never (`K3MINI_HUGEPAGES=0`).
    Off,
    /// From the first write, during the load (`K3MINI_HUGEPAGES=load`).
    AtLoad,
    /// Collapsed after the load, on a thread of their own (the default).
    After,
}

/// The huge-page timing `K3MINI_HUGEPAGES` asks for: `0` off, `load` at first write, anything
/// else (or unset) after the load. Read once a process (every buffer a load carves asks).
pub fn timing() -> Timing {
    static TIMING: std::sync::OnceLock<Timing> = std::sync::OnceLock::new();
    *TIMING.get_or_init(|| match std::env::var("K3MINI_HUGEPAGES").as_deref() {
        Ok("0") => Timing::Off,
        Ok("load") => Timing::AtLoad,
        _ => Timing::After,
    })
}

/// Whether huge pages are wanted at all (`K3MINI_HUGEPAGES=0` says no).
pub fn enabled() -> bool {
    timing() != Timing::Off
}

/// The system calls behind huge pages (Linux).
#[cfg(target_os = "linux")]
pub mod sys {
    use std::ffi::c_void;

    pub const MADV_HUGEPAGE: i32 = 14;
    pub const MADV_COLLAPSE: i32 = 25;
    pub const MADV_POPULATE_WRITE: i32 = 23;
    const PROT_READ: i32 = 1;
    const PROT_WRITE: i32 = 2;
    const MAP_PRIVATE: i32 = 2;
    const MAP_ANONYMOUS: i32 = 0x20;
    const MAP_FAILED: *mut c_void = !0usize as *mut c_void;

    extern "C" {
        pub fn madvise(addr: *mut c_void, len: usize, advice: i32) -> i32;
        fn mmap(addr: *mut c_void, len: usize, prot: i32, flags: i32, fd: i32, off: i64) -> *mut c_void;
        pub fn munmap(addr: *mut c_void, len: usize) -> i32;
        fn setpriority(which: i32, who: u32, prio: i32) -> i32;
        fn gettid() -> i32;
    }

    /// Lower the calling thread's scheduling priority to `nice` (Linux applies it to the one
    /// thread); a refusal leaves it as it was.
    pub fn nice_this_thread(nice: i32) {
        const PRIO_PROCESS: i32 = 0;
        // SAFETY: plain system calls on this thread's own id, no memory passed.
        unsafe {
            setpriority(PRIO_PROCESS, gettid() as u32, nice);
        }
    }

    /// A fresh private anonymous read-write mapping of `len` bytes (zero-filled, nothing backed
    /// yet), or `None` when the system refuses.
    pub fn map_anonymous(len: usize) -> Option<usize> {
        // SAFETY: a new mapping at an address of the kernel's choosing touches no existing memory.
        let p = unsafe { mmap(std::ptr::null_mut(), len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) };
        (p != MAP_FAILED && !p.is_null()).then_some(p as usize)
    }
}

/// Where a new buffer goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// The global allocator (temporaries, small matrices made at run time).
    Heap,
    /// A chunk on huge pages (weights that are streamed every token).
    Huge,
}

/// Element types a zero-filled mapping is a valid array of.
pub trait Plain: Copy + Default + fmt::Debug + PartialEq + Send + Sync + 'static {}
impl Plain for u8 {}
impl Plain for u16 {}
impl Plain for f32 {}

/// Bytes of chunks mapped now, in the whole process ([`mapped_bytes`]).
static MAPPED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Bytes of huge-page chunks and buffers mapped on their own ([`Buf::mapped`]) this process has
/// now (address space; only the pages written are backed). Zero once every huge or mapped buffer
/// is dropped and no thread holds an open chunk.
pub fn mapped_bytes() -> usize {
    MAPPED.load(std::sync::atomic::Ordering::Relaxed)
}

/// One mapping that huge buffers are carved from; unmapped with its last buffer.
struct Chunk {
    base: usize,
    len: usize,
}

impl Chunk {
    /// A mapping of `len` bytes (a multiple of [`HUGE`]) starting on a huge-page boundary and,
    /// with `advise` (or [`Timing::AtLoad`]), advised onto huge pages before any write; `None`
    /// when the system refuses.
    #[cfg(target_os = "linux")]
    fn map(len: usize, advise: bool) -> Option<Chunk> {
        debug_assert!(len.is_multiple_of(HUGE));
        let raw = sys::map_anonymous(len.checked_add(HUGE)?)?;
        let base = raw.next_multiple_of(HUGE);
        // SAFETY: [raw, base) and [base + len, raw + len + HUGE) are the slop of the mapping just
        // made, outside the chunk; nothing refers to them. madvise changes only how the chunk is
        // backed (and a refusal, e.g. THP off, leaves it on 4 KiB pages, which is still correct).
        unsafe {
            if base > raw {
                sys::munmap(raw as *mut _, base - raw);
            }
            if raw + HUGE > base {
                sys::munmap((base + len) as *mut _, raw + HUGE - base);
            }
            if advise || timing() == Timing::AtLoad {
                sys::madvise(base as *mut _, len, sys::MADV_HUGEPAGE);
            }
        }
        MAPPED.fetch_add(len, std::sync::atomic::Ordering::Relaxed);
        Some(Chunk { base, len })
    }

    /// A mapping of `len` bytes (a multiple of [`PAGE`]) on 4 KiB pages, never advised; `None`
    /// when the system refuses.
    #[cfg(target_os = "linux")]
    fn map_pages(len: usize) -> Option<Chunk> {
        debug_assert!(len.is_multiple_of(PAGE));
        let base = sys::map_anonymous(len)?;
        MAPPED.fetch_add(len, std::sync::atomic::Ordering::Relaxed);
        Some(Chunk { base, len })
    }

    #[cfg(not(target_os = "linux"))]
    fn map(_len: usize, _advise: bool) -> Option<Chunk> {
        None
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        #[cfg(target_os = "linux")]
        // SAFETY: the chunk is its own mapping, and every buffer carved from it held an `Arc` to
        // it, so none is left.
        unsafe {
            sys::munmap(self.base as *mut _, self.len);
        }
        MAPPED.fetch_sub(self.len, std::sync::atomic::Ordering::Relaxed);
    }
}

thread_local! {
    /// This thread's open chunk and the bytes of it carved so far.
    static OPEN: std::cell::RefCell<Option<(Arc<Chunk>, usize)>> = const { std::cell::RefCell::new(None) };
}

/// Let go of this thread's open chunk: what was carved from it stays until its buffers drop,
/// the rest is unmapped with them. Call it when a load is done.
pub fn seal() {
    OPEN.with(|o| o.borrow_mut().take());
}

/// `bytes` (> 0) of zeroed memory on huge pages, 64-byte aligned, and the chunk it is carved
/// from; `None` where huge buffers are off or the system refuses a mapping.
fn carve(bytes: usize) -> Option<(usize, Arc<Chunk>)> {
    if !enabled() {
        return None;
    }
    let bytes = bytes.checked_next_multiple_of(64)?;
    let (at, chunk) = if bytes > CHUNK / 2 {
        let chunk = Arc::new(Chunk::map(bytes.checked_next_multiple_of(HUGE)?, false)?);
        (chunk.base, chunk)
    } else {
        OPEN.with(|o| {
            let mut o = o.borrow_mut();
            if o.as_ref().is_none_or(|(c, used)| used + bytes > c.len) {
                *o = Some((Arc::new(Chunk::map(CHUNK, false)?), 0));
            }
            let (chunk, used) = o.as_mut()?;
            let at = chunk.base + *used;
            *used += bytes;
            Some((at, chunk.clone()))
        })?
    };
    populate(at, bytes);
    Some((at, chunk))
}

/// Fault in the 4 KiB pages of [at, at + bytes) in one call (`MADV_POPULATE_WRITE`, Linux 5.14+)
/// rather than one trap a page as the packer writes them. Not with [`Timing::AtLoad`], where the
/// first write faults in whole huge pages. A refusal leaves the pages to their first write.
fn populate(at: usize, bytes: usize) {
    #[cfg(target_os = "linux")]
    if timing() == Timing::After {
        let lo = at / PAGE * PAGE;
        let hi = (at + bytes).next_multiple_of(PAGE);
        // SAFETY: [lo, hi) lies inside the chunk's live mapping (4 KiB-aligned, as the chunk is),
        // and populating pages writes nothing a reader could see: they read as zeros either way.
        unsafe {
            sys::madvise(lo as *mut _, hi - lo, sys::MADV_POPULATE_WRITE);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (at, bytes);
}

/// A fixed-length array of plain values, on the heap or on huge pages ([`Place`]); reads and
/// writes as a slice.
pub struct Buf<T: Plain>(Inner<T>);

enum Inner<T: Plain> {
    Heap(Vec<T>),
    /// Carved from a chunk on huge pages, or a mapping of its own ([`Buf::mapped`]); `huge`
    /// unless that mapping is on 4 KiB pages.
    Mapped {
        ptr: NonNull<T>,
        len: usize,
        huge: bool,
        _chunk: Arc<Chunk>,
    },
}

// SAFETY: a huge buffer owns its slice of the chunk alone (carved once, never handed out twice),
// as a Vec owns its allocation; the chunk itself is only unmapped, through its Arc.
unsafe impl<T: Plain> Send for Buf<T> {}
// SAFETY: shared access gives `&[T]` only, as for Vec.
unsafe impl<T: Plain> Sync for Buf<T> {}

impl<T: Plain> Buf<T> {
    /// `n` zeros in `place` (on the heap where huge pages are off or refused).
    pub fn zeroed(n: usize, place: Place) -> Self {
        let bytes = n.checked_mul(size_of::<T>()).expect("buffer size overflows usize");
        if place == Place::Huge && bytes > 0 {
            if let Some((at, chunk)) = carve(bytes) {
                debug_assert!(at.is_multiple_of(align_of::<T>()));
                // SAFETY: `at` is a non-null address inside a live mapping, aligned for T.
                let ptr = unsafe { NonNull::new_unchecked(at as *mut T) };
                return Buf(Inner::Mapped { ptr, len: n, huge: true, _chunk: chunk });
            }
        }
        Buf(Inner::Heap(vec![T::default(); n]))
    }

    /// `n` zeros in a mapping of their own, unmapped when the buffer drops: for buffers that
    /// grow at run time, an attention cache that grows as a sequence does, whose old buffers
    /// should go back to the system (a large block freed to the allocator may stay in its heap).
    /// With `huge`, the mapping is aligned to a huge page, rounded up to whole huge pages (`n` is
    /// the length; the rounding is the caller's to use or not) and advised onto huge pages before
    /// anything is written, whatever [`timing`] says unless huge pages are off (no load waits on
    /// the huge pages' first faults here); without, it is 4 KiB pages, never advised. On the
    /// heap where huge pages are off or the system refuses.
    pub fn mapped(n: usize, huge: bool) -> Self {
        let bytes = n.checked_mul(size_of::<T>()).expect("buffer size overflows usize");
        if enabled() && bytes > 0 {
            #[cfg(target_os = "linux")]
            let chunk = if huge {
                bytes.checked_next_multiple_of(HUGE).and_then(|len| Chunk::map(len, true))
            } else {
                bytes.checked_next_multiple_of(PAGE).and_then(Chunk::map_pages)
            };
            #[cfg(not(target_os = "linux"))]
            let chunk: Option<Chunk> = None;
            if let Some(chunk) = chunk {
                // SAFETY: the chunk's base is a non-null address of a live mapping, aligned to
                // a page (so for T), and its bytes ≥ n values of T.
                let ptr = unsafe { NonNull::new_unchecked(chunk.base as *mut T) };
                return Buf(Inner::Mapped { ptr, len: n, huge, _chunk: Arc::new(chunk) });
            }
        }
        Buf(Inner::Heap(vec![T::default(); n]))
    }

    /// Whether the buffer is on huge pages (carved from a chunk, or mapped with `huge`).
    pub fn is_huge(&self) -> bool {
        matches!(self.0, Inner::Mapped { huge: true, .. })
    }
}

impl<T: Plain> Default for Buf<T> {
    fn default() -> Self {
        Buf(Inner::Heap(Vec::new()))
    }
}

impl<T: Plain> Deref for Buf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.0 {
            Inner::Heap(v) => v,
            // SAFETY: ptr..ptr + len lies inside the chunk this buffer keeps mapped, zeroed by the
            // kernel (a valid T for `Plain` types) or written since through `&mut self`.
            Inner::Mapped { ptr, len, .. } => unsafe { std::slice::from_raw_parts(ptr.as_ptr(), *len) },
        }
    }
}

impl<T: Plain> DerefMut for Buf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.0 {
            Inner::Heap(v) => v,
            // SAFETY: as in `deref`; `&mut self` makes the access unique (no other buffer
            // overlaps this one's bytes).
            Inner::Mapped { ptr, len, .. } => unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), *len) },
        }
    }
}

/// A copy on the heap (the original's place is not kept: clones are for tests and tools).
impl<T: Plain> Clone for Buf<T> {
    fn clone(&self) -> Self {
        Buf(Inner::Heap(self.to_vec()))
    }
}

impl<T: Plain> PartialEq for Buf<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T: Plain> fmt::Debug for Buf<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let place = if self.is_huge() { Place::Huge } else { Place::Heap };
        write!(f, "Buf::{place:?}({} values)", self.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_buffers_are_zeroed_disjoint_and_keep_what_is_written() {
        // Several buffers of one chunk, one past half a chunk (its own mapping), one empty.
        let sizes = [1usize, 100, 4096 + 3, CHUNK / 2 + 5, 0, 70_000];
        let mut bufs: Vec<Buf<u16>> = sizes.iter().map(|&n| Buf::zeroed(n, Place::Huge)).collect();
        for (i, b) in bufs.iter_mut().enumerate() {
            assert_eq!(b.len(), sizes[i]);
            assert!(b.iter().all(|&x| x == 0), "buffer {i} not zeroed");
            // On huge pages where they are on (and 64-byte aligned there); an empty one never.
            let huge = cfg!(target_os = "linux") && enabled() && !b.is_empty();
            assert_eq!(b.is_huge(), huge, "buffer {i}'s place");
            assert!(!huge || (b.as_ptr() as usize).is_multiple_of(64));
            for (j, x) in b.iter_mut().enumerate() {
                *x = (i * 7 + j) as u16;
            }
        }
        for (i, b) in bufs.iter().enumerate() {
            assert!(b.iter().enumerate().all(|(j, &x)| x == (i * 7 + j) as u16), "buffer {i} overwritten");
        }
        // A buffer that outlives its thread's open chunk (sealed) and the other buffers.
        let keep = bufs.swap_remove(2);
        drop(bufs);
        seal();
        assert!(keep.iter().enumerate().all(|(j, &x)| x == (2 * 7 + j) as u16));
        assert_eq!(keep.clone(), keep);
        assert!(!keep.clone().is_huge());
    }

    #[test]
    fn huge_buffers_carved_on_another_thread_outlive_it() {
        let b = std::thread::spawn(|| {
            let mut b: Buf<u8> = Buf::zeroed(5000, Place::Huge);
            b.iter_mut().enumerate().for_each(|(j, x)| *x = j as u8);
            b
        })
        .join()
        .expect("the carving thread");
        assert!(b.iter().enumerate().all(|(j, &x)| x == j as u8));
    }

    #[test]
    fn heap_buffers_are_zeroed() {
        let b: Buf<u16> = Buf::zeroed(33, Place::Heap);
        assert!(!b.is_huge() && b.len() == 33 && b.iter().all(|&x| x == 0));
    }

    #[test]
    fn mapped_buffers_are_zeroed_aligned_and_their_own() {
        let sizes = [(3usize, true), (HUGE / 4 + 1, true), (0, true), (5000, false)];
        let mut bufs: Vec<Buf<f32>> = sizes.iter().map(|&(n, huge)| Buf::mapped(n, huge)).collect();
        for (i, b) in bufs.iter_mut().enumerate() {
            assert!(b.iter().all(|&x| x == 0.0), "buffer {i} not zeroed");
            let mapped = cfg!(target_os = "linux") && enabled() && !b.is_empty();
            let huge = mapped && sizes[i].1;
            assert_eq!(b.is_huge(), huge, "buffer {i}'s place");
            assert!(!huge || (b.as_ptr() as usize).is_multiple_of(HUGE), "buffer {i} not on a huge-page boundary");
            assert!(!mapped || (b.as_ptr() as usize).is_multiple_of(PAGE), "buffer {i} not on a page boundary");
            b.iter_mut().enumerate().for_each(|(j, x)| *x = (i * 1000 + j) as f32);
        }
        let second = bufs.swap_remove(1);
        drop(bufs);
        assert!(second.iter().enumerate().all(|(j, &x)| x == (1000 + j) as f32));
        assert_eq!(second.len(), HUGE / 4 + 1);
    }
}
