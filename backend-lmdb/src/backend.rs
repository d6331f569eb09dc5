//! [`LmdbBackend`]: the writer, sizes, defragmentation and map growth.
//!
//! Concurrency: `current` (a read-write lock around the live [`Generation`]) is held only
//! long enough to clone its `Arc` — by read transactions when they open and by the writer —
//! and exclusively only to swap generations or resize the map in place. `writer` (a mutex)
//! serialises commits, defragmentation, growth, restores and `size` (which counts pages in a
//! write transaction, see there), and holds the poisoned state. A read transaction therefore
//! never waits for a commit (LMDB readers take no writer lock and the `current` lock is never
//! held across I/O), and a commit never waits for readers.

use std::fs::File;
use std::io::Read;
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use heed::types::Bytes;
use heed::{CompactionOption, Database, Env, MdbError, PutFlags, RwTxn, WithoutTls};
use keel_mvcc::backend::{PairObserver, snapshot};
use keel_mvcc::{
    Backend, BackendError, BackendSize, BatchOpRef, BatchSource, Bucket, ReadTxn, WriteBatch,
};
use parking_lot::{Mutex, RwLock};

use crate::env::{self, DirLock, Generation};
use crate::error::{LmdbError, from_heed};
use crate::keys;
use crate::options::{LmdbOptions, round_map_size};
use crate::txn::LmdbReadTxn;

/// A [`Backend`] on LMDB.
///
/// Requirements on its users (LMDB's, see `env::open_env` for why they make the one
/// `unsafe` open sound): the store directory is on a **local** file system (not NFS/SMB), and
/// nothing but this crate writes the files inside it. The directory is locked exclusively while
/// the backend or any read transaction from it is alive; a second open fails with
/// [`BackendError::Locked`].
///
/// [`Backend::restore`] loads a snapshot stream into a new generation with one `fdatasync` at
/// the end, and is all-or-nothing (see the method).
///
/// When the map is full, commits fail with [`BackendError::Full`]; call
/// [`grow_map`](LmdbBackend::grow_map) (or reopen with a larger
/// [`LmdbOptions::map_size`]) and retry.
///
/// A commit that fails at its durability point poisons the backend: from then on every call
/// that writes (commits, [`sync`](LmdbBackend::sync), [`Backend::defragment`],
/// [`Backend::restore`], [`grow_map`](LmdbBackend::grow_map)) fails with
/// [`BackendError::Poisoned`] until the store is reopened; reads keep working.
pub struct LmdbBackend {
    path: PathBuf,
    options: LmdbOptions,
    current: RwLock<Arc<Generation>>,
    /// The map size, readable without waiting for a commit; changed only under `writer`.
    map_size: AtomicU64,
    /// Superseded generations, alive while read transactions still use them.
    retired: Mutex<Vec<Weak<Generation>>>,
    writer: Mutex<Writer>,
    #[cfg(feature = "failpoints")]
    fail_next_commit: std::sync::atomic::AtomicBool,
}

struct Writer {
    /// Why commits are refused, after a commit failed at its durability point.
    poisoned: Option<String>,
    /// The map size every generation is opened with.
    map_size: usize,
    /// Bucket databases created by the running commit, reused between commits.
    created: Vec<(Bucket, Database<Bytes, Bytes>)>,
    /// Reused buffer for stored keys.
    key_buf: Vec<u8>,
    /// The bucket the last batch began with puts into: the next batch's leading puts into it
    /// go through one cursor (see `commit_from`).
    lead: Option<Bucket>,
}

impl Writer {
    /// [`BackendError::Poisoned`] once a commit failed at its durability point: every call
    /// that writes (commits, `sync`, `defragment`, `restore`, `grow_map`) checks this first.
    fn refuse_if_poisoned(&self) -> Result<(), BackendError> {
        match &self.poisoned {
            Some(reason) => Err(BackendError::Poisoned {
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }
}

impl std::fmt::Debug for LmdbBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LmdbBackend")
            .field("path", &self.path)
            .field("generation", &self.current.read().number())
            .finish_non_exhaustive()
    }
}

impl LmdbBackend {
    /// The store directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The current map size: the most bytes the data file may reach.
    pub fn map_size(&self) -> u64 {
        self.map_size.load(Ordering::Acquire)
    }

    /// Enlarges the map to `new_size` bytes (rounded up to 64 KiB), so that commits failing
    /// with [`BackendError::Full`] can succeed. Waits for a running commit; readers keep
    /// working throughout.
    ///
    /// With no read transaction open, LMDB's map is resized in place. Otherwise the store is
    /// copied, compacted, into a new generation opened with the larger map (as
    /// [`defragment`](Backend::defragment) does), and open readers keep the old one. A smaller
    /// size than the current one is refused with [`BackendError::InvalidOption`]. The new size
    /// lasts for the life of this handle; pass it as [`LmdbOptions::map_size`] when reopening.
    ///
    /// A poisoned backend refuses with [`BackendError::Poisoned`], whatever the size: what
    /// its last commit left on disk is unknown, a larger map does not change that, and the
    /// copy would carry that state into a new generation. Only a reopen recovers.
    pub fn grow_map(&self, new_size: u64) -> Result<(), BackendError> {
        let mut writer = self.writer.lock();
        writer.refuse_if_poisoned()?;
        let probe = LmdbOptions {
            map_size: new_size,
            ..self.options.clone()
        };
        probe.validate()?;
        let new_size = round_map_size(new_size);
        if new_size < writer.map_size {
            return Err(BackendError::InvalidOption(format!(
                "map size can only grow: {} requested, {} in use",
                new_size, writer.map_size
            )));
        }
        if new_size == writer.map_size {
            return Ok(());
        }
        {
            let current = self.current.write();
            if Arc::strong_count(&current) == 1 {
                // SAFETY: LMDB allows resizing an open environment when this process has no
                // transaction on it. No write transaction: they only exist inside `commit`,
                // `defragment` and `grow_map`, all under `writer`, which we hold. No read
                // transaction: each holds a clone of the generation's `Arc`, the count is 1
                // (ours), and a new one cannot start because cloning requires `current`,
                // which we hold exclusively. The environment is cloned nowhere else.
                unsafe { current.env().resize(new_size) }
                    .map_err(|e| from_heed(current.dir(), "resize map", e))?;
                writer.map_size = new_size;
                self.map_size.store(new_size as u64, Ordering::Release);
                tracing::info!(path = %self.path.display(), map_size = new_size, "map grown in place");
                return Ok(());
            }
        }
        self.swap_in_compacted_copy(&mut writer, new_size)?;
        writer.map_size = new_size;
        self.map_size.store(new_size as u64, Ordering::Release);
        tracing::info!(path = %self.path.display(), map_size = new_size, "map grown by copy");
        Ok(())
    }

    /// Flushes LMDB's buffers to disk: makes commits durable when
    /// [`LmdbOptions::sync_on_commit`] is off.
    pub fn sync(&self) -> Result<(), BackendError> {
        let writer = self.writer.lock();
        writer.refuse_if_poisoned()?;
        let generation = self.generation();
        generation
            .env()
            .force_sync()
            .map_err(|e| from_heed(generation.dir(), "fdatasync", e))
    }

    fn generation(&self) -> Arc<Generation> {
        Arc::clone(&self.current.read())
    }

    /// Writes a compacted copy of the live generation as the next one, opens it with
    /// `map_size`, and makes it live. Caller holds `writer`, so no commit runs meanwhile.
    fn swap_in_compacted_copy(
        &self,
        writer: &mut Writer,
        map_size: usize,
    ) -> Result<(), BackendError> {
        let old = self.generation();
        let number = old.number() + 1;
        let tmp = env::temp_generation_dir(&self.path, number);
        let dir = env::generation_dir(&self.path, number);
        let copy = || -> Result<(), BackendError> {
            if tmp.exists() {
                std::fs::remove_dir_all(&tmp)
                    .map_err(|e| BackendError::io(&tmp, "remove directory", e))?;
            }
            std::fs::create_dir(&tmp).map_err(|e| BackendError::io(&tmp, "create directory", e))?;
            let data = tmp.join(env::DATA_FILE);
            let mut file = File::options()
                .write(true)
                .create_new(true)
                .open(&data)
                .map_err(|e| BackendError::io(&data, "create", e))?;
            old.env()
                .copy_to_file(&mut file, CompactionOption::Enabled)
                .map_err(|e| from_heed(old.dir(), "compacting copy", e))?;
            file.sync_all()
                .map_err(|e| BackendError::io(&data, "fsync", e))?;
            env::sync_dir(&tmp)?;
            std::fs::rename(&tmp, &dir).map_err(|e| BackendError::io(&tmp, "rename", e))?;
            env::sync_dir(&self.path)
        };
        if let Err(e) = copy() {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
        self.install_generation(writer, &old, number, map_size)
    }

    /// Opens generation `number`, whose complete directory was just renamed into place, and
    /// makes it live in place of `old`, which is retired (deleted when its last reader drops
    /// it). Caller holds `writer`.
    fn install_generation(
        &self,
        writer: &mut Writer,
        old: &Arc<Generation>,
        number: u64,
        map_size: usize,
    ) -> Result<(), BackendError> {
        let dir = env::generation_dir(&self.path, number);
        // From here the new directory is what a reopen would load: it must become live, or
        // be removed before another commit lands in the old one.
        match Generation::open(old.lock(), number, map_size, &self.options) {
            Ok(generation) => {
                old.retire();
                *self.current.write() = Arc::new(generation);
                let mut retired = self.retired.lock();
                retired.retain(|g| g.strong_count() > 0);
                retired.push(Arc::downgrade(old));
                tracing::info!(
                    path = %self.path.display(),
                    generation = number,
                    "new generation is live"
                );
                Ok(())
            }
            Err(e) => {
                let removed = std::fs::remove_dir_all(&dir)
                    .map_err(|e| BackendError::io(&dir, "remove directory", e))
                    .and_then(|()| env::sync_dir(&self.path));
                if let Err(undo) = removed {
                    writer.poisoned = Some(format!(
                        "a new generation at {} could neither be opened ({e}) nor removed \
                         ({undo}); a reopen would lose later commits",
                        dir.display()
                    ));
                }
                Err(e)
            }
        }
    }

    /// Loads a snapshot stream into a new generation directory written under its temporary
    /// name, durable and renamed into place on success; returns the pairs loaded.
    ///
    /// The temporary environment is private (no reader can reach it) and opened with
    /// `MDB_NOSYNC`: each batch is its own LMDB commit of pairs inserted with `MDB_APPEND`
    /// (the stream's `(bucket, key)` order is the stored-key order, see `keys`), and one
    /// `fdatasync` at the end makes the whole load durable before the rename.
    fn load_generation(
        &self,
        number: u64,
        map_size: usize,
        input: &mut dyn Read,
        observe: &mut PairObserver<'_>,
    ) -> Result<u64, BackendError> {
        let tmp = env::temp_generation_dir(&self.path, number);
        let dir = env::generation_dir(&self.path, number);
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp)
                .map_err(|e| BackendError::io(&tmp, "remove directory", e))?;
        }
        std::fs::create_dir(&tmp).map_err(|e| BackendError::io(&tmp, "create directory", e))?;
        let loading = LmdbOptions {
            sync_on_commit: false,
            ..self.options.clone()
        };
        // SAFETY: see `env::open_env`. We hold the store's lock (every generation keeps it,
        // and `self` holds the live one), `tmp` is inside the store, and no other environment
        // on `tmp` is open: it was just created, and it is only ever opened here, under
        // `writer`.
        let lmdb = unsafe { env::open_env(&tmp, map_size, &loading, true) }?;
        env::main_database(&lmdb, &tmp)?;
        let max_key = lmdb.max_key_size();
        let none = env::Dbs::default();
        let mut created = Vec::new();
        let mut stored = Vec::new();
        let pairs = snapshot::restore_from(input, |batch| {
            let full = |e: heed::Error, op: &'static str| match e {
                heed::Error::Mdb(MdbError::MapFull) => map_full(&lmdb, map_size, &self.path),
                e => from_heed(&tmp, op, e),
            };
            let mut wtxn = lmdb
                .write_txn()
                .map_err(|e| from_heed(&tmp, "begin write transaction", e))?;
            // Puts only, straight from the parser's buffer.
            for (bucket, key, value) in batch.iter() {
                check_op(BatchOpRef::Put { bucket, key, value }, max_key)?;
                let Some(db) = env::bucket_db(&lmdb, &mut wtxn, &none, &mut created, bucket, true)
                    .map_err(|e| match e {
                        heed::Error::Mdb(MdbError::DbsFull) => {
                            BackendError::Other(Box::new(LmdbError::TooManyBuckets {
                                path: tmp.clone(),
                                bucket: bucket.name().to_owned(),
                                max_buckets: self.options.max_buckets,
                            }))
                        }
                        e => full(e, "create a bucket database"),
                    })?
                else {
                    continue;
                };
                observe(bucket, key, value);
                // The stream is in (bucket, key) order: each bucket's keys arrive ascending.
                keys::encode_into(key, &mut stored);
                db.put_with_flags(&mut wtxn, PutFlags::APPEND, &stored, value)
                    .map_err(|e| full(e, "append"))?;
            }
            wtxn.commit().map_err(|e| full(e, "commit"))
        })?;
        lmdb.force_sync()
            .map_err(|e| from_heed(&tmp, "fdatasync", e))?;
        drop(lmdb);
        env::sync_dir(&tmp)?;
        std::fs::rename(&tmp, &dir).map_err(|e| BackendError::io(&tmp, "rename", e))?;
        env::sync_dir(&self.path)?;
        Ok(pairs)
    }

    /// Test-only: the next commit fails as if its `fdatasync` had failed, after which the
    /// backend is poisoned. The failed commit writes nothing.
    #[cfg(feature = "failpoints")]
    pub fn fail_next_commit(&self) {
        self.fail_next_commit
            .store(true, std::sync::atomic::Ordering::Release);
    }

    fn commit_txn(&self, wtxn: RwTxn<'_>) -> heed::Result<()> {
        #[cfg(feature = "failpoints")]
        if self
            .fail_next_commit
            .swap(false, std::sync::atomic::Ordering::AcqRel)
        {
            drop(wtxn);
            return Err(heed::Error::Io(std::io::Error::other(
                "injected failure at the commit's fdatasync",
            )));
        }
        wtxn.commit()
    }

    /// [`Backend::size`] for a caller holding `writer`: no commit, swap or growth runs
    /// meanwhile, so the write transaction below begins at once, sees the last commit, and
    /// `generation.dbs()` has a handle of every bucket database in it.
    fn size_locked(&self, _writer: &Writer) -> Result<BackendSize, BackendError> {
        let generation = self.generation();
        let mut on_disk = generation.disk_size()?;
        // Generations still open for old readers take space too, until those readers drop.
        let retired: Vec<Arc<Generation>> = self
            .retired
            .lock()
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for old in &retired {
            on_disk += old.disk_size()?;
        }
        drop(retired);
        // A write transaction, not a read one: LMDB gives it no reader slot.
        let wtxn = generation
            .env()
            .write_txn()
            .map_err(|e| from_heed(generation.dir(), "begin write transaction", e))?;
        let (pages, page_size) = generation.pages_in_use(&wtxn, &generation.dbs())?;
        drop(wtxn);
        let in_use = pages * page_size;
        Ok(BackendSize {
            on_disk,
            in_use: in_use.min(on_disk),
        })
    }

    fn full(&self, generation: &Generation, map_size: usize) -> BackendError {
        map_full(generation.env(), map_size, &self.path)
    }
}

impl Backend for LmdbBackend {
    type Options = LmdbOptions;
    type ReadTxn = LmdbReadTxn;

    fn open(path: &Path, options: &LmdbOptions) -> Result<LmdbBackend, BackendError> {
        options.validate()?;
        let lock = Arc::new(DirLock::acquire(path)?);
        let map_size = options.rounded_map_size();
        let generation = match env::recover_generations(&lock)? {
            Some(number) => Generation::open(&lock, number, map_size, options)?,
            None => Generation::create(&lock, 1, map_size, options)?,
        };
        // LMDB never maps less than the last commit's data: a store reopened with a smaller
        // map runs on one as large as its data, which is the map to report and grow from.
        let map_size = map_size.max(generation.env().info().map_size);
        let number = generation.number();
        tracing::debug!(path = %path.display(), generation = number, "opened LMDB backend");
        Ok(LmdbBackend {
            path: path.to_path_buf(),
            options: options.clone(),
            current: RwLock::new(Arc::new(generation)),
            map_size: AtomicU64::new(map_size as u64),
            retired: Mutex::new(Vec::new()),
            writer: Mutex::new(Writer {
                poisoned: None,
                map_size,
                created: Vec::new(),
                key_buf: Vec::new(),
                lead: None,
            }),
            #[cfg(feature = "failpoints")]
            fail_next_commit: std::sync::atomic::AtomicBool::new(false),
        })
    }

    fn read_txn(&self) -> Result<LmdbReadTxn, BackendError> {
        LmdbReadTxn::begin(self.generation(), self.options.max_readers)
    }

    fn commit(&self, batch: &WriteBatch) -> Result<(), BackendError> {
        self.commit_from(batch)
    }

    /// Writes the operations straight from the caller's buffers into one LMDB write
    /// transaction, checking each (bucket name, key length) as it goes; a failed check aborts
    /// the transaction, so nothing of the batch is applied.
    fn commit_from(&self, source: &dyn BatchSource) -> Result<(), BackendError> {
        let mut writer = self.writer.lock();
        writer.refuse_if_poisoned()?;
        if source.op_count() == 0 {
            // Still check what there is (nothing, for a well-behaved source).
            return source.for_each_op(&mut |op| check_op(op, usize::MAX));
        }
        let generation = self.generation();
        let max_key = generation.max_key();
        let dir = generation.dir();
        let map_size = writer.map_size;
        let lmdb = generation.env();
        let mut wtxn = lmdb
            .write_txn()
            .map_err(|e| from_heed(dir, "begin write transaction", e))?;
        let id = wtxn.id() as u64;
        let heed_err = |e: heed::Error, op: &'static str| match e {
            heed::Error::Mdb(MdbError::MapFull) => self.full(&generation, map_size),
            e => from_heed(dir, op, e),
        };
        // Under the writer lock, so these are every committed bucket database.
        let dbs = generation.dbs();
        let mut created = std::mem::take(&mut writer.created);
        created.clear();
        let mut key_buf = std::mem::take(&mut writer.key_buf);
        // The batch's puts into the bucket the last batch began with (a store's batch begins
        // with its revisions, in ascending order) go through one cursor, in a first pass: an
        // append through a cursor that just appended finds the last leaf without searching
        // the tree from its root, as a put through a fresh cursor does. The other operations
        // are checked in order and kept (copied) for a second pass, unless the batch does not
        // begin with such a put, in which case the first pass does nothing. A kept operation
        // on another bucket is so applied after later puts into the cursor's bucket, with the
        // same result (buckets are separate databases); once an operation other than such a
        // put touches the cursor's bucket, every later operation is kept, in order.
        let lead = writer
            .lead
            .as_ref()
            .and_then(|b| dbs.get(b.name()).map(|db| (b.clone(), db)));
        let mut rest: Option<WriteBatch> = None;
        let mut first: Option<Bucket> = None;
        if let Some((bucket, db)) = lead {
            let mut cursor = db
                .iter_mut(&mut wtxn)
                .map_err(|e| heed_err(e, "open a cursor"))?;
            let mut kept = WriteBatch::new();
            let (mut state, mut appending) = (Lead::Start, true);
            let led = source.for_each_op(&mut |op| {
                if state == Lead::Off {
                    return Ok(());
                }
                check_key(op, max_key)?;
                if state != Lead::Kept
                    && let BatchOpRef::Put {
                        bucket: b,
                        key,
                        value,
                    } = op
                    && *b == bucket
                {
                    state = Lead::On;
                    keys::encode_into(key, &mut key_buf);
                    return append(&mut cursor, &key_buf, value, &mut appending)
                        .map_err(|e| heed_err(e, "write"));
                }
                if state == Lead::Start {
                    // Not a batch this pass is for: the second pass applies all of it.
                    state = Lead::Off;
                    return Ok(());
                }
                op_bucket(op).validate()?;
                if op_bucket(op) == &bucket {
                    state = Lead::Kept;
                }
                kept.push_ref(op);
                Ok(())
            });
            drop(cursor);
            if let Err(e) = led {
                writer.key_buf = key_buf;
                writer.created = created;
                return Err(e);
            }
            if state != Lead::Off {
                first = Some(bucket);
                rest = Some(kept);
            }
        }
        // Batches run long stretches of one bucket: remember the last one's database, and
        // whether its puts so far were appends (see `apply`).
        let mut last: Option<(Bucket, Database<Bytes, Bytes>)> = None;
        let mut appending = true;
        let mut op_index = 0usize;
        let second: &dyn BatchSource = match &rest {
            Some(kept) => kept,
            None => source,
        };
        let applied = second.for_each_op(&mut |op| {
            if rest.is_none()
                && op_index == 0
                && let BatchOpRef::Put { bucket, .. } = op
            {
                first = Some(bucket.clone());
            }
            op_index += 1;
            check_key(op, max_key)?;
            let bucket = op_bucket(op);
            let db = match &last {
                // The same bucket as the last operation: its name was checked then.
                Some((b, db)) if b == bucket => *db,
                _ => {
                    bucket.validate()?;
                    appending = true;
                    let is_put = matches!(op, BatchOpRef::Put { .. });
                    match env::bucket_db(lmdb, &mut wtxn, &dbs, &mut created, bucket, is_put) {
                        Ok(Some(db)) => {
                            last = Some((bucket.clone(), db));
                            db
                        }
                        // Nothing to delete in a bucket that does not exist.
                        Ok(None) => return Ok(()),
                        Err(heed::Error::Mdb(MdbError::DbsFull)) => {
                            return Err(BackendError::Other(Box::new(LmdbError::TooManyBuckets {
                                path: dir.to_path_buf(),
                                bucket: bucket.name().to_owned(),
                                max_buckets: self.options.max_buckets,
                            })));
                        }
                        Err(e) => return Err(heed_err(e, "create a bucket database")),
                    }
                }
            };
            apply(db, &mut wtxn, op, max_key, &mut key_buf, &mut appending)
                .map_err(|e| heed_err(e, "write"))
        });
        if applied.is_ok() {
            writer.lead = first;
        }
        writer.key_buf = key_buf;
        let result = applied.and_then(|()| {
            let layout = if created.is_empty() { dbs.layout() } else { id };
            generation
                .main()
                .put(&mut wtxn, keys::COMMIT_STAMP, &keys::stamp(id, layout))
                .map_err(|e| heed_err(e, "write commit stamp"))
        });
        if let Err(e) = result {
            writer.created = created;
            return Err(e);
        }
        let committed = self.commit_txn(wtxn);
        if committed.is_ok() && !created.is_empty() {
            // After the commit returned: see `env` on publishing handles.
            generation.publish(dbs.with(&created, id));
        }
        created.clear();
        writer.created = created;
        match committed {
            Ok(()) => Ok(()),
            Err(heed::Error::Mdb(MdbError::MapFull)) => Err(self.full(&generation, map_size)),
            Err(e) => {
                // LMDB may have written some pages or failed its fdatasync: what is on disk
                // is unknown, so refuse further commits until a reopen recovers.
                let err = from_heed(dir, "commit", e);
                tracing::error!(path = %self.path.display(), error = %err, "commit failed; backend poisoned");
                writer.poisoned = Some(err.to_string());
                Err(err)
            }
        }
    }

    /// Loads the stream into a new generation directory, then swaps it in as defragment does:
    /// one `fdatasync` for the whole stream instead of one per batch, and appends instead of
    /// B-tree searches. The restore is all-or-nothing: on any error (a damaged stream, a full
    /// map) the backend is left empty and usable, and a crash at any point leaves it empty or
    /// wholly restored.
    fn restore(&self, input: &mut dyn Read) -> Result<u64, BackendError> {
        self.restore_observed(input, &mut |_, _, _| {})
    }

    /// As [`restore`](Backend::restore), showing each pair to `observe` as it is appended.
    fn restore_observed(
        &self,
        input: &mut dyn Read,
        observe: &mut PairObserver<'_>,
    ) -> Result<u64, BackendError> {
        let mut writer = self.writer.lock();
        writer.refuse_if_poisoned()?;
        let old = self.generation();
        let probe = LmdbReadTxn::begin(Arc::clone(&old), self.options.max_readers)?;
        if !probe.buckets()?.is_empty() {
            return Err(BackendError::RestoreNotEmpty);
        }
        drop(probe);
        let number = old.number() + 1;
        let map_size = writer.map_size;
        let pairs = match self.load_generation(number, map_size, input, observe) {
            Ok(pairs) => pairs,
            Err(e) => {
                let tmp = env::temp_generation_dir(&self.path, number);
                if let Err(undo) = std::fs::remove_dir_all(&tmp) {
                    tracing::warn!(dir = %tmp.display(), error = %undo, "could not remove an unfinished restore; it is removed at the next open");
                }
                return Err(e);
            }
        };
        self.install_generation(&mut writer, &old, number, map_size)?;
        tracing::info!(path = %self.path.display(), pairs, "restored a snapshot stream");
        Ok(pairs)
    }

    /// Bytes on disk: the live generation's files and those of superseded generations that
    /// read transactions still hold. Bytes in use: the live generation's pages in use as of
    /// the last commit (every database's tree and the two meta pages, not free pages), at
    /// most the bytes on disk.
    ///
    /// Needs no reader slot, so it answers while read transactions hold them all: the pages
    /// are counted in a write transaction (LMDB gives those none), aborted unchanged. It
    /// therefore waits for a running commit, defragment, map growth or restore.
    fn size(&self) -> Result<BackendSize, BackendError> {
        let writer = self.writer.lock();
        self.size_locked(&writer)
    }

    fn defragment(&self) -> Result<(), BackendError> {
        let mut writer = self.writer.lock();
        writer.refuse_if_poisoned()?;
        let map_size = writer.map_size;
        let before = self.size_locked(&writer)?;
        self.swap_in_compacted_copy(&mut writer, map_size)?;
        let after = self.size_locked(&writer)?;
        tracing::info!(
            path = %self.path.display(),
            before = before.on_disk,
            after = after.on_disk,
            "defragmented"
        );
        Ok(())
    }
}

/// The bucket an operation writes to.
fn op_bucket(op: BatchOpRef<'_>) -> &Bucket {
    match op {
        BatchOpRef::Put { bucket, .. }
        | BatchOpRef::Delete { bucket, .. }
        | BatchOpRef::DeleteRange { bucket, .. } => bucket,
    }
}

/// Checks one operation against what LMDB stores: a valid bucket name, and a put's key no
/// longer than `max_key` bytes once marked (see `keys`).
fn check_op(op: BatchOpRef<'_>, max_key: usize) -> Result<(), BackendError> {
    op_bucket(op).validate()?;
    check_key(op, max_key)
}

/// The key-length part of [`check_op`].
fn check_key(op: BatchOpRef<'_>, max_key: usize) -> Result<(), BackendError> {
    let limit = max_key.saturating_sub(keys::MARK_LEN);
    if let BatchOpRef::Put { key, .. } = op
        && key.len() > limit
    {
        return Err(BackendError::TooLarge {
            what: "key",
            len: key.len(),
            limit,
        });
    }
    Ok(())
}

/// Where the first pass of `commit_from` stands.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Lead {
    /// No operation seen yet.
    Start,
    /// Putting through the cursor; other operations are kept for the second pass.
    On,
    /// An operation on the cursor's bucket was kept: every later one is kept too.
    Kept,
    /// The batch does not begin with a put into the cursor's bucket: the second pass applies
    /// all of it.
    Off,
}

/// Puts `stored = value` through `cursor`: as an append (`MDB_APPEND`) while `appending`,
/// and as an ordinary put once a key was not above every other (as `apply` does).
fn append(
    cursor: &mut heed::RwIter<'_, Bytes, Bytes>,
    stored: &[u8],
    value: &[u8],
    appending: &mut bool,
) -> heed::Result<()> {
    if *appending {
        // SAFETY: heed requires that no slice into the database be alive while the cursor
        // writes. Nothing is read through this cursor, and `stored` and `value` are the
        // caller's buffers, not pages of the database.
        match unsafe { cursor.put_current_with_options::<Bytes>(PutFlags::APPEND, stored, value) } {
            Err(heed::Error::Mdb(MdbError::KeyExist)) => *appending = false,
            done => return done,
        }
    }
    // SAFETY: as above; with no flags the cursor puts as `mdb_put` does, wherever the key
    // goes.
    unsafe { cursor.put_current_with_options::<Bytes>(PutFlags::empty(), stored, value) }
}

/// Applies one batch operation to its bucket's database `db` inside the write transaction.
///
/// While `appending`, a put is first tried as an append (`MDB_APPEND`): a key above every key
/// of the database (the MVCC store's next revisions) goes to the last page without a search
/// from the root, and a full last page is split by moving only the new key to a new page,
/// so sequential keys fill their pages. LMDB refuses the append with `MDB_KEYEXIST`, changing
/// nothing, when the key is not above the last one; the put is then made as usual and
/// `appending` turns off for the rest of the database's run of operations.
fn apply(
    db: Database<Bytes, Bytes>,
    wtxn: &mut RwTxn<'_>,
    op: BatchOpRef<'_>,
    max_key: usize,
    buf: &mut Vec<u8>,
    appending: &mut bool,
) -> heed::Result<()> {
    match op {
        BatchOpRef::Put { key, value, .. } => {
            keys::encode_into(key, buf);
            if *appending {
                match db.put_with_flags(wtxn, PutFlags::APPEND, buf, value) {
                    Err(heed::Error::Mdb(MdbError::KeyExist)) => *appending = false,
                    done => return done,
                }
            }
            db.put(wtxn, buf, value)
        }
        BatchOpRef::Delete { key, .. } => {
            if keys::MARK_LEN + key.len() > max_key {
                return Ok(()); // longer than any stored key: absent
            }
            keys::encode_into(key, buf);
            db.delete(wtxn, buf).map(|_| ())
        }
        BatchOpRef::DeleteRange { start, end, .. } => delete_range(db, wtxn, start, end, max_key),
    }
}

fn delete_range(
    db: Database<Bytes, Bytes>,
    wtxn: &mut RwTxn<'_>,
    start: &[u8],
    end: Option<&[u8]>,
    max_key: usize,
) -> heed::Result<()> {
    let Some((lower, upper)) = keys::range_bounds(start, end, max_key) else {
        return Ok(());
    };
    let bounds: (Bound<&[u8]>, Bound<&[u8]>) = (
        lower.as_ref().map(Vec::as_slice),
        upper.as_ref().map(Vec::as_slice),
    );
    let mut iter = db.range_mut(wtxn, &bounds)?;
    while let Some(item) = iter.next() {
        item?;
        // SAFETY: heed requires that no slice into the database is alive while the cursor
        // deletes. The item just checked is dropped at the end of the statement above, and
        // nothing else read in this transaction is held.
        unsafe { iter.del_current()? };
    }
    Ok(())
}

/// [`BackendError::Full`] for an environment that ran out of map.
fn map_full(lmdb: &Env<WithoutTls>, map_size: usize, path: &Path) -> BackendError {
    let info = lmdb.info();
    let page = lmdb.stat().page_size as u64;
    let used = (info.last_page_number as u64 + 1) * page;
    tracing::warn!(
        path = %path.display(),
        used,
        map_size,
        "LMDB map is full; call LmdbBackend::grow_map or reopen with a larger map_size"
    );
    BackendError::Full {
        used,
        limit: map_size as u64,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    /// Batches led by puts into the bucket the last batch began with take the cursor pass:
    /// appends, overwrites of the last key (no longer appends), puts below it, operations on
    /// other buckets between them, and deletes on the led bucket after which its puts are
    /// kept in order; some batches fail on a key too long, in either pass. After every
    /// commit the backend holds what a model applying the operations in order holds.
    #[test]
    fn led_batches_apply_their_operations_in_order() {
        let mut x = 0x853c_49e6_748f_ea9bu64;
        let mut next = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let dir = tempfile::tempdir().unwrap();
        let backend = LmdbBackend::open(dir.path(), &LmdbOptions::default()).unwrap();
        let buckets = [Bucket::new("a"), Bucket::new("b"), Bucket::new("c")];
        let mut model: BTreeMap<(usize, Vec<u8>), Vec<u8>> = BTreeMap::new();
        let mut top = 0u64;
        let (mut failed, mut led) = (0, 0);
        for round in 0..300u64 {
            let lead = if next(4) == 0 { 1 } else { 0 };
            let mut batch = WriteBatch::new();
            let mut after = model.clone();
            let mut bad = false;
            for i in 0..next(40) {
                top += 1 + next(3);
                let key = match next(10) {
                    // Overwrite the highest key: no longer an append.
                    0 => top.saturating_sub(1 + next(5)),
                    _ => top,
                }
                .to_be_bytes()
                .to_vec();
                let value = format!("v{round}.{i}").into_bytes();
                batch.put(&buckets[lead], key.clone(), value.clone());
                after.insert((lead, key), value);
            }
            for i in 0..next(12) {
                let b = next(3) as usize;
                let key = next(top + 2).to_be_bytes().to_vec();
                match next(6) {
                    0 => {
                        batch.delete(&buckets[b], key.clone());
                        after.remove(&(b, key));
                    }
                    1 => {
                        let end = (next(top + 2) + 1).to_be_bytes().to_vec();
                        batch.delete_range(&buckets[b], key.clone(), Some(end.clone()));
                        after.retain(|(bb, k), _| !(*bb == b && *k >= key && *k < end));
                    }
                    2 if next(8) == 0 => {
                        batch.put(&buckets[b], vec![7u8; 600], b"too long".to_vec());
                        bad = true;
                    }
                    _ => {
                        let value = format!("w{round}.{i}").into_bytes();
                        batch.put(&buckets[b], key.clone(), value.clone());
                        after.insert((b, key), value);
                    }
                }
            }
            if batch.op_count() == 0 {
                continue;
            }
            led += usize::from(backend.writer.lock().lead.is_some());
            let result = backend.commit(&batch);
            assert_eq!(result.is_err(), bad, "round {round}: {result:?}");
            if bad {
                failed += 1;
            } else {
                model = after;
            }
            let txn = backend.read_txn().unwrap();
            let mut held = BTreeMap::new();
            for (b, bucket) in buckets.iter().enumerate() {
                for item in txn.range(bucket, b"", None).unwrap() {
                    let (k, v) = item.unwrap();
                    held.insert((b, k.to_vec()), v.to_vec());
                }
            }
            assert_eq!(held, model, "round {round}");
        }
        assert!(failed > 5 && led > 100, "{failed} failed, {led} led");
    }
}
