//! Recovery on several threads: it rebuilds exactly what a scan on the opening thread
//! rebuilds, reports the first damage in segment order whichever segment a thread reaches
//! first, and repairs a torn tail of the last segment only.

use std::path::{Path, PathBuf};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use keel_wal::{Entry, HardState, Metadata, SnapshotMarker, Wal, WalError, WalOptions};

use crate::util::{FaultFs, Faults, entries, records, segments};

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
fn build(dir: &Path) -> Seen {
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

/// Recomputes the crc chain of segment `seg` after its bytes were changed on purpose, so
/// the change is whole records rather than damage; returns the crc the segment ends with.
fn reseal(seg: &Path) -> u32 {
    let mut b = std::fs::read(seg).unwrap();
    let mut crc = u32::from_le_bytes(b[28..32].try_into().unwrap());
    for r in records(&b) {
        let mut h = crc32fast::Hasher::new_with_initial(crc);
        h.update(&b[r.offset + 4..r.offset + 8 + r.len]);
        crc = h.finalize();
        b[r.offset..r.offset + 4].copy_from_slice(&crc.to_le_bytes());
    }
    std::fs::write(seg, &b).unwrap();
    crc
}

/// Opens on another thread: `None` if it has not returned within `secs` seconds, else
/// its result or its panic.
fn open_within(
    dir: PathBuf,
    o: WalOptions,
    secs: u64,
) -> Option<std::thread::Result<Result<Wal, WalError>>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Wal::open(&dir, o)));
        let _ = tx.send(r);
    });
    rx.recv_timeout(Duration::from_secs(secs)).ok()
}

fn faulty(threads: usize) -> (WalOptions, Arc<Faults>) {
    let (fs, faults) = FaultFs::new();
    (
        WalOptions {
            fs: Arc::new(fs),
            read_buffer: 4 << 10,
            ..opts(threads)
        },
        faults,
    )
}

fn name_of(p: &Path) -> String {
    p.file_name().unwrap().to_string_lossy().into_owned()
}

/// A whole record (its crc holds) whose snapshot marker is at index u64::MAX cannot be
/// written by any build: it is damage, reported with its place, with one thread or several;
/// and a marker at u64::MAX is refused by the API.
#[test]
fn a_snapshot_marker_at_the_last_index_is_damage() {
    let dir = tempfile::tempdir().unwrap();
    build(dir.path());
    let segs = segments(dir.path());
    let (seg, marker) = segs
        .iter()
        .find_map(|s| {
            let b = std::fs::read(s).unwrap();
            records(&b)
                .into_iter()
                .find(|r| r.ty == 4)
                .map(|r| (s.clone(), r))
        })
        .expect("a segment holds the snapshot marker");
    assert_ne!(
        &seg,
        segs.last().unwrap(),
        "the marker is not in the last segment"
    );
    let mut b = std::fs::read(&seg).unwrap();
    b[marker.offset + 8..marker.offset + 16].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&seg, &b).unwrap();
    // The segments after it chain from what it ends with: only the marker is wrong.
    let end = reseal(&seg);
    let next = &segs[segs.iter().position(|s| *s == seg).unwrap() + 1];
    let mut nb = std::fs::read(next).unwrap();
    let seed = records(&nb)[0].clone();
    nb[seed.offset + 8..seed.offset + 12].copy_from_slice(&end.to_le_bytes());
    std::fs::write(next, &nb).unwrap();
    reseal(next);
    for threads in [1, 2, 4] {
        let r = open_within(dir.path().to_path_buf(), opts(threads), 30)
            .unwrap_or_else(|| panic!("{threads} threads: open did not return"));
        match r {
            Ok(Err(WalError::Corrupt { path, offset, .. })) => {
                assert_eq!(path, seg, "{threads} threads");
                assert_eq!(offset, marker.offset as u64, "{threads} threads");
            }
            Ok(other) => panic!("{threads} threads: {:?}", other.map(|_| ())),
            Err(_) => panic!("{threads} threads: open panicked"),
        }
    }
    let fresh = tempfile::tempdir().unwrap();
    let wal = Wal::open(fresh.path(), opts(1)).unwrap();
    let err = wal
        .save_snapshot_marker(&SnapshotMarker {
            index: u64::MAX,
            term: 1,
        })
        .unwrap_err();
    assert!(matches!(err, WalError::InvalidAppend { .. }), "{err}");
}

/// A broken crc chain at a segment's seed, and a read error further into the same segment:
/// a sequential pass meets the broken chain first, and so does a scan, with one thread or
/// several.
#[test]
fn damage_before_a_read_error_in_one_segment_is_what_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    build(dir.path());
    let segs = segments(dir.path());
    let mut b = std::fs::read(&segs[2]).unwrap();
    let seed = records(&b)[0].clone();
    assert_eq!(seed.ty, 1, "a segment starts with its seed record");
    b[seed.offset + 8] ^= 0xff;
    std::fs::write(&segs[2], &b).unwrap();
    reseal(&segs[2]);
    for threads in [1, 3] {
        let (o, faults) = faulty(threads);
        *faults.fail_read.lock() = Some((name_of(&segs[2]), 32 << 10));
        let err = Wal::open(dir.path(), o).unwrap_err();
        assert!(
            matches!(&err, WalError::Corrupt { path, offset, .. }
                if path == &segs[2] && *offset == seed.offset as u64),
            "{threads} threads: {err}"
        );
    }
}

/// A read error in a segment is reported as such, naming the file, once every record before
/// it was found whole.
#[test]
fn a_read_error_names_its_segment() {
    let dir = tempfile::tempdir().unwrap();
    build(dir.path());
    let segs = segments(dir.path());
    for threads in [1, 3] {
        let (o, faults) = faulty(threads);
        *faults.fail_read.lock() = Some((name_of(&segs[4]), 16 << 10));
        let err = Wal::open(dir.path(), o).unwrap_err();
        assert!(
            matches!(&err, WalError::Io { path, .. } if path == &segs[4]),
            "{threads} threads: {err}"
        );
    }
}

/// A panic scanning a segment after a damaged one: a sequential pass never reaches that
/// segment and reports the damage, and so does a parallel open that scanned ahead.
#[test]
fn a_panic_past_the_first_damage_does_not_replace_it() {
    let dir = tempfile::tempdir().unwrap();
    build(dir.path());
    let segs = segments(dir.path());
    let mut b = std::fs::read(&segs[2]).unwrap();
    let r = records(&b)[3].clone();
    b[r.offset + 8 + r.len / 2] ^= 0x10;
    std::fs::write(&segs[2], &b).unwrap();
    for threads in [1, 2, 4] {
        let (o, faults) = faulty(threads);
        // The damaged segment is read slowly, so a worker opens the next one first.
        *faults.slow_read.lock() = Some(name_of(&segs[2]));
        *faults.panic_open.lock() = Some(name_of(&segs[3]));
        let r = open_within(dir.path().to_path_buf(), o, 60)
            .unwrap_or_else(|| panic!("{threads} threads: open did not return"));
        match r {
            Ok(Err(WalError::Corrupt { path, .. })) => assert_eq!(path, segs[2]),
            Ok(other) => panic!("{threads} threads: {:?}", other.map(|_| ())),
            Err(_) => panic!("{threads} threads: open panicked"),
        }
    }
}

/// A panic scanning a segment the open needs goes on to the caller, with its message,
/// instead of hanging the open.
#[test]
fn a_panic_scanning_a_needed_segment_reaches_the_caller() {
    let dir = tempfile::tempdir().unwrap();
    build(dir.path());
    let segs = segments(dir.path());
    for threads in [1, 2, 4] {
        let (o, faults) = faulty(threads);
        *faults.panic_open.lock() = Some(name_of(&segs[3]));
        let r = open_within(dir.path().to_path_buf(), o, 60)
            .unwrap_or_else(|| panic!("{threads} threads: open did not return"));
        let payload = match r {
            Err(payload) => payload,
            Ok(other) => panic!("{threads} threads: {:?}", other.map(|_| ())),
        };
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .unwrap_or_default();
        assert!(
            message.contains("injected panic opening"),
            "{threads} threads: {message:?}"
        );
    }
}
