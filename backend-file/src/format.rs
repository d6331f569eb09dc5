//! The on-disk format, byte by byte.
//!
//! A store is a directory. Every integer is little-endian; every checksum is CRC-32 (IEEE, as
//! computed by `crc32fast`).
//!
//! ```text
//! <dir>/LOCK                  empty; held with an exclusive advisory lock while open
//! <dir>/META                  the floor: segments below it are dead (32 bytes, below)
//! <dir>/META.tmp              a META being replaced; ignored and removed on open
//! <dir>/<id:016x>.seg         a segment: a header, frames appended and never rewritten, then
//!                             zeros (space prepared ahead of the next frame)
//! <dir>/<id:016x>.seg.tmp     a segment being prepared (header, zeros); not part of the
//!                             store until renamed to `<id:016x>.seg`; removed on open
//! <dir>/RESTORING             empty; present while a restore runs. A store holding it is
//!                             incomplete: open refuses it
//! ```
//!
//! ## META (32 bytes)
//!
//! ```text
//! 0   magic    8   "KEELMETA"
//! 8   version  u32 (= 2, `META_VERSION`)
//! 12  flags    u32 (= 0)
//! 16  floor    u64  lowest live segment id; segment files with a smaller id are dead
//! 24  crc      u32  over bytes 0..24
//! 28  zero     u32
//! ```
//!
//! META is replaced atomically: written to `META.tmp`, synced, renamed over `META`, and the
//! directory synced. It changes only after the live records of every segment below the new
//! floor have been copied into later segments by durable commits, so both the old and the new
//! floor describe the same data.
//!
//! ## Segment header (32 bytes)
//!
//! ```text
//! 0   magic    8   "KEELSEG\0"
//! 8   version  u32 (= 3, `VERSION`; 2, `OLDEST_VERSION`, is still read)
//! 12  flags    u32 (= 0)
//! 16  id       u64  equal to the id in the file name
//! 24  crc      u32  over bytes 0..24
//! 28  zero     u32
//! ```
//!
//! The version says how the segment's frames are laid out (below). New segments are written
//! in version 3. A version-2 segment is read as it is; when the last segment of a store is
//! one, open syncs it, leaves it sealed as it is and starts the next segment in version 3,
//! so no segment ever holds frames of both versions.
//!
//! A segment's header is synced, and the directory after its creation (or after the rename
//! of its `.seg.tmp`), before any frame is written to it. Segments are replayed in ascending
//! id order.
//!
//! After its last frame a segment holds zeros up to the end of its file: space written ahead
//! of the writer, so that a commit overwrites blocks that already exist and its `fdatasync`
//! flushes no file-system metadata. Every frame of a segment is durable before the next
//! segment's file exists.
//!
//! ## Frame: one committed batch
//!
//! In a version-3 segment (`FRAME_HEADER` = 24 bytes of header):
//!
//! ```text
//! 0   len      u32  payload bytes (frame = 24 + len bytes)
//! 4   crc      u32  over bytes 8..24+len (seq, durable and payload)
//! 8   seq      u64  commit sequence number: exactly one more than the previous frame's,
//!                   across segments
//! 16  durable  u64  the highest sequence number known durable (synced) when the frame was
//!                   written, always below seq: every frame up to it was on the disk. For a
//!                   commit that syncs its frame this is seq - 1; frames written without
//!                   a sync (a restore, which syncs once at its end) repeat the value from
//!                   before the first of them. Open syncs the last segment before anything
//!                   is written, so the first frame after an open records every frame
//!                   found there as durable
//! 24  payload  len bytes: a sequence of records
//! ```
//!
//! In a version-2 segment (`FRAME_HEADER_V2` = 16 bytes of header) there is no durable field:
//!
//! ```text
//! 0   len      u32  payload bytes (frame = 16 + len bytes)
//! 4   crc      u32  over bytes 8..16+len (seq and payload)
//! 8   seq      u64  as above
//! 16  payload  len bytes
//! ```
//!
//! A frame is the commit point: a batch is in the store exactly when its whole frame is
//! present with a matching checksum and sequence number. Sequence numbers start at 1, so a
//! frame header is never all zeros. A segment's log ends at the first place that does not
//! hold a whole frame with a matching checksum: if every byte from there to the end of the
//! file is zero, that is the segment's clean end. Otherwise, in any segment but the last, it
//! is corruption. In the last segment it is either a torn commit (a write that never finished
//! before a crash) or damage to a frame that was durable, and the durable field tells them
//! apart. Frames written without a sync may reach the disk in any order, so whole frames may
//! follow a torn one; but a frame is only written with a durable value of `d` once every frame
//! up to `d` was synced. So open, finding the bad place at offset `o` where the frame of
//! sequence `s` was expected, looks at every later offset of the segment, byte by byte (a
//! damaged length says nothing of where the next frame starts), for a whole frame with a
//! matching checksum, a sequence number above `s` and no further above it than frames could
//! fit in the bytes left, a durable value of `s` or more and below its sequence number (when
//! no frame came before `o`, `s` is taken as that frame's sequence minus one, the most the
//! bad frame's can be), a payload that reads as records (below), and after it a chain up to
//! the end of the file: frames of the same kind (matching checksum, records, durable value
//! below the sequence number), each with the sequence number after the one before, then only
//! zeros or nothing. If there is one, the frame at `o` had been durable: open fails with a
//! corruption error naming the file and `o`, and changes nothing. If there is none, it is a
//! torn commit and open truncates the file at `o`. The scan checksums (and looks through for
//! zeros after a chain) at most 4 times the bytes from `o` to the end of the file; should
//! that run out before it can tell, open fails with a corruption error naming the file and
//! `o`, and changes nothing. A version-2 last segment has no durable field: any bad place in
//! it counts as a torn commit, as before version 3.
//!
//! So damage to the very last frame of a store can never be told from a torn commit: no
//! frame after it records it durable, and open cuts it off. Any earlier frame is told apart
//! as soon as a frame written after its sync follows it, unless the frames after it end in a
//! torn commit (damage and a torn write together read as a torn commit). A frame's bytes are
//! not checked by the scan for where they lie, so a value can fool it: a value crafted to
//! hold such a chain (a header, records, the next headers, then zeros up to where the torn
//! write stopped) makes a torn commit that carries it read as damage, and open refuses the
//! store; a value holding many headers that pass the bounds above makes the scan run out,
//! with the same result. Open never cuts off a durable frame because of a value.
//!
//! A whole frame with a matching checksum but the wrong sequence number is corruption
//! anywhere (a torn write cannot produce one), and so is a version-3 frame whose durable
//! value is not below its sequence number, and a frame of sequence 2^64 - 1 (`u64::MAX`),
//! which no sequence could follow: it is never written, and a commit that would need it is
//! refused with a corruption error.
//!
//! ## Records (inside a payload)
//!
//! ```text
//! bucket  = 0x04 | id u32 | name_len u8 | name        declares bucket id -> name
//! put     = 0x01 | bucket u32 | klen u32 | vlen u32 | key | value
//! delete  = 0x02 | bucket u32 | klen u32 | key
//! range   = 0x03 | bucket u32 | slen u32 | elen u32 | start | end
//!                                           (elen = 0xFFFF_FFFF: no end, and no end bytes)
//! ```
//!
//! Records apply in order. The first frame of every segment declares every bucket known at
//! that moment, so a segment never depends on a dead one for a name; a later declaration of an
//! id must repeat the same name. A reader's value is the `vlen` bytes right after the key of
//! the live `put` record, read in place through the mapping.

use keel_mvcc::BackendError;
use std::ops::RangeInclusive;
use std::path::Path;

/// Segment format version written by this build (frames carry the durable field).
pub const VERSION: u32 = 3;
/// Oldest segment format version this build reads (frames without the durable field).
pub const OLDEST_VERSION: u32 = 2;
/// Version of the META file written and read by this build.
pub const META_VERSION: u32 = 2;
/// Magic of a segment file.
pub const SEGMENT_MAGIC: &[u8; 8] = b"KEELSEG\0";
/// Magic of the META file.
pub const META_MAGIC: &[u8; 8] = b"KEELMETA";
/// Bytes in a segment header and in META.
pub const HEADER_LEN: usize = 32;
/// Bytes in a frame header of a version-3 segment (the version written).
pub const FRAME_HEADER: usize = 24;
/// Bytes in a frame header of a version-2 segment.
pub const FRAME_HEADER_V2: usize = 16;
/// Bytes in a put record before its key.
pub const PUT_HEADER: usize = 13;

pub(crate) const TAG_PUT: u8 = 0x01;
pub(crate) const TAG_DELETE: u8 = 0x02;
pub(crate) const TAG_RANGE: u8 = 0x03;
pub(crate) const TAG_BUCKET: u8 = 0x04;
pub(crate) const NO_END: u32 = u32::MAX;

/// Encodes a 32-byte header (segment or META) with `magic`, `version` and `value` (id or
/// floor).
pub(crate) fn encode_header(magic: &[u8; 8], version: u32, value: u64) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..8].copy_from_slice(magic);
    h[8..12].copy_from_slice(&version.to_le_bytes());
    h[16..24].copy_from_slice(&value.to_le_bytes());
    let crc = crc32fast::hash(&h[..24]);
    h[24..28].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Decodes a 32-byte header whose version must lie in `versions`, returning its value (id or
/// floor) and its version. A version outside them is an
/// [`UnsupportedVersion`](BackendError::UnsupportedVersion) error naming the nearest one this
/// build reads.
pub(crate) fn decode_header(
    path: &Path,
    bytes: &[u8],
    magic: &[u8; 8],
    what: &str,
    versions: RangeInclusive<u32>,
) -> Result<(u64, u32), BackendError> {
    let corrupt = |offset: u64, reason: String| BackendError::Corrupt {
        path: path.to_path_buf(),
        offset,
        reason,
    };
    if bytes.len() < HEADER_LEN {
        return Err(corrupt(
            0,
            format!(
                "{what} is {} bytes long, shorter than its {HEADER_LEN}-byte header",
                bytes.len()
            ),
        ));
    }
    if &bytes[..8] != magic {
        return Err(corrupt(0, format!("not a keel {what} (bad magic)")));
    }
    let version = u32_at(bytes, 8);
    if !versions.contains(&version) {
        // The error names one version: the nearest this build reads (the oldest for an older
        // file, the newest for a newer one); the log names them all.
        let (oldest, newest) = (*versions.start(), *versions.end());
        tracing::warn!(
            path = %path.display(),
            found = version,
            oldest,
            newest,
            "{what} has a format version this build does not read"
        );
        return Err(BackendError::UnsupportedVersion {
            path: path.to_path_buf(),
            found: version,
            supported: if version < oldest { oldest } else { newest },
        });
    }
    let crc = u32_at(bytes, 24);
    if crc != crc32fast::hash(&bytes[..24]) {
        return Err(corrupt(24, format!("{what} header checksum mismatch")));
    }
    if u32_at(bytes, 12) != 0 || u32_at(bytes, 28) != 0 {
        return Err(corrupt(12, format!("{what} header has unknown flags")));
    }
    Ok((u64_at(bytes, 16), version))
}

/// Decodes a segment header: the segment's id and its format version.
pub(crate) fn decode_segment_header(path: &Path, bytes: &[u8]) -> Result<(u64, u32), BackendError> {
    decode_header(
        path,
        bytes,
        SEGMENT_MAGIC,
        "segment file",
        OLDEST_VERSION..=VERSION,
    )
}

/// Bytes in a frame header of a segment of format `version`.
pub(crate) fn frame_header_len(version: u32) -> usize {
    if version >= 3 {
        FRAME_HEADER
    } else {
        FRAME_HEADER_V2
    }
}

/// A whole frame with a matching checksum.
pub(crate) struct FrameRef<'a> {
    /// Its sequence number.
    pub(crate) seq: u64,
    /// Its durable field (`None` in a version-2 segment).
    pub(crate) durable: Option<u64>,
    /// Offset of its payload from the frame's start.
    pub(crate) header: usize,
    /// Its payload.
    pub(crate) payload: &'a [u8],
}

impl FrameRef<'_> {
    /// Bytes the whole frame takes.
    pub(crate) fn len(&self) -> usize {
        self.header + self.payload.len()
    }
}

/// Reads the frame at the start of `rest`, in a segment whose frame headers are `header`
/// bytes long; `Err` with a reason when `rest` does not start with a whole frame whose
/// checksum matches. Lengths are checked against `rest` before anything is sliced.
pub(crate) fn read_frame(rest: &[u8], header: usize) -> Result<FrameRef<'_>, String> {
    if rest.len() < header {
        return Err("incomplete frame header".to_string());
    }
    let len = u32_at(rest, 0) as usize;
    if len > rest.len() - header {
        return Err(format!(
            "frame of {len} bytes runs past the end of the file"
        ));
    }
    if frame_crc(&rest[8..header + len]) != u32_at(rest, 4) {
        return Err("frame checksum mismatch".to_string());
    }
    Ok(FrameRef {
        seq: u64_at(rest, 8),
        durable: (header >= FRAME_HEADER).then(|| u64_at(rest, 16)),
        header,
        payload: &rest[header..header + len],
    })
}

/// Reads a little-endian u32 at `at`; the caller has checked the bounds.
pub(crate) fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(x)
}

/// Reads a little-endian u64 at `at`; the caller has checked the bounds.
pub(crate) fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

/// Checksum of a frame: over everything after the checksum (seq, durable in version 3,
/// payload).
pub(crate) fn frame_crc(seq_and_payload: &[u8]) -> u32 {
    crc32fast::hash(seq_and_payload)
}

/// One decoded record, borrowing from the payload; offsets are relative to the payload start.
#[derive(Debug)]
pub(crate) enum Record<'a> {
    Bucket {
        id: u32,
        name: &'a [u8],
    },
    Put {
        bucket: u32,
        key: &'a [u8],
        /// Offset of the value within the payload.
        value_at: usize,
        value_len: u32,
    },
    Delete {
        bucket: u32,
        key: &'a [u8],
    },
    Range {
        bucket: u32,
        start: &'a [u8],
        end: Option<&'a [u8]>,
    },
}

/// Iterates over the records of one payload, with bounds checked against the payload.
pub(crate) struct Records<'a> {
    payload: &'a [u8],
    at: usize,
}

impl<'a> Records<'a> {
    pub(crate) fn new(payload: &'a [u8]) -> Records<'a> {
        Records { payload, at: 0 }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.payload.len())
            .ok_or_else(|| format!("record field of {n} bytes runs past the frame"))?;
        let s = &self.payload[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32_at(self.take(4)?, 0))
    }

    /// The next record and its offset in the payload, `None` at the end, `Err` with a reason
    /// when the payload is malformed.
    pub(crate) fn next_record(&mut self) -> Result<Option<(usize, Record<'a>)>, String> {
        if self.at == self.payload.len() {
            return Ok(None);
        }
        let start = self.at;
        let tag = self.take(1)?[0];
        let rec = match tag {
            TAG_BUCKET => {
                let id = self.u32()?;
                let len = self.take(1)?[0] as usize;
                Record::Bucket {
                    id,
                    name: self.take(len)?,
                }
            }
            TAG_PUT => {
                let bucket = self.u32()?;
                let klen = self.u32()? as usize;
                let vlen = self.u32()?;
                let key = self.take(klen)?;
                let value_at = self.at;
                self.take(vlen as usize)?;
                Record::Put {
                    bucket,
                    key,
                    value_at,
                    value_len: vlen,
                }
            }
            TAG_DELETE => {
                let bucket = self.u32()?;
                let klen = self.u32()? as usize;
                Record::Delete {
                    bucket,
                    key: self.take(klen)?,
                }
            }
            TAG_RANGE => {
                let bucket = self.u32()?;
                let slen = self.u32()? as usize;
                let elen = self.u32()?;
                let start = self.take(slen)?;
                let end = if elen == NO_END {
                    None
                } else {
                    Some(self.take(elen as usize)?)
                };
                Record::Range { bucket, start, end }
            }
            other => return Err(format!("unknown record tag {other:#04x}")),
        };
        Ok(Some((start, rec)))
    }
}

/// Appends a bucket declaration.
pub(crate) fn put_bucket(buf: &mut Vec<u8>, id: u32, name: &str) {
    buf.push(TAG_BUCKET);
    buf.extend_from_slice(&id.to_le_bytes());
    buf.push(name.len() as u8);
    buf.extend_from_slice(name.as_bytes());
}

/// Appends a put record; returns the offset of the value relative to the buffer start.
pub(crate) fn put_put(buf: &mut Vec<u8>, bucket: u32, key: &[u8], value: &[u8]) -> usize {
    buf.push(TAG_PUT);
    buf.extend_from_slice(&bucket.to_le_bytes());
    buf.extend_from_slice(&(key.len() as u32).to_le_bytes());
    buf.extend_from_slice(&(value.len() as u32).to_le_bytes());
    buf.extend_from_slice(key);
    let at = buf.len();
    buf.extend_from_slice(value);
    at
}

/// Appends a delete record.
pub(crate) fn put_delete(buf: &mut Vec<u8>, bucket: u32, key: &[u8]) {
    buf.push(TAG_DELETE);
    buf.extend_from_slice(&bucket.to_le_bytes());
    buf.extend_from_slice(&(key.len() as u32).to_le_bytes());
    buf.extend_from_slice(key);
}

/// Appends a delete-range record.
pub(crate) fn put_range(buf: &mut Vec<u8>, bucket: u32, start: &[u8], end: Option<&[u8]>) {
    buf.push(TAG_RANGE);
    buf.extend_from_slice(&bucket.to_le_bytes());
    buf.extend_from_slice(&(start.len() as u32).to_le_bytes());
    buf.extend_from_slice(&end.map_or(NO_END, |e| e.len() as u32).to_le_bytes());
    buf.extend_from_slice(start);
    if let Some(e) = end {
        buf.extend_from_slice(e);
    }
}

/// Bytes a put record of these lengths takes.
pub(crate) fn put_len(klen: usize, vlen: usize) -> u64 {
    (PUT_HEADER + klen + vlen) as u64
}
