//! The I/O seam: every write, sync, truncation and mapping of the store goes through `Io`,
//! which consults an optional [`FaultHook`]. Tests install a [`FaultPlan`] to fail any single
//! write or sync, or to tear a write (only a prefix reaches the file) and keep it there; a
//! hook of their own can also fail a mapping.

use std::fmt;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use keel_mvcc::BackendError;
use parking_lot::Mutex;

use crate::direct::DirectWriter;

/// What an injected fault does to one write.
#[derive(Debug)]
pub enum WriteFault {
    /// The write happens normally.
    Proceed,
    /// The write fails with this error and writes nothing.
    Fail(io::Error),
    /// Only the first `written` bytes reach the file, then the write fails.
    Torn {
        /// Bytes that reach the file.
        written: usize,
    },
}

/// Decides, before each I/O call of the store, whether it fails.
pub trait FaultHook: Send + Sync + fmt::Debug {
    /// Called before writing `len` bytes at `offset` of `path`.
    fn before_write(&self, path: &Path, offset: u64, len: usize) -> WriteFault;
    /// Called before syncing `path` (a file or the store's directory).
    fn before_sync(&self, path: &Path) -> io::Result<()>;
    /// Called before cutting `path` back to `len` bytes (the undo of a failed commit, and the
    /// torn-tail repair at open).
    fn before_truncate(&self, path: &Path, len: u64) -> io::Result<()>;
    /// Called before mapping `len` bytes of the segment file `path` read-only (at open, when a
    /// segment is started, and when a commit outgrows its segment's mapping); an error fails
    /// the mapping. The default lets every mapping proceed (a [`FaultPlan`] neither counts
    /// nor strikes mappings).
    fn before_map(&self, path: &Path, len: u64) -> io::Result<()> {
        let _ = (path, len);
        Ok(())
    }
}

/// A [`FaultHook`] that numbers every write and sync from 0 and strikes one of them.
#[derive(Debug, Default)]
pub struct FaultPlan {
    next: AtomicU64,
    strike: Option<(u64, Strike)>,
    truncates_fail: bool,
    writes: Mutex<Vec<u64>>,
}

/// What a [`FaultPlan`] does to the operation it strikes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strike {
    /// The write or sync fails.
    Fail,
    /// A write writes only `n` bytes (fewer if it is shorter), then fails; a sync just fails.
    Tear(usize),
}

impl FaultPlan {
    /// A plan that only counts.
    pub fn count_only() -> Arc<FaultPlan> {
        Arc::new(FaultPlan::default())
    }

    /// A plan that strikes operation number `op` (writes and syncs counted together).
    /// With `truncates_fail`, every truncation fails too, so a torn write stays in the file
    /// as a crash would leave it.
    pub fn strike(op: u64, strike: Strike, truncates_fail: bool) -> Arc<FaultPlan> {
        Arc::new(FaultPlan {
            next: AtomicU64::new(0),
            strike: Some((op, strike)),
            truncates_fail,
            writes: Mutex::new(Vec::new()),
        })
    }

    /// Operations counted so far.
    pub fn ops(&self) -> u64 {
        self.next.load(Ordering::SeqCst)
    }

    /// The numbers of the operations so far that were writes (the others were syncs).
    pub fn writes(&self) -> Vec<u64> {
        self.writes.lock().clone()
    }

    fn take(&self, write: bool) -> Option<Strike> {
        let n = self.next.fetch_add(1, Ordering::SeqCst);
        if write {
            self.writes.lock().push(n);
        }
        match self.strike {
            Some((at, s)) if at == n => Some(s),
            _ => None,
        }
    }
}

fn injected() -> io::Error {
    io::Error::other("injected fault")
}

impl FaultHook for FaultPlan {
    fn before_write(&self, _path: &Path, _offset: u64, len: usize) -> WriteFault {
        match self.take(true) {
            None => WriteFault::Proceed,
            Some(Strike::Fail) => WriteFault::Fail(injected()),
            Some(Strike::Tear(n)) => WriteFault::Torn {
                written: n.min(len),
            },
        }
    }

    fn before_sync(&self, _path: &Path) -> io::Result<()> {
        match self.take(false) {
            None => Ok(()),
            Some(_) => Err(injected()),
        }
    }

    fn before_truncate(&self, _path: &Path, _len: u64) -> io::Result<()> {
        if self.truncates_fail {
            Err(injected())
        } else {
            Ok(())
        }
    }
}

/// How a direct write went.
pub(crate) enum DirectOutcome {
    /// Handed to the disk; here is a buffer to encode the next frame into.
    Written(Vec<u8>),
    /// The file system refuses direct writes; here is the frame, to write it the ordinary way.
    Refused(Vec<u8>),
}

/// The store's I/O calls, with the optional hook in front of each.
#[derive(Clone, Debug, Default)]
pub(crate) struct Io {
    hook: Option<Arc<dyn FaultHook>>,
}

impl Io {
    pub(crate) fn new(hook: Option<Arc<dyn FaultHook>>) -> Io {
        Io { hook }
    }

    /// Positioned write of all of `buf` at `offset`.
    pub(crate) fn write_at(
        &self,
        file: &File,
        path: &Path,
        offset: u64,
        buf: &[u8],
    ) -> Result<(), BackendError> {
        let fault = match &self.hook {
            Some(h) => h.before_write(path, offset, buf.len()),
            None => WriteFault::Proceed,
        };
        let result = match fault {
            WriteFault::Proceed => file.write_all_at(buf, offset),
            WriteFault::Fail(e) => Err(e),
            WriteFault::Torn { written } => file
                .write_all_at(&buf[..written.min(buf.len())], offset)
                .and(Err(injected())),
        };
        result.map_err(|e| BackendError::io(path, "pwrite", e))
    }

    /// Positioned write of `frame` at `offset` of a segment through its direct writer (see
    /// `direct`), `seal` run on it first; `file` is the segment's ordinary handle. The write completes in the
    /// background: its failure is reported by a later call or by the writer's `finish`.
    pub(crate) fn write_direct(
        &self,
        direct: &mut DirectWriter,
        file: &File,
        path: &Path,
        offset: u64,
        mut frame: Vec<u8>,
        seal: fn(&mut [u8]),
    ) -> Result<DirectOutcome, BackendError> {
        let fault = match &self.hook {
            Some(h) => h.before_write(path, offset, frame.len()),
            None => WriteFault::Proceed,
        };
        let result = match fault {
            WriteFault::Proceed => match direct.write(file, offset, frame, seal) {
                Ok(next) => return Ok(DirectOutcome::Written(next)),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    if let Some(frame) = direct.take_refused() {
                        return Ok(DirectOutcome::Refused(frame));
                    }
                    Err(e)
                }
                Err(e) => Err(e),
            },
            WriteFault::Fail(e) => Err(e),
            WriteFault::Torn { written } => {
                seal(&mut frame);
                file.write_all_at(&frame[..written.min(frame.len())], offset)
                    .and(Err(injected()))
            }
        };
        result
            .map(|()| DirectOutcome::Written(Vec::new()))
            .map_err(|e| BackendError::io(path, "direct pwrite", e))
    }

    /// Allocates `[offset, offset + len)` of a file (`fallocate`, growing it if needed): the
    /// blocks exist afterwards and read as zeros. The hook sees it as a write of `len` bytes;
    /// a torn one counts as failed.
    pub(crate) fn allocate(
        &self,
        file: &File,
        path: &Path,
        offset: u64,
        len: u64,
    ) -> Result<(), BackendError> {
        let fault = match &self.hook {
            Some(h) => h.before_write(path, offset, len as usize),
            None => WriteFault::Proceed,
        };
        let result = match fault {
            WriteFault::Proceed => {
                rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), offset, len)
                    .map_err(io::Error::from)
            }
            WriteFault::Fail(e) => Err(e),
            WriteFault::Torn { .. } => Err(injected()),
        };
        result.map_err(|e| BackendError::io(path, "fallocate", e))
    }

    /// Starts writing `[offset, offset + len)` of a file to the disk without waiting for it
    /// (`sync_file_range` with `SYNC_FILE_RANGE_WRITE`). Not a durability point: the sync
    /// that must follow reports any failure, so an error here is only logged.
    pub(crate) fn start_writeback(&self, file: &File, path: &Path, offset: u64, len: u64) {
        let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
            return;
        };
        // SAFETY: `sync_file_range` takes only integers and reads no memory of ours; the
        // descriptor is borrowed from a `File` that stays open for the whole call.
        let rc = unsafe {
            libc::sync_file_range(file.as_raw_fd(), offset, len, libc::SYNC_FILE_RANGE_WRITE)
        };
        if rc != 0 {
            tracing::debug!(
                path = %path.display(),
                error = %io::Error::last_os_error(),
                "cannot start writeback early"
            );
        }
    }

    /// `fdatasync` of a file.
    pub(crate) fn sync_data(&self, file: &File, path: &Path) -> Result<(), BackendError> {
        if let Some(h) = &self.hook {
            h.before_sync(path)
                .map_err(|e| BackendError::io(path, "fdatasync", e))?;
        }
        file.sync_data()
            .map_err(|e| BackendError::io(path, "fdatasync", e))
    }

    /// `fsync` of a directory, making creations, renames and removals in it durable.
    pub(crate) fn sync_dir(&self, dir: &Path) -> Result<(), BackendError> {
        if let Some(h) = &self.hook {
            h.before_sync(dir)
                .map_err(|e| BackendError::io(dir, "fsync directory", e))?;
        }
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| BackendError::io(dir, "fsync directory", e))
    }

    /// Asks the hook whether mapping `len` bytes of `path` may proceed.
    pub(crate) fn before_map(&self, path: &Path, len: u64) -> Result<(), BackendError> {
        match &self.hook {
            Some(h) => h
                .before_map(path, len)
                .map_err(|e| BackendError::io(path, "mmap", e)),
            None => Ok(()),
        }
    }

    /// Cuts a file back to `len` bytes.
    pub(crate) fn truncate(&self, file: &File, path: &Path, len: u64) -> Result<(), BackendError> {
        if let Some(h) = &self.hook {
            h.before_truncate(path, len)
                .map_err(|e| BackendError::io(path, "truncate", e))?;
        }
        file.set_len(len)
            .map_err(|e| BackendError::io(path, "truncate", e))
    }
}
