//! Replicated-node benchmarks, each beside its reference in the same run:
//!
//! - put throughput of a 3-member in-process cluster (real WAL with fsync, real file backend,
//!   in-memory transport) with 1, 16 and 64 concurrent proposers, against a 1-member cluster
//!   at the same concurrency (goal at 64 proposers: ≥ 0.5× the 1-member rate);
//! - the 1-member rate against the WAL alone appending batches of the same size with one
//!   fsync per batch (reported);
//! - linearizable reads (ReadIndex) against serializable reads, 16 concurrent readers
//!   (reported).
//!
//! Run: `cargo bench -p keel-benches --bench raft`; smoke: `... -- --test`.

// criterion_group! generates an undocumented public function.
#![allow(missing_docs)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use keel_benches::{Better, Recorder};
use keel_mvcc::RangeRequest;
use keel_raft_glue::testing::{Cluster, fast_options};
use keel_raft_glue::{Node, NodeOptions, ReadConsistency};
use keel_wal::{Entry, Wal, WalOptions};

type B = keel_backend_file::FileBackend;

const VALUE: usize = 256;

fn options() -> NodeOptions {
    NodeOptions {
        request_timeout: Duration::from_secs(30),
        ..fast_options()
    }
}

fn wal_options() -> WalOptions {
    WalOptions {
        segment_size: 64 * 1024 * 1024,
        ..WalOptions::default()
    }
}

fn cluster(n: u64) -> Cluster<B> {
    let c =
        Cluster::<B>::with(n, options(), wal_options(), Default::default(), n).expect("cluster");
    c.wait_leader(Duration::from_secs(30)).expect("leader");
    c
}

/// Runs `total` puts spread over `workers` threads against `node`; returns the elapsed time.
fn put_burst(node: &Arc<Node<B>>, workers: u64, total: u64, counter: &AtomicU64) -> Duration {
    let value = vec![7u8; VALUE];
    let start = Instant::now();
    thread::scope(|s| {
        for w in 0..workers {
            let n = total / workers + u64::from(w < total % workers);
            let (node, value) = (node.clone(), &value);
            s.spawn(move || {
                for _ in 0..n {
                    let k = counter.fetch_add(1, Ordering::Relaxed);
                    node.put(format!("key-{:08}", k % 100_000).as_bytes(), value)
                        .expect("put");
                }
            });
        }
    });
    start.elapsed()
}

fn bench_puts(c: &mut Criterion, rec: &Recorder) {
    let one = cluster(1);
    let three = cluster(3);
    let leader1 = one
        .node(one.wait_leader(Duration::from_secs(30)).expect("leader"))
        .expect("runs");
    let leader3 = three
        .node(three.wait_leader(Duration::from_secs(30)).expect("leader"))
        .expect("runs");
    let counter = AtomicU64::new(0);
    let wal_dir = tempfile::tempdir().expect("tempdir");
    let wal = Wal::open(wal_dir.path(), wal_options()).expect("wal");
    let mut next_index = 1u64;
    let mut g = c.benchmark_group("raft-put");
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(4));
    g.warm_up_time(Duration::from_millis(500));
    for workers in [1u64, 16, 64] {
        let name1 = format!("1-member/{workers}");
        let name3 = format!("3-member/{workers}");
        let namew = format!("wal-batch/{workers}");
        g.bench_function(&name3, |b| {
            b.iter_custom(|iters| {
                let total = iters.max(workers);
                let t = put_burst(&leader3, workers, total, &counter);
                rec.record(&name3, t, total);
                t.mul_f64(iters as f64 / total as f64)
            })
        });
        g.bench_function(&name1, |b| {
            b.iter_custom(|iters| {
                let total = iters.max(workers);
                let t = put_burst(&leader1, workers, total, &counter);
                rec.record(&name1, t, total);
                t.mul_f64(iters as f64 / total as f64)
            })
        });
        // The WAL alone: batches of `workers` entries of the same size, one fsync each.
        g.bench_function(&namew, |b| {
            b.iter_custom(|iters| {
                let batches = iters.div_ceil(workers).max(1);
                let start = Instant::now();
                for _ in 0..batches {
                    let entries: Vec<Entry> = (0..workers)
                        .map(|i| Entry {
                            index: next_index + i,
                            term: 1,
                            data: vec![7u8; VALUE + 40],
                        })
                        .collect();
                    next_index += workers;
                    wal.append(&entries, None, true).expect("append");
                }
                let t = start.elapsed();
                rec.record(&namew, t, batches * workers);
                t.mul_f64(iters as f64 / (batches * workers) as f64)
            })
        });
        rec.ratio(
            &format!("3-member puts vs 1-member puts, {workers} proposers"),
            &name3,
            &name1,
            Better::Faster,
            (workers == 64).then_some(0.5),
        );
        rec.ratio(
            &format!("1-member puts vs WAL alone (batches of {workers}, fsync each)"),
            &name1,
            &namew,
            Better::Faster,
            None,
        );
    }
    g.finish();
}

fn read_burst(
    node: &Arc<Node<B>>,
    workers: u64,
    total: u64,
    consistency: ReadConsistency,
) -> Duration {
    let start = Instant::now();
    thread::scope(|s| {
        for w in 0..workers {
            let n = total / workers + u64::from(w < total % workers);
            let node = node.clone();
            s.spawn(move || {
                for i in 0..n {
                    let key = format!("key-{:08}", (i * 7919 + w) % 1000);
                    node.range(&RangeRequest::key(key.into_bytes()), consistency)
                        .expect("read");
                }
            });
        }
    });
    start.elapsed()
}

fn bench_reads(c: &mut Criterion, rec: &Recorder) {
    let three = cluster(3);
    let leader = three
        .node(three.wait_leader(Duration::from_secs(30)).expect("leader"))
        .expect("runs");
    let counter = AtomicU64::new(0);
    put_burst(&leader, 16, 1000, &counter);
    let mut g = c.benchmark_group("raft-read");
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(3));
    g.warm_up_time(Duration::from_millis(300));
    const READERS: u64 = 16;
    for (name, consistency) in [
        ("linearizable/16", ReadConsistency::Linearizable),
        ("serializable/16", ReadConsistency::Serializable),
    ] {
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let total = iters.max(READERS);
                let t = read_burst(&leader, READERS, total, consistency);
                rec.record(name, t, total);
                t.mul_f64(iters as f64 / total as f64)
            })
        });
    }
    rec.ratio(
        "linearizable reads vs serializable reads, 16 readers on the leader",
        "linearizable/16",
        "serializable/16",
        Better::Faster,
        None,
    );
    g.finish();
}

fn benches(c: &mut Criterion) {
    let rec = Recorder::new();
    bench_puts(c, &rec);
    bench_reads(c, &rec);
}

criterion_group!(raft, benches);
criterion_main!(raft);
