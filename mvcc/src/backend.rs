//! The storage seam under the MVCC store.
//!
//! A [`Backend`] is an ordered, durable, bucketed key-value store with three guarantees the
//! rest of keel is built on:
//!
//! 1. **Atomic batches.** [`Backend::commit`] applies a [`WriteBatch`] wholly or not at all, and
//!    when it returns `Ok` the batch survives a crash (a power cut, a `kill -9`). The MVCC store
//!    writes its *consistent index* (the last Raft index whose effects the backend holds) in the
//!    same batch as the data it covers, so the two can never disagree after a restart.
//! 2. **Snapshot reads that never block the writer.** A [`ReadTxn`] sees the store exactly as
//!    of the last commit before it was opened, for as long as it lives, on any thread; opening,
//!    holding or iterating it never waits for a commit and never makes one wait.
//! 3. **A streamed consistent copy.** [`Backend::snapshot`] writes the whole store, as of one
//!    instant, to a byte stream without stopping writes; [`Backend::restore`] loads such a
//!    stream into an empty backend. This is what a new learner receives.
//!
//! Keys and values are arbitrary bytes, compared lexicographically. A bucket springs into
//! existence on its first write; reading a bucket that was never written yields nothing.
//!
//! The default snapshot format is backend-independent and documented in [`snapshot`]; a
//! backend may override [`Backend::snapshot`] / [`Backend::restore`] with a native copy as long
//! as the two agree with each other.

pub mod snapshot;

use std::borrow::Cow;
use std::fmt;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

/// Longest bucket name a backend must accept, in bytes.
pub const MAX_BUCKET_NAME: usize = 64;

/// A named bucket: a separate ordered key space inside one backend.
///
/// Names are 1 to [`MAX_BUCKET_NAME`] bytes of ASCII letters, digits, `_` and `-`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Bucket(Cow<'static, str>);

impl Bucket {
    /// A bucket with a name known at compile time.
    ///
    /// The name is checked when the bucket is first used; an invalid name then yields
    /// [`BackendError::InvalidBucket`].
    pub const fn new(name: &'static str) -> Bucket {
        Bucket(Cow::Borrowed(name))
    }

    /// A bucket whose name was read at run time (from a snapshot stream, say).
    pub fn from_name(name: String) -> Result<Bucket, BackendError> {
        let bucket = Bucket(Cow::Owned(name));
        bucket.validate()?;
        Ok(bucket)
    }

    /// The bucket's name.
    pub fn name(&self) -> &str {
        &self.0
    }

    /// Checks the naming rule; every backend calls this before creating a bucket.
    pub fn validate(&self) -> Result<(), BackendError> {
        let name = self.name();
        let ok = !name.is_empty()
            && name.len() <= MAX_BUCKET_NAME
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if ok {
            Ok(())
        } else {
            Err(BackendError::InvalidBucket {
                name: name.to_owned(),
            })
        }
    }
}

impl fmt::Debug for Bucket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Bucket({:?})", self.name())
    }
}

impl fmt::Display for Bucket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One change inside a [`WriteBatch`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BatchOp {
    /// Set `key` to `value`, replacing any previous value.
    Put {
        /// Target bucket.
        bucket: Bucket,
        /// Key bytes.
        key: Vec<u8>,
        /// Value bytes.
        value: Vec<u8>,
    },
    /// Remove `key` if present.
    Delete {
        /// Target bucket.
        bucket: Bucket,
        /// Key bytes.
        key: Vec<u8>,
    },
    /// Remove every key in `[start, end)`; `end = None` means "to the end of the bucket".
    DeleteRange {
        /// Target bucket.
        bucket: Bucket,
        /// First key removed.
        start: Vec<u8>,
        /// First key kept, or `None` for no upper bound.
        end: Option<Vec<u8>>,
    },
}

/// One change of a batch whose bytes the caller keeps: what a [`BatchSource`] hands to a
/// backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchOpRef<'a> {
    /// Set `key` to `value`, replacing any previous value.
    Put {
        /// Target bucket.
        bucket: &'a Bucket,
        /// Key bytes.
        key: &'a [u8],
        /// Value bytes.
        value: &'a [u8],
    },
    /// Remove `key` if present.
    Delete {
        /// Target bucket.
        bucket: &'a Bucket,
        /// Key bytes.
        key: &'a [u8],
    },
    /// Remove every key in `[start, end)`; `end = None` means "to the end of the bucket".
    DeleteRange {
        /// Target bucket.
        bucket: &'a Bucket,
        /// First key removed.
        start: &'a [u8],
        /// First key kept, or `None` for no upper bound.
        end: Option<&'a [u8]>,
    },
}

impl BatchOp {
    /// The operation as a borrowed [`BatchOpRef`].
    pub fn as_ref(&self) -> BatchOpRef<'_> {
        match self {
            BatchOp::Put { bucket, key, value } => BatchOpRef::Put { bucket, key, value },
            BatchOp::Delete { bucket, key } => BatchOpRef::Delete { bucket, key },
            BatchOp::DeleteRange { bucket, start, end } => BatchOpRef::DeleteRange {
                bucket,
                start,
                end: end.as_deref(),
            },
        }
    }
}

/// The changes of one atomic batch, kept in the caller's own buffers and handed to the
/// backend one by one: [`Backend::commit_from`] commits them without first copying them into
/// a [`WriteBatch`]. A `WriteBatch` is a `BatchSource` too.
pub trait BatchSource {
    /// Passes every operation, in the order they apply, to `sink`; stops at the first error
    /// `sink` returns and returns it. Each call passes the same operations.
    fn for_each_op(
        &self,
        sink: &mut dyn FnMut(BatchOpRef<'_>) -> Result<(), BackendError>,
    ) -> Result<(), BackendError>;

    /// Number of operations `for_each_op` passes.
    fn op_count(&self) -> usize;
}

impl BatchSource for WriteBatch {
    fn for_each_op(
        &self,
        sink: &mut dyn FnMut(BatchOpRef<'_>) -> Result<(), BackendError>,
    ) -> Result<(), BackendError> {
        self.ops.iter().try_for_each(|op| sink(op.as_ref()))
    }

    fn op_count(&self) -> usize {
        self.ops.len()
    }
}

/// An ordered list of changes that a backend applies atomically.
///
/// Operations apply in order: a put after a delete of the same key leaves the key present.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WriteBatch {
    ops: Vec<BatchOp>,
    payload_bytes: usize,
}

impl WriteBatch {
    /// An empty batch.
    pub fn new() -> WriteBatch {
        WriteBatch::default()
    }

    /// An empty batch with room for `ops` operations.
    pub fn with_capacity(ops: usize) -> WriteBatch {
        WriteBatch {
            ops: Vec::with_capacity(ops),
            payload_bytes: 0,
        }
    }

    /// Appends a copy of `op`.
    pub fn push_ref(&mut self, op: BatchOpRef<'_>) {
        match op {
            BatchOpRef::Put { bucket, key, value } => self.put(bucket, key, value),
            BatchOpRef::Delete { bucket, key } => self.delete(bucket, key),
            BatchOpRef::DeleteRange { bucket, start, end } => {
                self.delete_range(bucket, start, end.map(<[u8]>::to_vec))
            }
        }
    }

    /// A copy of every operation of `source`.
    pub fn from_source(source: &dyn BatchSource) -> Result<WriteBatch, BackendError> {
        let mut batch = WriteBatch::with_capacity(source.op_count());
        source.for_each_op(&mut |op| {
            batch.push_ref(op);
            Ok(())
        })?;
        Ok(batch)
    }

    /// Sets `key` in `bucket` to `value`.
    pub fn put(&mut self, bucket: &Bucket, key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) {
        let (key, value) = (key.into(), value.into());
        self.payload_bytes += key.len() + value.len();
        self.ops.push(BatchOp::Put {
            bucket: bucket.clone(),
            key,
            value,
        });
    }

    /// Removes `key` from `bucket`.
    pub fn delete(&mut self, bucket: &Bucket, key: impl Into<Vec<u8>>) {
        let key = key.into();
        self.payload_bytes += key.len();
        self.ops.push(BatchOp::Delete {
            bucket: bucket.clone(),
            key,
        });
    }

    /// Removes every key of `bucket` in `[start, end)` (`end = None`: to the end).
    pub fn delete_range(
        &mut self,
        bucket: &Bucket,
        start: impl Into<Vec<u8>>,
        end: Option<Vec<u8>>,
    ) {
        let start = start.into();
        self.payload_bytes += start.len() + end.as_ref().map_or(0, Vec::len);
        self.ops.push(BatchOp::DeleteRange {
            bucket: bucket.clone(),
            start,
            end,
        });
    }

    /// The operations, in the order they apply.
    pub fn ops(&self) -> &[BatchOp] {
        &self.ops
    }

    /// Number of operations.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// True when the batch holds no operation.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Sum of key and value lengths in the batch.
    pub fn payload_bytes(&self) -> usize {
        self.payload_bytes
    }

    /// Removes every operation, keeping the allocation.
    pub fn clear(&mut self) {
        self.ops.clear();
        self.payload_bytes = 0;
    }
}

/// Space used by a backend.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendSize {
    /// Bytes the backend's files take on disk.
    pub on_disk: u64,
    /// Bytes holding live data; `on_disk - in_use` is what [`Backend::defragment`] can give back.
    pub in_use: u64,
}

/// A consistent, read-only view of a backend as of one commit.
///
/// The view is fixed when the transaction opens: later commits are invisible to it. It may be
/// sent to and used on any thread. Slices it returns borrow from it and stay valid and
/// unchanged for as long as it lives.
pub trait ReadTxn: Send {
    /// Iterator over `(key, value)` pairs in ascending key order.
    type Range<'a>: Iterator<Item = Result<(&'a [u8], &'a [u8]), BackendError>>
    where
        Self: 'a;

    /// The value of `key` in `bucket`, if any.
    fn get(&self, bucket: &Bucket, key: &[u8]) -> Result<Option<&[u8]>, BackendError>;

    /// The pairs of `bucket` with `start <= key < end` (`end = None`: no upper bound), in
    /// ascending key order.
    fn range<'a>(
        &'a self,
        bucket: &Bucket,
        start: &[u8],
        end: Option<&[u8]>,
    ) -> Result<Self::Range<'a>, BackendError>;

    /// Every bucket that holds at least one key, in ascending name order.
    fn buckets(&self) -> Result<Vec<Bucket>, BackendError>;
}

/// A durable, ordered, bucketed key-value store that the MVCC store runs on.
///
/// Implementations are shared between threads (`&self` everywhere). An error from
/// [`commit`](Backend::commit) leaves readers with the store as of the previous successful
/// commit, but the batch may be durable all the same: a backend may report a commit whose
/// batch was written and synced yet could not be published (as keel-backend-file's
/// `UnpublishedCommit`), which a reopen finds. An I/O error during a commit's durability point
/// (a failed `fsync`), or such an unpublished batch, **poisons** the backend: every later
/// commit fails with [`BackendError::Poisoned`], and reads of committed data still work.
/// keel-mvcc poisons its own store on any commit error.
pub trait Backend: Send + Sync + Sized + 'static {
    /// Options for [`open`](Backend::open); `Default` gives the documented defaults.
    type Options: Clone + Default + fmt::Debug + Send + Sync + 'static;
    /// The snapshot read transaction type.
    type ReadTxn: ReadTxn + 'static;

    /// Opens (creating if absent) the backend stored at `path`.
    ///
    /// The backend takes an exclusive lock: a second open of the same `path`, from this or
    /// another process, fails with [`BackendError::Locked`] until the first is dropped.
    fn open(path: &Path, options: &Self::Options) -> Result<Self, BackendError>;

    /// Opens a snapshot read transaction on the last successful commit.
    fn read_txn(&self) -> Result<Self::ReadTxn, BackendError>;

    /// Applies `batch` atomically and durably.
    ///
    /// On `Ok` the whole batch is visible to every read transaction opened afterwards and
    /// survives a crash. On `Err` none of it is visible, now or after a restart.
    fn commit(&self, batch: &WriteBatch) -> Result<(), BackendError>;

    /// Applies the operations of `source` atomically and durably, exactly as
    /// [`commit`](Backend::commit) applies a [`WriteBatch`] holding the same operations (same
    /// checks, same errors, nothing applied on error).
    ///
    /// The default copies them into a `WriteBatch` and commits that; a backend overrides it to
    /// write straight from the caller's buffers. The MVCC store commits through this method.
    fn commit_from(&self, source: &dyn BatchSource) -> Result<(), BackendError> {
        self.commit(&WriteBatch::from_source(source)?)
    }

    /// Bytes on disk and bytes in use.
    fn size(&self) -> Result<BackendSize, BackendError>;

    /// Rewrites the store compactly and gives unused space back to the file system.
    ///
    /// Read transactions opened before it keep their view. Writers may wait while it runs.
    fn defragment(&self) -> Result<(), BackendError>;

    /// Writes a consistent copy of the whole store to `out`, as of one commit, without
    /// stopping writers. Returns the number of bytes written.
    fn snapshot(&self, out: &mut dyn Write) -> Result<u64, BackendError> {
        let txn = self.read_txn()?;
        snapshot::write(&txn, out)
    }

    /// Loads a stream produced by [`snapshot`](Backend::snapshot) into this backend, which
    /// must be empty. Returns the number of pairs loaded.
    ///
    /// The stream is committed in several batches and its checksum is only known at its end:
    /// on error the backend holds a partial copy and must be discarded. Callers that need
    /// all-or-nothing restore into a fresh directory and rename it into place on success.
    fn restore(&self, input: &mut dyn Read) -> Result<u64, BackendError> {
        snapshot::restore(self, input)
    }

    /// [`restore`](Backend::restore), showing every pair of the stream to `observe`
    /// (bucket, key, value), so that a caller can build what it derives from the data (the
    /// store's key index, say) without reading the whole copy back afterwards.
    ///
    /// Each pair is shown exactly once, buckets in ascending name order and keys ascending
    /// within a bucket, before this returns `Ok`. Pairs of a stream that later fails may have
    /// been shown: on error, discard what was built from them with the backend.
    ///
    /// The default restores with [`restore`](Backend::restore) and then reads every pair
    /// back; backends that load the stream themselves show the pairs as they load them.
    fn restore_observed(
        &self,
        input: &mut dyn Read,
        observe: &mut PairObserver<'_>,
    ) -> Result<u64, BackendError> {
        let pairs = self.restore(input)?;
        let txn = self.read_txn()?;
        for bucket in txn.buckets()? {
            for item in txn.range(&bucket, &[], None)? {
                let (key, value) = item?;
                observe(&bucket, key, value);
            }
        }
        Ok(pairs)
    }

    /// [`restore_observed`](Backend::restore_observed) from a stream handed over as chunks
    /// ([`ChunkSource`]), with the same checks, the same guarantees and the same outcome for
    /// the same bytes, however they are cut: a stream that fails its checksum or its framing
    /// is refused before its last batch is loaded.
    ///
    /// The default reads the chunks as one byte stream ([`snapshot::ChunkRead`], a copy of
    /// every byte); a backend that parses the stream itself overrides it to parse inside the
    /// chunks ([`snapshot::restore_chunks_batched`]) and hand each back once loaded.
    fn restore_chunks(
        &self,
        chunks: &mut dyn ChunkSource,
        observe: &mut PairObserver<'_>,
    ) -> Result<u64, BackendError> {
        self.restore_observed(&mut snapshot::ChunkRead::new(chunks), observe)
    }
}

/// A snapshot stream handed over as chunks of bytes, by value, in order (the chunks of a
/// network transfer, say): the stream is their bytes end to end, cut anywhere. See
/// [`Backend::restore_chunks`].
pub trait ChunkSource {
    /// The next chunk; `None` once the stream has ended (or was abandoned: a restore that
    /// has not seen the stream's end frame by then fails as a stream that ends early).
    fn next_chunk(&mut self) -> Option<Vec<u8>>;

    /// Takes back a chunk the restore is done with, for the source to reuse its buffer.
    /// The default drops it.
    fn recycle(&mut self, chunk: Vec<u8>) {
        drop(chunk);
    }
}

/// Shown each pair a restore loads: bucket, key, value (see [`Backend::restore_observed`]).
pub type PairObserver<'a> = dyn FnMut(&Bucket, &[u8], &[u8]) + 'a;

/// Errors from a [`Backend`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// An operating-system I/O call failed.
    #[error("backend I/O error on {path}: {op} failed: {source}")]
    Io {
        /// File or directory involved.
        path: PathBuf,
        /// What was being done ("open", "fdatasync", "pwrite", ...).
        op: &'static str,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// An earlier durability failure; the backend refuses writes until it is reopened.
    #[error("backend is poisoned by an earlier write failure ({reason}); reopen it to recover")]
    Poisoned {
        /// The original failure.
        reason: String,
    },
    /// Another handle (in this or another process) holds the store open.
    #[error("backend at {path} is locked by another open handle")]
    Locked {
        /// The store's path.
        path: PathBuf,
    },
    /// The on-disk data is not a valid store.
    #[error("backend file {path} is corrupt at offset {offset}: {reason}")]
    Corrupt {
        /// Damaged file.
        path: PathBuf,
        /// Byte offset of the damage.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// The store was written by a format version this build does not read.
    #[error("backend file {path} has format version {found}; this build reads version {supported}")]
    UnsupportedVersion {
        /// The file.
        path: PathBuf,
        /// Version found on disk.
        found: u32,
        /// Version this build reads.
        supported: u32,
    },
    /// The store has reached its configured maximum size.
    #[error("backend is full: {used} of {limit} bytes in use; raise the size limit and reopen")]
    Full {
        /// Bytes in use.
        used: u64,
        /// Configured limit.
        limit: u64,
    },
    /// A bucket name breaks the naming rule.
    #[error("invalid bucket name {name:?}: use 1 to 64 ASCII letters, digits, '_' or '-'")]
    InvalidBucket {
        /// The offending name.
        name: String,
    },
    /// A key or value is larger than the backend accepts.
    #[error("{what} of {len} bytes exceeds the backend limit of {limit} bytes")]
    TooLarge {
        /// "key" or "value".
        what: &'static str,
        /// Its length.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// Options failed validation.
    #[error("invalid backend option: {0}")]
    InvalidOption(String),
    /// A snapshot stream is malformed, truncated or fails its checksum.
    #[error("invalid snapshot stream at byte {offset}: {reason}")]
    Snapshot {
        /// Stream offset of the problem.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// [`Backend::restore`] was called on a backend that already holds data.
    #[error("restore target is not empty")]
    RestoreNotEmpty,
    /// A backend-specific failure with no better variant.
    #[error("backend error: {0}")]
    Other(#[source] Box<dyn std::error::Error + Send + Sync + 'static>),
}

impl BackendError {
    /// Builds an [`BackendError::Io`].
    pub fn io(path: impl Into<PathBuf>, op: &'static str, source: io::Error) -> BackendError {
        BackendError::Io {
            path: path.into(),
            op,
            source,
        }
    }
}
