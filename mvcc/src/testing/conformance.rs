//! The backend conformance suite: every [`Backend`] runs the same tests.
//!
//! Each check is a generic function `fn check<B: Backend>(options: B::Options)` that opens
//! backends in fresh temporary directories and panics (with a message saying what broke) when
//! the backend breaks the contract written on [`Backend`] and [`ReadTxn`]. A backend crate runs
//! the whole suite with one line in its integration tests:
//!
//! ```ignore
//! keel_mvcc::backend_conformance_tests!(my_crate::MyBackend, my_crate::MyOptions::default());
//! ```
//!
//! which expands to a module `backend_conformance` holding one `#[test]` per check, each
//! calling the function of the same name here with a freshly evaluated options expression.
//!
//! What is pinned down:
//! - reads of an empty store; put/get/delete/delete_range and their order inside one batch;
//! - atomicity: a batch that fails on its last operation leaves nothing, now or after reopen;
//! - buckets: listing order, isolation between buckets with related names, a bucket whose
//!   last key is deleted disappears;
//! - range bounds (inclusive start, exclusive end, open end, empty and inverted ranges);
//! - read transactions: a fixed snapshot even while iterating across commits, usable from
//!   another thread, never blocking commits (bounded by a timeout rather than hanging), alive
//!   after the backend handle is dropped;
//! - durability across reopen, the exclusive lock (also while the process spawns children),
//!   size reporting, defragmentation that gives space back and keeps old readers' views;
//! - snapshot/restore: round trip, consistency while a writer commits, rejection of corrupted,
//!   truncated and extended streams, refusal to restore into a non-empty backend;
//! - large values and keys, empty batches, and a seeded random model test (set
//!   `KEEL_CONFORMANCE_SEED` to replay a failure; the seed is printed when it fails).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, mpsc};
use std::thread;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::backend::{Backend, BackendError, Bucket, ReadTxn, WriteBatch};
use crate::testing::ChunkCuts;

/// Expands to a module `backend_conformance` with one `#[test]` per conformance check.
///
/// `$backend` is the backend type and `$options` an expression of type
/// `<$backend as Backend>::Options`, evaluated afresh for every test.
#[macro_export]
macro_rules! backend_conformance_tests {
    ($backend:ty, $options:expr $(,)?) => {
        #[allow(unused_imports)]
        mod backend_conformance {
            use super::*;

            $crate::backend_conformance_tests!(@tests $backend, $options;
                open_empty,
                put_get_delete,
                empty_key_and_value,
                batch_applies_in_order,
                delete_range_bounds,
                failed_batch_is_atomic,
                commit_from_matches_commit,
                buckets_listed_and_isolated,
                range_bounds,
                read_txn_is_a_snapshot,
                read_txn_moves_across_threads,
                read_txn_outlives_backend,
                readers_never_block_commits,
                concurrent_readers_see_consistent_states,
                reopen_keeps_commits,
                second_open_is_locked,
                reopen_while_spawning_children,
                size_is_reported,
                defragment_gives_space_back,
                defragment_keeps_old_readers,
                snapshot_restore_round_trip,
                snapshot_during_writes_is_consistent,
                restore_rejects_damaged_streams,
                restore_into_non_empty_is_refused,
                restore_spanning_many_batches,
                restore_observed_shows_every_pair_once,
                restore_chunks_matches_restore,
                large_values,
                empty_batch,
                random_batches_match_model,
            );
        }
    };
    (@tests $backend:ty, $options:expr; $($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                $crate::testing::conformance::$name::<$backend>($options);
            }
        )*
    };
}

/// A backend open in its own temporary directory; the directory lives as long as this value.
struct Fixture<B> {
    backend: Option<B>,
    path: PathBuf,
    _dir: tempfile::TempDir,
}

impl<B: Backend> Fixture<B> {
    fn new(options: &B::Options) -> Fixture<B> {
        let dir = tempfile::tempdir().expect("create a temporary directory");
        let path = dir.path().join("store");
        let backend = B::open(&path, options)
            .unwrap_or_else(|e| panic!("open a fresh backend at {}: {e}", path.display()));
        Fixture {
            backend: Some(backend),
            path,
            _dir: dir,
        }
    }

    fn b(&self) -> &B {
        self.backend.as_ref().expect("backend is open")
    }

    fn reopen(&mut self, options: &B::Options) {
        drop(self.backend.take());
        self.backend = Some(
            B::open(&self.path, options)
                .unwrap_or_else(|e| panic!("reopen backend at {}: {e}", self.path.display())),
        );
    }
}

fn b(name: &'static str) -> Bucket {
    Bucket::new(name)
}

fn commit<B: Backend>(backend: &B, batch: &WriteBatch) {
    backend
        .commit(batch)
        .unwrap_or_else(|e| panic!("commit of {} ops failed: {e}", batch.len()));
}

fn get<T: ReadTxn>(txn: &T, bucket: &Bucket, key: &[u8]) -> Option<Vec<u8>> {
    txn.get(bucket, key)
        .unwrap_or_else(|e| panic!("get {bucket}/{key:?}: {e}"))
        .map(<[u8]>::to_vec)
}

fn range<T: ReadTxn>(
    txn: &T,
    bucket: &Bucket,
    start: &[u8],
    end: Option<&[u8]>,
) -> Vec<(Vec<u8>, Vec<u8>)> {
    txn.range(bucket, start, end)
        .unwrap_or_else(|e| panic!("range {bucket}[{start:?}, {end:?}): {e}"))
        .map(|item| {
            let (k, v) = item.unwrap_or_else(|e| panic!("range {bucket} item: {e}"));
            (k.to_vec(), v.to_vec())
        })
        .collect()
}

fn bucket_names<T: ReadTxn>(txn: &T) -> Vec<String> {
    txn.buckets()
        .unwrap_or_else(|e| panic!("list buckets: {e}"))
        .iter()
        .map(|b| b.name().to_owned())
        .collect()
}

/// Everything a read transaction sees: bucket name → key → value.
type Dump = BTreeMap<String, BTreeMap<Vec<u8>, Vec<u8>>>;

fn dump<T: ReadTxn>(txn: &T) -> Dump {
    let mut out = Dump::new();
    for bucket in txn
        .buckets()
        .unwrap_or_else(|e| panic!("list buckets: {e}"))
    {
        let pairs = range(txn, &bucket, &[], None);
        assert!(
            !pairs.is_empty(),
            "bucket {bucket} is listed by buckets() but holds no key"
        );
        for w in pairs.windows(2) {
            assert!(
                w[0].0 < w[1].0,
                "range of {bucket} is not strictly ascending: {:?} then {:?}",
                w[0].0,
                w[1].0
            );
        }
        out.insert(bucket.name().to_owned(), pairs.into_iter().collect());
    }
    out
}

fn dump_backend<B: Backend>(backend: &B) -> Dump {
    dump(&backend.read_txn().expect("open a read transaction"))
}

/// Every pair of `dump` as (bucket, key, value), in the order a snapshot stream holds them.
fn pairs_in_order(dump: &Dump) -> Vec<(String, Vec<u8>, Vec<u8>)> {
    dump.iter()
        .flat_map(|(bucket, pairs)| {
            pairs
                .iter()
                .map(move |(k, v)| (bucket.clone(), k.clone(), v.clone()))
        })
        .collect()
}

fn key(i: u32) -> Vec<u8> {
    format!("key-{i:06}").into_bytes()
}

/// Deterministic, incompressible-ish bytes.
fn filler(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..len).map(|_| rng.random::<u8>()).collect()
}

fn run_with_timeout<T: Send + 'static>(
    what: &str,
    timeout: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = mpsc::channel();
    let handle = thread::spawn(move || {
        let out = f();
        let _ = tx.send(());
        out
    });
    match rx.recv_timeout(timeout) {
        Ok(()) => handle.join().unwrap_or_else(|_| panic!("{what} panicked")),
        Err(mpsc::RecvTimeoutError::Disconnected) => match handle.join() {
            Ok(out) => out,
            Err(payload) => std::panic::resume_unwind(payload),
        },
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what} did not finish within {timeout:?}: it is blocked")
        }
    }
}

/// A fresh store reads as empty and reports a sane size.
pub fn open_empty<B: Backend>(options: B::Options) {
    let f = Fixture::<B>::new(&options);
    let txn = f.b().read_txn().expect("read txn on an empty store");
    assert!(bucket_names(&txn).is_empty(), "a fresh store lists buckets");
    assert_eq!(
        get(&txn, &b("key"), b"a"),
        None,
        "a fresh store returns a value"
    );
    assert!(
        range(&txn, &b("key"), b"", None).is_empty(),
        "a fresh store yields pairs"
    );
    let size = f.b().size().expect("size of an empty store");
    assert!(
        size.in_use <= size.on_disk,
        "in_use {} exceeds on_disk {}",
        size.in_use,
        size.on_disk
    );
    drop(txn);
    let mut f = f;
    f.reopen(&options);
    assert!(
        dump_backend(f.b()).is_empty(),
        "reopened empty store is not empty"
    );
}

/// Put, overwrite, delete and the absence of side effects on neighbouring keys.
pub fn put_get_delete<B: Backend>(options: B::Options) {
    let f = Fixture::<B>::new(&options);
    let kv = b("kv");
    let mut batch = WriteBatch::new();
    batch.put(&kv, "a", "1");
    batch.put(&kv, "b", "2");
    batch.put(&kv, "c", "3");
    commit(f.b(), &batch);
    let txn = f.b().read_txn().unwrap();
    assert_eq!(get(&txn, &kv, b"a").as_deref(), Some(&b"1"[..]));
    assert_eq!(get(&txn, &kv, b"b").as_deref(), Some(&b"2"[..]));
    assert_eq!(
        get(&txn, &kv, b"ab"),
        None,
        "a key never written is present"
    );
    drop(txn);

    let mut batch = WriteBatch::new();
    batch.put(&kv, "b", "two");
    batch.delete(&kv, "c");
    batch.delete(&kv, "never-written");
    commit(f.b(), &batch);
    let txn = f.b().read_txn().unwrap();
    assert_eq!(get(&txn, &kv, b"a").as_deref(), Some(&b"1"[..]));
    assert_eq!(
        get(&txn, &kv, b"b").as_deref(),
        Some(&b"two"[..]),
        "overwrite lost"
    );
    assert_eq!(get(&txn, &kv, b"c"), None, "deleted key still present");
    assert_eq!(
        range(&txn, &kv, b"", None),
        vec![
            (b"a".to_vec(), b"1".to_vec()),
            (b"b".to_vec(), b"two".to_vec())
        ]
    );
}

/// The empty key and the empty value are ordinary bytes.
pub fn empty_key_and_value<B: Backend>(options: B::Options) {
    let mut f = Fixture::<B>::new(&options);
    let kv = b("kv");
    let mut batch = WriteBatch::new();
    batch.put(&kv, "", "empty key");
    batch.put(&kv, "k", "");
    commit(f.b(), &batch);
    for round in 0..2 {
        let txn = f.b().read_txn().unwrap();
        assert_eq!(
            get(&txn, &kv, b"").as_deref(),
            Some(&b"empty key"[..]),
            "round {round}"
        );
        assert_eq!(
            get(&txn, &kv, b"k").as_deref(),
            Some(&b""[..]),
            "empty value read as absent (round {round})"
        );
        assert_eq!(
            range(&txn, &kv, b"", None),
            vec![
                (b"".to_vec(), b"empty key".to_vec()),
                (b"k".to_vec(), b"".to_vec())
            ],
            "round {round}"
        );
        drop(txn);
        f.reopen(&options);
    }
    let mut batch = WriteBatch::new();
    batch.delete(&kv, "");
    commit(f.b(), &batch);
    let txn = f.b().read_txn().unwrap();
    assert_eq!(get(&txn, &kv, b""), None, "empty key not deleted");
    assert_eq!(get(&txn, &kv, b"k").as_deref(), Some(&b""[..]));
}

/// Operations inside one batch apply in order.
pub fn batch_applies_in_order<B: Backend>(options: B::Options) {
    let f = Fixture::<B>::new(&options);
    let kv = b("kv");
    let mut batch = WriteBatch::new();
    batch.put(&kv, "x", "1");
    batch.delete(&kv, "x");
    batch.put(&kv, "x", "2"); // put after delete: present
    batch.put(&kv, "y", "1");
    batch.delete(&kv, "y"); // delete after put: absent
    batch.put(&kv, "r1", "a");
    batch.put(&kv, "r2", "b");
    batch.delete_range(&kv, "r", Some(b"s".to_vec()));
    batch.put(&kv, "r3", "c"); // put after delete_range: present
    batch.put(&kv, "z", "1");
    batch.put(&kv, "z", "2"); // last put wins
    commit(f.b(), &batch);
    let txn = f.b().read_txn().unwrap();
    assert_eq!(
        dump(&txn).remove("kv").unwrap_or_default(),
        BTreeMap::from([
            (b"r3".to_vec(), b"c".to_vec()),
            (b"x".to_vec(), b"2".to_vec()),
            (b"z".to_vec(), b"2".to_vec()),
        ]),
        "batch operations did not apply in order"
    );
    drop(txn);

    // A delete_range in a later batch removes keys written by an earlier one, including
    // keys at the exact start bound, but not at the exact end bound.
    let mut batch = WriteBatch::new();
    batch.put(&kv, "r3", "c2");
    batch.delete_range(&kv, "r3", Some(b"z".to_vec()));
    commit(f.b(), &batch);
    let txn = f.b().read_txn().unwrap();
    assert_eq!(
        get(&txn, &kv, b"r3"),
        None,
        "delete_range kept its start key"
    );
    assert_eq!(get(&txn, &kv, b"x"), None);
    assert_eq!(
        get(&txn, &kv, b"z").as_deref(),
        Some(&b"2"[..]),
        "delete_range removed its end key"
    );
}

/// `delete_range` removes exactly `[start, end)` of one bucket.
pub fn delete_range_bounds<B: Backend>(options: B::Options) {
    let f = Fixture::<B>::new(&options);
    let (a, other) = (b("a"), b("a-other"));
    let mut batch = WriteBatch::new();
    for i in 0..20 {
        batch.put(&a, key(i), "v");
        batch.put(&other, key(i), "w");
    }
    commit(f.b(), &batch);
    let expect = |live: &[u32]| -> BTreeMap<Vec<u8>, Vec<u8>> {
        live.iter().map(|&i| (key(i), b"v".to_vec())).collect()
    };

    let mut batch = WriteBatch::new();
    batch.delete_range(&a, key(5), Some(key(10)));
    commit(f.b(), &batch);
    let live: Vec<u32> = (0..5).chain(10..20).collect();
    assert_eq!(dump_backend(f.b()).remove("a").unwrap(), expect(&live));

    // Inverted and empty ranges remove nothing.
    let mut batch = WriteBatch::new();
    batch.delete_range(&a, key(15), Some(key(12)));
    batch.delete_range(&a, key(3), Some(key(3)));
    commit(f.b(), &batch);
    assert_eq!(dump_backend(f.b()).remove("a").unwrap(), expect(&live));

    // Bounds that are not keys themselves.
    let mut batch = WriteBatch::new();
    batch.delete_range(&a, b"key-000001x".to_vec(), Some(b"key-000003x".to_vec()));
    commit(f.b(), &batch);
    let live: Vec<u32> = [0, 1, 4].into_iter().chain(10..20).collect();
    assert_eq!(dump_backend(f.b()).remove("a").unwrap(), expect(&live));

    // Open end: to the end of the bucket, not beyond it.
    let mut batch = WriteBatch::new();
    batch.delete_range(&a, key(12), None);
    commit(f.b(), &batch);
    let live: Vec<u32> = [0, 1, 4, 10, 11].into();
    let mut all = dump_backend(f.b());
    assert_eq!(all.remove("a").unwrap(), expect(&live));
    assert_eq!(
        all.remove("a-other").map(|m| m.len()),
        Some(20),
        "delete_range leaked into another bucket"
    );

    // Everything: the bucket disappears.
    let mut batch = WriteBatch::new();
    batch.delete_range(&a, Vec::new(), None);
    commit(f.b(), &batch);
    let txn = f.b().read_txn().unwrap();
    assert_eq!(bucket_names(&txn), vec!["a-other".to_owned()]);
    assert!(range(&txn, &a, b"", None).is_empty());
}

/// A batch committed through `commit_from` (the caller's buffers) lands exactly as the same
/// `WriteBatch` through `commit`, and a failing one (invalid bucket at its end) changes nothing.
pub fn commit_from_matches_commit<B: Backend>(options: B::Options) {
    use crate::backend::{BatchOpRef, BatchSource};

    /// A source over plain tuples, as a store's own buffers would be.
    struct Ops(Vec<(Bucket, Vec<u8>, Option<Vec<u8>>)>);
    impl BatchSource for Ops {
        fn for_each_op(
            &self,
            sink: &mut dyn FnMut(BatchOpRef<'_>) -> Result<(), BackendError>,
        ) -> Result<(), BackendError> {
            for (bucket, key, value) in &self.0 {
                sink(match value {
                    Some(value) => BatchOpRef::Put { bucket, key, value },
                    None => BatchOpRef::Delete { bucket, key },
                })?;
            }
            Ok(())
        }
        fn op_count(&self) -> usize {
            self.0.len()
        }
    }

    let via_batch = Fixture::<B>::new(&options);
    let via_source = Fixture::<B>::new(&options);
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for round in 0..20 {
        let mut ops = Vec::new();
        let mut batch = WriteBatch::new();
        for _ in 0..rng.random_range(1..60) {
            let bucket = b(["kv", "meta", "lease"][rng.random_range(0..3)]);
            let k = key(rng.random_range(0..40));
            if rng.random_bool(0.7) {
                let v = filler(rng.random(), rng.random_range(0..300));
                batch.put(&bucket, k.clone(), v.clone());
                ops.push((bucket, k, Some(v)));
            } else {
                batch.delete(&bucket, k.clone());
                ops.push((bucket, k, None));
            }
        }
        commit(via_batch.b(), &batch);
        via_source
            .b()
            .commit_from(&Ops(ops))
            .unwrap_or_else(|e| panic!("round {round} (seed {seed}): commit_from failed: {e}"));
        assert_eq!(
            dump_backend(via_source.b()),
            dump_backend(via_batch.b()),
            "round {round} (seed {seed}): commit_from and commit disagree"
        );
    }
    let before = dump_backend(via_source.b());
    let failing = Ops(vec![
        (b("kv"), b"new".to_vec(), Some(b"1".to_vec())),
        (b("kv"), key(1), None),
        (Bucket::new("bad name"), b"k".to_vec(), Some(b"v".to_vec())),
    ]);
    match via_source.b().commit_from(&failing) {
        Err(BackendError::InvalidBucket { .. }) => {}
        other => panic!("commit_from with an invalid bucket returned {other:?}"),
    }
    assert_eq!(
        dump_backend(via_source.b()),
        before,
        "a failed commit_from left changes behind"
    );
}

/// A batch that fails on its last operation changes nothing, now or after reopen.
pub fn failed_batch_is_atomic<B: Backend>(options: B::Options) {
    let mut f = Fixture::<B>::new(&options);
    let kv = b("kv");
    let mut batch = WriteBatch::new();
    batch.put(&kv, "keep", "old");
    batch.put(&kv, "gone", "old");
    commit(f.b(), &batch);
    let before = dump_backend(f.b());

    let long: &'static str = Box::leak(
        "x".repeat(crate::backend::MAX_BUCKET_NAME + 1)
            .into_boxed_str(),
    );
    let invalid = ["", "has space", "slash/", "dot.", long, "é"];
    for name in invalid {
        let mut batch = WriteBatch::new();
        batch.put(&kv, "keep", "new");
        batch.delete(&kv, "gone");
        batch.delete_range(&kv, "a", None);
        batch.put(&b("fresh"), "k", "v");
        batch.put(&Bucket::new(name), "k", "v");
        match f.b().commit(&batch) {
            Err(BackendError::InvalidBucket { name: got }) => {
                assert_eq!(got, name, "InvalidBucket names the wrong bucket")
            }
            other => panic!("a batch with bucket {name:?} returned {other:?}"),
        }
        assert_eq!(
            dump_backend(f.b()),
            before,
            "a failed batch (bucket {name:?}) left changes behind"
        );
    }
    // The longest valid name is accepted.
    let longest = "b".repeat(crate::backend::MAX_BUCKET_NAME);
    let mut batch = WriteBatch::new();
    batch.put(&Bucket::from_name(longest.clone()).unwrap(), "k", "v");
    commit(f.b(), &batch);
    f.reopen(&options);
    let mut after = dump_backend(f.b());
    assert_eq!(
        after.remove(&longest).map(|m| m.len()),
        Some(1),
        "a {}-byte bucket name was not stored",
        crate::backend::MAX_BUCKET_NAME
    );
    assert_eq!(after, before, "a failed batch reappeared after reopen");
}

/// Buckets are listed in name order, are independent, and vanish when emptied.
pub fn buckets_listed_and_isolated<B: Backend>(options: B::Options) {
    let mut f = Fixture::<B>::new(&options);
    // Names chosen so that one is a prefix of another and '-' / '_' sort around letters.
    let names = ["a", "a-b", "a_b", "ab", "aa", "b", "B", "0", "z9"];
    let mut batch = WriteBatch::new();
    for name in names {
        let bucket = Bucket::from_name(name.to_owned()).unwrap();
        batch.put(&bucket, "same", format!("value of {name}"));
        batch.put(&bucket, name, "own");
        batch.put(&bucket, "", "empty");
    }
    commit(f.b(), &batch);
    let mut sorted: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    sorted.sort();
    for round in 0..2 {
        let txn = f.b().read_txn().unwrap();
        assert_eq!(bucket_names(&txn), sorted, "round {round}");
        for name in names {
            let bucket = Bucket::from_name(name.to_owned()).unwrap();
            assert_eq!(
                get(&txn, &bucket, b"same"),
                Some(format!("value of {name}").into_bytes()),
                "bucket {name} sees another bucket's value (round {round})"
            );
            let pairs = range(&txn, &bucket, b"", None);
            let mut expected = vec![
                (b"".to_vec(), b"empty".to_vec()),
                (name.as_bytes().to_vec(), b"own".to_vec()),
                (b"same".to_vec(), format!("value of {name}").into_bytes()),
            ];
            expected.sort();
            assert_eq!(pairs, expected, "bucket {name} (round {round})");
        }
        assert!(
            range(&txn, &b("a-c"), b"", None).is_empty(),
            "a never-written bucket yields pairs"
        );
        drop(txn);
        f.reopen(&options);
    }

    // Emptying one bucket removes it from the list and nothing else.
    let mut batch = WriteBatch::new();
    let ab = b("a-b");
    batch.delete(&ab, "same");
    batch.delete(&ab, "a-b");
    batch.delete(&ab, "");
    commit(f.b(), &batch);
    let txn = f.b().read_txn().unwrap();
    let left: Vec<String> = sorted.iter().filter(|n| *n != "a-b").cloned().collect();
    assert_eq!(
        bucket_names(&txn),
        left,
        "an emptied bucket is still listed"
    );
    assert_eq!(range(&txn, &b("a"), b"", None).len(), 3);
    assert_eq!(range(&txn, &b("ab"), b"", None).len(), 3);
    drop(txn);

    // Many buckets.
    let mut batch = WriteBatch::new();
    for i in 0..100 {
        batch.put(
            &Bucket::from_name(format!("many-{i:03}")).unwrap(),
            "k",
            i.to_string(),
        );
    }
    commit(f.b(), &batch);
    let txn = f.b().read_txn().unwrap();
    let listed = bucket_names(&txn);
    assert_eq!(listed.len(), left.len() + 100);
    for i in 0..100 {
        let bucket = Bucket::from_name(format!("many-{i:03}")).unwrap();
        assert_eq!(get(&txn, &bucket, b"k"), Some(i.to_string().into_bytes()));
    }
}

/// `range` honours `[start, end)` exactly, with binary keys, against a `BTreeMap` model.
pub fn range_bounds<B: Backend>(options: B::Options) {
    let f = Fixture::<B>::new(&options);
    let kv = b("kv");
    let keys: Vec<Vec<u8>> = vec![
        vec![],
        vec![0x00],
        vec![0x00, 0x00],
        vec![0x00, 0xFF],
        vec![0x01],
        b"a".to_vec(),
        b"a\x00".to_vec(),
        b"ab".to_vec(),
        b"b".to_vec(),
        vec![0x7F],
        vec![0x80],
        vec![0xFE, 0xFF],
        vec![0xFF],
        vec![0xFF, 0x00],
        vec![0xFF, 0xFF, 0xFF],
    ];
    let mut model = BTreeMap::new();
    let mut batch = WriteBatch::new();
    for (i, k) in keys.iter().enumerate() {
        let v = format!("v{i}").into_bytes();
        batch.put(&kv, k.clone(), v.clone());
        model.insert(k.clone(), v);
    }
    // A neighbouring bucket whose keys must never show up.
    batch.put(&b("kv0"), vec![0x00], "x");
    batch.put(&b("kw"), vec![], "x");
    batch.put(&b("k"), vec![0xFF], "x");
    commit(f.b(), &batch);

    let mut bounds: Vec<Vec<u8>> = keys.clone();
    bounds.extend([
        vec![0x00, 0x00, 0x00],
        b"aa".to_vec(),
        b"c".to_vec(),
        vec![0xFF, 0xFF],
        vec![0xFF, 0xFF, 0xFF, 0xFF],
    ]);
    let txn = f.b().read_txn().unwrap();
    for start in &bounds {
        let expected: Vec<_> = model
            .range(start.clone()..)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        assert_eq!(
            range(&txn, &kv, start, None),
            expected,
            "range [{start:?}, ..)"
        );
        for end in &bounds {
            let expected: Vec<_> = if start < end {
                model
                    .range(start.clone()..end.clone())
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect()
            } else {
                Vec::new()
            };
            assert_eq!(
                range(&txn, &kv, start, Some(end)),
                expected,
                "range [{start:?}, {end:?})"
            );
        }
    }
    // A partially consumed iterator followed by a fresh one: iterators are independent.
    let mut it = txn.range(&kv, b"a", None).unwrap();
    let first = it.next().unwrap().unwrap().0.to_vec();
    let again = range(&txn, &kv, b"a", Some(b"b"));
    assert_eq!(first, b"a".to_vec());
    assert_eq!(again.len(), 3);
    let second = it.next().unwrap().unwrap().0.to_vec();
    assert_eq!(second, b"a\x00".to_vec());
}

/// A read transaction sees the store as of its opening, for its whole life.
pub fn read_txn_is_a_snapshot<B: Backend>(options: B::Options) {
    let f = Fixture::<B>::new(&options);
    let kv = b("kv");
    let mut batch = WriteBatch::new();
    for i in 0..100 {
        batch.put(&kv, key(i), "old");
    }
    commit(f.b(), &batch);
    let old = f.b().read_txn().unwrap();
    let old_dump = dump(&old);

    // Start iterating, then commit between steps of the iteration.
    let mut it = old.range(&kv, b"", None).unwrap();
    let mut seen = Vec::new();
    for step in 0..100u32 {
        let (k, v) = it.next().expect("iterator ended early").unwrap();
        assert_eq!(v, b"old", "old snapshot saw a new value at step {step}");
        seen.push(k.to_vec());
        let mut batch = WriteBatch::new();
        batch.put(&kv, key(step), "new");
        batch.put(&kv, key(99 - step), "new");
        batch.delete(&kv, key((step + 50) % 100));
        batch.put(&kv, format!("key-{step:06}-inserted"), "new");
        batch.put(&b("later"), key(step), "new");
        commit(f.b(), &batch);
    }
    assert!(it.next().is_none(), "old snapshot saw inserted keys");
    assert_eq!(seen, (0..100).map(key).collect::<Vec<_>>());

    assert_eq!(dump(&old), old_dump, "old snapshot changed");
    assert_eq!(bucket_names(&old), vec!["kv".to_owned()]);
    assert_eq!(get(&old, &b("later"), &key(3)), None);

    let new = f.b().read_txn().unwrap();
    assert_eq!(
        bucket_names(&new),
        vec!["kv".to_owned(), "later".to_owned()]
    );
    assert_eq!(get(&new, &kv, &key(0)).as_deref(), Some(&b"new"[..]));
    assert_eq!(
        get(&new, &kv, b"key-000007-inserted").as_deref(),
        Some(&b"new"[..])
    );
    assert_eq!(
        get(&new, &b("later"), &key(99)).as_deref(),
        Some(&b"new"[..])
    );
    // Still unchanged after the newer one opened.
    assert_eq!(dump(&old), old_dump, "old snapshot changed");
}

/// A read transaction can be opened on one thread and used (and dropped) on another.
pub fn read_txn_moves_across_threads<B: Backend>(options: B::Options) {
    let f = Fixture::<B>::new(&options);
    let kv = b("kv");
    let mut batch = WriteBatch::new();
    batch.put(&kv, "k", "v1");
    commit(f.b(), &batch);
    let txn = f.b().read_txn().unwrap();
    let mut batch = WriteBatch::new();
    batch.put(&kv, "k", "v2");
    commit(f.b(), &batch);

    let seen = thread::spawn(move || {
        let v = get(&txn, &Bucket::new("kv"), b"k");
        let n = range(&txn, &Bucket::new("kv"), b"", None).len();
        (v, n, txn)
    })
    .join()
    .expect("reader thread panicked");
    assert_eq!(seen.0.as_deref(), Some(&b"v1"[..]));
    assert_eq!(seen.1, 1);
    // Back on this thread, then dropped on a third one.
    let txn = seen.2;
    assert_eq!(get(&txn, &kv, b"k").as_deref(), Some(&b"v1"[..]));
    thread::spawn(move || drop(txn)).join().unwrap();

    // Many threads each opening, reading and dropping their own transactions.
    let backend = Arc::new(f.backend.expect("backend"));
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let backend = Arc::clone(&backend);
            thread::spawn(move || {
                for _ in 0..50 {
                    let txn = backend.read_txn().unwrap();
                    assert_eq!(
                        get(&txn, &Bucket::new("kv"), b"k").as_deref(),
                        Some(&b"v2"[..])
                    );
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("reader thread panicked");
    }
}

/// A read transaction keeps working after the backend handle is dropped.
pub fn read_txn_outlives_backend<B: Backend>(options: B::Options) {
    let mut f = Fixture::<B>::new(&options);
    let kv = b("kv");
    let mut batch = WriteBatch::new();
    for i in 0..100 {
        batch.put(&kv, key(i), filler(i as u64, 100));
    }
    commit(f.b(), &batch);
    let txn = f.b().read_txn().unwrap();
    let expected = dump(&txn);
    drop(f.backend.take());
    assert_eq!(
        dump(&txn),
        expected,
        "a read txn changed when its backend was dropped"
    );
    drop(txn);
    f.reopen(&options);
    assert_eq!(dump_backend(f.b()), expected);
}

/// Held read transactions (on this and other threads) never make a commit wait.
pub fn readers_never_block_commits<B: Backend>(options: B::Options) {
    let f = Fixture::<B>::new(&options);
    let kv = b("kv");
    let mut batch = WriteBatch::new();
    for i in 0..1000 {
        batch.put(&kv, key(i), "v0");
    }
    commit(f.b(), &batch);
    let backend = Arc::new(f.backend.expect("backend"));

    // A reader on another thread opens a transaction, starts iterating, and holds it.
    let (opened_tx, opened_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let reader = {
        let backend = Arc::clone(&backend);
        thread::spawn(move || {
            let kv = Bucket::new("kv");
            let txn = backend.read_txn().unwrap();
            let mut it = txn.range(&kv, b"", None).unwrap();
            let first = it.next().unwrap().unwrap().1.to_vec();
            opened_tx.send(()).unwrap();
            release_rx
                .recv_timeout(Duration::from_secs(120))
                .expect("release signal");
            let rest: Vec<Vec<u8>> = it.map(|item| item.unwrap().1.to_vec()).collect();
            (first, rest)
        })
    };
    opened_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("reader opened its transaction");
    // One more held on this very thread.
    let local = backend.read_txn().unwrap();

    let writer = Arc::clone(&backend);
    let commits = run_with_timeout("100 commits with readers held", Duration::from_secs(60), {
        move || {
            let kv = Bucket::new("kv");
            for round in 1..=100u32 {
                let mut batch = WriteBatch::new();
                for i in (0..1000).step_by(10) {
                    batch.put(&kv, key(i + round % 10), format!("v{round}"));
                }
                writer.commit(&batch).unwrap();
            }
            100
        }
    });
    assert_eq!(commits, 100);
    let latest = backend.read_txn().unwrap();
    assert_eq!(
        get(&latest, &kv, &key(0)).as_deref(),
        Some(&b"v100"[..]),
        "the commits are not visible to a new reader"
    );
    assert_eq!(get(&local, &kv, &key(0)).as_deref(), Some(&b"v0"[..]));
    release_tx.send(()).unwrap();
    let (first, rest) = reader.join().expect("reader thread panicked");
    assert_eq!(first, b"v0");
    assert_eq!(rest.len(), 999);
    assert!(
        rest.iter().all(|v| v == b"v0"),
        "a held reader saw later commits"
    );
}

/// Readers on several threads always see a state some commit left — never a torn batch —
/// while a writer commits and, twice, defragments.
pub fn concurrent_readers_see_consistent_states<B: Backend>(options: B::Options) {
    const ACCOUNTS: u32 = 50;
    const TOTAL: u64 = ACCOUNTS as u64 * 100;
    let f = Fixture::<B>::new(&options);
    let (left, right) = (b("left"), b("right"));
    let mut batch = WriteBatch::new();
    for i in 0..ACCOUNTS {
        batch.put(&left, key(i), 100u64.to_be_bytes());
    }
    batch.put(&right, "epoch", 0u64.to_be_bytes());
    commit(f.b(), &batch);
    let backend = Arc::new(f.backend.expect("backend"));
    let stop = Arc::new(AtomicBool::new(false));
    let read = |v: &[u8]| u64::from_be_bytes(v.try_into().expect("8-byte value"));

    let readers: Vec<_> = (0..3)
        .map(|_| {
            let (backend, stop) = (Arc::clone(&backend), Arc::clone(&stop));
            thread::spawn(move || {
                let (left, right) = (Bucket::new("left"), Bucket::new("right"));
                let mut checks = 0u64;
                let mut last_epoch = 0;
                while !stop.load(Ordering::Relaxed) || checks == 0 {
                    let txn = backend.read_txn().unwrap();
                    let mut sum = 0;
                    let mut count = 0;
                    for item in txn.range(&left, b"", None).unwrap() {
                        sum += read(item.unwrap().1);
                        count += 1;
                    }
                    let moved: u64 = txn
                        .range(&right, b"acct", Some(b"acct\xFF"))
                        .unwrap()
                        .map(|item| read(item.unwrap().1))
                        .sum();
                    let epoch = read(txn.get(&right, b"epoch").unwrap().unwrap());
                    assert_eq!(count, ACCOUNTS, "an account vanished");
                    assert_eq!(
                        sum + moved,
                        TOTAL,
                        "a reader saw half a transfer at epoch {epoch}"
                    );
                    assert!(
                        epoch >= last_epoch,
                        "a later read transaction saw an older commit: epoch {epoch} after \
                         {last_epoch}"
                    );
                    last_epoch = epoch;
                    checks += 1;
                }
                checks
            })
        })
        .collect();

    let mut rng = StdRng::seed_from_u64(7);
    let mut balances = vec![100u64; ACCOUNTS as usize];
    let mut moved = BTreeMap::<u32, u64>::new();
    for epoch in 1..=300u64 {
        let i = rng.random_range(0..ACCOUNTS);
        let amount = rng.random_range(0..=balances[i as usize]);
        balances[i as usize] -= amount;
        *moved.entry(i).or_default() += amount;
        let mut batch = WriteBatch::new();
        batch.put(&left, key(i), balances[i as usize].to_be_bytes());
        batch.put(
            &right,
            format!("acct{i:04}"),
            moved[&i].to_be_bytes().to_vec(),
        );
        batch.put(&right, "epoch", epoch.to_be_bytes());
        backend.commit(&batch).unwrap();
        if epoch % 100 == 50 {
            // Readers keep opening transactions while the store is rewritten under them.
            backend.defragment().unwrap();
        }
    }
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        let checks = r.join().expect("reader thread panicked");
        assert!(checks > 0);
    }
}

/// Every committed batch survives a close and reopen; reopening twice changes nothing.
pub fn reopen_keeps_commits<B: Backend>(options: B::Options) {
    let mut f = Fixture::<B>::new(&options);
    let mut model = Dump::new();
    for round in 0..5u32 {
        let mut batch = WriteBatch::new();
        for i in 0..200u32 {
            let bucket = if i.is_multiple_of(3) {
                b("meta")
            } else {
                b("key")
            };
            let v = filler((round * 1000 + i) as u64, (i as usize * 7) % 300);
            batch.put(&bucket, key(i + round * 100), v.clone());
            model
                .entry(bucket.name().to_owned())
                .or_default()
                .insert(key(i + round * 100), v);
        }
        batch.delete(&b("key"), key(round * 50 + 1));
        if let Some(m) = model.get_mut("key") {
            m.remove(&key(round * 50 + 1));
        }
        commit(f.b(), &batch);
        f.reopen(&options);
        assert_eq!(dump_backend(f.b()), model, "after reopen in round {round}");
    }
    f.reopen(&options);
    assert_eq!(dump_backend(f.b()), model, "after a second reopen");
}

/// A second open of the same path fails with `Locked` until the first handle is dropped.
pub fn second_open_is_locked<B: Backend>(options: B::Options) {
    let mut f = Fixture::<B>::new(&options);
    let mut batch = WriteBatch::new();
    batch.put(&b("kv"), "k", "v");
    commit(f.b(), &batch);
    match B::open(&f.path, &options) {
        Err(BackendError::Locked { path }) => assert!(
            path_matches(&path, &f.path),
            "Locked names {} instead of {}",
            path.display(),
            f.path.display()
        ),
        Err(other) => panic!("second open failed with {other:?} instead of Locked"),
        Ok(_) => panic!("a second open of a locked store succeeded"),
    }
    // From another thread as well.
    let path = f.path.clone();
    let opts = options.clone();
    let second = thread::spawn(move || B::open(&path, &opts).err())
        .join()
        .unwrap();
    assert!(
        matches!(second, Some(BackendError::Locked { .. })),
        "second open from another thread returned {second:?}"
    );
    // The first handle still works, and a reopen after dropping it succeeds.
    assert_eq!(
        get(&f.b().read_txn().unwrap(), &b("kv"), b"k").as_deref(),
        Some(&b"v"[..])
    );
    f.reopen(&options);
    assert_eq!(
        get(&f.b().read_txn().unwrap(), &b("kv"), b"k").as_deref(),
        Some(&b"v"[..])
    );
}

/// Dropping a handle and reopening succeeds even while another thread spawns child
/// processes (a child between fork and exec holds a copy of every descriptor, lock files
/// included, for a moment).
pub fn reopen_while_spawning_children<B: Backend>(options: B::Options) {
    let mut f = Fixture::<B>::new(&options);
    let mut batch = WriteBatch::new();
    batch.put(&b("kv"), "k", "v");
    commit(f.b(), &batch);
    let stop = Arc::new(AtomicBool::new(false));
    let spawned = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let spawner = {
        let (stop, spawned) = (Arc::clone(&stop), Arc::clone(&spawned));
        thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if std::process::Command::new("true").status().is_ok() {
                    spawned.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
    };
    // At least 100 reopens, and enough for several children to be spawned meanwhile.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut round = 0u32;
    while round < 100
        || (spawned.load(Ordering::Relaxed) < 5 && std::time::Instant::now() < deadline)
    {
        drop(f.backend.take());
        match B::open(&f.path, &options) {
            Ok(backend) => f.backend = Some(backend),
            Err(e) => {
                stop.store(true, Ordering::Relaxed);
                panic!("reopen {round} while another thread spawns children failed: {e}");
            }
        }
        round += 1;
    }
    stop.store(true, Ordering::Relaxed);
    spawner.join().expect("spawner thread panicked");
    assert!(
        spawned.load(Ordering::Relaxed) >= 5,
        "fewer than 5 child processes were spawned in 20 s"
    );
    assert_eq!(
        get(&f.b().read_txn().unwrap(), &b("kv"), b"k").as_deref(),
        Some(&b"v"[..])
    );
}

fn path_matches(reported: &Path, opened: &Path) -> bool {
    reported == opened
        || reported.starts_with(opened)
        || reported.canonicalize().ok() == opened.canonicalize().ok()
}

/// `size` grows with data, and `in_use` never exceeds `on_disk` and drops after deletes.
pub fn size_is_reported<B: Backend>(options: B::Options) {
    let f = Fixture::<B>::new(&options);
    let empty = f.b().size().unwrap();
    let kv = b("kv");
    let mut batch = WriteBatch::new();
    for i in 0..2000 {
        batch.put(&kv, key(i), filler(i as u64, 2048));
    }
    commit(f.b(), &batch);
    let full = f.b().size().unwrap();
    let payload = 2000 * 2048u64;
    assert!(
        full.on_disk >= payload && full.in_use >= payload,
        "size {full:?} is below the {payload} bytes of payload"
    );
    assert!(
        full.in_use <= full.on_disk,
        "in_use exceeds on_disk: {full:?}"
    );
    assert!(
        full.on_disk > empty.on_disk,
        "on_disk did not grow: {empty:?} -> {full:?}"
    );

    let mut batch = WriteBatch::new();
    batch.delete_range(&kv, key(100), None);
    commit(f.b(), &batch);
    // Some backends reclaim lazily; a few more small commits let them catch up.
    for i in 0..3 {
        let mut batch = WriteBatch::new();
        batch.put(&b("tick"), "t", vec![i]);
        commit(f.b(), &batch);
    }
    let after = f.b().size().unwrap();
    assert!(
        after.in_use <= after.on_disk,
        "in_use exceeds on_disk: {after:?}"
    );
    assert!(
        after.in_use < full.in_use / 2,
        "in_use did not drop after deleting 95% of the data: {full:?} -> {after:?}"
    );
}

fn fill_then_delete_most<B: Backend>(backend: &B) -> Dump {
    let kv = b("kv");
    for chunk in 0..4u32 {
        let mut batch = WriteBatch::new();
        for i in chunk * 500..(chunk + 1) * 500 {
            batch.put(&kv, key(i), filler(i as u64, 4096));
        }
        commit(backend, &batch);
    }
    let mut batch = WriteBatch::new();
    batch.delete_range(&kv, key(100), None);
    batch.put(&b("meta"), "consistent_index", 42u64.to_be_bytes());
    commit(backend, &batch);
    dump_backend(backend)
}

/// Defragmenting after deleting most data shrinks the store on disk and keeps its content.
pub fn defragment_gives_space_back<B: Backend>(options: B::Options) {
    let mut f = Fixture::<B>::new(&options);
    let expected = fill_then_delete_most(f.b());
    let before = f.b().size().unwrap();
    f.b().defragment().expect("defragment");
    let after = f.b().size().unwrap();
    assert!(
        after.on_disk < before.on_disk / 2,
        "defragment did not give space back: {before:?} -> {after:?}"
    );
    assert!(
        after.in_use <= after.on_disk,
        "in_use exceeds on_disk: {after:?}"
    );
    assert_eq!(
        dump_backend(f.b()),
        expected,
        "defragment changed the content"
    );

    // The store keeps working: commit, read, defragment again, reopen.
    let mut batch = WriteBatch::new();
    batch.put(&b("kv"), key(5000), "after");
    commit(f.b(), &batch);
    f.b().defragment().expect("second defragment");
    f.reopen(&options);
    let mut got = dump_backend(f.b());
    assert_eq!(
        got.get_mut("kv").and_then(|m| m.remove(&key(5000))),
        Some(b"after".to_vec())
    );
    assert_eq!(
        got, expected,
        "content changed across defragment and reopen"
    );
    let reopened = f.b().size().unwrap();
    assert!(
        reopened.on_disk < before.on_disk / 2,
        "space came back after reopen: {before:?} -> {reopened:?}"
    );
}

/// Read transactions opened before a defragment keep their view, on any thread.
pub fn defragment_keeps_old_readers<B: Backend>(options: B::Options) {
    let f = Fixture::<B>::new(&options);
    let kv = b("kv");
    let mut batch = WriteBatch::new();
    for i in 0..1000 {
        batch.put(&kv, key(i), filler(i as u64, 1000));
    }
    commit(f.b(), &batch);
    let full_txn = f.b().read_txn().unwrap();
    let full = dump(&full_txn);
    let mut it = full_txn.range(&kv, b"", None).unwrap();
    let first = it.next().unwrap().unwrap().0.to_vec();

    let mut batch = WriteBatch::new();
    batch.delete_range(&kv, key(10), None);
    commit(f.b(), &batch);
    let small = dump_backend(f.b());
    let backend = Arc::new(f.backend.expect("backend"));
    let held_elsewhere = {
        let backend = Arc::clone(&backend);
        thread::spawn(move || backend.read_txn().unwrap())
            .join()
            .unwrap()
    };

    let defrag = Arc::clone(&backend);
    run_with_timeout(
        "defragment with readers held",
        Duration::from_secs(60),
        move || defrag.defragment().expect("defragment with readers held"),
    );
    let rest: Vec<Vec<u8>> = it.map(|item| item.unwrap().0.to_vec()).collect();
    assert_eq!(first, key(0));
    assert_eq!(rest.len(), 999, "an iterator lost keys across defragment");
    assert_eq!(dump(&full_txn), full, "an old reader's view changed");
    let moved = thread::spawn(move || dump(&held_elsewhere)).join().unwrap();
    assert_eq!(moved, small);

    let mut batch = WriteBatch::new();
    batch.put(&kv, key(0), "new");
    backend.commit(&batch).unwrap();
    assert_eq!(dump(&full_txn), full, "an old reader saw a later commit");
    drop(full_txn);
    let txn = backend.read_txn().unwrap();
    assert_eq!(get(&txn, &kv, &key(0)).as_deref(), Some(&b"new"[..]));
    assert_eq!(range(&txn, &kv, b"", None).len(), 10);
}

fn populate_varied<B: Backend>(backend: &B, seed: u64) -> u64 {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut pairs = 0;
    for round in 0..3 {
        let mut batch = WriteBatch::new();
        for bucket in ["key", "meta", "lease", "z-last"] {
            let bucket = Bucket::from_name(bucket.to_owned()).unwrap();
            for _ in 0..100 {
                let klen = rng.random_range(0..40);
                let k: Vec<u8> = (0..klen).map(|_| rng.random()).collect();
                let vlen = if rng.random_bool(0.05) {
                    rng.random_range(4000..20000)
                } else {
                    rng.random_range(0..200)
                };
                batch.put(&bucket, k, filler(rng.random(), vlen));
            }
        }
        if round == 1 {
            batch.delete_range(&b("lease"), vec![0x80], None);
        }
        commit(backend, &batch);
    }
    let txn = backend.read_txn().unwrap();
    for bucket in txn.buckets().unwrap() {
        pairs += range(&txn, &bucket, b"", None).len() as u64;
    }
    pairs
}

fn take_snapshot<B: Backend>(backend: &B) -> Vec<u8> {
    let mut stream = Vec::new();
    let written = backend
        .snapshot(&mut stream)
        .unwrap_or_else(|e| panic!("snapshot failed: {e}"));
    assert_eq!(
        written,
        stream.len() as u64,
        "snapshot reported a byte count unlike what it wrote"
    );
    stream
}

/// A snapshot restored into a fresh backend reproduces the source exactly.
pub fn snapshot_restore_round_trip<B: Backend>(options: B::Options) {
    let source = Fixture::<B>::new(&options);
    let pairs = populate_varied(source.b(), 11);
    let expected = dump_backend(source.b());
    let stream = take_snapshot(source.b());

    let mut target = Fixture::<B>::new(&options);
    let loaded = target
        .b()
        .restore(&mut stream.as_slice())
        .unwrap_or_else(|e| panic!("restore failed: {e}"));
    assert_eq!(loaded, pairs, "restore loaded the wrong number of pairs");
    assert_eq!(
        dump_backend(target.b()),
        expected,
        "restored content differs"
    );
    assert_eq!(
        take_snapshot(target.b()),
        stream,
        "a snapshot of the restored store differs from the source's"
    );
    target.reopen(&options);
    assert_eq!(
        dump_backend(target.b()),
        expected,
        "restored content lost on reopen"
    );

    // The empty store round-trips too.
    let empty = Fixture::<B>::new(&options);
    let stream = take_snapshot(empty.b());
    let target = Fixture::<B>::new(&options);
    assert_eq!(target.b().restore(&mut stream.as_slice()).unwrap(), 0);
    assert!(dump_backend(target.b()).is_empty());
}

/// A snapshot taken while a writer commits holds each commit wholly or not at all.
pub fn snapshot_during_writes_is_consistent<B: Backend>(options: B::Options) {
    const KEYS: u32 = 200;
    let f = Fixture::<B>::new(&options);
    let backend = Arc::new(f.backend.expect("backend"));
    let write_epoch = |backend: &B, epoch: u64| {
        let mut batch = WriteBatch::new();
        for i in 0..KEYS {
            let bucket = if i.is_multiple_of(2) {
                b("even")
            } else {
                b("odd")
            };
            let mut value = epoch.to_be_bytes().to_vec();
            value.extend_from_slice(&[0xAB; 500]);
            batch.put(&bucket, key(i), value);
        }
        // Keys only some epochs have: their presence must match the epoch too.
        if epoch.is_multiple_of(3) {
            batch.put(&b("third"), epoch.to_be_bytes(), "x");
        } else {
            batch.delete_range(&b("third"), Vec::new(), None);
        }
        backend.commit(&batch).unwrap();
    };
    write_epoch(&backend, 0);
    let stop = Arc::new(AtomicBool::new(false));
    let start = Arc::new(Barrier::new(2));
    let writer = {
        let (backend, stop, start) = (Arc::clone(&backend), Arc::clone(&stop), Arc::clone(&start));
        thread::spawn(move || {
            start.wait();
            let mut epoch = 1;
            while !stop.load(Ordering::Relaxed) && epoch < 10_000 {
                write_epoch(&backend, epoch);
                epoch += 1;
            }
            epoch
        })
    };
    start.wait();
    let mut epochs_seen = Vec::new();
    for _ in 0..8 {
        let stream = take_snapshot(&*backend);
        let target = Fixture::<B>::new(&options);
        target.b().restore(&mut stream.as_slice()).unwrap();
        let content = dump_backend(target.b());
        let mut epochs = std::collections::BTreeSet::new();
        let mut count = 0;
        for bucket in ["even", "odd"] {
            for value in content.get(bucket).expect("bucket in snapshot").values() {
                epochs.insert(u64::from_be_bytes(value[..8].try_into().unwrap()));
                count += 1;
            }
        }
        assert_eq!(count, KEYS, "a snapshot lost keys");
        assert_eq!(
            epochs.len(),
            1,
            "a snapshot mixes commits: epochs {epochs:?}"
        );
        let epoch = *epochs.iter().next().unwrap();
        let third: Vec<Vec<u8>> = content
            .get("third")
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default();
        if epoch.is_multiple_of(3) {
            assert_eq!(third, vec![epoch.to_be_bytes().to_vec()], "epoch {epoch}");
        } else {
            assert!(third.is_empty(), "epoch {epoch} has {third:?}");
        }
        epochs_seen.push(epoch);
        thread::sleep(Duration::from_millis(5));
    }
    stop.store(true, Ordering::Relaxed);
    let written = writer.join().expect("writer thread panicked");
    assert!(written > 1, "the writer made no progress during snapshots");
    assert!(
        epochs_seen.windows(2).all(|w| w[0] <= w[1]),
        "snapshots went back in time: {epochs_seen:?}"
    );
}

/// Restore rejects flipped bytes, truncation and trailing garbage with `BackendError::Snapshot`.
pub fn restore_rejects_damaged_streams<B: Backend>(options: B::Options) {
    let source = Fixture::<B>::new(&options);
    let kv = b("kv");
    let mut batch = WriteBatch::new();
    for i in 0..50 {
        batch.put(&kv, key(i), filler(i as u64, 40));
        batch.put(&b("meta"), key(i), "m");
    }
    commit(source.b(), &batch);
    let stream = take_snapshot(source.b());
    let target = Fixture::<B>::new(&options);
    let expect_rejected = |damaged: &[u8], what: &str| {
        let target = Fixture::<B>::new(&options);
        match target.b().restore(&mut &damaged[..]) {
            Err(BackendError::Snapshot { offset, reason }) => {
                assert!(
                    offset <= damaged.len() as u64,
                    "{what}: error offset {offset} beyond the stream"
                );
                assert!(!reason.is_empty(), "{what}: empty reason");
            }
            other => panic!("{what}: restore returned {other:?} instead of a snapshot error"),
        }
    };

    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for round in 0..24 {
        let mut damaged = stream.clone();
        let at = match round {
            0 => 0,
            1 => stream.len() - 1,
            2 => stream.len() - 5,
            _ => rng.random_range(0..stream.len()),
        };
        damaged[at] ^= rng.random_range(1..=255u8);
        expect_rejected(&damaged, &format!("byte {at} flipped (seed {seed})"));
    }
    for round in 0..12 {
        let len = match round {
            0 => 0,
            1 => stream.len() - 1,
            2 => 15,
            _ => rng.random_range(0..stream.len()),
        };
        expect_rejected(&stream[..len], &format!("truncated to {len} (seed {seed})"));
    }
    let mut extended = stream.clone();
    extended.push(0);
    expect_rejected(&extended, "one byte appended");

    // The intact stream still loads.
    assert_eq!(target.b().restore(&mut stream.as_slice()).unwrap(), 100);
    assert_eq!(dump_backend(target.b()), dump_backend(source.b()));
}

/// A stream larger than one restore batch, by pair count and by bytes, loads exactly and
/// survives a reopen; the same stream cut before its checksum is rejected.
pub fn restore_spanning_many_batches<B: Backend>(options: B::Options) {
    use crate::backend::snapshot::{RESTORE_BATCH_BYTES, RESTORE_BATCH_PAIRS};
    let source = Fixture::<B>::new(&options);
    let many = RESTORE_BATCH_PAIRS as u32 + 1_234;
    let mut batch = WriteBatch::new();
    for i in 0..many {
        batch.put(&b("many"), key(i), i.to_le_bytes());
    }
    commit(source.b(), &batch);
    let mut batch = WriteBatch::new();
    let big = 256 << 10;
    let bigs = (RESTORE_BATCH_BYTES / big) as u32 + 3;
    for i in 0..bigs {
        batch.put(&b("big"), key(i), filler(u64::from(i), big));
    }
    batch.put(&b("z"), "last", "");
    commit(source.b(), &batch);
    let expected = dump_backend(source.b());
    let stream = take_snapshot(source.b());

    let mut target = Fixture::<B>::new(&options);
    let loaded = target
        .b()
        .restore(&mut stream.as_slice())
        .unwrap_or_else(|e| panic!("restore of a multi-batch stream failed: {e}"));
    assert_eq!(loaded, u64::from(many + bigs + 1), "pairs loaded");
    assert!(
        dump_backend(target.b()) == expected,
        "restored content differs"
    );
    target.reopen(&options);
    assert!(
        dump_backend(target.b()) == expected,
        "restored content lost on reopen"
    );

    let cut = &stream[..stream.len() - 4];
    let target = Fixture::<B>::new(&options);
    match target.b().restore(&mut &cut[..]) {
        Err(BackendError::Snapshot { .. }) => {}
        other => panic!("a stream cut before its checksum restored as {other:?}"),
    }
}

/// `restore_observed` loads what `restore` loads and shows each pair exactly once, in stream
/// order, across batches; a damaged stream fails it as it fails `restore`.
pub fn restore_observed_shows_every_pair_once<B: Backend>(options: B::Options) {
    use crate::backend::snapshot::RESTORE_BATCH_PAIRS;
    let source = Fixture::<B>::new(&options);
    let mut batch = WriteBatch::new();
    for i in 0..(RESTORE_BATCH_PAIRS as u32 + 777) {
        batch.put(&b("a"), key(i), filler(u64::from(i), 24));
    }
    batch.put(&b("b"), "", "empty key");
    batch.put(&b("b"), "x", filler(7, 100_000));
    commit(source.b(), &batch);
    let expected = dump_backend(source.b());
    let stream = take_snapshot(source.b());

    let target = Fixture::<B>::new(&options);
    let mut seen: Vec<(String, Vec<u8>, Vec<u8>)> = Vec::new();
    let loaded = target
        .b()
        .restore_observed(&mut stream.as_slice(), &mut |bucket, k, v| {
            seen.push((bucket.name().to_owned(), k.to_vec(), v.to_vec()));
        })
        .unwrap_or_else(|e| panic!("restore_observed failed: {e}"));
    assert_eq!(loaded, seen.len() as u64, "pairs loaded vs pairs shown");
    let expected_pairs = pairs_in_order(&expected);
    assert!(seen == expected_pairs, "pairs shown differ from the stream");
    assert!(
        dump_backend(target.b()) == expected,
        "restored content differs"
    );

    let cut = &stream[..stream.len() - 4];
    let target = Fixture::<B>::new(&options);
    match target
        .b()
        .restore_observed(&mut &cut[..], &mut |_, _, _| {})
    {
        Err(BackendError::Snapshot { .. }) => {}
        other => panic!("a stream cut before its checksum restored as {other:?}"),
    }
}

/// `restore_chunks` loads what `restore_observed` loads and shows the same pairs in the same
/// order, however the stream is cut into chunks (single bytes, sizes that split every frame
/// field, empty chunks, one chunk); it hands back every chunk it took but the last one or
/// two; a flipped
/// byte, a cut stream and trailing bytes fail it as they fail `restore`.
pub fn restore_chunks_matches_restore<B: Backend>(options: B::Options) {
    use crate::backend::snapshot::RESTORE_BATCH_PAIRS;
    let source = Fixture::<B>::new(&options);
    let mut batch = WriteBatch::new();
    for i in 0..(RESTORE_BATCH_PAIRS as u32 + 300) {
        batch.put(&b("a"), key(i), filler(u64::from(i), (i % 97) as usize));
    }
    batch.put(&b("b"), "", "empty key");
    batch.put(&b("b"), "big", filler(7, 300_000));
    batch.put(&b("c"), "z", "");
    commit(source.b(), &batch);
    let expected = dump_backend(source.b());
    let stream = take_snapshot(source.b());
    let expected_pairs = pairs_in_order(&expected);
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let random: Vec<usize> = (0..64).map(|_| rng.random_range(0..70_000)).collect();
    let cuts: Vec<(&str, Vec<usize>)> = vec![
        ("one chunk", vec![stream.len()]),
        ("1 MiB chunks", vec![1 << 20]),
        ("odd sizes", vec![1, 2, 3, 5, 8, 13, 4093, 65_537]),
        ("with empty chunks", vec![0, 777, 0, 0, 100_003]),
        ("random sizes", random),
    ];
    for (what, sizes) in cuts {
        let target = Fixture::<B>::new(&options);
        let mut chunks = ChunkCuts::new(&stream, sizes);
        let mut seen: Vec<(String, Vec<u8>, Vec<u8>)> = Vec::new();
        let loaded = target
            .b()
            .restore_chunks(&mut chunks, &mut |bucket, k, v| {
                seen.push((bucket.name().to_owned(), k.to_vec(), v.to_vec()));
            })
            .unwrap_or_else(|e| panic!("{what} (seed {seed}): restore_chunks failed: {e}"));
        assert_eq!(loaded, seen.len() as u64, "{what}: pairs loaded vs shown");
        assert!(seen == expected_pairs, "{what}: pairs shown differ");
        assert!(
            dump_backend(target.b()) == expected,
            "{what}: restored content differs"
        );
        assert!(
            chunks.recycled <= chunks.handed,
            "{what}: more chunks handed back than taken"
        );
        // Every chunk goes back but the last one or two still read when the stream ended.
        assert!(
            chunks.handed - chunks.recycled <= 2,
            "{what}: {} of {} chunks never handed back",
            chunks.handed - chunks.recycled,
            chunks.handed
        );
    }
    // The "odd sizes" cut only: one stream of chunks per damage.
    let restore_damaged = |damaged: &[u8]| {
        let target = Fixture::<B>::new(&options);
        let mut chunks = ChunkCuts::new(damaged, [1, 2, 3, 5, 8, 13, 4093, 65_537]);
        target.b().restore_chunks(&mut chunks, &mut |_, _, _| {})
    };
    for round in 0..16 {
        let mut damaged = stream.clone();
        let at = match round {
            0 => stream.len() - 1,
            1 => stream.len() - 5,
            _ => rng.random_range(0..stream.len()),
        };
        damaged[at] ^= rng.random_range(1..=255u8);
        match restore_damaged(&damaged) {
            Err(BackendError::Snapshot { .. }) => {}
            other => panic!("byte {at} flipped (seed {seed}): restore_chunks gave {other:?}"),
        }
    }
    for cut in [0, 15, stream.len() / 2, stream.len() - 4, stream.len() - 1] {
        match restore_damaged(&stream[..cut]) {
            Err(BackendError::Snapshot { .. }) => {}
            other => panic!("cut to {cut}: restore_chunks gave {other:?}"),
        }
    }
    let mut extended = stream.clone();
    extended.push(0);
    match restore_damaged(&extended) {
        Err(BackendError::Snapshot { .. }) => {}
        other => panic!("one byte appended: restore_chunks gave {other:?}"),
    }
}

/// Restore refuses a backend that already holds data, and leaves that data alone.
pub fn restore_into_non_empty_is_refused<B: Backend>(options: B::Options) {
    let source = Fixture::<B>::new(&options);
    let mut batch = WriteBatch::new();
    batch.put(&b("kv"), "src", "1");
    commit(source.b(), &batch);
    let stream = take_snapshot(source.b());

    let target = Fixture::<B>::new(&options);
    let mut batch = WriteBatch::new();
    batch.put(&b("other"), "mine", "2");
    commit(target.b(), &batch);
    let before = dump_backend(target.b());
    match target.b().restore(&mut stream.as_slice()) {
        Err(BackendError::RestoreNotEmpty) => {}
        other => panic!("restore into a non-empty backend returned {other:?}"),
    }
    assert_eq!(
        dump_backend(target.b()),
        before,
        "a refused restore changed data"
    );
}

/// Values of several MiB and keys of a few hundred bytes, in one batch and many.
pub fn large_values<B: Backend>(options: B::Options) {
    let mut f = Fixture::<B>::new(&options);
    let kv = b("kv");
    let sizes = [0usize, 1, 4095, 4096, 4097, 65_536, 1 << 20, (8 << 20) + 3];
    let mut batch = WriteBatch::new();
    for (i, &len) in sizes.iter().enumerate() {
        batch.put(&kv, key(i as u32), filler(i as u64, len));
    }
    let long_key = vec![b'k'; 400];
    batch.put(&kv, long_key.clone(), "long key");
    commit(f.b(), &batch);
    // Many small pairs in one batch.
    let mut batch = WriteBatch::new();
    for i in 0..20_000 {
        batch.put(&b("many"), key(i), i.to_string());
    }
    commit(f.b(), &batch);
    for round in 0..2 {
        let txn = f.b().read_txn().unwrap();
        for (i, &len) in sizes.iter().enumerate() {
            let got = txn.get(&kv, &key(i as u32)).unwrap().expect("large value");
            assert_eq!(
                got.len(),
                len,
                "value {i} has the wrong length (round {round})"
            );
            assert!(
                got == filler(i as u64, len).as_slice(),
                "value {i} of {len} bytes differs (round {round})"
            );
        }
        assert_eq!(get(&txn, &kv, &long_key).as_deref(), Some(&b"long key"[..]));
        assert_eq!(range(&txn, &b("many"), b"", None).len(), 20_000);
        assert_eq!(
            get(&txn, &b("many"), &key(12_345)).as_deref(),
            Some(&b"12345"[..])
        );
        drop(txn);
        f.reopen(&options);
    }
    // Overwrite a large value with a small one and back.
    let mut batch = WriteBatch::new();
    batch.put(&kv, key(6), "small now");
    commit(f.b(), &batch);
    assert_eq!(
        get(&f.b().read_txn().unwrap(), &kv, &key(6)).as_deref(),
        Some(&b"small now"[..])
    );
    let stream = take_snapshot(f.b());
    let target = Fixture::<B>::new(&options);
    target.b().restore(&mut stream.as_slice()).unwrap();
    assert_eq!(dump_backend(target.b()), dump_backend(f.b()));
}

/// An empty batch commits and changes nothing.
pub fn empty_batch<B: Backend>(options: B::Options) {
    let mut f = Fixture::<B>::new(&options);
    commit(f.b(), &WriteBatch::new());
    assert!(dump_backend(f.b()).is_empty());
    let mut batch = WriteBatch::new();
    batch.put(&b("kv"), "k", "v");
    commit(f.b(), &batch);
    let before = dump_backend(f.b());
    for _ in 0..10 {
        commit(f.b(), &WriteBatch::new());
    }
    let mut cleared = batch.clone();
    cleared.clear();
    assert!(cleared.is_empty());
    commit(f.b(), &cleared);
    assert_eq!(dump_backend(f.b()), before);
    f.reopen(&options);
    assert_eq!(dump_backend(f.b()), before);
}

fn seed() -> u64 {
    match std::env::var("KEEL_CONFORMANCE_SEED") {
        Ok(s) => s.parse().expect("KEEL_CONFORMANCE_SEED is a u64"),
        Err(_) => rand::random(),
    }
}

/// Seeded random batches of puts, deletes and range deletes over a few buckets, checked
/// against a `BTreeMap` model after every commit and after reopens.
///
/// Replay a failure with `KEEL_CONFORMANCE_SEED=<seed printed in the failure>`.
pub fn random_batches_match_model<B: Backend>(options: B::Options) {
    let seed = seed();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        random_batches::<B>(options, seed)
    }));
    if let Err(payload) = result {
        eprintln!("random_batches_match_model failed with KEEL_CONFORMANCE_SEED={seed}");
        std::panic::resume_unwind(payload);
    }
}

fn random_batches<B: Backend>(options: B::Options, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut f = Fixture::<B>::new(&options);
    let buckets = [b("key"), b("meta"), b("key-x")];
    let mut model = Dump::new();
    let random_key = |rng: &mut StdRng| -> Vec<u8> {
        let len = rng.random_range(0..4);
        (0..len).map(|_| rng.random_range(0..6u8) * 50).collect()
    };
    for step in 0..300 {
        let mut batch = WriteBatch::new();
        let mut next = model.clone();
        for _ in 0..rng.random_range(0..12) {
            let bucket = &buckets[rng.random_range(0..buckets.len())];
            let name = bucket.name().to_owned();
            match rng.random_range(0..10) {
                0..=5 => {
                    let k = random_key(&mut rng);
                    let v = filler(rng.random(), rng.random_range(0..64));
                    batch.put(bucket, k.clone(), v.clone());
                    next.entry(name).or_default().insert(k, v);
                }
                6..=7 => {
                    let k = random_key(&mut rng);
                    batch.delete(bucket, k.clone());
                    if let Some(m) = next.get_mut(&name) {
                        m.remove(&k);
                    }
                }
                _ => {
                    let start = random_key(&mut rng);
                    let end = if rng.random_bool(0.2) {
                        None
                    } else {
                        Some(random_key(&mut rng))
                    };
                    batch.delete_range(bucket, start.clone(), end.clone());
                    if let Some(m) = next.get_mut(&name) {
                        m.retain(|k, _| *k < start || end.as_ref().is_some_and(|end| k >= end));
                    }
                }
            }
        }
        next.retain(|_, m| !m.is_empty());
        let failing = rng.random_bool(0.05);
        if failing {
            batch.put(&Bucket::new("not a bucket"), "k", "v");
            assert!(
                f.b().commit(&batch).is_err(),
                "step {step}: a batch with an invalid bucket committed"
            );
        } else {
            commit(f.b(), &batch);
            model = next;
        }
        assert_eq!(dump_backend(f.b()), model, "step {step} (seed {seed})");
        if rng.random_bool(0.05) {
            f.reopen(&options);
            assert_eq!(dump_backend(f.b()), model, "after reopen at step {step}");
        }
        if rng.random_bool(0.02) {
            f.b().defragment().unwrap();
            assert_eq!(
                dump_backend(f.b()),
                model,
                "after defragment at step {step}"
            );
        }
    }
}
