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

fn fill<B: Backend>(s: &Store<B>) {
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
    assert_eq!(s.physically_compacted_revision(), 0);
    s.compact(95).unwrap();
    assert_eq!(s.compacted_revision(), 95);
    // Kept: per key its last put <= 95 (10), the puts 96..=100 and tombstones 101..=103.
    wait_for("physical compaction", || {
        s.physically_compacted_revision() == 95
    });
    assert_eq!(
        key_bucket_len(&s),
        18,
        "physically compacted before its deletions were committed"
    );
    let again = s
        .range(&RangeRequest::range(vec![0], vec![0]).at(95))
        .unwrap();
    assert_eq!(again.kvs, at_95.kvs);
    let h = s.hash_kv(0).unwrap();
    assert_eq!(h.compact_revision, 95);
    assert_ne!(h.hash, hash_before.hash, "the hash covers the compaction");
    s.compact(103).unwrap();
    wait_for("second compaction", || {
        s.physically_compacted_revision() == 103
    });
    assert_eq!(key_bucket_len(&s), 7);
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
    assert_eq!(
        s.physically_compacted_revision(),
        0,
        "physically compacted with deletions left"
    );
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
    assert!(s.physically_compacted_revision() < 100);
    assert_eq!(
        s.hash_kv(0).unwrap(),
        hash,
        "hash differs while compaction is unfinished"
    );
    // Kept: the last put of each key (91..=100) and the tombstones 101..=103.
    wait_for("resumed compaction", || {
        s.physically_compacted_revision() == 100
    });
    assert_eq!(key_bucket_len(&s), 13);
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

/// The number of keys of a [`large_store`], each put once (value "v").
const LARGE: u32 = 300_000;

/// What a [`large_store`] holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum History {
    /// Every key put once: the compaction keeps every key.
    PutOnce,
    /// Every key put once, then every key but one in ten deleted: the compaction removes
    /// nine keys in ten, thinning out every leaf of the index.
    MostDeleted,
}

impl History {
    /// Whether the `n`th key (`k{n:06}`) is live with value "v" at the compaction point.
    fn kept(self, n: u32) -> bool {
        self == History::PutOnce || n.is_multiple_of(10)
    }
}

/// A thread's time on a CPU and time waiting for one (on a run queue), from its Linux
/// schedstat file.
fn schedstat(path: &str) -> (Duration, Duration) {
    let stat = std::fs::read_to_string(path).unwrap();
    let mut fields = stat
        .split_whitespace()
        .map(|f| Duration::from_nanos(f.parse().unwrap()));
    (fields.next().unwrap(), fields.next().unwrap())
}

/// What [`beside`] measured.
struct Beside<R> {
    /// What the work returned.
    outcome: R,
    /// How long the work took.
    took: Duration,
    /// The working thread's time on a CPU meanwhile.
    working: Duration,
    /// The longest call of `op`.
    longest: Duration,
    /// The most work one call of `op` waited through: the least of the time the call's
    /// thread slept (neither on a CPU nor waiting for one: waiting for a lock) and the
    /// working thread's time on a CPU meanwhile. A call waiting for a lock held by the work
    /// for a long stretch of it has both long; one that waited while the working thread was
    /// off its CPU holding a lock (a machine with other work to do), or that was itself off
    /// its CPU, does not have both long.
    waited: Duration,
    /// How many calls of `op` there were.
    calls: u32,
}

/// A store of [`LARGE`] keys, some deleted as `history` says, all in the backend; returns it
/// with its revision.
///
/// Nothing goes to the backend later but what the store's own work commits (its batch limit
/// and interval are out of reach): a put never waits for a backend commit, and no backend
/// commit takes a CPU from the measures of [`beside`].
fn large_store(history: History) -> (tempfile::TempDir, Store<MemBackend>, u64) {
    let (dir, path) = fresh_path();
    let options = StoreOptions {
        batch_limit: usize::MAX / 8,
        batch_interval: Duration::from_secs(3600),
        ..StoreOptions::default()
    };
    let s = open_at(&path, options);
    for chunk in 0..LARGE / 10_000 {
        let mut t = s.write();
        for i in 0..10_000u32 {
            t.put(format!("k{:06}", chunk * 10_000 + i).as_bytes(), b"v", 0)
                .unwrap();
        }
        t.commit().unwrap();
    }
    if history == History::MostDeleted {
        // k…1 to k…9 of every ten keys.
        for chunk in 0..LARGE / 100_000 {
            let mut t = s.write();
            for tens in chunk * 10_000..(chunk + 1) * 10_000 {
                t.delete_range(
                    format!("k{tens:05}1").as_bytes(),
                    Some(format!("k{tens:05}:").as_bytes()),
                )
                .unwrap();
            }
            t.commit().unwrap();
        }
    }
    s.force_commit().unwrap();
    let rev = s.current_revision();
    (dir, s, rev)
}

/// Runs `work` on another thread, and calls `op(n)` for n = 0, 1, … on this one until the
/// work returns.
fn beside<R: Send + 'static>(
    s: Store<MemBackend>,
    work: impl FnOnce(&Store<MemBackend>) -> R + Send + 'static,
    mut op: impl FnMut(u32, &Store<MemBackend>),
) -> (Store<MemBackend>, Beside<R>) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    let s = Arc::new(s);
    let (started, done) = (
        Arc::new(std::sync::OnceLock::new()),
        Arc::new(AtomicBool::new(false)),
    );
    // Dropped once the calls are over: the working thread lives on until then, so that its
    // schedstat file can be read after every call.
    let (calls_over, over) = std::sync::mpsc::channel::<()>();
    let worker = {
        let (s, started, done) = (s.clone(), started.clone(), done.clone());
        std::thread::spawn(move || {
            let tid = rustix::thread::gettid().as_raw_nonzero().get();
            let (cpu0, _) = schedstat("/proc/thread-self/schedstat");
            started.set(tid).unwrap();
            let t0 = Instant::now();
            let outcome = work(&s);
            let took = t0.elapsed();
            let (cpu1, _) = schedstat("/proc/thread-self/schedstat");
            done.store(true, Ordering::Release);
            let _ = over.recv();
            (outcome, took, cpu1 - cpu0)
        })
    };
    let working = loop {
        if let Some(tid) = started.get() {
            break format!("/proc/self/task/{tid}/schedstat");
        }
        std::hint::spin_loop();
    };
    let (mut longest, mut waited, mut calls) = (Duration::ZERO, Duration::ZERO, 0);
    while !done.load(Ordering::Acquire) {
        let (other0, _) = schedstat(&working);
        let (cpu0, queued0) = schedstat("/proc/thread-self/schedstat");
        let t0 = Instant::now();
        op(calls, &s);
        let took = t0.elapsed();
        let (cpu1, queued1) = schedstat("/proc/thread-self/schedstat");
        // Read last: the working thread's time covers the whole call.
        let other1 = schedstat(&working).0;
        let slept = took.saturating_sub((cpu1 - cpu0) + (queued1 - queued0));
        longest = longest.max(took);
        waited = waited.max(slept.min(other1 - other0));
        calls += 1;
    }
    drop(calls_over);
    let (outcome, took, working) = worker.join().unwrap();
    let s = Arc::into_inner(s).expect("the working thread has ended");
    let measured = Beside {
        outcome,
        took,
        working,
        longest,
        waited,
        calls,
    };
    (s, measured)
}

impl<R> Beside<R> {
    /// Checks that no call of `op` waited through more than an eighth of the work (`what`,
    /// done in chunks of the index held under its lock one at a time; a call takes the
    /// store's locks a few times, each time waiting for one chunk at most).
    fn check_waits(&self, case: &str, work: &str, call: &str) {
        eprintln!(
            "{case}: {work} took {:?} ({:?} on a CPU); {} {call}s, the longest {:?}, waiting \
             through {:?} of the {work}",
            self.took, self.working, self.calls, self.longest, self.waited
        );
        assert!(
            self.waited < self.working / 8,
            "{case}: a {call} waited through {:?} of a {work} of {:?} on a CPU ({:?} in all; \
             the longest {call} took {:?})",
            self.waited,
            self.working,
            self.took,
            self.longest
        );
    }
}

/// Compacts a [`large_store`] at its revision beside `op` (see [`beside`]); checks the keys
/// left in the index.
fn beside_a_large_compaction(
    history: History,
    op: impl FnMut(u32, &Store<MemBackend>),
) -> (tempfile::TempDir, Store<MemBackend>, u64, Beside<()>) {
    let (dir, s, rev) = large_store(history);
    let (s, b) = beside(s, move |s| s.compact(rev).unwrap(), op);
    // The keys kept, and any that calls put back.
    let kept = (0..LARGE).filter(|&n| history.kept(n)).count();
    assert!(
        (kept..=kept + b.calls as usize).contains(&s.key_count()),
        "{history:?}: {} keys in the index after the compaction",
        s.key_count()
    );
    (dir, s, rev, b)
}

/// The key index is compacted some keys at a time, its lock released in between: a read
/// waits for a chunk at most, not for the whole compaction of a large index, nor for packing
/// the leaves that a compaction removing most keys thinned out.
#[test]
fn reads_go_on_while_a_large_index_is_compacted() {
    for history in [History::PutOnce, History::MostDeleted] {
        let (_d, _s, _, b) = beside_a_large_compaction(history, |_, s| {
            let r = s.range(&RangeRequest::key(b"k000010".to_vec())).unwrap();
            assert_eq!(r.kvs.len(), 1);
        });
        b.check_waits(&format!("{history:?}"), "compaction", "read");
    }
}

/// Writes go on too while the key index is compacted: a put waits for a chunk of the
/// compaction at most (nor for packing the leaves a compaction removing most keys thinned
/// out), and every put made meanwhile, to keys compacted already or not yet, kept or
/// removed, reads back afterwards, as do the keys the compaction kept.
#[test]
fn writes_go_on_while_a_large_index_is_compacted() {
    for history in [History::PutOnce, History::MostDeleted] {
        writes_beside_a_large_compaction(history);
    }
}

fn writes_beside_a_large_compaction(history: History) {
    // Keys spread over the whole index, so some are compacted already and some not.
    let key = |n: u32| format!("k{:06}", (n * 7919) % LARGE);
    let (_d, s, rev, b) = beside_a_large_compaction(history, |n, s| {
        s.put(key(n).as_bytes(), format!("w{n}").as_bytes(), 0)
            .unwrap();
    });
    b.check_waits(&format!("{history:?}"), "compaction", "put");
    let puts = b.calls;
    assert!(puts > 10, "only {puts} puts during the compaction");
    let mut latest = std::collections::HashMap::new();
    for n in 0..puts {
        latest.insert(key(n), format!("w{n}"));
    }
    let every_997th = (0..LARGE).step_by(997).map(|i| format!("k{i:06}"));
    for key in every_997th.chain(latest.keys().cloned()) {
        let n: u32 = key[1..].parse().unwrap();
        let kept = history.kept(n).then_some("v");
        let r = s
            .range(&RangeRequest::key(key.clone().into_bytes()))
            .unwrap();
        let want = latest.get(&key).map(String::as_str).or(kept);
        let got = r.kvs.first().map(|kv| kv.value());
        assert_eq!(got, want.map(str::as_bytes), "{key}");
        // Its value as of the compaction point is still there.
        let at = s
            .range(&RangeRequest {
                revision: rev,
                ..RangeRequest::key(key.clone().into_bytes())
            })
            .unwrap();
        let got = at.kvs.first().map(|kv| kv.value());
        assert_eq!(
            got,
            kept.map(str::as_bytes),
            "{key} at the compaction point"
        );
    }
}

/// hash_kv walks the key index for what a compaction keeps some keys at a time, its lock
/// released in between: a put of a new key (which adds it to the index under the index's
/// write lock) waits for a chunk of the walk at most, and the hash is the one taken with no
/// writes going on (writes have later revisions, which leave what is kept alone).
#[test]
fn puts_go_on_while_a_large_index_is_hashed() {
    let (_d, s, rev) = large_store(History::PutOnce);
    // Every revision is then at or below the compaction point: the hash takes those the
    // walk's kept set holds.
    let compacted = rev;
    s.compact(compacted).unwrap();
    let quiet = s.hash_kv(rev).unwrap();
    assert_eq!(quiet.compact_revision, compacted);
    // New keys spread over the index (each beside an old one), so the walk meets leaves
    // split by them on both sides of where it goes on from.
    let (s, b) = beside(
        s,
        move |s| s.hash_kv(rev).unwrap(),
        |n, s| {
            let key = format!("k{:06}+", (n * 7919) % LARGE);
            s.put(key.as_bytes(), b"w", 0).unwrap();
        },
    );
    b.check_waits("a large index", "hash", "put");
    assert!(b.calls > 10, "only {} puts during the hash", b.calls);
    assert_eq!(b.outcome, quiet, "the hash beside the puts");
    assert_eq!(s.hash_kv(rev).unwrap(), quiet, "the hash after the puts");
}

/// A backend whose read transactions and commits fail, as armed, on the store's compactor
/// thread only: the physical deletion of a compaction fails while the store's own commits
/// (the compaction point's among them) go through.
mod faulty {
    use std::path::Path;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    use keel_mvcc::testing::{MemBackend, MemOptions};
    use keel_mvcc::{Backend, BackendError, BackendSize, BatchSource, WriteBatch};

    /// [`MemBackend`] with faults on the compactor thread.
    pub struct Faulty {
        pub mem: MemBackend,
        /// How many more read transactions the compactor opens fail (`u64::MAX`: all).
        pub failing_reads: AtomicU64,
        /// Read transactions the compactor tried to open.
        pub reads_tried: AtomicU64,
        /// The compactor's commits fail.
        pub failing_commits: AtomicBool,
    }

    fn on_compactor() -> bool {
        std::thread::current().name() == Some("keel-mvcc-compact")
    }

    impl Backend for Faulty {
        type Options = MemOptions;
        type ReadTxn = <MemBackend as Backend>::ReadTxn;
        fn open(path: &Path, options: &MemOptions) -> Result<Self, BackendError> {
            Ok(Faulty {
                mem: MemBackend::open(path, options)?,
                failing_reads: AtomicU64::new(0),
                reads_tried: AtomicU64::new(0),
                failing_commits: AtomicBool::new(false),
            })
        }
        fn read_txn(&self) -> Result<Self::ReadTxn, BackendError> {
            if on_compactor() {
                self.reads_tried.fetch_add(1, Ordering::AcqRel);
                let fail = self
                    .failing_reads
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| match n {
                        0 => None,
                        u64::MAX => Some(u64::MAX),
                        n => Some(n - 1),
                    })
                    .is_ok();
                if fail {
                    return Err(BackendError::Other(
                        "injected read failure: every reader slot is in use".into(),
                    ));
                }
            }
            self.mem.read_txn()
        }
        fn commit(&self, batch: &WriteBatch) -> Result<(), BackendError> {
            if on_compactor() && self.failing_commits.load(Ordering::Acquire) {
                return Err(BackendError::io(
                    "faulty",
                    "commit",
                    std::io::Error::other("injected commit failure"),
                ));
            }
            self.mem.commit(batch)
        }
        fn commit_from(&self, source: &dyn BatchSource) -> Result<(), BackendError> {
            self.commit(&WriteBatch::from_source(source)?)
        }
        fn size(&self) -> Result<BackendSize, BackendError> {
            self.mem.size()
        }
        fn defragment(&self) -> Result<(), BackendError> {
            self.mem.defragment()
        }
    }
}

/// A store over [`faulty::Faulty`] holding [`fill`]'s revisions, all in the backend.
fn faulty_store() -> (tempfile::TempDir, Store<faulty::Faulty>) {
    faulty_store_with(StoreOptions::default())
}

fn faulty_store_with(options: StoreOptions) -> (tempfile::TempDir, Store<faulty::Faulty>) {
    let (dir, path) = fresh_path();
    let backend = faulty::Faulty::open(&path, &Default::default()).unwrap();
    let options = StoreOptions {
        compaction_sleep_interval: Duration::from_millis(1),
        ..options
    };
    let s = Store::open(backend, options).unwrap();
    fill(&s);
    s.force_commit().unwrap();
    assert_eq!(s.backend().mem.len(&KEY_BUCKET), 103);
    (dir, s)
}

/// A backend commit of the compactor's that fails poisons the store, as a failed commit of
/// writes does: every later write, commit and compaction fails, saying why, instead of the
/// failure going to a log line while the store carries on without its deletions.
#[test]
fn a_failed_deletion_commit_poisons_the_store() {
    use std::sync::atomic::Ordering;
    let (_d, s) = faulty_store();
    s.backend().failing_commits.store(true, Ordering::Release);
    s.compact(95).unwrap();
    let mut refused = None;
    wait_for("the failed deletion to poison the store", || {
        match s.put(b"k5", b"later", 0) {
            Ok(_) => false,
            Err(e) => {
                refused = Some(e);
                true
            }
        }
    });
    let refused = refused.unwrap();
    assert!(
        matches!(refused, keel_mvcc::MvccError::Poisoned { .. })
            && refused.to_string().contains("injected commit failure"),
        "a put after the failed deletion: {refused}"
    );
    assert!(matches!(
        s.force_commit(),
        Err(keel_mvcc::MvccError::Poisoned { .. })
    ));
    assert!(matches!(
        s.compact(100),
        Err(keel_mvcc::MvccError::Poisoned { .. })
    ));
    // Nothing was deleted, and reads above the compaction point still work.
    assert_eq!(s.backend().mem.len(&KEY_BUCKET), 103);
    let r = s.range(&RangeRequest::key(b"k5".to_vec()).at(95)).unwrap();
    assert_eq!(r.kvs[0].value(), b"8");
}

/// A read of what to delete that fails (all reader slots taken, say) is tried again after a
/// pause, and the deletion finishes once reads work again.
#[test]
fn a_failed_read_of_what_to_delete_is_tried_again_after_a_pause() {
    use std::sync::atomic::Ordering;
    let (_d, s) = faulty_store();
    s.backend().failing_reads.store(3, Ordering::Release);
    let t0 = Instant::now();
    s.compact(95).unwrap();
    // Kept: per key its last put <= 95 (10), the puts 96..=100 and tombstones 101..=103.
    wait_for("physical compaction", || {
        s.backend().mem.len(&KEY_BUCKET) == 18
    });
    let took = t0.elapsed();
    assert_eq!(s.backend().failing_reads.load(Ordering::Acquire), 0);
    assert!(s.backend().reads_tried.load(Ordering::Acquire) >= 4);
    // Three pauses, of 10, 20 and 40 ms: tried again after a pause, not at once.
    assert!(
        took >= Duration::from_millis(70),
        "three failed reads and the deletion took {took:?}"
    );
    s.put(b"k5", b"later", 0).unwrap();
    s.force_commit().unwrap();
}

/// Reads that keep failing are tried a bounded number of times, pausing longer each time,
/// then the job is given up without poisoning the store; the next compaction deletes what it
/// would have.
#[test]
fn reads_that_keep_failing_give_the_deletion_up_until_the_next_compaction() {
    use std::sync::atomic::Ordering;
    let (_d, s) = faulty_store();
    let b = s.backend();
    b.failing_reads.store(u64::MAX, Ordering::Release);
    let t0 = Instant::now();
    s.compact(95).unwrap();
    wait_for("eight tries", || b.reads_tried.load(Ordering::Acquire) >= 8);
    let took = t0.elapsed();
    // Pauses of 10, 20, 40, …, 640 ms between the eight.
    assert!(
        took >= Duration::from_millis(1270),
        "eight tries in {took:?}"
    );
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        b.reads_tried.load(Ordering::Acquire),
        8,
        "tried again after giving up"
    );
    assert_eq!(b.mem.len(&KEY_BUCKET), 103);
    s.put(b"k5", b"later", 0).unwrap();
    b.failing_reads.store(0, Ordering::Release);
    s.compact(103).unwrap();
    // Kept: the live keys' last puts, and k5's put at 104 (above the point).
    wait_for("the next compaction", || b.mem.len(&KEY_BUCKET) == 8);
}

/// The tries and the first pause are options: three tries 1 and 2 ms apart give up within
/// milliseconds, not the default's 1.3 s.
#[test]
fn the_compactors_read_tries_and_pause_are_options() {
    use std::sync::atomic::Ordering;
    let (_d, s) = faulty_store_with(StoreOptions {
        compaction_read_tries: 3,
        compaction_retry_pause: Duration::from_millis(1),
        ..StoreOptions::default()
    });
    let b = s.backend();
    b.failing_reads.store(u64::MAX, Ordering::Release);
    let t0 = Instant::now();
    s.compact(95).unwrap();
    wait_for("three tries", || b.reads_tried.load(Ordering::Acquire) >= 3);
    assert!(
        t0.elapsed() < Duration::from_millis(1000),
        "{:?}",
        t0.elapsed()
    );
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        b.reads_tried.load(Ordering::Acquire),
        3,
        "tried again after giving up"
    );
    assert_eq!(b.mem.len(&KEY_BUCKET), 103);
    let refused = StoreOptions {
        compaction_read_tries: 0,
        ..StoreOptions::default()
    };
    assert!(matches!(
        refused.validate(),
        Err(keel_mvcc::MvccError::InvalidOption {
            option: "compaction_read_tries",
            ..
        })
    ));
}

/// A shutdown stops the compactor while it pauses before trying a failed read again.
#[test]
fn a_shutdown_stops_a_compactor_pausing_to_try_again() {
    use std::sync::atomic::Ordering;
    let (_d, s) = faulty_store();
    s.backend().failing_reads.store(u64::MAX, Ordering::Release);
    s.compact(95).unwrap();
    // The seventh try failed: the pause before the eighth is 640 ms.
    wait_for("seven tries", || {
        s.backend().reads_tried.load(Ordering::Acquire) >= 7
    });
    let t0 = Instant::now();
    drop(s);
    assert!(
        t0.elapsed() < Duration::from_millis(300),
        "the store took {:?} to shut down",
        t0.elapsed()
    );
}
