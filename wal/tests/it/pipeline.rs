//! Pins down pipelined durable appends (`WalOptions::pipeline_bytes`: the first half's whole
//! pages written by the log's write thread while the rest is encoded, the rest by the
//! appending thread): the segment files hold exactly the bytes a single direct write
//! leaves, small and unsynced appends take the old path, and a failed write of either part
//! fails the append and poisons the log while everything acknowledged before it stays
//! readable, also after a reopen, which repairs to whole records.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use keel_wal::{Entry, HardState, Wal, WalError, WalOptions};

use crate::util::{FaultFs, Faults, data, segments};

fn opts(fs: &FaultFs, pipeline_bytes: usize) -> WalOptions {
    WalOptions {
        segment_size: 256 << 10,
        pipeline_bytes,
        // Always split at half: the write thread is waited for.
        pipeline_wait: Duration::from_millis(100),
        fs: Arc::new(fs.clone()),
        ..WalOptions::default()
    }
}

/// A direct-write file system (skips the test where direct writes are refused, on tmpfs).
fn direct_fs() -> Option<(FaultFs, Arc<Faults>)> {
    let (fs, faults) = FaultFs::new();
    faults.direct.store(true, Ordering::SeqCst);
    let probe = tempfile::tempdir().unwrap();
    std::fs::write(probe.path().join("p"), b"x").unwrap();
    keel_wal::FileSystem::open_direct(&fs, &probe.path().join("p")).map(|_| (fs, faults))
}

/// `n` entries from `lo` of up to 2000 bytes (about 1 KiB on average, so copied into the
/// write buffer rather than written from their own buffers).
fn batch(lo: u64, n: u64, term: u64) -> Vec<Entry> {
    (lo..lo + n)
        .map(|i| Entry {
            index: i,
            term,
            data: data(i, term, 2000),
        })
        .collect()
}

/// Runs one workload: unsynced appends buffered ahead of synced ones, batches large and
/// small, hard states, rotations. Returns the entries written.
fn workload(wal: &Wal) -> Vec<Entry> {
    let mut want = Vec::new();
    let mut next = 1;
    for round in 0..60u64 {
        if round % 3 == 0 {
            let es = batch(next, 1 + round % 4, 1);
            wal.append(&es, None, false).unwrap();
            next += es.len() as u64;
            want.extend(es);
        }
        let n = [40, 3, 90, 17, 64][round as usize % 5];
        let es = batch(next, n, 1);
        let hs = (round % 2 == 0).then_some(HardState {
            term: 1,
            vote: 1,
            commit: next,
        });
        wal.append(&es, hs.as_ref(), true).unwrap();
        next += n;
        want.extend(es);
    }
    want
}

fn file_bytes(dir: &Path) -> Vec<(String, Vec<u8>)> {
    segments(dir)
        .into_iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect()
}

#[test]
fn pipelined_appends_leave_the_bytes_of_single_writes() {
    let Some((fs, _)) = direct_fs() else {
        return;
    };
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let want = {
        let piped = Wal::open(a.path(), opts(&fs, 16 << 10)).unwrap();
        let single = Wal::open(b.path(), opts(&fs, 0)).unwrap();
        let want = workload(&piped);
        assert_eq!(workload(&single), want);
        let (p, s) = (piped.stats(), single.stats());
        // Every synced append of 16 KiB or more: 48 of 60.
        assert_eq!(p.pipelined, 48, "{p:?}");
        assert!(p.rotations >= 3, "rotations: {}", p.rotations);
        assert_eq!(s.pipelined, 0);
        assert_eq!(s.direct_writes + p.direct_writes, 0);
        // Read back from the live log, then from the files.
        assert_eq!(piped.entries(1, want.len() as u64 + 1, None).unwrap(), want);
        want
    };
    let (fa, fb) = (file_bytes(a.path()), file_bytes(b.path()));
    assert_eq!(fa.len(), fb.len());
    for ((na, ba), (nb, bb)) in fa.iter().zip(&fb) {
        assert_eq!(na, nb);
        assert!(ba == bb, "{na}: the files differ");
    }
    let wal = Wal::open(a.path(), opts(&fs, 16 << 10)).unwrap();
    assert_eq!(wal.entries(1, want.len() as u64 + 1, None).unwrap(), want);
    assert_eq!(wal.hard_state().map(|h| h.vote), Some(1));
}

#[test]
fn small_and_unsynced_appends_are_not_pipelined() {
    let Some((fs, _)) = direct_fs() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let wal = Wal::open(dir.path(), opts(&fs, 64 << 10)).unwrap();
    // Below the threshold, synced.
    wal.append(&batch(1, 20, 1), None, true).unwrap();
    // Above it, not synced (buffered, written later).
    wal.append(&batch(21, 100, 1), None, false).unwrap();
    assert_eq!(wal.stats().pipelined, 0);
    // Above it with what is buffered: pipelined.
    wal.append(&batch(121, 10, 1), None, true).unwrap();
    assert_eq!(wal.stats().pipelined, 1, "{:?}", wal.stats());
    let want = [batch(1, 20, 1), batch(21, 100, 1), batch(121, 10, 1)].concat();
    drop(wal);
    let wal = Wal::open(dir.path(), opts(&fs, 64 << 10)).unwrap();
    assert_eq!(wal.entries(1, 131, None).unwrap(), want);
}

/// Which part of a pipelined append a fault hits.
#[derive(Clone, Copy, PartialEq)]
enum Failing {
    /// The first part (the write thread's): it starts in the page where the records
    /// written so far end.
    First,
    /// The rest (the appending thread's): it starts after that page.
    Second,
}

/// A pipelined append one of whose parts fails: the append fails, the log is poisoned,
/// what was acknowledged stays readable, and a reopen holds every acknowledged entry and at
/// most a prefix of the failed append's, each intact. Returns the last index after the
/// reopen (`None` where direct writes are refused).
fn failed_part(failing: Failing) -> Option<u64> {
    let (fs, faults) = direct_fs()?;
    let dir = tempfile::tempdir().unwrap();
    let wal = Wal::open(dir.path(), opts(&fs, 16 << 10)).unwrap();
    let acked = [batch(1, 40, 1), batch(41, 40, 1)].concat();
    wal.append(&acked[..40], None, true).unwrap();
    wal.append(&acked[40..], None, true).unwrap();
    let before = wal.stats().pipelined;
    assert_eq!(before, 2);
    // Every direct write ends with the page holding the end of the records.
    let page = faults.last_write_end.load(Ordering::SeqCst) - 4096;
    *faults.fail_writes_at.lock() = Some(match failing {
        Failing::First => page..page + 1,
        Failing::Second => page + 1..u64::MAX,
    });
    let failed = batch(81, 64, 1);
    let err = wal.append(&failed, None, true).unwrap_err();
    *faults.fail_writes_at.lock() = None;
    assert!(matches!(err, WalError::Io { .. }), "{err}");
    assert_eq!(wal.stats().pipelined, before + 1, "not pipelined");
    let err = wal.append(&batch(145, 1, 1), None, true).unwrap_err();
    assert!(
        matches!(&err, WalError::Poisoned { reason } if reason.contains("direct write")),
        "{err}"
    );
    assert_eq!(wal.entries(1, 81, None).unwrap(), acked);
    drop(wal);
    let wal = Wal::open(dir.path(), opts(&fs, 16 << 10)).unwrap();
    let last = wal.last_index();
    let all = [acked, failed].concat();
    assert_eq!(
        wal.entries(1, last + 1, None).unwrap(),
        all[..last as usize]
    );
    // The log goes on from there.
    let more = batch(last + 1, 64, 2);
    wal.append(&more, None, true).unwrap();
    drop(wal);
    let wal = Wal::open(dir.path(), opts(&fs, 16 << 10)).unwrap();
    assert_eq!(
        wal.entries(last + 1, last + 65, None).unwrap(),
        more,
        "appends after the repair"
    );
    Some(last)
}

#[test]
fn a_failed_first_part_fails_the_append_and_poisons_the_log() {
    // The first part's pages never reached the file: the append's records start with a
    // hole, so none of them is found.
    if let Some(last) = failed_part(Failing::First) {
        assert_eq!(last, 80);
    }
}

#[test]
fn a_failed_second_part_fails_the_append_and_poisons_the_log() {
    // The first part's whole pages were written: the failed append's entries in them are
    // found (never acknowledged, as after a crash between the writes), but not all.
    if let Some(last) = failed_part(Failing::Second) {
        assert!((81..144).contains(&last), "last index {last}");
    }
}
