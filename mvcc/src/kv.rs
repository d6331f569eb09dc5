//! Key-value pairs as the store returns them, and the record that stores one change in the
//! `key` bucket.
//!
//! Record format (value of a revision key, see [`crate::revision`]); integers big-endian:
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

use std::sync::Arc;

use crate::error::MvccError;
use crate::revision::Revision;

/// A lease identifier; `0` means "no lease" (etcd).
pub type LeaseId = i64;

/// Current record format number.
pub const RECORD_FORMAT: u8 = 1;
const HEADER: usize = 37;
const CRC: usize = 4;

/// A key with its value and metadata, as of some revision.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyValue {
    /// The key.
    pub key: Vec<u8>,
    /// The value (empty when the range asked for keys only).
    pub value: Vec<u8>,
    /// Revision of the put that created the key's current generation.
    pub create_revision: u64,
    /// Revision of the key's last change.
    pub mod_revision: u64,
    /// Number of puts since the key was (re)created, from 1.
    pub version: u64,
    /// The lease attached to the key, 0 for none.
    pub lease: LeaseId,
}

/// Encodes one change.
#[cfg(test)]
pub(crate) fn encode_record(kv: &KeyValue) -> Vec<u8> {
    encode_parts(
        &kv.key,
        &kv.value,
        kv.create_revision,
        kv.mod_revision,
        kv.version,
        kv.lease,
    )
    .to_vec()
}

/// Encodes one change from its parts (a tombstone has an empty value and zero create
/// revision and version), in one shared allocation: watchers receive the record itself,
/// not a copy.
pub(crate) fn encode_parts(
    key: &[u8],
    value: &[u8],
    create_revision: u64,
    mod_revision: u64,
    version: u64,
    lease: LeaseId,
) -> Arc<[u8]> {
    let len = HEADER + key.len() + value.len() + CRC;
    // A fresh `Arc` is unique, so `get_mut` always succeeds and the bytes are filled in place.
    let mut rec: Arc<[u8]> = std::iter::repeat_n(0u8, len).collect();
    if let Some(out) = Arc::get_mut(&mut rec) {
        let (body, crc) = out.split_at_mut(len - CRC);
        body[0] = RECORD_FORMAT;
        body[1..9].copy_from_slice(&create_revision.to_be_bytes());
        body[9..17].copy_from_slice(&mod_revision.to_be_bytes());
        body[17..25].copy_from_slice(&version.to_be_bytes());
        body[25..33].copy_from_slice(&lease.to_be_bytes());
        body[33..HEADER].copy_from_slice(&(key.len() as u32).to_be_bytes());
        body[HEADER..HEADER + key.len()].copy_from_slice(key);
        body[HEADER + key.len()..].copy_from_slice(value);
        crc.copy_from_slice(&crc32fast::hash(body).to_be_bytes());
    }
    rec
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
    /// Sets everything of `kv` but its key from this record (the value only if `with_value`).
    pub fn fill(&self, kv: &mut KeyValue, with_value: bool) {
        if with_value {
            kv.value = self.value.to_vec();
        }
        kv.create_revision = self.create_revision;
        kv.mod_revision = self.mod_revision;
        kv.version = self.version;
        kv.lease = self.lease;
    }

    /// Copies it out; `with_value = false` leaves the value empty.
    pub fn to_kv(&self, with_value: bool) -> KeyValue {
        KeyValue {
            key: self.key.to_vec(),
            value: if with_value {
                self.value.to_vec()
            } else {
                Vec::new()
            },
            create_revision: self.create_revision,
            mod_revision: self.mod_revision,
            version: self.version,
            lease: self.lease,
        }
    }
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

/// Decodes and checks a record stored under `rev`.
pub(crate) fn decode_record(rev: Revision, bytes: &[u8]) -> Result<RecordRef<'_>, MvccError> {
    if bytes.len() >= HEADER + CRC {
        let (body, crc) = bytes.split_at(bytes.len() - CRC);
        let stored = u32::from_be_bytes([crc[0], crc[1], crc[2], crc[3]]);
        if crc32fast::hash(body) != stored {
            return Err(MvccError::Corrupt {
                revision: rev,
                reason: "record checksum mismatch".to_owned(),
            });
        }
    }
    decode_record_unchecked(rev, bytes)
}

/// [`decode_record`] without computing the checksum, for records whose bytes a stream
/// checksum already covers: the format number and the key length are still checked.
pub(crate) fn decode_record_unchecked(
    rev: Revision,
    bytes: &[u8],
) -> Result<RecordRef<'_>, MvccError> {
    let mut rec = decode_head(rev, bytes.len(), bytes)?;
    rec.value = &bytes[HEADER + rec.key.len()..bytes.len() - CRC];
    Ok(rec)
}

/// Bytes of a record of `len` bytes that [`decode_head`] needs: its header and its key
/// (the key's length is read from `header`, the record's first bytes, when they hold it).
pub(crate) fn head_len(len: usize, header: &[u8]) -> usize {
    let key_len = match header.get(33..HEADER) {
        Some(b) => u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize,
        None => 0,
    };
    len.min(HEADER.saturating_add(key_len))
}

/// Decodes the fields of a record of `len` bytes from its first bytes `head` (at least
/// [`head_len`] of them), without its checksum; the value comes out empty.
pub(crate) fn decode_head(
    rev: Revision,
    len: usize,
    head: &[u8],
) -> Result<RecordRef<'_>, MvccError> {
    let corrupt = |reason: String| MvccError::Corrupt {
        revision: rev,
        reason,
    };
    if len < HEADER + CRC || head.len() < HEADER {
        return Err(corrupt(format!("record of {len} bytes is too short")));
    }
    if head[0] != RECORD_FORMAT {
        return Err(corrupt(format!("unknown record format {}", head[0])));
    }
    let key_len = u32::from_be_bytes([head[33], head[34], head[35], head[36]]) as usize;
    if key_len > len - CRC - HEADER || head.len() < HEADER + key_len {
        return Err(corrupt(format!("key length {key_len} exceeds the record")));
    }
    Ok(RecordRef {
        key: &head[HEADER..HEADER + key_len],
        value: &[],
        create_revision: be64(head, 1),
        mod_revision: be64(head, 9),
        version: be64(head, 17),
        lease: be64(head, 25) as i64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_round_trip_and_checksum() {
        let kv = KeyValue {
            key: b"k".to_vec(),
            value: b"value".to_vec(),
            create_revision: 3,
            mod_revision: 7,
            version: 2,
            lease: -5,
        };
        let mut bytes = encode_record(&kv);
        let back = decode_record(Revision::new(7, 0), &bytes)
            .unwrap()
            .to_kv(true);
        assert_eq!(back, kv);
        bytes[40] ^= 1;
        assert!(decode_record(Revision::new(7, 0), &bytes).is_err());
    }
}
