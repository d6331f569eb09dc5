//! keel's LMDB backend: the [`keel_mvcc::Backend`] trait on LMDB through heed.
//!
//! LMDB gives us exactly what the trait asks for: a copy-on-write B+tree in one memory-mapped
//! file, single-writer transactions that are atomic and durable on commit, and MVCC read
//! transactions that see one commit for as long as they live without ever taking a lock the
//! writer needs. This crate adds what LMDB leaves to its user:
//!
//! - `keys`: buckets. Every bucket is an LMDB named database of its own (etcd's bbolt keeps
//!   one B+tree per bucket too), so keys appended in ascending order — the MVCC store's
//!   revisions — fill the pages at the end of their own tree instead of splitting pages
//!   shared with the next bucket's first keys. The writer opens the handles and publishes
//!   them once their commit returns; readers take the published handles before their
//!   transaction begins (see `env`).
//! - `env`: the directory, its exclusive lock, and the one `unsafe` LMDB open with its
//!   obligations written down. A store's data lives in a *generation* directory; defragment
//!   writes a compacted copy as the next generation and swaps it in while old readers keep
//!   the old one open.
//! - `backend`: [`LmdbBackend`], the writer (atomic batches written straight from the
//!   caller's buffers, a full map reported as
//!   [`BackendError::Full`](keel_mvcc::BackendError::Full), poisoning after a failed commit),
//!   sizes, defragmentation, [`LmdbBackend::grow_map`], and a restore that loads a snapshot
//!   stream into a new generation (appends, one `fdatasync`) and swaps it in whole.
//! - `txn`: [`LmdbReadTxn`], a `Send` snapshot that may outlive the backend handle, checked
//!   against the commit stamp when it opens.
//! - `options`: [`LmdbOptions`] and their defaults.
//! - `reference`: [`RawLmdb`], raw LMDB opened the way the backend opens it, the reference
//!   benchmarks measure keel against.
//!
//! On-disk layout of a store at `path`:
//!
//! ```text
//! path/LOCK                      exclusive lock (flock) held while any handle or reader lives
//! path/gen-<16 hex digits>/      the live LMDB environment (data.mdb, lock.mdb)
//! path/gen-<16 hex digits>.tmp/  a defragment copy or a restore being written; deleted on open
//! ```
//!
//! The highest-numbered complete generation is the store; a lower one is left only by a
//! crash right after a defragment swap and is deleted on open. Inside LMDB, bucket `b` is
//! the named database `b`, holding each key `k` as `0x00 | k` with its value as given; the
//! unnamed database holds the named databases' records and one reserved key,
//! `0x00 | "commit"`, the commit stamp: the LMDB transaction id of the last commit and of the
//! last commit that created a bucket (two `u64`, big-endian). Read transactions check it to
//! work around a race in LMDB's read-transaction start that can otherwise hand out a snapshot
//! newer than the one its id names, and to know their bucket handles cover their snapshot
//! (see `txn`).

mod backend;
mod env;
mod error;
mod keys;
mod options;
mod reference;
mod txn;

pub use backend::LmdbBackend;
pub use error::LmdbError;
pub use options::{LmdbOptions, MAP_SIZE_UNIT};
pub use reference::RawLmdb;
pub use txn::{LmdbRange, LmdbReadTxn};
