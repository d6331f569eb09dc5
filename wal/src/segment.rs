//! Segment files: naming, the header, and preparing the next segment ahead of time.
//!
//! A segment is named `<seq>-<first_index>.wal`, both 16 lowercase hex digits, so names sort
//! by sequence number and parse back (etcd's scheme). `seq` starts at 0 and grows by one per
//! segment with no holes; `first_index` is the index the first entry written to it was
//! expected to have (`last_index + 1` when it was started).
//!
//! A segment starts with a 32-byte header:
//!
//! ```text
//! offset  size  field
//! 0       8     magic    b"KEELWAL\0"
//! 8       4     version  u32 LE, currently 3 (version 2, without batch records, is still
//!                        read; a last segment left in version 2 is appended to in it)
//! 12      4     zero
//! 16      8     seq      u64 LE, equal to the sequence number in the name
//! 24      4     zero
//! 28      4     crc      u32 LE: CRC-32 of bytes 0..28
//! ```
//!
//! Records follow from byte 32, starting with a seed record (see [`crate::record`]) that
//! carries the crc of the previous segment's last record and the segment's first index, then
//! the state records (metadata, snapshot marker, hard state) in force when the segment was
//! started, so releasing older segments never loses state.
//!
//! A segment is prepared as `<seq>.tmp`: created, its header written, its whole length zeroed
//! (1 MiB at a time, each piece synced before the next, so the zeroing never queues more than
//! that on the disk ahead of other writers' syncs) or reserved with `fallocate`, synced; only then renamed to its final name (and the
//! directory synced) when the log rotates into it. A released segment's file can be
//! recycled instead (kept as `<old seq>.free`, renamed to `<seq>.tmp`, its header rewritten
//! with an end marker after it): its blocks are already written, so `fdatasync` after
//! appending to it has no allocation or extent conversion to journal and nothing needs
//! zeroing. Its old records stay behind the end marker, and the crc chain starts from the
//! header's crc, so they can never verify as records of the new segment.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::io::{FileSystem, WalFile, write_all_at};

/// A segment of the log, open.
#[derive(Debug)]
pub(crate) struct SegInfo {
    /// Its path.
    pub(crate) path: PathBuf,
    /// Its file.
    pub(crate) file: Arc<dyn WalFile>,
}

/// Size of the segment header.
pub const SEGMENT_HEADER_LEN: u64 = 32;
/// The format version this build writes (it reads this one and [`OLDEST_VERSION`] on).
/// Version 3 added the batch record; version 2 segments never hold one.
pub const FORMAT_VERSION: u32 = 3;
/// The oldest format version this build reads.
pub const OLDEST_VERSION: u32 = 2;
/// The first version whose segments may hold batch records.
pub(crate) const BATCH_VERSION: u32 = 3;
const MAGIC: &[u8; 8] = b"KEELWAL\0";

/// Final file name of a segment.
pub(crate) fn segment_name(seq: u64, first_index: u64) -> String {
    format!("{seq:016x}-{first_index:016x}.wal")
}

/// Name of a segment being prepared.
pub(crate) fn tmp_name(seq: u64) -> String {
    format!("{seq:016x}.tmp")
}

/// Parses `<seq>-<first_index>.wal`.
pub(crate) fn parse_segment_name(name: &str) -> Option<(u64, u64)> {
    let stem = name.strip_suffix(".wal")?;
    let (a, b) = stem.split_once('-')?;
    if a.len() != 16 || b.len() != 16 {
        return None;
    }
    Some((
        u64::from_str_radix(a, 16).ok()?,
        u64::from_str_radix(b, 16).ok()?,
    ))
}

/// Where the crc chain of segment `seq` of format `version` starts: the crc of its header,
/// which its seed record's crc is seeded with.
pub(crate) fn chain_seed(seq: u64, version: u32) -> u32 {
    crate::record::u32_at(&encode_header_version(seq, version), 28)
}

/// Name a released segment file waits under until it is recycled.
pub(crate) fn free_name(seq: u64) -> String {
    format!("{seq:016x}.free")
}

/// Parses `<seq>.free`.
pub(crate) fn parse_free_name(name: &str) -> Option<u64> {
    let stem = name.strip_suffix(".free")?;
    if stem.len() != 16 {
        return None;
    }
    u64::from_str_radix(stem, 16).ok()
}

/// Encodes the header of segment `seq`.
pub(crate) fn encode_header(seq: u64) -> [u8; SEGMENT_HEADER_LEN as usize] {
    encode_header_version(seq, FORMAT_VERSION)
}

/// Encodes the header of segment `seq` in format `version`.
pub(crate) fn encode_header_version(seq: u64, version: u32) -> [u8; SEGMENT_HEADER_LEN as usize] {
    let mut h = [0u8; SEGMENT_HEADER_LEN as usize];
    h[0..8].copy_from_slice(MAGIC);
    h[8..12].copy_from_slice(&version.to_le_bytes());
    h[16..24].copy_from_slice(&seq.to_le_bytes());
    let crc = crc32fast::hash(&h[0..28]);
    h[28..32].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Why a header was refused.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum HeaderError {
    /// Short, wrong magic or failed checksum: not a complete header.
    Damaged(String),
    /// Intact, but written by another format version.
    Version(u32),
}

/// Checks a header and returns its sequence number and format version.
pub(crate) fn decode_header(h: &[u8]) -> Result<(u64, u32), HeaderError> {
    if h.len() < SEGMENT_HEADER_LEN as usize {
        return Err(HeaderError::Damaged(format!(
            "segment header is {} bytes, expected {SEGMENT_HEADER_LEN}",
            h.len()
        )));
    }
    let stored = crate::record::u32_at(h, 28);
    if crc32fast::hash(&h[0..28]) != stored {
        return Err(HeaderError::Damaged(
            "segment header checksum mismatch".into(),
        ));
    }
    if &h[0..8] != MAGIC {
        return Err(HeaderError::Damaged(
            "not a keel WAL segment (bad magic)".into(),
        ));
    }
    let version = crate::record::u32_at(h, 8);
    if !(OLDEST_VERSION..=FORMAT_VERSION).contains(&version) {
        return Err(HeaderError::Version(version));
    }
    Ok((crate::record::u64_at(h, 16), version))
}

/// A segment file prepared as `<seq>.tmp`, header durable, not yet part of the log.
#[derive(Debug)]
pub(crate) struct Prepared {
    pub seq: u64,
    pub path: PathBuf,
    pub file: Arc<dyn WalFile>,
    /// Made from a released segment's file rather than a new one.
    pub recycled: bool,
}

/// A released segment's file kept for reuse, as `<old seq>.free`.
#[derive(Debug)]
pub(crate) struct Free {
    pub path: PathBuf,
    pub file: Arc<dyn WalFile>,
}

/// How appends will write a prepared segment, which decides what its preparation leaves in
/// the page cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Writes {
    /// Through the page cache, in pieces that do not cover whole pages: a recycled file's
    /// old pages are read in ahead, in the background, rather than one at a time inside the
    /// writes that first touch them.
    Cached,
    /// Direct, in whole pages: the file's cached pages are dropped. Reading a recycled file's
    /// old contents in would cost a segment's worth of disk reads for nothing, and each
    /// direct write would have to drop the cached pages it covers on its own.
    Direct,
}

impl Writes {
    /// Applies the choice to `file`'s first `len` bytes. A hint: errors are harmless.
    fn prime(self, file: &dyn WalFile, len: u64) {
        let _ = match self {
            Writes::Cached => file.will_need(0, len),
            Writes::Direct => file.dont_need(0, len),
        };
    }
}

/// Turns a released segment's file into `<seq>.tmp`: renamed, then its header rewritten
/// together with an end marker right after it (so its old records are never reached), and
/// synced. Its blocks are already written, so appends to it are pure overwrites.
pub(crate) fn recycle(
    fs: &dyn FileSystem,
    dir: &Path,
    free: Free,
    seq: u64,
    writes: Writes,
) -> io::Result<Prepared> {
    let path = dir.join(tmp_name(seq));
    fs.rename(&free.path, &path)?;
    let mut start = [0u8; SEGMENT_HEADER_LEN as usize + 8];
    start[..SEGMENT_HEADER_LEN as usize].copy_from_slice(&encode_header(seq));
    let result = write_all_at(&*free.file, &start, 0).and_then(|()| free.file.sync_data());
    if let Err(e) = result {
        let _ = fs.remove(&path);
        return Err(e);
    }
    if let Ok(len) = free.file.len() {
        writes.prime(&*free.file, len);
    }
    Ok(Prepared {
        seq,
        path,
        file: free.file,
        recycled: true,
    })
}

/// Creates `<seq>.tmp` of `size` bytes with its header, zeroed or reserved, and synced.
pub(crate) fn prepare(
    fs: &dyn FileSystem,
    dir: &Path,
    seq: u64,
    size: u64,
    zero_fill: bool,
    writes: Writes,
    cancel: &AtomicBool,
) -> io::Result<Prepared> {
    let path = dir.join(tmp_name(seq));
    match fs.remove(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let file = fs.create(&path)?;
    let result = (|| {
        file.allocate(0, size)?;
        write_all_at(&*file, &encode_header(seq), 0)?;
        if zero_fill {
            let zeros = vec![0u8; 1 << 20];
            let mut off = SEGMENT_HEADER_LEN;
            while off < size {
                if cancel.load(Ordering::Relaxed) {
                    return Err(io::Error::new(
                        io::ErrorKind::Interrupted,
                        "preparation cancelled",
                    ));
                }
                let n = (size - off).min(zeros.len() as u64) as usize;
                write_all_at(&*file, &zeros[..n], off)?;
                // Flushed a piece at a time: written all at once, tens of MiB of zeros would
                // sit in the device queue ahead of every other writer's fdatasync on the disk
                // (this log's own appends, or another log's).
                file.sync_data()?;
                off += n as u64;
            }
        } else if file.len()? < size {
            file.set_len(size)?;
        }
        file.sync_all()?;
        if zero_fill && writes == Writes::Direct {
            // The zeros are written and synced: their cached pages are clean, and of no use.
            writes.prime(&*file, size);
        }
        Ok(())
    })();
    if let Err(e) = result {
        // Best effort: a half-made tmp file is removed again at the next open anyway.
        let _ = fs.remove(&path);
        return Err(e);
    }
    Ok(Prepared {
        seq,
        path,
        file,
        recycled: false,
    })
}

/// Renames a prepared segment into place and syncs the directory; returns its final path.
pub(crate) fn activate(
    fs: &dyn FileSystem,
    dir: &Path,
    prepared: &Prepared,
    first_index: u64,
) -> io::Result<PathBuf> {
    let to = dir.join(segment_name(prepared.seq, first_index));
    fs.rename(&prepared.path, &to)?;
    fs.sync_dir(dir)?;
    Ok(to)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_sort() {
        let a = segment_name(1, 0xabc);
        let b = segment_name(16, 2);
        assert_eq!(parse_segment_name(&a), Some((1, 0xabc)));
        assert_eq!(parse_segment_name(&b), Some((16, 2)));
        assert!(a < b);
        assert_eq!(parse_segment_name("0000000000000001.tmp"), None);
        assert_eq!(parse_segment_name("zz-00.wal"), None);
    }

    #[test]
    fn header_round_trip_and_damage() {
        let h = encode_header(7);
        assert_eq!(decode_header(&h), Ok((7, FORMAT_VERSION)));
        let old = encode_header_version(7, OLDEST_VERSION);
        assert_eq!(decode_header(&old), Ok((7, OLDEST_VERSION)));
        for i in 0..h.len() {
            let mut d = h;
            d[i] ^= 0x10;
            assert!(decode_header(&d).is_err(), "flip at {i} accepted");
        }
        let mut v = h;
        v[8..12].copy_from_slice(&9u32.to_le_bytes());
        let crc = crc32fast::hash(&v[0..28]);
        v[28..32].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(decode_header(&v), Err(HeaderError::Version(9)));
    }
}
