//! Records: what the log stores, and how one record is framed and checksummed.
//!
//! A record is an 8-byte header followed by its payload, zero-padded to a multiple of 8:
//!
//! ```text
//! offset  size  field
//! 0       4     crc     u32 LE: CRC-32 (crc32fast, IEEE) of bytes 4..8 and the unpadded
//!                       payload, seeded with the crc of the previous record (chained)
//! 4       4     word    u32 LE: type << 24 | payload length (length < 16 MiB)
//! 8       len   payload
//! 8+len   pad   zeros up to the next multiple of 8
//! ```
//!
//! Payloads (all integers u64 LE unless said otherwise):
//!
//! | type | name       | payload                                             |
//! |------|------------|-----------------------------------------------------|
//! | 1    | seed       | prev_crc u32 LE, 4 zero bytes, first_index          |
//! | 2    | entry      | index, term, data (the rest of the payload)         |
//! | 3    | hard state | term, vote, commit                                  |
//! | 4    | snapshot   | index, term                                         |
//! | 5    | metadata   | cluster_id, member_id                               |
//!
//! Type 0 does not exist: a header of zeros is the end of the written part of a segment.
//! Every write of records ends with such a header (8 zero bytes, overwritten by the next
//! write), so the end is marked even in a recycled segment file whose old records follow.
//!
//! A segment's seed record is chained from the crc of the segment's own header (which holds
//! its sequence number), not from the previous record: a segment verifies on its own, and
//! records left over from an earlier life of a recycled file (another sequence number, so
//! another chain) never verify in it.

/// Size of a record header.
pub const HEADER_LEN: usize = 8;
/// Largest payload a record can carry (the length field has 24 bits).
pub const MAX_PAYLOAD: usize = (1 << 24) - 1;
/// Bytes of an entry payload before its data.
pub const ENTRY_PREFIX: usize = 16;

/// A Raft log entry: its index, term, and opaque data.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Entry {
    /// Raft index.
    pub index: u64,
    /// Raft term.
    pub term: u64,
    /// Opaque payload (an encoded raft-rs entry, say).
    pub data: Vec<u8>,
}

/// Raft's hard state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HardState {
    /// Current term.
    pub term: u64,
    /// Member voted for in that term (0: none).
    pub vote: u64,
    /// Highest index known committed.
    pub commit: u64,
}

/// Records that the state up to `index` (of term `term`) is held by a snapshot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SnapshotMarker {
    /// Last index covered by the snapshot.
    pub index: u64,
    /// Term of that index.
    pub term: u64,
}

/// Identity of the member that owns the log.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Metadata {
    /// Cluster id.
    pub cluster_id: u64,
    /// This member's id.
    pub member_id: u64,
}

/// Record types.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum RecordType {
    Seed = 1,
    Entry = 2,
    HardState = 3,
    Snapshot = 4,
    Metadata = 5,
}

impl RecordType {
    pub(crate) fn from_u8(t: u8) -> Option<RecordType> {
        Some(match t {
            1 => RecordType::Seed,
            2 => RecordType::Entry,
            3 => RecordType::HardState,
            4 => RecordType::Snapshot,
            5 => RecordType::Metadata,
            _ => return None,
        })
    }

    /// Payload length this type requires: `Ok(exact)` or, for entries, the minimum.
    fn length_ok(self, len: usize) -> bool {
        match self {
            RecordType::Seed => len == 16,
            RecordType::Entry => len >= ENTRY_PREFIX,
            RecordType::HardState => len == 24,
            RecordType::Snapshot | RecordType::Metadata => len == 16,
        }
    }
}

/// Payload length rounded up to 8.
pub(crate) const fn padded(len: usize) -> usize {
    (len + 7) & !7
}

/// Bytes a record with this payload length takes on disk.
pub(crate) const fn record_len(payload_len: usize) -> usize {
    HEADER_LEN + padded(payload_len)
}

/// Appends a framed record whose payload is the concatenation of `parts` to `buf` and
/// returns its crc (the seed of the next record). The caller keeps the total under
/// [`MAX_PAYLOAD`].
pub(crate) fn encode(buf: &mut Vec<u8>, ty: RecordType, parts: &[&[u8]], prev_crc: u32) -> u32 {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    debug_assert!(len <= MAX_PAYLOAD);
    let word = ((ty as u32) << 24) | len as u32;
    let start = buf.len();
    buf.reserve(record_len(len));
    buf.extend_from_slice(&[0u8; 4]);
    buf.extend_from_slice(&word.to_le_bytes());
    for p in parts {
        buf.extend_from_slice(p);
    }
    // Word and payload are contiguous: one crc pass over both.
    let mut h = crc32fast::Hasher::new_with_initial(prev_crc);
    h.update(&buf[start + 4..]);
    let crc = h.finalize();
    buf[start..start + 4].copy_from_slice(&crc.to_le_bytes());
    buf.resize(buf.len() + padded(len) - len, 0);
    crc
}

/// A parsed record header.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Header {
    pub crc: u32,
    pub word: u32,
}

impl Header {
    pub(crate) fn parse(b: &[u8]) -> Header {
        let mut crc = [0u8; 4];
        let mut word = [0u8; 4];
        crc.copy_from_slice(&b[0..4]);
        word.copy_from_slice(&b[4..8]);
        Header {
            crc: u32::from_le_bytes(crc),
            word: u32::from_le_bytes(word),
        }
    }
    pub(crate) fn is_zero(&self) -> bool {
        self.crc == 0 && self.word == 0
    }
    pub(crate) fn payload_len(&self) -> usize {
        (self.word & 0x00ff_ffff) as usize
    }
    /// The record type, if known and if the length suits it.
    pub(crate) fn checked_type(&self) -> Result<RecordType, String> {
        let raw = (self.word >> 24) as u8;
        let ty = RecordType::from_u8(raw).ok_or_else(|| format!("unknown record type {raw}"))?;
        if !ty.length_ok(self.payload_len()) {
            return Err(format!(
                "record type {raw} with impossible payload length {}",
                self.payload_len()
            ));
        }
        Ok(ty)
    }
    /// Whether the record's bytes from its word (offset 4) to the end of the unpadded
    /// payload match the crc, chained from `prev_crc`.
    pub(crate) fn verify(&self, prev_crc: u32, word_and_payload: &[u8]) -> bool {
        let mut h = crc32fast::Hasher::new_with_initial(prev_crc);
        h.update(word_and_payload);
        h.finalize() == self.crc
    }
}

pub(crate) fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

pub(crate) fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(x)
}

/// A decoded, checksum-verified record borrowing its payload.
#[derive(Debug)]
pub(crate) enum Record<'a> {
    Seed {
        prev_crc: u32,
        first_index: u64,
    },
    Entry {
        index: u64,
        term: u64,
        data: &'a [u8],
    },
    HardState(HardState),
    Snapshot(SnapshotMarker),
    Metadata(Metadata),
}

impl<'a> Record<'a> {
    /// Decodes a payload whose length was checked against its type.
    pub(crate) fn decode(ty: RecordType, p: &'a [u8]) -> Record<'a> {
        match ty {
            RecordType::Seed => Record::Seed {
                prev_crc: u32_at(p, 0),
                first_index: u64_at(p, 8),
            },
            RecordType::Entry => Record::Entry {
                index: u64_at(p, 0),
                term: u64_at(p, 8),
                data: &p[ENTRY_PREFIX..],
            },
            RecordType::HardState => Record::HardState(HardState {
                term: u64_at(p, 0),
                vote: u64_at(p, 8),
                commit: u64_at(p, 16),
            }),
            RecordType::Snapshot => Record::Snapshot(SnapshotMarker {
                index: u64_at(p, 0),
                term: u64_at(p, 8),
            }),
            RecordType::Metadata => Record::Metadata(Metadata {
                cluster_id: u64_at(p, 0),
                member_id: u64_at(p, 8),
            }),
        }
    }
}

/// Encoders for each record kind; each returns the new chain crc.
pub(crate) fn encode_entry(buf: &mut Vec<u8>, e: &Entry, prev: u32) -> u32 {
    // `encode` for an entry, without its general parts: header and prefix framed in one
    // piece, then the data, the padding from zeros, and one crc pass over word and payload.
    let len = ENTRY_PREFIX + e.data.len();
    let head = entry_frame(e);
    let start = buf.len();
    buf.extend_from_slice(&head);
    buf.extend_from_slice(&e.data);
    let mut h = crc32fast::Hasher::new_with_initial(prev);
    h.update(&buf[start + 4..]);
    let crc = h.finalize();
    buf[start..start + 4].copy_from_slice(&crc.to_le_bytes());
    buf.extend_from_slice(&[0u8; 8][..padded(len) - len]);
    crc
}

/// The header (crc left zero) and prefix of an entry record: the bytes before its data.
fn entry_frame(e: &Entry) -> [u8; HEADER_LEN + ENTRY_PREFIX] {
    let len = ENTRY_PREFIX + e.data.len();
    debug_assert!(len <= MAX_PAYLOAD);
    let word = ((RecordType::Entry as u32) << 24) | len as u32;
    let mut h = [0u8; HEADER_LEN + ENTRY_PREFIX];
    h[4..8].copy_from_slice(&word.to_le_bytes());
    h[8..16].copy_from_slice(&e.index.to_le_bytes());
    h[16..24].copy_from_slice(&e.term.to_le_bytes());
    h
}

/// The header and prefix of an entry record (the bytes before its data) and its crc,
/// chained from `prev`: for writing the data straight from the entry's own buffer.
pub(crate) fn entry_head(e: &Entry, prev: u32) -> ([u8; HEADER_LEN + ENTRY_PREFIX], u32) {
    let mut h = entry_frame(e);
    let mut c = crc32fast::Hasher::new_with_initial(prev);
    c.update(&h[4..]);
    c.update(&e.data);
    let crc = c.finalize();
    h[..4].copy_from_slice(&crc.to_le_bytes());
    (h, crc)
}

pub(crate) fn encode_seed(buf: &mut Vec<u8>, chain: u32, prev_crc: u32, first_index: u64) -> u32 {
    let mut p = [0u8; 16];
    p[..4].copy_from_slice(&prev_crc.to_le_bytes());
    p[8..].copy_from_slice(&first_index.to_le_bytes());
    // The seed record starts a segment's chain from the segment's header crc (`chain`), so a
    // segment can be verified without reading the one before it, and records of another
    // segment never chain into it.
    encode(buf, RecordType::Seed, &[&p], chain)
}

pub(crate) fn encode_hard_state(buf: &mut Vec<u8>, hs: &HardState, prev: u32) -> u32 {
    let mut p = [0u8; 24];
    p[..8].copy_from_slice(&hs.term.to_le_bytes());
    p[8..16].copy_from_slice(&hs.vote.to_le_bytes());
    p[16..].copy_from_slice(&hs.commit.to_le_bytes());
    encode(buf, RecordType::HardState, &[&p], prev)
}

pub(crate) fn encode_snapshot(buf: &mut Vec<u8>, m: &SnapshotMarker, prev: u32) -> u32 {
    let mut p = [0u8; 16];
    p[..8].copy_from_slice(&m.index.to_le_bytes());
    p[8..].copy_from_slice(&m.term.to_le_bytes());
    encode(buf, RecordType::Snapshot, &[&p], prev)
}

pub(crate) fn encode_metadata(buf: &mut Vec<u8>, m: &Metadata, prev: u32) -> u32 {
    let mut p = [0u8; 16];
    p[..8].copy_from_slice(&m.cluster_id.to_le_bytes());
    p[8..].copy_from_slice(&m.member_id.to_le_bytes());
    encode(buf, RecordType::Metadata, &[&p], prev)
}
