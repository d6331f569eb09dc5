//! Pins down what `release_to` may delete: never the only durable copy of the log's state,
//! whatever state the segment kept is in, and a release that fails part way leaves nothing
//! behind that a later release would skip.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use keel_wal::{HardState, Metadata, SnapshotMarker, Wal, WalOptions};

use crate::util::{FaultFs, entries, segments};

fn opts() -> WalOptions {
    WalOptions {
        segment_size: 64 << 10,
        preallocate: false,
        ..WalOptions::default()
    }
}

/// What a crash would leave: the files as they are now (written, synced or not).
fn crash_copy(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn a_release_keeps_the_state_durable_when_the_new_segment_is_not_yet() {
    let dir = tempfile::tempdir().unwrap();
    let hs = HardState {
        term: 4,
        vote: 2,
        commit: 10,
    };
    let meta = Metadata {
        cluster_id: 0xc1,
        member_id: 2,
    };
    let marker = SnapshotMarker { index: 10, term: 4 };
    let wal = Wal::open(dir.path(), opts()).unwrap();
    wal.set_metadata(&meta).unwrap();
    wal.append(&entries(1, 11, 4), Some(&hs), true).unwrap();
    wal.save_snapshot_marker(&marker).unwrap();
    // Appends that are not synced until one of them starts a new segment, whose seed and
    // state records are then only buffered.
    let mut next = 11;
    while wal.segment_count() == 1 {
        wal.append(&entries(next, next + 10, 4), None, false)
            .unwrap();
        next += 10;
    }
    // Every entry and the state are in the new segment: the old one goes.
    wal.release_to(wal.last_index()).unwrap();
    assert_eq!(segments(dir.path()).len(), 1);
    let copy = tempfile::tempdir().unwrap();
    crash_copy(dir.path(), copy.path());
    let reopened = Wal::open(copy.path(), opts()).unwrap();
    assert_eq!(
        reopened.hard_state(),
        Some(hs),
        "acknowledged hard state lost"
    );
    assert_eq!(
        reopened.metadata(),
        Some(meta),
        "acknowledged metadata lost"
    );
    assert_eq!(
        reopened.snapshot_marker(),
        Some(marker),
        "acknowledged marker lost"
    );
    assert_eq!(reopened.first_index(), wal.first_index());
}

#[test]
fn a_release_that_fails_part_way_is_finished_by_the_next_one() {
    for recycle in [0, 2] {
        let dir = tempfile::tempdir().unwrap();
        let (fs, faults) = FaultFs::new();
        let o = WalOptions {
            recycle_segments: recycle,
            fs: Arc::new(fs),
            ..opts()
        };
        let wal = Wal::open(dir.path(), o.clone()).unwrap();
        let mut next = 1;
        while wal.segment_count() < 4 {
            wal.append(&entries(next, next + 20, 1), None, true)
                .unwrap();
            next += 20;
        }
        let last = wal.last_index();
        wal.save_snapshot_marker(&SnapshotMarker {
            index: last,
            term: 1,
        })
        .unwrap();
        faults.fail_release.store(true, Ordering::SeqCst);
        let err = wal.release_to(last).unwrap_err();
        assert!(err.to_string().contains("segment"), "{err}");
        faults.fail_release.store(false, Ordering::SeqCst);
        wal.release_to(last).unwrap();
        drop(wal);
        let wal = Wal::open(dir.path(), o).unwrap_or_else(|e| panic!("recycle {recycle}: {e}"));
        assert_eq!(
            segments(dir.path()).len(),
            1,
            "recycle {recycle}: every released segment is gone"
        );
        assert_eq!(wal.last_index(), last);
        assert_eq!(wal.first_index(), last + 1);
    }
}
