//! [`MemBackend`]: an in-memory [`Backend`] for tests.
//!
//! Contents live in a process-global registry keyed by path, so dropping a backend and opening
//! the same path again "reopens" it with every committed batch (but nothing survives the
//! process). Each bucket is an `Arc<BTreeMap>`: a commit copies the buckets it touches when a
//! read transaction still shares them, so readers keep their snapshot and never block the
//! writer. [`MemBackend::set_fail_commits`] makes commits fail, to test error paths.

use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};

use parking_lot::Mutex;

use crate::backend::{Backend, BackendError, BackendSize, BatchOp, Bucket, ReadTxn, WriteBatch};

type Tree = BTreeMap<Vec<u8>, Vec<u8>>;
type Data = BTreeMap<Bucket, Arc<Tree>>;

struct Shared {
    data: Mutex<Arc<Data>>,
    open: AtomicBool,
    /// Largest payload since the last defragmentation: what a file would have grown to.
    high_water: AtomicU64,
}

fn payload(data: &Data) -> u64 {
    data.values()
        .flat_map(|t| t.iter())
        .map(|(k, v)| (k.len() + v.len()) as u64)
        .sum()
}

static REGISTRY: LazyLock<Mutex<HashMap<PathBuf, Arc<Shared>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// Options of [`MemBackend`] (none matter; kept for the [`Backend`] contract).
#[derive(Clone, Debug, Default)]
pub struct MemOptions {}

/// Read transactions of one backend handle open now, and the most open at once.
#[derive(Debug, Default)]
struct ReaderCount {
    open: AtomicUsize,
    peak: AtomicUsize,
}

/// An in-memory backend; see the module docs.
pub struct MemBackend {
    path: PathBuf,
    shared: Arc<Shared>,
    readers: Arc<ReaderCount>,
    commit: Mutex<()>,
    fail: AtomicBool,
    /// Nanoseconds every commit sleeps before it applies its batch.
    commit_delay: AtomicU64,
    /// Commits this handle applied.
    commits: AtomicU64,
}

impl MemBackend {
    /// Makes every later commit fail with an I/O error (`true`) or succeed again (`false`).
    pub fn set_fail_commits(&self, fail: bool) {
        self.fail.store(fail, Ordering::Release);
    }

    /// Makes every later commit sleep `delay` before applying its batch, like a slow disk.
    pub fn set_commit_delay(&self, delay: std::time::Duration) {
        let nanos = u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX);
        self.commit_delay.store(nanos, Ordering::Release);
    }

    /// Commits this handle has applied since it was opened.
    pub fn commits(&self) -> u64 {
        self.commits.load(Ordering::Acquire)
    }

    /// Forgets the contents stored under `path` (the path must not be open).
    pub fn forget(path: &Path) {
        REGISTRY.lock().remove(path);
    }

    /// Number of pairs in `bucket` as last committed.
    pub fn len(&self, bucket: &Bucket) -> usize {
        self.shared.data.lock().get(bucket).map_or(0, |t| t.len())
    }

    /// True when no bucket holds a pair.
    pub fn is_empty(&self) -> bool {
        self.shared.data.lock().is_empty()
    }

    /// Read transactions of this handle open now.
    pub fn open_read_txns(&self) -> usize {
        self.readers.open.load(Ordering::Acquire)
    }

    /// The most read transactions of this handle open at once since the last
    /// [`reset_peak_read_txns`](MemBackend::reset_peak_read_txns) (or the open).
    pub fn peak_read_txns(&self) -> usize {
        self.readers.peak.load(Ordering::Acquire)
    }

    /// Starts measuring [`peak_read_txns`](MemBackend::peak_read_txns) again from now.
    pub fn reset_peak_read_txns(&self) {
        self.readers
            .peak
            .store(self.readers.open.load(Ordering::Acquire), Ordering::Release);
    }
}

impl Drop for MemBackend {
    fn drop(&mut self) {
        self.shared.open.store(false, Ordering::Release);
    }
}

/// A snapshot of a [`MemBackend`].
pub struct MemReadTxn {
    data: Arc<Data>,
    readers: Arc<ReaderCount>,
}

impl Drop for MemReadTxn {
    fn drop(&mut self) {
        self.readers.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Iterator of [`MemReadTxn::range`].
pub struct MemRange<'a> {
    inner: Option<std::collections::btree_map::Range<'a, Vec<u8>, Vec<u8>>>,
}

impl<'a> Iterator for MemRange<'a> {
    type Item = Result<(&'a [u8], &'a [u8]), BackendError>;

    fn next(&mut self) -> Option<Self::Item> {
        let (k, v) = self.inner.as_mut()?.next()?;
        Some(Ok((k.as_slice(), v.as_slice())))
    }
}

type KeyBounds<'a> = (Bound<&'a [u8]>, Bound<&'a [u8]>);

fn bounds<'a>(start: &'a [u8], end: Option<&'a [u8]>) -> Option<KeyBounds<'a>> {
    match end {
        Some(e) if e <= start => None,
        Some(e) => Some((Bound::Included(start), Bound::Excluded(e))),
        None => Some((Bound::Included(start), Bound::Unbounded)),
    }
}

impl ReadTxn for MemReadTxn {
    type Range<'a> = MemRange<'a>;

    fn get(&self, bucket: &Bucket, key: &[u8]) -> Result<Option<&[u8]>, BackendError> {
        Ok(self
            .data
            .get(bucket)
            .and_then(|t| t.get(key))
            .map(Vec::as_slice))
    }

    fn range<'a>(
        &'a self,
        bucket: &Bucket,
        start: &[u8],
        end: Option<&[u8]>,
    ) -> Result<MemRange<'a>, BackendError> {
        let inner = match (self.data.get(bucket), bounds(start, end)) {
            (Some(t), Some(b)) => Some(t.range::<[u8], _>(b)),
            _ => None,
        };
        Ok(MemRange { inner })
    }

    fn buckets(&self) -> Result<Vec<Bucket>, BackendError> {
        Ok(self.data.keys().cloned().collect())
    }
}

impl Backend for MemBackend {
    type Options = MemOptions;
    type ReadTxn = MemReadTxn;

    fn open(path: &Path, _options: &MemOptions) -> Result<MemBackend, BackendError> {
        let shared = REGISTRY
            .lock()
            .entry(path.to_path_buf())
            .or_insert_with(|| {
                Arc::new(Shared {
                    data: Mutex::new(Arc::new(Data::new())),
                    open: AtomicBool::new(false),
                    high_water: AtomicU64::new(0),
                })
            })
            .clone();
        if shared.open.swap(true, Ordering::AcqRel) {
            return Err(BackendError::Locked {
                path: path.to_path_buf(),
            });
        }
        Ok(MemBackend {
            path: path.to_path_buf(),
            shared,
            readers: Arc::default(),
            commit: Mutex::new(()),
            fail: AtomicBool::new(false),
            commit_delay: AtomicU64::new(0),
            commits: AtomicU64::new(0),
        })
    }

    fn read_txn(&self) -> Result<MemReadTxn, BackendError> {
        let open = self.readers.open.fetch_add(1, Ordering::AcqRel) + 1;
        self.readers.peak.fetch_max(open, Ordering::AcqRel);
        Ok(MemReadTxn {
            data: self.shared.data.lock().clone(),
            readers: self.readers.clone(),
        })
    }

    fn commit(&self, batch: &WriteBatch) -> Result<(), BackendError> {
        let _c = self.commit.lock();
        let delay = self.commit_delay.load(Ordering::Acquire);
        if delay > 0 {
            std::thread::sleep(std::time::Duration::from_nanos(delay));
        }
        if self.fail.load(Ordering::Acquire) {
            return Err(BackendError::io(
                &self.path,
                "commit",
                std::io::Error::other("injected commit failure"),
            ));
        }
        let mut data: Data = (**self.shared.data.lock()).clone();
        for op in batch.ops() {
            match op {
                BatchOp::Put { bucket, key, value } => {
                    bucket.validate()?;
                    Arc::make_mut(data.entry(bucket.clone()).or_default())
                        .insert(key.clone(), value.clone());
                }
                BatchOp::Delete { bucket, key } => {
                    bucket.validate()?;
                    if let Some(t) = data.get_mut(bucket) {
                        Arc::make_mut(t).remove(key);
                    }
                }
                BatchOp::DeleteRange { bucket, start, end } => {
                    bucket.validate()?;
                    if let Some(t) = data.get_mut(bucket)
                        && let Some(b) = bounds(start, end.as_deref())
                    {
                        let doomed: Vec<Vec<u8>> =
                            t.range::<[u8], _>(b).map(|(k, _)| k.clone()).collect();
                        let t = Arc::make_mut(t);
                        for k in doomed {
                            t.remove(&k);
                        }
                    }
                }
            }
        }
        data.retain(|_, t| !t.is_empty());
        self.shared
            .high_water
            .fetch_max(payload(&data), Ordering::AcqRel);
        *self.shared.data.lock() = Arc::new(data);
        self.commits.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    fn size(&self) -> Result<BackendSize, BackendError> {
        let in_use = payload(&self.shared.data.lock().clone());
        Ok(BackendSize {
            on_disk: self.shared.high_water.load(Ordering::Acquire).max(in_use),
            in_use,
        })
    }

    fn defragment(&self) -> Result<(), BackendError> {
        let _c = self.commit.lock();
        let in_use = payload(&self.shared.data.lock().clone());
        self.shared.high_water.store(in_use, Ordering::Release);
        Ok(())
    }
}
