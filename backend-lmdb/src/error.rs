//! Errors: how LMDB's failures become [`BackendError`]s.
//!
//! The backend speaks [`BackendError`] (the trait's error type). Failures with no variant of
//! their own there are carried by [`BackendError::Other`] as an [`LmdbError`].

use std::path::{Path, PathBuf};

use heed::MdbError;
use keel_mvcc::BackendError;

/// LMDB failures that [`BackendError`] has no specific variant for.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LmdbError {
    /// Every LMDB reader slot is taken by an open read transaction.
    #[error(
        "LMDB store {path}: all {max_readers} reader slots are in use; drop a read \
         transaction or reopen with a larger max_readers"
    )]
    ReadersFull {
        /// The store's generation directory.
        path: PathBuf,
        /// The configured limit.
        max_readers: u32,
    },
    /// Read transactions kept seeing a snapshot other than the one their id names (see
    /// [`LmdbReadTxn`](crate::LmdbReadTxn)); the store's commit stamp is missing or damaged.
    #[error(
        "LMDB store {path}: no consistent read snapshot after {attempts} attempts; the \
         commit stamp is missing or damaged"
    )]
    NoConsistentSnapshot {
        /// The store's generation directory.
        path: PathBuf,
        /// Attempts made.
        attempts: u32,
    },
    /// A commit would create a bucket beyond [`LmdbOptions::max_buckets`](crate::LmdbOptions).
    #[error(
        "LMDB store {path}: cannot create bucket {bucket}: all {max_buckets} bucket databases \
         are in use; reopen with a larger max_buckets"
    )]
    TooManyBuckets {
        /// The store's generation directory.
        path: PathBuf,
        /// The bucket the commit would have created.
        bucket: String,
        /// The configured limit.
        max_buckets: u32,
    },
    /// Any other LMDB error.
    #[error("LMDB store {path}: {op} failed: {source}")]
    Lmdb {
        /// The store's generation directory.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// heed's error.
        #[source]
        source: heed::Error,
    },
}

/// Maps a heed error from `op` on the environment in `dir` to a [`BackendError`].
///
/// `MDB_MAP_FULL` is not handled here: the writer turns it into [`BackendError::Full`] with
/// the sizes it knows.
pub(crate) fn from_heed(dir: &Path, op: &'static str, e: heed::Error) -> BackendError {
    match e {
        heed::Error::Io(source) => BackendError::io(dir, op, source),
        heed::Error::EnvAlreadyOpened => BackendError::Locked {
            path: dir.parent().unwrap_or(dir).to_path_buf(),
        },
        heed::Error::Mdb(
            kind @ (MdbError::Corrupted
            | MdbError::PageNotFound
            | MdbError::Invalid
            | MdbError::VersionMismatch),
        ) => BackendError::Corrupt {
            path: dir.join("data.mdb"),
            offset: 0,
            reason: format!("LMDB reports {kind} during {op}"),
        },
        other => BackendError::Other(Box::new(LmdbError::Lmdb {
            path: dir.to_path_buf(),
            op,
            source: other,
        })),
    }
}
