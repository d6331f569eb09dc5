//! keel's pure-Rust, memory-mapped, crash-safe, log-structured backend for keel-mvcc.
//!
//! The store is a directory of append-only segment files (byte layout in [`format`](mod@format)). Each
//! commit appends one checksummed frame holding the whole batch and syncs it once: that frame
//! is the commit point, so a batch is either wholly in the store after a crash or not at all.
//! An in-memory index per bucket, a copy-on-write B+tree, maps keys to the place of their value
//! in a segment; open rebuilds it by replaying the segments and cuts off a torn last frame
//! (but refuses to open over damage to a frame that was durable: each frame records the
//! highest sequence number durable when it was written, which tells the two apart).
//! Reads go through read-only shared mappings, one per segment made once at the segment size:
//! a read transaction ([`FileReadTxn`]) holds one immutable index version, which records the
//! committed end of every segment it reads, so it never waits for the writer and the writer
//! never waits for it. Writes only ever go past the committed end, which no reader reads.
//!
//! A commit costs one positioned write and one `fdatasync`: a background thread prepares
//! space ahead of the writer (allocated blocks, or zeros) and the next segment before the
//! active one fills, so the sync changes no file size and allocates nothing, and a new segment
//! is a rename. A restore from a snapshot stream writes its frames without syncing them and
//! syncs once at its end, behind a marker that keeps an unfinished restore from opening.
//!
//! Space comes back through the reclaimer: it copies the live records of the oldest segments
//! forward in small commits, then moves the floor in the META file and removes the old
//! segment files once no reader maps them. `defragment` does the same for every segment, so
//! the files shrink to the live data. Every write, sync and mapping goes through an I/O seam
//! ([`fault`]) where tests inject failures; a failed write or sync poisons the backend, and so
//! does a commit whose frame is durable but whose segment cannot be mapped to publish it
//! ([`UnpublishedCommit`]).

#![deny(unsafe_op_in_unsafe_fn)]

mod direct;
pub mod fault;
pub mod format;
mod index;
mod key;
mod options;
mod prepare;
mod reclaim;
mod recovery;
mod restore;
mod segment;
mod store;
mod txn;
mod verify;
mod version;

pub use fault::{FaultHook, FaultPlan, Strike, WriteFault};
pub use options::{FileOptions, PrepareWith};
pub use store::{FileBackend, LOCK_FILE, UnpublishedCommit};
pub use txn::{FileRange, FileReadTxn};
