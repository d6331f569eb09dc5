//! The store: open and rebuild, the shared state, the background committer, and the
//! operations that are shorthands for one read view or one write transaction.
//!
//! Buckets used by the store (auxiliary writes may use any other name):
//!
//! ```text
//! key   revision key (see `revision`) -> change record (see `kv`)
//! meta  "format"                -> u32 big-endian, = 1
//!       "consistent_index"      -> u64 big-endian, last Raft index applied
//!       "scheduled_compact_rev" -> u64 big-endian, compaction point recorded by `compact`
//!       "finished_compact_rev"  -> u64 big-endian, last compaction fully deleted
//! ```
//!
//! Concurrency: write transactions are serialised by one mutex and apply their changes to the
//! key index at once (at the next revision, which readers do not look at until it is
//! published; changes to keys already in the index in place, under the index's read lock, see
//! `key_index::Slot`) and to a private buffer; `commit` appends that buffer to the shared pending
//! buffer and publishes the revision under the short `state` lock. Readers take the `state`
//! lock only to copy the published revision and the `Arc`s of the pending buffers, then read
//! the key index in short chunks. Backend commits run on the committer thread (every
//! `batch_interval`, when `batch_limit` writes are pending, or for `force_commit` callers,
//! back to back while callers wait) under their own lock, so neither readers nor writers wait
//! for them.

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use parking_lot::{Condvar, Mutex, MutexGuard, RwLock};

use crate::backend::{Backend, Bucket, ReadTxn};
use crate::compact::CompactJob;
use crate::error::MvccError;
use crate::key_index::KeyIndex;
use crate::kv::LeaseId;
use crate::options::StoreOptions;
use crate::pending::{ChunkPool, Pending};
use crate::read::ReadView;
use crate::rebuild::IndexBuilder;
use crate::request::{
    DeleteRangeRequest, DeleteResponse, HashKv, PutRequest, PutResponse, RangeRequest,
    RangeResponse, TxnRequest, TxnResponse,
};
use crate::watch::{WatchHub, WatchRequest, WatchStream, Watcher};
use crate::write::{WriteScratch, WriteTxn};

/// Bucket of the revision-keyed changes.
pub const KEY_BUCKET: Bucket = Bucket::new("key");
/// Bucket of the store's metadata.
pub const META_BUCKET: Bucket = Bucket::new("meta");

pub(crate) const META_FORMAT: &[u8] = b"format";
pub(crate) const META_CONSISTENT_INDEX: &[u8] = b"consistent_index";
pub(crate) const META_SCHEDULED_COMPACT: &[u8] = b"scheduled_compact_rev";
pub(crate) const META_FINISHED_COMPACT: &[u8] = b"finished_compact_rev";
/// Store format written and read by this build.
pub const STORE_FORMAT: u32 = 1;

/// `force_commit` callers a commit wakes, and each woken caller wakes in turn (see
/// `Inner::wake_durable_from`).
const WAKE_FANOUT: usize = 2;

/// Keys visited per hold of the key-index read lock: a writer adding a key (or compaction)
/// waits at most about one chunk of a scan (some 10 µs, unless the scan's thread loses its
/// CPU in the chunk) for the write lock; writes to keys already in the index do not wait.
pub(crate) const INDEX_CHUNK: usize = 64;

pub(crate) struct IndexState {
    pub keys: KeyIndex,
    /// Compaction point: reads below it fail.
    pub compacted: u64,
}

pub(crate) struct State {
    /// Published revision.
    pub revision: u64,
    /// Buffer that write transactions append to.
    pub current: Arc<Pending>,
    /// Buffer being committed to the backend (kept after a failed commit).
    pub committing: Option<Arc<Pending>>,
}

/// The revision at open and the live keys that carried a lease then.
pub(crate) type OpenedLeases = Option<(u64, std::collections::HashMap<Vec<u8>, LeaseId>)>;

pub(crate) enum Signal {
    Commit,
    Shutdown,
}

pub(crate) struct Inner<B: Backend> {
    pub backend: B,
    pub options: StoreOptions,
    pub write_lock: Mutex<WriteScratch>,
    pub index: RwLock<IndexState>,
    pub state: Mutex<State>,
    /// Held while a batch goes to the backend; take it with [`Inner::lock_commits`].
    commit_lock: Mutex<()>,
    /// Held by a compaction from its checks until its job is queued: one at a time.
    pub compaction: Mutex<()>,
    /// How many times `commit_lock` was released, with the condition callers waiting for a
    /// running commit to end wait on.
    commits_ended: (Mutex<u64>, Condvar),
    /// Write buffers taken for a backend commit so far (taken under `state` and
    /// `commit_lock`, numbered from 1).
    buffers_taken: AtomicU64,
    /// The number of the newest taken buffer whose backend commit succeeded: every write
    /// acknowledged before that buffer was taken is durable.
    buffers_durable: AtomicU64,
    /// The newest buffer number a [`Store::force_commit`] caller waits to see durable: the
    /// committer thread commits back to back while it is above `buffers_durable`.
    buffers_wanted: AtomicU64,
    /// The `force_commit` callers parked until their buffer is durable: (buffer number,
    /// thread). The callers a commit made durable are unparked directly (a few by the
    /// commit, the rest by callers already woken: see [`Inner::wake_durable_from`]), not one
    /// after another through a shared lock, and those waiting for a later buffer sleep on.
    durable_waits: Mutex<Vec<(u64, std::thread::Thread)>>,
    pub consistent_index: AtomicU64,
    pub compacted: AtomicU64,
    /// The newest compaction point whose superseded revisions are deleted from the backend
    /// (its `finished_compact_rev`).
    pub compacted_physically: AtomicU64,
    pub poisoned: Mutex<Option<String>>,
    /// `poisoned` holds a reason: checked without taking its lock on every write.
    pub is_poisoned: AtomicBool,
    pub committer: Sender<Signal>,
    pub compactor: Sender<CompactJob>,
    pub shutdown: AtomicBool,
    /// A commit signal is in flight to the committer.
    pub commit_requested: AtomicBool,
    /// Revisions of open read views, with how many views read at each: compaction's physical
    /// deletion waits while a view below its revision is open (see `read`).
    pub view_pins: Mutex<std::collections::BTreeMap<u64, usize>>,
    pub watch: WatchHub,
    /// The revision at open and the leased live keys then, until taken (see
    /// [`Store::take_opened_leases`]) or dropped by the first write.
    pub opened_leases: Mutex<OpenedLeases>,
    /// `opened_leases` still holds a list (the first write drops it: it no longer applies).
    pub opened_leases_held: AtomicBool,
    /// Write transactions begun and not yet ended (waiting for the writer mutex or holding
    /// it): long reads yield the CPU to them between chunks (see `read`).
    pub writers: std::sync::atomic::AtomicUsize,
    /// Write transactions begun since open: a long read that sees it move knows writes flow
    /// (see `pace`).
    pub write_txns: AtomicU64,
    /// Sleeps paced long reads took (see `pace`).
    pub read_sleeps: AtomicU64,
    /// Their total length, in nanoseconds.
    pub read_slept_ns: AtomicU64,
    /// Whether long reads pace themselves, as the last probe found (see `pace`).
    pub pace_verdict: Mutex<Option<crate::pace::Verdict>>,
    /// Where the write buffers' chunks come from and go back to (see `pending`).
    pub chunk_pool: Arc<ChunkPool>,
}

/// A revisioned key-value store over a [`Backend`]. `Send + Sync`; share it with an `Arc`.
///
/// Writes are acknowledged once they are in memory and visible to every later read; the
/// backend receives them in batches (see [`StoreOptions::batch_interval`]), each batch with the
/// consistent index it covers. Durability comes from the caller's write-ahead log: after a
/// crash, reopen, read [`consistent_index`](Store::consistent_index) and re-apply later
/// entries. [`force_commit`](Store::force_commit) makes everything acknowledged so far durable.
pub struct Store<B: Backend> {
    pub(crate) inner: Arc<Inner<B>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Dropped on shutdown to wake the compactor from its pause.
    stop: Mutex<Option<Sender<()>>>,
}

fn meta_u64(txn: &impl ReadTxn, key: &'static [u8]) -> Result<u64, MvccError> {
    match txn.get(&META_BUCKET, key)? {
        None => Ok(0),
        Some(v) if v.len() == 8 => {
            let mut b = [0u8; 8];
            b.copy_from_slice(v);
            Ok(u64::from_be_bytes(b))
        }
        Some(v) => Err(MvccError::BadMeta {
            key: String::from_utf8_lossy(key).into_owned(),
            reason: format!("expected 8 bytes, found {}", v.len()),
        }),
    }
}

impl<B: Backend> crate::pace::Activity for Inner<B> {
    fn options(&self) -> &StoreOptions {
        &self.options
    }

    fn writes_waiting(&self) -> bool {
        self.writers.load(Ordering::Relaxed) > 0 || self.durability_wanted()
    }

    fn write_txns(&self) -> u64 {
        self.write_txns.load(Ordering::Relaxed)
    }

    fn committing(&self) -> bool {
        self.commit_lock.is_locked()
    }

    fn slept(&self, d: std::time::Duration) {
        self.read_sleeps.fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.read_slept_ns.fetch_add(ns, Ordering::Relaxed);
    }

    fn verdict(&self) -> Option<crate::pace::Verdict> {
        *self.pace_verdict.lock()
    }

    fn set_verdict(&self, verdict: crate::pace::Verdict) {
        *self.pace_verdict.lock() = Some(verdict);
    }
}

impl<B: Backend> Store<B> {
    /// Opens a store over `backend`: rebuilds the key index from the backend, and resumes a
    /// compaction that a crash interrupted.
    pub fn open(backend: B, options: StoreOptions) -> Result<Store<B>, MvccError> {
        options.validate()?;
        let mut built = IndexBuilder::new();
        {
            let txn = backend.read_txn()?;
            for item in txn.range(&KEY_BUCKET, &[], None)? {
                let (k, v) = item?;
                built.add(k, v)?;
            }
        }
        Self::open_rebuilt(backend, options, built)
    }

    /// Opens a store over `backend` with the key index already rebuilt from every record of
    /// its `key` bucket (see [`IndexBuilder`]: a restore that showed the builder each pair as
    /// it loaded them), instead of reading them all back. The index must come from exactly
    /// this backend's content; a builder that met a damaged record fails here.
    pub fn open_rebuilt(
        backend: B,
        options: StoreOptions,
        built: IndexBuilder,
    ) -> Result<Store<B>, MvccError> {
        options.validate()?;
        if let Some(e) = built.error {
            return Err(e);
        }
        let txn = backend.read_txn()?;
        let format = match txn.get(&META_BUCKET, META_FORMAT)? {
            None => None,
            Some(v) if v.len() == 4 => Some(u32::from_be_bytes([v[0], v[1], v[2], v[3]])),
            Some(v) => {
                return Err(MvccError::BadMeta {
                    key: "format".to_owned(),
                    reason: format!("expected 4 bytes, found {}", v.len()),
                });
            }
        };
        if let Some(f) = format
            && f != STORE_FORMAT
        {
            return Err(MvccError::BadMeta {
                key: "format".to_owned(),
                reason: format!("store format {f}; this build reads format {STORE_FORMAT}"),
            });
        }
        let consistent_index = meta_u64(&txn, META_CONSISTENT_INDEX)?;
        let scheduled = meta_u64(&txn, META_SCHEDULED_COMPACT)?;
        let finished = meta_u64(&txn, META_FINISHED_COMPACT)?;
        let IndexBuilder {
            mut keys,
            mut revision,
            leases,
            ..
        } = built;
        drop(txn);
        revision = revision.max(scheduled);
        let mut job = None;
        if scheduled > 0 {
            let available = keys.compact(scheduled);
            if scheduled > finished {
                job = Some(CompactJob {
                    revision: scheduled,
                    available,
                });
            }
        }

        let chunk_pool = Arc::new(ChunkPool::default());
        let current = Pending::with_capacity(0, chunk_pool.clone());
        if format.is_none() {
            let mut c = current.changes.write();
            c.meta
                .insert(META_FORMAT, STORE_FORMAT.to_be_bytes().to_vec());
            c.writes += 1;
        }
        let (commit_tx, commit_rx) = crossbeam_channel::unbounded();
        let (compact_tx, compact_rx) = crossbeam_channel::unbounded();
        let inner = Arc::new(Inner {
            backend,
            watch: WatchHub::new(&options),
            options,
            write_lock: Mutex::new(WriteScratch::at(revision)),
            index: RwLock::new(IndexState {
                keys,
                compacted: scheduled,
            }),
            state: Mutex::new(State {
                revision,
                current: Arc::new(current),
                committing: None,
            }),
            commit_lock: Mutex::new(()),
            compaction: Mutex::new(()),
            commits_ended: (Mutex::new(0), Condvar::new()),
            buffers_taken: AtomicU64::new(0),
            buffers_durable: AtomicU64::new(0),
            buffers_wanted: AtomicU64::new(0),
            durable_waits: Mutex::new(Vec::new()),
            consistent_index: AtomicU64::new(consistent_index),
            compacted: AtomicU64::new(scheduled),
            compacted_physically: AtomicU64::new(finished),
            poisoned: Mutex::new(None),
            is_poisoned: AtomicBool::new(false),
            committer: commit_tx,
            compactor: compact_tx,
            shutdown: AtomicBool::new(false),
            commit_requested: AtomicBool::new(false),
            view_pins: Mutex::new(std::collections::BTreeMap::new()),
            opened_leases: Mutex::new(Some((revision, leases))),
            opened_leases_held: AtomicBool::new(true),
            writers: std::sync::atomic::AtomicUsize::new(0),
            write_txns: AtomicU64::new(0),
            read_sleeps: AtomicU64::new(0),
            read_slept_ns: AtomicU64::new(0),
            pace_verdict: Mutex::new(None),
            chunk_pool,
        });
        if let Some(job) = job {
            tracing::info!(revision = job.revision, "resuming interrupted compaction");
            let _ = inner.compactor.send(job);
        }
        let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(0);
        let mut threads = Vec::new();
        threads.push(spawn("keel-mvcc-commit", {
            let inner = inner.clone();
            move || committer_loop(&inner, &commit_rx)
        })?);
        threads.push(spawn("keel-mvcc-compact", {
            let inner = inner.clone();
            move || crate::compact::compactor_loop(&inner, &compact_rx, &stop_rx)
        })?);
        threads.push(spawn("keel-mvcc-watch", {
            let inner = inner.clone();
            move || crate::watch::syncer_loop(&inner)
        })?);
        Ok(Store {
            inner,
            threads: Mutex::new(threads),
            stop: Mutex::new(Some(stop_tx)),
        })
    }

    /// The live keys that carried a lease when the store was opened, each with its lease
    /// (read during the open's pass over the records), so that a lessor opening over the
    /// store can attach them without scanning every key. Taken once: `None` after the first
    /// call, and `None` when a write has changed the store since it was opened.
    pub fn take_opened_leases(&self) -> Option<Vec<(Vec<u8>, LeaseId)>> {
        self.inner
            .opened_leases_held
            .store(false, Ordering::Relaxed);
        let (at, leases) = self.inner.opened_leases.lock().take()?;
        (self.inner.state.lock().revision == at).then(|| leases.into_iter().collect())
    }

    /// Reads a key or range; see [`RangeRequest`].
    pub fn range(&self, req: &RangeRequest) -> Result<RangeResponse, MvccError> {
        self.read()?.range(req)
    }

    /// Puts `key = value` with `lease` (0: none) as one revision; the previous pair is not
    /// read (use [`put_with`](Store::put_with) for it).
    pub fn put(&self, key: &[u8], value: &[u8], lease: LeaseId) -> Result<PutResponse, MvccError> {
        let mut txn = self.write();
        let mut resp = txn.put(key, value, lease)?;
        resp.revision = txn.commit()?;
        Ok(resp)
    }

    /// Puts with every option of [`PutRequest`] (the previous pair on request).
    pub fn put_with(&self, req: &PutRequest) -> Result<PutResponse, MvccError> {
        let mut txn = self.write();
        let mut resp = txn.put_with(req)?;
        resp.revision = txn.commit()?;
        Ok(resp)
    }

    /// Deletes `key`, or `[key, end)` (etcd range conventions), as one revision; the deleted
    /// pairs are not read (use [`delete_with`](Store::delete_with) for them). Deleting nothing
    /// does not change the revision.
    pub fn delete_range(
        &self,
        key: &[u8],
        end: Option<&[u8]>,
    ) -> Result<DeleteResponse, MvccError> {
        let mut txn = self.write();
        let mut resp = txn.delete_range(key, end)?;
        resp.revision = txn.commit()?;
        Ok(resp)
    }

    /// Deletes with every option of [`DeleteRangeRequest`] (the deleted pairs on request).
    pub fn delete_with(&self, req: &DeleteRangeRequest) -> Result<DeleteResponse, MvccError> {
        let mut txn = self.write();
        let mut resp = txn.delete_with(req)?;
        resp.revision = txn.commit()?;
        Ok(resp)
    }

    /// Runs a transaction atomically as one revision (none if it changes no key).
    pub fn txn(&self, req: &TxnRequest) -> Result<TxnResponse, MvccError> {
        let mut txn = self.write();
        let mut resp = txn.txn(req)?;
        let revision = txn.commit()?;
        crate::txn::set_revision(&mut resp, revision);
        Ok(resp)
    }

    /// A snapshot read view at the current revision. It sees every write committed before
    /// this call (in the backend or not), may move to another thread and live as long as
    /// needed; holding it never blocks writers or backend commits.
    pub fn read(&self) -> Result<ReadView<B>, MvccError> {
        ReadView::open(&self.inner)
    }

    /// Starts a write transaction: one atomic unit and one revision if it changes a key.
    /// Write transactions run one at a time; this waits for the previous one to end.
    pub fn write(&self) -> WriteTxn<'_, B> {
        WriteTxn::begin(&self.inner)
    }

    /// Compacts the history at `revision`: reads below it fail from now on; the superseded
    /// changes are deleted in the background in batches of
    /// [`StoreOptions::compaction_batch_limit`]. The compaction point is durable when this
    /// returns, so a crash resumes the deletion on the next open.
    ///
    /// A backend commit of deletions that fails poisons the store, as a failed commit of
    /// writes does: later writes, commits and compactions fail with
    /// [`MvccError::Poisoned`]. A read of what to delete that fails is tried again after a
    /// pause, a few times over about a second; should it keep failing, the deletions are left
    /// to the next compaction (which deletes what older ones did not) or the next open.
    pub fn compact(&self, revision: u64) -> Result<(), MvccError> {
        crate::compact::compact(&self.inner, revision)
    }

    /// Hash of the history up to `revision` (0: current), for comparing replicas; see
    /// [`HashKv`].
    pub fn hash_kv(&self, revision: u64) -> Result<HashKv, MvccError> {
        crate::compact::hash_kv(&self.inner, revision)
    }

    /// Watches a key or range; see [`WatchRequest`].
    pub fn watch(&self, req: WatchRequest) -> Result<Watcher, MvccError> {
        crate::watch::watch(&self.inner, req)
    }

    /// A new, empty [`WatchStream`]: many watchers behind one channel of
    /// [`StoreOptions::watch_channel_capacity`] responses (etcd's per-stream `chanBufLen`).
    pub fn watch_stream(&self) -> WatchStream<B> {
        WatchStream::new(&self.inner, self.inner.options.watch_channel_capacity)
    }

    /// A new, empty [`WatchStream`] whose channel holds `capacity` responses (at least 1).
    pub fn watch_stream_with_capacity(&self, capacity: usize) -> WatchStream<B> {
        WatchStream::new(&self.inner, capacity)
    }

    /// The revision of the last write transaction that changed a key.
    pub fn current_revision(&self) -> u64 {
        self.inner.state.lock().revision
    }

    /// Number of keys in the key index (live or with history not yet compacted).
    pub fn key_count(&self) -> usize {
        self.inner.index.read().keys.len()
    }

    /// Number of registered watchers.
    pub fn watcher_count(&self) -> usize {
        self.inner.watch.count()
    }

    /// How much long reads have given way to writes since the store opened: the sleeps they
    /// took between chunks while writes flowed on oversubscribed CPUs (see
    /// [`StoreOptions::long_read_cpu_percent`]).
    pub fn read_pacing(&self) -> crate::ReadPacing {
        crate::ReadPacing {
            sleeps: self.inner.read_sleeps.load(Ordering::Relaxed),
            slept: std::time::Duration::from_nanos(
                self.inner.read_slept_ns.load(Ordering::Relaxed),
            ),
        }
    }

    /// The compaction point (0 if never compacted).
    pub fn compacted_revision(&self) -> u64 {
        self.inner.compacted.load(Ordering::Acquire)
    }

    /// The newest compaction point whose superseded revisions are deleted from the backend
    /// and that deletion committed (etcd's physical compaction): at or below
    /// [`compacted_revision`](Self::compacted_revision), which a compaction sets when it is
    /// asked for, before the background deletions. 0 if no compaction finished. A caller
    /// that needs the space back before it goes on (a benchmark, a backup, a defragmentation)
    /// waits for this to reach the point it compacted at.
    pub fn physically_compacted_revision(&self) -> u64 {
        self.inner.compacted_physically.load(Ordering::Acquire)
    }

    /// The last Raft index applied by a write transaction (0 if none).
    pub fn consistent_index(&self) -> u64 {
        self.inner.consistent_index.load(Ordering::Acquire)
    }

    /// Commits every write acknowledged before this call to the backend; durable when this
    /// returns. A caller alone commits on its own thread. Concurrent callers share backend
    /// commits (a group commit): the store's committer thread takes the write buffer and
    /// commits it, and goes straight on to the next buffer while callers wait for it, so the
    /// backend is kept busy without a caller having to wake up first to start the next
    /// commit.
    pub fn force_commit(&self) -> Result<(), MvccError> {
        self.inner.wait_durable()
    }

    /// Writes a consistent copy of the backend (after a [`force_commit`](Store::force_commit))
    /// to `out`; returns the bytes written. Writes continue meanwhile.
    pub fn snapshot(&self, out: &mut dyn Write) -> Result<u64, MvccError> {
        self.force_commit()?;
        Ok(self.inner.backend.snapshot(out)?)
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.inner.backend
    }

    /// The value of `key` in auxiliary `bucket`, including writes not yet committed to the
    /// backend.
    pub fn aux_get(&self, bucket: &Bucket, key: &[u8]) -> Result<Option<Vec<u8>>, MvccError> {
        check_aux_bucket(bucket)?;
        let (current, committing) = self.inner.pending_snapshot();
        for p in std::iter::once(&current).chain(committing.as_ref()) {
            if let Some(v) = p.changes.read().aux(bucket, key) {
                return Ok(v.map(<[u8]>::to_vec));
            }
        }
        let txn = self.inner.backend.read_txn()?;
        Ok(txn.get(bucket, key)?.map(<[u8]>::to_vec))
    }

    /// Every pair of auxiliary `bucket` in ascending key order, including writes not yet
    /// committed to the backend.
    pub fn aux_scan(&self, bucket: &Bucket) -> Result<AuxPairs, MvccError> {
        check_aux_bucket(bucket)?;
        let (current, committing) = self.inner.pending_snapshot();
        let txn = self.inner.backend.read_txn()?;
        let mut all = std::collections::BTreeMap::new();
        for item in txn.range(bucket, &[], None)? {
            let (k, v) = item?;
            all.insert(k.to_vec(), Some(v.to_vec()));
        }
        for p in committing.iter().chain(std::iter::once(&current)) {
            if let Some(writes) = p.changes.read().aux.get(bucket) {
                all.extend(writes.iter().map(|(k, v)| (k.clone(), v.clone())));
            }
        }
        Ok(all
            .into_iter()
            .filter_map(|(k, v)| v.map(|v| (k, v)))
            .collect())
    }
}

/// The pairs of an auxiliary bucket, in ascending key order.
pub type AuxPairs = Vec<(Vec<u8>, Vec<u8>)>;

pub(crate) fn check_aux_bucket(bucket: &Bucket) -> Result<(), MvccError> {
    if *bucket == KEY_BUCKET || *bucket == META_BUCKET {
        return Err(MvccError::ReservedBucket {
            bucket: bucket.clone(),
        });
    }
    bucket.validate()?;
    Ok(())
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>, MvccError> {
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(f)
        .map_err(|e| {
            MvccError::Backend(crate::backend::BackendError::io(
                std::path::PathBuf::from(name),
                "spawn thread",
                e,
            ))
        })
}

impl<B: Backend> Inner<B> {
    /// The published revision and the pending buffers a reader needs, taken together.
    pub(crate) fn pending_snapshot(&self) -> (Arc<Pending>, Option<Arc<Pending>>) {
        let st = self.state.lock();
        (st.current.clone(), st.committing.clone())
    }

    /// Registers an open read view at `revision`.
    pub(crate) fn pin_view(&self, revision: u64) {
        *self.view_pins.lock().entry(revision).or_insert(0) += 1;
    }

    /// Unregisters a read view opened at `revision`.
    pub(crate) fn unpin_view(&self, revision: u64) {
        let mut pins = self.view_pins.lock();
        if let Some(n) = pins.get_mut(&revision) {
            *n -= 1;
            if *n == 0 {
                pins.remove(&revision);
            }
        }
    }

    /// The revision of the oldest open read view.
    pub(crate) fn oldest_view(&self) -> Option<u64> {
        self.view_pins.lock().first_key_value().map(|(r, _)| *r)
    }

    pub(crate) fn check_poisoned(&self) -> Result<(), MvccError> {
        if !self.is_poisoned.load(Ordering::Acquire) {
            return Ok(());
        }
        match &*self.poisoned.lock() {
            Some(reason) => Err(MvccError::Poisoned {
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Takes the commit lock: held while a batch goes to the backend. Releasing it wakes the
    /// callers of [`commit_pending`](Inner::commit_pending) waiting for a commit to end.
    pub(crate) fn lock_commits(&self) -> CommitGuard<'_> {
        CommitGuard {
            guard: Some(self.commit_lock.lock()),
            ended: &self.commits_ended,
        }
    }

    /// [`Store::force_commit`]: waits until every write acknowledged before this call is
    /// durable, the commits done by the committer thread.
    ///
    /// The caller notes the number of the buffer its writes are in (the current one, or the
    /// last one taken when the current one is empty: its writes went into older buffers). A
    /// caller that finds no commit running and nobody waiting commits on its own thread.
    /// Otherwise it raises `buffers_wanted` to that number, waking the committer if the
    /// number is new, and waits. The
    /// committer commits buffers back to back until `buffers_wanted` is durable, so under a
    /// steady stream of callers the next commit starts as soon as the last one ends, on a
    /// thread already running, instead of after a woken caller gets a CPU. Each commit wakes
    /// only the callers it made durable: those waiting for a later buffer sleep on.
    pub(crate) fn wait_durable(&self) -> Result<(), MvccError> {
        self.check_poisoned()?;
        let needed = {
            let st = self.state.lock();
            let taken = self.buffers_taken.load(Ordering::Acquire);
            if st.current.changes.read().is_empty() {
                taken
            } else {
                taken + 1
            }
        };
        if self.buffers_durable.load(Ordering::Acquire) >= needed {
            return Ok(());
        }
        // Alone (no commit running, nobody waiting): commit on this thread, without handing
        // the commit to the committer and waiting to be woken back.
        if !self.durability_wanted()
            && let Some(guard) = self.commit_lock.try_lock()
        {
            let _commit = CommitGuard {
                guard: Some(guard),
                ended: &self.commits_ended,
            };
            return self.commit_locked(needed);
        }
        if self.buffers_wanted.fetch_max(needed, Ordering::AcqRel) < needed
            && !self.commit_requested.swap(true, Ordering::AcqRel)
        {
            let _ = self.committer.send(Signal::Commit);
        }
        // Listed before looking at `buffers_durable`: a commit that ends after the look
        // finds this caller in the list and unparks it (an unpark before the park makes the
        // park return at once).
        self.durable_waits
            .lock()
            .push((needed, std::thread::current()));
        while self.buffers_durable.load(Ordering::Acquire) < needed {
            if let Err(e) = self.check_poisoned() {
                let me = std::thread::current().id();
                self.durable_waits.lock().retain(|(_, t)| t.id() != me);
                return Err(e);
            }
            std::thread::park();
        }
        // Leaves the list, and wakes the next callers made durable (see `wake_durable_from`).
        let me = std::thread::current().id();
        self.wake_durable_from(self.buffers_durable.load(Ordering::Acquire), Some(me));
        Ok(())
    }

    /// Poisons the store after a backend commit failed (`reason`: what was committed, and
    /// the error): from now on every write transaction's commit, [`Store::force_commit`] and
    /// compaction fails with [`MvccError::Poisoned`] naming the first such failure, until the
    /// store is reopened. The `force_commit` callers waiting are woken to return it.
    pub(crate) fn poison(&self, reason: String) {
        self.poisoned.lock().get_or_insert(reason);
        self.is_poisoned.store(true, Ordering::Release);
        let woken: Vec<std::thread::Thread> = {
            let mut waits = self.durable_waits.lock();
            waits.drain(..).map(|(_, t)| t).collect()
        };
        for t in woken {
            t.unpark();
        }
    }

    /// Takes `me` (a returning caller) off the list, and unparks up to [`WAKE_FANOUT`]
    /// callers waiting for buffer `durable` or an older one, taken off the list (once the
    /// list's lock is released).
    ///
    /// A commit wakes only [`WAKE_FANOUT`] of the callers it made durable, and goes on to its
    /// next commit; each caller woken wakes as many more before it returns, so every caller
    /// made durable wakes, in a tree, and the committer does not spend the unparks of all of
    /// them (some microseconds each, more when a woken caller takes its CPU) between two
    /// commits.
    ///
    /// No caller made durable stays asleep: a commit making any durable wakes some, and every
    /// caller woken, or returning after it was listed, wakes more while any are left. A
    /// caller taken off the list before it parks returns without parking (its buffer is
    /// durable) and wakes its share on the way out.
    fn wake_durable_from(&self, durable: u64, me: Option<std::thread::ThreadId>) {
        let mut woken: [Option<std::thread::Thread>; WAKE_FANOUT] = Default::default();
        {
            let mut waits = self.durable_waits.lock();
            if let Some(me) = me
                && let Some(i) = waits.iter().position(|(_, t)| t.id() == me)
            {
                waits.remove(i);
            }
            for slot in &mut woken {
                let Some(i) = waits.iter().position(|(needed, _)| *needed <= durable) else {
                    break;
                };
                *slot = Some(waits.remove(i).1);
            }
        }
        for t in woken.into_iter().flatten() {
            t.unpark();
        }
    }

    /// `force_commit` callers wait for a buffer not yet durable.
    pub(crate) fn durability_wanted(&self) -> bool {
        self.buffers_wanted.load(Ordering::Acquire) > self.buffers_durable.load(Ordering::Acquire)
    }

    /// Makes every write acknowledged before this call durable: commits the pending buffer
    /// to the backend (one batch) unless a commit that started after this call began has
    /// already done so.
    ///
    /// Every write acknowledged before this call is in the buffer the next commit takes or
    /// in an older one. A caller that finds another commit running waits for it to end
    /// instead of queueing for the lock, then looks again: once a commit that took its
    /// buffer (any thread's) has succeeded it returns without holding the lock, so concurrent
    /// callers share one backend commit (a group commit) and none waits behind callers that
    /// arrived after it.
    pub(crate) fn commit_pending(&self) -> Result<(), MvccError> {
        let needed = self.buffers_taken.load(Ordering::Acquire) + 1;
        loop {
            let ended = *self.commits_ended.0.lock();
            if self.buffers_durable.load(Ordering::Acquire) >= needed {
                return Ok(());
            }
            if let Some(guard) = self.commit_lock.try_lock() {
                let _commit = CommitGuard {
                    guard: Some(guard),
                    ended: &self.commits_ended,
                };
                return self.commit_locked(needed);
            }
            let mut count = self.commits_ended.0.lock();
            while *count == ended {
                self.commits_ended.1.wait(&mut count);
            }
        }
    }

    /// [`commit_pending`](Inner::commit_pending) with the commit lock held.
    fn commit_locked(&self, needed: u64) -> Result<(), MvccError> {
        self.check_poisoned()?;
        if self.buffers_durable.load(Ordering::Acquire) >= needed {
            return Ok(());
        }
        let (pending, taken) = {
            let mut st = self.state.lock();
            let len = {
                let changes = st.current.changes.read();
                if changes.is_empty() {
                    return Ok(());
                }
                changes.revs.len()
            };
            // The next buffer starts with room for as many changes as this one took (up to a
            // batch), so it does not grow by reallocation while writers append to it.
            let next =
                Pending::with_capacity(len.min(self.options.batch_limit), self.chunk_pool.clone());
            let p = std::mem::replace(&mut st.current, Arc::new(next));
            st.committing = Some(p.clone());
            (p, self.buffers_taken.fetch_add(1, Ordering::AcqRel) + 1)
        };
        let committed = self.backend.commit_from(&*pending.changes.read());
        match committed {
            Ok(()) => {
                self.state.lock().committing = None;
                self.buffers_durable.store(taken, Ordering::Release);
                self.wake_durable_from(taken, None);
                Ok(())
            }
            Err(e) => {
                // The buffer stays as `committing` so reads keep seeing it.
                tracing::error!(error = %e, "backend commit failed; store is poisoned");
                self.poison(e.to_string());
                Err(e.into())
            }
        }
    }
}

/// The store's commit lock, held (see [`Inner::lock_commits`]).
pub(crate) struct CommitGuard<'a> {
    guard: Option<MutexGuard<'a, ()>>,
    ended: &'a (Mutex<u64>, Condvar),
}

impl Drop for CommitGuard<'_> {
    fn drop(&mut self) {
        // The lock first, so a woken caller can take it.
        drop(self.guard.take());
        *self.ended.0.lock() += 1;
        self.ended.1.notify_all();
    }
}

fn committer_loop<B: Backend>(inner: &Inner<B>, rx: &Receiver<Signal>) {
    loop {
        let stop = match rx.recv_timeout(inner.options.batch_interval) {
            Ok(Signal::Commit) | Err(RecvTimeoutError::Timeout) => false,
            Ok(Signal::Shutdown) | Err(RecvTimeoutError::Disconnected) => true,
        };
        inner.commit_requested.store(false, Ordering::Release);
        loop {
            if let Err(e) = inner.commit_pending() {
                if !matches!(e, MvccError::Poisoned { .. }) {
                    tracing::error!(error = %e, "background backend commit failed");
                }
                break;
            }
            // Callers of `force_commit` wait for the buffer filled meanwhile: commit it now.
            if !inner.durability_wanted() {
                break;
            }
        }
        if stop {
            return;
        }
    }
}

impl<B: Backend> Drop for Store<B> {
    fn drop(&mut self) {
        self.inner.shutdown.store(true, Ordering::Release);
        let _ = self.inner.committer.send(Signal::Shutdown);
        let _ = self.inner.compactor.send(CompactJob::shutdown());
        self.inner.watch.shutdown();
        self.stop.lock().take();
        for t in self.threads.lock().drain(..) {
            let _ = t.join();
        }
    }
}

/// A store over a new in-memory backend in a temporary directory, which lives as long as the
/// returned guard: the unit tests' store.
#[cfg(test)]
pub(crate) fn mem_store(
    options: StoreOptions,
) -> (tempfile::TempDir, Store<crate::testing::MemBackend>) {
    use crate::testing::{MemBackend, MemOptions};
    let dir = tempfile::tempdir().expect("tempdir");
    let backend =
        MemBackend::open(&dir.path().join("mem"), &MemOptions::default()).expect("open backend");
    let store = Store::open(backend, options).expect("open store");
    (dir, store)
}
