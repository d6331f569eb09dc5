//! Lease benchmarks: grant + attach throughput and memory per lease, finding expired leases
//! through the expiry heap against a full scan of the same table (same run, goal ≥ 100×), and
//! the time to produce one checkpoint batch of 1 000 among a million leases.
//!
//! Grant + attach is measured twice: on the in-memory lease table (1 000 000 leases per
//! sample), and through the lessor over an MVCC store on the file (or LMDB) backend, where
//! each lease is one grant transaction plus one put of a key with the lease, against plain
//! puts of the same keys without a lease in the same run.
//!
//! `cargo bench -p keel-benches --bench lease` (a few minutes); `-- --test` is the smoke run
//! (10 000 leases instead of 1 000 000).

use std::hint::black_box;
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use keel_benches::{Better, Recorder};
use keel_lease::{LeaseTable, Lessor, LessorOptions, ManualClock};
use keel_mvcc::{Backend, Store, StoreOptions};
use rand::seq::SliceRandom;
use rand::{SeedableRng, rngs::StdRng};

static RECORDER: LazyLock<Recorder> = LazyLock::new(Recorder::new);

/// Number of leases in every workload.
fn lease_count() -> usize {
    if std::env::args().any(|a| a == "--test") {
        10_000
    } else {
        1_000_000
    }
}

fn key_of(id: i64) -> [u8; 24] {
    let mut key = *b"/registry/leases/0000000";
    key[17..].copy_from_slice(&format!("{:07}", id % 10_000_000).into_bytes());
    key
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// Resident set size of this process, from /proc/self/status (0 where unavailable).
fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

fn primary_table(options: LessorOptions) -> LeaseTable {
    let mut table = LeaseTable::new(options).expect("valid options");
    table.promote(Duration::ZERO);
    table
}

/// Grants `n` leases (ids 1..=n, TTL 1 h), attaching one 24-byte key to each if `keys`.
fn fill(table: &mut LeaseTable, n: usize, keys: bool) {
    for id in 1..=n as i64 {
        table.grant(id, 3_600, Duration::ZERO).expect("grant");
        if keys {
            table.attach(id, &key_of(id)).expect("attach");
        }
    }
}

/// Memory per lease, measured as the growth of the resident set and as the table's own
/// count of allocated bytes. Runs first, in a fresh process, so the RSS delta is the table's.
fn memory_report() {
    let n = lease_count();
    for keys in [false, true] {
        let before = rss_bytes();
        let mut table = primary_table(LessorOptions::default());
        fill(&mut table, n, keys);
        let after = rss_bytes();
        let usage = table.allocated_bytes();
        println!(
            "MEMORY lease table, {n} leases on a primary{}: {:.1} B/lease RSS growth; allocated: \
             {:.1} B/lease structure (slots, id index, expiry heap, checkpoint queue) + {:.1} B/lease keys",
            if keys {
                ", one 24-byte key attached to each"
            } else {
                ", no keys"
            },
            after.saturating_sub(before) as f64 / n as f64,
            usage.structure as f64 / n as f64,
            usage.keys as f64 / n as f64,
        );
        drop(black_box(table));
    }
}

fn grant_attach_table(c: &mut Criterion) {
    let n = lease_count();
    let mut group = c.benchmark_group("lease/grant_attach");
    group.sample_size(10);
    group.throughput(Throughput::Elements(n as u64));
    group.bench_function(BenchmarkId::new("table", n), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let mut table = primary_table(LessorOptions::default());
                let start = Instant::now();
                fill(&mut table, n, true);
                total += start.elapsed();
                drop(black_box(table));
            }
            RECORDER.record("grant+attach table", total, iters * n as u64);
            total
        });
    });
    group.finish();
    if let Some(per) = RECORDER.median("grant+attach table") {
        println!(
            "THROUGHPUT grant+attach, in-memory table, {n} leases: {:.0} leases/s ({:.3} us/lease)",
            1.0 / per,
            per * 1e6
        );
    }
}

/// Grant + put of a key with the lease through the lessor, against a plain put of the same
/// key without a lease, on a fresh store per sample.
fn grant_attach_store<B: Backend>(c: &mut Criterion, backend: &str, options: B::Options) {
    let mut group = c.benchmark_group(format!("lease/grant_attach_store/{backend}"));
    group.sample_size(10);
    group.throughput(Throughput::Elements(1));
    let open = |dir: &std::path::Path| {
        let backend = B::open(dir, &options).expect("open backend");
        Arc::new(Store::open(backend, StoreOptions::default()).expect("open store"))
    };
    let ours = format!("grant+attach lessor {backend}");
    let reference = format!("plain put {backend}");
    group.bench_function("lessor_grant_put", |b| {
        b.iter_custom(|iters| {
            let dir = tempfile::tempdir().expect("tempdir");
            let store = open(dir.path());
            let lessor = Lessor::open(
                store.clone(),
                Arc::new(ManualClock::new()),
                LessorOptions::default(),
            )
            .expect("open lessor");
            lessor.promote();
            let start = Instant::now();
            for id in 1..=iters as i64 {
                lessor.grant(id, 3_600, None).expect("grant");
                lessor.put(&key_of(id), b"value", id, None).expect("put");
            }
            store.force_commit().expect("commit");
            let elapsed = start.elapsed();
            RECORDER.record(&ours, elapsed, iters);
            elapsed
        });
    });
    group.bench_function("plain_put", |b| {
        b.iter_custom(|iters| {
            let dir = tempfile::tempdir().expect("tempdir");
            let store = open(dir.path());
            let start = Instant::now();
            for id in 1..=iters as i64 {
                store.put(&key_of(id), b"value", 0).expect("put");
            }
            store.force_commit().expect("commit");
            let elapsed = start.elapsed();
            RECORDER.record(&reference, elapsed, iters);
            elapsed
        });
    });
    group.finish();
    if let Some(per) = RECORDER.median(&ours) {
        println!(
            "THROUGHPUT grant+attach through the lessor on {backend}: {:.0} leases/s ({:.2} us/lease)",
            1.0 / per,
            per * 1e6
        );
    }
    RECORDER.ratio(
        &format!("grant+attach through the lessor vs a plain put, {backend}"),
        &ours,
        &reference,
        Better::LowerTime,
        None,
    );
}

fn grant_attach_stores(c: &mut Criterion) {
    #[cfg(feature = "backend-file")]
    grant_attach_store::<keel_backend_file::FileBackend>(c, "file", Default::default());
    #[cfg(all(feature = "backend-lmdb", not(feature = "backend-file")))]
    grant_attach_store::<keel_backend_lmdb::LmdbBackend>(c, "lmdb", Default::default());
    #[cfg(not(any(feature = "backend-file", feature = "backend-lmdb")))]
    let _ = c;
}

/// A primary table of `n` leases where exactly one lease expires per second, for ever: at
/// time `t` the deadlines are a permutation of `(t, t + n]` seconds.
struct ExpiryWorkload {
    table: LeaseTable,
    now: u64,
    next_id: i64,
    n: u64,
}

impl ExpiryWorkload {
    fn new(n: usize) -> ExpiryWorkload {
        // Handed-out leases are revoked only after a block of finds (see `find_expired`):
        // the retry interval outlasts a block so none is handed out twice.
        let mut table = primary_table(LessorOptions {
            promote_extension: Some(Duration::ZERO),
            expired_retry_interval: secs(200_000),
            ..LessorOptions::default()
        });
        let mut ttls: Vec<i64> = (1..=n as i64).collect();
        ttls.shuffle(&mut StdRng::seed_from_u64(42));
        for (i, ttl) in ttls.into_iter().enumerate() {
            table
                .grant(i as i64 + 1, ttl, Duration::ZERO)
                .expect("grant");
        }
        ExpiryWorkload {
            table,
            now: 0,
            next_id: n as i64 + 1,
            n: n as u64,
        }
    }

    /// Moves time forward by `k` seconds: `k` more leases are now expired.
    fn advance(&mut self, k: u64) {
        self.now += k;
    }

    /// Revokes `expired` (everything handed out since the last call) and grants as many new
    /// leases, keeping one deadline per second.
    fn replace(&mut self, expired: &[i64]) {
        let now = secs(self.now);
        for (j, &id) in expired.iter().enumerate() {
            self.table.remove(id).expect("expired lease exists");
            let ttl = (self.n - expired.len() as u64 + j as u64 + 1) as i64;
            self.table.grant(self.next_id, ttl, now).expect("grant");
            self.next_id += 1;
        }
    }

    /// The reference: a full scan of every lease for those whose deadline has passed.
    fn scan_expired(&self) -> Vec<i64> {
        let now = secs(self.now);
        self.table
            .iter()
            .filter(|l| l.expiry.is_some_and(|e| e <= now))
            .map(|l| l.id)
            .collect()
    }
}

fn find_expired(c: &mut Criterion) {
    const K: u64 = 1_000;
    /// Heap finds per full scan in one iteration.
    const FINDS: u64 = 10;
    let n = lease_count();
    let mut group = c.benchmark_group("lease/find_1000_expired");
    group.sample_size(30);
    let mut workload = ExpiryWorkload::new(n);
    // Each iteration runs both sides back to back on the same table (ten heap finds, then
    // one full scan), and each criterion sample records both sides' totals, so that load
    // from other processes on a shared machine weighs on both alike.
    group.bench_function(BenchmarkId::new("heap_and_full_scan", n), |b| {
        b.iter_custom(|iters| {
            let (mut heap, mut scan) = (Duration::ZERO, Duration::ZERO);
            for _ in 0..iters {
                let mut handed_out = Vec::with_capacity((FINDS * K) as usize);
                let start = Instant::now();
                for _ in 0..FINDS {
                    workload.advance(K);
                    let found = workload.table.expired(secs(workload.now));
                    assert_eq!(found.len() as u64, K);
                    handed_out.extend(found);
                }
                heap += start.elapsed();
                workload.replace(&handed_out);

                workload.advance(K);
                let start = Instant::now();
                let mut scanned = workload.scan_expired();
                scan += start.elapsed();
                assert_eq!(scanned.len() as u64, K);
                // The heap hands out exactly the leases the scan found.
                let mut from_heap = workload.table.expired(secs(workload.now));
                from_heap.sort_unstable();
                scanned.sort_unstable();
                assert_eq!(from_heap, scanned);
                workload.replace(&scanned);
            }
            RECORDER.record("expired heap", heap, iters * FINDS);
            RECORDER.record("expired scan", scan, iters);
            heap + scan
        });
    });
    group.finish();
    RECORDER.ratio(
        &format!("find {K} expired leases among {n}"),
        "expired heap",
        "expired scan",
        Better::Faster,
        Some(100.0),
    );
}

fn checkpoint_batches(c: &mut Criterion) {
    let n = lease_count();
    let options = LessorOptions::default();
    let interval = options.checkpoint_interval.as_secs();
    let batch = options.checkpoint_batch_limit;
    let mut table = primary_table(options);
    for id in 1..=n as i64 {
        table.grant(id, 100_000_000, Duration::ZERO).expect("grant");
    }
    let mut now = interval;
    let mut group = c.benchmark_group("lease/checkpoint_batch");
    group.throughput(Throughput::Elements(batch as u64));
    group.bench_function(BenchmarkId::new("1000_of", n), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut done = 0;
            while done < iters {
                let start = Instant::now();
                let cps = table.checkpoint_batch(secs(now));
                let elapsed = start.elapsed();
                if cps.is_empty() {
                    now += interval;
                    continue;
                }
                assert!(cps.len() <= batch);
                total += elapsed;
                done += 1;
                black_box(cps);
            }
            RECORDER.record("checkpoint batch", total, iters);
            total
        });
    });
    group.finish();
    if let Some(per) = RECORDER.median("checkpoint batch") {
        println!(
            "CHECKPOINT batch of {batch} among {n} leases: median {:.1} us per batch ({:.1} ns per lease)",
            per * 1e6,
            per * 1e9 / batch as f64
        );
    }
}

fn main() {
    memory_report();
    let mut c = Criterion::default().configure_from_args();
    grant_attach_table(&mut c);
    grant_attach_stores(&mut c);
    find_expired(&mut c);
    checkpoint_batches(&mut c);
    c.final_summary();
}
