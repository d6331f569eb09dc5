//! Group commit under a controlled disk: 8 threads appending single 1 KiB entries durably
//! against one thread, as the `wal` bench does, on a file system whose `fdatasync` is a
//! fixed sleep (`KEEL_PROFILE_SYNC_US`, default 130 µs) instead of the real one, so what the
//! log does between syncs shows without the noise of a shared disk. `KEEL_PROFILE_SYNC_US=0`
//! uses the real `fdatasync`.
//!
//! Run: `cargo run --release -p keel-wal --example group_profile` (`KEEL_PROFILE_ROUNDS`,
//! default 4000 appends per side).

use std::io::{self, IoSlice};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_wal::{Entry, FileSystem, RealFs, Wal, WalFile, WalOptions};
use parking_lot::Mutex;

/// The real file system, with `fdatasync` replaced by a sleep.
#[derive(Debug)]
struct SleepFs(Duration);

#[derive(Debug)]
struct SleepFile(Arc<dyn WalFile>, Duration);

impl WalFile for SleepFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        self.0.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
        self.0.write_at(buf, offset)
    }
    fn write_vectored_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> io::Result<usize> {
        self.0.write_vectored_at(bufs, offset)
    }
    fn sync_data(&self) -> io::Result<()> {
        std::thread::sleep(self.1);
        Ok(())
    }
    fn sync_all(&self) -> io::Result<()> {
        self.0.sync_all()
    }
    fn len(&self) -> io::Result<u64> {
        self.0.len()
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }
    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        self.0.allocate(offset, len)
    }
}

impl FileSystem for SleepFs {
    fn create(&self, path: &Path) -> io::Result<Arc<dyn WalFile>> {
        Ok(Arc::new(SleepFile(RealFs.create(path)?, self.0)))
    }
    fn open(&self, path: &Path, writable: bool) -> io::Result<Arc<dyn WalFile>> {
        Ok(Arc::new(SleepFile(RealFs.open(path, writable)?, self.0)))
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        RealFs.rename(from, to)
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        RealFs.remove(path)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        RealFs.sync_dir(dir)
    }
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        RealFs.create_dir_all(dir)
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        RealFs.list(dir)
    }
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let sync_us = env("KEEL_PROFILE_SYNC_US", 130);
    let rounds = env("KEEL_PROFILE_ROUNDS", 4000);
    let dir = tempfile::tempdir().expect("temp dir");
    let mut opts = WalOptions::default();
    if sync_us > 0 {
        opts.fs = Arc::new(SleepFs(Duration::from_micros(sync_us)));
    }
    let wal = Wal::open(dir.path(), opts).expect("open");
    let next = Mutex::new(1u64);
    let data: Vec<u8> = (0..1024).map(|b| b as u8).collect();
    let append = || {
        let mut e = Entry {
            index: 0,
            term: 1,
            data: data.clone(),
        };
        {
            let mut n = next.lock();
            e.index = *n;
            wal.append(std::slice::from_ref(&e), None, false)
                .expect("append");
            *n += 1;
        }
        wal.sync().expect("sync");
    };
    let s0 = wal.stats();
    let t = Instant::now();
    for _ in 0..rounds {
        append();
    }
    let one = t.elapsed();
    let s1 = wal.stats();
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| {
                for _ in 0..rounds / 8 {
                    append();
                }
            });
        }
    });
    let eight = t.elapsed();
    let s2 = wal.stats();
    let per = |d: Duration| d.as_secs_f64() * 1e6 / rounds as f64;
    let syncs = s2.syncs - s1.syncs;
    let avg_sync = |a: &keel_wal::WalStats, b: &keel_wal::WalStats| {
        (b.sync_time - a.sync_time).as_secs_f64() * 1e6 / (b.syncs - a.syncs).max(1) as f64
    };
    println!(
        "sync {sync_us} us: 1 thread {:.1} us/append ({} syncs of {:.1} us), 8 threads {:.1} us/append ({} syncs of {:.1} us, {:.2} per sync, {} gathers {:.1} us avg) -> {:.2}x",
        per(one),
        s1.syncs - s0.syncs,
        avg_sync(&s0, &s1),
        per(eight),
        syncs,
        avg_sync(&s1, &s2),
        (s2.durable_requests - s1.durable_requests) as f64 / syncs.max(1) as f64,
        s2.gathers - s1.gathers,
        (s2.gather_time - s1.gather_time).as_secs_f64() * 1e6
            / (s2.gathers - s1.gathers).max(1) as f64,
        one.as_secs_f64() / eight.as_secs_f64()
    );
}
