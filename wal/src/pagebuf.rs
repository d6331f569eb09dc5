//! The write buffer's memory: a growable byte buffer in an anonymous mapping, aligned to a
//! transparent huge page (2 MiB) and advised into huge pages where the kernel offers them
//! (`/sys/kernel/mm/transparent_hugepage/enabled` set to `madvise` or `always`).
//!
//! Why: a direct write hands the device the buffer's physical pages, one I/O segment per
//! physically contiguous run. From 4 KiB pages that is a segment per page (65 for an append
//! of 256 KiB), each a descriptor for a virtual disk to walk; from one huge page it is one.
//! On a virtio disk, 256 KiB direct writes plus `fdatasync` took 133–156 µs from a huge page
//! against 190–234 µs from 4 KiB pages, with the same bytes. Where no huge page is to be
//! had, the buffer works the same in small pages.
//!
//! The mapping is the buffer's capacity rounded up to whole huge pages, plus one huge page
//! of address space (never touched) to align it; only what the log writes into becomes
//! resident.

use std::ops::{Deref, DerefMut};

use memmap2::{Advice, MmapMut};

/// Size and alignment of a transparent huge page on the platforms keel runs on.
const HUGE: usize = 2 << 20;

/// A growable byte buffer whose storage starts on a huge-page boundary (see the module
/// doc). Grows like a `Vec`, keeping its contents at the same offsets from that boundary.
#[derive(Default)]
pub(crate) struct PageBuf {
    /// The mapping, `None` until the first byte is reserved.
    map: Option<MmapMut>,
    /// Offset of the huge-page boundary in `map` where the buffer starts.
    start: usize,
    /// Bytes usable from `start`.
    cap: usize,
    /// Bytes in use from `start`.
    len: usize,
}

impl std::fmt::Debug for PageBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageBuf")
            .field("len", &self.len)
            .field("cap", &self.cap)
            .finish()
    }
}

impl PageBuf {
    /// Bytes the buffer holds without growing.
    pub(crate) fn capacity(&self) -> usize {
        self.cap
    }

    /// Empties the buffer, keeping its memory.
    pub(crate) fn clear(&mut self) {
        self.len = 0;
    }

    /// Shortens the buffer to `len` bytes (no effect if it is shorter).
    pub(crate) fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Makes room for at least `additional` more bytes.
    pub(crate) fn reserve(&mut self, additional: usize) {
        let need = self.len.saturating_add(additional);
        if need > self.cap {
            self.grow(need);
        }
    }

    /// Grows or shrinks the buffer to `len` bytes, new ones set to `value`.
    pub(crate) fn resize(&mut self, len: usize, value: u8) {
        if len > self.len {
            self.reserve(len - self.len);
            let from = self.start + self.len;
            if let Some(map) = &mut self.map {
                map[from..self.start + len].fill(value);
            }
        }
        self.len = len;
    }

    /// Appends `bytes`.
    pub(crate) fn extend_from_slice(&mut self, bytes: &[u8]) {
        self.reserve(bytes.len());
        let at = self.start + self.len;
        if let Some(map) = &mut self.map {
            map[at..at + bytes.len()].copy_from_slice(bytes);
        }
        self.len += bytes.len();
    }

    /// Moves the contents to a mapping of at least `need` bytes (doubling, in whole huge
    /// pages). Running out of address space is handled as a `Vec` does: the process aborts.
    #[cold]
    fn grow(&mut self, need: usize) {
        let cap = need
            .max(self.cap.saturating_mul(2))
            .checked_next_multiple_of(HUGE)
            .filter(|c| *c <= isize::MAX as usize - HUGE);
        let Some(cap) = cap else {
            capacity_overflow();
        };
        let Ok(mut map) = MmapMut::map_anon(cap + HUGE) else {
            std::alloc::handle_alloc_error(
                std::alloc::Layout::from_size_align(cap, HUGE)
                    .unwrap_or(std::alloc::Layout::new::<u8>()),
            );
        };
        let start = map.as_ptr().align_offset(HUGE).min(HUGE);
        // A hint: without huge pages the buffer works the same.
        let _ = map.advise_range(Advice::HugePage, start, cap);
        if let Some(old) = &self.map {
            map[start..start + self.len].copy_from_slice(&old[self.start..self.start + self.len]);
        }
        self.map = Some(map);
        self.start = start;
        self.cap = cap;
    }
}

#[cold]
fn capacity_overflow() -> ! {
    panic!("write buffer capacity overflow")
}

impl Deref for PageBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.map {
            Some(map) => &map[self.start..self.start + self.len],
            None => &[],
        }
    }
}

impl DerefMut for PageBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.map {
            Some(map) => &mut map[self.start..self.start + self.len],
            None => &mut [],
        }
    }
}

/// What records are encoded into: the write buffer, or a plain vector.
pub(crate) trait Sink: DerefMut<Target = [u8]> {
    /// Appends `bytes`.
    fn extend_from_slice(&mut self, bytes: &[u8]);
    /// Makes room for at least `additional` more bytes.
    fn reserve(&mut self, additional: usize);
}

impl Sink for Vec<u8> {
    fn extend_from_slice(&mut self, bytes: &[u8]) {
        Vec::extend_from_slice(self, bytes);
    }
    fn reserve(&mut self, additional: usize) {
        Vec::reserve(self, additional);
    }
}

impl Sink for PageBuf {
    fn extend_from_slice(&mut self, bytes: &[u8]) {
        PageBuf::extend_from_slice(self, bytes);
    }
    fn reserve(&mut self, additional: usize) {
        PageBuf::reserve(self, additional);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn behaves_like_a_vec_and_stays_on_a_huge_page_boundary() {
        let mut b = PageBuf::default();
        let mut v: Vec<u8> = Vec::new();
        assert!(b.is_empty());
        let mut x = 1u64;
        for step in 0..2000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            match x % 5 {
                0 | 1 => {
                    let n = (x >> 8) as usize % 9000;
                    let bytes: Vec<u8> = (0..n).map(|i| (i as u64 + step) as u8).collect();
                    b.extend_from_slice(&bytes);
                    v.extend_from_slice(&bytes);
                }
                2 => {
                    let n = (x >> 8) as usize % (v.len() + 5000);
                    b.resize(n, step as u8);
                    v.resize(n, step as u8);
                }
                3 => {
                    let n = (x >> 8) as usize % (v.len() + 1);
                    b.truncate(n);
                    v.truncate(n);
                }
                _ => {
                    if x.is_multiple_of(7) {
                        b.clear();
                        v.clear();
                    }
                    if let Some(first) = b.first_mut() {
                        *first = 9;
                        v[0] = 9;
                    }
                }
            }
            assert_eq!(&*b, &v[..], "step {step}");
            assert!(b.capacity() >= b.len());
            if b.capacity() > 0 {
                assert_eq!(b.as_ptr().align_offset(HUGE), 0);
            }
        }
        // Grown past one huge page: the contents moved along.
        let big = vec![7u8; 3 * HUGE];
        b.extend_from_slice(&big);
        v.extend_from_slice(&big);
        assert_eq!(&*b, &v[..]);
        assert_eq!(b.as_ptr().align_offset(HUGE), 0);
    }
}
