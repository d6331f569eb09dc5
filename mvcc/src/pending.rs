//! The write buffer: changes acknowledged to callers but not yet committed to the backend.
//!
//! Write transactions append to the store's *current* buffer. The committer swaps it for an
//! empty one, commits the old one to the backend in one batch, and then forgets it. A read
//! view clones the `Arc`s of the buffers it may need (current and, while a commit runs, the
//! committing one) before it opens its backend read transaction, so every change at or below
//! its revision is in one of the buffers or in the backend: revisions are immutable, so it does
//! not matter which copy a value is read from. Deletions are tombstones appended like any
//! other change, so a pending delete is never hidden by an older committed value.

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::RwLock;

use crate::backend::{BackendError, BatchOpRef, BatchSource, Bucket};
use crate::revision::{REV_KEY_LEN, Revision, TOMBSTONE_MARK};
use crate::store::{KEY_BUCKET, META_BUCKET};

/// One stored change.
#[derive(Clone, Debug)]
pub(crate) struct PendingRev {
    pub rev: Revision,
    pub tombstone: bool,
    /// The record, shared with the watchers it is delivered to.
    pub record: Arc<[u8]>,
}

/// The changes of one or more write transactions.
#[derive(Debug, Default)]
pub(crate) struct Changes {
    /// Ascending by revision.
    pub revs: Vec<PendingRev>,
    /// Auxiliary writes: `None` deletes.
    pub aux: BTreeMap<Bucket, BTreeMap<Vec<u8>, Option<Vec<u8>>>>,
    /// Writes to the meta bucket.
    pub meta: BTreeMap<&'static [u8], Vec<u8>>,
    /// Number of writes, for the batch limit.
    pub writes: usize,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        self.writes == 0
    }

    /// The stored change at `rev`, if it is here.
    pub fn find(&self, rev: Revision) -> Option<&PendingRev> {
        let i = self.revs.binary_search_by(|p| p.rev.cmp(&rev)).ok()?;
        Some(&self.revs[i])
    }

    /// The auxiliary write to `bucket`/`key`, if any: `Some(None)` is a pending delete.
    pub fn aux(&self, bucket: &Bucket, key: &[u8]) -> Option<Option<&[u8]>> {
        self.aux.get(bucket)?.get(key).map(|v| v.as_deref())
    }

    /// Moves everything of `other` (newer) into `self`, leaving `other` empty with its
    /// allocations.
    pub fn absorb_from(&mut self, other: &mut Changes) {
        self.revs.append(&mut other.revs);
        if !other.aux.is_empty() {
            for (bucket, writes) in std::mem::take(&mut other.aux) {
                self.aux.entry(bucket).or_default().extend(writes);
            }
        }
        self.meta.append(&mut other.meta);
        self.writes += std::mem::take(&mut other.writes);
    }
}

/// The changes as a backend batch (revisions in order, then auxiliary writes, then meta
/// writes), without copying the records.
impl BatchSource for Changes {
    fn for_each_op(
        &self,
        sink: &mut dyn FnMut(BatchOpRef<'_>) -> Result<(), BackendError>,
    ) -> Result<(), BackendError> {
        let mut key = [0u8; REV_KEY_LEN + 1];
        for p in &self.revs {
            key[..REV_KEY_LEN].copy_from_slice(&p.rev.to_bytes());
            let len = if p.tombstone {
                key[REV_KEY_LEN] = TOMBSTONE_MARK;
                REV_KEY_LEN + 1
            } else {
                REV_KEY_LEN
            };
            sink(BatchOpRef::Put {
                bucket: &KEY_BUCKET,
                key: &key[..len],
                value: &p.record,
            })?;
        }
        for (bucket, writes) in &self.aux {
            for (key, value) in writes {
                sink(match value {
                    Some(value) => BatchOpRef::Put { bucket, key, value },
                    None => BatchOpRef::Delete { bucket, key },
                })?;
            }
        }
        for (key, value) in &self.meta {
            sink(BatchOpRef::Put {
                bucket: &META_BUCKET,
                key,
                value,
            })?;
        }
        Ok(())
    }

    fn op_count(&self) -> usize {
        self.revs.len() + self.aux.values().map(BTreeMap::len).sum::<usize>() + self.meta.len()
    }
}

/// A shared, append-only buffer of changes.
#[derive(Debug, Default)]
pub(crate) struct Pending {
    pub changes: RwLock<Changes>,
}

impl Pending {
    /// An empty buffer with room for `revs` changes.
    pub fn with_capacity(revs: usize) -> Pending {
        Pending {
            changes: RwLock::new(Changes {
                revs: Vec::with_capacity(revs),
                ..Changes::default()
            }),
        }
    }
}
