//! The persisted lease record.
//!
//! Every granted lease is one pair in the backend bucket `lease`, written through the MVCC
//! store's auxiliary buckets in the same atomic batch as the operation that changed it:
//!
//! ```text
//! key   = lease id                           8 bytes, i64 big-endian
//! value = version                             1 byte, currently 1
//!         granted TTL in seconds              8 bytes, i64 little-endian (> 0)
//!         remaining TTL in seconds            8 bytes, i64 little-endian (0 = no checkpoint)
//!         CRC-32 (crc32fast) of bytes 0..17   4 bytes, u32 little-endian
//! ```
//!
//! The remaining TTL is the last checkpointed value; a renewal resets it to 0, meaning "the
//! full granted TTL". Attached keys are not stored here: each key in the MVCC store carries
//! its lease id, and the attachments are rebuilt from the keys on open.

use crate::LeaseId;
use crate::error::LeaseError;

/// The backend bucket holding lease records.
pub const LEASE_BUCKET: keel_mvcc::Bucket = keel_mvcc::Bucket::new("lease");

/// Version byte of the current record format.
pub const RECORD_VERSION: u8 = 1;

/// Length of an encoded record value.
pub const RECORD_LEN: usize = 21;

/// A decoded lease record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseRecord {
    /// The lease id.
    pub id: LeaseId,
    /// Granted TTL in seconds.
    pub ttl: i64,
    /// Last checkpointed remaining TTL in seconds; 0 when none.
    pub remaining: i64,
}

impl LeaseRecord {
    /// The record's key: the id, big-endian.
    pub fn key(id: LeaseId) -> [u8; 8] {
        id.to_be_bytes()
    }

    /// The record's value bytes.
    pub fn encode_value(&self) -> [u8; RECORD_LEN] {
        let mut out = [0u8; RECORD_LEN];
        out[0] = RECORD_VERSION;
        out[1..9].copy_from_slice(&self.ttl.to_le_bytes());
        out[9..17].copy_from_slice(&self.remaining.to_le_bytes());
        let crc = crc32fast::hash(&out[..17]);
        out[17..21].copy_from_slice(&crc.to_le_bytes());
        out
    }

    /// Decodes a stored pair, checking length, version, checksum and the TTL's sign.
    pub fn decode(key: &[u8], value: &[u8]) -> Result<LeaseRecord, LeaseError> {
        let corrupt = |reason: String| LeaseError::CorruptRecord {
            key: key.to_vec(),
            reason,
        };
        let id_bytes: [u8; 8] = key
            .try_into()
            .map_err(|_| corrupt(format!("key is {} bytes, expected 8", key.len())))?;
        let id = LeaseId::from_be_bytes(id_bytes);
        if value.len() != RECORD_LEN {
            return Err(corrupt(format!(
                "value is {} bytes, expected {RECORD_LEN}",
                value.len()
            )));
        }
        if value[0] != RECORD_VERSION {
            return Err(corrupt(format!(
                "format version {} is not the supported version {RECORD_VERSION}",
                value[0]
            )));
        }
        let stored = u32::from_le_bytes([value[17], value[18], value[19], value[20]]);
        let computed = crc32fast::hash(&value[..17]);
        if stored != computed {
            return Err(corrupt(format!(
                "checksum mismatch (stored {stored:08x}, computed {computed:08x})"
            )));
        }
        let mut word = [0u8; 8];
        word.copy_from_slice(&value[1..9]);
        let ttl = i64::from_le_bytes(word);
        word.copy_from_slice(&value[9..17]);
        let remaining = i64::from_le_bytes(word);
        if id == 0 || ttl <= 0 || remaining < 0 {
            return Err(corrupt(format!(
                "impossible contents: id {id}, TTL {ttl}, remaining TTL {remaining}"
            )));
        }
        Ok(LeaseRecord { id, ttl, remaining })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_layout() {
        let r = LeaseRecord {
            id: -5,
            ttl: 3600,
            remaining: 600,
        };
        let key = LeaseRecord::key(r.id);
        assert_eq!(key, (-5i64).to_be_bytes());
        let v = r.encode_value();
        assert_eq!(v[0], 1);
        assert_eq!(&v[1..9], &3600i64.to_le_bytes());
        assert_eq!(&v[9..17], &600i64.to_le_bytes());
        assert_eq!(LeaseRecord::decode(&key, &v).unwrap(), r);
    }

    #[test]
    fn every_flipped_bit_is_detected() {
        let r = LeaseRecord {
            id: 7,
            ttl: 60,
            remaining: 0,
        };
        let key = LeaseRecord::key(7);
        let v = r.encode_value();
        for bit in 0..RECORD_LEN * 8 {
            let mut bad = v;
            bad[bit / 8] ^= 1 << (bit % 8);
            let err = LeaseRecord::decode(&key, &bad).unwrap_err();
            assert!(matches!(err, LeaseError::CorruptRecord { .. }), "{err}");
        }
        assert!(LeaseRecord::decode(&key, &v[..20]).is_err());
        assert!(LeaseRecord::decode(&key[..7], &v).is_err());
    }
}
