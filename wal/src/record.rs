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
//! | 6    | batch      | first_index, term, count u32 LE, 4 zero bytes,      |
//! |      |            | count data lengths (u32 LE each), then the data of  |
//! |      |            | the count entries back to back                      |
//!
//! A batch record (format version 3 on) holds entries `first_index ..
//! first_index + count` of one term, at least two of them, in at most
//! [`BATCH_MAX_PAYLOAD`] bytes of payload: one header and one checksum for them all
//! instead of one per entry (20 of the 24 framing bytes and a checksum call saved per
//! entry). An append copied into the write buffer frames each run of entries of one term
//! that fits as a batch; an entry alone, or too large to share a batch, is an entry record,
//! as are the entries of a durable append written straight from their own buffers (large
//! entries, see the log's direct writes). A batch of a possible length whose checksum holds
//! but whose lengths do not add up to its payload, or one in a version-2 segment, is
//! damage, never a torn write (a header whose length no batch can have is checked before
//! the checksum, and treated like any other bad header).
//!
//! Type 0 does not exist: a header of zeros is the end of the written part of a segment.
//! Every write of records ends with such a header (8 zero bytes, overwritten by the next
//! write), so the end is marked even in a recycled segment file whose old records follow.
//!
//! A segment's seed record is chained from the crc of the segment's own header (which holds
//! its sequence number), not from the previous record: a segment verifies on its own, and
//! records left over from an earlier life of a recycled file (another sequence number, so
//! another chain) never verify in it.

use crate::pagebuf::Sink;

/// Size of a record header.
pub const HEADER_LEN: usize = 8;
/// Largest payload a record can carry (the length field has 24 bits).
pub const MAX_PAYLOAD: usize = (1 << 24) - 1;
/// Bytes of an entry payload before its data.
pub const ENTRY_PREFIX: usize = 16;
/// Bytes of a batch payload before its length table.
pub(crate) const BATCH_PREFIX: usize = 24;
/// Largest payload of a batch record: a read of one entry reads and checks its whole record,
/// so batches stay small enough for that to cost little.
pub(crate) const BATCH_MAX_PAYLOAD: usize = 64 << 10;

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
    Batch = 6,
}

impl RecordType {
    pub(crate) fn from_u8(t: u8) -> Option<RecordType> {
        Some(match t {
            1 => RecordType::Seed,
            2 => RecordType::Entry,
            3 => RecordType::HardState,
            4 => RecordType::Snapshot,
            5 => RecordType::Metadata,
            6 => RecordType::Batch,
            _ => return None,
        })
    }

    /// Whether a payload of `len` bytes can be of this type (exact, or a range for entries
    /// and batches).
    fn length_ok(self, len: usize) -> bool {
        match self {
            RecordType::Seed => len == 16,
            RecordType::Entry => len >= ENTRY_PREFIX,
            RecordType::HardState => len == 24,
            RecordType::Snapshot | RecordType::Metadata => len == 16,
            RecordType::Batch => (BATCH_PREFIX + 2 * 4..=BATCH_MAX_PAYLOAD).contains(&len),
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
pub(crate) fn encode(buf: &mut impl Sink, ty: RecordType, parts: &[&[u8]], prev_crc: u32) -> u32 {
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
    seal(buf, start, len, prev_crc)
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
    Batch(Batch<'a>),
    HardState(HardState),
    Snapshot(SnapshotMarker),
    Metadata(Metadata),
}

/// A decoded batch record: entries `first_index ..` of one term, with their lengths checked
/// against the payload.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Batch<'a> {
    pub first_index: u64,
    pub term: u64,
    /// The length table: `count` u32 LE.
    lens: &'a [u8],
    /// The whole payload.
    payload: &'a [u8],
}

impl<'a> Batch<'a> {
    /// Checks a batch payload (length already checked against the type): the count fits the
    /// payload and the lengths add up to the bytes after the table.
    fn decode(p: &'a [u8]) -> Result<Batch<'a>, String> {
        let count = u32_at(p, 16) as usize;
        let table = count
            .checked_mul(4)
            .and_then(|t| t.checked_add(BATCH_PREFIX))
            .filter(|&t| t <= p.len())
            .ok_or_else(|| format!("batch of {count} entries in a {}-byte payload", p.len()))?;
        if count < 2 {
            return Err(format!(
                "batch of {count} entries (a batch holds at least 2)"
            ));
        }
        if u32_at(p, 20) != 0 {
            return Err("batch with non-zero reserved bytes".into());
        }
        let lens = &p[BATCH_PREFIX..table];
        let total: u64 = lens.chunks_exact(4).map(|l| u64::from(u32_at(l, 0))).sum();
        if total != (p.len() - table) as u64 {
            return Err(format!(
                "batch lengths add up to {total} bytes, its data holds {}",
                p.len() - table
            ));
        }
        let first_index = u64_at(p, 0);
        if first_index.checked_add(count as u64 - 1).is_none() {
            return Err(format!("batch of {count} entries from index {first_index}"));
        }
        Ok(Batch {
            first_index,
            term: u64_at(p, 8),
            lens,
            payload: p,
        })
    }

    /// Number of entries.
    pub(crate) fn len(&self) -> usize {
        self.lens.len() / 4
    }

    /// Length of the record's payload.
    pub(crate) fn payload_len(&self) -> usize {
        self.payload.len()
    }

    /// Index of the last entry.
    pub(crate) fn last_index(&self) -> u64 {
        self.first_index + self.len() as u64 - 1
    }

    /// The entries in order: (index, offset of the data in the payload, data).
    pub(crate) fn entries(&self) -> impl Iterator<Item = (u64, usize, &'a [u8])> + '_ {
        let mut at = BATCH_PREFIX + self.lens.len();
        let payload = self.payload;
        self.lens.chunks_exact(4).enumerate().map(move |(k, l)| {
            let n = u32_at(l, 0) as usize;
            let e = (self.first_index + k as u64, at, &payload[at..at + n]);
            at += n;
            e
        })
    }
}

impl<'a> Record<'a> {
    /// Decodes a payload whose length was checked against its type; a batch whose
    /// contents do not add up, or a snapshot marker at index `u64::MAX`, is refused with the
    /// reason.
    pub(crate) fn decode(ty: RecordType, p: &'a [u8]) -> Result<Record<'a>, String> {
        Ok(match ty {
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
            RecordType::Snapshot => {
                let index = u64_at(p, 0);
                if index == u64::MAX {
                    // No build writes one: the next entry's index would not exist.
                    return Err("snapshot marker at index u64::MAX".into());
                }
                Record::Snapshot(SnapshotMarker {
                    index,
                    term: u64_at(p, 8),
                })
            }
            RecordType::Metadata => Record::Metadata(Metadata {
                cluster_id: u64_at(p, 0),
                member_id: u64_at(p, 8),
            }),
            RecordType::Batch => Record::Batch(Batch::decode(p)?),
        })
    }
}

/// Encoders for each record kind; each returns the new chain crc.
pub(crate) fn encode_entry(buf: &mut impl Sink, e: &Entry, prev: u32) -> u32 {
    // `encode` for an entry, without its general parts: header and prefix framed in one
    // piece, then the data, the padding from zeros, and one crc pass over word and payload.
    let len = ENTRY_PREFIX + e.data.len();
    let head = entry_frame(e);
    let start = buf.len();
    buf.extend_from_slice(&head);
    buf.extend_from_slice(&e.data);
    seal(buf, start, len, prev)
}

/// How many of `entries` (at least one) the next record holds: the longest run from the
/// first that shares its term and fits in [`BATCH_MAX_PAYLOAD`] as a batch; 1 (an entry
/// record) where no second entry joins it.
pub(crate) fn batch_run(entries: &[Entry]) -> usize {
    let Some(first) = entries.first() else {
        return 0;
    };
    let mut payload = BATCH_PREFIX;
    let mut n = 0;
    for e in entries {
        let grown = payload + 4 + e.data.len();
        if e.term != first.term || grown > BATCH_MAX_PAYLOAD {
            break;
        }
        payload = grown;
        n += 1;
    }
    n.max(1)
}

/// Payload length of a batch of `entries`.
pub(crate) fn batch_payload_len(entries: &[Entry]) -> usize {
    BATCH_PREFIX + entries.iter().map(|e| 4 + e.data.len()).sum::<usize>()
}

/// Appends a batch record of `entries` (at least two, consecutive indices, one term, within
/// [`BATCH_MAX_PAYLOAD`], as [`batch_run`] picks them) to `buf` and returns its crc.
pub(crate) fn encode_batch(buf: &mut impl Sink, entries: &[Entry], prev: u32) -> u32 {
    let len = batch_payload_len(entries);
    debug_assert!(entries.len() >= 2 && len <= BATCH_MAX_PAYLOAD);
    let word = ((RecordType::Batch as u32) << 24) | len as u32;
    let start = buf.len();
    buf.reserve(record_len(len));
    let mut head = [0u8; HEADER_LEN + BATCH_PREFIX];
    head[4..8].copy_from_slice(&word.to_le_bytes());
    head[8..16].copy_from_slice(&entries[0].index.to_le_bytes());
    head[16..24].copy_from_slice(&entries[0].term.to_le_bytes());
    head[24..28].copy_from_slice(&(entries.len() as u32).to_le_bytes());
    buf.extend_from_slice(&head);
    for e in entries {
        buf.extend_from_slice(&(e.data.len() as u32).to_le_bytes());
    }
    for e in entries {
        buf.extend_from_slice(&e.data);
    }
    // One crc pass over word and payload for the whole batch.
    seal(buf, start, len, prev)
}

/// Finishes the record framed at `buf[start..]` (header with its crc left zero, then `len`
/// bytes of payload): computes its crc over word and payload, chained from `prev`, writes it
/// into the header, pads the payload to 8 bytes, and returns the crc.
fn seal(buf: &mut impl Sink, start: usize, len: usize, prev: u32) -> u32 {
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

pub(crate) fn encode_seed(buf: &mut impl Sink, chain: u32, prev_crc: u32, first_index: u64) -> u32 {
    let mut p = [0u8; 16];
    p[..4].copy_from_slice(&prev_crc.to_le_bytes());
    p[8..].copy_from_slice(&first_index.to_le_bytes());
    // The seed record starts a segment's chain from the segment's header crc (`chain`), so a
    // segment can be verified without reading the one before it, and records of another
    // segment never chain into it.
    encode(buf, RecordType::Seed, &[&p], chain)
}

pub(crate) fn encode_hard_state(buf: &mut impl Sink, hs: &HardState, prev: u32) -> u32 {
    let mut p = [0u8; 24];
    p[..8].copy_from_slice(&hs.term.to_le_bytes());
    p[8..16].copy_from_slice(&hs.vote.to_le_bytes());
    p[16..].copy_from_slice(&hs.commit.to_le_bytes());
    encode(buf, RecordType::HardState, &[&p], prev)
}

pub(crate) fn encode_snapshot(buf: &mut impl Sink, m: &SnapshotMarker, prev: u32) -> u32 {
    let mut p = [0u8; 16];
    p[..8].copy_from_slice(&m.index.to_le_bytes());
    p[8..].copy_from_slice(&m.term.to_le_bytes());
    encode(buf, RecordType::Snapshot, &[&p], prev)
}

pub(crate) fn encode_metadata(buf: &mut impl Sink, m: &Metadata, prev: u32) -> u32 {
    let mut p = [0u8; 16];
    p[..8].copy_from_slice(&m.cluster_id.to_le_bytes());
    p[8..].copy_from_slice(&m.member_id.to_le_bytes());
    encode(buf, RecordType::Metadata, &[&p], prev)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(n: u64) -> Vec<Entry> {
        (0..n)
            .map(|k| Entry {
                index: 10 + k,
                term: 4,
                data: vec![k as u8; 3 * k as usize],
            })
            .collect()
    }

    /// The payload of a batch record of `entries`, checked against its type as the reader
    /// checks it.
    fn payload(entries: &[Entry]) -> Vec<u8> {
        let mut buf = Vec::new();
        encode_batch(&mut buf, entries, 0);
        let h = Header::parse(&buf);
        assert_eq!(h.checked_type(), Ok(RecordType::Batch));
        buf[HEADER_LEN..HEADER_LEN + h.payload_len()].to_vec()
    }

    #[test]
    fn a_batch_decodes_to_its_entries() {
        let es = run(5);
        let p = payload(&es);
        let Ok(Record::Batch(b)) = Record::decode(RecordType::Batch, &p) else {
            panic!("not a batch");
        };
        assert_eq!(
            (b.first_index, b.last_index(), b.term, b.len()),
            (10, 14, 4, 5)
        );
        let got: Vec<(u64, &[u8])> = b.entries().map(|(i, _, d)| (i, d)).collect();
        let want: Vec<(u64, &[u8])> = es.iter().map(|e| (e.index, &e.data[..])).collect();
        assert_eq!(got, want);
        for (_, at, d) in b.entries() {
            assert_eq!(&p[at..at + d.len()], d);
        }
    }

    #[test]
    fn impossible_batches_are_refused() {
        let p = payload(&run(3));
        let with = |at: usize, v: u32| {
            let mut q = p.clone();
            q[at..at + 4].copy_from_slice(&v.to_le_bytes());
            Record::decode(RecordType::Batch, &q)
                .map(|_| ())
                .unwrap_err()
        };
        // Counts the payload cannot hold, or under two.
        assert!(with(16, u32::MAX).contains("batch of"));
        assert!(with(16, 1_000).contains("batch of"));
        assert!(with(16, 1).contains("at least 2"));
        // Reserved bytes, and lengths that do not add up.
        assert!(with(20, 1).contains("reserved"));
        assert!(with(24, 7).contains("add up"));
        // An index range past u64.
        let mut q = p.clone();
        q[0..8].copy_from_slice(&(u64::MAX - 1).to_le_bytes());
        assert!(Record::decode(RecordType::Batch, &q).is_err());
    }

    #[test]
    fn runs_break_at_a_term_change_and_at_the_size_bound() {
        let mut es = run(5);
        es[2].term = 5;
        es[3].term = 5;
        assert_eq!(batch_run(&es), 2);
        assert_eq!(batch_run(&es[2..]), 2);
        assert_eq!(batch_run(&es[4..]), 1);
        let big = |index| Entry {
            index,
            term: 1,
            data: vec![0; 40 << 10],
        };
        // Two 40 KiB entries do not fit in one batch: each is an entry record.
        assert_eq!(batch_run(&[big(1), big(2)]), 1);
        let small: Vec<Entry> = (0..2000)
            .map(|i| Entry {
                index: i,
                term: 1,
                data: vec![0; 100],
            })
            .collect();
        let n = batch_run(&small);
        assert_eq!(n, (BATCH_MAX_PAYLOAD - BATCH_PREFIX) / 104);
        assert!(batch_payload_len(&small[..n]) <= BATCH_MAX_PAYLOAD);
        assert!(batch_payload_len(&small[..n + 1]) > BATCH_MAX_PAYLOAD);
    }
}
