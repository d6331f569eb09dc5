//! keel-wal against the raw disk and against raft-engine, each in the same run.
//!
//! - `append`: 1 KiB entries, batches of 1, 16 and 256 per durable append, against a raw
//!   `pwrite` + `fdatasync` loop writing the same bytes in the same batches to a
//!   preallocated (zero-written) file. Goal: >= 0.9x the raw loop. Both sides run in steady
//!   state: the raw loop goes round its 64 MiB file, and the log, like a Raft log whose old
//!   entries are covered by snapshots, releases the segments before its last two as it
//!   goes (released files are recycled as new segments); before timing it has been through
//!   three segments, as the raw file has been written once. A second batch-256 line (no
//!   goal) shows a log that only grows, so every segment is a new file.
//! - `group_commit`: 8 threads appending single entries durably against one thread doing
//!   the same. Goal: >= 4x.
//! - `peer` (feature `peers`): batches of 16 1 KiB entries with sync on raft-engine.
//!   Goal: >= 1.0x.
//! - `replay`: opening (reading and checking every record of) a log of
//!   `KEEL_WAL_REPLAY_MIB` MiB (default 1024) against a raw sequential read + crc32 of the
//!   same bytes. Goal: >= 0.8x. Also prints the peak resident-memory growth of streaming the log from
//!   its middle.
//!
//! Run: `cargo bench -p keel-benches --bench wal` (add `--features peers` for raft-engine).
//! `KEEL_WAL_BENCH` picks parts (comma-separated, default all): `append1`, `append16`,
//! `append256`, `growing` (the growing-log batch-256 line), `group`, `peer`, `replay`; e.g.
//! `KEEL_WAL_BENCH=append256,group cargo bench -p keel-benches --bench wal`.

use std::fs::File;
use std::ops::ControlFlow;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput};
use keel_benches::{Better, Recorder};
use keel_wal::{Entry, Wal, WalOptions};
use parking_lot::Mutex;

/// Resident memory of this process in bytes: `VmRSS` (now) or `VmHWM` (peak since the last
/// [`reset_peak_rss`]), from `/proc/self/status`.
fn rss(field: &str) -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kib: usize = line[field.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib << 10)
}

/// Starts a new peak-RSS window (Linux: writing 5 to `/proc/self/clear_refs` resets `VmHWM`).
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Runs `f` and returns how far the process's resident memory peaked above where it started.
fn peak_rss_growth<T>(f: impl FnOnce() -> T) -> (T, Option<usize>) {
    let base = rss("VmRSS:");
    let reset = reset_peak_rss();
    let out = f();
    let peak = rss("VmHWM:");
    let growth = match (reset, base, peak) {
        (true, Some(base), Some(peak)) => Some(peak.saturating_sub(base)),
        _ => None,
    };
    (out, growth)
}

const ENTRY: usize = 1024;

/// Whether the part `name` is selected by `KEEL_WAL_BENCH` (all are when it is unset).
fn selected(name: &str) -> bool {
    match std::env::var("KEEL_WAL_BENCH") {
        Ok(v) if !v.trim().is_empty() => v.split(',').any(|p| p.trim() == name),
        _ => true,
    }
}
const RAW_FILE: u64 = 64 << 20;

fn quick<'a>(
    c: &'a mut Criterion,
    name: &str,
) -> criterion::BenchmarkGroup<'a, criterion::measurement::WallTime> {
    let mut g = c.benchmark_group(name);
    g.sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    g
}

fn template(n: usize) -> Vec<Entry> {
    (0..n)
        .map(|k| Entry {
            index: 0,
            term: 1,
            data: (0..ENTRY).map(|b| (b * 31 + k * 7) as u8).collect(),
        })
        .collect()
}

/// A file of `RAW_FILE` bytes written with zeros and synced: the raw disk at its best.
fn raw_file(dir: &Path) -> File {
    let path = dir.join("raw");
    let f = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .unwrap();
    let zeros = vec![0u8; 1 << 20];
    for i in 0..RAW_FILE / (1 << 20) {
        f.write_all_at(&zeros, i << 20).unwrap();
    }
    f.sync_all().unwrap();
    f
}

/// A durable append of `es` (indices from `next`), `next` moved past them.
fn keel_append(wal: &Wal, es: &mut [Entry], next: &mut u64) {
    for (k, e) in es.iter_mut().enumerate() {
        e.index = *next + k as u64;
    }
    wal.append(es, None, true).unwrap();
    *next += es.len() as u64;
}

/// Entries of [`ENTRY`] bytes one segment holds (roughly).
fn per_segment() -> u64 {
    WalOptions::default().segment_size / (ENTRY as u64 + 24)
}

/// [`keel_append`], then what a Raft node does once snapshots cover its older entries:
/// releases the segments before the last two.
fn keel_append_steady(wal: &Wal, es: &mut [Entry], next: &mut u64) {
    keel_append(wal, es, next);
    if wal.segment_count() > 2 {
        wal.release_to(next.saturating_sub(per_segment())).unwrap();
    }
}

/// Opens a log in `dir` and runs it through `segments` segments (written unsynced, released
/// as [`keel_append_steady`] does), the way the raw file is written once before timing.
/// Returns the log and its next index.
fn steady_wal(dir: &Path, segments: u64) -> (Wal, u64) {
    let wal = Wal::open(dir, WalOptions::default()).unwrap();
    let mut es = template(256);
    let mut next = 1u64;
    while next <= segments * per_segment() {
        for (k, e) in es.iter_mut().enumerate() {
            e.index = next + k as u64;
        }
        wal.append(&es, None, false).unwrap();
        next += es.len() as u64;
        if wal.segment_count() > 2 {
            wal.release_to(next.saturating_sub(per_segment())).unwrap();
        }
    }
    wal.sync().unwrap();
    (wal, next)
}

/// Times `a` and `b` once per iteration, alternating which goes first, records both, and
/// returns the total of `a`: on a shared machine only interleaved samples compare fairly.
fn paired(
    b: &mut criterion::Bencher<'_>,
    rec: &Recorder,
    names: (&str, &str),
    mut fa: impl FnMut(),
    mut fb: impl FnMut(),
) {
    let mut flip = false;
    b.iter_custom(|iters| {
        let (mut ta, mut tb) = (Duration::ZERO, Duration::ZERO);
        for _ in 0..iters {
            flip = !flip;
            if flip {
                let t = Instant::now();
                fa();
                ta += t.elapsed();
                let t = Instant::now();
                fb();
                tb += t.elapsed();
            } else {
                let t = Instant::now();
                fb();
                tb += t.elapsed();
                let t = Instant::now();
                fa();
                ta += t.elapsed();
            }
        }
        rec.record(names.0, ta, iters);
        rec.record(names.1, tb, iters);
        ta
    });
}

fn append(c: &mut Criterion, rec: &Recorder) {
    let smoke = std::env::args().any(|a| a == "--test");
    let mut g = quick(c, "wal_append");
    for (batch, steady) in [(1usize, true), (16, true), (256, true), (256, false)] {
        let part = if steady {
            format!("append{batch}")
        } else {
            "growing".to_string()
        };
        if !selected(&part) {
            continue;
        }
        g.throughput(Throughput::Bytes((batch * ENTRY) as u64));
        let dir = tempfile::tempdir().unwrap();
        let (wal, mut next) = if steady && !smoke {
            steady_wal(&dir.path().join("wal"), 3)
        } else {
            let wal = Wal::open(&dir.path().join("wal"), WalOptions::default()).unwrap();
            (wal, 1)
        };
        let mut es = template(batch);
        let f = raw_file(dir.path());
        let buf: Vec<u8> = template(batch).into_iter().flat_map(|e| e.data).collect();
        let mut off = 0u64;
        let growing = if steady { "" } else { ", growing log" };
        let keel = format!("keel append x{batch}{growing}");
        let raw = format!("raw write+fdatasync x{batch}{growing}");
        let id = if steady {
            "keel vs raw (paired)"
        } else {
            "keel growing log vs raw (paired)"
        };
        g.bench_function(BenchmarkId::new(id, batch), |b| {
            paired(
                b,
                rec,
                (&keel, &raw),
                || {
                    if steady {
                        keel_append_steady(&wal, &mut es, &mut next)
                    } else {
                        keel_append(&wal, &mut es, &mut next)
                    }
                },
                || {
                    if off + buf.len() as u64 > RAW_FILE {
                        off = 0;
                    }
                    f.write_all_at(&buf, off).unwrap();
                    f.sync_data().unwrap();
                    off += buf.len() as u64;
                },
            )
        });
        let stats = wal.stats();
        println!(
            "WAL append x{batch}{growing}: {} rotations, {} into recycled files, {} appends \
             written straight from the entries' buffers",
            stats.rotations, stats.recycled, stats.direct_writes
        );
        rec.ratio(
            &format!("wal append, 1 KiB entries, batch {batch}{growing}, vs raw write+fdatasync"),
            &keel,
            &raw,
            Better::Faster,
            steady.then_some(0.9),
        );
    }
    g.finish();
}

fn group_commit(c: &mut Criterion, rec: &Recorder) {
    let mut g = quick(c, "wal_group_commit");
    g.throughput(Throughput::Elements(1));
    let dir = tempfile::tempdir().unwrap();
    let wal = Arc::new(Wal::open(dir.path(), WalOptions::default()).unwrap());
    let next = Arc::new(Mutex::new(1u64));
    let data: Vec<u8> = (0..ENTRY).map(|b| b as u8).collect();

    let one = "keel 1 thread, durable single-entry appends";
    let eight = "keel 8 threads, durable single-entry appends";
    // Both sides make the entry before taking the index lock, as an application prepares its
    // payload before the ordered part: only the index and the append happen under it.
    let append_one = || {
        let mut e = Entry {
            index: 0,
            term: 1,
            data: data.clone(),
        };
        let mut n = next.lock();
        e.index = *n;
        wal.append(std::slice::from_ref(&e), None, true).unwrap();
        *n += 1;
    };
    let run_eight = |per: u64| {
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..per {
                        let mut e = Entry {
                            index: 0,
                            term: 1,
                            data: data.clone(),
                        };
                        {
                            // Raft indices are consecutive: the index is taken and the entry
                            // buffered under one lock; the durable wait is shared.
                            let mut n = next.lock();
                            e.index = *n;
                            wal.append(std::slice::from_ref(&e), None, false).unwrap();
                            *n += 1;
                        }
                        wal.sync().unwrap();
                    }
                });
            }
        });
    };
    // Durable requests and fdatasyncs of each side, summed over the samples.
    let (mut one_counts, mut eight_counts) = ((0u64, 0u64, 0f64), (0u64, 0u64, 0f64));
    let counts = |acc: &mut (u64, u64, f64), a: &keel_wal::WalStats, b: &keel_wal::WalStats| {
        acc.0 += b.durable_requests - a.durable_requests;
        acc.1 += b.syncs - a.syncs;
        acc.2 += (b.sync_time - a.sync_time).as_secs_f64();
    };
    let s_start = wal.stats();
    g.bench_function("8 threads vs 1 thread (paired)", |b| {
        b.iter_custom(|iters| {
            // Each sample: `n` appends on one thread, then `n` appends from 8 threads
            // started once (so thread start-up is not what is measured).
            let per = iters.div_ceil(8).max(4);
            let n = per * 8;
            let s0 = wal.stats();
            let t = Instant::now();
            for _ in 0..n {
                append_one();
            }
            let t1 = t.elapsed();
            let s1 = wal.stats();
            let t = Instant::now();
            run_eight(per);
            let t8 = t.elapsed();
            let s2 = wal.stats();
            counts(&mut one_counts, &s0, &s1);
            counts(&mut eight_counts, &s1, &s2);
            rec.record(one, t1, n);
            rec.record(eight, t8, n);
            t8.mul_f64(iters as f64 / n as f64)
        })
    });
    rec.ratio(
        "wal group commit, 8 threads vs 1 thread, durable 1 KiB appends",
        eight,
        one,
        Better::Faster,
        Some(4.0),
    );
    let s_end = wal.stats();
    let gathers = s_end.gathers - s_start.gathers;
    println!(
        "GROUP COMMIT leaders waited for their group {gathers} times, {:.1} us on average",
        (s_end.gather_time - s_start.gather_time).as_secs_f64() * 1e6 / gathers.max(1) as f64
    );
    for (what, (requests, syncs, secs)) in [("1 thread", one_counts), ("8 threads", eight_counts)] {
        println!(
            "GROUP COMMIT {what}: {requests} durable appends, {syncs} fdatasyncs, {:.2} appends \
             per fdatasync, {:.1} us per fdatasync",
            requests as f64 / syncs.max(1) as f64,
            secs * 1e6 / syncs.max(1) as f64
        );
    }
    g.finish();
}

#[cfg(feature = "peers")]
fn peer(c: &mut Criterion, rec: &Recorder) {
    use raft_engine::{Config, Engine, LogBatch};
    let mut g = quick(c, "wal_peer_raft_engine");
    g.throughput(Throughput::Bytes((16 * ENTRY) as u64));
    let dir = tempfile::tempdir().unwrap();

    let wal = Wal::open(&dir.path().join("keel"), WalOptions::default()).unwrap();
    let mut es = template(16);
    let mut next = 1u64;
    let keel = "keel append x16 (beside raft-engine)";
    let engine = Engine::open(Config {
        dir: dir
            .path()
            .join("raft-engine")
            .to_string_lossy()
            .into_owned(),
        ..Config::default()
    })
    .unwrap();
    let values = template(16);
    let mut batch = LogBatch::with_capacity(16);
    let mut key = 1u64;
    let re = "raft-engine write x16 sync";
    g.bench_function("keel vs raft-engine (paired)", |b| {
        paired(
            b,
            rec,
            (keel, re),
            || keel_append(&wal, &mut es, &mut next),
            || {
                // raft-engine's entry path needs protobuf message types; its key-value path
                // goes through the same batch encoding, write and sync pipeline.
                for e in &values {
                    batch
                        .put(1, key.to_be_bytes().to_vec(), e.data.clone())
                        .unwrap();
                    key += 1;
                }
                engine.write(&mut batch, true).unwrap();
            },
        )
    });
    rec.ratio(
        "wal append x16 1 KiB sync vs raft-engine",
        keel,
        re,
        Better::Faster,
        Some(1.0),
    );
    g.finish();
}

/// Where each segment's records end (the written part), found once, untimed.
fn written_parts(dir: &Path) -> Vec<(PathBuf, u64)> {
    let mut segs: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "wal"))
        .collect();
    segs.sort();
    segs.into_iter()
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap();
            let end = bytes
                .iter()
                .rposition(|&b| b != 0)
                .map_or(0, |i| (i as u64 + 8) & !7);
            (p, end)
        })
        .collect()
}

fn raw_read_crc(parts: &[(PathBuf, u64)], buf: &mut [u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    for (p, len) in parts {
        let f = File::open(p).unwrap();
        let mut off = 0u64;
        while off < *len {
            let n = ((*len - off) as usize).min(buf.len());
            f.read_exact_at(&mut buf[..n], off).unwrap();
            h.update(&buf[..n]);
            off += n as u64;
        }
    }
    h.finalize()
}

fn replay(c: &mut Criterion, rec: &Recorder) {
    // The smoke run (`-- --test`) only checks that everything works: a small log will do.
    let smoke = std::env::args().any(|a| a == "--test");
    let mib: u64 = std::env::var("KEEL_WAL_REPLAY_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if smoke { 16 } else { 1024 });
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wal");
    let entries = mib * (1 << 20) / (ENTRY as u64 + 24);
    {
        let wal = Wal::open(&path, WalOptions::default()).unwrap();
        let mut es = template(256);
        let mut next = 1u64;
        while next <= entries {
            for (k, e) in es.iter_mut().enumerate() {
                e.index = next + k as u64;
            }
            wal.append(&es, None, false).unwrap();
            next += es.len() as u64;
        }
        wal.sync().unwrap();
    }
    let parts = written_parts(&path);
    let bytes: u64 = parts.iter().map(|p| p.1).sum();

    let mut g = c.benchmark_group("wal_replay");
    g.sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(5))
        .throughput(Throughput::Bytes(bytes));
    let keel = format!("keel open (read + check every record) {mib} MiB");
    let full = format!("keel open + stream every entry {mib} MiB");
    let raw = format!("raw sequential read + crc32 {mib} MiB");
    let mut buf = vec![0u8; 4 << 20];
    // The machine is shared: each iteration times the reference and both keel variants back
    // to back (alternating which goes first), so all three see the same conditions.
    let mut flip = false;
    g.bench_function("keel open vs raw read+crc32 (paired)", |b| {
        b.iter_custom(|iters| {
            let mut keel_total = Duration::ZERO;
            for _ in 0..iters {
                flip = !flip;
                let time_raw = |buf: &mut Vec<u8>| {
                    let t = Instant::now();
                    std::hint::black_box(raw_read_crc(&parts, buf));
                    t.elapsed()
                };
                let r1 = if flip { Some(time_raw(&mut buf)) } else { None };
                let t = Instant::now();
                let wal = Wal::open(&path, read_opts()).unwrap();
                let k = t.elapsed();
                assert!(wal.last_index() >= entries);
                drop(wal);
                let t = Instant::now();
                let wal = Wal::open(&path, read_opts()).unwrap();
                let mut n = 0u64;
                wal.replay(wal.first_index(), |e| {
                    n += e.data.len() as u64;
                    ControlFlow::Continue(())
                })
                .unwrap();
                let f = t.elapsed();
                assert!(n >= entries * ENTRY as u64);
                drop(wal);
                let r = r1.unwrap_or_else(|| time_raw(&mut buf));
                rec.record(&keel, k, 1);
                rec.record(&full, f, 1);
                rec.record(&raw, r, 1);
                keel_total += k;
            }
            keel_total
        })
    });
    g.finish();
    rec.ratio(
        &format!("wal replay (open) of {mib} MiB vs raw read + crc32"),
        &keel,
        &raw,
        Better::Faster,
        Some(0.8),
    );
    rec.ratio(
        &format!("wal open + streaming every entry of {mib} MiB vs raw read + crc32"),
        &full,
        &raw,
        Better::Faster,
        None,
    );

    // Memory is measured in fresh child processes, so that nothing this process allocated and
    // freed earlier can hide what replay needs.
    for mode in ["replay", "entries"] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .env(PROBE_ENV, format!("{mode}:{}", path.display()))
            .output()
            .unwrap();
        assert!(out.status.success(), "memory probe failed: {out:?}");
        print!("{}", String::from_utf8_lossy(&out.stdout));
    }
}

/// Options for reading a finished log: no background preparation of a next segment.
fn read_opts() -> WalOptions {
    WalOptions {
        preallocate: false,
        ..WalOptions::default()
    }
}

/// Set in a child process: `replay:<log dir>` or `entries:<log dir>`, the measurement to make.
const PROBE_ENV: &str = "KEEL_WAL_MEMORY_PROBE";

/// The child side of the memory measurement: opens the log, then measures how far resident
/// memory grows while streaming from its middle (`replay`) or reading 10 000 entries there
/// (`entries`), beyond what the open log already holds.
fn memory_probe(spec: &str) {
    let (mode, path) = spec.split_once(':').expect("mode:path");
    let wal = Wal::open(Path::new(path), read_opts()).unwrap();
    let mid = (wal.first_index() + wal.last_index()) / 2;
    let seg = WalOptions::default().segment_size as usize;
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    if mode == "replay" {
        let (n, peak) = peak_rss_growth(|| {
            let mut n = 0u64;
            wal.replay(mid, |e| {
                n += 1;
                std::hint::black_box(e.data);
                ControlFlow::Continue(())
            })
            .unwrap();
            n
        });
        match peak {
            Some(peak) => println!(
                "MEMORY wal replay from index {mid} ({n} entries streamed, none kept): peak RSS \
                 +{:.1} MiB; bound: one segment ({} MiB) + entries returned (0) -> {}",
                mib(peak),
                seg >> 20,
                if peak <= seg { "within" } else { "EXCEEDED" }
            ),
            None => println!("MEMORY wal replay: peak RSS unavailable on this system"),
        }
    } else {
        let hi = (mid + 10_000).min(wal.last_index() + 1);
        let (got, peak) = peak_rss_growth(|| wal.entries(mid, hi, None).unwrap());
        let returned: usize = got.iter().map(|e| e.data.len() + size_of::<Entry>()).sum();
        match peak {
            Some(peak) => println!(
                "MEMORY wal entries(mid, mid + {}): peak RSS +{:.1} MiB; bound: one segment ({} \
                 MiB) + entries returned ({:.1} MiB) -> {}",
                hi - mid,
                mib(peak),
                seg >> 20,
                mib(returned),
                if peak <= seg + returned {
                    "within"
                } else {
                    "EXCEEDED"
                }
            ),
            None => println!("MEMORY wal entries: peak RSS unavailable on this system"),
        }
    }
}

fn main() {
    if let Ok(spec) = std::env::var(PROBE_ENV) {
        memory_probe(&spec);
        return;
    }
    let rec = Recorder::new();
    let mut c = Criterion::default().configure_from_args();
    append(&mut c, &rec);
    if selected("group") {
        group_commit(&mut c, &rec);
    }
    #[cfg(feature = "peers")]
    if selected("peer") {
        peer(&mut c, &rec);
    }
    if selected("replay") {
        replay(&mut c, &rec);
    }
    c.final_summary();
}
