//! Helpers shared by the test modules: options for small segments, deterministic entries,
//! and a fault-injecting file system.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use keel_wal::{Entry, FileSystem, RealFs, WalFile, WalOptions};
use parking_lot::Mutex;

/// Options with 64 KiB segments so tests rotate often.
pub fn small() -> WalOptions {
    WalOptions {
        segment_size: 64 << 10,
        ..WalOptions::default()
    }
}

/// Deterministic data for entry (index, term), of a length that varies with the index.
pub fn data(index: u64, term: u64, max: usize) -> Vec<u8> {
    let len = (index.wrapping_mul(2654435761) as usize % max.max(1)) + 1;
    let mut x = index.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ term.rotate_left(17) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x as u8) | 1
        })
        .collect()
}

pub fn entry(index: u64, term: u64) -> Entry {
    Entry {
        index,
        term,
        data: data(index, term, 300),
    }
}

pub fn entries(lo: u64, hi: u64, term: u64) -> Vec<Entry> {
    (lo..hi).map(|i| entry(i, term)).collect()
}

/// Names of the files in `dir`, sorted.
pub fn files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

/// Segment files (`*.wal`) in `dir`, sorted.
pub fn segments(dir: &Path) -> Vec<PathBuf> {
    files(dir)
        .into_iter()
        .filter(|n| n.ends_with(".wal"))
        .map(|n| dir.join(n))
        .collect()
}

/// Switches for [`FaultFs`].
#[derive(Debug, Default)]
pub struct Faults {
    /// `fdatasync`/`fsync` of segment files fail with EIO.
    pub fail_sync: AtomicBool,
    /// Creating or writing a `.tmp` (a new segment) fails with ENOSPC.
    pub enospc_new_segment: AtomicBool,
    /// Writes to `.wal` files fail with ENOSPC.
    pub enospc_write: AtomicBool,
    /// Writes take at most 7 bytes at a time.
    pub short_writes: AtomicBool,
    /// Number of `read_at` calls per file name.
    pub reads: Mutex<Vec<String>>,
    /// Number of syncs done.
    pub syncs: AtomicU64,
    /// Every `fdatasync` takes at least this many microseconds (a slow disk).
    pub sync_delay_us: AtomicU64,
    /// Hand out direct-write handles (as the real file system does where it can).
    pub direct: AtomicBool,
    /// While set, `sync_dir` waits until it is cleared.
    pub hold_dir_sync: AtomicBool,
    /// `sync_dir` fails with EIO.
    pub fail_dir_sync: AtomicBool,
    /// Calls of `sync_dir` that waited on [`Faults::hold_dir_sync`] so far.
    pub dir_syncs_held: AtomicU64,
    /// Deleting a `.wal` file, or renaming one to a `.free` name, fails with EIO.
    pub fail_release: AtomicBool,
    /// Every directory synced, in order.
    pub dirs_synced: Mutex<Vec<PathBuf>>,
    /// Every page-cache hint given: (file name, "will_need" or "dont_need").
    pub hints: Mutex<Vec<(String, &'static str)>>,
    /// `(file name, offset)`: reads of that file at or past the offset fail with EIO.
    pub fail_read: Mutex<Option<(String, u64)>>,
    /// Every read of this file first sleeps 300 ms.
    pub slow_read: Mutex<Option<String>>,
    /// Opening this file panics.
    pub panic_open: Mutex<Option<String>>,
    /// Bytes that writes to `.broken` files may still take, as on a nearly full disk (`None`:
    /// no limit): a write past it fails with ENOSPC.
    pub broken_space: Mutex<Option<u64>>,
    /// While set, every operation that changes files or makes them durable is logged to
    /// [`Faults::ops`].
    pub record_ops: AtomicBool,
    /// `"<op> <file name>..."` for every operation logged, in order: `create`, `write`,
    /// `set_len`, `sync` (of a file's data or all of it), `rename <from> <to>`, `remove`, and
    /// `sync_dir <dir path>`.
    pub ops: Mutex<Vec<String>>,
    /// Every file opened, to follow renames.
    files: Mutex<Vec<Weak<FaultFile>>>,
}

/// The real file system with switchable faults.
#[derive(Debug, Clone)]
pub struct FaultFs(pub Arc<Faults>);

#[derive(Debug)]
struct FaultFile {
    inner: Arc<dyn WalFile>,
    name: Mutex<String>,
    faults: Arc<Faults>,
}

fn name_of(path: &Path) -> String {
    path.file_name().unwrap().to_string_lossy().into_owned()
}

impl Faults {
    fn log(&self, op: impl FnOnce() -> String) {
        if self.record_ops.load(Ordering::SeqCst) {
            self.ops.lock().push(op());
        }
    }
}

fn enospc() -> io::Error {
    io::Error::from_raw_os_error(28)
}

impl WalFile for FaultFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let name = self.name.lock().clone();
        if let Some((failing, from)) = &*self.faults.fail_read.lock()
            && *failing == name
            && offset >= *from
        {
            return Err(io::Error::from_raw_os_error(5));
        }
        if self.faults.slow_read.lock().as_ref() == Some(&name) {
            std::thread::sleep(std::time::Duration::from_millis(300));
        }
        self.faults.reads.lock().push(name);
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
        let f = &self.faults;
        let name = self.name.lock().clone();
        f.log(|| format!("write {name}"));
        if name.ends_with(".tmp") && f.enospc_new_segment.load(Ordering::SeqCst) {
            return Err(enospc());
        }
        if name.ends_with(".wal") && f.enospc_write.load(Ordering::SeqCst) {
            return Err(enospc());
        }
        if name.contains(".broken")
            && let Some(left) = &mut *f.broken_space.lock()
        {
            *left = left.checked_sub(buf.len() as u64).ok_or_else(enospc)?;
        }
        if f.short_writes.load(Ordering::SeqCst) {
            let n = buf.len().min(7);
            return self.inner.write_at(&buf[..n], offset);
        }
        self.inner.write_at(buf, offset)
    }
    fn sync_data(&self) -> io::Result<()> {
        if self.faults.fail_sync.load(Ordering::SeqCst) {
            return Err(io::Error::from_raw_os_error(5));
        }
        self.faults.log(|| format!("sync {}", self.name.lock()));
        self.faults.syncs.fetch_add(1, Ordering::SeqCst);
        let delay = self.faults.sync_delay_us.load(Ordering::SeqCst);
        if delay > 0 {
            std::thread::sleep(std::time::Duration::from_micros(delay));
        }
        self.inner.sync_data()
    }
    fn sync_all(&self) -> io::Result<()> {
        if self.faults.fail_sync.load(Ordering::SeqCst) {
            return Err(io::Error::from_raw_os_error(5));
        }
        self.faults.log(|| format!("sync {}", self.name.lock()));
        self.faults.syncs.fetch_add(1, Ordering::SeqCst);
        self.inner.sync_all()
    }
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.faults.log(|| format!("set_len {}", self.name.lock()));
        self.inner.set_len(len)
    }
    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        if self.name.lock().ends_with(".tmp")
            && self.faults.enospc_new_segment.load(Ordering::SeqCst)
        {
            return Err(enospc());
        }
        self.inner.allocate(offset, len)
    }
    fn will_need(&self, offset: u64, len: u64) -> io::Result<()> {
        let name = self.name.lock().clone();
        self.faults.hints.lock().push((name, "will_need"));
        self.inner.will_need(offset, len)
    }
    fn dont_need(&self, offset: u64, len: u64) -> io::Result<()> {
        let name = self.name.lock().clone();
        self.faults.hints.lock().push((name, "dont_need"));
        self.inner.dont_need(offset, len)
    }
}

impl FaultFs {
    pub fn new() -> (FaultFs, Arc<Faults>) {
        let f = Arc::new(Faults::default());
        (FaultFs(f.clone()), f)
    }
    fn wrap(&self, path: &Path, inner: Arc<dyn WalFile>) -> Arc<dyn WalFile> {
        let f = Arc::new(FaultFile {
            inner,
            name: Mutex::new(name_of(path)),
            faults: self.0.clone(),
        });
        self.0.files.lock().push(Arc::downgrade(&f));
        f
    }
}

impl FileSystem for FaultFs {
    fn create(&self, path: &Path) -> io::Result<Arc<dyn WalFile>> {
        if self.0.enospc_new_segment.load(Ordering::SeqCst) {
            return Err(enospc());
        }
        self.0.log(|| format!("create {}", name_of(path)));
        let f = RealFs.create(path)?;
        Ok(self.wrap(path, f))
    }
    fn open(&self, path: &Path, writable: bool) -> io::Result<Arc<dyn WalFile>> {
        if self.0.panic_open.lock().as_deref() == Some(name_of(path).as_str()) {
            panic!("injected panic opening {}", path.display());
        }
        let f = RealFs.open(path, writable)?;
        Ok(self.wrap(path, f))
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        if self.0.fail_release.load(Ordering::SeqCst)
            && name_of(from).ends_with(".wal")
            && name_of(to).ends_with(".free")
        {
            return Err(io::Error::from_raw_os_error(5));
        }
        RealFs.rename(from, to)?;
        let (old, new) = (name_of(from), name_of(to));
        self.0.log(|| format!("rename {old} {new}"));
        for f in self.0.files.lock().iter().filter_map(Weak::upgrade) {
            let mut n = f.name.lock();
            if *n == old {
                *n = new.clone();
            }
        }
        Ok(())
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        if self.0.fail_release.load(Ordering::SeqCst) && name_of(path).ends_with(".wal") {
            return Err(io::Error::from_raw_os_error(5));
        }
        self.0.log(|| format!("remove {}", name_of(path)));
        RealFs.remove(path)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        if self.0.hold_dir_sync.load(Ordering::SeqCst) {
            self.0.dir_syncs_held.fetch_add(1, Ordering::SeqCst);
            while self.0.hold_dir_sync.load(Ordering::SeqCst) {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        if self.0.fail_dir_sync.load(Ordering::SeqCst) {
            return Err(io::Error::from_raw_os_error(5));
        }
        self.0.dirs_synced.lock().push(dir.to_path_buf());
        self.0.log(|| format!("sync_dir {}", dir.display()));
        RealFs.sync_dir(dir)
    }
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        RealFs.create_dir_all(dir)
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        RealFs.list(dir)
    }
    fn open_direct(&self, path: &Path) -> Option<Arc<dyn WalFile>> {
        if !self.0.direct.load(Ordering::SeqCst) {
            return None;
        }
        let f = RealFs.open_direct(path)?;
        Some(self.wrap(path, f))
    }
}

/// A record as the segment file holds it.
#[derive(Clone, Debug)]
pub struct Rec {
    /// Offset of its header.
    pub offset: usize,
    /// Its type.
    pub ty: u8,
    /// Its payload length.
    pub len: usize,
}

/// The records of a segment file, from after its header to its end marker.
pub fn records(bytes: &[u8]) -> Vec<Rec> {
    let mut out = Vec::new();
    let mut at = 32;
    while at + 8 <= bytes.len() {
        let word = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap());
        if word == 0 {
            break;
        }
        let len = (word & 0x00ff_ffff) as usize;
        out.push(Rec {
            offset: at,
            ty: (word >> 24) as u8,
            len,
        });
        at += 8 + len.div_ceil(8) * 8;
    }
    out
}
