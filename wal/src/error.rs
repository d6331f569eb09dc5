//! The one error type of the WAL.

use std::io;
use std::path::{Path, PathBuf};

/// Everything that can go wrong in the WAL. `Display` is a sentence naming what failed, on
/// which file, and why.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WalError {
    /// An I/O operation failed.
    #[error("WAL I/O error while trying to {op} {path}: {source}")]
    Io {
        /// What was being done ("write", "fdatasync", "open", ...).
        op: &'static str,
        /// The file or directory concerned.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
    /// The file system ran out of space. Nothing of the failed call was acknowledged; the log
    /// stays readable.
    #[error("WAL disk full while trying to {op} {path}: free space and retry")]
    DiskFull {
        /// What was being done.
        op: &'static str,
        /// The file concerned.
        path: PathBuf,
    },
    /// A previous write or fdatasync failed, so what is durable is unknown; every later write
    /// fails with this error. Reopen the log to recover.
    #[error("WAL is poisoned by an earlier failure ({reason}); close and reopen it")]
    Poisoned {
        /// The failure that poisoned the log.
        reason: String,
    },
    /// Another `Wal` (in this or another process) holds the directory.
    #[error("WAL directory {path} is locked by another open log")]
    Locked {
        /// The directory.
        path: PathBuf,
    },
    /// A record or segment failed its checks somewhere a torn write cannot explain (or in
    /// strict mode, anywhere).
    #[error("WAL corrupt in {path} at byte offset {offset}: {reason}")]
    Corrupt {
        /// The segment file.
        path: PathBuf,
        /// Byte offset of the damaged record or header in that file.
        offset: u64,
        /// What check failed.
        reason: String,
    },
    /// A segment in the middle of the sequence is missing, or the files do not follow each
    /// other.
    #[error("WAL segment sequence broken in {dir}: {reason}")]
    MissingSegment {
        /// The WAL directory.
        dir: PathBuf,
        /// What is missing or out of order.
        reason: String,
    },
    /// A segment was written by an unknown format version.
    #[error(
        "WAL segment {path} has format version {found}, this build reads versions {oldest} to {expected}",
        oldest = crate::segment::OLDEST_VERSION
    )]
    UnknownVersion {
        /// The segment file.
        path: PathBuf,
        /// Version found in the header.
        found: u32,
        /// Version this build writes (the newest it reads).
        expected: u32,
    },
    /// The options are invalid.
    #[error("invalid WAL option {field}: {reason}")]
    InvalidOption {
        /// The option field.
        field: &'static str,
        /// Why it is invalid.
        reason: String,
    },
    /// An append does not fit the log (non-consecutive indices, a gap after the last index,
    /// an index already covered by the snapshot marker, an entry too large).
    #[error("invalid WAL append: {reason}")]
    InvalidAppend {
        /// What is wrong with it.
        reason: String,
    },
    /// A read asked for entries no longer held (at or below the first released index).
    #[error("WAL entries from index {index} were compacted; the first entry held is {first}")]
    Compacted {
        /// Requested index.
        index: u64,
        /// First index still held.
        first: u64,
    },
    /// A read asked for entries past the last index, or an empty/reversed range.
    #[error("WAL entries [{lo}, {hi}) are unavailable; the log holds [{first}, {last}]")]
    Unavailable {
        /// Requested low bound.
        lo: u64,
        /// Requested high bound (exclusive).
        hi: u64,
        /// First index held.
        first: u64,
        /// Last index held.
        last: u64,
    },
    /// A snapshot marker older than the one already recorded.
    #[error("WAL snapshot marker at index {index} is older than the recorded one at {current}")]
    StaleSnapshot {
        /// Index of the rejected marker.
        index: u64,
        /// Index of the recorded marker.
        current: u64,
    },
}

impl WalError {
    /// Wraps an I/O error, mapping "no space left on device" to [`WalError::DiskFull`].
    /// Damage at `offset` of the file at `path`.
    pub(crate) fn corrupt(path: &Path, offset: u64, reason: impl Into<String>) -> WalError {
        WalError::Corrupt {
            path: path.to_path_buf(),
            offset,
            reason: reason.into(),
        }
    }

    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> WalError {
        if is_disk_full(&source) {
            WalError::DiskFull {
                op,
                path: path.into(),
            }
        } else {
            WalError::Io {
                op,
                path: path.into(),
                source,
            }
        }
    }

    /// Whether this error is [`WalError::DiskFull`].
    pub fn is_disk_full(&self) -> bool {
        matches!(self, WalError::DiskFull { .. })
    }
}

/// Whether an I/O error means the file system is out of space.
pub(crate) fn is_disk_full(e: &io::Error) -> bool {
    const ENOSPC: i32 = 28;
    e.kind() == io::ErrorKind::StorageFull || e.raw_os_error() == Some(ENOSPC)
}
