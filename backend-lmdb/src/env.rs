//! The store directory, its exclusive lock, and the one `unsafe` LMDB open.
//!
//! A store at `path` is a directory holding a `LOCK` file and one *generation* directory per
//! live LMDB environment (see the crate docs for the layout). [`DirLock`] holds an exclusive
//! `flock` on `LOCK`; every [`Generation`] keeps an `Arc` of it, so the lock is released only
//! when the backend handle **and** every read transaction it handed out are gone. While it is
//! held, no other handle — in this process or another — opens anything in the directory.
//!
//! [`Generation`] owns one open LMDB environment and the handles of its bucket databases
//! ([`Dbs`]). Read transactions hold an `Arc` of the generation they were opened on; when
//! defragment swaps in a new generation it marks the old one retired, and the old directory is
//! deleted once its last reader drops it.
//!
//! Bucket database handles: LMDB opens a named database in a transaction, and only one
//! transaction of the process may open handles at a time. Here only the writer does it (at
//! open, and in a commit that creates a bucket), under the writer lock. Once such a commit
//! has returned, the writer publishes a new [`Dbs`] naming the new handles and the commit's
//! id (its *layout id*, also written in the commit stamp, see `keys`). A reader takes the
//! published `Dbs` **before** it begins its LMDB transaction, so every handle in it was
//! committed before the transaction began and is valid in it; and it checks that the layout
//! id in its snapshot's stamp is not newer than the `Dbs` it took, so every bucket of its
//! snapshot has a handle in it (otherwise it begins again, which happens only while a bucket
//! is being created).

use std::fs::{self, File, TryLockError};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use heed::types::Bytes;
use heed::{Database, Env, EnvFlags, EnvOpenOptions, MdbError, RoTxn, RwTxn, WithoutTls};
use keel_mvcc::{BackendError, Bucket};
use parking_lot::RwLock;

use crate::error::from_heed;
use crate::options::LmdbOptions;

/// Name of the lock file inside the store directory.
pub const LOCK_FILE: &str = "LOCK";
/// How long a lock found held is retried before open reports [`BackendError::Locked`].
///
/// A `flock` belongs to the open file, and a child process being spawned by any thread of
/// this process holds a copy of every descriptor from its fork until its exec closes them.
/// A handle dropped in that window keeps the lock held for the child's last moments, so a
/// reopen right after the drop would fail without this grace period.
const LOCK_WAIT: Duration = Duration::from_millis(250);
/// Prefix of generation directory names.
const GEN_PREFIX: &str = "gen-";
/// Suffix of a generation still being written.
const TMP_SUFFIX: &str = ".tmp";
/// LMDB's data file inside a generation directory.
pub const DATA_FILE: &str = "data.mdb";
/// LMDB's lock file inside a generation directory.
pub const LMDB_LOCK_FILE: &str = "lock.mdb";

/// An exclusive lock on a store directory, released when dropped.
#[derive(Debug)]
pub struct DirLock {
    _file: File,
    path: PathBuf,
}

impl DirLock {
    /// Takes the lock on `dir` (created if absent), or fails with [`BackendError::Locked`].
    pub fn acquire(dir: &Path) -> Result<DirLock, BackendError> {
        fs::create_dir_all(dir).map_err(|e| BackendError::io(dir, "create directory", e))?;
        let path = dir.join(LOCK_FILE);
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| BackendError::io(&path, "open", e))?;
        let deadline = Instant::now() + LOCK_WAIT;
        loop {
            match file.try_lock() {
                Ok(()) => {
                    return Ok(DirLock {
                        _file: file,
                        path: dir.to_path_buf(),
                    });
                }
                Err(TryLockError::WouldBlock) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(TryLockError::WouldBlock) => {
                    return Err(BackendError::Locked {
                        path: dir.to_path_buf(),
                    });
                }
                Err(TryLockError::Error(e)) => return Err(BackendError::io(&path, "flock", e)),
            }
        }
    }

    /// The locked store directory.
    pub fn dir(&self) -> &Path {
        &self.path
    }
}

/// The handles of the bucket databases of one environment, as of one layout id.
#[derive(Clone, Debug, Default)]
pub(crate) struct Dbs {
    /// Ascending by name.
    entries: Vec<(Box<str>, Database<Bytes, Bytes>)>,
    /// Id of the commit (or open) that created or opened the newest of them.
    layout: u64,
}

impl Dbs {
    /// The database of bucket `name`, if it exists.
    #[inline]
    pub(crate) fn get(&self, name: &str) -> Option<Database<Bytes, Bytes>> {
        let i = self
            .entries
            .binary_search_by(|(n, _)| (**n).cmp(name))
            .ok()?;
        Some(self.entries[i].1)
    }

    /// Every bucket database, ascending by name.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&str, Database<Bytes, Bytes>)> {
        self.entries.iter().map(|(n, db)| (&**n, *db))
    }

    /// The layout id these handles are current for.
    pub(crate) fn layout(&self) -> u64 {
        self.layout
    }

    /// These handles plus `added` (names not in them), current for `layout`.
    pub(crate) fn with(&self, added: &[(Bucket, Database<Bytes, Bytes>)], layout: u64) -> Dbs {
        let mut entries = self.entries.clone();
        entries.extend(
            added
                .iter()
                .map(|(b, db)| (b.name().to_owned().into_boxed_str(), *db)),
        );
        entries.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        Dbs { entries, layout }
    }
}

/// The database of `bucket` in the write transaction `wtxn`: from `dbs`, from `created` (made
/// earlier in this transaction), or created now (and added to `created`) if `create`;
/// `None` when it does not exist and `create` is false.
pub(crate) fn bucket_db(
    env: &Env<WithoutTls>,
    wtxn: &mut RwTxn<'_>,
    dbs: &Dbs,
    created: &mut Vec<(Bucket, Database<Bytes, Bytes>)>,
    bucket: &Bucket,
    create: bool,
) -> heed::Result<Option<Database<Bytes, Bytes>>> {
    if let Some(db) = dbs.get(bucket.name()) {
        return Ok(Some(db));
    }
    if let Some((_, db)) = created.iter().find(|(b, _)| b == bucket) {
        return Ok(Some(*db));
    }
    if !create {
        return Ok(None);
    }
    let db = env.create_database::<Bytes, Bytes>(wtxn, Some(bucket.name()))?;
    created.push((bucket.clone(), db));
    Ok(Some(db))
}

/// One open LMDB environment of a store: a generation directory.
pub struct Generation {
    env: Option<Env<WithoutTls>>,
    /// The unnamed database: the bucket databases' records and the commit stamp.
    main: Database<Bytes, Bytes>,
    dbs: RwLock<Arc<Dbs>>,
    number: u64,
    dir: PathBuf,
    max_key: usize,
    retired: AtomicBool,
    lock: Arc<DirLock>,
}

impl Generation {
    /// Opens the existing environment of generation `number` of the locked store.
    ///
    /// A generation directory only ever appears complete (it is written under a temporary
    /// name and renamed), so a missing, empty or short data file is damage, reported as
    /// [`BackendError::Corrupt`] rather than silently replaced by an empty store or left to
    /// fault when LMDB touches a page past the end of the file.
    pub(crate) fn open(
        lock: &Arc<DirLock>,
        number: u64,
        map_size: usize,
        options: &LmdbOptions,
    ) -> Result<Generation, BackendError> {
        let dir = generation_dir(lock.dir(), number);
        let data = dir.join(DATA_FILE);
        let len = match fs::metadata(&data) {
            Ok(meta) => meta.len(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => 0,
            Err(e) => return Err(BackendError::io(&data, "stat", e)),
        };
        if len == 0 {
            return Err(BackendError::Corrupt {
                path: data,
                offset: 0,
                reason: "the data file of a complete generation is missing or empty".to_owned(),
            });
        }
        // SAFETY: see `open_env`; `lock` is the store's held lock and `dir` is inside it.
        let env = unsafe { open_env(&dir, map_size, options, true) }?;
        // Before any transaction touches the mapping: every page the last commit refers to
        // must be inside the file.
        let info = env.info();
        let page = u64::from(env.stat().page_size);
        let needed = (info.last_page_number as u64 + 1) * page;
        if len < needed {
            return Err(BackendError::Corrupt {
                path: data,
                offset: len,
                reason: format!(
                    "the data file is {len} bytes but its last commit uses pages up to byte \
                     {needed}: it was truncated"
                ),
            });
        }
        let main = main_database(&env, &dir)?;
        let dbs = open_buckets(&env, main, &dir)?;
        let max_key = env.max_key_size();
        Ok(Generation {
            env: Some(env),
            main,
            dbs: RwLock::new(Arc::new(dbs)),
            number,
            dir,
            max_key,
            retired: AtomicBool::new(false),
            lock: Arc::clone(lock),
        })
    }

    /// Creates generation `number` of the locked store as an empty LMDB environment, written
    /// under a temporary name and renamed into place once durable, then opens it.
    pub(crate) fn create(
        lock: &Arc<DirLock>,
        number: u64,
        map_size: usize,
        options: &LmdbOptions,
    ) -> Result<Generation, BackendError> {
        let root = lock.dir();
        let tmp = temp_generation_dir(root, number);
        let build = || -> Result<(), BackendError> {
            if tmp.exists() {
                fs::remove_dir_all(&tmp)
                    .map_err(|e| BackendError::io(&tmp, "remove directory", e))?;
            }
            fs::create_dir(&tmp).map_err(|e| BackendError::io(&tmp, "create directory", e))?;
            let durable = LmdbOptions {
                sync_on_commit: true,
                ..options.clone()
            };
            // SAFETY: see `open_env`; `lock` is the store's held lock and `tmp` is inside it.
            let env = unsafe { open_env(&tmp, map_size, &durable, true) }?;
            main_database(&env, &tmp)?;
            env.force_sync()
                .map_err(|e| from_heed(&tmp, "fdatasync", e))?;
            drop(env);
            sync_dir(&tmp)?;
            let dir = generation_dir(root, number);
            fs::rename(&tmp, &dir).map_err(|e| BackendError::io(&tmp, "rename", e))?;
            sync_dir(root)
        };
        if let Err(e) = build() {
            let _ = fs::remove_dir_all(&tmp);
            return Err(e);
        }
        Generation::open(lock, number, map_size, options)
    }

    /// The LMDB environment.
    pub(crate) fn env(&self) -> &Env<WithoutTls> {
        self.env.as_ref().expect("the environment lives until drop")
    }

    /// The unnamed database: bucket records and the commit stamp.
    pub(crate) fn main(&self) -> Database<Bytes, Bytes> {
        self.main
    }

    /// The bucket database handles published so far.
    #[inline]
    pub(crate) fn dbs(&self) -> Arc<Dbs> {
        Arc::clone(&self.dbs.read())
    }

    /// Publishes `dbs`, after the commit that created its newest handles returned. Only the
    /// writer calls it, under the writer lock.
    pub(crate) fn publish(&self, dbs: Dbs) {
        *self.dbs.write() = Arc::new(dbs);
    }

    /// This generation's number.
    pub(crate) fn number(&self) -> u64 {
        self.number
    }

    /// This generation's directory.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Longest key LMDB stores.
    pub(crate) fn max_key(&self) -> usize {
        self.max_key
    }

    /// The store's lock.
    pub(crate) fn lock(&self) -> &Arc<DirLock> {
        &self.lock
    }

    /// Marks this generation superseded: its directory is deleted when it is dropped.
    pub(crate) fn retire(&self) {
        self.retired.store(true, Ordering::Release);
    }

    /// Pages in use in the snapshot `txn` sees, and the page size. In use: the pages of every
    /// database's tree (branch, leaf and overflow pages), the unnamed one's included, and
    /// LMDB's two meta pages; not the free pages, nor the pages of the free list's own tree.
    /// `dbs` holds a handle of every bucket database of that snapshot.
    pub(crate) fn pages_in_use(
        &self,
        txn: &RoTxn<'_, WithoutTls>,
        dbs: &Dbs,
    ) -> Result<(u64, u64), BackendError> {
        let stat = |db: Database<Bytes, Bytes>| {
            db.stat(txn)
                .map(|s| {
                    (
                        (s.branch_pages + s.leaf_pages + s.overflow_pages) as u64,
                        u64::from(s.page_size),
                    )
                })
                .map_err(|e| from_heed(&self.dir, "stat", e))
        };
        let (mut pages, page_size) = stat(self.main)?;
        for (_, db) in dbs.iter() {
            pages += stat(db)?.0;
        }
        Ok((pages + 2, page_size))
    }

    /// Bytes of this generation's files: their lengths, or the bytes allocated to a sparse
    /// file (a data file that [`LmdbOptions::write_map`] extended to the map size).
    pub(crate) fn disk_size(&self) -> Result<u64, BackendError> {
        use std::os::unix::fs::MetadataExt as _;
        let mut total = 0;
        for name in [DATA_FILE, LMDB_LOCK_FILE] {
            let path = self.dir.join(name);
            match fs::metadata(&path) {
                Ok(meta) => total += meta.len().min(meta.blocks().saturating_mul(512)),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(BackendError::io(&path, "stat", e)),
            }
        }
        Ok(total)
    }
}

/// The unnamed database, which holds every bucket; committing makes its handle valid for
/// every later transaction.
pub(crate) fn main_database(
    env: &Env<WithoutTls>,
    dir: &Path,
) -> Result<Database<Bytes, Bytes>, BackendError> {
    let mut wtxn = env
        .write_txn()
        .map_err(|e| from_heed(dir, "begin write transaction", e))?;
    let db: Database<Bytes, Bytes> = env
        .create_database(&mut wtxn, None)
        .map_err(|e| from_heed(dir, "open the main database", e))?;
    wtxn.commit()
        .map_err(|e| from_heed(dir, "commit the main database", e))?;
    Ok(db)
}

/// Opens every bucket database of the environment and stamps this as a commit of its own
/// whose id is also the layout id (after a compacting copy LMDB's transaction ids restart, so
/// the stamp is always rewritten). Runs before any read transaction can use the environment.
///
/// A key of the unnamed database that is neither the commit stamp nor a bucket name is
/// reported as damage: it is what a store written with every bucket inside the unnamed
/// database (an earlier layout) or a damaged file looks like.
fn open_buckets(
    env: &Env<WithoutTls>,
    main: Database<Bytes, Bytes>,
    dir: &Path,
) -> Result<Dbs, BackendError> {
    let mut wtxn = env
        .write_txn()
        .map_err(|e| from_heed(dir, "begin write transaction", e))?;
    let mut names = Vec::new();
    for item in main
        .iter(&wtxn)
        .map_err(|e| from_heed(dir, "list bucket databases", e))?
    {
        let (key, _) = item.map_err(|e| from_heed(dir, "list bucket databases", e))?;
        if key == crate::keys::COMMIT_STAMP {
            continue;
        }
        let bucket = std::str::from_utf8(key)
            .ok()
            .and_then(|name| Bucket::from_name(name.to_owned()).ok())
            .ok_or_else(|| not_a_bucket(dir, key))?;
        names.push(bucket);
    }
    let mut entries = Vec::with_capacity(names.len());
    for bucket in names {
        let db = env
            .open_database::<Bytes, Bytes>(&wtxn, Some(bucket.name()))
            .map_err(|e| match e {
                heed::Error::Mdb(MdbError::Incompatible) => {
                    not_a_bucket(dir, bucket.name().as_bytes())
                }
                e => from_heed(dir, "open a bucket database", e),
            })?
            .ok_or_else(|| not_a_bucket(dir, bucket.name().as_bytes()))?;
        entries.push((bucket.name().to_owned().into_boxed_str(), db));
    }
    let id = wtxn.id() as u64;
    main.put(
        &mut wtxn,
        crate::keys::COMMIT_STAMP,
        &crate::keys::stamp(id, id),
    )
    .map_err(|e| from_heed(dir, "write commit stamp", e))?;
    wtxn.commit()
        .map_err(|e| from_heed(dir, "commit the commit stamp", e))?;
    Ok(Dbs {
        entries,
        layout: id,
    })
}

fn not_a_bucket(dir: &Path, key: &[u8]) -> BackendError {
    BackendError::Corrupt {
        path: dir.join(DATA_FILE),
        offset: 0,
        reason: format!(
            "the unnamed database holds {:?}, which is neither a bucket database nor the \
             commit stamp (a store of the earlier single-database layout, or damage)",
            String::from_utf8_lossy(key)
        ),
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        // Read transactions hold this generation and drop their LMDB transaction first, and
        // nothing else keeps a clone of the environment, so this closes it.
        drop(self.env.take());
        if self.retired.load(Ordering::Acquire) {
            match fs::remove_dir_all(&self.dir) {
                Ok(()) => tracing::debug!(dir = %self.dir.display(), "removed retired generation"),
                Err(e) => tracing::warn!(
                    dir = %self.dir.display(),
                    error = %e,
                    "could not remove a retired generation; it is removed at the next open"
                ),
            }
        }
    }
}

/// Opens the LMDB environment in `dir`.
///
/// # Safety
///
/// LMDB maps `dir/data.mdb` into memory and hands out slices into the mapping; heed marks the
/// open `unsafe` because those slices change under the program (undefined behaviour) if the
/// file is modified other than through this environment. The caller guarantees:
///
/// 1. **Exclusive access.** It holds the store's [`DirLock`] (an exclusive `flock` taken
///    before this call) and `dir` lies inside that store, so no other handle in any process
///    opens this environment while the returned one lives (every generation keeps the lock
///    alive). This also rules out opening the same environment twice in one process, which
///    LMDB forbids (its POSIX locks are per process).
/// 2. **Local file system.** `dir` is on a local file system; LMDB's locking and `mmap`
///    coherence do not hold on network file systems (NFS, SMB). This is documented on
///    [`LmdbBackend`](crate::LmdbBackend) as a requirement for its users.
/// 3. **Nobody else writes the files.** Nothing outside this crate writes `data.mdb` or
///    `lock.mdb` while the store is open; this crate only writes them through LMDB.
///
/// The map size is fixed here; LMDB refuses writes beyond it with `MDB_MAP_FULL` rather than
/// touching memory outside the mapping. heed's `WithoutTls` mode opens with `MDB_NOTLS`, so a
/// read transaction is tied to its object rather than to a thread and may move between
/// threads (heed then implements `Send` for it).
///
/// `named` says whether the environment has one named database per bucket (the backend's
/// layout, up to [`LmdbOptions::max_buckets`]) or only the unnamed one (raw LMDB).
pub(crate) unsafe fn open_env(
    dir: &Path,
    map_size: usize,
    options: &LmdbOptions,
    named: bool,
) -> Result<Env<WithoutTls>, BackendError> {
    let mut builder = EnvOpenOptions::new().read_txn_without_tls();
    builder
        .map_size(map_size)
        .max_readers(options.max_readers)
        .max_dbs(if named { options.max_buckets } else { 0 });
    let mut flags = if options.sync_on_commit {
        EnvFlags::empty()
    } else {
        EnvFlags::NO_SYNC
    };
    if options.write_map {
        flags |= EnvFlags::WRITE_MAP;
    }
    // SAFETY: the caller upholds this function's contract above, which is heed's contract
    // for `open` (exclusive, local, unmodified files). `NO_SYNC` and `WRITE_MAP` are the only
    // flags ever set; heed marks `flags` unsafe for what they weaken, not for memory safety
    // of this crate's reads: `NO_SYNC` skips the `fdatasync` (LMDB still writes pages and
    // meta in the same order); `WRITE_MAP` makes the map writable, which only this process's
    // LMDB writes through (the crate's code never writes through the slices it reads, which
    // are shared borrows), and LMDB writes only pages that no live read transaction can see,
    // as it does without the flag.
    unsafe {
        builder.flags(flags);
        builder.open(dir)
    }
    .map_err(|e| from_heed(dir, "open environment", e))
}

/// Directory of generation `number` of the store in `root`.
pub(crate) fn generation_dir(root: &Path, number: u64) -> PathBuf {
    root.join(format!("{GEN_PREFIX}{number:016x}"))
}

/// Directory where generation `number` is written before it is renamed into place.
pub(crate) fn temp_generation_dir(root: &Path, number: u64) -> PathBuf {
    root.join(format!("{GEN_PREFIX}{number:016x}{TMP_SUFFIX}"))
}

/// Finds the live generation of the locked store (`None` in a new store), and deletes
/// leftovers: unfinished copies and generations superseded by a later one.
pub(crate) fn recover_generations(lock: &DirLock) -> Result<Option<u64>, BackendError> {
    let root = lock.dir();
    let mut complete = Vec::new();
    let mut leftovers = Vec::new();
    let entries = fs::read_dir(root).map_err(|e| BackendError::io(root, "read directory", e))?;
    for entry in entries {
        let entry = entry.map_err(|e| BackendError::io(root, "read directory", e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(rest) = name.strip_prefix(GEN_PREFIX) else {
            continue;
        };
        if let Some(number) = rest.strip_suffix(TMP_SUFFIX) {
            if u64::from_str_radix(number, 16).is_ok() {
                leftovers.push(entry.path());
            }
        } else if rest.len() == 16
            && let Ok(number) = u64::from_str_radix(rest, 16)
        {
            complete.push(number);
        }
    }
    complete.sort_unstable();
    let live = complete.pop();
    leftovers.extend(complete.iter().map(|&n| generation_dir(root, n)));
    for dir in &leftovers {
        tracing::info!(dir = %dir.display(), "removing a leftover generation");
        fs::remove_dir_all(dir).map_err(|e| BackendError::io(dir, "remove directory", e))?;
    }
    if !leftovers.is_empty() {
        sync_dir(root)?;
    }
    Ok(live)
}

/// Makes the entries of directory `dir` (creations, renames, removals) durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), BackendError> {
    File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| BackendError::io(dir, "fsync directory", e))
}
