//! The file-system seam: every file operation of the WAL goes through [`FileSystem`] and
//! [`WalFile`], so tests can inject failed writes, short writes, failed `fdatasync` and a full
//! disk. [`RealFs`] is the real thing.

use std::fmt::Debug;
use std::fs::{File, OpenOptions};
use std::io::{self, IoSlice};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

/// An open file. Reads and writes are positioned (`pread`/`pwrite`), so one handle serves
/// concurrent readers and the writer.
pub trait WalFile: Send + Sync + Debug {
    /// Reads up to `buf.len()` bytes at `offset`; returns how many were read (0 at the end).
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
    /// Writes up to `buf.len()` bytes at `offset`; returns how many were written (a short
    /// write is allowed, the caller writes the rest).
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize>;
    /// Writes the concatenation of `bufs` at `offset` (`pwritev`), up to as much as one call
    /// takes; returns how many bytes were written (a short write is allowed, the caller
    /// writes the rest). The default writes only the first non-empty buffer, through
    /// [`WalFile::write_at`].
    fn write_vectored_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> io::Result<usize> {
        match bufs.iter().find(|b| !b.is_empty()) {
            Some(b) => self.write_at(b, offset),
            None => Ok(0),
        }
    }
    /// `fdatasync`: makes the written data (and the size, if it changed) durable.
    fn sync_data(&self) -> io::Result<()>;
    /// `fsync`: makes data and all metadata durable.
    fn sync_all(&self) -> io::Result<()>;
    /// The current length.
    fn len(&self) -> io::Result<u64>;
    /// Whether the file is empty.
    fn is_empty(&self) -> io::Result<bool> {
        Ok(self.len()? == 0)
    }
    /// Truncates or extends (with zeros) to `len` bytes.
    fn set_len(&self, len: u64) -> io::Result<()>;
    /// Reserves `[offset, offset + len)` so later writes there cannot fail for lack of space
    /// (`fallocate`); a no-op where the file system cannot.
    fn allocate(&self, offset: u64, len: u64) -> io::Result<()>;
    /// Hints that `[offset, offset + len)` is about to be overwritten in pieces that do not
    /// cover whole pages, so its pages are best read into the cache ahead, in the background
    /// (`posix_fadvise(WILLNEED)`), rather than one by one inside the writes. A hint: the
    /// default does nothing.
    fn will_need(&self, offset: u64, len: u64) -> io::Result<()> {
        let _ = (offset, len);
        Ok(())
    }
    /// Hints that the cached pages of `[offset, offset + len)` are not needed: its writes
    /// bypass the cache, and each would otherwise have to drop the pages it covers itself
    /// (`posix_fadvise(DONTNEED)`). A hint: the default does nothing.
    fn dont_need(&self, offset: u64, len: u64) -> io::Result<()> {
        let _ = (offset, len);
        Ok(())
    }
}

/// The file-system operations the WAL needs.
pub trait FileSystem: Send + Sync + Debug {
    /// Creates a new file for reading and writing; fails if it exists.
    fn create(&self, path: &Path) -> io::Result<Arc<dyn WalFile>>;
    /// Opens an existing file, for reading and also writing if `writable`.
    fn open(&self, path: &Path, writable: bool) -> io::Result<Arc<dyn WalFile>>;
    /// Renames `from` to `to` (atomically replacing `to`).
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Deletes a file.
    fn remove(&self, path: &Path) -> io::Result<()>;
    /// Makes the directory's entries (creates, renames, deletes) durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// Creates the directory and its parents.
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// The names of the files in the directory.
    fn list(&self, dir: &Path) -> io::Result<Vec<String>>;
    /// Opens an existing file a second time for direct writes (`O_DIRECT`: from the caller's
    /// memory to the disk, past the page cache), which take offsets, lengths and buffers
    /// aligned to [`DIRECT_ALIGN`]. `None` where the file system cannot (tmpfs, say): the
    /// log then writes through the page cache only. The default is `None`.
    fn open_direct(&self, path: &Path) -> Option<Arc<dyn WalFile>> {
        let _ = path;
        None
    }
}

/// Alignment of the offsets, lengths and memory of direct writes
/// ([`FileSystem::open_direct`]): a page, which covers every common logical block size.
pub const DIRECT_ALIGN: usize = 4096;

/// Writes all of `buf` at `offset`, continuing after short writes.
pub(crate) fn write_all_at(file: &dyn WalFile, mut buf: &[u8], mut offset: u64) -> io::Result<()> {
    while !buf.is_empty() {
        match file.write_at(buf, offset) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "write returned 0 bytes",
                ));
            }
            Ok(n) => {
                buf = &buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Most buffers one `pwritev` takes (Linux `IOV_MAX`).
const IOV_MAX: usize = 1024;

/// Writes the concatenation of all of `bufs` at `offset`, at most [`IOV_MAX`] buffers per
/// call, continuing after short writes.
pub(crate) fn write_all_vectored_at(
    file: &dyn WalFile,
    mut bufs: &mut [IoSlice<'_>],
    mut offset: u64,
) -> io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        let n = bufs.len().min(IOV_MAX);
        match file.write_vectored_at(&bufs[..n], offset) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "write returned 0 bytes",
                ));
            }
            Ok(n) => {
                IoSlice::advance_slices(&mut bufs, n);
                offset += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads as much of `buf` as the file holds at `offset`; returns the count (short only at
/// the end of the file).
pub(crate) fn read_full_at(file: &dyn WalFile, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// The real file system through `std::fs` (and `fallocate` through rustix).
#[derive(Clone, Copy, Debug, Default)]
pub struct RealFs;

/// A real file.
#[derive(Debug)]
pub struct RealFile(File);

impl RealFile {
    /// `posix_fadvise` over `[offset, offset + len)`.
    fn advise(&self, offset: u64, len: u64, advice: rustix::fs::Advice) -> io::Result<()> {
        rustix::fs::fadvise(&self.0, offset, std::num::NonZeroU64::new(len), advice)
            .map_err(io::Error::from)
    }
}

impl WalFile for RealFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        self.0.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
        self.0.write_at(buf, offset)
    }
    fn write_vectored_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> io::Result<usize> {
        rustix::io::pwritev(&self.0, bufs, offset).map_err(io::Error::from)
    }
    fn sync_data(&self) -> io::Result<()> {
        self.0.sync_data()
    }
    fn sync_all(&self) -> io::Result<()> {
        self.0.sync_all()
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.0.metadata()?.len())
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }
    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        if len == 0 {
            return Ok(());
        }
        match rustix::fs::fallocate(&self.0, rustix::fs::FallocateFlags::empty(), offset, len) {
            Ok(()) => Ok(()),
            Err(e) if e == rustix::io::Errno::OPNOTSUPP || e == rustix::io::Errno::NOSYS => Ok(()),
            Err(e) => Err(io::Error::from(e)),
        }
    }
    fn will_need(&self, offset: u64, len: u64) -> io::Result<()> {
        self.advise(offset, len, rustix::fs::Advice::WillNeed)
    }
    fn dont_need(&self, offset: u64, len: u64) -> io::Result<()> {
        self.advise(offset, len, rustix::fs::Advice::DontNeed)
    }
}

impl FileSystem for RealFs {
    fn create(&self, path: &Path) -> io::Result<Arc<dyn WalFile>> {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)?;
        Ok(Arc::new(RealFile(f)))
    }
    fn open(&self, path: &Path, writable: bool) -> io::Result<Arc<dyn WalFile>> {
        let f = OpenOptions::new().read(true).write(writable).open(path)?;
        Ok(Arc::new(RealFile(f)))
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        std::fs::create_dir_all(dir)
    }
    fn open_direct(&self, path: &Path) -> Option<Arc<dyn WalFile>> {
        use rustix::fs::{Mode, OFlags};
        let flags = OFlags::RDWR | OFlags::DIRECT | OFlags::CLOEXEC;
        match rustix::fs::open(path, flags, Mode::empty()) {
            Ok(fd) => Some(Arc::new(RealFile(File::from(fd)))),
            Err(e) => {
                tracing::debug!(path = %path.display(), error = %e, "WAL: no direct writes");
                None
            }
        }
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for e in std::fs::read_dir(dir)? {
            let e = e?;
            if let Ok(name) = e.file_name().into_string() {
                names.push(name);
            }
        }
        Ok(names)
    }
}
