//! keel's revisioned (MVCC) key-value store: etcd's `mvcc` semantics over a pluggable
//! [`Backend`].
//!
//! Every change gets a [`Revision`]; changes are stored in the backend's `key` bucket keyed by
//! revision (see [`revision`] and the record format in `kv`), and an in-memory key index
//! (key → generations of revisions) rebuilt on open maps keys to them. On top, [`Store`]
//! offers etcd's operations — range, put, delete, transactions, compaction, the history hash
//! and watch — plus [`ReadView`]s (snapshot reads that never block writers) and
//! [`WriteTxn`]s (one atomic unit, one revision, with auxiliary bucket writes and the Raft
//! consistent index in the same backend batch).
//!
//! Writes are buffered in memory and committed to the backend in batches by a background
//! thread; reads see buffered writes. The write-ahead log above the store provides
//! durability: after a crash, reopen and re-apply entries after
//! [`Store::consistent_index`].
//!
//! Long reads and memory: a range copies its pairs into buffers allocated on the reading
//! thread, which the caller frees. Freeing a large result (a full scan of 100 000 values of
//! 1 KiB is 100 MB) lets glibc's allocator trim that thread's heap, and the next large result
//! is faulted back in page by page, which slows the process's other threads, writers
//! included, while it happens. The store's own write buffers recycle their chunks for that
//! reason; a process that serves large scans beside busy writers keeps the rest of that cost
//! away with an allocator that keeps what is freed (glibc with `M_TRIM_THRESHOLD` raised, or
//! jemalloc or mimalloc).

#![forbid(unsafe_code)]

pub mod backend;
mod compact;
mod error;
mod key_index;
mod kv;
mod options;
mod pace;
mod pending;
mod read;
mod rebuild;
mod request;
pub mod revision;
mod store;
mod txn;
mod watch;
mod write;

pub use backend::{
    Backend, BackendError, BackendSize, BatchOp, BatchOpRef, BatchSource, Bucket, ReadTxn,
    WriteBatch,
};
pub use error::MvccError;
pub use kv::{KeyValue, LeaseId};
pub use options::StoreOptions;
pub use pace::ReadPacing;
pub use read::ReadView;
pub use rebuild::{IndexBuilder, IndexThread};
pub use request::{
    Compare, CompareResult, CompareTarget, DeleteRangeRequest, DeleteResponse, HashKv,
    MAX_TXN_DEPTH, PutRequest, PutResponse, RangeRequest, RangeResponse, TxnOp, TxnOpResponse,
    TxnRequest, TxnResponse, prefix_end,
};
pub use revision::Revision;
pub use store::{AuxPairs, KEY_BUCKET, META_BUCKET, STORE_FORMAT, Store};
pub use watch::{
    Event, EventKind, Events, EventsIter, StreamItem, WatchRequest, WatchStream, Watcher,
};
pub use write::WriteTxn;

#[cfg(feature = "testing")]
pub mod testing;

/// A xorshift64 generator from `seed` (not zero): the deterministic random numbers of the
/// unit tests.
#[cfg(test)]
pub(crate) fn xorshift(mut seed: u64) -> impl FnMut() -> u64 {
    move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    }
}
