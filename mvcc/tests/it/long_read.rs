//! A long read moves to fresh backend read transactions as it goes (so no backend reader is
//! held for the whole read) and returns exactly what one snapshot would: while writes,
//! backend commits and compactions at or below its revision land, and while a compaction
//! above it waits for the view to close before deleting history.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use keel_mvcc::testing::MemBackend;
use keel_mvcc::{KEY_BUCKET, KeyValue, MvccError, RangeRequest, Store, StoreOptions};

use crate::common::{fresh_path, open_at};

/// More keys than one backend read transaction serves before a view moves on.
const KEYS: u32 = 5_000;

fn key(i: u32) -> Vec<u8> {
    format!("key-{i:06}").into_bytes()
}

fn all() -> RangeRequest {
    RangeRequest::prefix(b"key-".to_vec())
}

fn fill(s: &Store<MemBackend>, round: u32) {
    let mut t = s.write();
    for i in 0..KEYS {
        t.put(&key(i), format!("{round}-{i}").as_bytes(), 0)
            .unwrap();
    }
    t.commit().unwrap();
}

fn expect_round(kvs: &[KeyValue], round: u32, what: &str) {
    assert_eq!(kvs.len(), KEYS as usize, "{what}: key count");
    for (i, kv) in kvs.iter().enumerate() {
        assert_eq!(kv.key(), key(i as u32), "{what}: key order");
        assert_eq!(
            kv.value(),
            format!("{round}-{i}").into_bytes(),
            "{what}: value of key {i}"
        );
    }
}

fn manual() -> StoreOptions {
    StoreOptions {
        batch_interval: Duration::from_secs(3600),
        batch_limit: 1_000_000,
        compaction_sleep_interval: Duration::from_millis(1),
        ..StoreOptions::default()
    }
}

#[test]
fn a_long_read_equals_its_snapshot_while_writes_commits_and_compactions_land() {
    let (_d, path) = fresh_path();
    let s = Arc::new(open_at(&path, manual()));
    fill(&s, 0);
    s.force_commit().unwrap();
    let view = s.read().unwrap();
    let at = view.revision();
    let expected = view.range(&all()).unwrap();
    expect_round(&expected.kvs, 0, "first read");

    // Writers overwrite every key and commit, and history at or below the view is compacted,
    // while the view is read again and again.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (s, stop) = (s.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut round = 1;
            while !stop.load(Ordering::Acquire) && round < 40 {
                fill(&s, round);
                s.force_commit().unwrap();
                if round == 3 {
                    s.compact(at).unwrap();
                }
                round += 1;
            }
            round
        })
    };
    let mut reads = 0;
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline && !writer.is_finished() {
        let again = view.range(&all()).unwrap();
        assert_eq!(again, expected, "read {reads} of the view differs");
        reads += 1;
    }
    stop.store(true, Ordering::Release);
    let rounds = writer.join().unwrap();
    assert!(rounds > 3, "the writer made too little progress");
    assert_eq!(s.compacted_revision(), at);
    assert_eq!(
        view.range(&all()).unwrap(),
        expected,
        "after compacting at the view"
    );
    assert!(reads > 0);

    // A read at the view's revision through a new view agrees too.
    let past = s
        .range(&RangeRequest {
            revision: at,
            ..all()
        })
        .unwrap();
    assert_eq!(
        past.kvs, expected.kvs,
        "a read at the same revision elsewhere"
    );
}

#[test]
fn compaction_above_an_open_view_waits_for_it_before_deleting() {
    let (_d, path) = fresh_path();
    let s = open_at(&path, manual());
    fill(&s, 0);
    let view = s.read().unwrap();
    fill(&s, 1);
    s.force_commit().unwrap();
    let stored = s.backend().len(&KEY_BUCKET);
    assert_eq!(stored, 2 * KEYS as usize);
    s.compact(s.current_revision()).unwrap();
    // Reads at the view's revision are refused from now on, as documented...
    assert!(matches!(
        view.range(&all()),
        Err(MvccError::Compacted { .. })
    ));
    // ...but the history it could still be reading stays until it closes.
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        s.backend().len(&KEY_BUCKET),
        stored,
        "compaction deleted history under an open view"
    );
    drop(view);
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.backend().len(&KEY_BUCKET) != KEYS as usize {
        assert!(Instant::now() < deadline, "compaction never resumed");
        std::thread::sleep(Duration::from_millis(5));
    }
    expect_round(&s.range(&all()).unwrap().kvs, 1, "after compaction");
}

#[test]
fn a_long_read_releases_each_backend_transaction_when_it_moves_on() {
    let (_dir, path) = fresh_path();
    let s = open_at(&path, manual());
    fill(&s, 0);
    s.force_commit().unwrap();
    assert_eq!(s.backend().open_read_txns(), 0, "nothing reads yet");
    s.backend().reset_peak_read_txns();
    let view = s.read().unwrap();
    let r = view.range(&all()).unwrap();
    expect_round(&r.kvs, 0, "the long read");
    // 5 000 records read 1 024 per transaction: five transactions one after the other. The
    // view keeps its latest; each earlier one is dropped when the next is opened, so at most
    // two are ever open at once.
    assert_eq!(
        s.backend().peak_read_txns(),
        2,
        "a long read kept an earlier backend read transaction open"
    );
    assert_eq!(s.backend().open_read_txns(), 1, "the view holds its latest");
    drop(view);
    assert_eq!(
        s.backend().open_read_txns(),
        0,
        "the view released its transaction"
    );
}
