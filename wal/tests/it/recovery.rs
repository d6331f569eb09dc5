//! Recovery on several threads: it rebuilds exactly what a scan on the opening thread
//! rebuilds, reports the first damage in segment order whichever segment a thread reaches
//! first, and repairs a torn tail of the last segment only.

use keel_wal::{Entry, HardState, Metadata, SnapshotMarker, Wal, WalError, WalOptions};

use crate::util::{entries, records, segments};

fn opts(threads: usize) -> WalOptions {
    WalOptions {
        segment_size: 64 << 10,
        preallocate: false,
        recovery_threads: threads,
        ..WalOptions::default()
    }
}

/// Everything an open rebuilds that a caller can see.
#[derive(Debug, PartialEq)]
struct Seen {
    first: u64,
    last: u64,
    entries: Vec<Entry>,
    hard_state: Option<HardState>,
    snapshot: Option<SnapshotMarker>,
    metadata: Option<Metadata>,
}

fn seen(wal: &Wal) -> Seen {
    Seen {
        first: wal.first_index(),
        last: wal.last_index(),
        entries: wal
            .entries(wal.first_index(), wal.last_index() + 1, None)
            .unwrap(),
        hard_state: wal.hard_state(),
        snapshot: wal.snapshot_marker(),
        metadata: wal.metadata(),
    }
}

/// A log over many segments whose later records change what earlier ones said: conflicting
/// appends that replace suffixes reaching back into earlier segments, snapshot markers that
/// drop a prefix, hard states and metadata rewritten along the way.
fn build(dir: &std::path::Path) -> Seen {
    let wal = Wal::open(dir, opts(1)).unwrap();
    wal.set_metadata(&Metadata {
        cluster_id: 7,
        member_id: 1,
    })
    .unwrap();
    for c in entries(1, 2001, 1).chunks(25) {
        wal.append(c, Some(&hs(1, 1, c[0].index)), true).unwrap();
    }
    // A conflict at 1500 replaces 1500..=2000 with term 2 entries.
    for c in entries(1500, 3001, 2).chunks(40) {
        wal.append(c, None, false).unwrap();
    }
    wal.save_snapshot_marker(&SnapshotMarker {
        index: 1000,
        term: 1,
    })
    .unwrap();
    wal.set_metadata(&Metadata {
        cluster_id: 7,
        member_id: 3,
    })
    .unwrap();
    // Single entries, which are entry records rather than batches.
    for e in entries(3001, 3060, 3) {
        wal.append(
            std::slice::from_ref(&e),
            Some(&hs(3, 2, e.index - 5)),
            false,
        )
        .unwrap();
    }
    // A conflict reaching back some segments.
    for c in entries(2900, 4000, 4).chunks(7) {
        wal.append(c, None, false).unwrap();
    }
    wal.sync().unwrap();
    assert!(segments(dir).len() >= 12, "the log spans many segments");
    seen(&wal)
}

fn hs(term: u64, vote: u64, commit: u64) -> HardState {
    HardState { term, vote, commit }
}

#[test]
fn every_number_of_threads_rebuilds_the_same_log() {
    let dir = tempfile::tempdir().unwrap();
    let want = build(dir.path());
    assert_eq!(want.first, 1001);
    assert_eq!(want.last, 3999);
    for threads in [1, 2, 3, 4, 16, 1] {
        let wal = Wal::open(dir.path(), opts(threads)).unwrap();
        assert_eq!(seen(&wal), want, "{threads} recovery threads");
    }
}

/// Damage in two segments: the earlier one is reported, though a thread may reach the later
/// one first, and neither is repaired.
#[test]
fn the_first_damage_in_segment_order_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    build(dir.path());
    let segs = segments(dir.path());
    let damage = |seg: &std::path::Path| {
        let mut bytes = std::fs::read(seg).unwrap();
        let rec = records(&bytes)[2].clone();
        bytes[rec.offset + 8 + rec.len / 2] ^= 0x10;
        std::fs::write(seg, &bytes).unwrap();
        rec.offset as u64
    };
    let later = damage(&segs[segs.len() - 3]);
    let earlier = damage(&segs[2]);
    let before: Vec<_> = segs.iter().map(|s| std::fs::read(s).unwrap()).collect();
    for threads in [1, 2, 4, 8] {
        for round in 0..5 {
            let err = Wal::open(dir.path(), opts(threads)).unwrap_err();
            let WalError::Corrupt { path, offset, .. } = &err else {
                panic!("{threads} threads, round {round}: expected Corrupt, got {err}");
            };
            assert_eq!(path, &segs[2], "{threads} threads, round {round}: {err}");
            assert_eq!(*offset, earlier, "{threads} threads, round {round}");
        }
    }
    let after: Vec<_> = segs.iter().map(|s| std::fs::read(s).unwrap()).collect();
    assert!(before == after, "a failed open changes no segment");
    assert_ne!(later, 0);
}

/// A torn record at the end of the last segment is cut off by a parallel open as by a
/// sequential one, and every entry before it is kept.
#[test]
fn a_torn_last_segment_is_repaired_by_a_parallel_open() {
    let dir = tempfile::tempdir().unwrap();
    let want = build(dir.path());
    let segs = segments(dir.path());
    let last = segs.last().unwrap();
    let mut bytes = std::fs::read(last).unwrap();
    let recs = records(&bytes);
    let tail = recs.last().unwrap().clone();
    // Tear the last record: zero the second half of its payload.
    let cut = tail.offset + 8 + tail.len / 2;
    bytes[cut..tail.offset + 8 + tail.len].fill(0);
    std::fs::write(last, &bytes).unwrap();
    let wal = Wal::open(dir.path(), opts(4)).unwrap();
    let got = seen(&wal);
    assert!(
        got.last < want.last,
        "the torn record's entries are gone: last {}",
        got.last
    );
    assert_eq!(got.entries[..], want.entries[..got.entries.len()]);
    drop(wal);
    // The repair held: a sequential open now finds the same log, whole.
    let again = Wal::open(dir.path(), opts(1)).unwrap();
    assert_eq!(seen(&again), got);
}

#[test]
fn recovery_threads_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    for threads in [0, 65] {
        let err = Wal::open(dir.path(), opts(threads)).unwrap_err();
        assert!(
            matches!(
                err,
                WalError::InvalidOption {
                    field: "recovery_threads",
                    ..
                }
            ),
            "{threads}: {err}"
        );
    }
}
