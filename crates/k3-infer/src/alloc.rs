//! A per-thread cache of small freed blocks in front of the system allocator, for binaries that
//! decode (`#[global_allocator] static A: k3_infer::alloc::ThreadCache = ThreadCache;`).
//!
//! A 2-thread decode token of the 370M model makes ~1,700 allocations, most of them vectors of
//! a few bytes to a few KiB freed within the same layer. glibc serves those above 1 KiB, and any
//! beyond its 7 cached chunks a size, from its bins, where a large request first consolidates the
//! small chunks freed before it; `perf` put ~2% of the caller's decode time in malloc, free and
//! `malloc_consolidate`, on the serial path between the products. This cache keeps up to
//! [`PER_CLASS`] freed blocks of each size class up to [`MAX_BLOCK`] bytes, [`MAX_CACHED`] bytes in
//! all, per thread, and hands them back last in, first out. Measured in one process against
//! glibc alone (`examples/decode_ab MODEL 2 16 60 0,1`, 370M Q4_0): decode +1.8–2.7%.
//!
//! Sizes are rounded up to classes, four a doubling (at most 25% more than asked), and every
//! block of a cached size is allocated at its class's size, so a block may be freed into the
//! cache whether or not it came from it, on any thread. Larger blocks and alignments above 16
//! go to the system allocator unchanged.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, Ordering};

/// The largest block the cache keeps.
pub const MAX_BLOCK: usize = 64 << 10;
/// Blocks kept per size class and thread.
pub const PER_CLASS: usize = 32;
/// Bytes kept per thread, all classes together.
pub const MAX_CACHED: usize = 2 << 20;
/// Size classes: 16, 32, 48, 64, then four a doubling up to [`MAX_BLOCK`].
const CLASSES: usize = 4 + 4 * (MAX_BLOCK.trailing_zeros() as usize - 6);

/// Whether freed blocks are kept (all blocks are rounded to their class either way).
static ENABLED: AtomicBool = AtomicBool::new(true);

/// Keep freed blocks (`true`, the default) or hand every one back at once (to measure what the
/// cache is worth within one process).
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// The class of a block of `size` bytes and alignment `align`, if it is cached.
fn class_of(size: usize, align: usize) -> Option<usize> {
    if align > 16 || size > MAX_BLOCK {
        return None;
    }
    let s = size.max(1);
    if s <= 64 {
        return Some(s.div_ceil(16) - 1);
    }
    let e = (s - 1).ilog2() as usize; // 2^e < s ≤ 2^(e+1), e ≥ 6
    let step = 1 << (e - 2);
    let q = (s - (1 << e)).div_ceil(step); // 1..=4
    Some(4 + 4 * (e - 6) + q - 1)
}

/// The bytes of a block of class `c`.
fn class_size(c: usize) -> usize {
    if c < 4 {
        return 16 * (c + 1);
    }
    let (e, q) = (6 + (c - 4) / 4, (c - 4) % 4 + 1);
    (1 << e) + q * (1 << (e - 2))
}

fn class_layout(c: usize) -> Layout {
    // SAFETY: class sizes are non-zero multiples of 16, far below isize::MAX; 16 is a power of two.
    unsafe { Layout::from_size_align_unchecked(class_size(c), 16) }
}

/// One thread's kept blocks.
struct Lists {
    n: [u8; CLASSES],
    blocks: [[*mut u8; PER_CLASS]; CLASSES],
    bytes: usize,
}

impl Lists {
    fn pop(&mut self, c: usize) -> Option<*mut u8> {
        let n = self.n[c] as usize;
        (n > 0).then(|| {
            self.n[c] -= 1;
            self.bytes -= class_size(c);
            self.blocks[c][n - 1]
        })
    }

    fn push(&mut self, c: usize, p: *mut u8) -> bool {
        let n = self.n[c] as usize;
        if n == PER_CLASS || self.bytes + class_size(c) > MAX_CACHED {
            return false;
        }
        self.blocks[c][n] = p;
        self.n[c] += 1;
        self.bytes += class_size(c);
        true
    }
}

impl Drop for Lists {
    /// A thread's kept blocks go back to the system allocator when it ends.
    fn drop(&mut self) {
        for c in 0..CLASSES {
            while let Some(p) = self.pop(c) {
                // SAFETY: every kept block was allocated by System at its class's layout.
                unsafe { System.dealloc(p, class_layout(c)) };
            }
        }
    }
}

thread_local! {
    static LISTS: UnsafeCell<Lists> = const {
        UnsafeCell::new(Lists { n: [0; CLASSES], blocks: [[std::ptr::null_mut(); PER_CLASS]; CLASSES], bytes: 0 })
    };
}

/// Run `f` on this thread's lists; `None` while the thread is being torn down.
fn with_lists<T>(f: impl FnOnce(&mut Lists) -> T) -> Option<T> {
    // SAFETY: the lists are this thread's alone, and `f` (pop or push) calls nothing that could
    // re-enter the allocator, so no second reference to them exists meanwhile.
    LISTS.try_with(|l| f(unsafe { &mut *l.get() })).ok()
}

/// Bytes this thread's cache holds now.
pub fn cached_bytes() -> usize {
    with_lists(|l| l.bytes).unwrap_or(0)
}

/// The allocator: [`System`] with this module's per-thread cache in front.
pub struct ThreadCache;

// SAFETY: every block handed out is either System's for the caller's layout (uncached sizes) or
// a System block of the layout's class (at least the requested size, 16-aligned, and an
// alignment of at most 16 was asked); a block comes back through `dealloc` with the layout it was
// asked with, which maps to the same class, so it is kept or returned at that class's layout.
unsafe impl GlobalAlloc for ThreadCache {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some(c) = class_of(layout.size(), layout.align()) else { return System.alloc(layout) };
        if ENABLED.load(Ordering::Relaxed) {
            if let Some(Some(p)) = with_lists(|l| l.pop(c)) {
                return p;
            }
        }
        System.alloc(class_layout(c))
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let Some(c) = class_of(layout.size(), layout.align()) else { return System.alloc_zeroed(layout) };
        if ENABLED.load(Ordering::Relaxed) {
            if let Some(Some(p)) = with_lists(|l| l.pop(c)) {
                std::ptr::write_bytes(p, 0, layout.size());
                return p;
            }
        }
        System.alloc_zeroed(class_layout(c))
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let Some(c) = class_of(layout.size(), layout.align()) else { return System.dealloc(ptr, layout) };
        if ENABLED.load(Ordering::Relaxed) && with_lists(|l| l.push(c, ptr)) == Some(true) {
            return;
        }
        System.dealloc(ptr, class_layout(c))
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let (old, new) = (class_of(layout.size(), layout.align()), class_of(new_size, layout.align()));
        match (old, new) {
            (Some(a), Some(b)) if a == b => ptr,
            (None, None) => System.realloc(ptr, layout, new_size),
            _ => {
                // SAFETY: the caller promises new_size, rounded to the alignment, fits isize.
                let to = Layout::from_size_align_unchecked(new_size, layout.align());
                let p = self.alloc(to);
                if !p.is_null() {
                    std::ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_size));
                    self.dealloc(ptr, layout);
                }
                p
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lay(size: usize, align: usize) -> Layout {
        Layout::from_size_align(size, align).expect("a valid layout")
    }

    /// Classes cover every cached size once, in order, each within 25% (or 16 bytes) of it.
    #[test]
    fn classes_round_sizes_up_by_at_most_a_quarter() {
        let mut last = 0;
        for s in 1..=MAX_BLOCK {
            let c = class_of(s, 8).expect("cached size");
            assert!(c < CLASSES && c >= last, "{s}: class {c} after {last}");
            let cs = class_size(c);
            assert!(cs >= s && (cs <= 64 || cs * 4 <= s * 5 + 4 * 16), "{s} → {cs}");
            assert!(c == 0 || class_size(c - 1) < s, "{s}: a smaller class holds it");
            last = c;
        }
        assert_eq!(last, CLASSES - 1);
        assert_eq!(class_size(CLASSES - 1), MAX_BLOCK);
        assert_eq!(class_of(MAX_BLOCK + 1, 8), None);
        assert_eq!(class_of(64, 32), None, "alignments above 16 go to the system");
    }

    /// Blocks come back reused, zeroed where asked, aligned, with their contents through a
    /// realloc; the cache stays within its limits; all without a global-allocator swap (the
    /// tests call the allocator's methods).
    #[test]
    fn blocks_are_reused_zeroed_and_bounded() {
        std::thread::spawn(|| {
            let a = ThreadCache;
            let l = lay(1000, 8);
            unsafe {
                // (The thread may hold blocks already: the tests' own allocator is this one.)
                let p = a.alloc(l);
                let before = cached_bytes();
                std::ptr::write_bytes(p, 0xAB, 1000);
                a.dealloc(p, l);
                assert_eq!(cached_bytes(), before + class_size(class_of(1000, 8).expect("cached")));
                // Same class: the same block, zeroed when asked.
                let q = a.alloc_zeroed(lay(990, 16));
                assert_eq!(q, p);
                assert!((0..990).all(|i| *q.add(i) == 0));
                assert_eq!(q as usize % 16, 0);
                // Realloc within the class keeps the block; across classes keeps the contents.
                *q = 7;
                let r = a.realloc(q, lay(990, 16), 1010);
                assert_eq!(r, q);
                let r2 = a.realloc(r, lay(1010, 16), 40_000);
                assert_eq!(*r2, 7);
                let r3 = a.realloc(r2, lay(40_000, 16), 1 << 20);
                assert_eq!(*r3, 7);
                a.dealloc(r3, lay(1 << 20, 16));
                // Many frees: at most PER_CLASS a class, MAX_CACHED in all.
                let mut held = Vec::new();
                for s in [64, 4096, 60_000] {
                    let l = lay(s, 8);
                    held.extend((0..200).map(|_| (a.alloc(l), l)));
                }
                for (p, l) in held {
                    a.dealloc(p, l);
                }
                let b = cached_bytes();
                assert!(b <= MAX_CACHED, "{b} bytes kept");
                assert!(b >= PER_CLASS * 4096, "{b} bytes kept");
                // Turned off, nothing more is kept (frees go to the system).
                set_enabled(false);
                let p = a.alloc(l);
                a.dealloc(p, l);
                assert_eq!(cached_bytes(), b);
                set_enabled(true);
            }
        })
        .join()
        .expect("allocator thread");
    }
}
