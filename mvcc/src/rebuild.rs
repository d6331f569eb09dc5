//! Rebuilding the in-memory state a store derives from its backend: the key index (key →
//! generations of revisions), the latest revision, and which live keys carry a lease.
//!
//! [`Store::open`](crate::Store::open) feeds it every record of the `key` bucket from one read
//! pass; a caller restoring a snapshot feeds it the pairs as the backend loads them
//! ([`Backend::restore_observed`](crate::Backend::restore_observed)) and opens the store
//! with [`Store::open_rebuilt`](crate::Store::open_rebuilt), so the copy is never read back.

use std::collections::HashMap;

use crate::backend::Bucket;
use crate::error::MvccError;
use crate::key_index::KeyIndex;
use crate::kv::{LeaseId, RecordRef, decode_record};
use crate::revision::Revision;
use crate::store::KEY_BUCKET;

/// The key index and lease attachments rebuilt from the `key` bucket's records, fed in
/// ascending revision order.
///
/// ```no_run
/// # use keel_mvcc::{Backend, IndexBuilder, Store, StoreOptions};
/// # fn f<B: Backend>(backend: B, input: &mut dyn std::io::Read) -> Result<(), Box<dyn std::error::Error>> {
/// let mut builder = IndexBuilder::new();
/// backend.restore_observed(input, &mut |bucket, key, value| builder.observe(bucket, key, value))?;
/// let store = Store::open_rebuilt(backend, StoreOptions::default(), builder)?;
/// # Ok(()) }
/// ```
#[derive(Default)]
pub struct IndexBuilder {
    pub(crate) keys: KeyIndex,
    /// Highest main revision seen.
    pub(crate) revision: u64,
    /// Lease of every key whose latest change is a put with a lease.
    pub(crate) leases: HashMap<Vec<u8>, LeaseId>,
    /// Records seen.
    pub(crate) records: u64,
    /// The first record that failed to decode; the rebuild is refused with it.
    pub(crate) error: Option<MvccError>,
    /// The records come out of a checksummed snapshot stream: their own checksums are not
    /// computed again (see [`IndexBuilder::for_checked_stream`]).
    pub(crate) stream_checked: bool,
}

impl IndexBuilder {
    /// An empty builder.
    pub fn new() -> IndexBuilder {
        IndexBuilder::default()
    }

    /// A builder for the pairs of a snapshot stream being restored, whose every byte is covered
    /// by the stream's checksum (checked before its last batch is loaded, see
    /// [`snapshot::restore_from`](crate::backend::snapshot::restore_from); a stream failing
    /// it is discarded with everything built from it). The records' own checksums cover the
    /// same bytes once more, so they are not computed here: only the record's framing is
    /// checked (format, lengths). They stay in the restored records, checked by every read, as
    /// on the member the stream came from.
    pub fn for_checked_stream() -> IndexBuilder {
        IndexBuilder {
            stream_checked: true,
            ..IndexBuilder::default()
        }
    }

    /// Takes one pair of a backend: records of the `key` bucket are indexed, pairs of other
    /// buckets are ignored. Records must come in ascending revision order (the bucket's key
    /// order). A damaged record is remembered and fails the open.
    pub fn observe(&mut self, bucket: &Bucket, key: &[u8], value: &[u8]) {
        if *bucket == KEY_BUCKET
            && self.error.is_none()
            && let Err(e) = self.add(key, value)
        {
            self.error = Some(e);
        }
    }

    /// Indexes one record of the `key` bucket.
    pub(crate) fn add(&mut self, key: &[u8], value: &[u8]) -> Result<(), MvccError> {
        let Some((rev, tombstone)) = Revision::from_key(key) else {
            return Err(MvccError::Corrupt {
                revision: Revision::default(),
                reason: format!("key bucket holds a non-revision key {key:02x?}"),
            });
        };
        let rec = if self.stream_checked {
            decode_record_framing(rev, value)?
        } else {
            decode_record(rev, value)?
        };
        if tombstone {
            self.keys.tombstone(rec.key, rev);
        } else {
            self.keys
                .restore_put(rec.key, rec.create_revision, rev, rec.version);
        }
        if rec.lease != 0 && !tombstone {
            self.leases.insert(rec.key.to_vec(), rec.lease);
        } else if !self.leases.is_empty() {
            self.leases.remove(rec.key);
        }
        self.revision = self.revision.max(rev.main);
        self.records += 1;
        Ok(())
    }

    /// Records indexed so far.
    pub fn records(&self) -> u64 {
        self.records
    }
}

/// Decodes a record (format in [`crate::kv`]) without computing its checksum: for records
/// whose bytes a stream checksum covers. The format number and the key length are checked.
fn decode_record_framing(rev: Revision, bytes: &[u8]) -> Result<RecordRef<'_>, MvccError> {
    const HEADER: usize = 37;
    const CRC: usize = 4;
    let corrupt = |reason: String| MvccError::Corrupt {
        revision: rev,
        reason,
    };
    if bytes.len() < HEADER + CRC {
        return Err(corrupt(format!(
            "record of {} bytes is too short",
            bytes.len()
        )));
    }
    let body = &bytes[..bytes.len() - CRC];
    if body[0] != crate::kv::RECORD_FORMAT {
        return Err(corrupt(format!("unknown record format {}", body[0])));
    }
    let be64 = |at: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&body[at..at + 8]);
        u64::from_be_bytes(a)
    };
    let key_len = u32::from_be_bytes([body[33], body[34], body[35], body[36]]) as usize;
    if key_len > body.len() - HEADER {
        return Err(corrupt(format!("key length {key_len} exceeds the record")));
    }
    Ok(RecordRef {
        key: &body[HEADER..HEADER + key_len],
        value: &body[HEADER + key_len..],
        create_revision: be64(1),
        mod_revision: be64(9),
        version: be64(17),
        lease: be64(25) as i64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{KeyValue, encode_record};

    #[test]
    fn a_checked_stream_skips_record_checksums_but_not_framing() {
        let kv = KeyValue {
            key: b"k".to_vec(),
            value: b"value".to_vec(),
            create_revision: 3,
            mod_revision: 7,
            version: 2,
            lease: 5,
        };
        let rev = Revision::new(7, 0);
        let key = rev.to_key(false);
        let mut record = encode_record(&kv);
        let last = record.len() - 1;
        record[last] ^= 1;
        // A record whose checksum is wrong: refused when read from a backend, taken from a
        // stream whose own checksum covers it.
        assert!(IndexBuilder::new().add(&key, &record).is_err());
        let mut built = IndexBuilder::for_checked_stream();
        built.add(&key, &record).expect("framing is sound");
        assert_eq!((built.records(), built.revision), (1, 7));
        assert_eq!(built.leases.get(&b"k"[..]), Some(&5));
        // Broken framing is refused either way.
        let mut bad = record.clone();
        bad[0] = 9;
        assert!(IndexBuilder::for_checked_stream().add(&key, &bad).is_err());
        let mut long = record.clone();
        long[33..37].copy_from_slice(&1000u32.to_be_bytes());
        assert!(IndexBuilder::for_checked_stream().add(&key, &long).is_err());
        assert!(
            IndexBuilder::for_checked_stream()
                .add(&key, &record[..20])
                .is_err()
        );
    }
}
