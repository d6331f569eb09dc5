//! Pins down the durable appends written with direct writes (`O_DIRECT`, past the page
//! cache): records of every size and alignment, after buffered ones, across rotations and
//! conflict truncation, read back the same before and after reopening, with and without
//! direct writes; and a file system that cannot take them leaves the log on the page cache.

use std::path::Path;
use std::sync::Arc;

use keel_wal::{Entry, FileSystem, HardState, RealFs, Wal, WalOptions};
use rand::{Rng, SeedableRng};

use crate::util::data;

/// Whether direct writes work where the tests' temporary files are (not on tmpfs, say).
fn direct_supported(dir: &Path) -> bool {
    let probe = dir.join("probe");
    std::fs::write(&probe, [0u8; 4096]).unwrap();
    let ok = RealFs.open_direct(&probe).is_some();
    std::fs::remove_file(probe).unwrap();
    ok
}

fn opts(direct: bool) -> WalOptions {
    WalOptions {
        segment_size: 256 << 10,
        direct_writes: direct,
        ..WalOptions::default()
    }
}

fn entry(index: u64, term: u64, len: usize) -> Entry {
    let mut d = data(index, term, 64);
    d.resize(len, (index as u8) ^ (term as u8) | 1);
    Entry {
        index,
        term,
        data: d,
    }
}

#[test]
fn direct_writes_read_back_like_buffered_ones() {
    let seed: u64 = rand::random();
    eprintln!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let supported = direct_supported(dir.path());
    let path = dir.path().join("wal");
    let wal = Wal::open(&path, opts(true)).unwrap();
    let mut model: Vec<Entry> = Vec::new();
    let mut term = 1;
    for step in 0..400 {
        let n = rng.random_range(0..20usize);
        let mut lo = model.len() as u64 + 1;
        if step % 37 == 36 && lo > 5 {
            // A conflict: the suffix from a few entries back is replaced in a new term.
            lo -= rng.random_range(1..5u64);
            term += 1;
            model.truncate(lo as usize - 1);
        }
        let batch: Vec<Entry> = (0..n as u64)
            .map(|k| {
                let len = match rng.random_range(0..4) {
                    0 => rng.random_range(0..64),
                    1 => rng.random_range(64..1100),
                    2 => 4096 - 24 + rng.random_range(0..16),
                    _ => rng.random_range(1100..9000),
                };
                entry(lo + k, term, len)
            })
            .collect();
        let hs = (step % 5 == 0).then_some(HardState {
            term,
            vote: 1,
            commit: lo.saturating_sub(1),
        });
        let sync = rng.random_bool(0.6);
        if batch.is_empty() && hs.is_none() {
            continue;
        }
        wal.append(&batch, hs.as_ref(), sync).unwrap();
        model.extend(batch);
        let last = model.len() as u64;
        if last > 0 && step % 10 == 0 {
            assert_eq!(
                wal.entries(1, last + 1, None).unwrap(),
                model,
                "step {step}"
            );
        }
    }
    wal.sync().unwrap();
    let stats = wal.stats();
    assert!(stats.rotations > 0, "{stats:?}");
    if supported {
        assert!(stats.direct_flushes > 0, "{stats:?}");
    } else {
        assert_eq!(stats.direct_flushes, 0, "{stats:?}");
    }
    let last = model.len() as u64;
    drop(wal);
    for direct in [true, false] {
        let wal = Wal::open(&path, opts(direct)).unwrap();
        assert_eq!(wal.last_index(), last);
        assert_eq!(wal.entries(1, last + 1, None).unwrap(), model);
        // Appending after a reopen starts from the torn page's first bytes read back.
        let more = [entry(last + 1, term, 777), entry(last + 2, term, 5000)];
        wal.append(&more, None, true).unwrap();
        drop(wal);
        let wal = Wal::open(&path, opts(!direct)).unwrap();
        let mut all = model.clone();
        all.extend(more.iter().cloned());
        assert_eq!(wal.entries(1, last + 3, None).unwrap(), all);
        drop(wal);
        // Take the two back out for the next round.
        let wal = Wal::open(&path, opts(direct)).unwrap();
        wal.append(&[entry(last, term, 0)], None, true).unwrap();
        model[last as usize - 1] = entry(last, term, 0);
        assert_eq!(wal.entries(1, last + 1, None).unwrap(), model);
    }
}

/// A file system without direct writes: the log writes through the page cache.
#[derive(Debug)]
struct NoDirect;

impl FileSystem for NoDirect {
    fn create(&self, path: &Path) -> std::io::Result<Arc<dyn keel_wal::WalFile>> {
        RealFs.create(path)
    }
    fn open(&self, path: &Path, writable: bool) -> std::io::Result<Arc<dyn keel_wal::WalFile>> {
        RealFs.open(path, writable)
    }
    fn rename(&self, from: &Path, to: &Path) -> std::io::Result<()> {
        RealFs.rename(from, to)
    }
    fn remove(&self, path: &Path) -> std::io::Result<()> {
        RealFs.remove(path)
    }
    fn sync_dir(&self, dir: &Path) -> std::io::Result<()> {
        RealFs.sync_dir(dir)
    }
    fn create_dir_all(&self, dir: &Path) -> std::io::Result<()> {
        RealFs.create_dir_all(dir)
    }
    fn list(&self, dir: &Path) -> std::io::Result<Vec<String>> {
        RealFs.list(dir)
    }
}

#[test]
fn a_file_system_without_direct_writes_keeps_the_page_cache() {
    let dir = tempfile::tempdir().unwrap();
    let o = WalOptions {
        fs: Arc::new(NoDirect),
        ..opts(true)
    };
    let wal = Wal::open(dir.path(), o.clone()).unwrap();
    let es: Vec<Entry> = (1..=100).map(|i| entry(i, 1, 1000)).collect();
    for e in &es {
        wal.append(std::slice::from_ref(e), None, true).unwrap();
    }
    assert_eq!(wal.stats().direct_flushes, 0);
    drop(wal);
    let wal = Wal::open(dir.path(), o).unwrap();
    assert_eq!(wal.entries(1, 101, None).unwrap(), es);
}

#[test]
fn direct_appends_copy_even_large_entries_and_never_read_the_segment_back() {
    let dir = tempfile::tempdir().unwrap();
    if !direct_supported(dir.path()) {
        eprintln!("direct writes unsupported here: skipped");
        return;
    }
    let (fs, faults) = crate::util::FaultFs::new();
    faults
        .direct
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let o = WalOptions {
        fs: Arc::new(fs),
        ..opts(true)
    };
    let wal = Wal::open(&dir.path().join("wal"), o.clone()).unwrap();
    // Batches of 16 entries of 1000 or 4096 bytes: a 256 KiB segment takes 4 to 15 of
    // them, so 40 rotate at least 4 times.
    let mut es = Vec::new();
    for b in 0..40u64 {
        let len = if b % 2 == 0 { 1000 } else { 4096 };
        let batch: Vec<Entry> = (0..16).map(|k| entry(b * 16 + k + 1, 1, len)).collect();
        wal.append(&batch, None, true).unwrap();
        es.extend(batch);
    }
    let stats = wal.stats();
    assert!(stats.rotations >= 4, "{stats:?}");
    // Large entries too are copied into the write buffer and written direct, not written
    // through the page cache from their own buffers.
    assert_eq!(stats.direct_writes, 0, "{stats:?}");
    assert_eq!(stats.direct_flushes, stats.syncs, "{stats:?}");
    // Every page a direct write rewrites starts with bytes the log wrote itself, the first
    // page of a segment with its header: none is read back from the disk.
    assert_eq!(*faults.reads.lock(), Vec::<String>::new());
    drop(wal);
    let wal = Wal::open(&dir.path().join("wal"), o).unwrap();
    assert_eq!(wal.entries(1, es.len() as u64 + 1, None).unwrap(), es);
}
