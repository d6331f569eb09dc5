//! keel's main job until the replicated node exists: a Raft-shaped WAL workload.
//!
//! Several proposer threads append batches of entries (a few hundred bytes to a few KiB)
//! with a hard state, durably, sharing fdatasyncs through group commit. The log is then
//! reopened and every entry and the hard state verified. Throughput is printed beside a raw
//! `pwrite` + `fdatasync` loop writing the same batches to a preallocated file, measured in
//! the same run, as ratios.
//!
//! `cargo run --release -p keel-wal --example demo [-- <dir>]` (default: a temporary
//! directory). `KEEL_DEMO_ENTRIES` sets the number of entries (default 40000).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_wal::{Entry, HardState, Wal, WalOptions};
use parking_lot::Mutex;

const THREADS: usize = 4;

/// Deterministic entry data: 200 B to 4 KiB, derived from the index.
fn data(index: u64) -> Vec<u8> {
    let mut x = index.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let len = 200 + (x % 3900) as usize;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Batch size for the batch starting at `index`: 1 to 8 entries.
fn batch_len(index: u64) -> u64 {
    1 + (index.wrapping_mul(2654435761) >> 7) % 8
}

/// The workload: `(first index, entry count)` per batch, `total` entries in all.
fn batches(total: u64) -> Vec<(u64, u64)> {
    let mut v = Vec::new();
    let mut i = 1;
    while i <= total {
        let n = batch_len(i).min(total - i + 1);
        v.push((i, n));
        i += n;
    }
    v
}

struct Run {
    elapsed: Duration,
    bytes: u64,
    entries: u64,
    appends: u64,
}

impl Run {
    fn print(&self, what: &str) {
        let s = self.elapsed.as_secs_f64();
        println!(
            "  {what:<52} {:>9.0} entries/s {:>8.1} MB/s {:>8.0} durable appends/s",
            self.entries as f64 / s,
            self.bytes as f64 / s / 1e6,
            self.appends as f64 / s
        );
    }
}

/// Appends `work` to `wal` from `threads` threads; each append carries a hard state and
/// returns only once durable. Returns the time taken.
fn keel_run(wal: &Arc<Wal>, work: &[(u64, u64)], threads: usize) -> Duration {
    let cursor = Arc::new(Mutex::new(0usize));
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            let (wal, cursor) = (wal.clone(), cursor.clone());
            s.spawn(move || {
                loop {
                    {
                        // Raft indices are consecutive: take the next batch and buffer it
                        // under one lock; the durable wait below is shared (group commit).
                        let mut c = cursor.lock();
                        let Some(&(first, n)) = work.get(*c) else {
                            break;
                        };
                        *c += 1;
                        let es: Vec<Entry> = (first..first + n)
                            .map(|i| Entry {
                                index: i,
                                term: 1,
                                data: data(i),
                            })
                            .collect();
                        let hs = HardState {
                            term: 1,
                            vote: 1,
                            commit: first + n - 1,
                        };
                        wal.append(&es, Some(&hs), false).expect("append");
                    }
                    wal.sync().expect("sync");
                }
            });
        }
    });
    start.elapsed()
}

/// The raw reference: the same batches, one `pwrite` + `fdatasync` each, to a preallocated
/// (zero-written) file.
struct Raw {
    file: File,
    bufs: Vec<Vec<u8>>,
    offsets: Vec<u64>,
}

impl Raw {
    fn new(dir: &std::path::Path, work: &[(u64, u64)]) -> Raw {
        let bufs: Vec<Vec<u8>> = work
            .iter()
            .map(|&(first, n)| (first..first + n).flat_map(data).collect())
            .collect();
        let mut offsets = Vec::with_capacity(bufs.len());
        let mut total = 0;
        for b in &bufs {
            offsets.push(total);
            total += b.len() as u64;
        }
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.join("raw-reference"))
            .expect("create raw file");
        let zeros = vec![0u8; 1 << 20];
        let mut off = 0;
        while off < total {
            file.write_all_at(&zeros, off).expect("preallocate");
            off += zeros.len() as u64;
        }
        file.sync_all().expect("sync");
        Raw {
            file,
            bufs,
            offsets,
        }
    }

    /// Writes batches `range` durably; returns the time taken.
    fn run(&self, range: std::ops::Range<usize>) -> Duration {
        let start = Instant::now();
        for i in range {
            self.file
                .write_all_at(&self.bufs[i], self.offsets[i])
                .expect("write");
            self.file.sync_data().expect("fdatasync");
        }
        start.elapsed()
    }
}

fn verify(dir: &std::path::Path, total: u64) -> Result<Duration, String> {
    let start = Instant::now();
    let wal = Wal::open(dir, WalOptions::default()).map_err(|e| e.to_string())?;
    if wal.last_index() != total {
        return Err(format!(
            "last index {} after reopen, expected {total}",
            wal.last_index()
        ));
    }
    let mut checked = 0;
    let mut err = None;
    wal.replay(1, |e| {
        if e.data != data(e.index).as_slice() || e.term != 1 {
            err = Some(format!("entry {} differs after reopen", e.index));
            return std::ops::ControlFlow::Break(());
        }
        checked += 1;
        std::ops::ControlFlow::Continue(())
    })
    .map_err(|e| e.to_string())?;
    if let Some(e) = err {
        return Err(e);
    }
    if checked != total {
        return Err(format!("{checked} entries read back, expected {total}"));
    }
    let hs = wal.hard_state().ok_or("no hard state after reopen")?;
    if hs.commit != total {
        return Err(format!(
            "hard state commit {} after reopen, expected {total}",
            hs.commit
        ));
    }
    Ok(start.elapsed())
}

fn main() {
    let total: u64 = std::env::var("KEEL_DEMO_ENTRIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40_000);
    let tmp = tempfile::tempdir().expect("temporary directory");
    let root: PathBuf = std::env::args()
        .nth(1)
        .map_or_else(|| tmp.path().to_path_buf(), PathBuf::from);
    let work = batches(total);
    println!(
        "keel WAL demo: {total} Raft entries (200 B - 4 KiB) in {} batches of 1-8 with a hard state each, every append durable",
        work.len()
    );

    let raw = Raw::new(&root, &work);
    let mut wals = Vec::new();
    for (threads, name) in [(1usize, "keel-1"), (THREADS, "keel-n")] {
        let dir = root.join(name);
        let _ = std::fs::remove_dir_all(&dir);
        let wal = Arc::new(Wal::open(&dir, WalOptions::default()).expect("open WAL"));
        wals.push((threads, dir, wal, Duration::ZERO));
    }
    // The disk is shared and its latency drifts: run the workload in slices, each slice on
    // the raw file and on both logs back to back, rotating the order.
    const SLICES: usize = 12;
    let mut raw_time = Duration::ZERO;
    for k in 0..SLICES {
        let range = work.len() * k / SLICES..work.len() * (k + 1) / SLICES;
        for step in 0..3 {
            match (k + step) % 3 {
                0 => raw_time += raw.run(range.clone()),
                j => {
                    let (threads, _, wal, t) = &mut wals[j - 1];
                    *t += keel_run(wal, &work[range.clone()], *threads);
                }
            }
        }
    }
    drop(raw);
    let _ = std::fs::remove_file(root.join("raw-reference"));
    let entries: u64 = work.iter().map(|w| w.1).sum();
    let bytes: u64 = (1..=entries).map(|i| data(i).len() as u64).sum();
    let run = |elapsed| Run {
        elapsed,
        bytes,
        entries,
        appends: work.len() as u64,
    };
    let mut results = Vec::new();
    for (threads, dir, wal, t) in wals {
        drop(wal);
        let took = match verify(&dir, total) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("VERIFY FAILED ({}): {e}", dir.display());
                std::process::exit(1);
            }
        };
        results.push((threads, run(t), took));
    }
    let raw = run(raw_time);

    println!("results (same run, same disk):");
    raw.print("raw pwrite+fdatasync per batch, 1 thread");
    for (threads, run, took) in &results {
        run.print(&format!("keel WAL, {threads} thread(s), group commit"));
        println!(
            "    reopened and verified all {total} entries + hard state in {:.0} ms; {:.2}x the raw loop",
            took.as_secs_f64() * 1e3,
            raw.elapsed.as_secs_f64() / run.elapsed.as_secs_f64()
        );
    }
}
