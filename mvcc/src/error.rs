//! The store's error type.
//!
//! Messages that etcd users know keep etcd's wording at their start ("required revision has
//! been compacted", "duplicate key given in txn request", ...), followed by the details.

use crate::backend::{BackendError, Bucket};
use crate::revision::Revision;

/// Errors from the MVCC store. Bad input is refused before anything changes.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MvccError {
    /// A read, watch, hash or compaction asked for a revision at or below the compaction point.
    #[error(
        "required revision has been compacted (requested {requested}, compacted at {compacted})"
    )]
    Compacted {
        /// The revision asked for.
        requested: u64,
        /// The store's compaction point.
        compacted: u64,
    },
    /// A read, hash or compaction asked for a revision above the current one.
    #[error("required revision is a future revision (requested {requested}, current {current})")]
    FutureRevision {
        /// The revision asked for.
        requested: u64,
        /// The store's current revision.
        current: u64,
    },
    /// An operation named no key.
    #[error("key is not provided")]
    EmptyKey,
    /// A range end sorts before its key.
    #[error("range end {end:?} is below the key {key:?}")]
    RangeEndBelowKey {
        /// The key (lossy UTF-8).
        key: String,
        /// The range end (lossy UTF-8).
        end: String,
    },
    /// A request carries more bytes than the configured limit.
    #[error("request is too large: {size} bytes, the limit is {limit} bytes")]
    RequestTooLarge {
        /// Bytes in the request (keys, values, range ends).
        size: usize,
        /// `StoreOptions::max_request_bytes`.
        limit: usize,
    },
    /// A transaction carries more operations than the configured limit.
    #[error("too many operations in txn request: {ops} operations, the limit is {limit}")]
    TooManyOps {
        /// Operations in the request (the larger branch, nested ones included).
        ops: usize,
        /// `StoreOptions::max_txn_ops`.
        limit: usize,
    },
    /// A transaction nests transactions deeper than
    /// [`MAX_TXN_DEPTH`](crate::request::MAX_TXN_DEPTH) levels.
    #[error("txn request nests transactions deeper than {limit} levels")]
    TxnTooDeep {
        /// The deepest nesting accepted.
        limit: usize,
    },
    /// One transaction branch puts the same key twice, or puts a key it also deletes.
    #[error("duplicate key given in txn request: {key:?}")]
    DuplicateKey {
        /// The key (lossy UTF-8).
        key: String,
    },
    /// A write transaction tried to apply a Raft index the store already holds.
    #[error(
        "consistent index {index} is already applied: the store holds index {applied}; apply only later entries"
    )]
    IndexAlreadyApplied {
        /// The index offered.
        index: u64,
        /// The store's consistent index.
        applied: u64,
    },
    /// An auxiliary write named a bucket the store keeps for itself.
    #[error("bucket {bucket} is reserved by the store; use another name")]
    ReservedBucket {
        /// The bucket.
        bucket: Bucket,
    },
    /// A store option is out of range.
    #[error("invalid store option {option}: {reason}")]
    InvalidOption {
        /// The field.
        option: &'static str,
        /// Why it was refused.
        reason: String,
    },
    /// Stored data does not decode.
    #[error("stored change at revision {revision} is corrupt: {reason}")]
    Corrupt {
        /// The revision key that failed.
        revision: Revision,
        /// What is wrong.
        reason: String,
    },
    /// The store's metadata does not decode or is from an unknown format.
    #[error("store metadata key {key:?} is invalid: {reason}")]
    BadMeta {
        /// The meta key.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// The watcher was cancelled or the store closed.
    #[error("watch {id} is closed: it was cancelled or the store was dropped")]
    WatchClosed {
        /// The watch id.
        id: u64,
    },
    /// An earlier backend commit (of writes, or of a compaction's deletions) failed; writes
    /// are refused until the store is reopened.
    #[error("store is poisoned by an earlier backend commit failure ({reason}); reopen it")]
    Poisoned {
        /// The first failure.
        reason: String,
    },
    /// The backend failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// Lossy UTF-8 rendering of a key for error messages, cut at 128 bytes.
pub(crate) fn show(key: &[u8]) -> String {
    let cut = &key[..key.len().min(128)];
    let mut s = String::from_utf8_lossy(cut).into_owned();
    if key.len() > 128 {
        s.push_str("...");
    }
    s
}
