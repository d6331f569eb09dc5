//! Writing a restore's frames around the page cache.
//!
//! A restore writes a whole store's worth of frames that nothing reads until it ends. Written
//! through the page cache, each byte is first copied into a cache page by the kernel (for a
//! large restore, the dearest step of the whole load) and later written back all at once,
//! filling the device queue in front of every other writer's `fdatasync` on the same disk.
//! [`DirectWriter`] writes them with `O_DIRECT` instead: straight from an aligned buffer of
//! ours to the disk, in pieces of at most [`PIECE`] bytes, one after the other, so at most one
//! piece of the restore is ever queued on the device.
//!
//! `O_DIRECT` needs offsets, lengths and buffer addresses aligned to the device's block;
//! [`BLOCK`] (4 KiB) covers the devices keel runs on. A frame starts wherever the previous one
//! ended, so each write starts at the block holding the frame's first byte, re-writing that
//! block's earlier bytes (kept from the previous write, or read back), and ends with zeros up
//! to the next block boundary: bytes after a segment's last frame are zeros in the format
//! anyway. The file's size, if the write passed it, ends on that boundary. Durability is
//! unchanged: the frames still count only once the segment is synced.
//!
//! A file system that refuses `O_DIRECT` (tmpfs, some network file systems) makes the restore
//! fall back to ordinary writes.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::ptr::NonNull;

/// Alignment of every direct write: offset, length and buffer address.
pub(crate) const BLOCK: usize = 4096;

/// Largest single direct write: the most a restore ever has queued on the device.
pub(crate) const PIECE: usize = 1 << 20;

/// A zero-initialised heap buffer whose start is aligned to [`BLOCK`].
struct AlignedBuf {
    ptr: NonNull<u8>,
    cap: usize,
}

// SAFETY: `AlignedBuf` owns its allocation exclusively (no aliasing pointer is kept anywhere
// else), like a `Vec<u8>`, so moving it to another thread is sound.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    const fn empty() -> AlignedBuf {
        AlignedBuf {
            ptr: NonNull::dangling(),
            cap: 0,
        }
    }

    /// Makes room for at least `len` bytes (rounded up to a block); the content is lost.
    fn reserve(&mut self, len: usize) -> io::Result<()> {
        if len <= self.cap {
            return Ok(());
        }
        let cap = len.div_ceil(BLOCK) * BLOCK;
        let layout = Layout::from_size_align(cap, BLOCK)
            .map_err(|_| io::Error::new(io::ErrorKind::OutOfMemory, "buffer too large"))?;
        // SAFETY: `layout` has a non-zero size (`len > self.cap >= 0`, rounded up to a block).
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| {
            io::Error::new(io::ErrorKind::OutOfMemory, "cannot allocate a write buffer")
        })?;
        self.free();
        self.ptr = ptr;
        self.cap = cap;
        Ok(())
    }

    fn free(&mut self) {
        if self.cap > 0 {
            // SAFETY: `ptr` came from `alloc_zeroed` with exactly this size and alignment
            // (`reserve`), and is freed once: `cap` is reset right after.
            unsafe {
                dealloc(
                    self.ptr.as_ptr(),
                    Layout::from_size_align_unchecked(self.cap, BLOCK),
                )
            };
            self.ptr = NonNull::dangling();
            self.cap = 0;
        }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.cap == 0 {
            return &mut [];
        }
        // SAFETY: `ptr` points to `cap` bytes we own, initialised (zeroed at allocation and
        // only ever written through this slice), and `&mut self` makes this the only borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        self.free();
    }
}

/// Direct writes to one segment file, in append order.
pub(crate) struct DirectWriter {
    /// The segment opened a second time, with `O_DIRECT`.
    file: File,
    /// Segment this writer belongs to.
    pub(crate) segment: u32,
    buf: AlignedBuf,
    /// File offset of the block holding the end of the last write, and that block's bytes
    /// before the end.
    tail: Option<(u64, Vec<u8>)>,
}

impl DirectWriter {
    /// Opens `path` (segment `segment`) for direct writes; `Ok(None)` when the file system
    /// refuses `O_DIRECT`.
    pub(crate) fn open(path: &Path, segment: u32) -> io::Result<Option<DirectWriter>> {
        match OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
        {
            Ok(file) => Ok(Some(DirectWriter {
                file,
                segment,
                buf: AlignedBuf::empty(),
                tail: None,
            })),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Writes `data` at `offset` of the segment, whose bytes before `offset` are already
    /// written; `file` is the segment's ordinary handle, used to read back the start of the
    /// first block when this writer has not written it. `Err` with `EINVAL` means the file
    /// system took the open but refuses the writes: write through the page cache instead.
    pub(crate) fn write(&mut self, file: &File, offset: u64, data: &[u8]) -> io::Result<()> {
        let block = offset - offset % BLOCK as u64;
        let head = (offset - block) as usize;
        let end = head + data.len();
        let padded = end.div_ceil(BLOCK) * BLOCK;
        self.buf.reserve(padded)?;
        let tail = self.tail.take();
        let buf = self.buf.as_mut_slice();
        if head > 0 {
            match tail {
                Some((at, bytes)) if at == block && bytes.len() == head => {
                    buf[..head].copy_from_slice(&bytes);
                }
                _ => file.read_exact_at(&mut buf[..head], block)?,
            }
        }
        buf[head..end].copy_from_slice(data);
        buf[end..padded].fill(0);
        let mut done = 0;
        while done < padded {
            let n = (padded - done).min(PIECE);
            self.file
                .write_all_at(&buf[done..done + n], block + done as u64)?;
            done += n;
        }
        let last = end - end % BLOCK;
        self.tail = Some((block + last as u64, buf[last..end].to_vec()));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unaligned_appends_land_byte_for_byte() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("seg");
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .expect("create");
        let header = vec![0xAB; 37];
        file.write_all_at(&header, 0).expect("header");
        let Some(mut w) = DirectWriter::open(&path, 1).expect("open") else {
            // The temporary directory's file system refuses O_DIRECT: nothing to check.
            return;
        };
        let mut expected = header.clone();
        let mut offset = header.len() as u64;
        for (i, len) in [1usize, 4095, 4096, 5000, PIECE + 3, 17, 3 * PIECE, 1]
            .into_iter()
            .enumerate()
        {
            let data: Vec<u8> = (0..len).map(|j| (i * 31 + j * 7) as u8).collect();
            w.write(&file, offset, &data).expect("write");
            expected.extend_from_slice(&data);
            offset += len as u64;
        }
        let mut got = vec![0u8; expected.len()];
        file.read_exact_at(&mut got, 0).expect("read back");
        assert!(
            got == expected,
            "file content differs from what was written"
        );
        let size = file.metadata().expect("metadata").len();
        assert_eq!(size % BLOCK as u64, 0, "file ends off a block boundary");
        let mut rest = vec![1u8; (size - offset) as usize];
        file.read_exact_at(&mut rest, offset).expect("read padding");
        assert!(rest.iter().all(|&b| b == 0), "padding is not zeros");
    }
}
