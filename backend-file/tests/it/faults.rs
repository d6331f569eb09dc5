//! Fault injection at the I/O seam: any single write or sync that fails, and any write that
//! tears, leaves every acknowledged batch, nothing of the failed one, a poisoned backend that
//! still serves reads, and a store that reopens cleanly.

use std::path::Path;
use std::sync::Arc;

use keel_backend_file::{FaultPlan, FileBackend, FileOptions, Strike, UnpublishedCommit};
use keel_mvcc::{Backend, BackendError, ReadTxn, WriteBatch};

use crate::support::{B, Dump, META_B, dump, summary};

fn options(hook: Option<Arc<FaultPlan>>) -> FileOptions {
    FileOptions {
        segment_size: 64 << 10,
        background_reclaim: false,
        reclaim_min_garbage: 0,
        reclaim_step_bytes: 8 << 10,
        prepare_ahead: false,
        fault_hook: hook.map(|h| h as _),
        ..FileOptions::default()
    }
}

fn batch(i: u32) -> WriteBatch {
    let mut b = WriteBatch::new();
    for j in 0..20u32 {
        b.put(
            &B,
            format!("k{:02}", (i + j) % 50).into_bytes(),
            vec![i as u8; 900],
        );
    }
    b.delete(&B, format!("k{:02}", (i * 3) % 50).into_bytes());
    b.put(&META_B, b"n".to_vec(), i.to_be_bytes().to_vec());
    b
}

/// The scenario: commits that roll segments, a reclaim pass, a defragment, more commits.
/// Returns the state after the last acknowledged step and the first error, if any.
fn scenario(b: &FileBackend) -> (Dump, Option<BackendError>) {
    let mut acked = dump(b);
    for i in 0..12 {
        if let Err(e) = b.commit(&batch(i)) {
            return (acked, Some(e));
        }
        acked = dump(b);
        let step = match i {
            5 => b.reclaim().map(|_| ()),
            8 => b.defragment(),
            _ => Ok(()),
        };
        if let Err(e) = step {
            assert!(dump(b) == acked, "a failed reclaim changes no data");
            return (acked, Some(e));
        }
    }
    (acked, None)
}

/// Number of I/O operations of the scenario, and which of them are writes.
fn count_ops() -> (u64, Vec<u64>) {
    let dir = tempfile::tempdir().unwrap();
    let plan = FaultPlan::count_only();
    let b = FileBackend::open(dir.path(), &options(Some(plan.clone()))).unwrap();
    let (_, err) = scenario(&b);
    assert!(err.is_none());
    (plan.ops(), plan.writes())
}

fn check_after_fault(dir: &Path, plan: Arc<FaultPlan>, what: &str) {
    let b = match FileBackend::open(dir, &options(Some(plan))) {
        Ok(b) => b,
        Err(e) => {
            assert!(
                matches!(e, BackendError::Io { .. }),
                "{what}: open fails with Io: {e}"
            );
            // Nothing was acknowledged; the store must still open.
            let b = FileBackend::open(dir, &options(None)).expect("reopen after failed open");
            assert!(dump(&b).is_empty(), "{what}");
            return;
        }
    };
    let (acked, err) = scenario(&b);
    let err = err.unwrap_or_else(|| panic!("{what}: the injected fault surfaced"));
    assert!(matches!(err, BackendError::Io { .. }), "{what}: {err}");
    // Poisoned: writes refused, reads of committed data still served.
    match b.commit(&batch(77)) {
        Err(BackendError::Poisoned { .. }) => {}
        other => panic!("{what}: expected Poisoned, got {other:?}"),
    }
    assert!(
        b.defragment().is_err(),
        "{what}: defragment refused when poisoned"
    );
    assert!(dump(&b) == acked, "{what}: reads after poisoning");
    let txn = b.read_txn().unwrap();
    drop(b);
    assert_eq!(
        txn.range(&B, &[], None).unwrap().count(),
        acked.get("key").map_or(0, |m| m.len()),
        "{what}: old reader"
    );
    drop(txn);
    let b = FileBackend::open(dir, &options(None)).expect("reopen");
    let got = dump(&b);
    assert!(
        got == acked,
        "{what}: after reopen: {} vs acked {}",
        summary(&got),
        summary(&acked)
    );
    b.check_integrity().unwrap();
    b.commit(&batch(5)).expect("writable after reopen");
}

#[test]
fn every_single_failed_write_or_sync() {
    let (total, _) = count_ops();
    assert!(total > 40, "scenario does {total} I/O operations");
    for op in 0..total {
        let dir = tempfile::tempdir().unwrap();
        let plan = FaultPlan::strike(op, Strike::Fail, false);
        check_after_fault(dir.path(), plan, &format!("fail op {op}"));
    }
}

#[test]
fn every_torn_write_left_in_place() {
    // The torn prefix stays in the file (the undo truncation fails too), as after a crash.
    let (_, writes) = count_ops();
    assert!(writes.len() > 20);
    for op in writes {
        for keep in [1usize, 20, 700] {
            let dir = tempfile::tempdir().unwrap();
            let plan = FaultPlan::strike(op, Strike::Tear(keep), true);
            check_after_fault(dir.path(), plan, &format!("tear op {op} at {keep}"));
        }
    }
}

mod undo {
    use std::path::Path;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    use keel_backend_file::{FaultHook, WriteFault};

    /// Once armed, fails the next sync, then records every truncate and sync after it.
    #[derive(Debug, Default)]
    pub struct FailNextSync {
        pub armed: AtomicBool,
        pub after: Mutex<Vec<&'static str>>,
    }

    impl FaultHook for FailNextSync {
        fn before_write(&self, _: &Path, _: u64, _: usize) -> WriteFault {
            WriteFault::Proceed
        }
        fn before_sync(&self, _: &Path) -> std::io::Result<()> {
            if self.armed.swap(false, Ordering::SeqCst) {
                return Err(std::io::Error::from_raw_os_error(5));
            }
            self.after.lock().unwrap().push("sync");
            Ok(())
        }
        fn before_truncate(&self, _: &Path, _: u64) -> std::io::Result<()> {
            self.after.lock().unwrap().push("truncate");
            Ok(())
        }
    }
}

/// A commit whose sync fails cuts its frame off and syncs the cut before it returns the
/// error: an unsynced cut could be lost with power, and the whole frame, checksum intact,
/// would come back at the next open.
#[test]
fn a_failed_commit_is_cut_off_durably() {
    let dir = tempfile::tempdir().unwrap();
    let hook = Arc::new(undo::FailNextSync::default());
    let b = FileBackend::open(
        dir.path(),
        &FileOptions {
            fault_hook: Some(hook.clone() as _),
            ..options(None)
        },
    )
    .unwrap();
    b.commit(&batch(1)).unwrap();
    hook.after.lock().unwrap().clear();
    hook.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(b.commit(&batch(2)).is_err());
    assert_eq!(*hook.after.lock().unwrap(), ["truncate", "sync"]);
    drop(b);
    let b = FileBackend::open(dir.path(), &options(None)).unwrap();
    let want = {
        let d = tempfile::tempdir().unwrap();
        let only = FileBackend::open(d.path(), &options(None)).unwrap();
        only.commit(&batch(1)).unwrap();
        summary(&dump(&only))
    };
    assert_eq!(summary(&dump(&b)), want);
}

mod map {
    use std::path::Path;
    use std::sync::atomic::{AtomicBool, Ordering};

    use keel_backend_file::{FaultHook, WriteFault};

    /// Once armed, fails the next mapping that is longer than `longer_than` bytes and, if
    /// `name` is set, of the file so named.
    #[derive(Debug, Default)]
    pub struct FailNextMap {
        pub longer_than: u64,
        pub name: Option<&'static str>,
        pub armed: AtomicBool,
    }

    impl FaultHook for FailNextMap {
        fn before_write(&self, _: &Path, _: u64, _: usize) -> WriteFault {
            WriteFault::Proceed
        }
        fn before_sync(&self, _: &Path) -> std::io::Result<()> {
            Ok(())
        }
        fn before_truncate(&self, _: &Path, _: u64) -> std::io::Result<()> {
            Ok(())
        }
        fn before_map(&self, path: &Path, len: u64) -> std::io::Result<()> {
            let named = self
                .name
                .is_none_or(|name| path.file_name().is_some_and(|n| n == name));
            if len > self.longer_than && named && self.armed.swap(false, Ordering::SeqCst) {
                return Err(std::io::Error::from_raw_os_error(12));
            }
            Ok(())
        }
    }
}

/// A failed mapping of the segment a roll has just started poisons the backend: that
/// segment's file already exists, so no later commit may go on in the segment before it
/// (a commit torn there would then lie in a sealed segment, which open refuses).
#[test]
fn a_failed_mapping_of_a_new_segment_poisons() {
    let dir = tempfile::tempdir().unwrap();
    let (b, hook) = open_failing_maps(
        dir.path(),
        map::FailNextMap {
            name: Some("0000000000000002.seg"),
            ..Default::default()
        },
    );
    hook.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut acked = dump(&b);
    let err = (0..10)
        .find_map(|i| match b.commit(&batch(i)) {
            Ok(()) => {
                acked = dump(&b);
                None
            }
            Err(e) => Some(e),
        })
        .expect("a commit rolls to segment 2, whose mapping fails");
    assert!(
        !hook.armed.load(std::sync::atomic::Ordering::SeqCst),
        "the failure was the mapping of segment 2: {err}"
    );
    let mut small = WriteBatch::new();
    small.put(&B, b"small".to_vec(), b"x".to_vec());
    match b.commit(&small) {
        Err(BackendError::Poisoned { reason }) => {
            assert!(reason.contains("mmap"), "{reason}")
        }
        other => panic!("expected Poisoned after the failed roll, got {other:?}"),
    }
    assert!(dump(&b) == acked, "readers keep the acknowledged state");
    drop(b);
    let b = FileBackend::open(dir.path(), &options(None)).unwrap();
    assert!(
        dump(&b) == acked,
        "after reopen: {} vs acked {}",
        summary(&dump(&b)),
        summary(&acked)
    );
    b.check_integrity().unwrap();
    b.commit(&small).expect("writable after reopen");
}

/// A commit whose frame is synced but whose segment cannot be mapped past it (the frame
/// outgrew the segment's mapping) says that the batch is durable but not published, and
/// poisons the backend: later writes are refused, readers keep the state before it, and a
/// reopen finds the batch.
#[test]
fn a_durable_batch_that_cannot_be_published_poisons() {
    let dir = tempfile::tempdir().unwrap();
    let segment = options(None).segment_size;
    let (b, hook) = open_failing_long_maps(dir.path(), segment);
    b.commit(&batch(1)).unwrap();
    let before = dump(&b);
    let mut big = WriteBatch::new();
    big.put(&B, b"big".to_vec(), vec![7; segment as usize + (16 << 10)]);
    hook.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    let err = b.commit(&big).expect_err("the mapping fails");
    let unpublished = unpublished(&err);
    assert_eq!(unpublished.seq, 2, "the batch's sequence number");
    assert!(unpublished.synced, "the batch was synced");
    assert!(err.to_string().contains("durable"), "{err}");
    let chain = error_chain(unpublished);
    assert_eq!(
        chain.matches("Cannot allocate memory").count(),
        1,
        "the mapping error is told once down the chain: {chain}"
    );
    match b.commit(&batch(3)) {
        Err(e @ BackendError::Poisoned { .. }) => {
            let text = e.to_string();
            assert!(text.contains("could not be published"), "{text}");
            assert!(
                !text.contains("reopen the backend); reopen"),
                "reopening is advised once: {text}"
            );
        }
        other => panic!("expected Poisoned, got {other:?}"),
    }
    assert!(
        dump(&b) == before,
        "readers keep the state before the batch"
    );
    drop(b);
    let b = FileBackend::open(dir.path(), &options(None)).unwrap();
    let got = dump(&b);
    assert_eq!(
        got.get("key")
            .and_then(|m| m.get(&b"big"[..]))
            .map(Vec::len),
        Some(segment as usize + (16 << 10)),
        "a reopen finds the durable batch"
    );
    b.check_integrity().unwrap();
}

/// A backend in `dir` whose next mapping longer than `segment` fails once the returned
/// hook is armed.
fn open_failing_long_maps(
    dir: &std::path::Path,
    segment: u64,
) -> (FileBackend, Arc<map::FailNextMap>) {
    open_failing_maps(
        dir,
        map::FailNextMap {
            longer_than: segment,
            ..Default::default()
        },
    )
}

/// A backend in `dir` that consults `hook` before every mapping.
fn open_failing_maps(
    dir: &std::path::Path,
    hook: map::FailNextMap,
) -> (FileBackend, Arc<map::FailNextMap>) {
    let hook = Arc::new(hook);
    let b = FileBackend::open(
        dir,
        &FileOptions {
            fault_hook: Some(hook.clone() as _),
            ..options(None)
        },
    )
    .unwrap();
    (b, hook)
}

/// The UnpublishedCommit inside `err`; panics if it holds none.
fn unpublished(err: &BackendError) -> &UnpublishedCommit {
    let found = match err {
        BackendError::Other(inner) => inner.downcast_ref::<UnpublishedCommit>(),
        _ => None,
    };
    found.unwrap_or_else(|| panic!("expected an UnpublishedCommit error, got {err}"))
}

/// The text of an error and of every error below it, as a chain printer shows them.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        out.push_str(": ");
        out.push_str(&s.to_string());
        next = s.source();
    }
    out
}

/// A restore's batch whose segment cannot be mapped past it fails the restore with an
/// UnpublishedCommit that says to discard the store, not that a reopen finds the batch: the
/// restore's marker stays, and a reopen refuses the store.
#[test]
fn a_restore_batch_that_cannot_be_published_says_to_discard_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let segment = options(None).segment_size;
    let (b, hook) = open_failing_long_maps(dir.path(), segment);
    hook.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    let stream = crate::support::stream(200, 1024);
    let err = b
        .restore(&mut stream.as_slice())
        .expect_err("the mapping fails");
    let unpublished = unpublished(&err);
    assert!(!unpublished.synced, "a restore's batch is not synced");
    let text = unpublished.to_string();
    assert!(text.contains("discard"), "{text}");
    assert!(!text.contains("reopen finds"), "{text}");
    drop(b);
    match FileBackend::open(dir.path(), &options(None)) {
        Err(BackendError::Corrupt { reason, .. }) => {
            assert!(reason.contains("discard"), "{reason}")
        }
        other => panic!(
            "expected the reopen to refuse the store, got {:?}",
            other.map(|_| ())
        ),
    }
}
