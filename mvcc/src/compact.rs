//! Compaction and the history hash.
//!
//! `compact(c)` is etcd's: under the writer lock it checks `c` and records
//! `scheduled_compact_rev = c` in the pending meta writes (reads below `c` fail from then
//! on); it compacts the key index a chunk of keys per hold of the writer and index locks, so
//! that reads and writes go on meanwhile (compactions themselves run one at a time); it then
//! commits the pending buffer, so the compaction point is durable and every revision `<= c`
//! is in the backend. The compactor thread deletes from the `key` bucket, in batches of
//! `compaction_batch_limit` with a pause between them, every revision `<= c` that the index
//! compaction did not keep, and finally records `finished_compact_rev = c`. A store opened
//! with `scheduled > finished` compacts again (deleting what is left is idempotent).
//!
//! Before each batch the compactor waits while a read view below `c` is open: such a view
//! may still be reading, from fresh backend read transactions, revisions that this
//! compaction deletes (see `read`). Compactions queued meanwhile do not pile up behind it:
//! the newest takes the place of the waiting one, whose deletions it covers.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError};
use parking_lot::{MutexGuard, RwLockReadGuard, RwLockWriteGuard};

use crate::backend::{Backend, ReadTxn, WriteBatch};
use crate::error::MvccError;
use crate::kv::hash_as_format_1;
use crate::read::ReadView;
use crate::request::HashKv;
use crate::revision::Revision;
use crate::store::{Inner, KEY_BUCKET, META_BUCKET, META_FINISHED_COMPACT, META_SCHEDULED_COMPACT};

/// Keys of the index compacted per hold of its write lock: a read waits at most about this
/// many keys' compaction (some hundreds of microseconds) for its read lock.
const INDEX_COMPACT_CHUNK: usize = 4096;

/// Keys of the index walked per hold of its read lock by [`hash_kv`], for what a compaction
/// keeps: a write adding a key (which takes the write lock) waits at most about this many
/// keys' walk (some hundreds of microseconds).
const INDEX_KEEP_CHUNK: usize = 4096;

/// How often the compactor looks again while an open view pins history it would delete.
const PIN_POLL: Duration = Duration::from_millis(5);

/// The longest pause between two tries at reading a batch (the first is
/// [`StoreOptions::compaction_retry_pause`](crate::StoreOptions::compaction_retry_pause)).
const READ_RETRY_PAUSE_MAX: Duration = Duration::from_secs(1);

/// Physical deletion work for the compactor thread; revision 0 stops the thread.
pub(crate) struct CompactJob {
    pub revision: u64,
    pub available: HashSet<Revision>,
}

impl CompactJob {
    pub fn shutdown() -> CompactJob {
        CompactJob {
            revision: 0,
            available: HashSet::new(),
        }
    }
}

pub(crate) fn compact<B: Backend>(inner: &Arc<Inner<B>>, revision: u64) -> Result<(), MvccError> {
    // One compaction at a time: each compacts the index from where the one before left it,
    // and its kept set holds all that a newer one's does (see `take_newer`).
    let _one = inner.compaction.lock();
    let keys = {
        let _writer = inner.write_lock.lock();
        inner.check_poisoned()?;
        let compacted = inner.compacted.load(Ordering::Acquire);
        if revision <= compacted {
            return Err(MvccError::Compacted {
                requested: revision,
                compacted,
            });
        }
        let st = inner.state.lock();
        if revision > st.revision {
            return Err(MvccError::FutureRevision {
                requested: revision,
                current: st.revision,
            });
        }
        let mut c = st.current.changes.write();
        c.meta
            .insert(META_SCHEDULED_COMPACT, revision.to_be_bytes().to_vec());
        c.writes += 1;
        drop(c);
        drop(st);
        let mut idx = inner.index.write();
        idx.compacted = revision;
        inner.compacted.store(revision, Ordering::Release);
        idx.keys.len()
    };
    // The index is compacted some keys at a time, with the writer lock and the index lock
    // released in between, so reads and writes go on meanwhile. Reads at `revision` or later
    // (earlier ones fail from now on) find the same answers through a partly compacted
    // index; a write transaction runs wholly between two chunks, and its changes all have
    // later revisions, which compaction leaves alone, so a key it adds or changes is
    // compacted alike whether the chunk that reaches it comes before or after. A key keeps
    // one revision at most, and keys added meanwhile keep none: the revisions kept go into
    // a vector that never grows (and moves) past this capacity with a lock held, and is
    // written in order, so a chunk takes the page faults of its own share of it only (a set
    // sized for every key takes those of most of its memory in the first chunk: with 300 000
    // keys, some 1 800 faults and over 4 ms under both locks). The set the compactor looks
    // revisions up in is made from it once no lock is held.
    let mut kept = Vec::with_capacity(keys);
    let mut from: Option<Vec<u8>> = None;
    loop {
        let writer = inner.write_lock.lock();
        let mut idx = inner.index.write();
        from = idx
            .keys
            .compact_some(revision, from.as_deref(), INDEX_COMPACT_CHUNK, &mut kept);
        // Handed to the reads and writes waiting, if any, before this thread takes them
        // again.
        RwLockWriteGuard::unlock_fair(idx);
        MutexGuard::unlock_fair(writer);
        if from.is_none() {
            break;
        }
    }
    let available: HashSet<Revision> = kept.into_iter().collect();
    inner.commit_pending()?;
    let _ = inner.compactor.send(CompactJob {
        revision,
        available,
    });
    Ok(())
}

/// The compactor thread; `stop` disconnects when the store is dropped, which also cuts the
/// pauses between batches and between tries short.
///
/// Jobs queued while one waits (for a read view below it, or between its batches) are not
/// run one after another: the newest takes the place of the running one (see [`take_newer`]),
/// so the queue, and the kept-revision sets its jobs hold, stay bounded however many
/// compactions an open view holds back.
///
/// A job whose reads of what to delete keep failing is given up after `compaction_read_tries`
/// (see [`delete_compacted`]): the next compaction deletes what it would have (it deletes
/// everything older ones do, from the start), and so does the next open (the compaction
/// point is recorded as scheduled, not finished). A failed commit of deletions poisons the
/// store; the thread then deletes nothing more.
pub(crate) fn compactor_loop<B: Backend>(
    inner: &Inner<B>,
    rx: &Receiver<CompactJob>,
    stop: &Receiver<()>,
) {
    // The newest compaction this thread finished: a job at or below it has nothing left to
    // delete (a job can be queued after a newer one, by a `compact` that committed first).
    let mut finished = 0;
    while let Ok(mut job) = rx.recv() {
        if job.revision == 0 || inner.shutdown.load(Ordering::Acquire) {
            return;
        }
        if job.revision <= finished || inner.check_poisoned().is_err() {
            continue;
        }
        match delete_compacted(inner, &mut job, rx, stop) {
            Ok(true) => {
                finished = job.revision;
                inner
                    .compacted_physically
                    .fetch_max(job.revision, Ordering::AcqRel);
                tracing::debug!(revision = job.revision, "compaction finished");
            }
            Ok(false) => return,
            // Logged where the store was poisoned, by this job's commit or another.
            Err(_) if inner.check_poisoned().is_err() => {}
            Err(e) => tracing::error!(
                revision = job.revision,
                error = %e,
                tries = inner.options.compaction_read_tries,
                "compaction gave up reading what to delete; the next compaction or open \
                 deletes it"
            ),
        }
    }
}

/// Replaces `job` with the newest queued job when that is newer; `None` when a shutdown was
/// queued, else whether `job` was replaced.
///
/// A newer compaction deletes everything an older one does (the index compaction that made
/// its kept set started from the older one's), and `compact` recorded the newer point as
/// scheduled before queueing it, so a store reopened before it finished resumes it, older
/// points included. Nothing waits on a particular job: `finished_compact_rev` records the
/// newest point whose deletions are done.
fn take_newer(rx: &Receiver<CompactJob>, job: &mut CompactJob) -> Option<bool> {
    let mut replaced = false;
    while let Ok(next) = rx.try_recv() {
        if next.revision == 0 {
            return None;
        }
        if next.revision > job.revision {
            *job = next;
            replaced = true;
        }
    }
    Some(replaced)
}

/// Deletes what `job` does not keep, or what a newer queued job taking its place does not;
/// false when stopped by a shutdown (resumed on reopen).
///
/// A failed read of a batch of what to delete has written nothing of it: it is tried again,
/// from where it started, after a pause that doubles with each failure of the same batch
/// (from `compaction_retry_pause` up to [`READ_RETRY_PAUSE_MAX`]), and its error is returned
/// once `compaction_read_tries` tries failed.
/// The batches committed before it stay committed (deleting is idempotent). A failed commit
/// poisons the store (see [`Inner::poison`]) and is returned at once: the backend may hold
/// the batch or not, and a store that cannot tell what it holds writes nothing more.
fn delete_compacted<B: Backend>(
    inner: &Inner<B>,
    job: &mut CompactJob,
    rx: &Receiver<CompactJob>,
    stop: &Receiver<()>,
) -> Result<bool, MvccError> {
    let mut from: Vec<u8> = Vec::new();
    let limit = inner.options.compaction_batch_limit;
    // Failed tries at reading the batch starting at `from`.
    let mut failed: u32 = 0;
    loop {
        if inner.shutdown.load(Ordering::Acquire) {
            return Ok(false);
        }
        loop {
            match take_newer(rx, job) {
                None => return Ok(false),
                // The newer job keeps less: scan again from the start.
                Some(true) => {
                    from.clear();
                    failed = 0;
                }
                Some(false) => {}
            }
            // Wait while a view below the job is open: it may still read what the job deletes.
            if inner.oldest_view().is_none_or(|r| r >= job.revision) {
                break;
            }
            if inner.shutdown.load(Ordering::Acquire) {
                return Ok(false);
            }
            if let Err(RecvTimeoutError::Disconnected) = stop.recv_timeout(PIN_POLL) {
                return Ok(false);
            }
        }
        let (batch, next) = match read_batch(inner, job, &from, limit) {
            Ok(read) => read,
            Err(e) => {
                failed += 1;
                if failed >= inner.options.compaction_read_tries {
                    return Err(e);
                }
                let pause = inner
                    .options
                    .compaction_retry_pause
                    .saturating_mul(1 << (failed - 1).min(16))
                    .min(READ_RETRY_PAUSE_MAX);
                tracing::warn!(
                    revision = job.revision,
                    error = %e,
                    failures = failed,
                    ?pause,
                    "compaction failed to read what to delete; trying again after a pause"
                );
                if let Err(RecvTimeoutError::Disconnected) = stop.recv_timeout(pause) {
                    return Ok(false);
                }
                // From the top: a shutdown, a newer job or a view opened meanwhile first.
                continue;
            }
        };
        failed = 0;
        if !batch.is_empty() {
            commit_deletions(inner, job.revision, &batch)?;
        }
        match next {
            Some(n) => {
                from = n;
                if let Err(RecvTimeoutError::Disconnected) =
                    stop.recv_timeout(inner.options.compaction_sleep_interval)
                {
                    return Ok(false);
                }
            }
            None => break,
        }
    }
    let mut batch = WriteBatch::new();
    batch.put(
        &META_BUCKET,
        META_FINISHED_COMPACT.to_vec(),
        job.revision.to_be_bytes().to_vec(),
    );
    commit_deletions(inner, job.revision, &batch)?;
    Ok(true)
}

/// The next batch of what `job` deletes, from `from` on (at most `limit` deletions), and
/// the key to go on from, if any is left.
fn read_batch<B: Backend>(
    inner: &Inner<B>,
    job: &CompactJob,
    from: &[u8],
    limit: usize,
) -> Result<(WriteBatch, Option<Vec<u8>>), MvccError> {
    let end = Revision::new(job.revision.saturating_add(1), 0).to_bytes();
    let mut batch = WriteBatch::new();
    let txn = inner.backend.read_txn()?;
    for item in txn.range(&KEY_BUCKET, from, Some(&end[..]))? {
        let (k, _) = item?;
        let Some((rev, _)) = Revision::from_key(k) else {
            continue;
        };
        if !job.available.contains(&rev) {
            batch.delete(&KEY_BUCKET, k.to_vec());
            if batch.len() >= limit {
                let mut after = k.to_vec();
                after.push(0);
                return Ok((batch, Some(after)));
            }
        }
    }
    Ok((batch, None))
}

/// Commits a batch of the compaction at `revision` under the store's commit lock, unless
/// the store is poisoned; a failure poisons it, as a failed commit of writes does.
fn commit_deletions<B: Backend>(
    inner: &Inner<B>,
    revision: u64,
    batch: &WriteBatch,
) -> Result<(), MvccError> {
    let _c = inner.lock_commits();
    inner.check_poisoned()?;
    inner.backend.commit(batch).map_err(|e| {
        tracing::error!(
            revision,
            error = %e,
            "compaction's backend commit failed; store is poisoned"
        );
        inner.poison(format!("compaction at revision {revision}: {e}"));
        e.into()
    })
}

/// The hash of the history up to `revision` (0: the current one), as a compaction at the
/// store's compaction point leaves it: see [`HashKv`].
pub(crate) fn hash_kv<B: Backend>(
    inner: &Arc<Inner<B>>,
    revision: u64,
) -> Result<HashKv, MvccError> {
    let view = ReadView::open(inner)?;
    let current = view.revision();
    if revision > current {
        return Err(MvccError::FutureRevision {
            requested: revision,
            current,
        });
    }
    let rev = if revision == 0 { current } else { revision };
    // The compaction point and what it keeps are read before the scan opens its backend read
    // transaction, and the compactor does not wait for this view (it reads at or above any
    // compaction point), so a newer compaction's deletions may land in between: hashing them
    // under the older point gives a hash of neither state. After the scan the point is read
    // again: a compaction's deletions follow its update of the point, and a read transaction
    // opened after them sees them, so if the scan saw any deletion of a newer compaction the
    // point read there has moved, and the hash is taken again under it. An unchanged point
    // means the scan saw everything that compaction keeps, and records it deletes are skipped
    // whether the scan saw them or not. Each retry follows a newer compaction at or below
    // `rev`, so retries are bounded.
    loop {
        // What a compaction keeps at `rev`, walked some keys at a time with the index's lock
        // released in between, so writes adding keys go on meanwhile. Neither they (their
        // revisions are above `rev`) nor a compaction at or below `rev` change what is kept
        // at `rev` (see `keep_some`): the walk finds what it would in an index left alone.
        // A compaction above `rev` fails the next chunk, or the check after the scan.
        let mut kept = Vec::new();
        let mut compacted = None;
        let mut after: Option<Vec<u8>> = None;
        loop {
            let idx = inner.index.read();
            if rev < idx.compacted {
                return Err(MvccError::Compacted {
                    requested: rev,
                    compacted: idx.compacted,
                });
            }
            if compacted.is_none() {
                // At most one revision per key: `kept` never grows (and moves) with the
                // lock held.
                compacted = Some(idx.compacted);
                kept.reserve(idx.keys.len());
            }
            after = idx
                .keys
                .keep_some(rev, after.as_deref(), INDEX_KEEP_CHUNK, &mut kept);
            // Handed to the writes waiting, if any, before this thread takes it again.
            RwLockReadGuard::unlock_fair(idx);
            if after.is_none() {
                break;
            }
        }
        // The point the walk started under: a compaction that moved it since is caught by
        // the check after the scan.
        let compacted = compacted.unwrap_or_default();
        let keep: HashSet<Revision> = kept.into_iter().collect();
        let mut h = crc32fast::Hasher::new();
        h.update(KEY_BUCKET.name().as_bytes());
        view.sources(None)
            .for_each_change(Revision::default(), rev, |r, _, k, v| {
                if r.main <= compacted && !keep.contains(&r) {
                    return Ok(true);
                }
                h.update(k);
                hash_as_format_1(&mut h, r, v)?;
                Ok(true)
            })?;
        if inner.index.read().compacted == compacted {
            return Ok(HashKv {
                hash: h.finalize(),
                compact_revision: compacted,
                revision: rev,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use crate::backend::{Backend, ReadTxn};
    use crate::options::StoreOptions;
    use crate::store::{KEY_BUCKET, META_BUCKET, META_FINISHED_COMPACT, mem_store};

    /// Compactions issued while an open read view holds the compactor back do not each queue
    /// a job holding the set of every kept revision: the newest replaces the others, and once
    /// the view is gone it deletes what they all would have.
    #[test]
    fn compaction_jobs_behind_an_open_view_do_not_pile_up() {
        let (_d, s) = mem_store(StoreOptions::default());
        for i in 0..10_000u32 {
            s.put(format!("k{i:05}").as_bytes(), b"v", 0).unwrap();
        }
        let view = s.read().unwrap(); // at 10 000
        for round in 0..20u32 {
            s.put(b"k00000", round.to_string().as_bytes(), 0).unwrap();
            s.compact(s.current_revision()).unwrap();
        }
        std::thread::sleep(Duration::from_millis(100));
        let queued = s.inner.compactor.len();
        drop(view);
        assert!(
            queued <= 1,
            "{queued} compaction jobs queued behind the view, each holding a set of 10 000 \
             kept revisions"
        );
        let last = s.current_revision();
        let finished = || {
            s.backend()
                .read_txn()
                .unwrap()
                .get(&META_BUCKET, META_FINISHED_COMPACT)
                .unwrap()
                .map(<[u8]>::to_vec)
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while finished() != Some(last.to_be_bytes().to_vec()) {
            assert!(
                Instant::now() < deadline,
                "the newest compaction never finished"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        // One revision per key: the 20 overwritten puts of k00000 and its first are gone.
        assert_eq!(s.backend().len(&KEY_BUCKET), 10_000);
    }
}
