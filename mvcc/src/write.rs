//! Write transactions: one atomic unit, one revision.
//!
//! A transaction holds the store's writer mutex from `begin` to `commit` or drop. Its changes
//! go into the key index at once, at revision `base + 1`, which readers ignore until `commit`
//! publishes it; the records wait in a private buffer. `commit` appends that buffer to the
//! shared pending buffer (so the whole transaction lands in one backend batch), publishes the
//! revision and notifies watchers. Dropping the transaction instead removes its revisions from
//! the key index again, leaving no trace.

use std::cell::OnceCell;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use parking_lot::MutexGuard;

use crate::backend::{Backend, Bucket};
use crate::error::MvccError;
use crate::key_index::KeyAt;
use crate::kv::{KeyValue, LeaseId, decode_record, encode_parts};
use crate::pending::{Changes, PendingRev};
use crate::read::{ReadView, range, scan_live};
use crate::request::{
    DeleteRangeRequest, DeleteResponse, PutRequest, PutResponse, RangeRequest, RangeResponse,
    TxnRequest, TxnResponse, bound, check_range,
};
use crate::revision::Revision;
use crate::store::{Inner, META_CONSISTENT_INDEX, Signal, check_aux_bucket};

/// A write transaction; see the module docs. Obtained from [`Store::write`](crate::Store::write).
///
/// Reads through it ([`range`](WriteTxn::range)) see its own earlier writes.
pub struct WriteTxn<'a, B: Backend> {
    inner: &'a Arc<Inner<B>>,
    /// The writer mutex's guard, and the buffers this transaction stages its changes in.
    scratch: MutexGuard<'a, WriteScratch>,
    base: u64,
    next_sub: u64,
    consistent_index: Option<u64>,
    view: OnceCell<ReadView<B>>,
    done: bool,
}

impl<'a, B: Backend> WriteTxn<'a, B> {
    pub(crate) fn begin(inner: &'a Arc<Inner<B>>) -> WriteTxn<'a, B> {
        inner.writers.fetch_add(1, Ordering::Relaxed);
        inner.write_txns.fetch_add(1, Ordering::Relaxed);
        let guard = inner.write_lock.lock();
        let base = guard.revision;
        WriteTxn {
            inner,
            scratch: guard,
            base,
            next_sub: 0,
            consistent_index: None,
            view: OnceCell::new(),
            done: false,
        }
    }

    /// The revision reads in this transaction see: the one it will commit as once it changed
    /// a key, else the store's current revision.
    pub fn revision(&self) -> u64 {
        if self.scratch.staged.revs.is_empty() {
            self.base
        } else {
            self.base + 1
        }
    }

    pub(crate) fn options(&self) -> &crate::options::StoreOptions {
        &self.inner.options
    }

    fn view(&self) -> Result<&ReadView<B>, MvccError> {
        if let Some(v) = self.view.get() {
            return Ok(v);
        }
        let v = ReadView::open(self.inner)?;
        Ok(self.view.get_or_init(|| v))
    }

    fn fetch(&self, revs: &[Revision]) -> Result<Vec<KeyValue>, MvccError> {
        if revs.is_empty() {
            return Ok(Vec::new());
        }
        let view = self.view()?;
        let compacted = || self.inner.index.read().compacted;
        view.sources(Some(&self.scratch.staged))
            .fetch(compacted, revs, true)
    }

    fn check_size(&self, size: usize) -> Result<(), MvccError> {
        let limit = self.inner.options.max_request_bytes;
        if size > limit {
            return Err(MvccError::RequestTooLarge { size, limit });
        }
        Ok(())
    }

    /// Reads a key or range, seeing this transaction's own writes.
    pub fn range(&self, req: &RangeRequest) -> Result<RangeResponse, MvccError> {
        let view = self.view()?;
        range(
            self.inner,
            &view.sources(Some(&self.scratch.staged)),
            req,
            self.revision(),
        )
    }

    /// Puts `key = value` with `lease` (0: none); the previous pair is not read.
    pub fn put(
        &mut self,
        key: &[u8],
        value: &[u8],
        lease: LeaseId,
    ) -> Result<PutResponse, MvccError> {
        self.put_inner(key, value, lease, false)
    }

    /// Puts with every option of [`PutRequest`].
    pub fn put_with(&mut self, req: &PutRequest) -> Result<PutResponse, MvccError> {
        self.put_inner(&req.key, &req.value, req.lease, req.prev_kv)
    }

    fn put_inner(
        &mut self,
        key: &[u8],
        value: &[u8],
        lease: LeaseId,
        want_prev: bool,
    ) -> Result<PutResponse, MvccError> {
        if key.is_empty() {
            return Err(MvccError::EmptyKey);
        }
        self.check_size(key.len() + value.len())?;
        let rev = Revision::new(self.base + 1, self.next_sub);
        let (prev, prev_kv) = if want_prev {
            let prev = self.inner.index.read().keys.get(key, rev.main);
            let prev_kv = match prev {
                Some(p) => self.fetch(&[p.modified])?.pop(),
                None => None,
            };
            (self.index_put(key, rev), prev_kv)
        } else {
            (self.index_put(key, rev), None)
        };
        let (create_revision, version) = match prev {
            Some(p) => (p.created, p.version + 1),
            None => (rev.main, 1),
        };
        let staged = &mut self.scratch.staged;
        let record = encode_parts(
            &mut staged.records,
            key,
            value,
            create_revision,
            rev.main,
            version,
            lease,
        );
        self.next_sub += 1;
        staged.revs.push(PendingRev {
            rev,
            tombstone: false,
            record,
        });
        staged.writes += 1;
        self.scratch.prev_revs.push(prev.map(|p| p.modified));
        Ok(PutResponse {
            revision: rev.main,
            prev_kv,
        })
    }

    /// Records a put of `key` at `rev` in the key index; returns the key's state just before.
    ///
    /// A key already in the index changes in place under the index's read lock (see
    /// [`Slot`](crate::key_index::Slot)): a long scan holding the read lock does not hold the
    /// put up. Every taker of the write lock holds the writer mutex, as this transaction
    /// does, so no writer queued for the write lock stands in the read lock's way either.
    /// Only a new key takes the write lock. When the write lock is free (no scan holds the
    /// read lock), the put takes it at once, without waiting: one search of the index finds
    /// the key or where to add it, instead of a search under the read lock that misses for a
    /// new key and a second one under the write lock.
    fn index_put(&self, key: &[u8], rev: Revision) -> Option<KeyAt> {
        if let Some(mut idx) = self.inner.index.try_write() {
            return idx.keys.get_and_put(key, rev.main, rev);
        }
        if let Some(prev) = self
            .inner
            .index
            .read()
            .keys
            .get_and_put_existing(key, rev.main, rev)
        {
            return prev;
        }
        self.inner
            .index
            .write()
            .keys
            .get_and_put(key, rev.main, rev)
    }

    /// Deletes `key`, or `[key, end)` (etcd range conventions); the deleted pairs are not read.
    pub fn delete_range(
        &mut self,
        key: &[u8],
        end: Option<&[u8]>,
    ) -> Result<DeleteResponse, MvccError> {
        self.delete_inner(key, end, false)
    }

    /// Deletes with every option of [`DeleteRangeRequest`].
    pub fn delete_with(&mut self, req: &DeleteRangeRequest) -> Result<DeleteResponse, MvccError> {
        self.delete_inner(&req.key, req.range_end.as_deref(), req.prev_kv)
    }

    fn delete_inner(
        &mut self,
        key: &[u8],
        end: Option<&[u8]>,
        want_prev: bool,
    ) -> Result<DeleteResponse, MvccError> {
        check_range(key, end)?;
        self.check_size(key.len() + end.map_or(0, <[u8]>::len))?;
        let at = self.base + 1;
        let mut victims = Vec::new();
        scan_live(self.inner, key, &bound(end), at, &|| {}, |k, state| {
            victims.push((k.to_vec(), state.modified));
        })?;
        let prev_kvs = if want_prev {
            let revs: Vec<Revision> = victims.iter().map(|(_, r)| *r).collect();
            self.fetch(&revs)?
        } else {
            Vec::new()
        };
        // Tombstones change keys already in the index, in place (see `index_put`).
        for chunk in victims.chunks(crate::store::INDEX_CHUNK) {
            let idx = self.inner.index.read();
            for (k, prev) in chunk {
                let rev = Revision::new(at, self.next_sub);
                idx.keys.tombstone(k, rev);
                self.next_sub += 1;
                let staged = &mut self.scratch.staged;
                let record = encode_parts(&mut staged.records, k, &[], 0, at, 0, 0);
                staged.revs.push(PendingRev {
                    rev,
                    tombstone: true,
                    record,
                });
                staged.writes += 1;
                self.scratch.prev_revs.push(Some(*prev));
            }
        }
        Ok(DeleteResponse {
            revision: self.revision(),
            deleted: victims.len(),
            prev_kvs,
        })
    }

    /// Runs a transaction request inside this write transaction.
    pub fn txn(&mut self, req: &TxnRequest) -> Result<TxnResponse, MvccError> {
        crate::txn::run(self, req)
    }

    /// Sets `key = value` in auxiliary `bucket` (e.g. "lease", "members"), committed in the
    /// same backend batch as this transaction's key changes. The store's own buckets ("key",
    /// "meta") are refused.
    pub fn put_aux(&mut self, bucket: &Bucket, key: &[u8], value: &[u8]) -> Result<(), MvccError> {
        check_aux_bucket(bucket)?;
        self.check_size(key.len() + value.len())?;
        self.scratch
            .staged
            .aux
            .entry(bucket.clone())
            .or_default()
            .insert(key.to_vec(), Some(value.to_vec()));
        self.scratch.staged.writes += 1;
        Ok(())
    }

    /// Deletes `key` from auxiliary `bucket`, in the same backend batch as this transaction.
    pub fn delete_aux(&mut self, bucket: &Bucket, key: &[u8]) -> Result<(), MvccError> {
        check_aux_bucket(bucket)?;
        self.check_size(key.len())?;
        self.scratch
            .staged
            .aux
            .entry(bucket.clone())
            .or_default()
            .insert(key.to_vec(), None);
        self.scratch.staged.writes += 1;
        Ok(())
    }

    /// Records that this transaction applies Raft entry `index`; stored in the same backend
    /// batch. Refused when `index` is not above the store's
    /// [`consistent_index`](crate::Store::consistent_index) (nor above an index already set on
    /// this transaction).
    pub fn set_consistent_index(&mut self, index: u64) -> Result<(), MvccError> {
        let applied = self
            .inner
            .consistent_index
            .load(Ordering::Acquire)
            .max(self.consistent_index.unwrap_or(0));
        if index <= applied {
            return Err(MvccError::IndexAlreadyApplied { index, applied });
        }
        self.consistent_index = Some(index);
        Ok(())
    }

    /// Ends the transaction: its changes become visible to every reader opened from now on
    /// and to watchers, and are queued for the next backend batch. Returns the store's
    /// revision. Fails only when an earlier backend commit failed (the store is poisoned); the
    /// transaction is then discarded.
    pub fn commit(mut self) -> Result<u64, MvccError> {
        self.inner.check_poisoned()?;
        let changed = !self.scratch.staged.revs.is_empty();
        let revision = self.revision();
        if let Some(ci) = self.consistent_index {
            self.scratch
                .staged
                .meta
                .insert(META_CONSISTENT_INDEX, ci.to_be_bytes().to_vec());
            self.scratch.staged.writes += 1;
        }
        let notify = changed && self.inner.watch.has_watchers();
        let (buf, start, pending_writes) = {
            let mut st = self.inner.state.lock();
            let (start, writes) = {
                let mut current = st.current.changes.write();
                let start = current.revs.len();
                current.absorb_from(&mut self.scratch.staged);
                (start, current.writes)
            };
            st.revision = revision;
            if let Some(ci) = self.consistent_index {
                self.inner.consistent_index.store(ci, Ordering::Release);
            }
            // The buffer is only needed past the lock to notify watchers.
            (notify.then(|| st.current.clone()), start, writes)
        };
        self.scratch.revision = revision;
        self.done = true;
        let held = &self.inner.opened_leases_held;
        if changed && held.load(Ordering::Relaxed) && held.swap(false, Ordering::Relaxed) {
            // The leased keys noted at open no longer describe the store: free them.
            *self.inner.opened_leases.lock() = None;
        }
        if let Some(buf) = buf {
            self.inner
                .watch
                .notify(self.inner, revision, buf, start, &self.scratch.prev_revs);
        }
        let limit = self.inner.options.batch_limit;
        if pending_writes >= limit {
            if !self.inner.commit_requested.swap(true, Ordering::AcqRel) {
                let _ = self.inner.committer.send(Signal::Commit);
            }
            if pending_writes >= limit.saturating_mul(8) {
                // The committer makes no progress (it has not even taken the buffer since
                // the last commit ended): commit here so memory stays bounded.
                if let Err(e) = self.inner.commit_pending() {
                    tracing::error!(error = %e, "backend commit from a writer failed");
                }
            } else if pending_writes >= limit.saturating_mul(4) {
                // The committer is behind: wait for the commit it is running to end, then go
                // on while it commits this buffer. Writes keep overlapping backend commits
                // (and their fsyncs) instead of stopping for a commit of their own; memory
                // holds at most the buffer being committed and this one.
                drop(self.inner.lock_commits());
            }
        }
        Ok(revision)
    }
}

impl<B: Backend> Drop for WriteTxn<'_, B> {
    fn drop(&mut self) {
        if !self.done && !self.scratch.staged.revs.is_empty() {
            // In place, as the changes were made; keys left with no history (created by
            // this transaction) are then dropped under the write lock.
            let mut emptied = Vec::new();
            {
                let idx = self.inner.index.read();
                let staged = &self.scratch.staged;
                for p in staged.revs.iter().rev() {
                    if let Ok(rec) = decode_record(p.rev, staged.record(p))
                        && idx.keys.rollback(rec.key, p.rev)
                    {
                        emptied.push(rec.key);
                    }
                }
            }
            if !emptied.is_empty() {
                let mut idx = self.inner.index.write();
                for key in emptied {
                    idx.keys.remove_if_empty(key);
                }
            }
        }
        self.scratch.clear();
        self.inner.writers.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The buffers write transactions stage their changes in, kept under the writer mutex and
/// reused from one transaction to the next (a put allocates no staging vectors).
pub(crate) struct WriteScratch {
    staged: Changes,
    /// Per staged revision: the key's revision just before it (for watchers' `prev_kv`).
    prev_revs: Vec<Option<Revision>>,
    /// The store's published revision, which only write transactions change (under the
    /// writer mutex), so a transaction starts from it without the state lock.
    revision: u64,
}

impl WriteScratch {
    /// Staged changes beyond this many are not kept for reuse.
    const KEEP: usize = 1024;

    /// Empty buffers, for a store at `revision`.
    pub(crate) fn at(revision: u64) -> WriteScratch {
        WriteScratch {
            staged: Changes::default(),
            prev_revs: Vec::new(),
            revision,
        }
    }

    fn clear(&mut self) {
        let s = &mut self.staged;
        s.revs.clear();
        s.records.clear();
        if !s.aux.is_empty() {
            s.aux.clear();
        }
        if !s.meta.is_empty() {
            s.meta.clear();
        }
        s.writes = 0;
        self.prev_revs.clear();
        if s.revs.capacity() > Self::KEEP {
            s.revs = Vec::new();
            self.prev_revs = Vec::new();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::mpsc;
    use std::time::Duration;

    use crate::store::mem_store;
    use crate::{RangeRequest, StoreOptions};

    /// A scan holds the key index's read lock while it walks a chunk: puts onto keys already
    /// in the index, deletes, and a transaction rolled back all go through while it is held;
    /// only a new key waits for the write lock.
    #[test]
    fn changes_to_existing_keys_do_not_wait_for_the_index_read_lock() {
        let (_dir, s) = mem_store(StoreOptions::default());
        let s = Arc::new(s);
        for k in [b"a", b"b", b"c"] {
            s.put(k, b"v1", 0).expect("put");
        }
        let held = s.inner.index.read();
        let (done_tx, done) = mpsc::channel();
        let writer = {
            let s = s.clone();
            std::thread::spawn(move || {
                s.put(b"a", b"v2", 0).expect("put");
                s.delete_range(b"b", None).expect("delete");
                let mut t = s.write();
                t.put(b"c", b"never", 0).expect("put");
                drop(t);
                done_tx.send(()).expect("send");
                // A new key needs the write lock.
                s.put(b"d", b"v1", 0).expect("put");
                done_tx.send(()).expect("send");
            })
        };
        done.recv_timeout(Duration::from_secs(10))
            .expect("changes to existing keys waited for the read lock");
        assert!(
            done.recv_timeout(Duration::from_millis(100)).is_err(),
            "a new key was added under a read lock"
        );
        drop(held);
        done.recv_timeout(Duration::from_secs(10))
            .expect("the new key's put");
        writer.join().expect("writer");
        let all = s
            .range(&RangeRequest::range(b"a".to_vec(), vec![0]))
            .expect("range");
        let pairs: Vec<(&[u8], &[u8], u64)> = all
            .kvs
            .iter()
            .map(|kv| (kv.key(), kv.value(), kv.version))
            .collect();
        assert_eq!(
            pairs,
            [
                (&b"a"[..], &b"v2"[..], 2),
                (&b"c"[..], &b"v1"[..], 1),
                (&b"d"[..], &b"v1"[..], 1)
            ]
        );
        assert_eq!(s.current_revision(), 6);
    }

    /// A transaction that creates a key and is dropped leaves no trace of it in the index.
    #[test]
    fn a_rolled_back_new_key_leaves_the_index() {
        let (_dir, s) = mem_store(StoreOptions::default());
        s.put(b"a", b"v1", 0).expect("put");
        let mut t = s.write();
        t.put(b"new", b"v", 0).expect("put");
        t.put(b"a", b"v2", 0).expect("put");
        t.delete_range(b"new", None).expect("delete");
        drop(t);
        assert_eq!(s.key_count(), 1);
        let r = s.range(&RangeRequest::key(b"a".to_vec())).expect("range");
        assert_eq!((r.kvs[0].value(), r.kvs[0].version), (&b"v1"[..], 1));
        s.put(b"new", b"w", 0).expect("put");
        let r = s.range(&RangeRequest::key(b"new".to_vec())).expect("range");
        assert_eq!((r.kvs[0].create_revision, r.kvs[0].version), (2, 1));
    }
}
