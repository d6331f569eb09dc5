//! Compaction deletes superseded revisions in the background, keeps what reads above the
//! compaction point need, resumes after a restart, and the history hash ignores its progress.

use std::time::{Duration, Instant};

use keel_mvcc::testing::MemBackend;
use keel_mvcc::{Backend, KEY_BUCKET, RangeRequest, ReadTxn, Store, StoreOptions};

use crate::common::{fresh_path, open_at};

fn key_bucket_len(s: &Store<MemBackend>) -> usize {
    s.backend().len(&KEY_BUCKET)
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn fill(s: &Store<MemBackend>) {
    // 10 keys x 10 versions, then 3 keys deleted: revisions 1..=103.
    for v in 0..10u32 {
        for k in 0..10u32 {
            s.put(format!("k{k}").as_bytes(), format!("{v}").as_bytes(), 0)
                .unwrap();
        }
    }
    for k in 0..3u32 {
        s.delete_range(format!("k{k}").as_bytes(), None).unwrap();
    }
}

#[test]
fn compaction_deletes_in_bounded_batches_and_keeps_what_reads_need() {
    let (_d, path) = fresh_path();
    let s = open_at(
        &path,
        StoreOptions {
            compaction_batch_limit: 7,
            compaction_sleep_interval: Duration::from_millis(1),
            ..StoreOptions::default()
        },
    );
    fill(&s);
    let hash_before = s.hash_kv(0).unwrap();
    let at_95 = s
        .range(&RangeRequest::range(vec![0], vec![0]).at(95))
        .unwrap();
    s.compact(95).unwrap();
    assert_eq!(s.compacted_revision(), 95);
    // Kept: per key its last put <= 95 (10), the puts 96..=100 and tombstones 101..=103.
    wait_for("physical compaction", || key_bucket_len(&s) == 18);
    let again = s
        .range(&RangeRequest::range(vec![0], vec![0]).at(95))
        .unwrap();
    assert_eq!(again.kvs, at_95.kvs);
    let h = s.hash_kv(0).unwrap();
    assert_eq!(h.compact_revision, 95);
    assert_ne!(h.hash, hash_before.hash, "the hash covers the compaction");
    s.compact(103).unwrap();
    wait_for("second compaction", || key_bucket_len(&s) == 7);
    assert_eq!(
        s.range(&RangeRequest::range(vec![0], vec![0]))
            .unwrap()
            .count,
        7
    );
}

#[test]
fn an_interrupted_compaction_resumes_on_open_and_hashes_agree() {
    let (_d, path) = fresh_path();
    let slow = StoreOptions {
        compaction_batch_limit: 1,
        compaction_sleep_interval: Duration::from_secs(3600),
        ..StoreOptions::default()
    };
    let s = open_at(&path, slow.clone());
    fill(&s);
    s.compact(100).unwrap();
    let hash = s.hash_kv(0).unwrap();
    wait_for("first batch", || key_bucket_len(&s) == 102);
    // Stopped after one batch of one deletion.
    let start = Instant::now();
    drop(s);
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "shutdown waited for the compactor pause"
    );
    let txn = MemBackend::open(&path, &Default::default()).unwrap();
    let scheduled = txn
        .read_txn()
        .unwrap()
        .get(&keel_mvcc::META_BUCKET, b"scheduled_compact_rev")
        .unwrap()
        .map(<[u8]>::to_vec);
    assert_eq!(scheduled, Some(100u64.to_be_bytes().to_vec()));
    assert!(
        txn.read_txn()
            .unwrap()
            .get(&keel_mvcc::META_BUCKET, b"finished_compact_rev")
            .unwrap()
            .is_none()
    );
    drop(txn);
    let s = open_at(&path, StoreOptions::default());
    assert_eq!(s.compacted_revision(), 100);
    assert_eq!(
        s.hash_kv(0).unwrap(),
        hash,
        "hash differs while compaction is unfinished"
    );
    // Kept: the last put of each key (91..=100) and the tombstones 101..=103.
    wait_for("resumed compaction", || key_bucket_len(&s) == 13);
    assert_eq!(
        s.hash_kv(0).unwrap(),
        hash,
        "hash changed by physical compaction"
    );
    assert!(s.range(&RangeRequest::key(b"k5".to_vec()).at(99)).is_err());
    assert_eq!(
        s.range(&RangeRequest::key(b"k5".to_vec()).at(100))
            .unwrap()
            .kvs[0]
            .value(),
        b"9"
    );
}

/// A backend whose first read transaction opened by a thread named "gated", once armed,
/// waits until released: it stops a read between its setup and its backend read.
mod gated {
    use std::path::Path;
    use std::sync::atomic::{AtomicBool, Ordering};

    use keel_mvcc::testing::{MemBackend, MemOptions};
    use keel_mvcc::{Backend, BackendError, BackendSize, BatchSource, WriteBatch};
    use parking_lot::{Condvar, Mutex};

    /// Armed, the next read transaction opened by the "gated" thread waits.
    pub static ARMED: AtomicBool = AtomicBool::new(false);
    /// (reached, released).
    pub static STATE: Mutex<(bool, bool)> = Mutex::new((false, false));
    /// Signals changes of [`STATE`].
    pub static CV: Condvar = Condvar::new();

    /// [`MemBackend`] with the gate.
    pub struct Gated(pub MemBackend);

    impl Backend for Gated {
        type Options = MemOptions;
        type ReadTxn = <MemBackend as Backend>::ReadTxn;
        fn open(path: &Path, options: &MemOptions) -> Result<Self, BackendError> {
            Ok(Gated(MemBackend::open(path, options)?))
        }
        fn read_txn(&self) -> Result<Self::ReadTxn, BackendError> {
            if std::thread::current().name() == Some("gated") && ARMED.swap(false, Ordering::AcqRel)
            {
                let mut st = STATE.lock();
                st.0 = true;
                CV.notify_all();
                while !st.1 {
                    CV.wait(&mut st);
                }
            }
            self.0.read_txn()
        }
        fn commit(&self, batch: &WriteBatch) -> Result<(), BackendError> {
            self.0.commit(batch)
        }
        fn commit_from(&self, source: &dyn BatchSource) -> Result<(), BackendError> {
            self.0.commit_from(source)
        }
        fn size(&self) -> Result<BackendSize, BackendError> {
            self.0.size()
        }
        fn defragment(&self) -> Result<(), BackendError> {
            self.0.defragment()
        }
    }
}

/// hash_kv reads the compaction point, then opens its backend read transaction: a compaction
/// whose deletions land in between must not make it hash a history of neither state under
/// the old compaction point.
#[test]
fn hash_kv_racing_a_compaction_hashes_one_state() {
    use gated::*;
    use std::sync::atomic::Ordering;
    let (_d, p) = fresh_path();
    let backend = Gated(MemBackend::open(&p, &Default::default()).unwrap());
    let s = std::sync::Arc::new(
        Store::open(
            backend,
            StoreOptions {
                compaction_sleep_interval: Duration::from_millis(1),
                ..Default::default()
            },
        )
        .unwrap(),
    );
    for i in 1..=10u32 {
        s.put(b"k", i.to_string().as_bytes(), 0).unwrap();
    }
    s.compact(3).unwrap();
    wait_for("first compaction", || s.backend().0.len(&KEY_BUCKET) == 8);
    let before = s.hash_kv(10).unwrap();
    assert_eq!(before.compact_revision, 3);
    ARMED.store(true, Ordering::Release);
    let hasher = {
        let s = s.clone();
        std::thread::Builder::new()
            .name("gated".into())
            .spawn(move || s.hash_kv(10))
            .unwrap()
    };
    {
        let mut st = STATE.lock();
        while !st.0 {
            CV.wait(&mut st);
        }
    }
    s.compact(8).unwrap();
    wait_for("second compaction", || s.backend().0.len(&KEY_BUCKET) == 3);
    {
        let mut st = STATE.lock();
        st.1 = true;
        CV.notify_all();
    }
    let raced = hasher.join().unwrap().unwrap();
    let after = s.hash_kv(10).unwrap();
    assert_eq!(after.compact_revision, 8);
    assert!(
        raced == before || raced == after,
        "hash_kv(10) racing compact(8) returned {raced:?}; before the compaction it is \
         {before:?}, after it {after:?}"
    );
}

/// The number of keys of [`beside_a_large_compaction`]'s store, each put once (value "v").
const LARGE: u32 = 300_000;

/// Fills a store with [`LARGE`] keys, compacts it at its current revision on another thread,
/// and calls `op(n)` for n = 0, 1, … on this one until the compaction returns; returns the
/// store, the compaction point, how long the compaction took, the longest call of `op`, and
/// how many calls there were.
fn beside_a_large_compaction(
    mut op: impl FnMut(u32, &Store<MemBackend>),
) -> (
    tempfile::TempDir,
    Store<MemBackend>,
    u64,
    Duration,
    Duration,
    u32,
) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    let (dir, path) = fresh_path();
    let s = Arc::new(open_at(&path, StoreOptions::default()));
    for chunk in 0..LARGE / 10_000 {
        let mut t = s.write();
        for i in 0..10_000u32 {
            t.put(format!("k{:06}", chunk * 10_000 + i).as_bytes(), b"v", 0)
                .unwrap();
        }
        t.commit().unwrap();
    }
    s.force_commit().unwrap();
    let rev = s.current_revision();
    let (started, done) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let compactor = {
        let (s, started, done) = (s.clone(), started.clone(), done.clone());
        std::thread::spawn(move || {
            started.store(true, Ordering::Release);
            let t0 = Instant::now();
            s.compact(rev).unwrap();
            done.store(true, Ordering::Release);
            t0.elapsed()
        })
    };
    while !started.load(Ordering::Acquire) {
        std::hint::spin_loop();
    }
    let (mut longest, mut calls) = (Duration::ZERO, 0);
    while !done.load(Ordering::Acquire) {
        let t0 = Instant::now();
        op(calls, &s);
        longest = longest.max(t0.elapsed());
        calls += 1;
    }
    let took = compactor.join().unwrap();
    let s = Arc::into_inner(s).expect("the compactor thread has ended");
    (dir, s, rev, took, longest, calls)
}

/// The key index is compacted some keys at a time, its lock released in between: a read
/// waits for a chunk at most, not for the whole compaction of a large index.
#[test]
fn reads_go_on_while_a_large_index_is_compacted() {
    let (_d, _s, _, took, longest, reads) = beside_a_large_compaction(|_, s| {
        let r = s.range(&RangeRequest::key(b"k000001".to_vec())).unwrap();
        assert_eq!(r.kvs.len(), 1);
    });
    eprintln!("compaction took {took:?}; {reads} reads, the longest {longest:?}");
    assert!(
        longest < took / 4,
        "a read waited {longest:?} of a compaction of {took:?}"
    );
}

/// Writes go on too while the key index is compacted: a put waits for a chunk of the
/// compaction at most, and every put made meanwhile, to keys compacted already or not yet,
/// reads back afterwards, as do the keys the compaction kept.
#[test]
fn writes_go_on_while_a_large_index_is_compacted() {
    // Keys spread over the whole index, so some are compacted already and some not.
    let key = |n: u32| format!("k{:06}", (n * 7919) % LARGE);
    let (_d, s, rev, took, longest, puts) = beside_a_large_compaction(|n, s| {
        s.put(key(n).as_bytes(), format!("w{n}").as_bytes(), 0)
            .unwrap();
    });
    assert!(
        longest < took / 4,
        "a put waited {longest:?} of a compaction of {took:?}"
    );
    assert!(puts > 10, "only {puts} puts during the compaction");
    let mut latest = std::collections::HashMap::new();
    for n in 0..puts {
        latest.insert(key(n), format!("w{n}"));
    }
    let every_997th = (0..LARGE).step_by(997).map(|i| format!("k{i:06}"));
    for key in every_997th.chain(latest.keys().cloned()) {
        let r = s
            .range(&RangeRequest::key(key.clone().into_bytes()))
            .unwrap();
        let want = latest.get(&key).map_or("v", String::as_str);
        assert_eq!(r.kvs.len(), 1, "{key}");
        assert_eq!(r.kvs[0].value(), want.as_bytes(), "{key}");
        // Its value as of the compaction point is still there.
        let at = s
            .range(&RangeRequest {
                revision: rev,
                ..RangeRequest::key(key.clone().into_bytes())
            })
            .unwrap();
        assert_eq!(at.kvs[0].value(), b"v", "{key} at the compaction point");
    }
}
