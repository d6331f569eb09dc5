//! A writer killed with SIGKILL loses no acknowledged write: after reopen the store is
//! consistent and its consistent index matches its contents. Runs the shared crash test on
//! a small file-persisted backend defined here (the in-memory backend dies with its process).
//!
//! `KEEL_CRASH_ROUNDS=1000 cargo test -p keel-mvcc --test it crash` runs more rounds.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use keel_mvcc::{Backend, BackendError, BackendSize, BatchOp, Bucket, ReadTxn, WriteBatch};
use parking_lot::Mutex;

type Data = BTreeMap<Bucket, BTreeMap<Vec<u8>, Vec<u8>>>;

/// The whole store in one file, replaced atomically (write, fsync, rename, fsync the
/// directory) on every commit. Format: "KTFB" | u32 LE version 1 | records | u32 LE CRC-32 of
/// everything before; record = u8 bucket length | bucket | u32 LE key length | key | u32 LE
/// value length | value.
struct FileBackend {
    dir: PathBuf,
    data: Mutex<Arc<Data>>,
    commit: Mutex<()>,
    _lock: File,
}

struct FileReadTxn(Arc<Data>);

struct FileRange<'a>(Option<std::collections::btree_map::Range<'a, Vec<u8>, Vec<u8>>>);

impl<'a> Iterator for FileRange<'a> {
    type Item = Result<(&'a [u8], &'a [u8]), BackendError>;
    fn next(&mut self) -> Option<Self::Item> {
        let (k, v) = self.0.as_mut()?.next()?;
        Some(Ok((k.as_slice(), v.as_slice())))
    }
}

impl ReadTxn for FileReadTxn {
    type Range<'a> = FileRange<'a>;
    fn get(&self, bucket: &Bucket, key: &[u8]) -> Result<Option<&[u8]>, BackendError> {
        Ok(self
            .0
            .get(bucket)
            .and_then(|t| t.get(key))
            .map(Vec::as_slice))
    }
    fn range<'a>(
        &'a self,
        bucket: &Bucket,
        start: &[u8],
        end: Option<&[u8]>,
    ) -> Result<FileRange<'a>, BackendError> {
        use std::ops::Bound;
        let Some(t) = self.0.get(bucket) else {
            return Ok(FileRange(None));
        };
        let upper = match end {
            Some(e) if e <= start => return Ok(FileRange(None)),
            Some(e) => Bound::Excluded(e),
            None => Bound::Unbounded,
        };
        Ok(FileRange(Some(
            t.range::<[u8], _>((Bound::Included(start), upper)),
        )))
    }
    fn buckets(&self) -> Result<Vec<Bucket>, BackendError> {
        Ok(self.0.keys().cloned().collect())
    }
}

fn io<'a>(path: &'a Path, op: &'static str) -> impl FnOnce(std::io::Error) -> BackendError + 'a {
    move |e| BackendError::io(path, op, e)
}

fn corrupt(path: &Path, reason: &str) -> BackendError {
    BackendError::Corrupt {
        path: path.to_path_buf(),
        offset: 0,
        reason: reason.to_owned(),
    }
}

fn load(path: &Path) -> Result<Data, BackendError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Data::new()),
        Err(e) => return Err(BackendError::io(path, "read", e)),
    };
    if bytes.len() < 12 || &bytes[..4] != b"KTFB" {
        return Err(corrupt(path, "bad header"));
    }
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    if crc32fast::hash(body) != u32::from_le_bytes(crc.try_into().unwrap()) {
        return Err(corrupt(path, "checksum mismatch"));
    }
    let mut data = Data::new();
    let mut at = 8;
    let take = |at: &mut usize, n: usize| -> Result<&[u8], BackendError> {
        let s = body
            .get(*at..*at + n)
            .ok_or_else(|| corrupt(path, "truncated record"))?;
        *at += n;
        Ok(s)
    };
    while at < body.len() {
        let blen = take(&mut at, 1)?[0] as usize;
        let name = String::from_utf8(take(&mut at, blen)?.to_vec())
            .map_err(|_| corrupt(path, "bucket name"))?;
        let klen = u32::from_le_bytes(take(&mut at, 4)?.try_into().unwrap()) as usize;
        let key = take(&mut at, klen)?.to_vec();
        let vlen = u32::from_le_bytes(take(&mut at, 4)?.try_into().unwrap()) as usize;
        let value = take(&mut at, vlen)?.to_vec();
        data.entry(Bucket::from_name(name)?)
            .or_default()
            .insert(key, value);
    }
    Ok(data)
}

impl Backend for FileBackend {
    type Options = ();
    type ReadTxn = FileReadTxn;

    fn open(path: &Path, _: &()) -> Result<FileBackend, BackendError> {
        std::fs::create_dir_all(path).map_err(io(path, "create_dir"))?;
        let lock_path = path.join("LOCK");
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io(&lock_path, "open"))?;
        if lock.try_lock().is_err() {
            return Err(BackendError::Locked {
                path: path.to_path_buf(),
            });
        }
        let data = load(&path.join("data"))?;
        Ok(FileBackend {
            dir: path.to_path_buf(),
            data: Mutex::new(Arc::new(data)),
            commit: Mutex::new(()),
            _lock: lock,
        })
    }

    fn read_txn(&self) -> Result<FileReadTxn, BackendError> {
        Ok(FileReadTxn(self.data.lock().clone()))
    }

    fn commit(&self, batch: &WriteBatch) -> Result<(), BackendError> {
        let _c = self.commit.lock();
        let mut data: Data = (**self.data.lock()).clone();
        for op in batch.ops() {
            match op {
                BatchOp::Put { bucket, key, value } => {
                    data.entry(bucket.clone())
                        .or_default()
                        .insert(key.clone(), value.clone());
                }
                BatchOp::Delete { bucket, key } => {
                    if let Some(t) = data.get_mut(bucket) {
                        t.remove(key);
                    }
                }
                BatchOp::DeleteRange { bucket, start, end } => {
                    if let Some(t) = data.get_mut(bucket) {
                        t.retain(|k, _| !(k >= start && end.as_ref().is_none_or(|e| k < e)));
                    }
                }
            }
        }
        data.retain(|_, t| !t.is_empty());
        let mut out = b"KTFB".to_vec();
        out.extend_from_slice(&1u32.to_le_bytes());
        for (bucket, t) in &data {
            for (k, v) in t {
                out.push(bucket.name().len() as u8);
                out.extend_from_slice(bucket.name().as_bytes());
                out.extend_from_slice(&(k.len() as u32).to_le_bytes());
                out.extend_from_slice(k);
                out.extend_from_slice(&(v.len() as u32).to_le_bytes());
                out.extend_from_slice(v);
            }
        }
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        let tmp = self.dir.join("data.tmp");
        let mut f = File::create(&tmp).map_err(io(&tmp, "create"))?;
        f.write_all(&out).map_err(io(&tmp, "write"))?;
        f.sync_all().map_err(io(&tmp, "fsync"))?;
        let dst = self.dir.join("data");
        std::fs::rename(&tmp, &dst).map_err(io(&dst, "rename"))?;
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(io(&self.dir, "fsync dir"))?;
        *self.data.lock() = Arc::new(data);
        Ok(())
    }

    fn size(&self) -> Result<BackendSize, BackendError> {
        let len = std::fs::metadata(self.dir.join("data")).map_or(0, |m| m.len());
        Ok(BackendSize {
            on_disk: len,
            in_use: len,
        })
    }

    fn defragment(&self) -> Result<(), BackendError> {
        Ok(())
    }
}

#[test]
fn mvcc_survives_sigkill() {
    let dir = tempfile::tempdir().expect("tempdir");
    keel_mvcc::testing::crash::run::<FileBackend>(
        "crash::mvcc_survives_sigkill",
        dir.path(),
        (),
        keel_mvcc::testing::crash::rounds(),
    );
}
