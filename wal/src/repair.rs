//! Torn-tail repair: what open does when the last segment ends in a record (or header) that
//! is not whole, as after a crash in the middle of a write.
//!
//! The repair changes only the bytes from the first bad record to the end of the file, so
//! only those are kept, in a copy `<name>.broken` (numbered `.broken.N` if that exists): the
//! copy is as long as the segment and holds, at their own offsets, the segment header
//! (bytes 0..32) and every page (4 KiB, aligned in the file) of those bytes that is not all
//! zeros; the rest is a hole (reads as zeros, takes no space). So the first non-zero 8 bytes
//! after the header are the bad record's header, and the copy takes about the space of the
//! data past the last whole record (in a recycled file, that includes the leftovers of its
//! earlier life), not a segment's, on a disk that may be nearly full. The segment up to the
//! bad record stays as it was, and laid over the copy gives back the segment as found.
//!
//! The copy is made durable, its data and then its name (a directory sync), before anything
//! is changed; then the bytes from the first bad record to the end of the file are zeroed
//! (keeping the file's allocation), and the file is synced. So a crash during the repair
//! never leaves the segment changed without its copy. If the copy cannot be made (say, the
//! disk is full), what was made of it is deleted and open fails with the error, the segment
//! unchanged. Strict mode never gets here: open reports the damage instead.

use std::io;
use std::path::{Path, PathBuf};

use crate::error::WalError;
use crate::io::{DIRECT_ALIGN, FileSystem, WalFile, read_full_at, write_all_at};
use crate::segment::SEGMENT_HEADER_LEN;

/// The pieces the copy of a torn tail is written or left out in.
const PAGE: u64 = DIRECT_ALIGN as u64;

/// A free `<path>.broken[.N]` name.
pub(crate) fn broken_path(fs: &dyn FileSystem, path: &Path) -> io::Result<PathBuf> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let existing = fs.list(dir)?;
    let mut candidate = format!("{name}.broken");
    let mut n = 1;
    while existing.contains(&candidate) {
        candidate = format!("{name}.broken.{n}");
        n += 1;
    }
    Ok(dir.join(candidate))
}

/// Keeps a copy of the segment's header and of its bytes from `offset` on, then zeroes
/// those bytes; returns the copy's path.
pub(crate) fn truncate_tail(
    fs: &dyn FileSystem,
    path: &Path,
    file: &dyn WalFile,
    offset: u64,
) -> Result<PathBuf, WalError> {
    let copying = |e| WalError::io("keep a copy of the torn tail of", path, e);
    let copy = broken_path(fs, path).map_err(copying)?;
    let len = file.len().map_err(copying)?;
    if let Err(e) = copy_tail(fs, file, &copy, offset, len) {
        if let Err(e) = fs.remove(&copy)
            && e.kind() != io::ErrorKind::NotFound
        {
            tracing::warn!(error = %e, path = %copy.display(), "WAL: cannot delete a partial copy");
        }
        return Err(copying(e));
    }
    let repairing = |e| WalError::io("repair", path, e);
    let zeros = vec![0u8; 1 << 20];
    let mut at = offset;
    while at < len {
        let n = (len - at).min(zeros.len() as u64) as usize;
        write_all_at(file, &zeros[..n], at).map_err(repairing)?;
        at += n as u64;
    }
    file.sync_all().map_err(repairing)?;
    Ok(copy)
}

/// Writes `copy` as the module documentation says (the header and the non-zero pages of
/// `[offset, len)` of `file`) and makes it durable, name included.
fn copy_tail(
    fs: &dyn FileSystem,
    file: &dyn WalFile,
    copy: &Path,
    offset: u64,
    len: u64,
) -> io::Result<()> {
    let out = fs.create(copy)?;
    let mut buf = vec![0u8; 1 << 20];
    let got = read_full_at(file, &mut buf[..SEGMENT_HEADER_LEN as usize], 0)?;
    write_all_at(&*out, &buf[..got], 0)?;
    let mut at = offset;
    while at < len {
        let want = (len - at).min(buf.len() as u64) as usize;
        let got = read_full_at(file, &mut buf[..want], at)?;
        if got == 0 {
            break;
        }
        let mut p = 0;
        while p < got {
            let page_end = ((at + p as u64) / PAGE + 1) * PAGE;
            let q = ((page_end - at) as usize).min(got);
            if buf[p..q].iter().any(|&b| b != 0) {
                write_all_at(&*out, &buf[p..q], at + p as u64)?;
            }
            p = q;
        }
        at += got as u64;
    }
    out.set_len(len)?;
    out.sync_all()?;
    if let Some(dir) = copy.parent() {
        fs.sync_dir(dir)?;
    }
    Ok(())
}

/// Moves a segment whose header is damaged out of the log, to `<name>.broken`.
pub(crate) fn set_aside(fs: &dyn FileSystem, path: &Path) -> io::Result<PathBuf> {
    let to = broken_path(fs, path)?;
    fs.rename(path, &to)?;
    if let Some(dir) = path.parent() {
        fs.sync_dir(dir)?;
    }
    Ok(to)
}
