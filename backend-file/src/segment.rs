//! Segment files and their read-only mappings.
//!
//! A [`SegFile`] names one segment file; a [`SegMap`] is a read-only shared mapping of it,
//! made once per segment at the segment size (a commit that outgrows it makes a longer one,
//! and readers of the old one keep it). An index version records, next to each mapping, the
//! segment's committed end as of that version, and only that prefix is ever read. Read
//! transactions hold `Arc<SegMap>`s, so a mapping lives exactly as long as some index version
//! points into it. A segment that the reclaimer has emptied is marked dead and its file is removed when
//! the last mapping of it goes away.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use keel_mvcc::BackendError;
use memmap2::{MmapOptions, MmapRaw};

use crate::fault::Io;

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

/// A read-only shared mapping of a segment file, at the segment size or the whole file if it
/// is longer: its committed bytes, the space prepared ahead of them and, past the end of the
/// file, the space the segment will grow into, so that commits need no new mapping until the
/// segment outgrows it (see [`SegMap::map`]).
///
/// No slice of the whole mapping is ever made: [`SegMap::prefix`] hands out only prefixes up to
/// a committed end, whose bytes exist in the file and never change.
pub(crate) struct SegMap {
    pub(crate) file: Arc<SegFile>,
    map: MmapRaw,
}

impl SegMap {
    /// Maps `file` (at `path`) read-only, where `committed` bytes are committed now: `map_len`
    /// bytes, or the whole file if it is longer.
    ///
    /// The mapping may reach past the end of the file, so the space a segment grows into later
    /// is read through the same mapping: a new one is made only when a segment outgrows
    /// `map_len`. Bytes past the end of the file are never read (see [`prefix`](Self::prefix):
    /// only committed bytes are, and those lie inside the file).
    ///
    /// Fails without mapping when the file is shorter than `committed`, or when the fault
    /// hook of `io` fails the mapping.
    pub(crate) fn map(
        io: &Io,
        seg: &Arc<SegFile>,
        file: &File,
        path: &Path,
        committed: u64,
        map_len: u64,
    ) -> Result<Arc<SegMap>, BackendError> {
        let size = file
            .metadata()
            .map_err(|e| BackendError::io(path, "stat", e))?
            .len();
        if committed > size || committed == 0 {
            return Err(BackendError::Corrupt {
                path: path.to_path_buf(),
                offset: size,
                reason: format!("cannot map {committed} bytes of a {size}-byte segment"),
            });
        }
        let len = usize::try_from(map_len.max(size)).map_err(|_| BackendError::Corrupt {
            path: path.to_path_buf(),
            offset: 0,
            reason: "segment larger than the address space".into(),
        })?;
        io.before_map(path, len as u64)?;
        let map = MmapOptions::new()
            .len(len)
            .map_raw_read_only(file)
            .map_err(|e| BackendError::io(path, "mmap", e))?;
        Ok(Arc::new(SegMap {
            file: seg.clone(),
            map,
        }))
    }

    /// Bytes the mapping spans (committed or not).
    pub(crate) fn capacity(&self) -> u64 {
        self.map.len() as u64
    }

    /// The first `len` bytes, `None` when the mapping is shorter.
    ///
    /// Callers pass a committed end of the segment (the end recorded in an index version, or
    /// the end that recovery validated), never more.
    pub(crate) fn prefix(&self, len: u64) -> Option<&[u8]> {
        let len = usize::try_from(len).ok()?;
        if len > self.map.len() {
            return None;
        }
        // SAFETY: `len` is within the mapping (checked above), which is a live read-only
        // shared mapping owned by `self`, so the pointer is valid for `len` bytes for as long
        // as `&self` lives. Every caller passes a committed end of the segment: those bytes
        // lie inside the file (a segment is never cut below a committed end: the undo of a
        // failed commit and the repairs at open and after a defragment cut only bytes past
        // it), so reading them cannot fault, and they never change while the file exists: the
        // store writes a segment only past its committed end (frames, and the zeros prepared
        // ahead of them), and removes a segment file only once no mapping of it is left
        // (`SegFile` is dropped after every `SegMap` holding it). Other processes are kept out
        // by the exclusive lock on the store's LOCK file; a process that ignores the lock and
        // writes the files is outside what any memory-mapped store can defend against, as
        // with LMDB.
        Some(unsafe { std::slice::from_raw_parts(self.map.as_ptr(), len) })
    }
}
