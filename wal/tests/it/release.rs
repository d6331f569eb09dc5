//! Pins down what `release_to` may delete: never the only durable copy of the log's state,
//! whatever state the segment kept is in; a release that fails part way leaves nothing
//! behind that a later release would skip; a crash at any point of a release, on a file
//! system that keeps any of the directory changes not yet synced, leaves a log that opens
//! with every entry not released; and a hole in the segment sequence stays an error.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use keel_wal::{HardState, Metadata, SnapshotMarker, Wal, WalError, WalOptions};

use crate::util::{FaultFs, entries, files, segments};

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

/// A change to the directory made by the log, or a sync of the directory, as the file-system
/// seam logged it.
#[derive(Clone, Debug)]
enum DirOp {
    Rename(String, String),
    Remove(String),
    Sync,
}

/// The directory changes and syncs among the operations `ops` logged by a `FaultFs`.
fn dir_ops(ops: &[String]) -> Vec<DirOp> {
    ops.iter()
        .filter_map(|op| {
            let w: Vec<&str> = op.split(' ').collect();
            match w[..] {
                ["rename", from, to] => Some(DirOp::Rename(from.into(), to.into())),
                ["remove", name] => Some(DirOp::Remove(name.into())),
                ["sync_dir", ..] => Some(DirOp::Sync),
                _ => None,
            }
        })
        .collect()
}

/// Every directory a crash could leave of one holding `before` when the operations `ops`
/// were made in it, each as its names, each with the name in `before` of the file it names:
/// for each point the crash may come at, the changes made before the last directory sync up
/// to that point are kept, and of those after it any subset is (a file system may make them
/// durable in any order).
fn crash_states(before: &BTreeSet<String>, ops: &[DirOp]) -> BTreeSet<BTreeMap<String, String>> {
    let apply = |names: &mut BTreeMap<String, String>, op: &DirOp| match op {
        DirOp::Rename(from, to) => {
            if let Some(was) = names.remove(from) {
                names.insert(to.clone(), was);
            }
        }
        DirOp::Remove(name) => {
            names.remove(name);
        }
        DirOp::Sync => {}
    };
    let mut states = BTreeSet::new();
    for k in 0..=ops.len() {
        let done = &ops[..k];
        let synced = done
            .iter()
            .rposition(|op| matches!(op, DirOp::Sync))
            .map_or(0, |i| i + 1);
        let pending = &done[synced..];
        assert!(pending.len() < 16, "{ops:?}");
        for kept in 0..1u32 << pending.len() {
            let mut names: BTreeMap<String, String> =
                before.iter().map(|n| (n.clone(), n.clone())).collect();
            for op in &done[..synced] {
                apply(&mut names, op);
            }
            for (i, op) in pending.iter().enumerate() {
                if kept & (1 << i) != 0 {
                    apply(&mut names, op);
                }
            }
            states.insert(names);
        }
    }
    states
}

/// The first index of segment `path`, from its name.
fn first_index_of(path: &Path) -> u64 {
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    let first = name.trim_end_matches(".wal").split('-').nth(1).unwrap();
    u64::from_str_radix(first, 16).unwrap()
}

/// Releases three segments of a five-segment log (recycling up to `recycle` of them, with
/// or without a snapshot marker covering them) and checks every state a crash during the
/// release could leave on a file system that makes directory changes durable in any order
/// once they are not synced: each opens, strictly (nothing to repair), with the state and
/// every entry from the first one the release kept, identical.
fn crash_during_release(recycle: usize, marker: bool) {
    let ctx = format!("recycle {recycle}, marker {marker}");
    let dir = tempfile::tempdir().unwrap();
    let (fs, faults) = FaultFs::new();
    let o = WalOptions {
        recycle_segments: recycle,
        fs: Arc::new(fs),
        ..opts()
    };
    let meta = Metadata {
        cluster_id: 0xc1,
        member_id: 3,
    };
    let wal = Wal::open(dir.path(), o).unwrap();
    wal.set_metadata(&meta).unwrap();
    let mut next = 1;
    while wal.segment_count() < 5 {
        let hs = HardState {
            term: 2,
            vote: 1,
            commit: next,
        };
        wal.append(&entries(next, next + 20, 2), Some(&hs), true)
            .unwrap();
        next += 20;
    }
    let last = next - 1;
    // An entry a few into segment 3: segments 0, 1 and 2 go.
    let at = first_index_of(&segments(dir.path())[3]) + 3;
    if marker {
        wal.save_snapshot_marker(&SnapshotMarker {
            index: at - 1,
            term: 2,
        })
        .unwrap();
    }
    let before_dir = tempfile::tempdir().unwrap();
    crash_copy(dir.path(), before_dir.path());
    let before: BTreeSet<String> = files(before_dir.path()).into_iter().collect();
    faults.record_ops.store(true, Ordering::SeqCst);
    wal.release_to(at).unwrap();
    faults.record_ops.store(false, Ordering::SeqCst);
    assert_eq!(wal.segment_count(), 2, "{ctx}");
    let kept = wal.first_index();
    assert!(kept <= at, "{ctx}: entry {at} released");
    let want = wal.entries(kept, last + 1, None).unwrap();
    assert_eq!(want, entries(kept, last + 1, 2), "{ctx}");
    let (hs, snapshot) = (wal.hard_state(), wal.snapshot_marker());
    let ops = dir_ops(&faults.ops.lock());
    drop(wal);

    let states = crash_states(&before, &ops);
    assert!(states.len() > 1, "{ctx}: {ops:?}");
    for names in states {
        let crashed = tempfile::tempdir().unwrap();
        for (name, was) in &names {
            std::fs::copy(before_dir.path().join(was), crashed.path().join(name)).unwrap();
        }
        let strict = WalOptions {
            strict: true,
            ..opts()
        };
        let left: Vec<&String> = names.keys().collect();
        let wal = Wal::open(crashed.path(), strict).unwrap_or_else(|e| {
            panic!("{ctx}: a crash during the release left {left:?}: {e}\n{ops:?}")
        });
        assert!(wal.first_index() <= kept, "{ctx}: {left:?}");
        assert_eq!(wal.last_index(), last, "{ctx}: {left:?}");
        assert_eq!(
            wal.entries(kept, last + 1, None).unwrap(),
            want,
            "{ctx}: {left:?}"
        );
        assert_eq!(wal.hard_state(), hs, "{ctx}: {left:?}");
        assert_eq!(wal.metadata(), Some(meta), "{ctx}: {left:?}");
        assert_eq!(wal.snapshot_marker(), snapshot, "{ctx}: {left:?}");
    }
}

#[test]
fn a_crash_during_a_release_leaves_a_log_that_opens() {
    for recycle in [0, 2] {
        for marker in [false, true] {
            crash_during_release(recycle, marker);
        }
    }
}

/// A segment missing between others is an error naming the sequence numbers missing,
/// whether or not a snapshot marker covers what the segment held: a release never leaves a
/// hole, so a hole is damage.
#[test]
fn a_hole_in_the_segment_sequence_is_an_error_naming_the_missing_segment() {
    for marker in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        {
            let wal = Wal::open(dir.path(), opts()).unwrap();
            let mut next = 1;
            while wal.segment_count() < 5 {
                wal.append(&entries(next, next + 20, 1), None, true)
                    .unwrap();
                next += 20;
            }
            if marker {
                let index = first_index_of(&segments(dir.path())[3]);
                wal.save_snapshot_marker(&SnapshotMarker { index, term: 1 })
                    .unwrap();
            }
        }
        let segs = segments(dir.path());
        std::fs::remove_file(&segs[2]).unwrap();
        for strict in [false, true] {
            let o = WalOptions { strict, ..opts() };
            let err = Wal::open(dir.path(), o).unwrap_err();
            let WalError::MissingSegment { reason, .. } = &err else {
                panic!("marker {marker}, strict {strict}: expected MissingSegment, got {err}");
            };
            let name = |p: &Path| p.file_name().unwrap().to_string_lossy().into_owned();
            assert!(reason.contains("2..2"), "{err}");
            assert!(reason.contains(&name(&segs[1])), "{err}");
            assert!(reason.contains(&name(&segs[3])), "{err}");
        }
        assert_eq!(segments(dir.path()).len(), 4, "open changed the segments");
    }
}
