//! Where a durable append's time goes: wall time and the appending thread's CPU time per
//! durable append of `KEEL_PROFILE_BATCH` (default 256) entries of `KEEL_PROFILE_ENTRY` bytes
//! (default 1024), in steady state
//! (released segments recycled), next to a raw `pwrite` + `fdatasync` of the same bytes into a
//! preallocated file, interleaved. CPU time is far less disturbed by other load on the
//! machine than wall time, so it shows what the log adds on top of the write itself.
//!
//! Run: `cargo run --release -p keel-wal --example append_profile` (`KEEL_PROFILE_ROUNDS`,
//! default 2000, appends per side; `KEEL_PROFILE_DIRECT=0` turns direct writes off;
//! `KEEL_PROFILE_SIDE=keel` or `raw` times one side alone; `KEEL_PROFILE_SEGMENT_MIB`,
//! default 64, sets the segment size).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use keel_wal::{Entry, Wal, WalOptions};

/// CPU time this thread has run, from `/proc/thread-self/schedstat` (nanoseconds).
fn thread_cpu() -> Duration {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    let ns = s
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    Duration::from_nanos(ns)
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let batch = env("KEEL_PROFILE_BATCH", 256);
    let size = env("KEEL_PROFILE_ENTRY", 1024);
    let rounds = env("KEEL_PROFILE_ROUNDS", 2000);
    let dir = tempfile::tempdir().expect("temp dir");
    let opts = WalOptions {
        direct_writes: env("KEEL_PROFILE_DIRECT", 1) != 0,
        segment_size: env("KEEL_PROFILE_SEGMENT_MIB", 64) as u64 * (1 << 20),
        ..WalOptions::default()
    };
    let per_segment = opts.segment_size / (size as u64 + 24);
    let wal = Wal::open(&dir.path().join("wal"), opts).expect("open");
    let mut es: Vec<Entry> = (0..batch)
        .map(|k| Entry {
            index: 0,
            term: 1,
            data: (0..size).map(|b| (b * 31 + k * 7) as u8).collect(),
        })
        .collect();
    let mut next = 1u64;
    let mut append = |sync: bool| {
        for (k, e) in es.iter_mut().enumerate() {
            e.index = next + k as u64;
        }
        wal.append(&es, None, sync).expect("append");
        next += batch as u64;
        if wal.segment_count() > 2 {
            wal.release_to(next.saturating_sub(per_segment))
                .expect("release");
        }
    };
    // Steady state: three segments (`KEEL_PROFILE_WARM`) written and recycled before timing.
    let warm = env("KEEL_PROFILE_WARM", 3) as u64;
    for _ in 0..(warm * per_segment).div_ceil(batch as u64) {
        append(false);
    }
    let raw_len = 64u64 << 20;
    let raw = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(dir.path().join("raw"))
        .expect("raw file");
    let zeros = vec![0u8; 1 << 20];
    for i in 0..raw_len >> 20 {
        raw.write_all_at(&zeros, i << 20).expect("zero");
    }
    raw.sync_all().expect("sync");
    let bytes: Vec<u8> = (0..batch)
        .flat_map(|k| (0..size).map(move |b| (b * 31 + k * 7) as u8))
        .collect();
    let mut off = 0u64;
    let (mut kw, mut kc, mut rw, mut rc) = (
        Duration::ZERO,
        Duration::ZERO,
        Duration::ZERO,
        Duration::ZERO,
    );
    // `KEEL_PROFILE_SIDE=keel` or `raw` runs one side alone (for a profiler's samples).
    let side = std::env::var("KEEL_PROFILE_SIDE").unwrap_or_default();
    let (keel_on, raw_on) = (side != "raw", side != "keel");
    let (mut keel_each, mut raw_each) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
    for _ in 0..rounds {
        let (t, c) = (Instant::now(), thread_cpu());
        if keel_on {
            append(true);
        }
        kw += t.elapsed();
        keel_each.push(t.elapsed());
        kc += thread_cpu() - c;
        if !raw_on {
            continue;
        }
        let (t, c) = (Instant::now(), thread_cpu());
        if off + bytes.len() as u64 > raw_len {
            off = 0;
        }
        raw.write_all_at(&bytes, off).expect("raw write");
        raw.sync_data().expect("raw sync");
        off += bytes.len() as u64;
        rw += t.elapsed();
        raw_each.push(t.elapsed());
        rc += thread_cpu() - c;
    }
    let per = |d: Duration| d.as_secs_f64() * 1e6 / rounds as f64;
    println!(
        "batch {batch} x {size} B, {rounds} rounds: keel wall {:.1} us cpu {:.1} us | raw wall {:.1} us cpu {:.1} us | wall ratio {:.3}x",
        per(kw),
        per(kc),
        per(rw),
        per(rc),
        rw.as_secs_f64() / kw.as_secs_f64()
    );
    for (side, each) in [("keel", &mut keel_each), ("raw", &mut raw_each)] {
        if each.is_empty() {
            continue;
        }
        each.sort();
        let pct = |p: f64| each[((each.len() - 1) as f64 * p) as usize].as_secs_f64() * 1e6;
        println!(
            "  {side}: p50 {:.1} us, p90 {:.1} us, p99 {:.1} us, max {:.1} us",
            pct(0.5),
            pct(0.9),
            pct(0.99),
            pct(1.0)
        );
    }
    let st = wal.stats();
    println!(
        "  {} syncs of {:.1} us, {} direct flushes, {} direct (vectored) writes",
        st.syncs,
        st.sync_time.as_secs_f64() * 1e6 / st.syncs.max(1) as f64,
        st.direct_flushes,
        st.direct_writes
    );
}
