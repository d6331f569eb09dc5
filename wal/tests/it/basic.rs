//! Pins down the Raft-shaped API: round trip, rotation, release, conflict truncation, hard
//! state, snapshot markers and metadata across reopen, the directory lock, the durability of
//! the directories an open creates, and typed errors for bad input.

use std::ops::ControlFlow;
use std::sync::Arc;

use keel_wal::{Entry, HardState, Metadata, SnapshotMarker, Wal, WalError, WalOptions};

use crate::util::{FaultFs, entries, entry, segments, small};

#[test]
fn round_trip_and_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let want = entries(1, 201, 3);
    {
        let wal = Wal::open(dir.path(), small()).unwrap();
        assert_eq!((wal.first_index(), wal.last_index()), (1, 0));
        for chunk in want.chunks(7) {
            wal.append(chunk, None, true).unwrap();
        }
        assert_eq!(wal.last_index(), 200);
        assert_eq!(wal.entries(1, 201, None).unwrap(), want);
        assert_eq!(wal.term(150).unwrap(), Some(3));
    }
    let wal = Wal::open(dir.path(), small()).unwrap();
    assert_eq!((wal.first_index(), wal.last_index()), (1, 200));
    assert_eq!(wal.entries(1, 201, None).unwrap(), want);
    assert_eq!(wal.entries(50, 60, None).unwrap(), want[49..59].to_vec());
    assert_eq!(wal.term(0).unwrap(), Some(0));
    assert_eq!(wal.term(201).unwrap(), None);
}

#[test]
fn unsynced_appends_are_readable_and_survive_a_clean_close() {
    let dir = tempfile::tempdir().unwrap();
    let want = entries(1, 51, 1);
    {
        let wal = Wal::open(dir.path(), small()).unwrap();
        wal.append(&want, None, false).unwrap();
        assert_eq!(wal.entries(1, 51, None).unwrap(), want);
    }
    let wal = Wal::open(dir.path(), small()).unwrap();
    assert_eq!(wal.entries(1, 51, None).unwrap(), want);
}

#[test]
fn max_bytes_limits_but_returns_at_least_one() {
    let dir = tempfile::tempdir().unwrap();
    let wal = Wal::open(dir.path(), small()).unwrap();
    let e: Vec<Entry> = (1..=10)
        .map(|i| Entry {
            index: i,
            term: 1,
            data: vec![i as u8; 100],
        })
        .collect();
    wal.append(&e, None, true).unwrap();
    assert_eq!(wal.entries(1, 11, Some(0)).unwrap().len(), 1);
    assert_eq!(wal.entries(1, 11, Some(250)).unwrap().len(), 2);
    assert_eq!(wal.entries(1, 11, Some(300)).unwrap().len(), 3);
    assert_eq!(wal.entries(1, 11, None).unwrap().len(), 10);
    assert_eq!(wal.entries(4, 4, None).unwrap().len(), 0);
}

#[test]
fn rotation_keeps_everything_readable() {
    let dir = tempfile::tempdir().unwrap();
    let want = entries(1, 2001, 1);
    {
        let wal = Wal::open(dir.path(), small()).unwrap();
        for chunk in want.chunks(13) {
            wal.append(
                chunk,
                Some(&HardState {
                    term: 1,
                    vote: 2,
                    commit: chunk[0].index,
                }),
                true,
            )
            .unwrap();
        }
        assert!(wal.segment_count() > 3, "{} segments", wal.segment_count());
        assert_eq!(wal.entries(1, 2001, None).unwrap(), want);
    }
    let segs = segments(dir.path());
    assert!(segs.len() > 3);
    let wal = Wal::open(dir.path(), small()).unwrap();
    assert_eq!(wal.entries(1, 2001, None).unwrap(), want);
    assert_eq!(wal.hard_state().unwrap().commit, 1990);
    let mut seen = 0;
    wal.replay(1000, |e| {
        assert_eq!(e.to_entry(), want[(e.index - 1) as usize]);
        seen += 1;
        ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(seen, 1001);
}

#[test]
fn conflict_truncation_replaces_the_suffix() {
    let dir = tempfile::tempdir().unwrap();
    let mut want = entries(1, 301, 1);
    {
        let wal = Wal::open(dir.path(), small()).unwrap();
        wal.append(&want, None, true).unwrap();
        // A new leader overwrites from 120 with a shorter log, then one more entry.
        let new = entries(120, 150, 2);
        wal.append(&new, None, true).unwrap();
        want.truncate(119);
        want.extend(new);
        assert_eq!(wal.last_index(), 149);
        assert_eq!(wal.entries(1, 150, None).unwrap(), want);
        assert!(matches!(
            wal.entries(1, 151, None),
            Err(WalError::Unavailable { .. })
        ));
        wal.append(&[entry(150, 2)], None, true).unwrap();
        want.push(entry(150, 2));
    }
    let wal = Wal::open(dir.path(), small()).unwrap();
    assert_eq!(wal.last_index(), 150);
    assert_eq!(wal.entries(1, 151, None).unwrap(), want);
    assert_eq!(wal.term(119).unwrap(), Some(1));
    assert_eq!(wal.term(120).unwrap(), Some(2));
}

#[test]
fn release_deletes_whole_segments_below_only() {
    let dir = tempfile::tempdir().unwrap();
    let want = entries(1, 3001, 1);
    let wal = Wal::open(dir.path(), small()).unwrap();
    wal.append(&want[..1500], None, true).unwrap();
    for chunk in want[1500..].chunks(100) {
        wal.append(chunk, None, true).unwrap();
    }
    let before = segments(dir.path()).len();
    wal.save_snapshot_marker(&SnapshotMarker {
        index: 2000,
        term: 1,
    })
    .unwrap();
    wal.release_to(2000).unwrap();
    let after = segments(dir.path()).len();
    assert!(after < before, "{after} segments left of {before}");
    let first = wal.first_index();
    assert!(first > 1000 && first <= 2001, "first index {first}");
    assert_eq!(
        wal.entries(first, 3001, None).unwrap(),
        want[first as usize - 1..].to_vec()
    );
    assert!(matches!(
        wal.entries(first - 1, 3001, None),
        Err(WalError::Compacted { .. })
    ));
    drop(wal);
    let wal = Wal::open(dir.path(), small()).unwrap();
    assert_eq!(wal.first_index(), first);
    assert_eq!(wal.last_index(), 3000);
    assert_eq!(
        wal.entries(first, 3001, None).unwrap(),
        want[first as usize - 1..].to_vec()
    );
    assert_eq!(
        wal.snapshot_marker(),
        Some(SnapshotMarker {
            index: 2000,
            term: 1
        })
    );
    // Releasing past the end keeps the active segment and the state.
    wal.set_metadata(&Metadata {
        cluster_id: 7,
        member_id: 9,
    })
    .unwrap();
    wal.release_to(10_000).unwrap();
    assert_eq!(segments(dir.path()).len(), 1);
    drop(wal);
    let wal = Wal::open(dir.path(), small()).unwrap();
    assert_eq!(
        wal.metadata(),
        Some(Metadata {
            cluster_id: 7,
            member_id: 9
        })
    );
    assert_eq!(wal.snapshot_marker().unwrap().index, 2000);
    assert_eq!(wal.last_index(), 3000);
}

#[test]
fn state_records_survive_reopen_and_release() {
    let dir = tempfile::tempdir().unwrap();
    let hs = HardState {
        term: 5,
        vote: 3,
        commit: 40,
    };
    let meta = Metadata {
        cluster_id: 0xc1,
        member_id: 0x3,
    };
    {
        let wal = Wal::open(dir.path(), small()).unwrap();
        wal.set_metadata(&meta).unwrap();
        wal.append(&entries(1, 51, 5), Some(&hs), true).unwrap();
        // Enough to rotate several times; the state must be carried into new segments.
        for i in 0..20 {
            wal.append(&entries(51 + i * 50, 101 + i * 50, 5), None, true)
                .unwrap();
        }
        wal.save_snapshot_marker(&SnapshotMarker {
            index: 900,
            term: 5,
        })
        .unwrap();
        wal.release_to(900).unwrap();
    }
    let wal = Wal::open(dir.path(), small()).unwrap();
    assert_eq!(wal.hard_state(), Some(hs));
    assert_eq!(wal.metadata(), Some(meta));
    assert_eq!(
        wal.snapshot_marker(),
        Some(SnapshotMarker {
            index: 900,
            term: 5
        })
    );
    assert_eq!(wal.last_index(), 1050);
    assert_eq!(wal.term(900).unwrap(), Some(5));
    assert!(wal.first_index() <= 901);
}

#[test]
fn snapshot_marker_past_the_end_allows_a_gap() {
    let dir = tempfile::tempdir().unwrap();
    {
        let wal = Wal::open(dir.path(), small()).unwrap();
        wal.append(&entries(1, 11, 1), None, true).unwrap();
        wal.save_snapshot_marker(&SnapshotMarker {
            index: 100,
            term: 4,
        })
        .unwrap();
        assert_eq!((wal.first_index(), wal.last_index()), (101, 100));
        assert!(matches!(
            wal.entries(5, 6, None),
            Err(WalError::Compacted { .. })
        ));
        assert_eq!(wal.term(100).unwrap(), Some(4));
        wal.append(&entries(101, 111, 4), None, true).unwrap();
        assert!(matches!(
            wal.save_snapshot_marker(&SnapshotMarker { index: 50, term: 1 }),
            Err(WalError::StaleSnapshot { .. })
        ));
    }
    let wal = Wal::open(dir.path(), small()).unwrap();
    assert_eq!((wal.first_index(), wal.last_index()), (101, 110));
    assert_eq!(wal.entries(101, 111, None).unwrap(), entries(101, 111, 4));
    assert!(matches!(
        wal.append(&entries(100, 101, 4), None, true),
        Err(WalError::InvalidAppend { .. })
    ));
}

#[test]
fn bad_appends_and_ranges_are_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let wal = Wal::open(dir.path(), small()).unwrap();
    wal.append(&entries(1, 6, 1), None, true).unwrap();
    let gap = wal.append(&entries(8, 9, 1), None, true).unwrap_err();
    assert!(matches!(gap, WalError::InvalidAppend { .. }), "{gap}");
    assert!(gap.to_string().contains("gap"), "{gap}");
    let mut holes = entries(6, 9, 1);
    holes.remove(1);
    assert!(matches!(
        wal.append(&holes, None, true),
        Err(WalError::InvalidAppend { .. })
    ));
    let zero = wal.append(&[entry(0, 1)], None, true).unwrap_err();
    assert!(matches!(zero, WalError::InvalidAppend { .. }), "{zero}");
    let huge = Entry {
        index: 6,
        term: 1,
        data: vec![0; keel_wal::MAX_PAYLOAD],
    };
    assert!(matches!(
        wal.append(&[huge], None, true),
        Err(WalError::InvalidAppend { .. })
    ));
    assert!(matches!(
        wal.entries(3, 2, None),
        Err(WalError::Unavailable { .. })
    ));
    assert!(matches!(
        wal.entries(1, 8, None),
        Err(WalError::Unavailable { .. })
    ));
    assert_eq!(wal.last_index(), 5);
    let bad = WalOptions {
        segment_size: 100,
        ..WalOptions::default()
    };
    let e = Wal::open(dir.path(), bad).unwrap_err();
    assert!(
        matches!(
            e,
            WalError::InvalidOption {
                field: "segment_size",
                ..
            }
        ),
        "{e}"
    );
    let bad = WalOptions {
        durable_spin: std::time::Duration::from_secs(1),
        ..WalOptions::default()
    };
    let e = Wal::open(dir.path(), bad).unwrap_err();
    assert!(
        matches!(
            e,
            WalError::InvalidOption {
                field: "durable_spin",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn a_second_open_of_the_same_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let wal = Wal::open(dir.path(), small()).unwrap();
    let err = Wal::open(dir.path(), small()).unwrap_err();
    assert!(matches!(err, WalError::Locked { .. }), "{err}");
    assert!(err.to_string().contains("locked"), "{err}");
    drop(wal);
    Wal::open(dir.path(), small()).unwrap();
}

#[test]
fn the_directories_an_open_creates_are_made_durable() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("data").join("wal");
    let (fs, faults) = FaultFs::new();
    let o = WalOptions {
        fs: Arc::new(fs),
        ..small()
    };
    let wal = Wal::open(&dir, o.clone()).unwrap();
    wal.append(&entries(1, 3, 1), None, true).unwrap();
    // Each new directory's entry lives in its parent: without a sync of the parent, a
    // crash can lose the directory, and the acknowledged log with it.
    let synced = faults.dirs_synced.lock().clone();
    for parent in [root.path().to_path_buf(), root.path().join("data")] {
        assert!(
            synced.contains(&parent),
            "{} never synced; synced: {synced:?}",
            parent.display()
        );
    }
    drop(wal);
    // Reopening an existing directory syncs no parent.
    faults.dirs_synced.lock().clear();
    let wal = Wal::open(&dir, o).unwrap();
    assert_eq!(wal.last_index(), 2);
    let synced = faults.dirs_synced.lock().clone();
    assert!(!synced.iter().any(|d| d != &dir), "{synced:?}");
}

#[test]
fn group_commit_shares_syncs_between_threads() {
    let dir = tempfile::tempdir().unwrap();
    let (fs, faults) = crate::util::FaultFs::new();
    let opts = WalOptions {
        fs: std::sync::Arc::new(fs),
        segment_size: 1 << 20,
        ..WalOptions::default()
    };
    let wal = std::sync::Arc::new(Wal::open(dir.path(), opts).unwrap());
    // Each thread appends its own indices in turn under a shared counter so indices stay
    // consecutive.
    let next = std::sync::Arc::new(parking_lot::Mutex::new(1u64));
    let before = faults.syncs.load(std::sync::atomic::Ordering::SeqCst);
    std::thread::scope(|s| {
        for _ in 0..8 {
            let (wal, next) = (wal.clone(), next.clone());
            s.spawn(move || {
                for _ in 0..50 {
                    {
                        let mut n = next.lock();
                        wal.append(&[entry(*n, 1)], None, false).unwrap();
                        *n += 1;
                    }
                    wal.sync().unwrap();
                }
            });
        }
    });
    let syncs = faults.syncs.load(std::sync::atomic::Ordering::SeqCst) - before;
    assert_eq!(wal.last_index(), 400);
    assert!(syncs <= 400, "{syncs} syncs for 400 durable appends");
    let stats = wal.stats();
    assert_eq!(stats.appends, 400);
    assert!(stats.syncs <= syncs, "{stats:?} against {syncs} file syncs");
    assert!(stats.durable_requests <= 400, "{stats:?}");
    assert!(stats.requests_per_sync() >= 1.0, "{stats:?}");
    // Nothing new to make durable: no sync at all.
    let before = faults.syncs.load(std::sync::atomic::Ordering::SeqCst);
    wal.sync().unwrap();
    wal.append(&[], None, true).unwrap();
    assert_eq!(
        faults.syncs.load(std::sync::atomic::Ordering::SeqCst),
        before
    );
    assert_eq!(wal.entries(1, 401, None).unwrap(), entries(1, 401, 1));
}

#[test]
fn a_single_writer_never_waits_for_a_group() {
    let dir = tempfile::tempdir().unwrap();
    let wal = Wal::open(dir.path(), small()).unwrap();
    for i in 1..=50 {
        wal.append(&[entry(i, 1)], None, true).unwrap();
    }
    let stats = wal.stats();
    assert_eq!(stats.appends, 50);
    assert_eq!(stats.durable_requests, 50);
    // Rotations sync the closed segment themselves; every other append has a sync of its own.
    assert_eq!(stats.syncs + stats.rotations, 50, "{stats:?}");
    assert_eq!(stats.gathers, 0, "{stats:?}");
}

/// 8 threads appending durably through a slow disk (5 ms per `fdatasync`), once spinning for
/// the running sync and once parking at once: every append is durable and read back either
/// way, and only the spinning log sees syncs end without parking.
#[test]
fn durable_requests_spin_for_a_running_sync_or_park() {
    for spin in [
        std::time::Duration::from_millis(50),
        std::time::Duration::ZERO,
    ] {
        let dir = tempfile::tempdir().unwrap();
        let (fs, faults) = crate::util::FaultFs::new();
        faults
            .sync_delay_us
            .store(5_000, std::sync::atomic::Ordering::SeqCst);
        let opts = WalOptions {
            fs: std::sync::Arc::new(fs),
            durable_spin: spin,
            ..WalOptions::default()
        };
        let wal = std::sync::Arc::new(Wal::open(dir.path(), opts.clone()).unwrap());
        let next = std::sync::Arc::new(parking_lot::Mutex::new(1u64));
        std::thread::scope(|s| {
            for _ in 0..8 {
                let (wal, next) = (wal.clone(), next.clone());
                s.spawn(move || {
                    for _ in 0..10 {
                        {
                            let mut n = next.lock();
                            wal.append(&[entry(*n, 1)], None, false).unwrap();
                            *n += 1;
                        }
                        wal.sync().unwrap();
                    }
                });
            }
        });
        let stats = wal.stats();
        if spin.is_zero() {
            assert_eq!(stats.spun, 0, "{stats:?}");
        } else {
            assert!(stats.spun > 0, "{stats:?}");
        }
        assert!(stats.requests_per_sync() > 1.0, "{stats:?}");
        drop(wal);
        let wal = Wal::open(dir.path(), opts).unwrap();
        assert_eq!(wal.entries(1, 81, None).unwrap(), entries(1, 81, 1));
    }
}

/// With a slow disk (10 ms per `fdatasync`), 8 threads appending durably in a loop come back
/// within the gather window (5 ms: half the sync time), so syncs serve most of them at once
/// instead of alternating half groups (4 per sync on average without the wait: the threads
/// a sync releases always miss the sync that starts right after it).
#[test]
fn group_commit_gathers_the_previous_group() {
    let dir = tempfile::tempdir().unwrap();
    let (fs, faults) = crate::util::FaultFs::new();
    faults
        .sync_delay_us
        .store(10_000, std::sync::atomic::Ordering::SeqCst);
    let opts = WalOptions {
        fs: std::sync::Arc::new(fs),
        group_commit_wait: std::time::Duration::from_millis(10),
        ..WalOptions::default()
    };
    let wal = std::sync::Arc::new(Wal::open(dir.path(), opts).unwrap());
    let next = std::sync::Arc::new(parking_lot::Mutex::new(1u64));
    std::thread::scope(|s| {
        for _ in 0..8 {
            let (wal, next) = (wal.clone(), next.clone());
            s.spawn(move || {
                for _ in 0..25 {
                    {
                        let mut n = next.lock();
                        wal.append(&[entry(*n, 1)], None, false).unwrap();
                        *n += 1;
                    }
                    wal.sync().unwrap();
                }
            });
        }
    });
    let stats = wal.stats();
    assert_eq!(wal.last_index(), 200);
    assert!(stats.gathers > 0, "{stats:?}");
    assert!(
        stats.requests_per_sync() > 5.0,
        "{:.2} durable requests per sync: {stats:?}",
        stats.requests_per_sync()
    );
    assert_eq!(wal.entries(1, 201, None).unwrap(), entries(1, 201, 1));
}

#[test]
fn replay_from_an_index_reads_no_lower_segment() {
    let dir = tempfile::tempdir().unwrap();
    let (fs, faults) = crate::util::FaultFs::new();
    let opts = WalOptions {
        fs: std::sync::Arc::new(fs),
        ..small()
    };
    let wal = Wal::open(dir.path(), opts).unwrap();
    let want = entries(1, 2001, 1);
    for c in want.chunks(50) {
        wal.append(c, None, true).unwrap();
    }
    let segs = segments(dir.path());
    assert!(segs.len() >= 4);
    faults.reads.lock().clear();
    let mut got = Vec::new();
    wal.replay(1800, |e| {
        got.push(e.to_entry());
        ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(got, want[1799..].to_vec());
    let read = faults.reads.lock().clone();
    assert!(!read.is_empty());
    let lowest = read.iter().min().unwrap().clone();
    let first_seg = segs[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(lowest > first_seg, "replay from 1800 read {lowest}");
    // Stopping early works too.
    let mut n = 0;
    wal.replay(10, |_| {
        n += 1;
        if n == 5 {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    })
    .unwrap();
    assert_eq!(n, 5);
}

#[test]
fn the_first_append_after_reopen_that_does_not_fit_starts_a_new_segment() {
    let o = || WalOptions {
        preallocate: false,
        ..small()
    };
    let e = |i: u64| Entry {
        index: i,
        term: 1,
        data: vec![7; 1000],
    };
    // How many such entries the first segment holds.
    let probe = tempfile::tempdir().unwrap();
    let fit = {
        let wal = Wal::open(probe.path(), o()).unwrap();
        let mut i = 1;
        while wal.segment_count() == 1 {
            wal.append(&[e(i)], None, true).unwrap();
            i += 1;
        }
        i - 2
    };
    let dir = tempfile::tempdir().unwrap();
    {
        let wal = Wal::open(dir.path(), o()).unwrap();
        for i in 1..=fit {
            wal.append(&[e(i)], None, true).unwrap();
        }
        assert_eq!(wal.segment_count(), 1);
    }
    let wal = Wal::open(dir.path(), o()).unwrap();
    wal.append(&[e(fit + 1)], None, true).unwrap();
    assert_eq!(
        wal.segment_count(),
        2,
        "the append did not start a new segment"
    );
    for seg in segments(dir.path()) {
        let len = std::fs::metadata(&seg).unwrap().len();
        assert_eq!(
            len,
            o().segment_size,
            "{} grew past the segment size",
            seg.display()
        );
    }
    drop(wal);
    let wal = Wal::open(dir.path(), o()).unwrap();
    assert_eq!(
        wal.entries(1, fit + 2, None).unwrap(),
        (1..=fit + 1).map(e).collect::<Vec<_>>()
    );
}
