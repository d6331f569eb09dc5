//! keel's write-ahead log: the durable source of truth for a Raft log.
//!
//! A [`Wal`] is a directory of segment files holding a sequence of checksummed records:
//! Raft entries, hard states, snapshot markers and metadata. [`Wal::append`] writes entries
//! and a hard state as one durability point; concurrent durable appends share one
//! `fdatasync` (group commit). [`Wal::open`] reads every record back, checks it, rebuilds an
//! in-memory index (index → segment, offset, term) and repairs a torn tail, reading several
//! segments at a time ([`WalOptions::recovery_threads`]); reads go to the files by
//! positioned reads through that index.
//!
//! # Files
//!
//! - `<seq>-<first_index>.wal`: a segment, both fields 16 lowercase hex digits (so names
//!   sort by `seq`); `seq` counts from 0 without holes, `first_index` is `last_index + 1`
//!   when the segment was started. Default size 64 MiB, preallocated (zeroed). Released
//!   segments go lowest first, each rename or deletion durable before the next, so the
//!   segments on disk never have a hole, even after a crash: open takes one as damage.
//! - `<seq>.tmp`: the next segment being prepared in the background; renamed into place
//!   (then the directory synced) only once its header is durable.
//! - `<seq>.free`: a released segment's file kept for reuse
//!   ([`WalOptions::recycle_segments`]); it becomes a `.tmp` again with a new header and an
//!   end marker right after it, so its old records are never reached.
//! - `<name>.broken[.N]`: what a torn-tail repair changed in a segment, kept before it did:
//!   the segment's header and its bytes from the first bad record on, at their own offsets,
//!   the bytes before them left out (a hole reading as zeros); see `repair.rs`.
//! - `LOCK`: holds an exclusive `flock` while the log is open.
//!
//! # Segment layout (all integers little-endian)
//!
//! ```text
//! 0   8  magic b"KEELWAL\0"
//! 8   4  format version (u32) = 3 (2 is still read: no batch records)
//! 12  4  zero
//! 16  8  seq (u64)
//! 24  4  zero
//! 28  4  CRC-32 of bytes 0..28 (u32)
//! 32  .. records, each 8-byte aligned, then an end marker (8 zero bytes); after it zeros
//!        (a new file, and the rest of the page after a direct write) or leftovers of the
//!        file's earlier life (a recycled one)
//! ```
//!
//! # Record framing
//!
//! ```text
//! 0   4  crc  (u32): CRC-32 (IEEE, crc32fast) of bytes 4..8 and the unpadded payload,
//!                    seeded with the crc of the previous record
//! 4   4  word (u32): record type << 24 | payload length (< 16 MiB)
//! 8   n  payload
//! 8+n p  zero padding to a multiple of 8
//! ```
//!
//! The header is 8 bytes at an 8-byte aligned offset, so it never straddles a sector and a
//! length is never torn. Payloads (u64 LE fields):
//!
//! ```text
//! 1 seed        prev_crc (u32) | 4 zero bytes | first_index
//! 2 entry       index | term | data...
//! 3 hard state  term | vote | commit
//! 4 snapshot    index | term
//! 5 metadata    cluster_id | member_id
//! 6 batch       first_index | term | count (u32) | 4 zero bytes |
//!               count data lengths (u32 each) | the entries' data, back to back
//! ```
//!
//! A batch record (version 3 on) holds two or more entries of one term at consecutive
//! indices, up to 64 KiB of payload: an append frames each such run as one record, with one
//! header and one checksum pass, instead of one record per entry (entries of 2 KiB or more
//! written straight from their own buffers stay entry records). A batch whose checksum
//! holds but whose lengths do not add up to its payload, or one in a version-2 segment, is
//! a [`WalError::Corrupt`] naming the file and offset, never a torn write. A version-2 segment that is the last one
//! at open is appended to in its own format (entry records only); new segments are
//! version 3.
//!
//! Every segment's records start with a seed record, whose own crc is seeded with the
//! segment header's crc (bytes 28..32, which cover the sequence number) and whose payload
//! carries the crc of the previous segment's last record (so the chain runs across
//! segments, and a segment can still be verified on its own), followed by the metadata,
//! snapshot marker and hard state in force when the segment was started (so deleting older
//! segments never loses state). A header of zeros ends a segment's records: every write of
//! records carries one after them (the next write overwrites it). Records a recycled file
//! held in its earlier life sit behind that marker, and since they chain from another
//! header's crc, they fail their checksum if a torn write ever exposes one: open then
//! treats it as a torn tail, never as data.
//!
//! # Recovery
//!
//! Open checks every header and record. A bad record in the last segment is a torn write:
//! the segment's bytes from that record on are kept in a `.broken` copy (made durable
//! first), then zeroed, and the log continues from the last whole record; a last segment
//! whose header is bad is renamed to `.broken` whole ([`WalOptions::strict`] refuses
//! instead). If the copy cannot be made (a full disk, say), open fails and changes nothing.
//! Damage anywhere else, a broken chain, an index gap, a missing segment or an
//! unknown version is a [`WalError`] naming the file and offset. Lengths are bounded by the
//! bytes left in the file before anything is read or allocated.
//!
//! # Faults
//!
//! All file operations go through [`FileSystem`] ([`RealFs`] by default). A failed write or
//! `fdatasync` poisons the log ([`WalError::Poisoned`]); running out of space while making a
//! segment is a [`WalError::DiskFull`] that leaves the log usable.

#![forbid(unsafe_code)]

mod decoder;
mod encoder;
mod error;
mod index;
mod io;
mod options;
mod pagebuf;
mod record;
mod recovery;
mod repair;
mod segment;
mod stats;
mod wal;

pub use error::WalError;
pub use io::{DIRECT_ALIGN, FileSystem, RealFile, RealFs, WalFile};
pub use options::WalOptions;
pub use record::{Entry, HardState, MAX_PAYLOAD, Metadata, SnapshotMarker};
pub use segment::{FORMAT_VERSION, OLDEST_VERSION, SEGMENT_HEADER_LEN};
pub use stats::WalStats;
pub use wal::{EntryRef, Wal};
