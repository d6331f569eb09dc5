//! keel's file backend against raw LMDB (through heed), same workloads, same run.
//!
//! - `write/keel_pattern`: 1 000 puts per durable commit, 17-byte ever-growing revision keys
//!   (`main` u64 BE, `_`, `sub` u64 BE) and 1 KiB values. Goal: ≥ 1.5× LMDB's throughput.
//! - `write/random_24_150`: 1 000 random 24-byte keys with 150-byte values per durable commit
//!   (redb's benchmark workload). Ratio reported.
//! - `read/point` and `read/scan_10k` on 1 M keys (24 B / 150 B, loaded in random order):
//!   1 000 random gets per read transaction, and one 10 000-key range scan from a random key.
//!   Goal: ≤ 1.3× LMDB's time.
//! - space: the file size after 10 rounds of overwriting the whole data set, each round
//!   followed by a defragment, against the live data (keys + values). Goal: ≤ 1.5×.
//! - `restore`: a 48 MB snapshot stream (48 000 pairs of 1 KiB) restored into a fresh file
//!   store through its own restore (one sync at the end), against the generic restore that
//!   commits durably every 8 MiB, and against keel's LMDB backend. Ratios reported.
//!
//! `cargo bench -p keel-benches --bench backend` (a few minutes);
//! `cargo bench -p keel-benches --bench backend -- --test` runs every workload once on small
//! sizes.

use std::hint::black_box;
use std::ops::Bound;
use std::path::Path;
use std::time::Duration;

use criterion::Criterion;
use heed::types::Bytes;
use heed::{Database, Env, WithoutTls};
use keel_backend_file::{FileBackend, FileOptions};
use keel_backend_lmdb::{LmdbBackend, LmdbOptions, RawLmdb};
use keel_benches::{Better, Recorder};
use keel_mvcc::{Backend, Bucket, ReadTxn, WriteBatch};
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};

const BUCKET: Bucket = Bucket::new("key");
const BATCH: usize = 1000;

fn smoke() -> bool {
    std::env::args().any(|a| a == "--test")
}

/// Keys loaded for the read workloads.
fn read_keys() -> usize {
    if smoke() { 20_000 } else { 1_000_000 }
}

/// Raw LMDB through heed, opened the way keel's LMDB backend opens it.
struct Lmdb {
    env: Env<WithoutTls>,
    db: Database<Bytes, Bytes>,
    _raw: RawLmdb,
}

impl Lmdb {
    fn open(dir: &Path) -> Lmdb {
        let options = LmdbOptions {
            map_size: 64 << 30,
            ..LmdbOptions::default()
        };
        let raw = RawLmdb::open(dir, &options).expect("open raw LMDB");
        Lmdb {
            env: raw.env.clone(),
            db: raw.db,
            _raw: raw,
        }
    }

    fn commit(&self, pairs: &[(Vec<u8>, Vec<u8>)]) {
        let mut wtxn = self.env.write_txn().expect("write txn");
        for (k, v) in pairs {
            self.db.put(&mut wtxn, k, v).expect("put");
        }
        wtxn.commit().expect("commit");
    }
}

fn file_options() -> FileOptions {
    FileOptions::default()
}

fn batch_of(pairs: &[(Vec<u8>, Vec<u8>)]) -> WriteBatch {
    let mut b = WriteBatch::new();
    for (k, v) in pairs {
        b.put(&BUCKET, k.clone(), v.clone());
    }
    b
}

fn revision_key(main: u64, sub: u64) -> Vec<u8> {
    let mut k = Vec::with_capacity(17);
    k.extend_from_slice(&main.to_be_bytes());
    k.push(b'_');
    k.extend_from_slice(&sub.to_be_bytes());
    k
}

fn random_pairs(rng: &mut StdRng, n: usize, klen: usize, vlen: usize) -> Vec<(Vec<u8>, Vec<u8>)> {
    (0..n)
        .map(|_| {
            let mut k = vec![0u8; klen];
            rng.fill_bytes(&mut k);
            let mut v = vec![0u8; vlen];
            rng.fill_bytes(&mut v);
            (k, v)
        })
        .collect()
}

fn configure(c: &mut Criterion) -> criterion::BenchmarkGroup<'_, criterion::measurement::WallTime> {
    let mut g = c.benchmark_group("backend");
    g.sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    g
}

fn writes(c: &mut Criterion) {
    let rec = Recorder::new();
    let mut g = configure(c);
    let value = vec![0x5au8; 1024];
    {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = FileBackend::open(dir.path(), &file_options()).expect("open");
        let mut rev = 1u64;
        g.bench_function("write/keel_pattern/file", |b| {
            rec.iter(b, "keel_pattern/file", |_| {
                let mut batch = WriteBatch::new();
                for sub in 0..BATCH as u64 {
                    batch.put(&BUCKET, revision_key(rev, sub), value.clone());
                }
                rev += 1;
                file.commit(&batch).expect("commit");
            })
        });
    }
    {
        let dir = tempfile::tempdir().expect("tempdir");
        let lmdb = Lmdb::open(dir.path());
        let mut rev = 1u64;
        g.bench_function("write/keel_pattern/lmdb", |b| {
            rec.iter(b, "keel_pattern/lmdb", |_| {
                let pairs: Vec<(Vec<u8>, Vec<u8>)> = (0..BATCH as u64)
                    .map(|sub| (revision_key(rev, sub), value.clone()))
                    .collect();
                rev += 1;
                lmdb.commit(&pairs);
            })
        });
    }
    rec.ratio(
        "batched writes, keel pattern (17 B revision keys, 1 KiB values, 1000/commit)",
        "keel_pattern/file",
        "keel_pattern/lmdb",
        Better::Faster,
        Some(1.5),
    );

    {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = FileBackend::open(dir.path(), &file_options()).expect("open");
        let mut rng = StdRng::seed_from_u64(1);
        g.bench_function("write/random_24_150/file", |b| {
            rec.iter(b, "random/file", |_| {
                let batch = batch_of(&random_pairs(&mut rng, BATCH, 24, 150));
                file.commit(&batch).expect("commit");
            })
        });
    }
    {
        let dir = tempfile::tempdir().expect("tempdir");
        let lmdb = Lmdb::open(dir.path());
        let mut rng = StdRng::seed_from_u64(1);
        g.bench_function("write/random_24_150/lmdb", |b| {
            rec.iter(b, "random/lmdb", |_| {
                lmdb.commit(&random_pairs(&mut rng, BATCH, 24, 150));
            })
        });
    }
    rec.ratio(
        "random writes (24 B keys, 150 B values, 1000/commit)",
        "random/file",
        "random/lmdb",
        Better::Faster,
        None,
    );
    g.finish();
}

fn reads(c: &mut Criterion) {
    let rec = Recorder::new();
    let n = read_keys();
    let mut rng = StdRng::seed_from_u64(2);
    let pairs = random_pairs(&mut rng, n, 24, 150);
    let probes: Vec<usize> = (0..1 << 16).map(|_| rng.random_range(0..n)).collect();
    let mut sorted: Vec<&[u8]> = pairs.iter().map(|(k, _)| &k[..]).collect();
    sorted.sort_unstable();

    let fdir = tempfile::tempdir().expect("tempdir");
    let file = FileBackend::open(fdir.path(), &file_options()).expect("open");
    for chunk in pairs.chunks(10_000) {
        file.commit(&batch_of(chunk)).expect("commit");
    }
    let ldir = tempfile::tempdir().expect("tempdir");
    let lmdb = Lmdb::open(ldir.path());
    for chunk in pairs.chunks(10_000) {
        lmdb.commit(chunk);
    }

    let mut g = configure(c);
    const GETS: usize = 1000;
    g.bench_function("read/point/file", |b| {
        rec.iter(b, "point/file", |i| {
            let txn = file.read_txn().expect("txn");
            let mut sum = 0;
            for j in 0..GETS {
                let k = &pairs[probes[(i as usize * GETS + j) % probes.len()]].0;
                sum += txn.get(&BUCKET, k).expect("get").map_or(0, <[u8]>::len);
            }
            black_box(sum);
        })
    });
    g.bench_function("read/point/lmdb", |b| {
        rec.iter(b, "point/lmdb", |i| {
            let txn = lmdb.env.read_txn().expect("txn");
            let mut sum = 0;
            for j in 0..GETS {
                let k = &pairs[probes[(i as usize * GETS + j) % probes.len()]].0;
                sum += lmdb.db.get(&txn, k).expect("get").map_or(0, <[u8]>::len);
            }
            black_box(sum);
        })
    });
    rec.ratio(
        "random point reads on 1M keys (1000 gets per read txn)",
        "point/file",
        "point/lmdb",
        Better::LowerTime,
        Some(1.3),
    );

    const SCAN: usize = 10_000;
    let start_of = |i: u64| sorted[probes[i as usize % probes.len()] % (n - SCAN)];
    g.bench_function("read/scan_10k/file", |b| {
        rec.iter(b, "scan/file", |i| {
            let txn = file.read_txn().expect("txn");
            let mut sum = 0;
            for item in txn
                .range(&BUCKET, start_of(i), None)
                .expect("range")
                .take(SCAN)
            {
                let (k, v) = item.expect("item");
                sum += k.len() + v.len();
            }
            assert_eq!(sum, SCAN * 174);
        })
    });
    g.bench_function("read/scan_10k/lmdb", |b| {
        rec.iter(b, "scan/lmdb", |i| {
            let txn = lmdb.env.read_txn().expect("txn");
            let mut sum = 0;
            let from = start_of(i);
            for item in lmdb
                .db
                .range(&txn, &(Bound::Included(from), Bound::Unbounded))
                .expect("range")
                .take(SCAN)
            {
                let (k, v) = item.expect("item");
                sum += k.len() + v.len();
            }
            assert_eq!(sum, SCAN * 174);
        })
    });
    rec.ratio(
        "10k-key range scans on 1M keys",
        "scan/file",
        "scan/lmdb",
        Better::LowerTime,
        Some(1.3),
    );
    g.finish();
}

/// Bytes of every file under `dir`, recursively.
fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .expect("read dir")
        .map(|e| {
            let e = e.expect("entry");
            let meta = e.metadata().expect("stat");
            if meta.is_dir() {
                dir_bytes(&e.path())
            } else {
                meta.len()
            }
        })
        .sum()
}

/// Not a timing: prints the space figures once.
fn space(_c: &mut Criterion) {
    let keys = if smoke() { 10_000 } else { 200_000 };
    let live = (keys * (24 + 150)) as f64;
    let mut rng = StdRng::seed_from_u64(3);
    let key_set: Vec<Vec<u8>> = random_pairs(&mut rng, keys, 24, 0)
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    let round = |rng: &mut StdRng| -> Vec<(Vec<u8>, Vec<u8>)> {
        key_set
            .iter()
            .map(|k| {
                let mut v = vec![0u8; 150];
                rng.fill_bytes(&mut v);
                (k.clone(), v)
            })
            .collect()
    };

    let fdir = tempfile::tempdir().expect("tempdir");
    let ldir = tempfile::tempdir().expect("tempdir");
    let odir = tempfile::tempdir().expect("tempdir");
    {
        let file = FileBackend::open(fdir.path(), &file_options()).expect("open");
        let online = FileBackend::open(
            odir.path(),
            &FileOptions {
                segment_size: 4 << 20,
                reclaim_min_garbage: 0,
                ..FileOptions::default()
            },
        )
        .expect("open");
        let lmdb = Lmdb::open(ldir.path());
        for _ in 0..10 {
            let pairs = round(&mut rng);
            for chunk in pairs.chunks(BATCH) {
                let batch = batch_of(chunk);
                file.commit(&batch).expect("commit");
                online.commit(&batch).expect("commit");
                lmdb.commit(chunk);
            }
            file.defragment().expect("defragment");
            online.reclaim().expect("reclaim");
        }
        lmdb.env.force_sync().expect("sync");
        let f = dir_bytes(fdir.path()) as f64;
        let o = dir_bytes(odir.path()) as f64;
        let l = dir_bytes(ldir.path()) as f64;
        println!(
            "SPACE after 10 overwrite rounds of {keys} keys ({:.1} MB live): \
             file+defragment {:.1} MB = {:.3}x live (goal <= 1.50x: {}); \
             file, online reclaim only (4 MiB segments) {:.1} MB = {:.3}x; \
             lmdb {:.1} MB = {:.3}x",
            live / 1e6,
            f / 1e6,
            f / live,
            if f / live <= 1.5 { "met" } else { "NOT met" },
            o / 1e6,
            o / live,
            l / 1e6,
            l / live,
        );
    }
}

fn restore(c: &mut Criterion) {
    let rec = Recorder::new();
    let pairs = if smoke() { 2_000 } else { 48_000 };
    let stream = {
        let dir = tempfile::tempdir().expect("tempdir");
        let source = FileBackend::open(dir.path(), &file_options()).expect("open");
        let mut rng = StdRng::seed_from_u64(4);
        for chunk in random_pairs(&mut rng, pairs, 24, 1024).chunks(BATCH) {
            source.commit(&batch_of(chunk)).expect("commit");
        }
        let mut out = Vec::new();
        source.snapshot(&mut out).expect("snapshot");
        out
    };
    let mut g = configure(c);
    g.bench_function("restore/file", |b| {
        rec.iter(b, "restore/file", |_| {
            let dir = tempfile::tempdir().expect("tempdir");
            let target = FileBackend::open(dir.path(), &file_options()).expect("open");
            let n = target.restore(&mut stream.as_slice()).expect("restore");
            assert_eq!(n as usize, pairs);
        })
    });
    g.bench_function("restore/file_generic", |b| {
        rec.iter(b, "restore/file_generic", |_| {
            let dir = tempfile::tempdir().expect("tempdir");
            let target = FileBackend::open(dir.path(), &file_options()).expect("open");
            let n = keel_mvcc::backend::snapshot::restore(&target, &mut stream.as_slice())
                .expect("restore");
            assert_eq!(n as usize, pairs);
        })
    });
    g.bench_function("restore/lmdb", |b| {
        rec.iter(b, "restore/lmdb", |_| {
            let dir = tempfile::tempdir().expect("tempdir");
            let options = LmdbOptions {
                map_size: 64 << 30,
                ..LmdbOptions::default()
            };
            let target = LmdbBackend::open(dir.path(), &options).expect("open");
            let n = target.restore(&mut stream.as_slice()).expect("restore");
            assert_eq!(n as usize, pairs);
        })
    });
    g.finish();
    rec.ratio(
        "restore of a 48 MB stream, file backend's own vs generic (durable commit per 8 MiB)",
        "restore/file",
        "restore/file_generic",
        Better::Faster,
        None,
    );
    rec.ratio(
        "restore of a 48 MB stream, file backend vs keel's LMDB backend",
        "restore/file",
        "restore/lmdb",
        Better::Faster,
        None,
    );
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    writes(&mut c);
    reads(&mut c);
    space(&mut c);
    restore(&mut c);
    c.final_summary();
}
