//! Torn-tail repair: what open does when the last segment ends in a record (or header) that
//! is not whole, as after a crash in the middle of a write.
//!
//! A copy of the damaged segment is kept as `<name>.broken` (numbered `.broken.N` if that
//! exists) and made durable, its data and then its name (a directory sync), before anything
//! is changed; then the bytes from the first bad record to the end of the file are zeroed
//! (keeping the file's allocation), and the file is synced. So a crash during the repair
//! never leaves the segment changed without its copy. Strict mode never gets here: open
//! reports the damage instead.

use std::io;
use std::path::{Path, PathBuf};

use crate::io::{FileSystem, WalFile, write_all_at};

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

/// Keeps a copy of the segment, then zeroes it from `offset` to its end.
pub(crate) fn truncate_tail(
    fs: &dyn FileSystem,
    path: &Path,
    file: &dyn WalFile,
    offset: u64,
) -> io::Result<PathBuf> {
    let copy = broken_path(fs, path)?;
    fs.copy(path, &copy)?;
    if let Some(dir) = path.parent() {
        fs.sync_dir(dir)?;
    }
    let len = file.len()?;
    let zeros = vec![0u8; 1 << 20];
    let mut at = offset;
    while at < len {
        let n = (len - at).min(zeros.len() as u64) as usize;
        write_all_at(file, &zeros[..n], at)?;
        at += n as u64;
    }
    file.sync_all()?;
    Ok(copy)
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
