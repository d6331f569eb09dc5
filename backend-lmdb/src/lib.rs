//! keel's LMDB backend: the [`keel_mvcc::Backend`] trait on LMDB through heed.
//!
//! LMDB gives us exactly what the trait asks for: a copy-on-write B+tree in one memory-mapped
//! file, single-writer transactions that are atomic and durable on commit, and MVCC read
//! transactions that see one commit for as long as they live without ever taking a lock the
//! writer needs. This crate adds what LMDB leaves to its user:
//!
//! - `keys`: buckets. Every bucket lives in LMDB's one unnamed database, its keys prefixed
//!   with the bucket name and a zero byte. One database handle, opened once, serves every
//!   transaction, so read transactions never coordinate with the writer about handles.
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
//! crash right after a defragment swap and is deleted on open. The keys inside LMDB are
//! `bucket name | 0x00 | key`, values stored as given, plus one reserved key,
//! `0x00 | "commit"`, holding the LMDB transaction id of the last commit (`u64`, big-endian):
//! read transactions check it to work around a race in LMDB's read-transaction start that
//! can otherwise hand out a snapshot newer than the one its id names (see `txn`).

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
