//! Segment files and their read-only mappings.
//!
//! A [`SegFile`] names one segment file; a [`SegMap`] is a read-only shared mapping of its
//! first `len` bytes, all of them committed. Read transactions hold `Arc<SegMap>`s, so a
//! mapping lives exactly as long as some index version points into it. When the active
//! segment grows, a new, longer mapping is made and published; readers of the old one keep
//! it. A segment that the reclaimer has emptied is marked dead and its file is removed when
//! the last mapping of it goes away.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use keel_mvcc::BackendError;
use memmap2::{Mmap, MmapOptions};

/// File name of segment `id`.
pub(crate) fn file_name(id: u64) -> String {
    format!("{id:016x}.seg")
}

/// Parses a segment file name.
pub(crate) fn parse_name(name: &str) -> Option<u64> {
    let hex = name.strip_suffix(".seg")?;
    if hex.len() != 16 {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

/// One segment file.
#[derive(Debug)]
pub(crate) struct SegFile {
    pub(crate) id: u32,
    pub(crate) path: PathBuf,
    dead: AtomicBool,
}

impl SegFile {
    pub(crate) fn new(id: u32, path: PathBuf) -> Arc<SegFile> {
        Arc::new(SegFile {
            id,
            path,
            dead: AtomicBool::new(false),
        })
    }

    /// Marks the file for removal once nothing maps it. Only called after META records a
    /// floor above this segment, so the removal can never lose data.
    pub(crate) fn mark_dead(&self) {
        self.dead.store(true, Ordering::SeqCst);
    }
}

impl Drop for SegFile {
    fn drop(&mut self) {
        if self.dead.load(Ordering::SeqCst) {
            match std::fs::remove_file(&self.path) {
                Ok(()) => tracing::debug!(path = %self.path.display(), "removed dead segment"),
                Err(e) => {
                    tracing::warn!(path = %self.path.display(), error = %e, "cannot remove dead segment")
                }
            }
        }
    }
}

/// A read-only mapping of the first `len` committed bytes of a segment.
pub(crate) struct SegMap {
    pub(crate) file: Arc<SegFile>,
    map: Mmap,
}

impl SegMap {
    /// Maps the first `len` bytes of `file` (at `path`) read-only.
    ///
    /// Fails without mapping when the file is shorter than `len`, so a mapping never reaches
    /// past the end of its file.
    pub(crate) fn map(
        seg: &Arc<SegFile>,
        file: &File,
        path: &Path,
        len: u64,
    ) -> Result<Arc<SegMap>, BackendError> {
        let size = file
            .metadata()
            .map_err(|e| BackendError::io(path, "stat", e))?
            .len();
        if len > size || len == 0 {
            return Err(BackendError::Corrupt {
                path: path.to_path_buf(),
                offset: size,
                reason: format!("cannot map {len} bytes of a {size}-byte segment"),
            });
        }
        let len = usize::try_from(len).map_err(|_| BackendError::Corrupt {
            path: path.to_path_buf(),
            offset: 0,
            reason: "segment larger than the address space".into(),
        })?;
        // SAFETY: the mapping is read-only and covers bytes [0, len) of a file that is at
        // least `len` bytes long (checked just above), so no access through it can fault on a
        // missing page. Those bytes never change while the file exists: the store only
        // writes a segment by appending past its committed end (every `len` passed here is at
        // most a committed end), never truncates a segment below a committed end (the undo of
        // a failed commit and the torn-tail repair at open cut only uncommitted bytes), and
        // removes a segment file only once no mapping of it is left (`SegFile` is dropped
        // after every `SegMap` holding it). Other processes are kept out by the exclusive
        // lock on the store's LOCK file; a process that ignores the lock and writes the files
        // is outside what any memory-mapped store can defend against, as with LMDB.
        let map = unsafe { MmapOptions::new().len(len).map(file) }
            .map_err(|e| BackendError::io(path, "mmap", e))?;
        Ok(Arc::new(SegMap {
            file: seg.clone(),
            map,
        }))
    }

    /// The mapped bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.map
    }
}
