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
use crate::kv::{LeaseId, decode_record};
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
}

impl IndexBuilder {
    /// An empty builder.
    pub fn new() -> IndexBuilder {
        IndexBuilder::default()
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
        let rec = decode_record(rev, value)?;
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
