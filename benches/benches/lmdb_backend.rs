//! The LMDB backend against raw LMDB through heed, in the same run: what keel's bucket
//! databases (one LMDB named database per bucket, keys with a 1-byte prefix), batch
//! validation, commit stamp and checked read-transaction start cost.
//!
//! - commit: batches of 1 000 puts (24-byte ever-growing keys, 150-byte values, as the MVCC
//!   store writes revisions), with fsync and without; only the commit is timed (building the
//!   `WriteBatch` or the raw pairs is not); goal ≥ 0.9× raw heed's throughput;
//! - range: a read transaction iterating 10 000 pairs; goal ≤ 1.1× raw heed's time;
//! - point read: open a read transaction and get one key; reported (the commit-stamp check
//!   adds one lookup per open).
//! - restore: a 42 MB snapshot stream (40 000 pairs of 24-byte keys and 1 KiB values, as a
//!   learner receives) into an empty backend, fsync on: the backend's own restore against the
//!   generic one (`snapshot::restore`, a durable commit per 8 MiB batch), and against raw heed
//!   appending the same, already decoded, pairs in one transaction with one fsync; MB/s of
//!   stream reported by criterion.
//!
//! `cargo bench -p keel-benches --bench lmdb_backend` (about two minutes); `-- --test` is the
//! smoke run.

use std::hint::black_box;
use std::ops::Bound;
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use keel_benches::{Better, Recorder};
use keel_mvcc::{Backend, Bucket, ReadTxn, WriteBatch};

static RECORDER: LazyLock<Recorder> = LazyLock::new(Recorder::new);

const BATCH: u64 = 1_000;
const RANGE_KEYS: u64 = 10_000;
const KEY: Bucket = Bucket::new("key");
const MAP_SIZE: usize = 8 << 30;

fn key(i: u64) -> [u8; 24] {
    let mut k = [b'0'; 24];
    k[..4].copy_from_slice(b"rev-");
    k[8..].copy_from_slice(&i.to_be_bytes().map(|b| b % 10 + b'0').repeat(2));
    k[4..8].copy_from_slice(&(i as u32).to_be_bytes());
    k
}

fn value(i: u64) -> [u8; 150] {
    [(i % 251) as u8; 150]
}

fn commit(c: &mut Criterion) {
    for sync in [true, false] {
        let label = if sync { "fsync" } else { "no fsync" };
        let mut group = c.benchmark_group(format!("lmdb_backend/commit 1000 puts, {label}"));
        group
            .throughput(Throughput::Elements(BATCH))
            .sample_size(20)
            .measurement_time(Duration::from_secs(5));
        let ours = format!("keel backend, {label}");
        let raw = format!("raw heed, {label}");

        let dir = tempfile::tempdir().unwrap();
        let store = keel_benches::lmdb::backend(dir.path(), MAP_SIZE as u64, sync);
        let mut next = 0u64;
        group.bench_function("keel", |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    let mut batch = WriteBatch::new();
                    for _ in 0..BATCH {
                        batch.put(&KEY, key(next), value(next));
                        next += 1;
                    }
                    let start = Instant::now();
                    store.commit(&batch).expect("commit");
                    timed += start.elapsed();
                }
                RECORDER.record(&ours, timed, iters);
                timed
            })
        });
        drop(store);

        let dir = tempfile::tempdir().unwrap();
        let reference = keel_benches::lmdb::raw(dir.path(), MAP_SIZE as u64, sync);
        let (env, db) = (reference.env.clone(), reference.db);
        let mut next = 0u64;
        group.bench_function("raw heed", |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    let pairs: Vec<([u8; 24], [u8; 150])> = (0..BATCH)
                        .map(|_| {
                            next += 1;
                            (key(next - 1), value(next - 1))
                        })
                        .collect();
                    let start = Instant::now();
                    let mut wtxn = env.write_txn().expect("write txn");
                    for (k, v) in &pairs {
                        db.put(&mut wtxn, k, v).expect("put");
                    }
                    wtxn.commit().expect("commit");
                    timed += start.elapsed();
                }
                RECORDER.record(&raw, timed, iters);
                timed
            })
        });
        group.finish();
        RECORDER.ratio(
            &format!("LMDB backend commit throughput vs raw heed ({label})"),
            &ours,
            &raw,
            Better::Faster,
            Some(0.9),
        );
    }
}

fn reads(c: &mut Criterion) {
    let ours_dir = tempfile::tempdir().unwrap();
    let store = keel_benches::lmdb::backend(ours_dir.path(), MAP_SIZE as u64, false);
    let raw_dir = tempfile::tempdir().unwrap();
    let reference = keel_benches::lmdb::raw(raw_dir.path(), MAP_SIZE as u64, false);
    let (env, db) = (reference.env.clone(), reference.db);
    let mut batch = WriteBatch::new();
    let mut wtxn = env.write_txn().expect("write txn");
    for i in 0..RANGE_KEYS {
        batch.put(&KEY, key(i), value(i));
        db.put(&mut wtxn, &key(i), &value(i)).expect("put");
    }
    store.commit(&batch).expect("commit");
    wtxn.commit().expect("commit");

    let mut group = c.benchmark_group("lmdb_backend/range 10k");
    group
        .throughput(Throughput::Elements(RANGE_KEYS))
        .sample_size(30)
        .measurement_time(Duration::from_secs(4));
    group.bench_function("keel", |b| {
        RECORDER.iter(b, "keel range", |_| {
            let txn = store.read_txn().expect("read txn");
            let mut bytes = 0usize;
            for item in txn.range(&KEY, b"", None).expect("range") {
                let (k, v) = item.expect("item");
                bytes += k.len() + v.len();
            }
            assert_eq!(bytes, RANGE_KEYS as usize * 174);
            black_box(bytes);
        })
    });
    group.bench_function("raw heed", |b| {
        RECORDER.iter(b, "raw heed range", |_| {
            let txn = env.clone().static_read_txn().expect("read txn");
            let mut bytes = 0usize;
            let bounds: (Bound<&[u8]>, Bound<&[u8]>) = (Bound::Unbounded, Bound::Unbounded);
            for item in db.range(&txn, &bounds).expect("range") {
                let (k, v) = item.expect("item");
                bytes += k.len() + v.len();
            }
            assert_eq!(bytes, RANGE_KEYS as usize * 174);
            black_box(bytes);
        })
    });
    group.finish();
    RECORDER.ratio(
        "LMDB backend range of 10k pairs vs raw heed",
        "keel range",
        "raw heed range",
        Better::LowerTime,
        Some(1.1),
    );

    let mut group = c.benchmark_group("lmdb_backend/read txn + get");
    group
        .sample_size(30)
        .measurement_time(Duration::from_secs(4));
    group.bench_function("keel", |b| {
        RECORDER.iter(b, "keel point read", |i| {
            let txn = store.read_txn().expect("read txn");
            let k = key(i.wrapping_mul(7919) % RANGE_KEYS);
            black_box(txn.get(&KEY, &k).expect("get").expect("present").len());
        })
    });
    group.bench_function("raw heed", |b| {
        RECORDER.iter(b, "raw heed point read", |i| {
            let txn = env.clone().static_read_txn().expect("read txn");
            let k = key(i.wrapping_mul(7919) % RANGE_KEYS);
            black_box(db.get(&txn, &k).expect("get").expect("present").len());
        })
    });
    group.finish();
    RECORDER.ratio(
        "LMDB backend read txn + get vs raw heed",
        "keel point read",
        "raw heed point read",
        Better::LowerTime,
        None,
    );
}

fn restore(c: &mut Criterion) {
    const PAIRS: u64 = 40_000;
    let big = |i: u64| {
        let mut v = vec![(i % 251) as u8; 1024];
        v[..8].copy_from_slice(&i.to_be_bytes());
        v
    };
    let src_dir = tempfile::tempdir().unwrap();
    let source = keel_benches::lmdb::backend(src_dir.path(), MAP_SIZE as u64, false);
    let mut batch = WriteBatch::new();
    for i in 0..PAIRS {
        batch.put(&KEY, key(i), big(i));
    }
    source.commit(&batch).expect("commit");
    let mut stream = Vec::new();
    source.snapshot(&mut stream).expect("snapshot");
    drop(source);
    let pairs: Vec<(Vec<u8>, Vec<u8>)> = (0..PAIRS)
        .map(|i| {
            let mut stored = b"key\0".to_vec();
            stored.extend_from_slice(&key(i));
            (stored, big(i))
        })
        .collect();
    assert!(pairs.windows(2).all(|w| w[0].0 < w[1].0));

    let mut group = c.benchmark_group("lmdb_backend/restore 42 MB stream");
    group
        .throughput(Throughput::Bytes(stream.len() as u64))
        .sample_size(10)
        .measurement_time(Duration::from_secs(10));
    for (name, native) in [("keel restore", true), ("generic restore", false)] {
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    let dir = tempfile::tempdir().unwrap();
                    let target = keel_benches::lmdb::backend(dir.path(), MAP_SIZE as u64, true);
                    let start = Instant::now();
                    let loaded = if native {
                        target.restore(&mut stream.as_slice())
                    } else {
                        keel_mvcc::backend::snapshot::restore(&target, &mut stream.as_slice())
                    }
                    .expect("restore");
                    timed += start.elapsed();
                    assert_eq!(loaded, PAIRS);
                }
                RECORDER.record(name, timed, iters);
                timed
            })
        });
    }
    group.bench_function("raw heed", |b| {
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            for _ in 0..iters {
                let dir = tempfile::tempdir().unwrap();
                let reference = keel_benches::lmdb::raw(dir.path(), MAP_SIZE as u64, true);
                let (env, db) = (reference.env.clone(), reference.db);
                let start = Instant::now();
                let mut wtxn = env.write_txn().expect("write txn");
                for (k, v) in &pairs {
                    db.put_with_flags(&mut wtxn, heed::PutFlags::APPEND, k, v)
                        .expect("append");
                }
                wtxn.commit().expect("commit");
                timed += start.elapsed();
            }
            RECORDER.record("raw heed append", timed, iters);
            timed
        })
    });
    group.finish();
    RECORDER.ratio(
        "LMDB backend restore vs the generic restore",
        "keel restore",
        "generic restore",
        Better::Faster,
        None,
    );
    RECORDER.ratio(
        "LMDB backend restore vs raw heed appends (decoded pairs, one fsync)",
        "keel restore",
        "raw heed append",
        Better::Faster,
        None,
    );
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    commit(&mut c);
    reads(&mut c);
    restore(&mut c);
    c.final_summary();
}
