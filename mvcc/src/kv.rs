//! Key-value pairs as the store returns them, and the record that stores one change in the
//! `key` bucket.
//!
//! A record is the value stored under a revision key (see [`crate::revision`]). Its first byte
//! is its format number; the store writes format 2 and reads both.
//!
//! A build that reads only format 1 refuses format 2 records ("unknown record format 2"),
//! so the formats go one way: a member on such a build cannot open a store, or load a
//! snapshot, written by a newer one. Upgrade every member before a newer one writes (or
//! sends a snapshot); going back means restoring a backup taken before the upgrade.
//!
//! Format 2 (written since it exists): a variable-length header of unsigned LEB128 varints
//! (7 bits per byte, least significant group first, high bit set on every byte but the last;
//! at most 10 bytes for a u64), some 8 bytes for a fresh key instead of format 1's 37:
//!
//! ```text
//! offset 0        format          u8      (= 2)
//! then            mod_revision    varint  (the change's main revision)
//! then            mod - create    varint  (mod_revision - create_revision; a tombstone's
//!                                          create_revision is 0, so this is mod_revision)
//! then            version         varint  (0 for a tombstone)
//! then            lease           varint  of the zigzag form of the i64 lease
//!                                         ((l << 1) ^ (l >> 63); 0 = no lease)
//! then            key_len         varint  (at most u32::MAX)
//! then            key             key_len bytes
//! then            value           the rest up to the checksum (empty for a tombstone)
//! last 4 bytes    crc             u32 big-endian, CRC-32 (IEEE) of every byte before it
//! ```
//!
//! Format 1 (stores written before format 2; read, never written); integers big-endian:
//!
//! ```text
//! offset 0        format          u8   (= 1)
//! offset 1..9     create_revision u64  (0 for a tombstone)
//! offset 9..17    mod_revision    u64  (the change's main revision)
//! offset 17..25   version         u64  (0 for a tombstone)
//! offset 25..33   lease           i64  (0 = no lease)
//! offset 33..37   key_len         u32
//! offset 37..     key             key_len bytes
//! then            value           the rest up to the checksum (empty for a tombstone)
//! last 4 bytes    crc             u32  CRC-32 (IEEE) of every byte before it
//! ```

use std::sync::LazyLock;

use bytes::{Bytes, BytesMut};

use crate::error::MvccError;
use crate::pending::{RecordAt, Records};
use crate::revision::Revision;

/// A lease identifier; `0` means "no lease" (etcd).
pub type LeaseId = i64;

/// Current record format number: the one the store writes.
pub const RECORD_FORMAT: u8 = 2;
/// The first record format, still read.
const FORMAT_1: u8 = 1;
/// Format 1's fixed header.
const HEADER_1: usize = 37;
/// Longest format 2 header: the format byte and five varints of at most 10 bytes.
const MAX_HEADER_2: usize = 1 + 5 * 10;
/// Bytes of a record's trailing checksum.
pub(crate) const RECORD_CRC: usize = 4;
const CRC: usize = RECORD_CRC;

/// A key with its value and metadata, as of some revision. Read the key and the value with
/// [`key`](KeyValue::key) and [`value`](KeyValue::value).
///
/// The key and the value lie side by side in one reference-counted buffer, so cloning a
/// `KeyValue` copies no bytes. The pairs of one range share buffers of 16 KiB (a pair of
/// more than 2 KiB gets a buffer of its own), so a range allocates once per buffer instead
/// of once per pair; a pair kept after the others of its range are dropped keeps its whole
/// buffer alive, 16 KiB at most. A buffer is made no larger than the pairs left to make
/// would fill if they were the size of the one that starts it, and the last pair of a result
/// that would start a new buffer gets one of its own size instead, so a pair read alone (the
/// previous pair of a put or of a watch event, a range of one key) holds no more than its
/// bytes, and a result of a few pairs not much more than theirs.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct KeyValue {
    /// The key's bytes, then the value's.
    pub(crate) bytes: Bytes,
    /// Where the key ends in `bytes`.
    pub(crate) key_len: usize,
    /// Revision of the put that created the key's current generation.
    pub create_revision: u64,
    /// Revision of the key's last change.
    pub mod_revision: u64,
    /// Number of puts since the key was (re)created, from 1.
    pub version: u64,
    /// The lease attached to the key, 0 for none.
    pub lease: LeaseId,
}

impl KeyValue {
    /// The pair `key`, `value`, with revisions, version and lease 0.
    pub fn new(key: &[u8], value: &[u8]) -> KeyValue {
        KeyValue {
            bytes: pair(key, value),
            key_len: key.len(),
            ..KeyValue::default()
        }
    }

    /// `record`'s key and metadata, with `bytes` holding its key and then the value taken.
    fn with_fields(bytes: Bytes, record: &RecordRef<'_>) -> KeyValue {
        KeyValue {
            bytes,
            key_len: record.key.len(),
            create_revision: record.create_revision,
            mod_revision: record.mod_revision,
            version: record.version,
            lease: record.lease,
        }
    }

    /// The key.
    pub fn key(&self) -> &[u8] {
        &self.bytes[..self.key_len]
    }

    /// The value (empty when the range asked for keys only).
    pub fn value(&self) -> &[u8] {
        &self.bytes[self.key_len..]
    }

    /// Replaces the value.
    pub fn set_value(&mut self, value: &[u8]) {
        self.bytes = pair(self.key(), value);
    }

    /// The key and the value, apart: the key copied out, the value moved to the front of the
    /// pair's buffer when the pair holds that buffer alone, copied out otherwise.
    pub fn into_parts(self) -> (Vec<u8>, Vec<u8>) {
        let key = self.key().to_vec();
        let mut value = Vec::from(self.bytes);
        value.drain(..self.key_len);
        (key, value)
    }
}

/// `key` then `value` in a buffer of their own.
fn pair(key: &[u8], value: &[u8]) -> Bytes {
    let mut bytes = Vec::with_capacity(key.len() + value.len());
    bytes.extend_from_slice(key);
    bytes.extend_from_slice(value);
    Bytes::from(bytes)
}

/// Buffers that the pairs of one result share: each pair is copied into the chunk being
/// filled, and the chunk is freed once every pair in it is dropped.
pub(crate) struct KvArena {
    /// The unfilled rest of the chunk being filled.
    chunk: BytesMut,
    /// Pairs of the result not yet made.
    left: usize,
}

impl KvArena {
    /// Bytes of a chunk.
    pub const CHUNK: usize = 16 << 10;
    /// A pair of more bytes than this gets a buffer of its own, so at most this many bytes of
    /// a chunk go unused.
    pub const ALONE: usize = 2 << 10;

    /// An arena for a result of `pairs` pairs.
    pub fn new(pairs: usize) -> KvArena {
        KvArena {
            chunk: BytesMut::new(),
            left: pairs,
        }
    }

    /// The pair with its metadata from `record` (the value left empty if `with_value` is
    /// false), its bytes copied into the arena, or into a buffer of its own when it is
    /// large, or the result's last pair and the chunk being filled has no room for it.
    #[inline]
    pub fn kv(&mut self, record: &RecordRef<'_>, with_value: bool) -> KeyValue {
        let value = if with_value { record.value } else { &[] };
        let len = record.key.len() + value.len();
        self.left = self.left.saturating_sub(1);
        let alone = len > Self::ALONE || (self.left == 0 && self.chunk.capacity() < len);
        let bytes = if alone {
            pair(record.key, value)
        } else {
            if self.chunk.capacity() < len {
                // Room for the pairs left if they are of this one's size: a result of a
                // few pairs does not hold a whole chunk.
                let room = len.saturating_mul(self.left + 1);
                self.chunk = BytesMut::with_capacity(room.min(Self::CHUNK));
            }
            self.chunk.extend_from_slice(record.key);
            self.chunk.extend_from_slice(value);
            self.chunk.split().freeze()
        };
        KeyValue::with_fields(bytes, record)
    }
}

impl std::fmt::Debug for KeyValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyValue")
            .field("key", &self.key())
            .field("value", &self.value())
            .field("create_revision", &self.create_revision)
            .field("mod_revision", &self.mod_revision)
            .field("version", &self.version)
            .field("lease", &self.lease)
            .finish()
    }
}

/// Encodes one change in record format 1, as stores written before format 2 hold it.
#[cfg(test)]
pub(crate) fn encode_record(kv: &KeyValue) -> Vec<u8> {
    let mut body = Vec::with_capacity(HEADER_1 + kv.key().len() + kv.value().len() + CRC);
    body.push(FORMAT_1);
    body.extend_from_slice(&kv.create_revision.to_be_bytes());
    body.extend_from_slice(&kv.mod_revision.to_be_bytes());
    body.extend_from_slice(&kv.version.to_be_bytes());
    body.extend_from_slice(&kv.lease.to_be_bytes());
    body.extend_from_slice(&(kv.key().len() as u32).to_be_bytes());
    body.extend_from_slice(kv.key());
    body.extend_from_slice(kv.value());
    let crc = crc32fast::hash(&body);
    body.extend_from_slice(&crc.to_be_bytes());
    body
}

/// CRC-32 (IEEE) of `bytes`, as `crc32fast::hash` computes it, from a hasher made once:
/// `crc32fast::hash` detects the CPU's features on every call, a tenth of the work for a
/// record of 200 bytes.
#[inline]
fn crc32(bytes: &[u8]) -> u32 {
    static FRESH: LazyLock<crc32fast::Hasher> = LazyLock::new(crc32fast::Hasher::new);
    let mut h = FRESH.clone();
    h.update(bytes);
    h.finalize()
}

/// Writes `v` as a varint at `buf[at..]` (which has room for 10 bytes); returns where it ends.
#[inline]
fn put_varint(buf: &mut [u8; MAX_HEADER_2], mut at: usize, mut v: u64) -> usize {
    while v >= 0x80 {
        buf[at] = (v as u8) | 0x80;
        v >>= 7;
        at += 1;
    }
    buf[at] = v as u8;
    at + 1
}

/// Reads a varint at `b[*at..]`, moving `at` past it; `None` when it runs past `b` or
/// overflows a u64. One-byte varints (most header fields) take the short way.
#[inline(always)]
fn get_varint(b: &[u8], at: &mut usize) -> Option<u64> {
    let first = *b.get(*at)?;
    *at += 1;
    if first < 0x80 {
        return Some(u64::from(first));
    }
    get_varint_rest(b, at, u64::from(first & 0x7f))
}

/// The bytes of a varint after its first (whose low bits are `v`).
#[inline]
fn get_varint_rest(b: &[u8], at: &mut usize, mut v: u64) -> Option<u64> {
    let mut shift = 7u32;
    loop {
        let byte = *b.get(*at)?;
        *at += 1;
        if shift == 63 && byte > 1 {
            return None;
        }
        v |= u64::from(byte & 0x7f) << shift;
        if byte < 0x80 {
            return Some(v);
        }
        shift += 7;
    }
}

/// The format 2 header of a change, in `buf`; returns its length.
fn header_2(
    buf: &mut [u8; MAX_HEADER_2],
    key_len: usize,
    create_revision: u64,
    mod_revision: u64,
    version: u64,
    lease: LeaseId,
) -> usize {
    buf[0] = RECORD_FORMAT;
    let mut n = put_varint(buf, 1, mod_revision);
    n = put_varint(buf, n, mod_revision.wrapping_sub(create_revision));
    n = put_varint(buf, n, version);
    n = put_varint(buf, n, ((lease << 1) ^ (lease >> 63)) as u64);
    put_varint(buf, n, key_len as u64)
}

/// Appends the record of one change, encoded from its parts (a tombstone has an empty value
/// and zero create revision and version) in the current format, to `records`; returns where
/// it lies.
pub(crate) fn encode_parts(
    records: &mut Records,
    key: &[u8],
    value: &[u8],
    create_revision: u64,
    mod_revision: u64,
    version: u64,
    lease: LeaseId,
) -> RecordAt {
    let mut head = [0u8; MAX_HEADER_2];
    let h = header_2(
        &mut head,
        key.len(),
        create_revision,
        mod_revision,
        version,
        lease,
    );
    records.append(h + key.len() + value.len() + CRC, |out| {
        let start = out.len();
        out.extend_from_slice(&head[..h]);
        out.extend_from_slice(key);
        out.extend_from_slice(value);
        let crc = crc32(&out[start..]);
        out.extend_from_slice(&crc.to_be_bytes());
    })
}

/// Feeds `h` the record stored under `rev` as format 1 encodes it, whatever format it was
/// written in (a format 2 record is checked, then re-encoded): the history hash of
/// [`Store::hash_kv`](crate::Store::hash_kv) does not depend on the record format, so members
/// holding the same history agree although some wrote it in format 1 and others in format 2
/// (during a rolling upgrade, say).
pub(crate) fn hash_as_format_1(
    h: &mut crc32fast::Hasher,
    rev: Revision,
    bytes: &[u8],
) -> Result<(), MvccError> {
    if bytes.first() != Some(&RECORD_FORMAT) {
        h.update(bytes);
        return Ok(());
    }
    let rec = decode_record(rev, bytes)?;
    let mut head = [0u8; HEADER_1];
    head[0] = FORMAT_1;
    head[1..9].copy_from_slice(&rec.create_revision.to_be_bytes());
    head[9..17].copy_from_slice(&rec.mod_revision.to_be_bytes());
    head[17..25].copy_from_slice(&rec.version.to_be_bytes());
    head[25..33].copy_from_slice(&rec.lease.to_be_bytes());
    head[33..].copy_from_slice(&(rec.key.len() as u32).to_be_bytes());
    let mut crc = crc32fast::Hasher::new();
    for part in [&head[..], rec.key, rec.value] {
        crc.update(part);
        h.update(part);
    }
    h.update(&crc.finalize().to_be_bytes());
    Ok(())
}

/// A decoded record borrowing its key and value.
pub(crate) struct RecordRef<'a> {
    pub key: &'a [u8],
    pub value: &'a [u8],
    pub create_revision: u64,
    pub mod_revision: u64,
    pub version: u64,
    pub lease: LeaseId,
}

impl RecordRef<'_> {
    /// Copies it out; `with_value = false` leaves the value empty.
    pub fn to_kv(&self, with_value: bool) -> KeyValue {
        let value = if with_value { self.value } else { &[] };
        KeyValue::with_fields(pair(self.key, value), self)
    }
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

/// A record's header fields and where its key lies.
struct Head {
    create_revision: u64,
    mod_revision: u64,
    version: u64,
    lease: LeaseId,
    key_start: usize,
    key_len: usize,
}

/// Parses the header at the start of `head` (of either format); the error is the reason.
fn parse_head(head: &[u8]) -> Result<Head, String> {
    match head.first() {
        Some(&RECORD_FORMAT) => {
            let mut at = 1;
            let mut next = || get_varint(head, &mut at).ok_or("record header is cut short");
            let mod_revision = next()?;
            let create_delta = next()?;
            let version = next()?;
            let zigzag = next()?;
            let key_len = next()?;
            Ok(Head {
                create_revision: mod_revision.wrapping_sub(create_delta),
                mod_revision,
                version,
                lease: ((zigzag >> 1) as i64) ^ -((zigzag & 1) as i64),
                key_start: at,
                key_len: usize::try_from(key_len).unwrap_or(usize::MAX),
            })
        }
        Some(&FORMAT_1) if head.len() >= HEADER_1 => Ok(Head {
            create_revision: be64(head, 1),
            mod_revision: be64(head, 9),
            version: be64(head, 17),
            lease: be64(head, 25) as i64,
            key_start: HEADER_1,
            key_len: u32::from_be_bytes([head[33], head[34], head[35], head[36]]) as usize,
        }),
        Some(&FORMAT_1) | None => Err("record header is cut short".to_owned()),
        Some(f) => Err(format!("unknown record format {f}")),
    }
}

/// Decodes and checks a record stored under `rev`.
#[inline]
pub(crate) fn decode_record(rev: Revision, bytes: &[u8]) -> Result<RecordRef<'_>, MvccError> {
    if let Some((body, crc)) = bytes.split_last_chunk::<CRC>() {
        if crc32(body) != u32::from_be_bytes(*crc) {
            return Err(checksum_mismatch(rev));
        }
        if let Some(rec) = decode_2(bytes) {
            return Ok(rec);
        }
    }
    decode_record_slow(rev, bytes)
}

#[cold]
fn checksum_mismatch(rev: Revision) -> MvccError {
    MvccError::Corrupt {
        revision: rev,
        reason: "record checksum mismatch".to_owned(),
    }
}

/// A well-formed format 2 record (checksum aside), decoded without building errors: `None`
/// for anything else (format 1, damage), which the general path decodes or explains. It
/// accepts exactly the format 2 records that path accepts.
#[inline(always)]
fn decode_2(bytes: &[u8]) -> Option<RecordRef<'_>> {
    if *bytes.first()? != RECORD_FORMAT {
        return None;
    }
    let mut at = 1;
    let mod_revision = get_varint(bytes, &mut at)?;
    let create_delta = get_varint(bytes, &mut at)?;
    let version = get_varint(bytes, &mut at)?;
    let zigzag = get_varint(bytes, &mut at)?;
    let key_len = get_varint(bytes, &mut at)?;
    let body_end = bytes.len().checked_sub(CRC)?;
    let key_end = at.checked_add(usize::try_from(key_len).ok()?)?;
    let key = bytes.get(at..key_end)?;
    let value = bytes.get(key_end..body_end)?;
    Some(RecordRef {
        key,
        value,
        create_revision: mod_revision.wrapping_sub(create_delta),
        mod_revision,
        version,
        lease: ((zigzag >> 1) as i64) ^ -((zigzag & 1) as i64),
    })
}

/// [`decode_record`] without computing the checksum, for records whose bytes a stream
/// checksum already covers (or that the store wrote itself and holds in memory): the format
/// number and the key length are still checked.
#[inline]
pub(crate) fn decode_record_unchecked(
    rev: Revision,
    bytes: &[u8],
) -> Result<RecordRef<'_>, MvccError> {
    match decode_2(bytes) {
        Some(rec) => Ok(rec),
        None => decode_record_slow(rev, bytes),
    }
}

/// The general path of [`decode_record_unchecked`]: format 1, or the error saying why a
/// record does not decode.
fn decode_record_slow(rev: Revision, bytes: &[u8]) -> Result<RecordRef<'_>, MvccError> {
    let (mut rec, key_end) = decode_parts(rev, bytes.len(), bytes)?;
    rec.value = &bytes[key_end..bytes.len() - CRC];
    Ok(rec)
}

/// Bytes of a record of `len` bytes that [`decode_head`] needs: its header and its key
/// (the key's length is read from `header`, the record's first bytes, when they hold it).
pub(crate) fn head_len(len: usize, header: &[u8]) -> usize {
    match parse_head(header) {
        Ok(h) => len.min(h.key_start.saturating_add(h.key_len)),
        Err(_) => len.min(header.len()),
    }
}

/// Decodes the fields of a record of `len` bytes from its first bytes `head` (at least
/// [`head_len`] of them), without its checksum; the value comes out empty.
pub(crate) fn decode_head(
    rev: Revision,
    len: usize,
    head: &[u8],
) -> Result<RecordRef<'_>, MvccError> {
    decode_parts(rev, len, head).map(|(rec, _)| rec)
}

/// [`decode_head`], also returning where the key ends (and the value starts).
fn decode_parts(
    rev: Revision,
    len: usize,
    head: &[u8],
) -> Result<(RecordRef<'_>, usize), MvccError> {
    let corrupt = |reason: String| MvccError::Corrupt {
        revision: rev,
        reason,
    };
    let head = &head[..head.len().min(len)];
    let h = parse_head(head).map_err(|reason| match head.first() {
        Some(&RECORD_FORMAT | &FORMAT_1) => corrupt(format!("record of {len} bytes: {reason}")),
        _ if len < CRC + 1 => corrupt(format!("record of {len} bytes is too short")),
        _ => corrupt(reason),
    })?;
    let room = len.saturating_sub(CRC).saturating_sub(h.key_start);
    if h.key_start + CRC > len || h.key_len > room || head.len() < h.key_start + h.key_len {
        return Err(corrupt(format!(
            "key length {} exceeds the record of {len} bytes",
            h.key_len
        )));
    }
    let key_end = h.key_start + h.key_len;
    Ok((
        RecordRef {
            key: &head[h.key_start..key_end],
            value: &[],
            create_revision: h.create_revision,
            mod_revision: h.mod_revision,
            version: h.version,
            lease: h.lease,
        },
        key_end,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pair_reads_back_its_key_and_value_from_one_buffer() {
        let mut kv = KeyValue::new(b"key", b"value");
        assert_eq!((kv.key(), kv.value()), (&b"key"[..], &b"value"[..]));
        assert_eq!(kv.create_revision + kv.mod_revision + kv.version, 0);
        kv.set_value(b"");
        assert_eq!((kv.key(), kv.value()), (&b"key"[..], &b""[..]));
        kv.set_value(b"longer value");
        assert_eq!(
            kv.clone().into_parts(),
            (b"key".to_vec(), b"longer value".to_vec())
        );
        // Where the key ends matters, not only the bytes.
        assert_ne!(KeyValue::new(b"ab", b"c"), KeyValue::new(b"a", b"bc"));
        assert_eq!(KeyValue::new(b"", b"").into_parts(), (vec![], vec![]));
        // The key does not keep the value's room.
        let (key, value) = KeyValue::new(b"k", &[7; 4096]).into_parts();
        assert!(key.capacity() < 64, "{}", key.capacity());
        assert_eq!(value, vec![7; 4096]);
        assert!(format!("{kv:?}").contains("key: [107, 101, 121]"));
    }

    /// Small pairs of one result are packed into shared chunks, side by side, with the right
    /// fields; a pair over `ALONE` bytes, and a pair that would not fit in the chunk's rest,
    /// do not land in the chunk being filled; every pair reads back whole after the arena and
    /// the other pairs are dropped, and `into_parts` copies out of a shared chunk; a result
    /// of a few pairs gets buffers sized for them.
    #[test]
    fn an_arena_packs_small_pairs_into_shared_chunks() {
        let rec = |key: &'static [u8], value: &'static [u8], rev: u64| RecordRef {
            key,
            value,
            create_revision: 1,
            mod_revision: rev,
            version: rev,
            lease: -3,
        };
        static BIG: [u8; KvArena::ALONE] = [9; KvArena::ALONE];
        static MID: [u8; 1000] = [4; 1000];
        let mut arena = KvArena::new(40);
        let mut kvs = Vec::new();
        for rev in 1..=40 {
            let value: &'static [u8] = match rev {
                7 => &BIG,
                _ if rev % 3 == 0 => &MID,
                _ => b"value",
            };
            kvs.push((arena.kv(&rec(b"key", value, rev), rev != 5), value));
        }
        drop(arena);
        let end = |kv: &KeyValue| kv.bytes.as_ptr() as usize + kv.bytes.len();
        let mut shared = 0;
        for (i, (kv, value)) in kvs.iter().enumerate() {
            let rev = i as u64 + 1;
            let want: &[u8] = if rev == 5 { b"" } else { value };
            assert_eq!((kv.key(), kv.value()), (&b"key"[..], want), "pair {rev}");
            assert_eq!(
                (kv.create_revision, kv.mod_revision, kv.version, kv.lease),
                (1, rev, rev, -3)
            );
            if i > 0 && end(&kvs[i - 1].0) == kv.bytes.as_ptr() as usize {
                shared += 1;
            }
        }
        // 40 pairs of 1003 or 8 bytes but one (2051 bytes, alone) fill 16 KiB chunks; a pair
        // starts a chunk only after one that did not fit, or after the big one.
        assert!(shared >= 34, "only {shared} pairs follow the one before");
        let big = &kvs[6].0;
        assert!(end(&kvs[5].0) != big.bytes.as_ptr() as usize);
        assert!(end(big) != kvs[7].0.bytes.as_ptr() as usize);
        let (kv, _) = kvs.swap_remove(0);
        drop(kvs);
        assert_eq!(kv.into_parts(), (b"key".to_vec(), b"value".to_vec()));
        // A result of three small pairs takes a buffer of their size, not a whole chunk;
        // a larger pair that does not fit starts one sized for it and the pairs left.
        let mut arena = KvArena::new(3);
        let first = arena.kv(&rec(b"key", b"value", 1), true);
        assert_eq!(
            arena.chunk.capacity(),
            16,
            "room for two more pairs of 8 bytes"
        );
        let second = arena.kv(&rec(b"key", &MID, 2), true);
        assert_eq!(
            arena.chunk.capacity(),
            1003,
            "room for one more pair of 1003 bytes"
        );
        let third = arena.kv(&rec(b"key", b"value", 3), true);
        assert_eq!(end(&second), third.bytes.as_ptr() as usize);
        assert_eq!(
            [first.value(), second.value(), third.value()],
            [&b"value"[..], &MID[..], &b"value"[..]]
        );
    }

    fn kv(
        key: &[u8],
        value: &[u8],
        create: u64,
        modified: u64,
        version: u64,
        lease: i64,
    ) -> KeyValue {
        KeyValue {
            create_revision: create,
            mod_revision: modified,
            version,
            lease,
            ..KeyValue::new(key, value)
        }
    }

    fn encode(kv: &KeyValue) -> Vec<u8> {
        let mut records = Records::default();
        let at = encode_parts(
            &mut records,
            kv.key(),
            kv.value(),
            kv.create_revision,
            kv.mod_revision,
            kv.version,
            kv.lease,
        );
        records.get(at).to_vec()
    }

    /// Changes whose fields cover one-byte and ten-byte varints, negative and extreme
    /// leases, tombstones and empty values.
    fn samples() -> Vec<KeyValue> {
        vec![
            kv(b"k", b"value", 3, 7, 2, -5),
            kv(
                b"key-00000000000000000001",
                &[7; 150],
                1_000_000,
                1_000_000,
                1,
                0,
            ),
            kv(b"gone", b"", 0, 42, 0, 0),
            kv(&[0xff; 300], &[1; 70_000], 1, u64::MAX, u64::MAX, i64::MIN),
            kv(b"x", b"", u64::MAX, 0, 127, i64::MAX),
            kv(b"lease", b"v", 128, 16_384, 128, 0x7a3c_1f00_dead_beef),
        ]
    }

    #[test]
    fn format_2_round_trips_and_checks_its_checksum() {
        for kv in samples() {
            let rev = Revision::new(kv.mod_revision, 0);
            let mut bytes = encode(&kv);
            assert_eq!(bytes[0], RECORD_FORMAT);
            let back = decode_record(rev, &bytes).unwrap().to_kv(true);
            assert_eq!(back, kv);
            // The head alone gives every field but the value.
            let head = &bytes[..head_len(bytes.len(), &bytes)];
            assert_eq!(head.len(), bytes.len() - kv.value().len() - CRC);
            let fields = decode_head(rev, bytes.len(), head).unwrap().to_kv(false);
            assert_eq!(fields, {
                let mut no_value = kv.clone();
                no_value.set_value(&[]);
                no_value
            });
            for at in [1, bytes.len() / 2, bytes.len() - 1] {
                bytes[at] ^= 0x10;
                assert!(
                    decode_record(rev, &bytes).is_err(),
                    "flip at {at} unnoticed"
                );
                bytes[at] ^= 0x10;
            }
        }
    }

    #[test]
    fn format_1_records_stay_readable() {
        for kv in samples() {
            let rev = Revision::new(kv.mod_revision, 0);
            let mut bytes = encode_record(&kv);
            assert_eq!(bytes[0], 1);
            assert_eq!(decode_record(rev, &bytes).unwrap().to_kv(true), kv);
            assert_eq!(
                decode_record_unchecked(rev, &bytes).unwrap().to_kv(true),
                kv
            );
            let head = &bytes[..head_len(bytes.len(), &bytes)];
            assert_eq!(head.len(), HEADER_1 + kv.key().len());
            let fields = decode_head(rev, bytes.len(), head).unwrap().to_kv(false);
            assert_eq!(fields, {
                let mut no_value = kv.clone();
                no_value.set_value(&[]);
                no_value
            });
            let at = 40.min(bytes.len() - 5);
            bytes[at] ^= 1;
            assert!(decode_record(rev, &bytes).is_err());
        }
    }

    #[test]
    fn the_history_hash_sees_format_1_bytes_whatever_the_format() {
        for kv in samples() {
            let rev = Revision::new(kv.mod_revision, 0);
            let hash = |bytes: &[u8]| {
                let mut h = crc32fast::Hasher::new();
                hash_as_format_1(&mut h, rev, bytes).unwrap();
                h.finalize()
            };
            let v1 = encode_record(&kv);
            assert_eq!(hash(&encode(&kv)), hash(&v1));
            assert_eq!(hash(&v1), crc32fast::hash(&v1));
        }
        let mut damaged = encode(&samples()[0]);
        damaged[3] ^= 4;
        let mut h = crc32fast::Hasher::new();
        assert!(hash_as_format_1(&mut h, Revision::new(7, 0), &damaged).is_err());
    }

    #[test]
    fn a_fresh_key_costs_a_dozen_bytes_of_header_and_checksum() {
        let kv = kv(
            b"key-00000000000000000001",
            &[7; 150],
            1_000_000,
            1_000_000,
            1,
            0,
        );
        let bytes = encode(&kv);
        let overhead = bytes.len() - kv.key().len() - kv.value().len();
        assert!(overhead <= 12, "{overhead} bytes of header and checksum");
        assert_eq!(
            encode_record(&kv).len() - bytes.len(),
            HEADER_1 + CRC - overhead
        );
    }

    #[test]
    fn broken_framing_is_refused_without_the_checksum() {
        let rev = Revision::new(7, 0);
        let good = encode(&kv(b"k", b"value", 3, 7, 2, 5));
        // Unknown format number.
        let mut bad = good.clone();
        bad[0] = 9;
        let err = decode_record_unchecked(rev, &bad)
            .err()
            .expect("format 9 refused");
        assert!(err.to_string().contains("unknown record format 9"), "{err}");
        // A key length past the record's end (the key length is the header's last varint).
        let mut long = good.clone();
        long[5] = 100;
        assert!(decode_record_unchecked(rev, &long).is_err());
        assert!(decode_head(rev, long.len(), &long).is_err());
        // Cut short: in the header, and so short that no header fits.
        for n in [0, 1, 3, 5, 8] {
            assert!(
                decode_record_unchecked(rev, &good[..n]).is_err(),
                "{n} bytes"
            );
        }
        // A varint that never ends, and one that overflows a u64.
        let mut endless = vec![RECORD_FORMAT];
        endless.extend_from_slice(&[0xff; 20]);
        assert!(decode_record_unchecked(rev, &endless).is_err());
        let mut overflow = vec![RECORD_FORMAT];
        overflow.extend_from_slice(&[0xff; 9]);
        overflow.extend_from_slice(&[0x02, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert!(decode_record_unchecked(rev, &overflow).is_err());
    }

    #[test]
    fn the_format_2_fast_path_accepts_what_the_general_path_accepts() {
        let rev = Revision::new(7, 0);
        let fields = |r: &RecordRef<'_>| {
            (
                r.key.to_vec(),
                r.value.to_vec(),
                r.create_revision,
                r.mod_revision,
                r.version,
                r.lease,
            )
        };
        let mut checked = 0;
        for kv in samples() {
            let good = encode(&kv);
            let mut variants: Vec<Vec<u8>> = (0..good.len().min(64))
                .map(|n| good[..n].to_vec())
                .collect();
            for at in 0..good.len().min(16) {
                for flip in [0x01, 0x7f, 0x80, 0xff] {
                    let mut bad = good.clone();
                    bad[at] ^= flip;
                    variants.push(bad);
                }
            }
            variants.push(good);
            for bytes in &variants {
                let slow = decode_record_slow(rev, bytes).ok();
                let fast = decode_2(bytes);
                assert_eq!(
                    fast.as_ref().map(fields),
                    slow.as_ref()
                        .filter(|_| bytes.first() == Some(&RECORD_FORMAT))
                        .map(fields),
                    "{bytes:?}"
                );
                checked += 1;
            }
        }
        assert!(checked > 300);
    }

    #[test]
    fn the_shared_hasher_computes_crc32() {
        for len in [0, 1, 7, 64, 200, 4097] {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 31 + 7) as u8).collect();
            assert_eq!(crc32(&bytes), crc32fast::hash(&bytes));
            // Twice: the shared hasher is not consumed.
            assert_eq!(crc32(&bytes), crc32fast::hash(&bytes));
        }
    }

    #[test]
    fn varints_round_trip_at_every_width() {
        let mut buf = [0u8; MAX_HEADER_2];
        for shift in 0..64 {
            for v in [1u64 << shift, (1u64 << shift) - 1, u64::MAX >> shift] {
                let end = put_varint(&mut buf, 0, v);
                assert_eq!(end, (64 - v.leading_zeros() as usize).div_ceil(7).max(1));
                let mut at = 0;
                assert_eq!(get_varint(&buf, &mut at), Some(v));
                assert_eq!(at, end);
            }
        }
    }
}
